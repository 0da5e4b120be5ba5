"""Trace once, replay many: decode steps extended from four traced ones give the same request
sequence, byte for byte, as tracing every step, on a table of models and sizes (tensor parallel 1
and 2); what cannot be extended is traced whole; the trace cache never trusts a bad file."""
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from lab_helpers.allocator.budget import OutOfMemory
from lab_helpers.allocator.model import SMALL_REQUEST_MAX_BYTES
from lab_helpers.allocator.settings import DEFAULT_SETTINGS, allocator_settings
from lab_helpers.core.errors import LabError
from lab_helpers.real.config import load_config, parse_config
from lab_helpers.real.predict import fake_process_group, predict_model
from lab_helpers.real.replay import (TRACED_DECODE_STEPS, WINDOW_MARGIN, ExtendedRun, LoadTrace, RunTrace,
                                     decode_steps_to_trace, decode_workspace_affine, expand_decode, replay_rank,
                                     traced_decode_steps)
from lab_helpers.real.spec import RunSpec, recorded_steps
from lab_helpers.real.trace_cache import MAGIC, TraceCache, decode_entry, encode_entry
from lab_helpers.real.traces import TraceSession

MIB = 2**20
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 5, "vocab_size": 1000, "max_position_embeddings": 4096}
ODD = {"model_type": "qwen2", "hidden_size": 96, "intermediate_size": 200, "num_attention_heads": 6,
       "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 1517, "max_position_embeddings": 4096}
MISTRAL = {"model_type": "mistral", "hidden_size": 128, "intermediate_size": 300, "num_attention_heads": 8,
           "num_key_value_heads": 4, "num_hidden_layers": 3, "vocab_size": 3001, "max_position_embeddings": 4096,
           "sliding_window": None}
BIASED = dict(TINY, attention_bias=True, tie_word_embeddings=True, vocab_size=151936)
# a key/value cache that outgrows what the prefill left free: reserved grows in late decode steps
KV_HEAVY = dict(TINY, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_hidden_layers=2)


MODELS = Path(__file__).resolve().parent.parent / "data" / "models"


def reduced(name: str, layers: int = 2, **changes) -> dict:
    """A bundled config of data/models with `layers` layers (its layer types cut to match) and `changes`."""
    raw = json.loads((MODELS / f"{name}.json").read_text())
    raw["n_layer" if "n_layer" in raw else "num_hidden_layers"] = layers
    if raw.get("layer_types"):
        raw["layer_types"] = raw["layer_types"][:layers]
    return {**raw, **changes}


REDUCED = {
    "qwen1.5-0.5b/4": reduced("qwen1.5-0.5b", layers=4),
    "qwen2.5-7b/2": reduced("qwen2.5-7b"),
    "llama-3.1-8b/2": reduced("llama-3.1-8b"),
    "qwen3-8b/2": reduced("qwen3-8b"),
    "olmo-2-7b/2": reduced("olmo-2-7b"),
    "pythia-1.4b/2": reduced("pythia-1.4b"),
    "gpt2/2": reduced("gpt2"),  # learned positions, a bias on every product (cuBLASLt)
    "mixtral-8x7b/2": reduced("mixtral-8x7b"),  # a mixture of experts
    "qwen3-30b-a3b/2": reduced("qwen3-30b-a3b"),
    "qwen1.5-moe-a2.7b/2": reduced("qwen1.5-moe-a2.7b"),  # experts and a shared expert
    "mistral-7b-v0.1/2,window-64": reduced("mistral-7b-v0.1", sliding_window=64),
    "phi-3-mini-4k/2": reduced("phi-3-mini-4k"),  # window 2047
    "gemma-2-2b/2": reduced("gemma-2-2b"),
    "gemma-2-2b/2,window-32": reduced("gemma-2-2b", sliding_window=32),
    # the decode steps' key/value tensors outweigh the prefill's logits
    "llama-small-vocabulary/2": reduced("llama-3.1-8b", vocab_size=1000),  # one sliding layer (4096), one full; torch.tensor scalars
    "gemma-3-4b-text/2,window-16": reduced("gemma-3-4b-text", layer_types=["sliding_attention", "full_attention"],
                                           sliding_window=16),
}


def shape_of(name):
    configs = {"tiny": TINY, "odd": ODD, "odd-even-vocabulary": dict(ODD, vocab_size=1518), "mistral": MISTRAL,
               "mistral-even-vocabulary": dict(MISTRAL, vocab_size=3000),
               "biased": BIASED, "kv-heavy": KV_HEAVY, **REDUCED}
    return parse_config(configs[name], name) if name in configs else load_config(name)


# (model, dtype, batch, context, new tokens, tensor parallel): every family the lab accepts, odd
# sizes, a key/value tensor crossing 1 MiB (small pool to large) during decode, a large vocabulary
# (argmax staging), float32 (the math attention)
CASES = [
    ("tiny", "bfloat16", 1, 16, 9, 1),
    ("tiny", "float32", 3, 37, 11, 1),
    ("tiny", "bfloat16", 2, 4093, 13, 1),
    ("odd", "bfloat16", 5, 61, 10, 1),
    ("odd-even-vocabulary", "float16", 1, 255, 7, 2),
    ("mistral", "bfloat16", 2, 127, 12, 1),
    ("mistral-even-vocabulary", "float32", 1, 9, 6, 2),
    ("tiny", "bfloat16", 3, 129, 8, 2),
    ("biased", "bfloat16", 2, 33, 9, 1),
    ("qwen1.5-0.5b/4", "bfloat16", 1, 509, 8, 1),
    ("qwen2.5-7b/2", "bfloat16", 2, 1023, 6, 2),
]


def sessions(shape, dtype, degree, rank, mesh=None):
    fast = TraceSession(shape, dtype, degree, rank, TraceCache(None), expand=True)
    full = TraceSession(shape, dtype, degree, rank, TraceCache(None), expand=False)
    return fast, full


@pytest.mark.parametrize("name, dtype, batch, context, new_tokens, degree", CASES)
def test_extended_decode_steps_equal_the_full_trace(name, dtype, batch, context, new_tokens, degree):
    shape = shape_of(name)
    assert decode_steps_to_trace(shape, context, new_tokens) == TRACED_DECODE_STEPS < new_tokens
    steps = recorded_steps(new_tokens, 3)
    for rank in range(degree):
        if degree == 1:
            fast, full = sessions(shape, dtype, 1, 0)
            fast_run, full_run = fast.run(batch, context, new_tokens), full.run(batch, context, new_tokens)
        else:
            with fake_process_group(rank, degree) as mesh:
                fast, full = sessions(shape, dtype, degree, rank)
                fast_run = fast.run(batch, context, new_tokens, mesh)
                full_run = full.run(batch, context, new_tokens, mesh)
        assert fast.traced == [(batch, context, TRACED_DECODE_STEPS)]  # four steps traced, the rest extended
        assert full.traced == [(batch, context, new_tokens)]
        assert fast.load().events == full.load().events
        assert fast_run.phases == full_run.phases  # the same requests and releases, in the same order
        assert fast_run.persistent == full_run.persistent
        free = replay_rank(full.load(), full_run, None, steps)
        assert replay_rank(fast.load(), fast_run, None, steps) == free
        # capped below the free run's peak: both run out at the same request, or both fit the same way
        cap = free["overall"]["peak_reserved_bytes"] - 2 * MIB
        outcomes = []
        for session, run in ((fast, fast_run), (full, full_run)):
            try:
                outcomes.append(replay_rank(session.load(), run, cap, steps))
            except OutOfMemory as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]


