"""A model of PyTorch's CUDA caching allocator: block rounding, the small and large pools, segments."""
from bisect import bisect_left
from dataclasses import dataclass


MIN_BLOCK_BYTES = 512  # the allocator rounds every request up to a multiple of this


SMALL_REQUEST_MAX_BYTES = 2**20  # requests up to 1 MiB come from the small pool


SMALL_SEGMENT_BYTES = 2 * 2**20  # small-pool segments are 2 MiB


LARGE_SEGMENT_BYTES = 20 * 2**20  # large requests under 10 MiB share 20 MiB segments


MIN_LARGE_ALLOC_BYTES = 10 * 2**20  # from here a segment is the request itself...


ROUND_LARGE_BYTES = 2 * 2**20  # ...rounded up to 2 MiB


# Persistent math-library workspaces allocated at the first matrix product, in
# allocation order. Measured with torch 2.11.0+cu130 on an NVIDIA H200: a 32 MiB
# cuBLAS workspace (PyTorch's default on compute capability 9.0, 4096 * 8 KiB)
# then a 1 MiB block (cuBLASLt's default workspace is 1024 KiB).
DEFAULT_WORKSPACE_BYTES = (32 * 2**20, 2**20)


DEFAULT_WORKSPACE_SOURCE = "measured default: torch 2.11.0+cu130 on NVIDIA H200 (compute capability 9.0)"


@dataclass(eq=False, slots=True)
class _Block:
    """A block of a segment, linked to its neighbours in address order."""

    size: int
    address: int
    small: bool
    free: bool = True
    # the neighbours in address order, a _Block or None (a string annotation breaks dataclasses in
    # exec'd notebook code)
    prev: object = None
    next: object = None

    @property
    def segment(self) -> list:
        """The blocks of its segment, in address order."""
        head = self
        while head.prev is not None:
            head = head.prev
        members = []
        while head is not None:
            members.append(head)
            head = head.next
        return members

    def __deepcopy__(self, memo):
        # a segment's chain is copied in one loop, not by recursion (a small segment may hold
        # thousands of blocks, more than Python's recursion limit)
        chain = self.segment
        copies = [memo.get(id(b)) or _Block(b.size, b.address, b.small, b.free) for b in chain]
        for i, (b, c) in enumerate(zip(chain, copies)):
            memo[id(b)] = c
            c.prev = copies[i - 1] if i else None
            c.next = copies[i + 1] if i + 1 < len(copies) else None
        return memo[id(self)]


# A pool's free blocks are kept sorted by one integer key, size then address, so that best fit
# (the smallest block that fits, then the lowest address) is one bisection.
ADDRESS_BITS = 62
ADDRESS_BIAS = 2**61  # addresses lie in [-2^61, 2^61): segments grow up from 0, or down from 0


def _pool_key(block: _Block) -> int:
    return (block.size << ADDRESS_BITS) | (block.address + ADDRESS_BIAS)


class FreePool:
    """The cached free blocks of one pool, sorted by (size, address); iterates over the blocks."""

    def __init__(self):
        self.keys = []
        self.blocks = []

    def __iter__(self):
        return iter(list(self.blocks))

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, block: _Block) -> None:
        key = _pool_key(block)
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.blocks.insert(i, block)

    def remove(self, block: _Block) -> None:
        i = bisect_left(self.keys, _pool_key(block))
        del self.keys[i]
        del self.blocks[i]

    def take_best_fit(self, size: int) -> "_Block | None":
        """Remove and return the smallest free block of at least `size` bytes, the lowest address
        among equal sizes; None when no block is that large."""
        keys = self.keys
        i = bisect_left(keys, size << ADDRESS_BITS)
        if i == len(keys):
            return None
        del keys[i]
        return self.blocks.pop(i)

    def has_fit(self, size: int) -> bool:
        return bool(self.keys) and self.keys[-1] >= size << ADDRESS_BITS


