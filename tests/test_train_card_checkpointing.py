"""fit --card --task train says when --gradient-checkpointing would make a cheaper forfait fit: the
checkpointed run is asked only of the GPU models cheaper than the cheapest fit, exact to the cent."""
import json
from pathlib import Path

import pytest

from lab_helpers.core.tables import LINE_WIDTH
from lab_helpers.pricing.card import load_card
from lab_helpers.real.config import load_config
from lab_helpers.real.train import TrainSpec, predict_training_model
from lab_helpers.real.train_card import cheapest_training_forfaits
from lab_helpers.real.train_tables import format_train_card

pytest.importorskip("transformers")

CARD_HEADER = ("model_id,display_name,gpus_per_lot,memory_per_gpu_gib,duration_days,lot_price_cents,currency,"
               "snapshot_date,provenance")
# floor(GiB x 149380136960 / 141): the budget of a GPU model with no known total (lab_helpers.real.budget)
BUDGETS = {2: 2118867190, 10: 10594335954, 11: 11653769550}
# tiny holds neither run; cheap holds the checkpointed run only; dear holds both
MODELS = [("tiny", 1, 2, 500), ("cheap", 1, 10, 1000), ("dear", 1, 11, 3000)]
BATCH, CONTEXT = 4, 1024


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpointing-card")
    raw = json.loads((Path(__file__).resolve().parent.parent / "data/models/qwen1.5-0.5b.json").read_text())
    raw["num_hidden_layers"] = 4
    config = folder / "qwen-4-layers.json"
    config.write_text(json.dumps(raw), encoding="utf-8")
    lines = [CARD_HEADER]
    for gpu, per_lot, gib, price in MODELS:
        for days, factor in ((3, 1), (7, 1), (30, 4)):
            lines.append(f"{gpu},GPU {gpu},{per_lot},{gib},{days},{price * factor},USD,2026-09-24,test card")
    card = folder / "card.csv"
    card.write_text("\n".join(lines) + "\n", encoding="utf-8")
    shape = load_config(str(config))
    return shape, load_card(card)


def test_the_budgets_straddle_the_two_runs(setting):
    shape, _ = setting
    assert BUDGETS == {g: g * 149380136960 // 141 for g in BUDGETS}
    plain = predict_training_model(shape, TrainSpec(shape.name, batch=BATCH, context=CONTEXT, steps=2))["overall"]
    checkpointed = predict_training_model(shape, TrainSpec(shape.name, batch=BATCH, context=CONTEXT, steps=2,
                                                           gradient_checkpointing=True))["overall"]
    # 10 GiB is below the plain run's peak allocated, above the checkpointed run's peak reserved
    assert checkpointed["peak_reserved_bytes"] <= BUDGETS[10] < plain["peak_allocated_bytes"]
    assert plain["peak_reserved_bytes"] <= BUDGETS[11]


def test_a_cheaper_forfait_with_checkpointing_is_named(setting):
    shape, rows = setting
    spec = TrainSpec(shape.name, batch=BATCH, context=CONTEXT, steps=2)
    answer = cheapest_training_forfaits(shape, spec, 7, rows, card_name="card.csv")
    assert answer["cheapest"] == "dear" and answer["rows"][0]["total_price_cents"] == 3000
    cheaper = answer["with_gradient_checkpointing"]
    capped = predict_training_model(shape, TrainSpec(shape.name, batch=BATCH, context=CONTEXT, steps=2,
                                                     gradient_checkpointing=True))["overall"]
    assert (cheaper["gpu"], cheaper["total_price_cents"], cheaper["total_price"], cheaper["saves_cents"],
            cheaper["budget_bytes"], cheaper["peak_reserved_bytes"]) == (
        "cheap", 1000, "10.00", 2000, BUDGETS[10], capped["peak_reserved_bytes"])
    assert cheaper["headroom_bytes"] == BUDGETS[10] - capped["peak_reserved_bytes"]
    lines = format_train_card(answer).splitlines()
    assert ("With --gradient-checkpointing: cheap at 10.00 USD (1000 cents), 20.00 USD (2000 cents) less than "
            "the cheapest fit above") in "\n".join(lines).replace("\n  ", " ")
    assert max(map(len, lines)) <= LINE_WIDTH


def test_no_line_when_checkpointing_is_asked_or_changes_nothing(setting):
    shape, rows = setting
    asked = TrainSpec(shape.name, batch=BATCH, context=CONTEXT, steps=2, gradient_checkpointing=True)
    answer = cheapest_training_forfaits(shape, asked, 7, rows)
    assert answer["cheapest"] == "cheap" and "with_gradient_checkpointing" not in answer
    assert "With --gradient-checkpointing" not in format_train_card(answer)
    # only the models cheaper than the cheapest fit are asked again: here none
    calls = []

    def never(degree, budget):
        calls.append(budget)
        return {"fits": False, "reason": "not asked"}
    small = TrainSpec(shape.name, batch=1, context=16, steps=2)
    without_tiny = [row for row in rows if row["model_id"] != "tiny"]
    plain = cheapest_training_forfaits(shape, small, 7, without_tiny, checkpointed_fits=never)
    assert plain["cheapest"] == "cheap" and calls == [] and "with_gradient_checkpointing" not in plain
    # with tiny, the one model cheaper than the cheapest fit, it alone is asked (with no cap first)
    plain = cheapest_training_forfaits(shape, small, 7, rows, checkpointed_fits=never)
    assert calls == [2**50, BUDGETS[2]] and "with_gradient_checkpointing" not in plain
