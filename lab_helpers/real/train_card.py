"""The cheapest forfait of the rate card whose one GPU holds a fine-tuning run: the buyer's question
for training.

    python -m lab_helpers.real_model fit --card --task train --config qwen1.5-0.5b --train lora \\
        --lora-rank 16 --batch 4 --context 1024 --days 7 [--accepted-results N] [--format table]

For every GPU model of the rate card: whether two optimizer steps of the run (its --train, optimizer,
dtype, gradient checkpointing, batch and context, as `fit --task train` predicts them) fit one GPU of
that model, the lots one GPU needs, their price for the days asked (exact cents), the cost per accepted
result if asked, and whether the GPU's memory figure was measured or derived, not measured: the
columns, budget rule, prices and order of lab_helpers.real.card_fit, whose pieces this module
calls (its table: lab_helpers.real.train_tables.format_train_card). Tensor-parallel training is out of
scope of the lab: every GPU model is asked at degree 1 only, and one whose one GPU cannot hold the run
is listed last as not fitting.
"""
from dataclasses import replace

from lab_helpers.pricing.forfait import UNIT_COST_ROUNDING
from lab_helpers.real.budget import budget_rule_text
from lab_helpers.real.card_fit import (UNCAPPED_BUDGET_BYTES, capped_where_needed, card_answer, card_entry,
                                       card_heading, card_models, check_request, gpu_budget_bytes, priced_entry,
                                       read_card)
from lab_helpers.real.config import ModelShape
from lab_helpers.real.progress import progress_bar
from lab_helpers.real.train import TrainSpec, predict_training_model
from lab_helpers.real.train_fit import TRAIN_FIT_CRITERION, TRAIN_FIT_STEPS

TRAIN_CARD_KIND = "iteragpu-lab cheapest forfait, fine-tuning"
TRAIN_CARD_DEGREE = 1
TRAIN_DEGREE_RULE = ("degree 1 only: tensor-parallel training is out of scope, so each GPU model is asked "
                     "whether one GPU holds the run; lots = ceil(1 / GPUs per lot) = 1")
TRAIN_ORDER = ("by total price, then fewer GPUs rented, then model id; GPU models whose one GPU cannot hold "
               "the run last, by model id")
NOT_ON_ONE_GPU = "does not fit one GPU (degree 1 only: tensor-parallel training is out of scope)"


def training_fits(shape: ModelShape, spec: TrainSpec, replay: bool = True):
    """fits(degree, budget) for capped_where_needed: `spec` predicted on one GPU, with no cap at
    UNCAPPED_BUDGET_BYTES, else under the replayed allocator capped at `budget`:
    {fits, peak_reserved_bytes, peak_allocated_bytes} or {fits: False, reason}. The run is traced once,
    with no cap, and each budget replays its allocator calls (lab_helpers.real.train_replay); `replay`
    False traces it again under each budget (the path the replay is checked against)."""
    from lab_helpers.allocator.budget import OutOfMemory
    from lab_helpers.real.train_replay import record_training
    recorded = {}

    def overall(budget):
        if not replay:
            return predict_training_model(shape, spec, None if budget == UNCAPPED_BUDGET_BYTES else budget)["overall"]
        if "requests" not in recorded:
            recorded["document"], recorded["requests"] = record_training(shape, spec)
        if budget == UNCAPPED_BUDGET_BYTES:
            return recorded["document"]["overall"]
        return recorded["requests"].overall(budget)

    def fits(degree, budget):
        if degree != TRAIN_CARD_DEGREE:
            raise LabError("tensor-parallel training is out of scope: one GPU only")
        try:
            peaks = overall(budget)
        except OutOfMemory as exc:
            where = exc.phase if exc.index is None else f"{exc.phase} #{exc.index}"
            return {"fits": False, "reason": f"out of memory in {where}: {exc}"}
        return {"fits": True, **peaks}
    return fits


def training_configuration(shape: ModelShape, spec: TrainSpec) -> dict:
    """The run an answer prices, as its JSON names it (TrainSpec.record less the device and seed)."""
    record = spec.record()
    return {"config_name": shape.name,
            **{key: value for key, value in record.items() if key not in ("kind", "config_name", "device", "seed")}}


def cheaper_with_checkpointing(rows: list, days: int, candidates: list, fits, accepted_results=None) -> tuple:
    """(the cheapest entry among `candidates` [(gpu, row, budget)] whose one GPU holds the run of `fits`, or
    None; the predictions run): the candidates are tried by price, so the first that fits is the answer."""
    from lab_helpers.pricing.forfait import compute_forfait
    cache = {}
    priced = sorted(candidates, key=lambda c: (compute_forfait(rows, c[0], days, 1, accepted_results)
                                               ["total_price_cents"], c[0]))
    for gpu, row, budget in priced:
        point = capped_where_needed(cache, fits, TRAIN_CARD_DEGREE, budget["budget_bytes"])
        if point["fits"]:
            entry = priced_entry(card_entry(gpu, row, budget, True), rows, row, days, TRAIN_CARD_DEGREE, point,
                                 accepted_results)
            return entry, len(cache)
    return None, len(cache)


