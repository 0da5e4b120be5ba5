"""The cheapest forfait of the rate card that fits a model run: the buyer's question.

    python -m lab_helpers.real_model fit --card --config llama-3.1-70b --dtype bfloat16 \\
        --batch 1 --context 32768 --new-tokens 4 --days 7 [--accepted-results N] [--format table]

For every GPU model of the rate card: the smallest tensor-parallel degree at which the predicted
run fits one GPU's memory on every rank, the lots that degree needs, their price for the days
asked (exact cents, from calcul_forfaits), the cost per accepted result if asked, and whether the
memory figure per GPU was measured on that GPU or derived, not measured (lab_helpers.real.budget: the
one rule `fit --gpu` uses too). Rows are
sorted by price; the GPU models that fit at no allowed degree come last.
"""
import math

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.text import printable
from lab_helpers.pricing.card import (DURATIONS_DAYS, ILLUSTRATIVE_NOTICE, MAX_ACCEPTED_RESULTS, NOTICE, RATE_CARD_PATH,
                                      ForfaitError, is_illustrative, load_card)
from lab_helpers.pricing.forfait import UNIT_COST_ROUNDING, compute_forfait
from lab_helpers.real.config import ConfigError, ModelShape, check_tensor_parallel
from lab_helpers.real.budget import MEASURED_NCCL_OUTSIDE, NCCL_REFERENCE, budget_rule_text, device_budget, nccl_outside
from lab_helpers.real.fit import MAX_FIT_DECODE_STEPS, SearchBounded, fits_at_degree
from lab_helpers.real.progress import progress_bar
from lab_helpers.real.spec import RunSpec

CARD_FIT_KIND = "iteragpu-lab cheapest forfait"
# Tensor parallelism runs over NCCL between the GPUs of one machine, and a machine holds at most 8
# of them on the usual NVLink/NVSwitch boards: degrees 1 to 8 are searched, never beyond.
CARD_MAX_DEGREE = 8
NCCL_RULE = ("at degree > 1 each rank's budget is the GPU's less the bytes NCCL holds outside the allocator: "
             "measured where MEASURED_NCCL_OUTSIDE has that GPU and degree, else the {nccl} bytes measured on "
             "two H200s at tensor parallel 2, derived, not measured")
# A budget no GPU reaches (1 PiB, real_model fit's largest --memory-bytes): a run "with no cap".
UNCAPPED_BUDGET_BYTES = 2**50
DEGREE_RULE = ("degrees 1 to {high} (the GPUs of one machine), those the model's tensor-parallel plan "
               "can shard evenly; lots = ceil(degree / GPUs per lot)")
ORDER = ("by total price, then fewer GPUs rented, then model id; GPU models that fit at no allowed "
         "degree last, by model id")
CRITERION = ("fits at degree d when every rank's predicted run (the replayed allocator, weights sharded "
             "d ways) stays within the per-GPU budget")


def gpu_budget_bytes(row: dict) -> dict:
    """The per-GPU memory budget of a rate-card row by the one rule (lab_helpers.real.budget):
    {budget_bytes, memory_source, memory_basis, cuda_total_bytes}."""
    return device_budget(row["model_id"], row["memory_per_gpu_gib"])


def degree_problem(shape: ModelShape, degree: int):
    """None when transformers' tensor-parallel plan can split the model `degree` ways, else why not."""
    try:
        check_tensor_parallel(shape, degree)
    except ConfigError as exc:  # worded as fit --card's answer says it: the flag it leaves out
        return exc.flagged(lambda name: name == "tensor_parallel") if isinstance(exc, ParameterError) else str(exc)
    return None


def nccl_outside_bytes(gpu: str, degree: int) -> tuple:
    """(bytes, source) NCCL holds outside the allocator per rank of `gpu` at `degree` (0 at degree 1),
    by the one rule (lab_helpers.real.budget.nccl_outside)."""
    entry = nccl_outside(gpu, degree)
    return entry["nccl_outside_allocator_bytes"], entry["nccl_source"]


def rank_budget_bytes(gpu: str, gpu_budget: int, degree: int) -> int:
    """What one rank's allocator may reserve at `degree` on a `gpu` of `gpu_budget` usable bytes."""
    return gpu_budget - nccl_outside_bytes(gpu, degree)[0]


def check_request(days, accepted_results) -> None:
    """Raise ParameterError unless `days` is a forfait duration and `accepted_results` None or 1..10^15."""
    if days not in DURATIONS_DAYS:
        raise ParameterError("days", f"must be one of {', '.join(map(str, DURATIONS_DAYS))}, got {days!r}")
    if accepted_results is not None and (isinstance(accepted_results, bool) or not isinstance(accepted_results, int)
                                         or not 1 <= accepted_results <= MAX_ACCEPTED_RESULTS):
        raise ParameterError("accepted_results", f"must be a whole number from 1 to {MAX_ACCEPTED_RESULTS}, "
                                                 f"got {accepted_results!r}")