class AllocatorModel:
    """Replays PyTorch's CUDA caching allocator (default settings) on request sizes alone."""

    def __init__(self):
        self.free_blocks = {True: FreePool(), False: FreePool()}  # per pool (small?), the cached free blocks
        self.next_address = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    @staticmethod
    def round_size(request_bytes: int) -> int:
        """Bytes the allocator hands out for a request: a multiple of 512, at least 512."""
        return max(MIN_BLOCK_BYTES, -(-request_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)

    @staticmethod
    def segment_size(rounded: int) -> int:
        """Bytes a new segment for a rounded request reserves from the device."""
        if rounded <= SMALL_REQUEST_MAX_BYTES:
            return SMALL_SEGMENT_BYTES
        if rounded < MIN_LARGE_ALLOC_BYTES:
            return LARGE_SEGMENT_BYTES
        return -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES

    def segment_address(self, segment_bytes: int, request_bytes: int) -> int:
        """The address of a new segment of `segment_bytes` (cudaMalloc), made for a request of
        `request_bytes` that no cached block fits: here each one right after the last, on a device
        that never runs out (a subclass may give another address, or fail here)."""
        address = self.next_address
        self.next_address += segment_bytes
        return address

    def has_free_block(self, rounded: int) -> bool:
        """Whether a cached free block of at least `rounded` bytes exists in its pool."""
        return self.free_blocks[rounded <= SMALL_REQUEST_MAX_BYTES].has_fit(rounded)

    def malloc(self, request_bytes: int) -> _Block:
        """Allocate; return the block to pass to free()."""
        size = MIN_BLOCK_BYTES if request_bytes <= MIN_BLOCK_BYTES else -(-request_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES
        small = size <= SMALL_REQUEST_MAX_BYTES
        pool = self.free_blocks[small]
        block = pool.take_best_fit(size)  # best fit: the smallest block, then the lowest address
        if block is None:  # a new segment (cudaMalloc)
            total = self.segment_size(size)
            block = _Block(total, self.segment_address(total, request_bytes), small)
            self.reserved += total
            if self.reserved > self.peak_reserved:
                self.peak_reserved = self.reserved
        remaining = block.size - size
        # a small block splits if 512 bytes remain; a large one only if over 1 MiB remains
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_MAX_BYTES:
            rest = _Block(remaining, block.address + size, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.add(rest)
            block.size = size
        block.free = False
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: _Block) -> None:
        """Return a block to its pool, merged with its free neighbours in the segment."""
        self.allocated -= block.size
        block.free = True
        pool = self.free_blocks[block.small]
        after = block.next
        if after is not None and after.free:  # the next one first, as the allocator does
            pool.remove(after)
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
        before = block.prev
        if before is not None and before.free:
            pool.remove(before)
            block.size += before.size
            block.address = before.address
            block.prev = before.prev
            if before.prev is not None:
                before.prev.next = block
        pool.add(block)

    def replay(self, events, blocks: list) -> None:
        """Apply a recorded sequence of requests: an event n > 0 is malloc(n), its block appended to
        `blocks`; an event ~i (negative) is free(blocks[i]). The same as calling malloc and free
        one by one (tests/test_allocator_index.py checks it); the common cases are written out here
        because a long run replays millions of events."""
        keep = blocks.append
        if type(self).malloc is not AllocatorModel.malloc or type(self).free is not AllocatorModel.free:
            for event in events:  # a subclass that sees each call
                if event > 0:
                    keep(self.malloc(event))
                else:
                    self.free(blocks[~event])
            return
        pools = self.free_blocks
        small_keys, small_blocks = pools[True].keys, pools[True].blocks
        large_keys, large_blocks = pools[False].keys, pools[False].blocks
        malloc, block_type = self.malloc, _Block
        shift, bias, min_block, small_max = ADDRESS_BITS, ADDRESS_BIAS, MIN_BLOCK_BYTES, SMALL_REQUEST_MAX_BYTES
        # the counters live in locals between two calls of the general path
        allocated, peak = self.allocated, self.peak_allocated
        for event in events:
            if event > 0:
                size = min_block if event <= min_block else -(-event // min_block) * min_block
                small = size <= small_max
                keys, members = (small_keys, small_blocks) if small else (large_keys, large_blocks)
                i = bisect_left(keys, size << shift)
                if i == len(keys):  # a new segment: the general path
                    self.allocated, self.peak_allocated = allocated, peak
                    keep(malloc(event))
                    allocated, peak = self.allocated, self.peak_allocated
                    continue
                del keys[i]
                block = members.pop(i)
                remaining = block.size - size
                if remaining >= min_block if small else remaining > small_max:
                    after = block.next
                    rest = block_type(remaining, block.address + size, small, True, block, after)
                    if after is not None:
                        after.prev = rest
                    block.next = rest
                    key = (remaining << shift) | (rest.address + bias)
                    j = bisect_left(keys, key)
                    keys.insert(j, key)
                    members.insert(j, rest)
                    block.size = size
                block.free = False
                allocated += block.size
                if allocated > peak:
                    peak = allocated
                keep(block)
            else:
                block = blocks[~event]
                allocated -= block.size
                block.free = True
                keys, members = (small_keys, small_blocks) if block.small else (large_keys, large_blocks)
                after = block.next
                if after is not None and after.free:
                    j = bisect_left(keys, (after.size << shift) | (after.address + bias))
                    del keys[j]
                    del members[j]
                    block.size += after.size
                    block.next = after = after.next
                    if after is not None:
                        after.prev = block
                before = block.prev
                if before is not None and before.free:
                    j = bisect_left(keys, (before.size << shift) | (before.address + bias))
                    del keys[j]
                    del members[j]
                    block.size += before.size
                    block.address = before.address
                    block.prev = before = before.prev
                    if before is not None:
                        before.next = block
                key = (block.size << shift) | (block.address + bias)
                j = bisect_left(keys, key)
                keys.insert(j, key)
                members.insert(j, block)
        self.allocated, self.peak_allocated = allocated, peak

    def release_free_segments(self) -> list:
        """Return every wholly free segment to the device (cudaFree); the released blocks, small
        pool first, each pool's in (size, address) order."""
        released = []
        for pool in self.free_blocks.values():
            for block in [b for b in pool if b.prev is None and b.next is None]:
                pool.remove(block)
                self.reserved -= block.size
                released.append(block)
        return released

    def reset_peaks(self) -> None:
        """Restart the peaks from the current values, as reset_peak_memory_stats does."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