def cheapest_training_forfaits(shape: ModelShape, spec: TrainSpec, days: int, rows: list, accepted_results=None,
                               fits=None, card_name: str = "", checkpointed_fits=None) -> dict:
    """For every GPU model of the card `rows`: does `spec` (TRAIN_FIT_STEPS optimizer steps) fit one
    GPU of it, and if so the lot and its price.

    `fits(degree, budget) -> {"fits", "peak_reserved_bytes", "peak_allocated_bytes"}` (or with
    "reason" when it does not fit) defaults to training_fits; through capped_where_needed it runs once
    with no cap, then once more per budget below that run's peak reserved.

    Without gradient checkpointing, the GPU models cheaper than the cheapest fit (all, where none fits)
    are asked again with it (`checkpointed_fits`, default training_fits of that run): where one holds
    it, "with_gradient_checkpointing" names the cheapest such forfait, a cheaper answer the flag gives."""
    check_request(days, accepted_results)
    spec = replace(spec, steps=TRAIN_FIT_STEPS)
    fits = training_fits(shape, spec) if fits is None else fits
    cache, fitting, not_fitting, refused = {}, [], [], []
    models = card_models(rows, days)
    for gpu, row in progress_bar(len(models), "card: GPU models", "GPU model", models.items()):
        budget = gpu_budget_bytes(row)
        point = capped_where_needed(cache, fits, TRAIN_CARD_DEGREE, budget["budget_bytes"])
        entry = card_entry(gpu, row, budget, point["fits"])
        if point["fits"]:
            fitting.append(priced_entry(entry, rows, row, days, TRAIN_CARD_DEGREE, point, accepted_results))
        else:
            entry["reason"] = f"{NOT_ON_ONE_GPU}; {point['reason']}"
            not_fitting.append(entry)
            refused.append((gpu, row, budget))
    answer = card_answer(rows, fitting, not_fitting)
    extra, checkpointed_predictions = {}, 0
    if not spec.gradient_checkpointing and refused:
        # only the models that did not fit can lower the price, and only those below the cheapest fit:
        # the checkpointed run is predicted for them alone, not for the whole card
        cheapest = min((e["total_price_cents"] for e in fitting), default=None)
        from lab_helpers.pricing.forfait import compute_forfait
        candidates = [c for c in refused if cheapest is None or
                      compute_forfait(rows, c[0], days, 1, accepted_results)["total_price_cents"] < cheapest]
        if candidates:
            checkpointed = replace(spec, gradient_checkpointing=True)
            found, checkpointed_predictions = cheaper_with_checkpointing(
                rows, days, candidates,
                training_fits(shape, checkpointed) if checkpointed_fits is None else checkpointed_fits,
                accepted_results)
            if found is not None:
                extra["with_gradient_checkpointing"] = {
                    key: found[key] for key in ("gpu", "display_name", "lots", "gpus", "total_price_cents",
                                                "total_price", "unit_cost_cents", "unit_cost", "budget_bytes",
                                                "memory_source", "peak_reserved_bytes", "peak_allocated_bytes",
                                                "headroom_bytes")}
                if cheapest is not None:
                    extra["with_gradient_checkpointing"]["saves_cents"] = cheapest - found["total_price_cents"]
    return {
        "kind": TRAIN_CARD_KIND,
        "configuration": training_configuration(shape, spec),
        **card_heading(rows, days, accepted_results, card_name),
        "allowed_degrees": [TRAIN_CARD_DEGREE], "degree_rule": TRAIN_DEGREE_RULE,
        "memory_rule": budget_rule_text(),
        "criterion": TRAIN_FIT_CRITERION, "order": TRAIN_ORDER, "unit_cost_rounding": UNIT_COST_ROUNDING,
        "predictions_run": len(cache) + checkpointed_predictions,
        **answer, **extra,
    }


def train_card_fit(shape: ModelShape, spec: TrainSpec, days: int, accepted_results=None, tariffs=None) -> dict:
    """cheapest_training_forfaits on the rate card file `tariffs` (default: the lab's card)."""
    check_request(days, accepted_results)
    rows, shown = read_card(tariffs)
    return cheapest_training_forfaits(shape, spec, days, rows, accepted_results, card_name=shown)