def capped_where_needed(cache: dict, predict, degree: int, budget: int) -> dict:
    """`predict(degree, budget)`'s answer for `budget`, through `cache`: the run with no cap
    (UNCAPPED_BUDGET_BYTES) first, once per degree, then a capped run only where it is needed."""
    # Every budget of the card faces the same traced run: under a budget at or above that run's peak
    # reserved with no cap, the capped allocator never reaches its cap, so it replays the same
    # requests to the same peaks, and the run with no cap answers every such budget. A budget below
    # that peak needs its own capped run: there the capped allocator releases its wholly free cached
    # segments and retries before failing, as PyTorch does, so the run may still fit (with a lower
    # peak reserved) or not.
    if (degree, None) not in cache:
        cache[(degree, None)] = predict(degree, UNCAPPED_BUDGET_BYTES)
    free = cache[(degree, None)]
    if free["fits"] and free["peak_reserved_bytes"] <= budget:
        return free
    if (degree, budget) not in cache:
        cache[(degree, budget)] = predict(degree, budget)
    return cache[(degree, budget)]


def card_models(rows: list, days: int) -> dict:
    """{model_id: its row of `days`} in the card's own order (every model has a row for every duration)."""
    models = {}
    for row in rows:
        if row["duration_days"] == days:
            models.setdefault(row["model_id"], row)
    return models


def card_entry(gpu: str, row: dict, budget: dict, fits: bool) -> dict:
    """The columns of every answer row: the GPU model, whether the run fits, its budget (gpu_budget_bytes)."""
    return {"gpu": gpu, "display_name": row["display_name"], "fits": fits,
            "memory_per_gpu_gb": row["memory_per_gpu_gib"], **budget}


def priced_entry(entry: dict, rows: list, row: dict, days: int, degree: int, point: dict,
                 accepted_results=None) -> dict:
    """`entry` (card_entry's) of a GPU model that fits at `degree`, with the run's peaks (`point`), the
    lots that degree needs and their price for `days` (exact cents, lab_helpers.pricing.forfait)."""
    gpu = entry["gpu"]
    nccl, nccl_source = nccl_outside_bytes(gpu, degree)
    rank_budget = entry["budget_bytes"] - nccl
    lots = math.ceil(degree / row["gpus_per_lot"])
    price = compute_forfait(rows, gpu, days, lots, accepted_results)
    entry.update({
        "tensor_parallel": degree, "lots": lots, "gpus_per_lot": row["gpus_per_lot"],
        "gpus": price["gpus"], "idle_gpus": price["gpus"] - degree,
        "peak_reserved_bytes": point["peak_reserved_bytes"],
        "peak_allocated_bytes": point["peak_allocated_bytes"],
        "nccl_outside_allocator_bytes": nccl, "nccl_source": nccl_source,
        "rank_budget_bytes": rank_budget,
        "headroom_bytes": rank_budget - point["peak_reserved_bytes"],
        "lot_price_cents": price["lot_price_cents"], "total_price_cents": price["total_price_cents"],
        "total_price": price["total_price"], "unit_cost_cents": price["unit_cost_cents"],
        "unit_cost": price["unit_cost"],
    })
    return entry


def card_heading(rows: list, days: int, accepted_results, card_name: str) -> dict:
    """What an answer says of the forfaits it prices: duration, accepted results, currency, card."""
    return {"days": days, "accepted_results": accepted_results, "currency": rows[0]["currency"],
            "rate_card": printable(card_name),
            "snapshot_date": ", ".join(sorted({r["snapshot_date"] for r in rows}))}


def card_answer(rows: list, fitting: list, not_fitting: list) -> dict:
    """{cheapest, rows, notice}: the entries that fit by price, then fewer GPUs, then model id; those
    that do not, last by model id; the card's notice."""
    fitting = sorted(fitting, key=lambda e: (e["total_price_cents"], e["gpus"], e["gpu"]))
    return {"cheapest": fitting[0]["gpu"] if fitting else None,
            "rows": fitting + sorted(not_fitting, key=lambda e: e["gpu"]),
            "notice": NOTICE + (ILLUSTRATIVE_NOTICE if any(map(is_illustrative, rows)) else "")}


