"""Trace once, replay many: a traced run's allocation requests written down as a sequence, and the
allocator model replayed over it as often as a question needs.

A run traced on meta (lab_helpers.real.tracer) asks the allocator for the same requests whatever the
allocator answers, so the requests are recorded once (`RequestRecorder`) and replayed under any
capacity (`replay_rank`). Events are integers: a positive one is a request of that many bytes (its
id is its rank among the requests, from 0), a negative one ~id releases request `id`.

Decode steps repeat: from the second step on, each step's events are those of the step before
plus a constant difference (the key/value tensors grow by one position, a release names the request
of one step later). `expand_decode` checks that on three traced steps and extends the sequence to
any number of steps; where the run's structure does not promise it (`decode_expandable`), every step
is traced.
"""
from dataclasses import dataclass

# decode steps traced when the steps are extended from the traced ones: step 0 (which releases the
# prefill's cache) and three steps whose events must be affine in the step number
TRACED_DECODE_STEPS = 4
# the transformers families whose decode steps were checked to repeat (a full-attention DynamicCache
# with one tensor per layer for keys and one for values, growing by one position per step)
EXPANDABLE_FAMILIES = ("llama", "mistral", "qwen2")


class RequestRecorder:
    """Stands in for the allocator model while a run is traced: numbers every request in order
    and writes the requests and releases down."""

    def __init__(self):
        self.events = []
        self.requests = 0

    def malloc(self, request_bytes: int) -> int:
        self.events.append(request_bytes)
        self.requests += 1
        return self.requests - 1

    def free(self, request_id: int) -> None:
        self.events.append(~request_id)

    def take(self) -> list:
        """The events since the last take()."""
        events, self.events = self.events, []
        return events


@dataclass
class LoadTrace:
    """The model_load phase of one rank: its events and the requests alive after it (the weights)."""

    events: list
    weights: list
    requests: int  # requests made by the end of the load


@dataclass
class RunTrace:
    """The phases after the load of one rank at one (batch, context): each phase as
    (name, index, events released before it starts, its own events)."""

    phases: list
    persistent: list  # ids of the math libraries' workspaces, held for the process's life
    decode_steps: int  # decode steps the phases hold


def decode_expandable(shape) -> bool:
    """Whether the run's decode steps may be extended from traced ones: a family checked to repeat,
    every layer full attention, no sliding window (a window starts cropping mid-run)."""
    raw = shape.raw
    if shape.model_type not in EXPANDABLE_FAMILIES:
        return False
    if raw.get("sliding_window") is not None and (shape.model_type == "mistral" or raw.get("use_sliding_window")):
        return False
    layer_types = raw.get("layer_types")
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        return False
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key) if isinstance(raw.get(key), dict) else {}
        if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
            return False
    return True


def _affine(a: list, b: list, c: list) -> "list | None":
    """The componentwise difference when c - b == b - a (same lengths, the same kind of event at
    every position), else None."""
    if not len(a) == len(b) == len(c):
        return None
    steps = []
    for x, y, z in zip(a, b, c):
        if (x > 0) != (y > 0) or (y > 0) != (z > 0) or z - y != y - x:
            return None
        steps.append(z - y)
    return steps


def decode_template(trace: RunTrace) -> "tuple | None":
    """(events of the last traced step as (pre, own), their differences per step) when the last three
    traced decode steps are affine in the step number, else None."""
    decode = [p for p in trace.phases if p[0] == "decode"]
    if len(decode) < TRACED_DECODE_STEPS:
        return None
    (_, _, pre1, own1), (_, _, pre2, own2), (_, _, pre3, own3) = decode[-3:]
    pre_step, own_step = _affine(pre1, pre2, pre3), _affine(own1, own2, own3)
    if pre_step is None or own_step is None:
        return None
    return (pre3, own3), (pre_step, own_step)


def expand_decode(trace: RunTrace, new_tokens: int) -> "RunTrace | None":
    """The trace extended to `new_tokens` decode steps (the traced ones, then each next step the last
    traced one plus its differences), or None when the traced steps do not repeat so, or when a
    request would shrink to nothing before the last step."""
    if new_tokens <= trace.decode_steps:
        return RunTrace([p for p in trace.phases if p[0] != "decode" or p[1] < new_tokens],
                        trace.persistent, new_tokens)
    template = decode_template(trace)
    if template is None:
        return None
    (pre, own), (pre_step, own_step) = template
    ahead = new_tokens - trace.decode_steps
    for events, steps in ((pre, pre_step), (own, own_step)):
        if any(e > 0 and e + ahead * d <= 0 for e, d in zip(events, steps)):
            return None
    phases = list(trace.phases)
    last = trace.decode_steps - 1
    for step in range(trace.decode_steps, new_tokens):
        j = step - last
        phases.append(("decode", step, [e + j * d for e, d in zip(pre, pre_step)],
                       [e + j * d for e, d in zip(own, own_step)]))
    return RunTrace(phases, trace.persistent, new_tokens)