# (model, dtype, batch, context, new tokens, tensor parallel, extended?): the families of data/models
# reduced to two layers, odd sizes, windows reached before the first decode step, never reached, or
# reached mid-run (traced whole: not extended)
DOCUMENT_CASES = [
    ("llama-3.1-8b/2", "bfloat16", 3, 37, 9, 1, True),
    ("llama-3.1-8b/2", "bfloat16", 2, 129, 7, 2, True),
    ("qwen3-8b/2", "float16", 1, 255, 8, 2, True),
    ("olmo-2-7b/2", "bfloat16", 5, 17, 6, 1, True),
    ("pythia-1.4b/2", "float32", 2, 61, 7, 1, True),
    ("gpt2/2", "bfloat16", 3, 101, 9, 1, True),
    ("mixtral-8x7b/2", "bfloat16", 3, 23, 7, 1, True),
    ("qwen3-30b-a3b/2", "bfloat16", 2, 45, 6, 2, True),
    ("qwen1.5-moe-a2.7b/2", "bfloat16", 1, 33, 8, 1, True),
    ("mistral-7b-v0.1/2,window-64", "bfloat16", 2, 27, 9, 1, True),
    ("phi-3-mini-4k/2", "bfloat16", 1, 2051, 9, 1, True),
    ("gemma-2-2b/2", "bfloat16", 2, 50, 10, 1, True),
    ("gemma-3-4b-text/2,window-16", "bfloat16", 2, 30, 9, 1, True),  # cropped from the prefill on
    ("gemma-3-4b-text/2,window-16", "bfloat16", 1, 8, 12, 1, False),  # starts cropping too near the last step
    # a window that starts cropping mid-run: the steps up to its edge and past it traced, the rest extended
    ("gemma-3-4b-text/2,window-16", "bfloat16", 1, 8, 40, 1, True),
    ("mistral-7b-v0.1/2,window-64", "bfloat16", 2, 60, 30, 1, True),
    ("mistral-7b-v0.1/2,window-64", "bfloat16", 3, 64, 19, 2, True),  # the context at the window itself
    ("mistral-7b-v0.1/2,window-64", "bfloat16", 1, 67, 16, 1, True),  # within the margin past it
    ("gemma-2-2b/2,window-32", "bfloat16", 2, 20, 45, 1, True),  # the sliding layer beside a full one
    ("odd-even-vocabulary", "bfloat16", 5, 61, 10, 2, True),
    ("kv-heavy", "bfloat16", 16, 16, 52, 1, True),  # runs out in decode step 48 just under its peak
    # cuDNN's decode workspace splits the keys in powers of two by length: from 509 keys here
    ("tiny", "bfloat16", 1, 500, 20, 1, False),  # a split count that changes mid-run: traced whole
    ("tiny", "bfloat16", 1, 600, 20, 1, True),  # the same split count in every step
    # key/value tensors above 1 MiB: the small pool repeats and most decode steps replay in bulk
    ("llama-3.1-8b/2", "bfloat16", 1, 700, 40, 1, True),
    ("llama-small-vocabulary/2", "bfloat16", 16, 600, 60, 1, True),
    ("llama-3.1-8b/2", "bfloat16", 1, 1200, 30, 2, True),
]
EXPANDABLE = allocator_settings("expandable_segments:True")


