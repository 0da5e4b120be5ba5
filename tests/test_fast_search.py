"""fit and fit --card with decode steps replayed in bulk (lab_helpers.real.decode_replay) give the same
documents, byte for byte, as with every decode step replayed request by request, and as with every
decode step traced: budgets at and around the boundaries fit finds, PyTorch's default allocator,
tensor parallel 1 and 2, every degree of the rate card.

The search itself is unchanged (the same bisection, the same probes): only each probe's replay is
faster, so the documents, the number of predictions included, are the same."""
import json
import sys
from pathlib import Path

import pytest

from lab_helpers.allocator.settings import DEFAULT_SETTINGS
from lab_helpers.real import replay, traces
from lab_helpers.real.config import parse_config
from lab_helpers.real.decode_replay import DecodeReplayer
from lab_helpers.real.fit import fit_model
from lab_helpers.real.trace_cache import TraceCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay import reduced  # noqa: E402

MIB = 2**20
SHAPES = {
    "llama-small-vocabulary/2": reduced("llama-3.1-8b", vocab_size=1000),
    "qwen2.5-7b/2": reduced("qwen2.5-7b", vocab_size=2000),
}


class RequestByRequest(DecodeReplayer):
    """The replay with no bulk step: every decode step request by request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.usable = False


def fit_document(shape, new_tokens, budget, batch, context, degree, allocator, bulk=True, expand=True,
                 monkeypatch=None, cache=None):
    with monkeypatch.context() as patch:
        if not bulk:
            patch.setattr(replay, "DecodeReplayer", RequestByRequest)
        if not expand:
            original = traces.TraceSession.__init__
            patch.setattr(traces.TraceSession, "__init__",
                          lambda self, *a, **k: original(self, *a, **{**k, "expand": False}))
        found = fit_model(shape, "bfloat16", new_tokens, budget, "test", batch=batch, context=context,
                          tensor_parallel=degree, allocator=allocator,
                          trace_cache=cache if cache is not None else TraceCache(None))
    return json.dumps(found, sort_keys=True)


# (shape, new tokens, batch, context, tensor parallel, allocator): the budget is set from the peak
# reserved of (batch, context) itself, so that the point sits at the boundary of both searches
# (expandable segments replay request by request: their documents are compared in tests/test_replay.py)
CASES = [
    ("llama-small-vocabulary/2", 40, 8, 700, 1, DEFAULT_SETTINGS),
    ("qwen2.5-7b/2", 30, 4, 1200, 2, DEFAULT_SETTINGS),
]


@pytest.mark.parametrize("name, new_tokens, batch, context, degree, allocator", CASES)
def test_fit_in_bulk_equals_fit_request_by_request(monkeypatch, name, new_tokens, batch, context, degree,
                                                   allocator):
    from lab_helpers.real.predict import predict_model
    from lab_helpers.real.spec import RunSpec
    shape = parse_config(SHAPES[name], name)
    spec = RunSpec(name, batch=batch, context=context, new_tokens=new_tokens, decode_record_every=new_tokens,
                   tensor_parallel=degree)
    cache = TraceCache(None)  # the traces do not depend on the replay: shared by both paths
    peak = predict_model(shape, spec, allocator=allocator, trace_cache=cache)["overall"]["peak_reserved_bytes"]
    for budget in (peak, peak - MIB):
        documents = [fit_document(shape, new_tokens, budget, batch, context, degree, allocator, bulk, True,
                                  monkeypatch, cache) for bulk in (True, False)]
        assert documents[0] == documents[1]
        found = json.loads(documents[0])
        assert found["largest_context_at_batch"] > 0 and found["largest_batch_at_context"] > 0


def test_fit_in_bulk_equals_fit_with_every_decode_step_traced(monkeypatch):
    shape = parse_config(SHAPES["llama-small-vocabulary/2"], "llama-small-vocabulary/2")
    budget = 1400 * MIB
    fast = fit_document(shape, 24, budget, 4, 900, 1, DEFAULT_SETTINGS, True, True, monkeypatch)
    assert fast == fit_document(shape, 24, budget, 4, 900, 1, DEFAULT_SETTINGS, True, False, monkeypatch)


def test_the_bulk_path_is_taken_by_a_fit_probe():
    """The probes of the cases above do replay decode steps in bulk (else they would test nothing)."""
    from lab_helpers.real.spec import recorded_steps
    from lab_helpers.real.traces import TraceSession
    shape = parse_config(SHAPES["llama-small-vocabulary/2"], "llama-small-vocabulary/2")
    session = TraceSession(shape, "bfloat16", 1, 0, TraceCache(None))
    stats = {}
    replay.replay_rank(session.load(), session.run(8, 700, 40), 3 * 2**30, recorded_steps(40, 40), stats=stats)
    assert stats["bulk_steps"] > 20


def test_fit_card_in_bulk_equals_fit_card_request_by_request(monkeypatch):
    from lab_helpers.real.card_fit import card_fit
    from lab_helpers.real.spec import RunSpec
    name = "llama-small-vocabulary/2"
    shape = parse_config(SHAPES[name], name)
    spec = RunSpec(name, batch=8, context=700, new_tokens=40, decode_record_every=40)
    cache = TraceCache(None)
    documents = []
    for bulk in (True, False):
        with monkeypatch.context() as patch:
            if not bulk:
                patch.setattr(replay, "DecodeReplayer", RequestByRequest)
            documents.append(json.dumps(card_fit(shape, spec, 7, trace_cache=cache), sort_keys=True))
    assert documents[0] == documents[1]
    assert json.loads(documents[0])["cheapest"] is not None
