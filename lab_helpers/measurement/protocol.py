"""The phase protocol every measuring command follows: synchronize, reset the peaks, run, read the counters."""
import time

from lab_helpers.allocator.history import now_us
from lab_helpers.core.errors import LabError, safe_reason


class PhaseError(Exception):
    """A CUDA failure (out of memory included) during a measured phase: exit code 3."""

    def __init__(self, phase, exc, reason: "str | None" = None):
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        super().__init__(f"phase {phase} failed: {type(exc).__name__}: {first_line[:300]}")
        self.phase = phase
        memory = type(exc).__name__ == "OutOfMemoryError" or "out of memory" in first_line.lower()
        self.reason = reason or ("out_of_memory" if memory else "cuda_error")
        self.message = f"{type(exc).__name__}: {first_line[:300]}"
        # PyTorch's whole out-of-memory line (about 500 characters), whose figures the oom file keeps
        self.error_text = first_line[:2000]
        self.oom_snapshot = None  # set by measure's HistoryRecorder on out-of-memory
        self.oom_snapshot_problem = None

    def report(self) -> dict:
        """The structured failure that `measure --failure-report` writes."""
        return {"kind": "iteragpu-lab measure failure", "phase": self.phase, "reason": self.reason,
                "message": self.message}


def open_device(torch, device) -> None:
    """Make `device` current and create its CUDA context, before anything is measured. Creating it
    takes a few hundred MiB of the device: where other processes hold all but less, or the device is
    in a bad state, it fails, and that is this run's first phase failing (exit 3, no file written)."""
    try:
        torch.cuda.set_device(device)
        torch.cuda.init()
    except RuntimeError as exc:  # torch.AcceleratorError and torch.OutOfMemoryError derive from it
        # a cuda_error even when CUDA says out of memory: nothing of the run is on the device yet, so
        # its size is not the cause (a sweep reads out_of_memory as "this size does not fit")
        raise PhaseError("cuda_context", exc, reason="cuda_error") from None


def import_torch():
    try:
        import torch
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "torch":
            raise LabError(f"torch cannot be imported ({safe_reason(exc)}); measure needs a GPU build of torch")
        raise  # no torch at all: core.cli.run names it and the lab's Python, as for every command
    except Exception as exc:
        raise LabError(f"torch cannot be imported ({safe_reason(exc)}); measure needs a GPU build of torch")
    return torch


def run_phase(torch, device, name, action, index=None, passes=0, history=None, failed_as=None):
    """Run `action` as one phase, as every measuring command measures it; return (record, what action returned). With a HistoryRecorder
    `history`, mark the phase on the trace's clock (between the synchronizations) and on failure
    let it save the allocator's state. A failure names the phase `failed_as` (default `name`)."""
    torch.cuda.synchronize(device)
    baseline_allocated = torch.cuda.memory_allocated(device)
    baseline_reserved = torch.cuda.memory_reserved(device)
    # What the allocator faces: a new segment's cudaMalloc fails past the device's free bytes, so
    # the replay's budget is free + reserved, less what appears outside the allocator later
    # (lab_helpers.allocator.budget, device_budgets). Read before and after every phase: the
    # first matrix product, cuDNN attention and lazily loaded kernels take memory outside it.
    baseline_free = int(torch.cuda.mem_get_info(device)[0])
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_us = now_us()
    try:
        started = time.perf_counter()
        start.record()
        result = action()
        end.record()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        device_seconds = start.elapsed_time(end) / 1000.0  # elapsed_time is in ms
    except RuntimeError as exc:  # torch.OutOfMemoryError and CUDA errors derive from it
        error = PhaseError(failed_as or name, exc)
        if history is not None:
            history.mark(name, index, start_us, now_us())
            history.failure(torch, device, error)
        raise error from None
    if history is not None:
        history.mark(name, index, start_us, now_us())
    stats = torch.cuda.memory_stats(device)
    end_free = int(torch.cuda.mem_get_info(device)[0])
    record = {
        "phase": name, "index": index, "passes": passes,
        "seconds": seconds, "device_seconds": device_seconds,
        "baseline_allocated_bytes": baseline_allocated,
        "baseline_reserved_bytes": baseline_reserved,
        "end_allocated_bytes": stats["allocated_bytes.all.current"],
        "end_reserved_bytes": stats["reserved_bytes.all.current"],
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
        "baseline_device_free_bytes": baseline_free,
        "end_device_free_bytes": end_free,
    }
    return record, result
