"""The lesson's experiments replayed on the allocator model: the counters a GPU would show, predicted.

pic-vs-reserve.ipynb measures each behaviour of the caching allocator on a GPU. Without one it
shows what this module predicts for the same requests instead, always under PREDICTED_LABEL: an
experiment is a list of steps, each a label and the allocator calls it makes in order, run on
AllocatorModel (default settings) and read after every step as torch.cuda.memory_stats would show it,
per pool too. Nothing here knows a library's own constants (the cuBLAS workspaces): an experiment
that needs them passes them in its steps. Standard library only."""
from lab_helpers.allocator.budget import BudgetedAllocatorModel, OutOfMemory
from lab_helpers.allocator.expandable import CappedExpandableAllocator, PagesOutOfMemory
from lab_helpers.allocator.model import SMALL_REQUEST_MAX_BYTES
from lab_helpers.core.errors import LabError


PREDICTED_LABEL = "predicted, not measured"


POOL_NAMES = ("small_pool", "large_pool")  # the names torch.cuda.memory_stats gives the two pools


def pool_name(small: bool) -> str:
    """The memory_stats name of a pool: "small_pool" (requests up to 1 MiB) or "large_pool"."""
    return POOL_NAMES[0] if small else POOL_NAMES[1]


class LessonAllocator(BudgetedAllocatorModel):
    """The default allocator model (reserved bounded by `budget_bytes`, None: unbounded) that counts,
    per pool, its segments and its reserved and allocated bytes, as memory_stats' `segment.<pool>`,
    `reserved_bytes.<pool>` and `allocated_bytes.<pool>` do."""

    def __init__(self, budget_bytes=None):
        super().__init__(budget_bytes)
        self.pools = {name: {"segments": 0, "reserved": 0, "allocated": 0} for name in POOL_NAMES}

    def segment_address(self, segment_bytes: int, request_bytes: int) -> int:
        address = super().segment_address(segment_bytes, request_bytes)  # may raise OutOfMemory
        pool = self.pools[pool_name(self.round_size(request_bytes) <= SMALL_REQUEST_MAX_BYTES)]
        pool["segments"] += 1
        pool["reserved"] += segment_bytes
        return address

    def malloc(self, request_bytes: int):
        block = super().malloc(request_bytes)
        self.pools[pool_name(block.small)]["allocated"] += block.size
        return block

    def free(self, block) -> None:
        self.pools[pool_name(block.small)]["allocated"] -= block.size  # before free(): merging grows it
        super().free(block)

    def release_free_segments(self) -> list:
        released = super().release_free_segments()
        for block in released:
            pool = self.pools[pool_name(block.small)]
            pool["segments"] -= 1
            pool["reserved"] -= block.size
        return released


def allocator_counters(allocator: LessonAllocator) -> dict:
    """The counters of `allocator` right now: allocated, reserved, their peaks, and per pool its
    segments, reserved and allocated bytes (keys such as "large_pool_segments")."""
    row = {"allocated": allocator.allocated, "reserved": allocator.reserved,
           "max_allocated": allocator.peak_allocated, "max_reserved": allocator.peak_reserved}
    for name, pool in allocator.pools.items():
        for key, value in pool.items():
            row[f"{name}_{key}"] = value
    return row


def replay_steps(steps, allocator: LessonAllocator = None) -> list:
    """Run an experiment's steps on the allocator model; one row per step, its label under "step" and
    the counters after it (allocator_counters).

    `steps` is [(label, [call, ...]), ...]; a call is ("malloc", name, bytes) (a tensor of that many
    bytes, kept under `name` until freed), ("free", name, ...), ("empty_cache",) (every wholly free
    segment goes back to the device) or ("reset_peaks",). `allocator` (a fresh LessonAllocator by
    default) is left in the state after the last step."""
    allocator = LessonAllocator() if allocator is None else allocator
    live, rows = {}, []
    for label, calls in steps:
        for call in calls:
            kind, args = call[0], call[1:]
            if kind == "malloc" and len(args) == 2:
                name, nbytes = args
                if name in live:
                    raise LabError(f"step {label!r}: {name!r} is already allocated")
                if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
                    raise LabError(f"step {label!r}: {name!r} needs a whole number of bytes > 0, not {nbytes!r}")
                live[name] = allocator.malloc(nbytes)
            elif kind == "free" and args:
                for name in args:
                    if name not in live:
                        raise LabError(f"step {label!r}: {name!r} is not allocated")
                    allocator.free(live.pop(name))
            elif kind == "empty_cache" and not args:
                allocator.release_free_segments()
            elif kind == "reset_peaks" and not args:
                allocator.reset_peaks()
            else:
                raise LabError(f"step {label!r}: {call!r} is not a call the lesson replays")
        rows.append({"step": label, **allocator_counters(allocator)})
    return rows


def cached_free_blocks(allocator: LessonAllocator) -> dict:
    """The cached free blocks of `allocator`: those of partly used segments ("split_free_bytes",
    "split_free_blocks", memory_stats' `inactive_split_bytes` and `inactive_split`), the largest free
    block, and the bytes of wholly free segments (what empty_cache would give back)."""
    split, whole = [], []
    for pool in allocator.free_blocks.values():
        for block in pool:
            (whole if block.prev is None and block.next is None else split).append(block.size)
    return {"split_free_bytes": sum(split), "split_free_blocks": len(split),
            "largest_free_block": max(split + whole, default=0), "wholly_free_segment_bytes": sum(whole)}


def predict_holes(segment_bytes: int, piece_bytes: int, pieces: int, request_bytes: int, limit_bytes: int) -> dict:
    """The fragmentation experiment under a cap of `limit_bytes` reserved: a tensor of `segment_bytes`
    made and freed (its segment stays cached), `pieces` tensors of `piece_bytes` cut from it, every
    other one freed (the first, the third, ...), then a request of `request_bytes`.

    {"default": {"succeeded", "allocated", "reserved", cached_free_blocks' figures, "out_of_memory"
    (OutOfMemory.report(), or None)}, "expandable": {"succeeded", "allocated", "reserved"}} (the
    second under expandable_segments:True, its figures after the request)."""
    outcome = {}
    for mode in ("default", "expandable"):
        if mode == "default":
            allocator = LessonAllocator(limit_bytes)
        else:
            allocator = CappedExpandableAllocator(limit_bytes)
        allocator.free(allocator.malloc(segment_bytes))
        blocks = [allocator.malloc(piece_bytes) for _ in range(pieces)]
        for block in blocks[::2]:
            allocator.free(block)
        failure = None
        try:
            allocator.malloc(request_bytes)
        except (OutOfMemory, PagesOutOfMemory) as exc:
            failure = exc
        figures = {"succeeded": failure is None, "allocated": allocator.allocated, "reserved": allocator.reserved}
        if mode == "default":
            figures.update(cached_free_blocks(allocator))
            figures["out_of_memory"] = None if failure is None else failure.report()
        outcome[mode] = figures
    return outcome
