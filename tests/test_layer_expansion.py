"""A run traced on a few layers and expanded to the model's depth (lab_helpers.real.layers) equals the
run traced on every layer, request for request, on every family of data/models whose layers are all the
same (odd sizes, several sizes and decode steps, tensor parallel 1 and 2), and predicts the same
documents; a model whose layers differ, or a run whose check fails, is traced whole."""
import json
from contextlib import nullcontext
from dataclasses import replace

import pytest

from lab_helpers.core import forked
from lab_helpers.real import layers as layer_module
from lab_helpers.real.config import parse_config
from lab_helpers.real.layers import Split, TEMPLATE_LAYERS, NotExpandable, uniform_layers, well_formed
from lab_helpers.real.predict import fake_process_group, predict_model
from lab_helpers.real.protocol import transformers_config
from lab_helpers.real.replay import RunTrace
from lab_helpers.real.spec import RunSpec
from lab_helpers.real.trace_cache import TraceCache
from lab_helpers.real.traces import TraceSession
from test_replay import reduced

MIB = 2**20


def shape_of(name: str, layers: int = 9, **changes):
    return parse_config(reduced(name, layers=layers, **changes), f"{name}/{layers}")


def _guard(shape) -> bool:
    config = transformers_config(shape)
    return uniform_layers(shape, config, layer_module.plain_meta_model(config))


def _runs(shape, dtype, degree, batch, context, steps):
    """(expanded sessions' runs, full sessions' runs, the expanded sessions) of every rank: every decode
    step traced (expand=False), layers expanded or not."""
    fast_runs, full_runs, sessions = [], [], []
    for rank in range(degree):
        with fake_process_group(rank, degree) if degree > 1 else nullcontext() as mesh:
            fast = TraceSession(shape, dtype, degree, rank, TraceCache(None), expand=False, expand_layers=True)
            full = TraceSession(shape, dtype, degree, rank, TraceCache(None), expand=False, expand_layers=False)
            fast_runs.append(fast.run(batch, context, steps, mesh))
            full_runs.append(full.run(batch, context, steps, mesh))
            assert fast.load().events == full.load().events
            sessions.append(fast)
    return fast_runs, full_runs, sessions


# (config of data/models, layers, changes, dtype, batch, context, decode steps, tensor parallel): every
# family whose layers pass the guard; odd layer counts, batches, contexts and vocabularies
CASES = [
    ("llama-3.1-8b", 9, {"vocab_size": 1001}, "bfloat16", 3, 37, 3, 1),
    ("llama-3.1-70b", 11, {"vocab_size": 1002}, "float16", 1, 129, 2, 2),
    ("mistral-7b-v0.1", 8, {"sliding_window": 64, "vocab_size": 777}, "bfloat16", 2, 70, 3, 1),
    ("qwen2.5-7b", 9, {}, "bfloat16", 2, 33, 2, 2),
    ("qwen1.5-0.5b", 10, {"vocab_size": 1517}, "float32", 5, 19, 3, 1),
    ("qwen3-8b", 8, {"vocab_size": 1000}, "bfloat16", 1, 255, 4, 1),
    ("qwen3-30b-a3b", 8, {"vocab_size": 1006}, "bfloat16", 2, 23, 2, 2),
    ("qwen1.5-moe-a2.7b", 8, {"vocab_size": 1000}, "bfloat16", 3, 17, 2, 1),
    ("mixtral-8x7b", 9, {"vocab_size": 1000}, "bfloat16", 1, 45, 3, 1),
    ("olmo-2-7b", 8, {}, "bfloat16", 2, 31, 2, 1),
    ("gpt2", 9, {"vocab_size": 1003}, "bfloat16", 3, 101, 3, 1),
    ("pythia-1.4b", 8, {"vocab_size": 1001}, "float32", 2, 61, 2, 1),
    ("phi-3-mini-4k", 9, {}, "bfloat16", 1, 2051, 2, 1),
    ("gemma-2-2b", 8, {"layer_types": ["sliding_attention"] * 8, "sliding_window": 16, "vocab_size": 1000},
     "bfloat16", 2, 30, 3, 1),
    ("gemma-3-4b-text", 9, {"layer_types": ["full_attention"] * 9, "vocab_size": 1000}, "bfloat16", 2, 9, 3, 1),
]


