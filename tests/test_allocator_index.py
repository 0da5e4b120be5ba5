"""The indexed allocator model (best fit by bisection, linked neighbours) against the list-scanning
implementation it replaced, kept here as the exact reference: the same requests give the same
blocks, counters, free blocks and address holes after every call."""
import random
from dataclasses import dataclass

import pytest

from lab_helpers.allocator.addressed import AddressedAllocator, CappedAllocator
from lab_helpers.allocator.addresses import DriverAddresses
from lab_helpers.allocator.budget import OutOfMemory
from lab_helpers.allocator.model import AllocatorModel, MIN_BLOCK_BYTES, SMALL_REQUEST_MAX_BYTES

MIB = 2**20


@dataclass(eq=False)
class ReferenceBlock:
    size: int
    address: int
    segment: list
    small: bool
    free: bool = True


class ReferenceAllocator:
    """The former AllocatorModel: every free block in one list per pool, scanned for the best fit."""

    round_size = staticmethod(AllocatorModel.round_size)
    segment_size = staticmethod(AllocatorModel.segment_size)

    def __init__(self):
        self.free_blocks = {True: [], False: []}
        self.next_address = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, request_bytes):
        size = self.round_size(request_bytes)
        small = size <= SMALL_REQUEST_MAX_BYTES
        pool = self.free_blocks[small]
        fits = [b for b in pool if b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.address))
            pool.remove(block)
        else:
            total = self.segment_size(size)
            block = ReferenceBlock(total, self.next_address, [], small)
            block.segment.append(block)
            self.next_address += total
            self.reserved += total
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_MAX_BYTES:
            rest = ReferenceBlock(remaining, block.address + size, block.segment, small)
            block.segment.insert(block.segment.index(block) + 1, rest)
            pool.append(rest)
            block.size = size
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block):
        self.allocated -= block.size
        block.free = True
        pool, segment = self.free_blocks[block.small], block.segment
        i = segment.index(block)
        for j in (i + 1, i - 1):
            if 0 <= j < len(segment) and segment[j].free:
                neighbour = segment.pop(j)
                pool.remove(neighbour)
                block.size += neighbour.size
                block.address = min(block.address, neighbour.address)
        pool.append(block)

    def reset_peaks(self):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


class ReferenceAddressed(ReferenceAllocator):
    """The reference with the driver's address order (lab_helpers.allocator.addresses, shared: the
    index is what is checked): segments moved into place after the base class made them."""

    def __init__(self):
        super().__init__()
        self.addresses = DriverAddresses()

    def malloc(self, request_bytes):
        reserved, base = self.reserved, self.next_address
        block = super().malloc(request_bytes)
        grown = self.reserved - reserved
        if grown:
            start = self.addresses.map(grown)
            for member in block.segment:
                member.address += start - base
            self.next_address = base
        return block

    def give_back(self, block):
        self.addresses.release(block.address, block.size)


class ReferenceCapped(ReferenceAddressed):
    def __init__(self, capacity_bytes):
        super().__init__()
        self.capacity_bytes = capacity_bytes

    def malloc(self, request_bytes):
        size = self.round_size(request_bytes)
        small = size <= 2**20
        if not any(b.size >= size for b in self.free_blocks[small]):
            segment = self.segment_size(size)
            if self.reserved + segment > self.capacity_bytes:
                for pool in self.free_blocks.values():
                    for block in [b for b in pool if len(b.segment) == 1]:
                        pool.remove(block)
                        self.reserved -= block.size
                        self.give_back(block)
                if self.reserved + segment > self.capacity_bytes:
                    raise OutOfMemory("reference")
        return super().malloc(request_bytes)


def state(alloc) -> tuple:
    """Counters, and each free block with the blocks of its segment (each segment walked once: a
    segment of thousands of blocks would make a walk per free block quadratic)."""
    segments = {}  # id of a block -> its segment's (size, address, free) tuple

    def segment_of(block):
        if id(block) not in segments:
            members = block.segment
            shape = tuple((m.size, m.address, m.free) for m in members)
            segments.update((id(m), shape) for m in members)
        return segments[id(block)]

    pools = tuple(sorted((b.size, b.address, segment_of(b)) for b in alloc.free_blocks[small])
                  for small in (True, False))
    addresses = getattr(alloc, "addresses", None)
    return (alloc.allocated, alloc.reserved, alloc.peak_allocated, alloc.peak_reserved, pools,
            None if addresses is None else (addresses.top, sorted(addresses.holes), sorted(addresses.room)))


BOUNDARIES = [MIN_BLOCK_BYTES, MIB, 10 * MIB, 20 * MIB, 2 * MIB, 12 * MIB]


