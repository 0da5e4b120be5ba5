"""Trace once, replay many: a traced run's allocation requests written down as a sequence, and the
allocator model replayed over it as often as a question needs.

A run traced on meta (lab_helpers.real.tracer) asks the allocator for the same requests whatever the
allocator answers, so the requests are recorded once (`RequestRecorder`) and replayed under any
capacity (`replay_rank`). Events are integers: a positive one is a request of that many bytes (its
id is its rank among the requests, from 0), a negative one ~id releases request `id`.

Decode steps repeat: from the second step on, each step's events are those of the step before
plus a constant difference (the key/value tensors grow by one position, a release names the request
of one step later). `expand_decode` checks that on three traced steps and extends the sequence to
any number of steps; where the run's structure does not promise it (`decode_steps_to_trace`), every step
is traced.
"""
from dataclasses import dataclass

from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.real.decode_replay import DecodeReplayer

# decode steps traced when the steps are extended from the traced ones: step 0 (which releases the
# prefill's cache) and three steps whose events must be affine in the step number
TRACED_DECODE_STEPS = 4
# the transformers families whose decode steps were checked to repeat (tests/test_replay.py: every
# family of data/models): a DynamicCache with one key and one value tensor per layer, a full layer's
# growing by one position per step, a sliding layer's by one position until it crops to its window
EXPANDABLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmo2",
                       "gpt2", "gpt_neox", "phi3", "gemma2", "gemma3_text")
# positions kept between a run and a window's edge: a sliding layer's cache grows up to its window
# (window - 1 kept positions and the new one), then stays that size; a run whose positions come
# this close to a window edge is traced whole
WINDOW_MARGIN = 4


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


def decode_steps_to_trace(shape, context: int, new_tokens: int) -> "int | None":
    """How many of the run's first decode steps to trace before the others are extended from them
    (expand_decode), or None where they may not be extended: a family not checked to repeat, or a
    RoPE that changes with the length (dynamic, longrope).

    traced_decode_steps, where every sliding window is beyond every position of the run or reached
    before its first decode step. Where a window starts cropping mid-run (its edge, give or take
    WINDOW_MARGIN positions, inside the run), the steps until the run's positions are WINDOW_MARGIN
    past every such edge are traced too, then traced_decode_steps more: from there each window is
    cropped in every step, as in a run that starts past it. None where that reaches the last step
    (the run is traced whole). The traced steps must still be affine where they end (expand_decode
    checks it); a CUDA behaviour of the tracer whose bytes are not affine in the cache length must be
    excluded here (decode_workspace_affine)."""
    raw = shape.raw
    if shape.model_type not in EXPANDABLE_FAMILIES:
        return None
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key) if isinstance(raw.get(key), dict) else {}
        if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
            return None
    crossing = [w + WINDOW_MARGIN - context for w in {w for w in shape.layer_windows if w is not None}
                if not (context + new_tokens + WINDOW_MARGIN <= w or context >= w + WINDOW_MARGIN)]
    steps = max(crossing, default=0) + traced_decode_steps(shape)
    return steps if not crossing or steps < new_tokens else None


def decode_workspace_affine(shape, batch: int, tensor_parallel: int, context: int, new_tokens: int) -> bool:
    """Whether the tracer's cuDNN decode workspace (lab_helpers.real.behaviour.cudnn_decode_workspace_bytes:
    the keys split in powers of two by length) is affine in the key length over every decode step of
    the run, for one rank's heads: a rule that changes at some length between the traced steps and
    the last would not be seen by the check of the traced steps, so such a run is traced whole (as is
    one where the rule cannot be evaluated here)."""
    from lab_helpers.real.behaviour import cudnn_decode_workspace_bytes
    heads, key_heads = shape.heads // tensor_parallel, max(shape.kv_heads // tensor_parallel, 1)
    try:
        sizes = [cudnn_decode_workspace_bytes(batch, heads, key_heads, kv, shape.value_dim)
                 for kv in range(context + 1, context + new_tokens + 1)]
    except TypeError:  # another signature: nothing is known of its rule
        return False
    return all(b - a == sizes[1] - sizes[0] for a, b in zip(sizes, sizes[1:]))


def traced_decode_steps(shape) -> int:
    """Decode steps traced before the others are extended: TRACED_DECODE_STEPS, one more with a sliding
    window (a cropped layer's cache is a view of the step before's, so a step releases what was made
    two steps back, and step 1 still releases a request of step 0, which differs)."""
    return TRACED_DECODE_STEPS + (1 if any(w is not None for w in shape.layer_windows) else 0)


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