def _counters(alloc, base_allocated: int, base_reserved: int) -> dict:
    return {"baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved}


def default_allocator(capacity_bytes=None):
    """The replayed allocator under PyTorch's default settings, capped at `capacity_bytes` when given."""
    from lab_helpers.real.tracer import AddressedAllocator, CappedAllocator
    return AddressedAllocator() if capacity_bytes is None else CappedAllocator(capacity_bytes)


def _apply(alloc, events: list, blocks: list) -> None:
    if hasattr(alloc, "replay"):
        alloc.replay(events, blocks)
        return
    for event in events:  # an allocator model without a replay of its own
        if event > 0:
            blocks.append(alloc.malloc(event))
        else:
            alloc.free(blocks[~event])


def replay_rank(load: LoadTrace, run: "RunTrace | None", capacity_bytes, recorded_steps,
                make_allocator=default_allocator) -> dict:
    """The allocator model replayed over one rank's load and run: {"phases": records of the recorded
    phases, "overall": the peaks, "weights_bytes", "workspace_bytes"}. Under `capacity_bytes` the
    allocator is capped (lab_helpers.real.tracer.CappedAllocator: OutOfMemory when it runs out).
    `make_allocator(capacity_bytes)` makes the allocator model (the trace does not depend on it: any
    allocator setting replays the same requests). With run None, the load alone."""
    alloc = make_allocator(capacity_bytes)
    blocks = []
    _apply(alloc, load.events, blocks)
    records = [{"phase": "model_load", "index": None, "passes": 0, **_counters(alloc, 0, 0)}]
    weights_bytes = sum(blocks[i].size for i in load.weights)
    totals = {"peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved}
    recorded = set(recorded_steps)
    for name, index, pre, own in (run.phases if run is not None else ()):
        _apply(alloc, pre, blocks)
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        alloc.reset_peaks()
        _apply(alloc, own, blocks)
        if alloc.peak_allocated > totals["peak_allocated_bytes"]:
            totals["peak_allocated_bytes"] = alloc.peak_allocated
        if alloc.peak_reserved > totals["peak_reserved_bytes"]:
            totals["peak_reserved_bytes"] = alloc.peak_reserved
        if name != "decode" or index in recorded:
            records.append({"phase": name, "index": index, "passes": 1 if name in ("prefill", "decode") else 0,
                            **_counters(alloc, base_allocated, base_reserved)})
    workspace_bytes = sum(blocks[i].size for i in run.persistent if i < len(blocks)) if run is not None else 0
    return {"phases": records, "overall": totals, "weights_bytes": weights_bytes, "workspace_bytes": workspace_bytes}


def trace_load(shape, dtype: str, tensor_parallel: int, mesh) -> tuple:
    """(LoadTrace, the model on meta, its tracer's recorder) of one rank's model_load."""
    import torch

    from lab_helpers.real.protocol import run_protocol
    from lab_helpers.real.spec import RunSpec
    from lab_helpers.real.tracer import AllocationTracer
    recorder = RequestRecorder()
    tracer = AllocationTracer(recorder)
    state = {}

    def phase(name, action, index, recorded):
        with tracer:
            state["model"] = action()
        tracer.collect(settled=True)

    spec = RunSpec(shape.name, dtype=dtype, tensor_parallel=tensor_parallel)
    run_protocol(shape, spec, torch.device("meta"), phase, mesh=mesh, stop_after="model_load")
    tracer.settle()
    weights = sorted(block for _, block, _ in tracer.settled.values())
    return LoadTrace(recorder.take(), weights, recorder.requests), state["model"], recorder


def trace_run(shape, spec, model, load: LoadTrace, mesh, decode_steps: int) -> RunTrace:
    """The phases after the load of `spec` (its first `decode_steps` decode steps) traced on `model`,
    the meta model of `load`."""
    from dataclasses import replace

    import torch

    from lab_helpers.real.protocol import run_protocol
    from lab_helpers.real.tracer import AllocationTracer
    recorder = RequestRecorder()
    recorder.requests = load.requests
    tracer = AllocationTracer(recorder)
    from lab_helpers.real.progress import progress_bar
    phases = []

    def phase(name, action, index, recorded):
        tracer.collect()
        pre = recorder.take()
        with tracer:
            action()
        tracer.collect()
        phases.append((name, index, pre, recorder.take()))
        bar.update()

    with progress_bar(2 + decode_steps, f"tracing batch {spec.batch}, context {spec.context}", "phase") as bar:
        run_protocol(shape, replace(spec, new_tokens=decode_steps), torch.device("meta"), phase, model=model,
                     mesh=mesh)
    persistent = list(tracer.persistent)
    return RunTrace(phases, persistent, decode_steps)