def document(shape, spec, allocator, budget, cache, expand, phase_budget=None):
    return json.dumps(predict_model(shape, spec, capacity_bytes=budget, allocator=allocator, report_out_of_memory=True,
                                    trace_cache=cache, expand_decode_steps=expand, phase_budget=phase_budget),
                      sort_keys=True)


def failing_budget(shape, spec, allocator, cache, peak) -> "int | None":
    """A budget just under the run's need: the first below `peak` (falling in 2 MiB, then 20 MiB steps)
    under which the slow path predicts an out-of-memory error."""
    for budget in [peak - 1, *range(peak - 2 * MIB, peak - 40 * MIB, -2 * MIB),
                   *range(peak - 40 * MIB, peak // 2, -20 * MIB)]:
        found = json.loads(document(shape, spec, allocator, budget, cache, False))
        if "out_of_memory" in found:
            return budget
    return None


@pytest.mark.parametrize("name, dtype, batch, context, new_tokens, degree, extended", DOCUMENT_CASES)
def test_fast_predictions_equal_the_full_trace_under_every_allocator(name, dtype, batch, context, new_tokens,
                                                                    degree, extended):
    """The prediction documents of the fast path and of every decode step traced, byte for byte: PyTorch's
    default allocator, under a budget at the run's peak (fits) and just under it (runs out in the same
    phase, after the same releases), expandable segments unbounded and capped just under its peak."""
    shape = shape_of(name)
    spec = RunSpec(name, dtype=dtype, batch=batch, context=context, new_tokens=new_tokens, decode_record_every=3,
                   tensor_parallel=degree)
    fast_cache, full_cache = TraceCache(None), TraceCache(None)
    traced = decode_steps_to_trace(shape, context, new_tokens)
    assert (traced is not None and new_tokens > traced
            and decode_workspace_affine(shape, batch, degree, context, new_tokens)) is extended
    for settings in (DEFAULT_SETTINGS, EXPANDABLE):
        free = document(shape, spec, settings, None, full_cache, False)
        assert document(shape, spec, settings, None, fast_cache, True) == free
        peak = json.loads(free)["overall"]["peak_reserved_bytes"]
        failing = failing_budget(shape, spec, settings, full_cache, peak)
        assert failing is not None
        for budget in (peak, failing):
            full = document(shape, spec, settings, budget, full_cache, False)
            assert document(shape, spec, settings, budget, fast_cache, True) == full
        assert "out_of_memory" not in json.loads(document(shape, spec, settings, peak, full_cache, False))
    # what was traced: four decode steps (five with a window, more where one starts cropping mid-run)
    # where the steps are extended, else every step
    runs = [t for t in fast_cache.memory.values() if isinstance(t, RunTrace)]
    assert {t.decode_steps for t in runs} == {traced if extended else new_tokens}
    assert {t.decode_steps for t in full_cache.memory.values() if isinstance(t, RunTrace)} == {new_tokens}


@pytest.mark.parametrize("name, batch, context, new_tokens, degree", [
    ("llama-3.1-8b/2", 1, 700, 40, 1), ("llama-small-vocabulary/2", 16, 600, 60, 1), ("llama-3.1-8b/2", 1, 1200, 30, 2)])
def test_long_runs_replay_most_decode_steps_in_bulk(name, batch, context, new_tokens, degree):
    """The cases above whose documents equal the full trace's do take the bulk path (lab_helpers.real.decode_replay)."""
    shape = shape_of(name)
    with fake_process_group(0, degree) if degree > 1 else __import__("contextlib").nullcontext() as mesh:
        session = TraceSession(shape, "bfloat16", degree, 0, TraceCache(None))
        run = session.run(batch, context, new_tokens, mesh)
    assert isinstance(run, ExtendedRun)
    stats = {}
    bulk = replay_rank(session.load(), run, None, recorded_steps(new_tokens, 1), stats=stats)
    assert bulk == replay_rank(session.load(), run.written_out(), None, recorded_steps(new_tokens, 1))
    assert stats["bulk_steps"] >= new_tokens - 2 * TRACED_DECODE_STEPS


def synthetic_run(new_tokens, layers=2, base=12 * MIB, growth=64 * 1024, small=(3000, 700), token=8,
                  transient=1536 * 1024, late=()):
    """A load and a run with the structure of a decode: per layer two small activations, a key/value
    tensor of `base` bytes growing by `growth` per step that replaces the step before's, a transient of
    `transient` bytes (a workspace, released right after), then small requests of the sizes `late` held to
    the layer's end; a token carried to the next step. Four steps traced, the rest extended."""
    made = [1]

    def request(events, size):
        events.append(size)
        made[0] += 1
        return made[0] - 1

    inputs, prefill = [], []
    request(inputs, 512)
    kv = [request(prefill, base) for _ in range(layers)]
    prefill.append(~request(prefill, 30 * MIB))
    phases, carried = [("inputs", None, [], inputs), ("prefill", None, [], prefill)], None
    for step in range(TRACED_DECODE_STEPS):
        events = []
        for layer in range(layers):
            a, b = request(events, small[0]), request(events, small[1])
            new = request(events, base + (step + 1) * growth)
            events.append(~kv[layer])
            kv[layer] = new
            events.append(~request(events, transient))
            held = [request(events, size) for size in late]
            events += [~a, ~b, *(~h for h in held)]
        made_token = request(events, token)
        if carried is not None:
            events.append(~carried)
        carried = made_token
        phases.append(("decode", step, [], events))
    return LoadTrace([50 * MIB], [0], 1), expand_decode(RunTrace(phases, [], TRACED_DECODE_STEPS), new_tokens)


def _outcome(load, run, budget, stats=None):
    result = replay_rank(load, run, budget, list(range(0, run.decode_steps, 7)) + [run.decode_steps - 1],
                         report=True, stats=stats)
    if result["out_of_memory"] is not None:
        failure = result["out_of_memory"]
        result["out_of_memory"] = (str(failure), failure.report())
    return result


@pytest.mark.parametrize("changes", [{}, {"growth": 3 * 2**15, "layers": 3}, {"token": 600, "small": (512, 70000)}])
def test_bulk_decode_steps_equal_every_step_replayed_under_every_budget(changes):
    """The bulk replay of extended decode steps against the same steps replayed request by request,
    under no budget and every budget from the run's peak reserved down past its peak allocated (1 MiB
    apart): releases of cached segments in bulk steps (the small pool brought to the failing request,
    then request by request), out-of-memory errors in the same request with the same figures."""
    load, run = synthetic_run(150, **changes)
    whole = run.written_out()
    stats = {}
    free = _outcome(load, whole, None)
    assert _outcome(load, run, None, stats) == free
    assert stats == {"bulk_steps": 150 - TRACED_DECODE_STEPS - 2, "resumed": 0} or stats["bulk_steps"] > 100
    resumed = failed = 0
    for budget in range(free["overall"]["peak_reserved_bytes"], free["overall"]["peak_allocated_bytes"] - 4 * MIB,
                        -MIB):
        stats = {}
        expected = _outcome(load, whole, budget)
        assert _outcome(load, run, budget, stats) == expected
        resumed += stats["resumed"] > 0
        failed += expected["out_of_memory"] is not None
    assert resumed > 10 and failed > 10


@pytest.mark.parametrize("changes", [{}, {"growth": 3 * 2**15, "layers": 3}, {"token": 600, "small": (512, 70000)}])
def test_bulk_steps_written_out_equal_bulk_steps_through_the_allocator_calls(changes, monkeypatch):
    """DecodeReplayer's bulk steps with AllocatorModel's malloc and free written out against the same
    steps through the allocator's calls (the path of an allocator that overrides them): the same
    outcomes and the same bulk steps, unbounded and under budgets from the peak reserved down past
    the peak allocated (releases refused mid-step, then request by request; out of memory)."""
    from lab_helpers.real.decode_replay import DecodeReplayer
    load, run = synthetic_run(150, **changes)
    free = _outcome(load, run, None)
    budgets = [None, *range(free["overall"]["peak_reserved_bytes"], free["overall"]["peak_allocated_bytes"] - 4 * MIB,
                            -3 * MIB)]

    def outcomes():
        found = []
        for budget in budgets:
            stats = {}
            found.append((_outcome(load, run, budget, stats), stats))
        return found

    written_out = outcomes()
    with monkeypatch.context() as patch:
        patch.setattr(DecodeReplayer, "_large_ops_inline", DecodeReplayer._large_ops)
        assert outcomes() == written_out
    assert sum(stats["resumed"] > 0 for _, stats in written_out) > 3
    assert all(stats["bulk_steps"] > 0 for _, stats in written_out)


@pytest.mark.parametrize("changes", [{}, {"transient": 17 * MIB + 512}, {"transient": 40 * MIB},
                                     {"base": 2 * MIB, "growth": 4096, "late": (1000 * 1024,) * 4}])
def test_a_bulk_step_passes_over_a_request_released_by_the_next_large_event(changes, monkeypatch):
    """The transient of each layer (taken, then released before any other large request) is marked in
    the bulk steps' plan, the key/value tensors are not: the bulk replay finds its block, counts it in
    allocated and the peak (the whole block where the allocator would not split it: 17 MiB and 512 bytes
    in an 18 MiB segment), and leaves the large pool as it was; the small requests made after its
    release, more than the key/value tensor it follows, still count in the peak. The outcomes equal
    those of every step replayed request by request, unbounded and under budgets down past the peak
    allocated (a 40 MiB transient at times finds no cached block that fits and takes a new segment,
    through the allocator's own malloc)."""
    from lab_helpers.real.decode_replay import DecodeReplayer
    load, run = synthetic_run(150, **changes)
    planned = []
    plan = DecodeReplayer._plan

    def recording_plan(self, *args):
        plan(self, *args)
        if self.span is not None:
            planned.append([(op[0], op[6]) for op in self.ops])

    monkeypatch.setattr(DecodeReplayer, "_plan", recording_plan)
    free = _outcome(load, run.written_out(), None)
    assert _outcome(load, run, None) == free
    # per layer: the key/value tensor made, the one before released, the transient made and released
    assert planned and all(ops == [(True, False), (False, False), (True, True), (False, False)] * 2 for ops in planned)
    for budget in range(free["overall"]["peak_reserved_bytes"], free["overall"]["peak_allocated_bytes"] - 4 * MIB,
                        -2 * MIB):
        assert _outcome(load, run, budget) == _outcome(load, run.written_out(), budget)


def test_a_per_phase_budget_replays_the_same_on_both_paths():
    """compare's budgets, one per phase: from decode step 10 on, no more than reserved was when step 10
    started, so a later step's new segment first releases the free cached ones, then runs out."""
    shape = shape_of("kv-heavy")
    spec = RunSpec("kv-heavy", batch=16, context=16, new_tokens=52, decode_record_every=1)
    fast_cache, full_cache = TraceCache(None), TraceCache(None)
    free = json.loads(document(shape, spec, DEFAULT_SETTINGS, None, full_cache, False))
    tight = next(p["baseline_reserved_bytes"] for p in free["phases"] if p["index"] == 10)

    def phase_budget(rank, phase, index):
        return tight if phase == "decode" and index >= 10 else 2**40

    full = document(shape, spec, DEFAULT_SETTINGS, None, full_cache, False, phase_budget)
    assert document(shape, spec, DEFAULT_SETTINGS, None, fast_cache, True, phase_budget) == full
    failed = json.loads(full)["out_of_memory"]
    assert failed["phase"] == "decode" and failed["index"] >= TRACED_DECODE_STEPS  # in an extended step
    quick = json.loads(document(shape, spec, DEFAULT_SETTINGS, free["overall"]["peak_reserved_bytes"] - 1,
                                fast_cache, True))
    assert (quick["out_of_memory"]["phase"], quick["out_of_memory"]["index"]) == ("decode", 48)


def test_a_release_and_retry_replays_the_same_on_both_paths():
    """Just under the peak, the prefill's new segments first release the wholly free cached ones."""
    shape = shape_of("kv-heavy")
    spec = RunSpec("kv-heavy", batch=16, context=128, new_tokens=40, decode_record_every=7)
    fast_cache, full_cache = TraceCache(None), TraceCache(None)
    peak = json.loads(document(shape, spec, DEFAULT_SETTINGS, None, full_cache, False))["overall"]["peak_reserved_bytes"]
    full = document(shape, spec, DEFAULT_SETTINGS, peak - MIB // 2, full_cache, False)
    assert document(shape, spec, DEFAULT_SETTINGS, peak - MIB // 2, fast_cache, True) == full
    assert [r["phase"] for r in json.loads(full)["cache_releases"]] == ["prefill", "prefill"]
    assert "out_of_memory" not in json.loads(full)


@pytest.mark.parametrize("name, degree", [("tiny", 2), ("odd-even-vocabulary", 2), ("mistral-even-vocabulary", 2), ("mistral-even-vocabulary", 4)])
def test_every_rank_traces_what_rank_zero_traces(name, degree):
    """What fits_at_degree and fit rely on to replay rank 0's trace for every rank."""
    shape = shape_of(name)
    traces = []
    for rank in range(degree):
        with fake_process_group(rank, degree) as mesh:
            session = TraceSession(shape, "bfloat16", degree, rank, TraceCache(None))
            run = session.run(3, 45, 6, mesh)
            traces.append((session.load(), run.phases, run.persistent))
    assert all(t == traces[0] for t in traces[1:])


def test_a_prediction_through_the_cache_equals_one_traced_whole(tmp_path):
    shape = shape_of("odd")
    spec = RunSpec("odd", batch=2, context=100, new_tokens=9, decode_record_every=2)
    first = predict_model(shape, spec, trace_cache=TraceCache(tmp_path))
    again = predict_model(shape, spec, trace_cache=TraceCache(tmp_path))  # read from disk, nothing traced
    session = TraceSession(shape, "bfloat16", 1, 0, TraceCache(None), expand=False)
    whole = replay_rank(session.load(), session.run(2, 100, 9), None, recorded_steps(9, 2))
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert [{k: p[k] for k in w} for p, w in zip(first["phases"], whole["phases"])] == whole["phases"]
    assert first["overall"] == whole["overall"] and first["workspace"]["bytes"] == whole["workspace_bytes"]


def test_decode_record_every_changes_no_trace():
    shape = shape_of("tiny")
    cache = TraceCache(None)
    one = predict_model(shape, RunSpec("tiny", batch=2, context=50, new_tokens=20), trace_cache=cache)
    names = set(cache.memory)
    five = predict_model(shape, RunSpec("tiny", batch=2, context=50, new_tokens=20, decode_record_every=5),
                         trace_cache=cache)
    assert set(cache.memory) == names  # the same traces answered both
    assert one["overall"] == five["overall"]
    by_step = {p["index"]: p for p in one["phases"] if p["phase"] == "decode"}
    assert [p for p in five["phases"] if p["phase"] == "decode"] == [by_step[s] for s in recorded_steps(20, 5)]


# ------------------------------------------------------------------ what is not extended
@pytest.mark.parametrize("changes, context, new_tokens", [
    ({"layer_types": ["sliding_attention", "full_attention"] * 2 + ["full_attention"], "sliding_window": 64},
     40, 30),  # the window is reached mid-run, too near the last step to trace its edge and extend the rest
    ({"model_type": "mistral", "sliding_window": 64}, 59, 8),  # reached within the margin of the prefill
    ({"model_type": "mistral", "sliding_window": 64}, 20, 42),  # reached within the margin of the last step
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, 40, 30),
])
def test_runs_whose_steps_may_change_are_not_extended(changes, context, new_tokens):
    if "rope_scaling" in changes:  # a RoPE that changes past a length (the shape as given, not read)
        shape = replace(shape_of("tiny"), raw={**TINY, **changes})
    else:
        shape = parse_config({**TINY, **changes}, "changed")
    assert decode_steps_to_trace(shape, context, new_tokens) is None
    if "sliding_window" in changes:  # before it, or past it: the steps traced at first alone
        first = traced_decode_steps(shape)
        assert decode_steps_to_trace(shape, 10, 20) == decode_steps_to_trace(shape, 200, 20) == first
        # reached mid-run with steps to spare: traced up to the margin past its edge, then as many again
        assert decode_steps_to_trace(shape, 40, 60) == 64 + WINDOW_MARGIN - 40 + traced_decode_steps(shape)
    assert decode_steps_to_trace(replace(shape_of("tiny"), model_type="deepseek_v3"), 40, 30) is None  # not checked


def test_an_unexpandable_model_is_traced_whole(monkeypatch):
    from lab_helpers.real import replay, traces
    shape = shape_of("tiny")
    monkeypatch.setattr(replay, "EXPANDABLE_FAMILIES", ())  # no family checked to repeat
    session = TraceSession(shape, "bfloat16", 1, 0, TraceCache(None))
    run = session.run(1, 8, 7)
    assert session.traced == [(1, 8, 7)] and run.decode_steps == 7
    monkeypatch.undo()
    monkeypatch.setattr(traces, "expand_decode", lambda trace, n: None)  # steps that do not repeat
    session = TraceSession(shape, "bfloat16", 1, 0, TraceCache(None))
    assert session.run(1, 8, 7).decode_steps == 7
    assert session.traced == [(1, 8, TRACED_DECODE_STEPS), (1, 8, 7)]


@pytest.mark.parametrize("rule, extended", [
    (lambda batch, heads, key_heads, kv, dim: 0 if kv < 40 else 4 * batch * heads * dim * 4 + 128, False),  # from 40
    (lambda batch, heads, key_heads, kv, dim: 512 * batch * heads + 16 * kv, True),  # affine in the key length
])
def test_a_decode_workspace_whose_rule_changes_mid_run_is_traced_whole(monkeypatch, rule, extended):
    """cuDNN's decode workspace as the tracer models it: a rule that changes at some key length after
    the traced steps is not extended (the traced steps alone would look affine)."""
    from lab_helpers.real import behaviour, tracer
    for module in (behaviour, tracer):  # the replay's check reads the one, the tracer's model the other
        monkeypatch.setattr(module, "cudnn_decode_workspace_bytes", rule)
    shape = shape_of("tiny")
    spec = RunSpec("tiny", batch=2, context=20, new_tokens=30, decode_record_every=4)
    fast, full = TraceCache(None), TraceCache(None)
    documents = [document(shape, spec, DEFAULT_SETTINGS, None, cache, expand) for cache, expand in ((fast, True),
                                                                                                    (full, False))]
    assert documents[0] == documents[1]
    runs = [t for t in fast.memory.values() if isinstance(t, RunTrace)]
    assert {t.decode_steps for t in runs} == {TRACED_DECODE_STEPS if extended else 30}


def _steps(*own):
    return RunTrace([("inputs", None, [], [64]), ("prefill", None, [], [512, ~1])] +
                    [("decode", i, [], list(events)) for i, events in enumerate(own)], [], len(own))


def test_steps_that_are_not_affine_are_not_extended():
    base = _steps([100, ~3], [100, 200, ~4, ~5], [100, 201, ~6, ~7], [100, 202, ~8, ~9])
    grown = expand_decode(base, 6)
    assert [p[3] for p in grown.phases[-2:]] == [[100, 203, ~10, ~11], [100, 204, ~12, ~13]]
    for own in ([100, 200, ~4, ~5], [100, 201, ~6, ~7], [100, 203, ~8, ~9]), \
               ([100, 200, ~4, ~5], [100, 201, ~6, ~7], [100, 202, ~8]), \
               ([100, 200, ~4, ~5], [100, 201, ~6, ~7], [100, 202, ~8, ~8]), \
               ([100, 200, ~4, ~5], [100, 201, ~6, ~7], [100, ~7, 202, ~9]):
        assert expand_decode(_steps([100, ~3], *own), 6) is None
    shrinking = _steps([100, ~3], [100, 3, ~4, ~5], [100, 2, ~6, ~7], [100, 1, ~8, ~9])
    assert expand_decode(shrinking, 6) is None  # a request would reach 0 bytes
    assert expand_decode(base, 3).decode_steps == 3 and len(expand_decode(base, 3).phases) == 5


# ------------------------------------------------------------------ the cache on disk
def _entry(tmp_path):
    shape = shape_of("tiny")
    cache = TraceCache(tmp_path)
    session = TraceSession(shape, "bfloat16", 1, 0, cache)
    run = session.run(2, 30, 6)
    files = sorted(tmp_path.glob("*.trace"))
    assert len(files) == 2 and not list(tmp_path.glob(".*"))  # the load and the run; no temporary left
    return shape, session, run, files


def test_a_cache_entry_is_read_back_as_written(tmp_path):
    shape, session, run, files = _entry(tmp_path)
    fresh = TraceSession(shape, "bfloat16", 1, 0, TraceCache(tmp_path))
    assert fresh.run(2, 30, 6).phases == run.phases and fresh.traced == [] and fresh.model is None


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "garbage", "magic only", "folder",
                                    "foreign key", "fifo", "wrong layout"])
def test_a_bad_cache_entry_is_ignored_and_rebuilt(tmp_path, damage):
    shape, session, run, files = _entry(tmp_path)
    key = {**session.key, "kind": "run", "batch": 2, "context": 30, "decode_steps": TRACED_DECODE_STEPS}
    path = tmp_path / TraceCache._name(key)
    assert path in files
    data = path.read_bytes()
    path.unlink()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flipped":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(os.urandom(5000))
    elif damage == "magic only":
        path.write_bytes(MAGIC)
    elif damage == "folder":
        path.mkdir()
    elif damage == "foreign key":  # a whole, intact entry of another key under this name
        path.write_bytes(encode_entry({**key, "batch": 3}, run))
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "wrong layout":
        bad = RunTrace([("warmup", None, [1], [2])], [], 0)
        path.write_bytes(encode_entry(key, bad))
    fresh = TraceSession(shape, "bfloat16", 1, 0, TraceCache(tmp_path))
    again = fresh.run(2, 30, 6)
    assert again.phases == run.phases
    assert fresh.traced == [(2, 30, TRACED_DECODE_STEPS)]  # traced again, not read
    if damage not in ("folder", "fifo"):
        assert decode_entry(path.read_bytes(), key) is not None  # rewritten whole


def test_the_cache_folder_is_trimmed_oldest_first(tmp_path):
    shape = shape_of("tiny")
    TraceSession(shape, "bfloat16", 1, 0, TraceCache(tmp_path)).run(1, 8, 2)
    TraceSession(shape, "float32", 1, 0, TraceCache(tmp_path)).run(1, 8, 2)
    files = sorted(tmp_path.glob("*.trace"))
    assert len(files) == 4
    for age, path in enumerate(files):  # the last one in name order is the newest
        os.utime(path, (1000 + age, 1000 + age))
    keep = files[-1].stat().st_size + files[-2].stat().st_size
    TraceCache(tmp_path, max_bytes=keep).trim()
    assert sorted(tmp_path.glob("*.trace")) == files[-2:]
    TraceCache(tmp_path, max_bytes=0).trim()
    assert not list(tmp_path.glob("*.trace"))


def test_no_cache_writes_nothing_and_the_cache_answers_the_same(tmp_path, capsys):
    from lab_helpers.real.commands import main
    env_before = os.environ["XDG_CACHE_HOME"]
    os.environ["XDG_CACHE_HOME"] = str(tmp_path)
    try:
        argv = ["predict", "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "64", "--new-tokens", "6"]
        assert main(argv + ["--no-cache"]) == 0
        uncached = capsys.readouterr().out
        assert not (tmp_path / "iteragpu-lab").exists()
        assert main(argv) == 0
        assert capsys.readouterr().out == uncached
        # the config's shape, the load and the run
        assert len(list((tmp_path / "iteragpu-lab" / "traces").glob("*.trace"))) == 3
        assert main(argv) == 0
        assert capsys.readouterr().out == uncached
    finally:
        os.environ["XDG_CACHE_HOME"] = env_before


def test_a_cache_folder_that_cannot_be_written_changes_no_answer(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    shape = shape_of("tiny")
    spec = RunSpec("tiny", batch=1, context=8, new_tokens=5)
    assert predict_model(shape, spec, trace_cache=TraceCache(blocker / "sub")) == \
        predict_model(shape, spec, trace_cache=TraceCache(None))


def test_a_bad_budget_is_refused_before_any_trace():
    from lab_helpers.real.fit import fits_at_degree
    with pytest.raises(LabError):
        fits_at_degree(shape_of("tiny"), RunSpec("tiny"), 1, 0, TraceCache(None))


def test_progress_shows_on_a_terminal_only(monkeypatch):
    import io

    from lab_helpers.real.progress import PROGRESS_DELAY_SECONDS, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", io.StringIO())
    with progress_bar(3, "quiet") as bar:
        bar.update()
        assert bar.disable
    assert not __import__("sys").stderr.getvalue()
    monkeypatch.setattr("sys.stderr", Terminal())
    with progress_bar(3, "shown") as bar:
        assert not bar.disable and bar.delay == PROGRESS_DELAY_SECONDS  # drawn once two seconds have passed

    class OutStream(io.StringIO):  # a Jupyter kernel's stderr: not a terminal
        pass

    import types
    monkeypatch.setattr("sys.stderr", OutStream())
    monkeypatch.delitem(__import__("sys").modules, "ipykernel", raising=False)
    with progress_bar(3, "no kernel") as bar:
        assert bar.disable
    monkeypatch.setitem(__import__("sys").modules, "ipykernel", types.ModuleType("ipykernel"))
    with progress_bar(3, "in a notebook") as bar:
        assert not bar.disable and type(bar).__module__ == "tqdm.std"  # the plain bar: no ipywidgets needed


def test_tracing_leaves_the_config_as_given():
    """The trace key and the documents show shape.raw: building the model must not rewrite it."""
    import copy
    shape = load_config("llama-3.1-8b")  # a rope block (llama3) that the config's construction rewrites
    before = copy.deepcopy(shape.raw)
    from lab_helpers.real.protocol import transformers_config
    transformers_config(shape)
    assert shape.raw == before


def test_the_causal_model_names_read_from_the_source_equal_the_imported_ones():
    """lab_helpers.real.config reads transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES from its source file
    (importing the module costs nearly the import of torch and transformers again)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lab_helpers.real.config import causal_lm_architectures
    assert causal_lm_architectures() == dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("name", ["qwen1.5-0.5b", "gemma-3-4b-text", "mixtral-8x7b", "gpt2", "mistral-7b-v0.1"])
def test_a_shape_kept_in_the_cache_equals_the_one_read_from_its_config(tmp_path, name):
    """parse_config's shape through the cache folder: read once through transformers' config class, then
    taken from the folder (no config class read), equal field for field, parameter count included; a
    damaged entry is read again and rewritten."""
    from lab_helpers.real import config
    from lab_helpers.real.trace_cache import shape_key
    direct = load_config(name)
    first = config.load_config(name, TraceCache(tmp_path))
    assert first == direct
    entry = tmp_path / TraceCache._name(shape_key(direct.raw))
    assert entry.is_file()
    config._BUILT.clear()
    kept = config.load_config(name, TraceCache(tmp_path))
    assert kept == direct and kept.parameter_count() == direct.parameter_count()
    assert kept.attention_bias == direct.attention_bias
    entry.write_bytes(entry.read_bytes()[:-7])
    assert config.load_config(name, TraceCache(tmp_path)) == direct
    assert decode_entry(entry.read_bytes(), shape_key(direct.raw)) is not None  # rewritten whole


@pytest.mark.parametrize("changes", [{"base": 8192, "growth": 2048}, {"base": 4096, "growth": 512, "layers": 3},
                                     {"base": 1000 * 1024, "growth": 2048}])
def test_key_value_tensors_growing_in_the_small_pool_replay_as_every_step_written_out(changes):
    """Key/value tensors under 1 MiB grow in the small pool, which then never repeats: where one is still
    small in the last step no step is replayed in bulk and the replayer keeps no books (its stats stay
    empty); where it crosses into the large pool mid-run (the last case) the bulk replay starts after.
    Both equal every step replayed request by request, under no budget and budgets down past the peak."""
    load, run = synthetic_run(60, **changes)
    whole = run.written_out()
    stats = {}
    free = _outcome(load, whole, None)
    assert _outcome(load, run, None, stats) == free
    crosses = changes["base"] + 60 * changes["growth"] > SMALL_REQUEST_MAX_BYTES
    assert (stats.get("bulk_steps", 0) > 0) is crosses and (stats == {}) is not crosses
    for budget in range(free["overall"]["peak_reserved_bytes"], free["overall"]["peak_allocated_bytes"] - 4 * MIB,
                        -MIB):
        assert _outcome(load, run, budget) == _outcome(load, whole, budget)
