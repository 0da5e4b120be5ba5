"""The size search of fit and fit --task train (lab_helpers.real.search): the same answer as trying every
size from 1 up, on a table of monotone cases (staircases of segments, a boundary beyond the peak
reserved's crossing as under release-and-retry, none or every size fitting, a start on either side),
at most about twice a bisection's probes, and, on real models, the same fit documents as the search
that galloped from 1 (the number of predictions apart)."""
import json
import random
import sys
from pathlib import Path

import pytest

from lab_helpers.real import fit as fit_module
from lab_helpers.real import train_fit
from lab_helpers.real.config import parse_config
from lab_helpers.real.fit import fit_model
from lab_helpers.real.search import Probe, largest_fitting
from lab_helpers.real.trace_cache import TraceCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay import reduced  # noqa: E402

MIB = 2**20
BUDGET = 149380136960


def galloping(probe, high, budget_bytes, start=None):
    """The search fit ran before: 1, 2, 4, ... until a size does not fit, then a bisection."""
    low = 0
    answer = probe(1) if high >= 1 else None
    if answer is None or not answer.fits:
        return 0, answer is None and high >= 1
    low, size = 1, 2
    while size <= high:
        answer = probe(size)
        if answer is None:
            return low, True
        if not answer.fits:
            break
        low, size = size, size * 2
    top = min(size, high + 1)
    while top - low > 1:
        middle = (low + top) // 2
        answer = probe(middle)
        if answer is None:
            return low, True
        low, top = (middle, top) if answer.fits else (low, middle)
    return low, False


