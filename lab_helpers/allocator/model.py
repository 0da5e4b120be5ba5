"""A model of PyTorch's CUDA caching allocator: block rounding, the small and large pools, segments."""
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


@dataclass(eq=False)
class _Block:
    size: int
    address: int
    segment: list  # the blocks of its segment, in address order
    small: bool
    free: bool = True


class AllocatorModel:
    """Replays PyTorch's CUDA caching allocator (default settings) on request sizes alone."""

    def __init__(self):
        self.free_blocks = {True: [], False: []}  # per pool (small?), the cached free blocks
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

    def malloc(self, request_bytes: int) -> _Block:
        """Allocate; return the block to pass to free()."""
        size = self.round_size(request_bytes)
        small = size <= SMALL_REQUEST_MAX_BYTES
        pool = self.free_blocks[small]
        fits = [b for b in pool if b.size >= size]
        if fits:  # best fit: the smallest block, then the lowest address
            block = min(fits, key=lambda b: (b.size, b.address))
            pool.remove(block)
        else:  # a new segment (cudaMalloc)
            total = self.segment_size(size)
            block = _Block(total, self.next_address, [], small)
            block.segment.append(block)
            self.next_address += total
            self.reserved += total
        remaining = block.size - size
        # a small block splits if 512 bytes remain; a large one only if over 1 MiB remains
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_MAX_BYTES:
            rest = _Block(remaining, block.address + size, block.segment, small)
            block.segment.insert(block.segment.index(block) + 1, rest)
            pool.append(rest)
            block.size = size
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: _Block) -> None:
        """Return a block to its pool, merged with its free neighbours in the segment."""
        self.allocated -= block.size
        block.free = True
        pool, segment = self.free_blocks[block.small], block.segment
        i = segment.index(block)
        for j in (i + 1, i - 1):  # the next one first, so index i stays valid
            if 0 <= j < len(segment) and segment[j].free:
                neighbour = segment.pop(j)
                pool.remove(neighbour)
                block.size += neighbour.size
                block.address = min(block.address, neighbour.address)
        pool.append(block)

    def reset_peaks(self) -> None:
        """Restart the peaks from the current values, as reset_peak_memory_stats does."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