@pytest.mark.parametrize("name, layers, changes, dtype, batch, context, steps, degree", CASES,
                         ids=[f"{c[0]}/{c[1]}-tp{c[7]}" for c in CASES])
def test_an_expanded_run_equals_the_run_traced_on_every_layer(name, layers, changes, dtype, batch, context, steps,
                                                             degree):
    shape = shape_of(name, layers, **changes)
    assert _guard(shape)
    fast_runs, full_runs, sessions = _runs(shape, dtype, degree, batch, context, steps)
    for fast, full, session in zip(fast_runs, full_runs, sessions):
        assert session.layer_expanded == [(batch, context, steps)]  # expanded, not traced whole
        assert fast.phases == full.phases  # the same requests and releases, the same ids, in the same order
        assert fast.persistent == full.persistent and fast.decode_steps == full.decode_steps


# (config, layers, changes, dtype, batch, context, decode steps, --quantize): bitsandbytes' weights, loaded
# and quantized key by key, then every layer's products through bitsandbytes' code; widths not divisible
# by 4 (the 8-bit product's float32 fallback) in the last
QUANTIZED_CASES = [
    ("llama-3.1-8b", 9, {"vocab_size": 1001}, "bfloat16", 3, 37, 3, "int8-threshold-0"),
    ("qwen2.5-7b", 9, {}, "bfloat16", 2, 33, 2, "nf4-double"),
    ("gpt2", 8, {"vocab_size": 1003}, "float16", 2, 50, 2, "nf4"),
    ("gpt2", 9, {"vocab_size": 1003}, "bfloat16", 3, 101, 3, "int8-threshold-0"),
    ("phi-3-mini-4k", 9, {}, "bfloat16", 1, 2051, 2, "fp4"),
    ("gemma-2-2b", 8, {"layer_types": ["sliding_attention"] * 8, "sliding_window": 16, "vocab_size": 1000},
     "bfloat16", 2, 30, 3, "int8-threshold-0"),
    ("qwen3-30b-a3b", 8, {"vocab_size": 1006}, "bfloat16", 2, 23, 2, "fp4-double"),
    ("llama-3.1-8b", 9, {"hidden_size": 262, "head_dim": 262, "num_attention_heads": 1, "num_key_value_heads": 1,
                         "intermediate_size": 690, "vocab_size": 1001}, "bfloat16", 2, 40, 3, "int8-threshold-0"),
]


@pytest.mark.parametrize("name, layers, changes, dtype, batch, context, steps, kind", QUANTIZED_CASES,
                         ids=[f"{c[0]}/{c[1]}-{c[7]}" for c in QUANTIZED_CASES])
def test_a_quantized_models_expanded_run_equals_the_run_traced_on_every_layer(name, layers, changes, dtype, batch,
                                                                             context, steps, kind):
    pytest.importorskip("bitsandbytes")
    shape = replace(shape_of(name, layers, **changes), quantization=kind)
    (fast,), (full,), (session,) = _runs(shape, dtype, 1, batch, context, steps)
    assert session.layer_expanded == [(batch, context, steps)]
    assert fast.phases == full.phases
    assert fast.persistent == full.persistent and fast.decode_steps == full.decode_steps


# (config, layers, changes, tensor parallel): one session traces runs of several sizes one after another,
# its two smaller models sharing one cache of meta kernels' output layouts (LayerExpansion.layouts)
SHARED_CASES = [
    ("llama-3.1-8b", 9, {"vocab_size": 1000}, 1),
    ("qwen3-30b-a3b", 8, {"vocab_size": 1006}, 2),
    ("gpt2", 8, {}, 1),
    ("mistral-7b-v0.1", 8, {"sliding_window": 64, "vocab_size": 777}, 1),
]


