"""A model of PyTorch's CUDA caching allocator under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.

The rules follow c10/cuda/CUDACachingAllocator.cpp (the same in the generic
c10/core/CachingDeviceAllocator.h of later versions), torch 2.x as shipped in 2.11; the function
named in each comment is the one the rule comes from.

- One expandable segment per pool and stream (find_expandable_block): a virtual range of
  ceil(1.125 x the device's total memory / page) pages, reserved with cuMemAddressReserve, with
  no physical memory until pages are mapped. The small pool (requests <= 1 MiB) maps 2 MiB pages
  (kSmallBuffer), the large pool 20 MiB pages (kLargeBuffer). The 2 MiB / 20 MiB / request-sized
  segment choice of the default allocator (get_allocation_size) is not used.
- memory_reserved() is the bytes mapped (map_block adds, unmap_block subtracts the page-rounded
  range): reserved grows and shrinks in whole pages.
- A request first takes the best free mapped block (get_free_block): the smallest that fits, then
  the lowest address, except that a block whose next neighbour is unmapped counts as "as large as
  it could grow" (its size plus the unmapped range): the search moves on to the next larger block
  while that one's expandable size is smaller.
- When no free block fits (try_allocate_expandable_block): the lowest-addressed unmapped range,
  together with the free mapped block just before it, that adds up to the request; the missing
  bytes are mapped as whole pages right after that free block (map_block), which merges with it.
  In a run that never released memory, that is the end of the segment: it grows at its end.
- Every block splits when at least 512 bytes would remain, in both pools (should_split), so a
  large block's remainder under 1 MiB stays free at its end, where the next request can use it.
- free() merges a block with its free mapped neighbours (free_block, try_merge_blocks); nothing is
  unmapped on free.
- Before an out-of-memory error (malloc: alloc_block, then release_available_cached_blocks, which
  does nothing without max_split_size_mb, then release_cached_blocks and alloc_block again), and on
  torch.cuda.empty_cache(): every free mapped block gives back the whole pages inside it
  (release_blocks, unmap_block, ExpandableSegment::unmap); the part of a page that a live block
  shares stays mapped. A mapping that cannot get all its pages maps none of them
  (ExpandableSegment::map releases the pages it had created).
"""
from dataclasses import dataclass

from lab_helpers.allocator.model import (LARGE_SEGMENT_BYTES, MIN_BLOCK_BYTES, SMALL_REQUEST_MAX_BYTES,
                                         SMALL_SEGMENT_BYTES, AllocatorModel)


SMALL_PAGE_BYTES = SMALL_SEGMENT_BYTES  # kSmallBuffer: the small pool maps 2 MiB pages


LARGE_PAGE_BYTES = LARGE_SEGMENT_BYTES  # kLargeBuffer: the large pool maps 20 MiB pages


# cudaGetDeviceProperties' totalGlobalMem of an NVIDIA H200 (143771 MiB; torch's total_memory, as the
# measurement files record it, not cudaMemGetInfo's 150109880320): it sets the size of the virtual
# range, 8088 pages of 20 MiB (157.97 GiB) for the large pool, beyond which a second segment starts.
H200_TOTAL_MEMORY_BYTES = 143771 * 2**20


class PagesOutOfMemory(Exception):
    """The replayed allocator could not map the pages a request needs within its capacity."""


@dataclass(eq=False)
class _ExpandableBlock:
    size: int
    address: int
    segment: object  # its _ExpandableSegment (a string annotation breaks dataclasses in exec'd notebook code)
    mapped: bool
    free: bool = True

    @property
    def small(self) -> bool:
        return self.segment.small


@dataclass(eq=False)
class _ExpandableSegment:
    small: bool
    page_bytes: int
    base: int
    blocks: list  # in address order, covering the whole virtual range