def cheapest_forfaits(shape: ModelShape, spec: RunSpec, days: int, rows: list, accepted_results=None,
                      fits=None, max_degree: int = CARD_MAX_DEGREE, card_name: str = "", trace_cache=None) -> dict:
    """For every GPU model of the card `rows`: the smallest degree that fits, its lots and price.

    `fits(degree, rank_budget_bytes) -> {"fits", "peak_reserved_bytes", "peak_allocated_bytes"}`
    (the worst rank's) defaults to lab_helpers.real.fit.fits_at_degree; it is called at most once per
    (degree, budget), first with no cap (UNCAPPED_BUDGET_BYTES), then only for the budgets below
    that run's peak reserved. Only the degrees lab_helpers.real.config.check_tensor_parallel accepts are
    tried."""
    check_request(days, accepted_results)
    if fits is None:
        def fits(degree, budget):
            return fits_at_degree(shape, spec, degree, budget, trace_cache)
    allowed, refused = [], {}
    for degree in range(1, max_degree + 1):
        problem = degree_problem(shape, degree)
        if problem is None:
            allowed.append(degree)
        else:
            refused[str(degree)] = problem
    cache = {}
    # each prediction at degree d traces d ranks of new_tokens decode steps: the search stops before
    # the steps traced in all pass MAX_FIT_DECODE_STEPS (the first one always runs), and the GPU
    # models left are reported as not searched
    spent = [0]

    def predict_once(degree, budget):
        cost = degree * spec.new_tokens
        if cache and spent[0] + cost > MAX_FIT_DECODE_STEPS:
            raise SearchBounded
        spent[0] += cost
        return fits(degree, budget)

    def fits_once(degree, budget):
        return capped_where_needed(cache, predict_once, degree, budget)

    fitting, not_fitting, unsearched = [], [], []
    models = card_models(rows, days)
    for gpu, row in progress_bar(len(models), "card: GPU models", "GPU model", models.items()):
        budget = gpu_budget_bytes(row)
        try:
            found = next(((d, fits_once(d, rank_budget_bytes(gpu, budget["budget_bytes"], d))) for d in allowed
                          if fits_once(d, rank_budget_bytes(gpu, budget["budget_bytes"], d))["fits"]), None)
        except SearchBounded:
            unsearched.append(gpu)
            not_fitting.append({**card_entry(gpu, row, budget, False),
                                "reason": "not searched: the search reached its bound (search_bound)"})
            continue
        entry = card_entry(gpu, row, budget, found is not None)
        if found is None:
            entry["reason"] = (f"does not fit at any allowed degree ({', '.join(map(str, allowed))})"
                               if allowed else "no allowed degree")
            if allowed:
                last = fits_once(allowed[-1], rank_budget_bytes(gpu, budget["budget_bytes"], allowed[-1]))
                if last.get("reason"):
                    entry["reason"] += f"; at {allowed[-1]}: {last['reason']}"
            not_fitting.append(entry)
            continue
        degree, point = found
        fitting.append(priced_entry(entry, rows, row, days, degree, point, accepted_results))
    return {
        "kind": CARD_FIT_KIND,
        "configuration": {"config_name": shape.name, "dtype": spec.dtype, "batch": spec.batch,
                          "context": spec.context, "new_tokens": spec.new_tokens},
        **card_heading(rows, days, accepted_results, card_name),
        "allowed_degrees": allowed, "refused_degrees": refused,
        "degree_rule": DEGREE_RULE.format(high=max_degree), "nccl_rule": NCCL_RULE.format(nccl=MEASURED_NCCL_OUTSIDE[NCCL_REFERENCE][0]),
        "memory_rule": budget_rule_text(),
        "criterion": CRITERION, "order": ORDER, "unit_cost_rounding": UNIT_COST_ROUNDING,
        "predictions_run": len(cache),
        "search_bound": (f"at most {MAX_FIT_DECODE_STEPS} decode steps traced in all (ranks x new tokens per "
                         f"prediction), degrees 1 to {max_degree}"
                         + (f"; the bound was reached: {', '.join(unsearched)} not searched" if unsearched else "")),
        **card_answer(rows, fitting, not_fitting),
    }


def read_card(tariffs=None) -> tuple:
    """(rows, shown name) of the rate card at `tariffs` (default data/tarifs-forfaits.csv)."""
    path = RATE_CARD_PATH if tariffs is None else tariffs
    shown = RATE_CARD_PATH.name if tariffs is None else tariffs
    try:
        return load_card(path, shown), printable(shown)
    except ForfaitError as exc:
        raise LabError(str(exc)) from None


def card_fit(shape: ModelShape, spec: RunSpec, days: int, accepted_results=None, tariffs=None,
             trace_cache=None) -> dict:
    """cheapest_forfaits on the rate card file `tariffs` (default: the lab's card)."""
    check_request(days, accepted_results)
    rows, shown = read_card(tariffs)
    return cheapest_forfaits(shape, spec, days, rows, accepted_results, card_name=shown, trace_cache=trace_cache)