@pytest.mark.parametrize("name, layers, changes, degree", SHARED_CASES)
def test_runs_traced_in_one_session_equal_runs_each_traced_in_a_fresh_one(name, layers, changes, degree):
    shape = shape_of(name, layers, **changes)
    sizes = [(2, 37), (2, 38), (1, 37), (3, 70), (2, 39)]
    with fake_process_group(0, degree) if degree > 1 else nullcontext() as mesh:
        session = TraceSession(shape, "bfloat16", degree, 0, TraceCache(None), expand=False, expand_layers=True)
        for batch, context in sizes:
            run = session.run(batch, context, 3, mesh)
            fresh = TraceSession(shape, "bfloat16", degree, 0, TraceCache(None), expand=False,
                                 expand_layers=True).run(batch, context, 3, mesh)
            assert (run.phases, run.persistent, run.decode_steps) == (fresh.phases, fresh.persistent,
                                                                      fresh.decode_steps)
    assert session.layer_expanded == [(b, t, 3) for b, t in sizes]
    assert session._layers.layouts  # filled by the first run, read by the next ones


def test_the_next_session_on_the_same_cache_reuses_its_expansion_and_traces_the_same_runs(monkeypatch):
    """A notebook's next question on the same model (a new TraceSession over the process's cache) traces
    its runs on the expansion the first question prepared, not on two smaller models built again; the
    runs equal those of a session over a fresh cache. A tensor-parallel rank's expansion is not kept (its
    models hold one question's fake process group), nor one of another model or dtype."""
    prepared = []
    original = layer_module.LayerExpansion.prepare.__func__

    def counting(cls, shape, dtype, *rest):
        prepared.append((shape.name, dtype))
        return original(cls, shape, dtype, *rest)

    monkeypatch.setattr(layer_module.LayerExpansion, "prepare", classmethod(counting))
    shape, other = shape_of("llama-3.1-8b", 9, vocab_size=1000), shape_of("qwen2.5-7b", 9)
    cache = TraceCache(None)
    for batch, context in [(2, 37), (3, 41)]:  # the second is a new run: traced, on the kept expansion
        session = TraceSession(shape, "bfloat16", 1, 0, cache, expand=False, expand_layers=True)
        run = session.run(batch, context, 3)
        fresh = TraceSession(shape, "bfloat16", 1, 0, TraceCache(None), expand=False, expand_layers=True)
        assert session.layer_expanded == [(batch, context, 3)]
        assert (run.phases, run.persistent) == (lambda r: (r.phases, r.persistent))(fresh.run(batch, context, 3))
    TraceSession(shape, "float32", 1, 0, cache, expand=False, expand_layers=True).run(2, 37, 3)
    TraceSession(other, "bfloat16", 1, 0, cache, expand=False, expand_layers=True).run(2, 37, 3)
    with fake_process_group(0, 2) as mesh:
        for context in (37, 38):
            TraceSession(other, "bfloat16", 2, 0, cache, expand=False, expand_layers=True).run(2, context, 3, mesh)
    assert prepared == [(shape.name, "bfloat16")] * 3 + [(shape.name, "float32"), (other.name, "bfloat16")] + \
        [(other.name, "bfloat16")] * 2


