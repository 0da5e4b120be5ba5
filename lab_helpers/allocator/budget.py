"""The caching allocator on a device of bounded memory: release-and-retry, then out of memory.

When a new segment's cudaMalloc fails, PyTorch's CUDA caching allocator (default settings: no
max_split_size_mb, no garbage_collection_threshold) releases every cached segment that is wholly
free (release_cached_blocks, as empty_cache does) and retries once; if the retry fails too it
raises torch.OutOfMemoryError. `BudgetMixin` replays exactly that against a budget: the bytes the
allocator's segments may add up to (reserved) before cudaMalloc fails. Standard library only.
"""
from lab_helpers.allocator.model import AllocatorModel


MAX_MEMORY_BUDGET_BYTES = 2**50  # a budget above this is refused as a bad input (far above any device)


class OutOfMemory(Exception):
    """The replayed allocator could not get a new segment within its budget, even after releasing
    its wholly free cached segments. Every figure is in bytes, taken at the failing request, after
    the release; `phase` and `index` are set by the code that runs the phases."""

    def __init__(self, request_bytes=None, block_bytes=None, segment_bytes=None, reserved_bytes=None,
                 allocated_bytes=None, budget_bytes=None, released_bytes=None):
        if isinstance(request_bytes, str):  # a message alone (the expandable-segments model raises it so)
            super().__init__(request_bytes)
            request_bytes = None
        else:
            super().__init__(f"{segment_bytes} more bytes needed with {reserved_bytes} reserved of {budget_bytes}")
        self.request_bytes = request_bytes
        self.block_bytes = block_bytes
        self.segment_bytes = segment_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        self.budget_bytes = budget_bytes
        self.released_bytes = released_bytes
        self.phase = None
        self.index = None

    def report(self) -> dict:
        """The out-of-memory outcome as a document's block (a message alone: the figures it gives)."""
        if self.request_bytes is None:
            return {"phase": self.phase, "index": self.index, "message": str(self)}
        return {
            "phase": self.phase, "index": self.index,
            "request_bytes": self.request_bytes,  # as the code asked
            "block_bytes": self.block_bytes,  # rounded to 512 bytes
            "segment_bytes": self.segment_bytes,  # the cudaMalloc that failed ("Tried to allocate")
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "reserved_but_unallocated_bytes": self.reserved_bytes - self.allocated_bytes,
            "budget_bytes": self.budget_bytes,
            "free_under_budget_bytes": self.budget_bytes - self.reserved_bytes,
            "released_before_failing_bytes": self.released_bytes,
        }


class BudgetMixin:
    """Put before an allocator class (`class X(BudgetMixin, SomeAllocator)`): its cudaMalloc of a new
    segment then fails as a device of `budget_bytes` would (None: unbounded, the default).

    It needs of the allocator AllocatorModel's hook `segment_address` (called only when no cached
    free block fits the request, so that the best-fit choice is never changed by the budget) and
    `release_free_segments`. `budget_bytes` may change between phases (the free memory a
    measurement recorded per phase). `releases` lists every release whose retry succeeded: (bytes
    released, reserved after the release); a failed one is the OutOfMemory."""

    budget_bytes = None
    releases = ()

    def release_cached(self) -> int:
        """Return every wholly free segment to the device (cudaFree); the bytes released."""
        released = 0
        for block in self.release_free_segments():
            released += block.size
            self.segment_released(block)
        return released

    def segment_released(self, block) -> None:
        """Called for each segment release_cached gives back (an address model keeps the range)."""

    def segment_address(self, segment_bytes: int, request_bytes: int) -> int:
        budget = self.budget_bytes
        if budget is not None and self.reserved + segment_bytes > budget:
            # no cached block fits (else no segment would be asked for): releasing the wholly free
            # segments changes no choice of block, only what the device has left for this one
            released = self.release_cached()
            if self.reserved + segment_bytes > budget:
                raise OutOfMemory(request_bytes, self.round_size(request_bytes), segment_bytes, self.reserved,
                                  self.allocated, budget, released)
            self.releases = [*self.releases, (released, self.reserved)]  # rare: a new list is cheap
        return super().segment_address(segment_bytes, request_bytes)


class BudgetedAllocatorModel(BudgetMixin, AllocatorModel):
    """AllocatorModel on a device where its reserved bytes may reach `budget_bytes` (None: unbounded)."""

    def __init__(self, budget_bytes=None):
        super().__init__()
        self.budget_bytes = budget_bytes


def measured_budgets(records: list) -> "list | None":
    """The budget each measured phase ran under, from its record (None when a record lacks the
    device's free bytes: a file written before they were recorded).

    A segment's cudaMalloc fails once it exceeds the device's free bytes. Free + reserved is the
    same before and after any cudaMalloc or cudaFree of the allocator, so it changes only when
    memory appears (or goes) outside the allocator: the CUDA context and torch's own set-up before
    the first phase, then, in the phases, cuBLAS/cuBLASLt handles at the first matrix product, the
    cuDNN handle at the first cuDNN attention, every kernel module loaded lazily at its first launch,
    NCCL's buffers. The budget of a phase is the smaller of free + reserved at its start and at its
    end: what the allocator could reach, less everything outside it that had appeared by the end
    of the phase. Memory outside the allocator only grows during a run, so within a phase the true
    figure is at least this one; most of it appears at a phase's first kernels (the first layer of
    a forward), before the large requests that meet the limit."""
    budgets = []
    for record in records:
        figures = [record.get(key) for key in ("baseline_device_free_bytes", "baseline_reserved_bytes",
                                                 "end_device_free_bytes", "end_reserved_bytes")]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in figures):
            return None
        budgets.append(min(figures[0] + figures[1], figures[2] + figures[3]))
    return budgets


UNBOUNDED_NOTE = ("reserved is predicted for an unbounded device: no release of cached segments and no "
                  "out-of-memory error are replayed")


UNRECORDED_NOTE = ("the measurement did not record the device's free bytes (a file written before they were "
                   "recorded), so no release of cached segments and no out-of-memory error are replayed")