@dataclass
class ExtendedRun:
    """A run of `decode_steps` decode steps whose steps past the traced ones are not written out: each
    is the last traced step plus `template`'s differences times its distance from it (expand_decode)."""

    traced: RunTrace
    template: tuple  # ((pre, own) of the last traced step, (pre_step, own_step)): decode_template's
    decode_steps: int

    @property
    def persistent(self) -> list:
        return self.traced.persistent

    def step_events(self, step: int) -> tuple:
        """(pre, own) of an extended decode step (step >= the traced steps)."""
        (pre, own), (pre_step, own_step) = self.template
        j = step - (self.traced.decode_steps - 1)
        return [e + j * d for e, d in zip(pre, pre_step)], [e + j * d for e, d in zip(own, own_step)]

    @property
    def phases(self) -> list:
        """Every phase written out, as a RunTrace holds them."""
        return [*self.traced.phases,
                *(("decode", step, *self.step_events(step)) for step in range(self.traced.decode_steps,
                                                                              self.decode_steps))]

    def written_out(self) -> RunTrace:
        return RunTrace(self.phases, self.persistent, self.decode_steps)


def expand_decode(trace: RunTrace, new_tokens: int) -> "RunTrace | ExtendedRun | None":
    """The trace extended to `new_tokens` decode steps (the traced ones, then each next step the last
    traced one plus its differences; an ExtendedRun, not written out), or None when the traced steps
    do not repeat so, or when a request would shrink to nothing before the last step."""
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
    return ExtendedRun(trace, template, new_tokens)