class ExpandableAllocator:
    """Replays PyTorch's CUDA caching allocator under expandable_segments:True on request sizes alone,
    on a device that never runs out of memory (CappedExpandableAllocator has a capacity)."""

    round_size = staticmethod(AllocatorModel.round_size)

    def __init__(self, total_memory_bytes: int = H200_TOTAL_MEMORY_BYTES):
        self.total_memory_bytes = total_memory_bytes
        self.free_blocks = {True: [], False: []}  # per pool (small?), the free mapped blocks
        self.segments = {True: [], False: []}
        self.next_address = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.retries = 0  # num_alloc_retries: out-of-memory retries after a release
        self.unmapped_bytes = 0  # given back by releases, in all

    # ------------------------------------------------------------------ the public calls
    def malloc(self, request_bytes: int) -> _ExpandableBlock:
        """Allocate; return the block to pass to free()."""
        size = self.round_size(request_bytes)
        small = size <= SMALL_REQUEST_MAX_BYTES
        pool = self.free_blocks[small]
        block = self._best_fit(pool, size)
        if block is not None:
            pool.remove(block)
        else:
            block = self._grow(small, size)
            if block is None:
                self.release_cached()
                self.retries += 1
                block = self._grow(small, size)
                if block is None:
                    raise self._out_of_memory(size)
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES:  # should_split: in both pools under expandable segments
            rest = _ExpandableBlock(remaining, block.address + size, block.segment, True)
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, rest)
            pool.append(rest)
            block.size = size
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _ExpandableBlock) -> None:
        """Return a block to its pool, merged with its free mapped neighbours (free_block)."""
        self.allocated -= block.size
        block.free = True
        for neighbour in self._neighbours(block):
            if neighbour is not None and neighbour.free and neighbour.mapped:
                self._absorb(block, neighbour)
                self.free_blocks[block.small].remove(neighbour)
        self.free_blocks[block.small].append(block)

    def release_cached(self) -> None:
        """Give back every whole page inside a free mapped block, as release_cached_blocks does before an
        out-of-memory error and on torch.cuda.empty_cache(); a segment left wholly unmapped is
        released (release_expandable_segment)."""
        for small in (False, True):  # the large pool first, as release_cached_blocks does
            for block in sorted(self.free_blocks[small], key=lambda b: (b.size, b.address)):
                self._unmap(block)
                if len(block.segment.blocks) == 1 and not block.mapped:  # nothing mapped is left in it
                    self.segments[small].remove(block.segment)

    def reset_peaks(self) -> None:
        """Restart the peaks from the current values, as reset_peak_memory_stats does."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    # --------------------------------------------------------------- the device's capacity
    def _can_map(self, nbytes: int) -> bool:
        """Whether the device has `nbytes` more for new pages (cuMemCreate succeeds)."""
        return True

    def _out_of_memory(self, size: int) -> Exception:
        return PagesOutOfMemory(f"{size} bytes requested, no free block and no pages to map with "
                                f"{self.reserved} reserved")

    # ------------------------------------------------------------------------ the rules
    @staticmethod
    def _neighbours(block: _ExpandableBlock) -> tuple:
        blocks = block.segment.blocks
        i = blocks.index(block)
        return (blocks[i - 1] if i > 0 else None, blocks[i + 1] if i + 1 < len(blocks) else None)

    @staticmethod
    def _absorb(block: _ExpandableBlock, neighbour: _ExpandableBlock) -> None:
        """try_merge_blocks: `block` takes over its neighbour's range; the neighbour disappears."""
        block.segment.blocks.remove(neighbour)
        block.address = min(block.address, neighbour.address)
        block.size += neighbour.size

    def _expandable_size(self, block: _ExpandableBlock) -> int:
        after = self._neighbours(block)[1]
        return block.size + (after.size if after is not None and not after.mapped else 0)

    def _best_fit(self, pool: list, size: int):
        """get_free_block under expandable segments."""
        fits = [b for b in pool if b.size >= size]
        if len(fits) > 1:
            fits.sort(key=lambda b: (b.size, b.address))
            i = 0
            while i + 1 < len(fits) and self._expandable_size(fits[i + 1]) < self._expandable_size(fits[i]):
                i += 1
            return fits[i]
        return fits[0] if fits else None

    def _find_expandable(self, small: bool, size: int) -> _ExpandableBlock:
        """find_expandable_block: the lowest address where free and unmapped ranges add up to `size`
        (from the free block before an unmapped range, when there is one), else a new segment."""
        for segment in self.segments[small]:
            blocks = segment.blocks
            for i, block in enumerate(blocks):
                if block.mapped:
                    continue
                start = i - 1 if i > 0 and blocks[i - 1].free else i
                room, j = 0, start
                while room < size and j < len(blocks) and blocks[j].free:
                    room += blocks[j].size
                    j += 1
                if room >= size:
                    return blocks[start]
        page = SMALL_PAGE_BYTES if small else LARGE_PAGE_BYTES
        address_space = self.total_memory_bytes + self.total_memory_bytes // 8
        virtual = -(-address_space // page) * page
        segment = _ExpandableSegment(small, page, self.next_address, [])
        segment.blocks.append(_ExpandableBlock(virtual, self.next_address, segment, False))
        self.next_address += virtual
        self.segments[small].append(segment)
        return segment.blocks[0]

    def _grow(self, small: bool, size: int):
        """try_allocate_expandable_block: map what the candidate range lacks; None if a mapping fails
        (pages mapped by an earlier step of the same call stay mapped, as in PyTorch)."""
        candidate = self._find_expandable(small, size)
        if not candidate.mapped:
            candidate = self._map(candidate, min(candidate.size, size))
            if candidate is None:
                return None
        while candidate.size < size:
            after = self._neighbours(candidate)[1]  # unmapped: free -> unmapped -> ...
            candidate = self._map(after, min(size - candidate.size, after.size))
            if candidate is None:
                return None
        self.free_blocks[small].remove(candidate)
        return candidate

    def _map(self, block: _ExpandableBlock, size: int):
        """map_block: whole pages from the start of an unmapped block, merged with free mapped neighbours."""
        segment = block.segment
        page = segment.page_bytes
        mapped = -(-size // page) * page  # the block starts on a page: ExpandableSegment::map
        if not self._can_map(mapped):
            return None
        if mapped < block.size:
            rest = _ExpandableBlock(block.size - mapped, block.address + mapped, segment, False)
            segment.blocks.insert(segment.blocks.index(block) + 1, rest)
            block.size = mapped
        block.mapped = True
        pool = self.free_blocks[segment.small]
        for neighbour in self._neighbours(block):
            if neighbour is not None and neighbour.free and neighbour.mapped:
                self._absorb(block, neighbour)
                pool.remove(neighbour)
        pool.append(block)
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _unmap(self, block: _ExpandableBlock) -> None:
        """unmap_block: the whole pages inside a free mapped block; the partial pages at its ends stay
        mapped as free blocks of their own."""
        segment = block.segment
        page = segment.page_bytes
        start, end = block.address - segment.base, block.address - segment.base + block.size
        first, last = -(-start // page), end // page
        if first >= last:
            return
        pool = self.free_blocks[segment.small]
        pool.remove(block)
        blocks = segment.blocks
        before, after = first * page - start, end - last * page
        if before:
            head = _ExpandableBlock(before, block.address, segment, True)
            blocks.insert(blocks.index(block), head)
            pool.append(head)
        if after:
            tail = _ExpandableBlock(after, segment.base + last * page, segment, True)
            blocks.insert(blocks.index(block) + 1, tail)
            pool.append(tail)
        unmapped = (last - first) * page
        block.address, block.size, block.mapped = segment.base + first * page, unmapped, False
        for neighbour in self._neighbours(block):
            if neighbour is not None and not neighbour.mapped:
                self._absorb(block, neighbour)
        self.reserved -= unmapped
        self.unmapped_bytes += unmapped


class CappedExpandableAllocator(ExpandableAllocator):
    """ExpandableAllocator on a device where at most `capacity_bytes` can be reserved (mapped): a
    request that needs pages beyond it first gets every whole free page released (release_cached),
    then is retried, then raises `out_of_memory` (the caller's exception class, so that a search
    that catches its own allocator's error catches this one too)."""

    def __init__(self, capacity_bytes: int, out_of_memory=PagesOutOfMemory,
                 total_memory_bytes: int = H200_TOTAL_MEMORY_BYTES):
        super().__init__(total_memory_bytes)
        self.capacity_bytes = capacity_bytes
        self.out_of_memory = out_of_memory

    def _can_map(self, nbytes: int) -> bool:
        return self.reserved + nbytes <= self.capacity_bytes

    def _out_of_memory(self, size: int) -> Exception:
        return self.out_of_memory(f"{size} bytes requested: no free block, and the pages it needs do not fit "
                                  f"with {self.reserved} reserved of {self.capacity_bytes} "
                                  f"(expandable segments, after releasing every free page)")