@pytest.mark.parametrize("name, layers, changes, degree", SHARED_CASES)
def test_the_larger_trace_made_in_a_child_equals_the_one_made_here(name, layers, changes, degree, monkeypatch):
    """The smaller models' two traces of a run: the larger one traced in a forked child (a second core)
    gives the runs of a session traced with no child, run after run, and came from the child each time."""
    shape = shape_of(name, layers, **changes)
    sizes = [(2, 37), (1, 70), (3, 38)]
    runs, from_child = {}, []
    original = forked.Forked.result

    def result(self):
        value = original(self)
        from_child.append(self.from_child)
        return value

    monkeypatch.setattr(forked.Forked, "result", result)
    for child in (True, False):
        monkeypatch.setattr(forked, "forking_helps", lambda: child)
        with fake_process_group(0, degree) if degree > 1 else nullcontext() as mesh:
            session = TraceSession(shape, "bfloat16", degree, 0, TraceCache(None), expand=False, expand_layers=True)
            runs[child] = [session.run(batch, context, 3, mesh) for batch, context in sizes]
        assert session.layer_expanded == [(b, t, 3) for b, t in sizes]
    assert from_child == [True] * len(sizes) + [False] * len(sizes)
    assert [(r.phases, r.persistent, r.decode_steps) for r in runs[True]] == \
        [(r.phases, r.persistent, r.decode_steps) for r in runs[False]]


# (config, layers, changes, batch, context, new tokens, tensor parallel): predictions with the decode steps
# extended (the default path) and layers expanded or traced whole
DOCUMENT_CASES = [
    ("llama-3.1-8b", 9, {"vocab_size": 1000}, 2, 129, 9, 2),
    ("qwen3-30b-a3b", 8, {"vocab_size": 1000}, 1, 33, 8, 1),
    ("gpt2", 8, {}, 3, 41, 7, 1),
    ("mistral-7b-v0.1", 9, {"sliding_window": 64, "vocab_size": 1000}, 2, 27, 9, 1),
    # the window starts cropping mid-run: the steps to its edge and past it traced, the rest extended
    ("mistral-7b-v0.1", 9, {"sliding_window": 64, "vocab_size": 1000}, 2, 60, 30, 1),
    ("gemma-2-2b", 8, {"layer_types": ["sliding_attention"] * 8, "sliding_window": 16, "vocab_size": 1000},
     1, 14, 24, 1),
]


def _document(shape, spec, cache, expand_layers, budget=None):
    return json.dumps(predict_model(shape, spec, capacity_bytes=budget, report_out_of_memory=True, trace_cache=cache,
                                    expand_layers=expand_layers), sort_keys=True)


@pytest.mark.parametrize("name, layers, changes, batch, context, new_tokens, degree", DOCUMENT_CASES)
def test_predictions_from_expanded_runs_equal_the_full_traces(name, layers, changes, batch, context, new_tokens,
                                                            degree):
    """The prediction documents, unbounded and under a budget just under the peak (release-and-retry, then
    out of memory in the same phase), byte for byte."""
    shape = shape_of(name, layers, **changes)
    spec = RunSpec(shape.name, batch=batch, context=context, new_tokens=new_tokens, decode_record_every=3,
                   tensor_parallel=degree)
    fast, full = TraceCache(None), TraceCache(None)
    free = _document(shape, spec, full, False)
    assert _document(shape, spec, fast, True) == free
    # and every decode step of every layer traced
    assert json.dumps(predict_model(shape, spec, trace_cache=TraceCache(None), expand_decode_steps=False,
                                    report_out_of_memory=True), sort_keys=True) == free
    peak = json.loads(free)["overall"]["peak_reserved_bytes"]
    for budget in (peak, peak - 2 * MIB, peak - 20 * MIB):
        assert _document(shape, spec, fast, True, budget) == _document(shape, spec, full, False, budget)
    runs = [key for key, t in fast.memory.items() if isinstance(t, RunTrace)]
    assert runs and fast.memory.keys() == full.memory.keys()  # the same keys: an expanded trace is a full one


