"""The training trace asks the allocator what the H200 asked its own, request for request.

tests/h200_train_requests.json holds three fine-tuning runs measured on an NVIDIA H200 (torch
2.11.0+cu130, transformers 5.17.0, 2026-12-02) by `benchmarks/train_requests.py measure` and pinned by
its `pin`: two layers of llama-3.1-8b at (1, 128), full AdamW; at (1, 3072) with gradient
checkpointing; two layers of qwen3-8b at (8, 256), full; three steps each; and two layers of
llama-3.1-8b at (1, 128) with float32 weights under bfloat16 autocast and gradient checkpointing,
two steps (its casts, their cached weight copies, and the recomputed forward under the forward's
autocast state). Per phase, every
allocation in order and the set of releases between two allocations, and the six counters. The
same runs traced on meta must ask the same requests and replay to the same counters. What these
runs exercise: the engine's in-place gradient accumulation, the math attention's in-place mask
add, `_safe_softmax`'s and softmax backward's temporaries, the staging of split reductions
(RMSNorm's weight gradients), cumsum's cast and CUB scan buffers, checkpointing's recomputed
forward."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNS = json.loads((ROOT / "tests" / "h200_train_requests.json").read_text())
_spec = importlib.util.spec_from_file_location("train_requests", ROOT / "benchmarks" / "train_requests.py")
train_requests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_requests)


def label(run: dict) -> str:
    return (f"{run['config']}-{run['batch']}x{run['context']}-{run['train']}"
            f"{'-checkpointing' if run['gradient_checkpointing'] else ''}{'-autocast' if run.get('autocast') else ''}")


@pytest.mark.parametrize("run", RUNS, ids=[label(r) for r in RUNS])
def test_every_phase_asks_the_h200s_requests_and_ends_on_its_counters(run):
    assert run["torch"].startswith("2.11.0")
    traced = train_requests.traced(run)
    assert [(p["phase"], p["index"]) for p in traced] == [(p["phase"], p["index"]) for p in run["phases"]]
    for measured, mine in zip(run["phases"], traced):
        where = f"{measured['phase']} {measured['index']}"
        assert train_requests.traced_requests(mine) == measured["requests"], where
        assert {k: mine[k] for k in train_requests.COUNTERS} == \
            {k: measured[k] for k in train_requests.COUNTERS}, where


def test_the_pinned_runs_are_whole():
    """Each pinned run has model_load, inputs and four phases a step, and requests in each step."""
    for run in RUNS:
        names = [p["phase"] for p in run["phases"]]
        assert names[:2] == ["model_load", "inputs"]
        assert names[2:] == ["forward", "backward", "optimizer_step", "zero_grad"] * run["steps"]
        assert all(p["requests"] for p in run["phases"] if p["phase"] in ("forward", "backward"))