def request_size(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.5:  # around a boundary of the rounding, the pools or the segment sizes
        return max(1, rng.choice(BOUNDARIES) + rng.randint(-1024, 1024))
    if kind < 0.75:
        return rng.randint(1, 64 * 1024)
    if kind < 0.95:
        return rng.randint(MIB, 24 * MIB)
    return rng.randint(20 * MIB, 200 * MIB)


def replay(seed: int, steps: int, new, reference, reset_every: int = 97):
    """Drive both allocators with one random sequence; compare after every call."""
    rng = random.Random(seed)
    ours, theirs = new(), reference()
    live = []
    for step in range(steps):
        if live and rng.random() < 0.45:
            i = rng.randrange(len(live))
            a, b = live.pop(i)
            ours.free(a)
            theirs.free(b)
        else:
            n = request_size(rng)
            try:
                b = theirs.malloc(n)
            except OutOfMemory:
                with pytest.raises(OutOfMemory):
                    ours.malloc(n)
            else:
                a = ours.malloc(n)
                assert (a.size, a.address) == (b.size, b.address)
                live.append((a, b))
        if step % reset_every == 0:
            ours.reset_peaks()
            theirs.reset_peaks()
        assert state(ours) == state(theirs), f"seed {seed}, step {step}"
    return ours


@pytest.mark.parametrize("seed", range(6))
def test_indexed_allocator_matches_the_list_scanning_one(seed):
    replay(seed, 1500, AllocatorModel, ReferenceAllocator)


@pytest.mark.parametrize("seed", range(6))
def test_addressed_allocator_matches_the_reference(seed):
    replay(100 + seed, 1500, AddressedAllocator, ReferenceAddressed)


@pytest.mark.parametrize("seed, capacity_mib", [(200, 300), (201, 600), (202, 1200), (203, 250), (204, 2000)])
def test_capped_allocator_matches_the_reference(seed, capacity_mib):
    capacity = capacity_mib * MIB
    replay(seed, 1500, lambda: CappedAllocator(capacity), lambda: ReferenceCapped(capacity))


def test_equal_sizes_go_to_the_lowest_address_and_free_merges_both_neighbours():
    for new, reference in ((AllocatorModel, ReferenceAllocator), (AddressedAllocator, ReferenceAddressed)):
        ours, theirs = new(), reference()
        pairs = []
        for n in [4096] * 20 + [3 * MIB] * 5 + [30 * MIB] * 3 + [11 * MIB] * 2:
            pairs.append((ours.malloc(n), theirs.malloc(n)))
        for i in [1, 3, 2, 0, 7, 5, 6, 21, 23, 22, 25, 27, 26, 29]:  # holes, then merges on both sides
            ours.free(pairs[i][0])
            theirs.free(pairs[i][1])
            assert state(ours) == state(theirs)
        for n in [4096, 8192, 512, 3 * MIB, 30 * MIB, 11 * MIB, 12 * MIB]:
            a, b = ours.malloc(n), theirs.malloc(n)
            assert (a.size, a.address) == (b.size, b.address)
            assert state(ours) == state(theirs)


def test_a_deep_copy_keeps_a_segment_of_thousands_of_blocks():
    import copy
    alloc = AllocatorModel()
    blocks = [alloc.malloc(512) for _ in range(4096)]  # one 2 MiB segment, 4096 blocks
    for block in blocks[::2]:
        alloc.free(block)  # 2048 free blocks, each between two allocated ones
    copied = copy.deepcopy(alloc)
    assert state(copied) == state(alloc)
    alloc.free(blocks[11])
    assert copied.allocated == 2048 * 512 and alloc.allocated == 2047 * 512
    assert len(copied.free_blocks[True]) == 2048 and len(alloc.free_blocks[True]) == 2047


def recorded_sequence(seed: int, steps: int) -> list:
    """A random request sequence as replay() takes it: n > 0 requests n bytes, ~i frees request i."""
    rng = random.Random(seed)
    events, live, made = [], [], 0
    for _ in range(steps):
        if live and rng.random() < 0.45:
            events.append(~live.pop(rng.randrange(len(live))))
        else:
            events.append(request_size(rng))
            live.append(made)
            made += 1
    return events


@pytest.mark.parametrize("seed, new, reference", [
    (300, AllocatorModel, ReferenceAllocator), (301, AllocatorModel, ReferenceAllocator),
    (302, AddressedAllocator, ReferenceAddressed), (303, AddressedAllocator, ReferenceAddressed),
    (304, lambda: CappedAllocator(400 * MIB), lambda: ReferenceCapped(400 * MIB)),
    (305, lambda: CappedAllocator(900 * MIB), lambda: ReferenceCapped(900 * MIB))])
def test_replay_of_a_recorded_sequence_matches_call_by_call(seed, new, reference):
    events = recorded_sequence(seed, 3000)
    rng = random.Random(seed)
    ours, theirs = new(), reference()
    ours_blocks, their_blocks = [], []
    at = 0
    while at < len(events):
        chunk = events[at:at + rng.randint(1, 60)]
        at += len(chunk)
        try:
            for event in chunk:
                if event > 0:
                    their_blocks.append(theirs.malloc(event))
                else:
                    theirs.free(their_blocks[~event])
        except OutOfMemory:
            with pytest.raises(OutOfMemory):
                ours.replay(chunk, ours_blocks)
            return
        ours.replay(chunk, ours_blocks)
        assert state(ours) == state(theirs)
        assert [(b.size, b.address) for b in ours_blocks] == [(b.size, b.address) for b in their_blocks]
        if rng.random() < 0.1:
            ours.reset_peaks()
            theirs.reset_peaks()