# ------------------------------------------------------------------ what is not expanded
REFUSED = {
    # gemma3's sliding and full layers (a pattern of the config class)
    "gemma3-pattern": ("gemma-3-4b-text", 9, {"layer_types": None, "sliding_window_pattern": 3,
                                              "vocab_size": 1000}),
    "gemma2-alternating": ("gemma-2-2b", 8, {"layer_types": None, "vocab_size": 1000}),
    # qwen2's sliding window from layer max_window_layers on
    "qwen2-max-window-layers": ("qwen2.5-7b", 9, {"use_sliding_window": True, "sliding_window": 64,
                                                  "max_window_layers": 4, "layer_types": None}),
    # mixtures of experts with dense layers
    "qwen2-moe-mlp-only-layers": ("qwen1.5-moe-a2.7b", 8, {"mlp_only_layers": [0], "vocab_size": 1000}),
    "qwen2-moe-sparse-step": ("qwen1.5-moe-a2.7b", 8, {"decoder_sparse_step": 2, "vocab_size": 1000}),
    "qwen3-moe-mlp-only-layers": ("qwen3-30b-a3b", 8, {"mlp_only_layers": [7], "vocab_size": 1000}),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_layers_that_differ_fail_the_guard_and_are_traced_whole(case):
    name, layers, changes = REFUSED[case]
    raw = reduced(name, layers=layers, **changes)
    raw = {k: v for k, v in raw.items() if v is not None}
    shape = parse_config(raw, case)
    assert not _guard(shape)
    fast_runs, full_runs, sessions = _runs(shape, "bfloat16", 1, 2, 21, 2)
    assert sessions[0].layer_expanded == [] and sessions[0]._layers is False
    assert fast_runs[0].phases == full_runs[0].phases


def test_a_model_of_few_layers_is_traced_whole():
    shape = shape_of("llama-3.1-8b", TEMPLATE_LAYERS + 1, vocab_size=1000)
    assert _guard(shape)
    fast_runs, full_runs, sessions = _runs(shape, "bfloat16", 1, 1, 16, 2)
    assert sessions[0].layer_expanded == [] and fast_runs[0].phases == full_runs[0].phases


def test_an_expansion_that_does_not_match_the_larger_trace_is_traced_whole(monkeypatch):
    """The check: the smaller trace expanded by one layer must equal the larger one; when it does not
    (here: the expansion made wrong on purpose) the run is traced on every layer."""
    original = Split.expand

    def wrong(self, m, layers, base):
        trace = original(self, m, layers, base)
        name, index, pre, own = trace.phases[-1]
        trace.phases[-1] = (name, index, pre, [own[0] + 512, *own[1:]])
        return trace

    monkeypatch.setattr(Split, "expand", wrong)
    shape = shape_of("llama-3.1-8b", 9, vocab_size=1000)
    fast_runs, full_runs, sessions = _runs(shape, "bfloat16", 1, 2, 21, 2)
    assert sessions[0].layer_expanded == [] and sessions[0].traced == [(2, 21, 2)]
    assert fast_runs[0].phases == full_runs[0].phases


def _marked(events_by_phase):
    """A RunTrace and its marks: each phase (head, [layer events], tail)."""
    phases, marks = [("inputs", None, [], [64])], {}
    for p, (head, layers, tail) in enumerate(events_by_phase, start=1):
        own, found = list(head), []
        for i, events in enumerate(layers):
            found.append(("start", i, len(own)))
            own += events
        found.append(("end", len(layers) - 1, len(own)))
        own += tail
        phases.append(("prefill" if p == 1 else "decode", None if p == 1 else p - 2, [], own))
        marks[p] = found
    return RunTrace(phases, [], len(events_by_phase) - 1), marks


def test_a_run_that_releases_a_weight_is_not_expanded():
    base = 10  # requests of the load: ids 0 to 9
    trace, marks = _marked([([100], [[200, ~11], [200, ~12]], [~10, ~13])])
    assert well_formed(Split(trace, marks, 2, base).expand(1, 4, base), base)
    trace, marks = _marked([([100], [[200, ~3], [200, ~12]], [~10, ~11, ~13])])  # ~3: a weight
    with pytest.raises(NotExpandable):
        Split(trace, marks, 2, base)


def test_a_layer_called_out_of_order_is_not_expanded():
    trace, marks = _marked([([100], [[200], [200]], [])])
    marks[1][0], marks[1][1] = marks[1][1], marks[1][0]
    with pytest.raises(NotExpandable):
        Split(trace, marks, 2, 10)