def _counters(alloc, base_allocated: int, base_reserved: int) -> dict:
    return {"baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved}


def replay_allocator_for(settings, capacity_bytes=None):
    """The replayed allocator of a real-model prediction under `settings` (AllocatorSettings), capped at
    `capacity_bytes` (what it may reserve) when one is given."""
    from lab_helpers.allocator.addressed import AddressedAllocator, CappedAllocator
    from lab_helpers.allocator.budget import OutOfMemory
    from lab_helpers.allocator.expandable import CappedExpandableAllocator, ExpandableAllocator
    if settings.expandable_segments:
        # segments grow in place: no address to choose, so no AddressedAllocator counterpart
        return ExpandableAllocator() if capacity_bytes is None else CappedExpandableAllocator(capacity_bytes,
                                                                                               OutOfMemory)
    return AddressedAllocator() if capacity_bytes is None else CappedAllocator(capacity_bytes)


def allocator_factory(settings):
    """make_allocator(capacity_bytes) for replay_rank: the allocator model of `settings`."""
    return lambda capacity_bytes=None: replay_allocator_for(settings, capacity_bytes)


def default_allocator(capacity_bytes=None):
    """The replayed allocator under PyTorch's default settings, capped at `capacity_bytes` when given."""
    from lab_helpers.allocator.settings import DEFAULT_SETTINGS
    return replay_allocator_for(DEFAULT_SETTINGS, capacity_bytes)


def set_budget(alloc, budget_bytes) -> None:
    """The budget of the next phase: BudgetMixin's, or the expandable model's own capacity."""
    from lab_helpers.allocator.budget import BudgetMixin
    if isinstance(alloc, BudgetMixin):
        alloc.budget_bytes = budget_bytes
    elif budget_bytes is not None and hasattr(alloc, "capacity_bytes"):
        alloc.capacity_bytes = budget_bytes


def _apply(alloc, events: list, blocks: list) -> None:
    if hasattr(alloc, "replay"):
        alloc.replay(events, blocks)
        return
    for event in events:  # an allocator model without a replay of its own (expandable segments)
        if event > 0:
            blocks.append(alloc.malloc(event))
        else:
            alloc.free(blocks[~event])


def _releases_since(alloc, seen: int, name: str, index) -> list:
    return [{"phase": name, "index": index, "released_bytes": r, "reserved_bytes_after": after}
            for r, after in getattr(alloc, "releases", ())[seen:]]


def replay_rank(load: LoadTrace, run: "RunTrace | None", capacity_bytes, recorded_steps,
                make_allocator=default_allocator, phase_budget=None, report: bool = False, stats=None) -> dict:
    """The allocator model replayed over one rank's load and run: {"phases": records of the recorded
    phases, "overall": the peaks, "weights_bytes", "workspace_bytes", "releases": the releases of
    cached segments whose retry succeeded, "out_of_memory": None, "load_failed": False}. With run None,
    the load alone.

    `make_allocator(capacity_bytes)` makes the allocator model (the trace does not depend on it: any
    allocator setting replays the same requests). The budget is `capacity_bytes` (None: unbounded), or
    `phase_budget(phase, index)` phase by phase; under it the allocator's release-and-retry is replayed,
    and when it still runs out lab_helpers.allocator.budget.OutOfMemory is raised, its phase named, or
    with `report` the result stops there: "out_of_memory" the exception, "load_failed" whether it came
    in the load, "phases" the phases completed, "overall" the peaks so far."""
    from lab_helpers.allocator.budget import OutOfMemory
    load_budget = phase_budget("model_load", None) if phase_budget else capacity_bytes
    alloc = make_allocator(load_budget)
    blocks = []
    result = {"phases": [], "overall": None, "weights_bytes": 0, "workspace_bytes": 0, "releases": [],
              "out_of_memory": None, "load_failed": False}
    try:
        _apply(alloc, load.events, blocks)
    except OutOfMemory as exc:
        if exc.phase is None:
            exc.phase, exc.index = "model_load", None
        if not report:
            raise
        result.update(out_of_memory=exc, load_failed=True)
        return result
    records = [{"phase": "model_load", "index": None, "passes": 0, **_counters(alloc, 0, 0)}]
    releases = _releases_since(alloc, 0, "model_load", None)
    weights_bytes = sum(blocks[i].size for i in load.weights)
    totals = {"peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved}
    result.update(phases=records, overall=totals, weights_bytes=weights_bytes, releases=releases)
    recorded = set(recorded_steps)
    extended = isinstance(run, ExtendedRun)
    replayer = None
    if extended and isinstance(alloc, AllocatorModel):
        replayer = DecodeReplayer(alloc, blocks, run.template, run.traced.decode_steps - 1, run.decode_steps)
        if replayer.usable:
            replayer.track(load.events)
        else:
            replayer = None

    def phase(name, index, pre, own, bulk=False):
        first = len(blocks)
        _apply(alloc, pre, blocks)  # releases only: no budget is reached
        set_budget(alloc, phase_budget(name, index) if phase_budget else capacity_bytes)
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        seen = len(getattr(alloc, "releases", ()))
        alloc.reset_peaks()
        try:
            if replayer is not None:
                replayer.track(pre)
                start = replayer.bulk_step(index) if bulk else 0
                if start is not None:
                    if bulk:
                        own = run.step_events(index)[1]
                    elif replayer.pending():  # the steps before were replayed in bulk
                        replayer.resume(index, 0, alloc.allocated)
                        first = len(blocks)
                    _apply(alloc, own[start:] if start else own, blocks)
                    replayer.track(own[start:] if start else own)
                    if name == "decode" and not bulk:
                        replayer.step_done(index, first, own, len(getattr(alloc, "releases", ())))
            else:
                _apply(alloc, own, blocks)
        except OutOfMemory as exc:
            if exc.phase is None:
                exc.phase, exc.index = name, index
            raise
        finally:
            releases.extend(_releases_since(alloc, seen, name, index))
            if alloc.peak_allocated > totals["peak_allocated_bytes"]:
                totals["peak_allocated_bytes"] = alloc.peak_allocated
            if alloc.peak_reserved > totals["peak_reserved_bytes"]:
                totals["peak_reserved_bytes"] = alloc.peak_reserved
        if name != "decode" or index in recorded:
            records.append({"phase": name, "index": index, "passes": 1 if name in ("prefill", "decode") else 0,
                            **_counters(alloc, base_allocated, base_reserved)})

    try:
        for name, index, pre, own in ((run.traced.phases if extended else run.phases) if run is not None else ()):
            phase(name, index, pre, own)
        if extended:
            for step in range(run.traced.decode_steps, run.decode_steps):
                if replayer is not None and replayer.in_span(step):
                    phase("decode", step, [], None, bulk=True)
                else:
                    phase("decode", step, *run.step_events(step))
    except OutOfMemory as exc:
        if not report:
            raise
        result["out_of_memory"] = exc
    if stats is not None and replayer is not None:
        stats.update(replayer.stats)
    if run is not None:
        result["workspace_bytes"] = sum(blocks[i].size for i in run.persistent if i < len(blocks))
    return result


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


def trace_run(shape, spec, model, load: LoadTrace, mesh, decode_steps: int, recorder=None,
              layouts: "dict | None" = None) -> RunTrace:
    """The phases after the load of `spec` (its first `decode_steps` decode steps) traced on `model`,
    the meta model of `load` (into `recorder`, a fresh RequestRecorder, where one is given; `layouts`,
    the tracer's cache of meta kernels' output layouts, shared with other traces where one is given)."""
    from dataclasses import replace

    import torch

    from lab_helpers.real.protocol import run_protocol
    from lab_helpers.real.tracer import AllocationTracer
    recorder = recorder if recorder is not None else RequestRecorder()
    recorder.requests = load.requests
    tracer = AllocationTracer(recorder, layouts=layouts)
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