def synthetic(seed):
    """A monotone case: peaks affine plus a quadratic term, rounded up to a segment size, an overhead of
    cached segments in the peak reserved of which a share is released under the budget."""
    r = random.Random(seed)
    high = r.choice([1, 2, 7, 100, 4096, 130000])
    weights, slope, square = r.randint(0, 148 * 10**9), r.randint(1, 3 * 10**6), r.randint(0, 10**9)
    segment = r.choice([512, 2 * MIB, 20 * MIB, 512 * MIB])
    overhead, released = r.choice([0, 10**8, 10**10]), r.random()

    def allocated(v):
        return weights + slope * v + square * v * v // 10**8

    def reserved(v):
        return -(-(allocated(v) + overhead * v // max(high, 1)) // segment) * segment

    def fits(v):
        return allocated(v) + released * (reserved(v) - allocated(v)) <= BUDGET

    truth = max((v for v in range(1, min(high, 200000) + 1) if fits(v)), default=0) if high <= 4096 else None
    if truth is None:  # monotone: bisect for the truth
        low, top = 0, high + 1
        while top - low > 1:
            middle = (low + top) // 2
            low, top = (middle, top) if fits(middle) else (low, middle)
        truth = low
    start = r.choice([None, 1, max(1, truth), truth + 1, max(1, truth // 3), high])
    return high, fits, reserved, allocated, truth, start


@pytest.mark.parametrize("seed", range(400))
def test_the_search_finds_what_trying_every_size_finds(seed):
    high, fits, reserved, allocated, truth, start = synthetic(seed)
    asked = []

    def probe(v):
        assert 1 <= v <= high and v not in asked  # in bounds, and never the same size twice
        asked.append(v)
        # a run that does not fit gives its peaks with no cap in one case of two
        known = fits(v) or seed % 2
        return Probe(fits(v), reserved(v) if known else None, allocated(v) if known else None)

    assert largest_fitting(probe, high, BUDGET, start) == (truth, False)
    assert len(asked) <= 2 * high.bit_length() + 3
    assert galloping(lambda v: Probe(fits(v)), high, BUDGET) == (truth, False)


@pytest.mark.parametrize("seed", range(0, 400, 3))
def test_peaks_given_later_change_no_probe_and_are_computed_only_when_read(seed):
    """A Probe whose peaks come from `later` (fit: a run that does not fit, replayed again with no cap
    only when the search reads its peaks): the same sizes probed, in the same order, and the same
    answer as with the peaks given at once; each `later` called at most once."""
    high, fits, reserved, allocated, truth, start = synthetic(seed)
    runs = {}
    for lazy in (False, True):
        asked, later_calls = [], []

        def probe(v):
            asked.append(v)
            if fits(v) or not lazy:
                return Probe(fits(v), reserved(v), allocated(v))
            return Probe(False, later=lambda: later_calls.append(v) or (reserved(v), allocated(v)))

        runs[lazy] = (largest_fitting(probe, high, BUDGET, start), asked, later_calls)
    assert runs[True][:2] == runs[False][:2]
    later_calls, failed = runs[True][2], [v for v in runs[True][1] if not fits(v)]
    assert len(later_calls) == len(set(later_calls)) and set(later_calls) <= set(failed)


@pytest.mark.parametrize("high,start,truth", [(0, None, 0), (1, None, 0), (1, None, 1), (1, 1, 1), (1, 1, 0),
                                              (5, 9, 3), (5, 0, 5), (64, 64, 64), (64, 64, 63), (64, 1, 0)])
def test_the_edges_of_the_range(high, start, truth):
    asked = []

    def probe(v):
        asked.append(v)
        return Probe(v <= truth)

    assert largest_fitting(probe, high, BUDGET, start) == (truth, False)
    assert all(1 <= v <= high for v in asked) and len(asked) == len(set(asked))


@pytest.mark.parametrize("start", [None, 1, 4096])
def test_where_the_lines_keep_the_bound_within_the_budget_the_bound_is_probed_next(start):
    """A model whose positions bound the answer (every size fits): after two sizes that fit, the line
    through their peaks stays within the budget at the bound, so the bound is the third probe, not
    the end of a gallop of doublings; where the line leaves the budget before it, the bound is not probed."""
    high = 130816
    asked = []

    def probe(v):
        asked.append(v)
        return Probe(True, 10**9 + v * 10**5, 10**9 + v * 10**5)

    assert largest_fitting(probe, high, BUDGET, start) == (high, False)
    first = start or 1
    assert asked == [first, 2 * first, high]
    asked.clear()
    steep = 10**9 + 2 * first * 10**6  # the peaks' line leaves the budget far below the bound

    def probe_steep(v):
        asked.append(v)
        return Probe(v * steep <= BUDGET * first, v * steep // first, v * steep // first)

    found, _ = largest_fitting(probe_steep, high, BUDGET, start)
    assert high not in asked and found == BUDGET * first // steep


@pytest.mark.parametrize("bound", [0, 1, 2, 5])
def test_a_bounded_search_keeps_a_size_that_fits_and_says_it_stopped(bound):
    asked = []

    def probe(v):
        if len(asked) >= bound:
            return None
        asked.append(v)
        return Probe(v <= 1000, 10**9 + v * 10**6)

    found, stopped = largest_fitting(probe, 4096, 10**9 + 1000 * 10**6, start=None)
    assert stopped and found <= 1000 and (found == 0 or found in asked)


# ---- real models: each size found fits and the next does not, and the galloping search's document is
# the same, the number of predictions apart. Fitting is not always monotone: the segments'
# fragmentation can make a larger size fit where a smaller one does not (the training case below, pinned),
# and the two searches may then stop at different boundaries, each a size that fits whose next does not.
CASES = [  # (config, new tokens, batch, context, tensor parallel, budget as the point's peak reserved + slack)
    ("llama-3.1-8b", 8, 2, 300, 1, 0),
    ("llama-3.1-8b", 8, 2, 300, 1, 7 * MIB),
    ("qwen2.5-7b", 6, 3, 200, 2, 3 * MIB),
    ("qwen3-8b", 4, None, 64, 1, -MIB),
]


def _document(shape, new_tokens, batch, context, degree, budget, monkeypatch, search):
    with monkeypatch.context() as patch:
        patch.setattr(fit_module, "largest_fitting", search)
        found = fit_model(shape, "bfloat16", new_tokens, budget, "test", batch=batch, context=context,
                          tensor_parallel=degree, trace_cache=TraceCache(None))
    return found


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fit_finds_a_boundary_and_agrees_with_the_galloping_search_where_fitting_is_monotone(case, monkeypatch):
    from lab_helpers.real.predict import predict_model
    from lab_helpers.real.spec import RunSpec
    name, new_tokens, batch, context, degree, slack = CASES[case]
    shape = parse_config(reduced(name, vocab_size=1000 + 1000 * case), name)
    point = RunSpec(shape.name, batch=batch or 2, context=context, new_tokens=new_tokens,
                    decode_record_every=new_tokens, tensor_parallel=degree)
    budget = predict_model(shape, point, trace_cache=TraceCache(None))["overall"]["peak_reserved_bytes"] + slack
    new = _document(shape, new_tokens, batch, context, degree, budget, monkeypatch, largest_fitting)
    old = _document(shape, new_tokens, batch, context, degree, budget, monkeypatch, galloping)
    new.pop("predictions_run"), old.pop("predictions_run")

    def fits(b, t):
        return fit_model(shape, "bfloat16", new_tokens, budget, "test", batch=b, context=t, tensor_parallel=degree,
                         trace_cache=TraceCache(None))["fits"]

    found = {key: new[key] for key in ("largest_context_at_batch", "largest_batch_at_context") if key in new}
    for key, size in found.items():
        b, t = (batch, size) if key == "largest_context_at_batch" else (size, context)
        after = (b, t + 1) if key == "largest_context_at_batch" else (b + 1, t)
        assert size > 0 and fits(b, t) and not fits(*after)
    assert json.dumps(new, sort_keys=True) == json.dumps(old, sort_keys=True)


def _eager_fits(shape, spec, budget, loaded):
    """fit's _fits as it was: a run that does not fit replayed again with no cap at once."""
    found = _lazy_fits(shape, spec, budget, loaded)
    if "uncapped" in found:
        reserved, allocated = found.pop("uncapped")()
        found["peak_reserved_bytes"], found["peak_allocated_bytes"] = reserved, allocated
    return found


_lazy_fits = fit_module._fits


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fit_replays_a_run_that_does_not_fit_with_no_cap_only_when_its_peaks_are_read(case, monkeypatch):
    """The fit documents of fit's search are the same, byte for byte, whether the uncapped replay of a
    probe that does not fit runs at once or only when the search reads its peaks."""
    from lab_helpers.real.predict import predict_model
    from lab_helpers.real.spec import RunSpec
    name, new_tokens, batch, context, degree, slack = CASES[case]
    shape = parse_config(reduced(name, vocab_size=1000 + 1000 * case), name)
    point = RunSpec(shape.name, batch=batch or 2, context=context, new_tokens=new_tokens,
                    decode_record_every=new_tokens, tensor_parallel=degree)
    budget = predict_model(shape, point, trace_cache=TraceCache(None))["overall"]["peak_reserved_bytes"] + slack
    documents = []
    for fits in (_lazy_fits, _eager_fits):
        with monkeypatch.context() as patch:
            patch.setattr(fit_module, "_fits", fits)
            documents.append(json.dumps(fit_model(shape, "bfloat16", new_tokens, budget, "test", batch=batch,
                                                  context=context, tensor_parallel=degree,
                                                  trace_cache=TraceCache(None)), sort_keys=True))
    assert documents[0] == documents[1]


def test_fit_task_train_finds_a_boundary_where_the_galloping_search_does(monkeypatch):
    """A one-layer model whose activations are small beside its weights and states, the budget 3 MiB
    above the point's peak: whether a context fits turns on the segments' fragmentation and flips
    back and forth (at batch 2: fits from 48 to 74, not at 75, fits from 76 to 90, not at 91 and 92,
    fits from 93 to 102, not from 103 to 121, ..., fits from 156 to 159, not at 160; at context 48,
    batches 1, 2, 4, 6 and 9 fit, 3, 5, 7 and 8 do not): each search stops at a boundary, a size that
    fits whose next does not, not the same one."""
    from dataclasses import replace

    from lab_helpers.allocator.budget import OutOfMemory
    from lab_helpers.real.train import TrainSpec, predict_training_model
    shape = parse_config(reduced("llama-3.1-8b", layers=1, vocab_size=500), "llama-3.1-8b")
    spec = TrainSpec(shape.name, batch=2, context=48, steps=2, train="full")
    budget = predict_training_model(shape, spec)["overall"]["peak_reserved_bytes"] + 3 * MIB

    def fits(b, t):
        try:
            predict_training_model(shape, replace(spec, batch=b, context=t), budget)
        except OutOfMemory:
            return False
        return True

    documents = []
    for search in (largest_fitting, galloping):
        with monkeypatch.context() as patch:
            patch.setattr(train_fit, "largest_fitting", search)
            documents.append(train_fit.fit_training(shape, spec, budget, "test", batch=2, context=48))
    for document in documents:
        context, batch = document["largest_context_at_batch"], document["largest_batch_at_context"]
        assert fits(2, context) and not fits(2, context + 1) and fits(batch, 48) and not fits(batch + 1, 48)
    assert [d["largest_context_at_batch"] for d in documents] == [159, 102]
    assert [d["largest_batch_at_context"] for d in documents] == [4, 6]  # at context 48, batch flips too
