"""lab_helpers.real.train_replay: a fine-tuning run traced once with no cap, its allocator calls replayed
under a capped allocator, against the run traced again under that cap (predict_training_model with
capacity_bytes), on a table of runs and budgets: the same overall peaks where it fits, the same
OutOfMemory (message, phase, index) where it does not; and the card's answers the same either way."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lab_helpers.allocator.budget import OutOfMemory
from lab_helpers.real.config import parse_config
from lab_helpers.real.train import TrainSpec, predict_training_model
from lab_helpers.real.train_replay import record_training

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay import reduced  # noqa: E402

MIB = 2**20
# (config, layers, spec changes): what is trained, the optimizer, checkpointing, autocast, a 4-bit base
RUNS = [
    ("llama-3.1-8b", 2, dict(batch=2, context=48)),
    ("llama-3.1-8b", 1, dict(batch=2, context=48, optimizer="sgd")),
    ("qwen2.5-7b", 2, dict(batch=1, context=64, train="lora", lora_rank=8)),
    ("qwen2.5-7b", 2, dict(batch=3, context=40, train="lora", lora_rank=4, gradient_checkpointing=True)),
    ("llama-3.1-8b", 2, dict(batch=2, context=32, dtype="float32", autocast="bfloat16")),
    ("llama-3.1-8b", 2, dict(batch=1, context=16, train="qlora", quantize="nf4", lora_rank=4)),
]


def capped(shape, spec, budget):
    """predict_training_model under `budget`: ("fits", overall) or ("out of memory", message, phase, index)."""
    try:
        return ("fits", predict_training_model(shape, spec, budget)["overall"])
    except OutOfMemory as exc:
        return ("out of memory", str(exc), exc.phase, exc.index)


def replayed(requests, budget):
    try:
        return ("fits", requests.overall(budget))
    except OutOfMemory as exc:
        return ("out of memory", str(exc), exc.phase, exc.index)


@pytest.mark.parametrize("name, layers, changes", RUNS)
def test_a_recorded_run_replayed_under_a_cap_is_the_run_traced_under_it(name, layers, changes):
    shape = parse_config(reduced(name, layers=layers, vocab_size=500), name)
    spec = TrainSpec(shape.name, steps=2, **changes)
    document, requests = record_training(shape, spec)
    assert document == predict_training_model(shape, spec)  # recording changes nothing of the prediction
    peak = document["overall"]["peak_reserved_bytes"]
    allocated = document["overall"]["peak_allocated_bytes"]
    # at and above the peak, just under it (release-and-retry), down past the peak allocated (out of memory)
    budgets = [peak + 64 * MIB, peak, peak - 1, peak - 2 * MIB, peak - 20 * MIB, (peak + allocated) // 2,
               allocated, allocated - 1, allocated // 2]
    outcomes = set()
    for budget in budgets:
        if budget <= 0:
            continue
        truth = capped(shape, spec, budget)
        assert replayed(requests, budget) == truth, budget
        outcomes.add(truth[0])
    assert outcomes == {"fits", "out of memory"}  # the table reaches both sides


def test_the_training_card_is_the_same_with_the_run_replayed():
    from conftest import ROOT
    from lab_helpers.pricing.card import load_card
    from lab_helpers.real import train_card
    shape = parse_config(reduced("qwen2.5-7b", layers=2, vocab_size=500), "qwen2.5-7b")
    spec = TrainSpec(shape.name, batch=2, context=64, steps=2, train="lora", lora_rank=8)
    rows = load_card(ROOT / "data" / "tarifs-forfaits.csv")
    budget = predict_training_model(shape, spec)["overall"]["peak_reserved_bytes"]
    # a card whose GPU models fall on both sides of the run's peak
    rows = [dict(row, memory_per_gpu_gib=round(budget / 2**30 * factor, 3)) for row, factor in
            zip(rows, [0.5, 0.9, 0.99, 1.0, 1.01, 1.2, 3.0] * (len(rows) // 7 + 1))]
    checkpointed = replace(spec, gradient_checkpointing=True)  # the cheaper forfait the card looks for
    traced = train_card.cheapest_training_forfaits(
        shape, spec, 7, rows, fits=train_card.training_fits(shape, spec, replay=False),
        checkpointed_fits=train_card.training_fits(shape, checkpointed, replay=False))
    replayed_answer = train_card.cheapest_training_forfaits(shape, spec, 7, rows)
    assert traced.pop("predictions_run") == replayed_answer.pop("predictions_run") > 2  # capped ones among them
    assert replayed_answer == traced
    assert {row["fits"] for row in traced["rows"]} == {True, False}
