"""A fine-tuning run's allocator calls recorded once and replayed under any capacity: `fit --card --task
train` asks one run under each GPU model's budget, and each capped prediction traced the run again.

The trace on meta asks the allocator model for the same requests whatever it answers (the tracer reads
no counter of it), so the run traced once with no cap, its calls written down in order (each request's
bytes, each release, each empty_cache, where each phase starts and ends), replays through a capped
allocator to the prediction the capped trace makes: the same peaks where it fits, the same
OutOfMemory, in the same phase, where it does not (tests/test_train_replay.py compares both paths
on a table of runs and budgets).
"""
from lab_helpers.allocator.addressed import AddressedAllocator, CappedAllocator
from lab_helpers.allocator.budget import OutOfMemory

_MALLOC, _FREE, _EMPTY_CACHE, _START, _END = range(5)


class RecordingAllocator(AddressedAllocator):
    """The unbounded allocator model a training trace feeds, writing its calls down as it serves them."""

    def __init__(self):
        super().__init__()
        self.calls = []  # (kind, value): bytes of a request, the request number released, a phase
        self.numbers = {}  # id of a live block -> its request number
        self.requests = 0

    def malloc(self, request_bytes: int):
        block = super().malloc(request_bytes)
        self.calls.append((_MALLOC, request_bytes))
        self.numbers[id(block)] = self.requests
        self.requests += 1
        return block

    def free(self, block) -> None:
        self.calls.append((_FREE, self.numbers.pop(id(block))))
        super().free(block)

    def release_free_segments(self) -> list:
        # called by the tracer's empty_cache only (an unbounded allocator never releases by itself),
        # which gives each released block back: the replay does both
        self.calls.append((_EMPTY_CACHE, None))
        return super().release_free_segments()

    def phase_started(self, name: str, index) -> None:
        self.calls.append((_START, (name, index)))

    def phase_ended(self) -> None:
        self.calls.append((_END, None))


class TrainingRequests:
    """The recorded calls of one training run; `overall(capacity_bytes)` replays them."""

    def __init__(self, calls: list):
        self.calls = calls

    def overall(self, capacity_bytes: int) -> dict:
        """{"peak_allocated_bytes", "peak_reserved_bytes"}: the overall peaks of the run under a capped
        allocator, each phase's peaks counted from its start as predict_training_model counts them;
        OutOfMemory, its phase and index set, where the run does not fit."""
        alloc = CappedAllocator(capacity_bytes)
        blocks, phase = [], (None, None)
        overall = {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0}
        for kind, value in self.calls:
            if kind == _MALLOC:
                try:
                    blocks.append(alloc.malloc(value))
                except OutOfMemory as exc:
                    exc.phase, exc.index = phase
                    raise
            elif kind == _FREE:
                alloc.free(blocks[value])
            elif kind == _EMPTY_CACHE:
                for block in alloc.release_free_segments():
                    alloc.give_back(block)
            elif kind == _START:
                phase = value
                alloc.reset_peaks()
            else:
                overall["peak_allocated_bytes"] = max(overall["peak_allocated_bytes"], alloc.peak_allocated)
                overall["peak_reserved_bytes"] = max(overall["peak_reserved_bytes"], alloc.peak_reserved)
        return overall


def record_training(shape, spec) -> tuple:
    """(the prediction document of `spec` with no cap, its TrainingRequests)."""
    from lab_helpers.real.train import predict_training_model
    recorder = RecordingAllocator()
    document = predict_training_model(shape, spec, allocator=recorder)
    return document, TrainingRequests(recorder.calls)
