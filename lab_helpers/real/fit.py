"""Does a real model's run fit a GPU, and the largest batch and context that do: predictions under a
replayed allocator capped at the budget, with no GPU. A rate-card GPU's budget is the one rule of
lab_helpers.real.budget."""
import functools
import sys
from dataclasses import replace

from lab_helpers.allocator.settings import DEFAULT_SETTINGS, AllocatorSettings
from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.numbers import parse_device
from lab_helpers.measurement.environment import usable_memory
from lab_helpers.pricing.card import RATE_CARD_PATH, ForfaitError, load_card
from lab_helpers.real.budget import budget_source_text, rank_budget
from lab_helpers.real.config import ConfigError, ModelShape, check_tensor_parallel
from lab_helpers.real.predict import fake_process_group, load_for_prediction, predict_model
from lab_helpers.real.search import Probe, largest_fitting
from lab_helpers.real.spec import MAX_MODEL_BATCH, MAX_MODEL_CONTEXT, MAX_TOKENS, RunSpec

# What a real-model measuring process holds outside the allocator (cuBLAS, cuDNN attention, argmax
# kernels) is loaded before the search, so the figure is what such a process can reach; handed to
# lab_helpers.measurement.environment.usable_memory, which runs it in a child process (argv: the device index).
USABLE_PROBE = r"""
import json, sys, torch
DEVICE = f"cuda:{int(sys.argv[1])}"
torch.cuda.set_device(DEVICE)
torch.cuda.init()
x = torch.ones(64, 64, device=DEVICE, dtype=torch.bfloat16)
torch.nn.functional.linear(x, x, x[0]) @ x
q = torch.ones(1, 2, 64, 64, device=DEVICE, dtype=torch.bfloat16)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
x.argmax(-1)
torch.cuda.synchronize()
torch.cuda.empty_cache()
held = torch.cuda.memory_reserved(DEVICE)
step = 2 * 2**20  # the allocator rounds large blocks to 2 MiB
low, high = 0, torch.cuda.mem_get_info(DEVICE)[0] // step + 1
while high - low > 1:
    middle = (low + high) // 2
    try:
        block = torch.empty(middle * step, dtype=torch.uint8, device=DEVICE)
        del block
        low = middle
    except torch.OutOfMemoryError:
        high = middle
    torch.cuda.empty_cache()
print(json.dumps({"usable_memory_bytes": held + low * step}))
"""
def usable_memory_bytes(device: str = "cuda:0") -> int:
    """The largest reserved a fresh real-model measuring process can reach on `device`, measured now
    in a child process; LabError when no GPU answers."""
    index = parse_device(device)
    import torch
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        # the probe's own failure would name torch internals (a build without CUDA has no _cuda_setDevice)
        raise ParameterError(None, f"no GPU visible as {device}: give {{gpu}} or {{memory_bytes}}", ("gpu", "memory_bytes"))
    answer = usable_memory(index, command=[sys.executable, "-c", USABLE_PROBE, str(index)])
    if not isinstance(answer["usable_memory_bytes"], int):
        raise LabError(f"cannot measure the usable memory of {device} "
                       f"({answer['usable_memory_unavailable_reason']}); give --gpu or --memory-bytes")
    return answer["usable_memory_bytes"]


def gpu_budget(gpu: str, tariffs=None, tensor_parallel: int = 1) -> tuple:
    """(bytes, source) of one rank of a rate-card GPU model at `tensor_parallel`: the one rule of
    lab_helpers.real.budget (measured where the lab measured that GPU, else derived, not measured,
    from its total memory or the card's figure; less NCCL's bytes outside the allocator at N > 1).
    `tariffs` is a rate card path (default data/tarifs-forfaits.csv)."""
    entry = gpu_budget_entry(gpu, tariffs, tensor_parallel)
    return entry["rank_budget_bytes"], budget_source_text(entry, tensor_parallel)


def gpu_budget_entry(gpu: str, tariffs=None, tensor_parallel: int = 1) -> dict:
    """lab_helpers.real.budget.rank_budget of the rate card's row for `gpu`; LabError if none."""
    try:
        rows = load_card(tariffs or RATE_CARD_PATH)
    except ForfaitError as exc:
        raise LabError(str(exc)) from None
    found = [row for row in rows if row["model_id"] == gpu]
    if not found:
        # a GPU the card lacks is still answered: by its budget in bytes, or by a card that has it
        choices = ", ".join(sorted({r["model_id"] for r in rows}))
        raise ParameterError(None, f"unknown {{gpu}} {gpu!r}; valid choices: {choices}; or give the budget with "
                             "{memory_bytes} N, or a rate card that has it with {tariffs} PATH",
                             ("gpu", "memory_bytes", "tariffs"))
    return rank_budget(gpu, found[0]["memory_per_gpu_gib"], tensor_parallel)


def _fits(shape: ModelShape, spec: RunSpec, budget: int, loaded: dict) -> dict:
    """{"fits", and the peaks under the budget where it fits, else "uncapped": a function giving the
    peaks with no cap}: a run that does not fit is replayed again from its trace with no cap, its peaks
    guiding fit's search (lab_helpers.real.search), only when the search reads them."""
    from lab_helpers.allocator.budget import OutOfMemory
    try:
        prediction = predict_model(shape, spec, capacity_bytes=budget, loaded=loaded)
    except OutOfMemory:
        @functools.cache  # the point's probe may be read by both searches
        def uncapped():
            overall = predict_model(shape, spec, capacity_bytes=None, loaded=loaded)["overall"]
            return overall["peak_reserved_bytes"], overall["peak_allocated_bytes"]
        return {"fits": False, "uncapped": uncapped}
    return {"fits": True, "peak_reserved_bytes": prediction["overall"]["peak_reserved_bytes"],
            "peak_allocated_bytes": prediction["overall"]["peak_allocated_bytes"]}


def fits_at_degree(shape: ModelShape, spec: RunSpec, degree: int, budget_bytes: int, trace_cache=None) -> dict:
    """Does `spec` fit `degree` GPUs of `budget_bytes` each, the model split with transformers' plan?

    `budget_bytes` is what one rank's allocator may reserve (a GPU's usable memory less what
    NCCL holds outside the allocator, when known). Rank 0's run is predicted with no GPU under a
    replayed allocator capped at the budget (see `fit`'s criterion); its trace is every rank's
    (rank_zero_replay). Returns
    {"fits": bool, "peak_reserved_bytes": int | None, "peak_allocated_bytes": int | None,
    "reason": str | None}: the peaks are the worst rank's (None when it does not fit);
    "reason" says why not (a degree the plan cannot split the model by, weights and cache
    beyond the budget, or the rank that ran out). Raises LabError on a bad spec or budget. The traces
    come from `trace_cache` (lab_helpers.real.trace_cache; default the user's cache folder)."""
    spec = replace(spec, tensor_parallel=1)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise LabError(f"the memory budget must be a whole number of bytes > 0, got {budget_bytes!r}")
    no = {"fits": False, "peak_reserved_bytes": None, "peak_allocated_bytes": None}
    try:
        check_tensor_parallel(shape, degree)
    except ConfigError as exc:
        return {**no, "reason": str(exc)}
    # Each rank holds at least 1/N of every weight and of the key/value cache at the last
    # decode step (a split tensor's shards sum to it; a whole one is on every rank): beyond
    # the budget the run cannot fit, whatever the allocator does.
    held = shape.parameter_bytes(spec.dtype) + shape.kv_cache_bytes(spec.batch, spec.context + spec.new_tokens,
                                                                     spec.dtype)
    if -(-held // degree) > budget_bytes:
        return {**no, "reason": f"weights and key/value cache alone take {-(-held // degree)} bytes per rank"}
    from lab_helpers.allocator.budget import OutOfMemory
    try:
        overall = rank_zero_replay(shape, replace(spec, tensor_parallel=degree), budget_bytes, trace_cache)
    except OutOfMemory as exc:
        return {**no, "reason": f"out of memory in the replayed allocator: {exc}"}
    return {"fits": True, "peak_reserved_bytes": overall["peak_reserved_bytes"],
            "peak_allocated_bytes": overall["peak_allocated_bytes"], "reason": None}


def rank_zero_replay(shape: ModelShape, spec: RunSpec, capacity_bytes: int, trace_cache=None) -> dict:
    """The overall peaks of rank 0 of `spec` under `capacity_bytes` (OutOfMemory when it runs out), from
    its trace (made or read once): N divides every size the plan splits (checked), so each rank's
    local shapes are the same and the collectives symmetric, and a rank's number reaches no size of
    this protocol: every rank's trace is rank 0's (tests/test_replay.py compares them)."""
    from lab_helpers.real.trace_cache import default_cache
    from lab_helpers.real.traces import ModelNeeded, TraceSession
    session = TraceSession(shape, spec.dtype, spec.tensor_parallel, 0, trace_cache or default_cache())
    try:
        return session.replay(spec, capacity_bytes, ())["overall"]
    except ModelNeeded:  # a trace is missing: rank 0's model is built in its process group
        with fake_process_group(0, spec.tensor_parallel) as mesh:
            return session.replay(spec, capacity_bytes, (), mesh)["overall"]


# What set a largest-size answer (fit's "largest_context_bound", "largest_batch_bound"): the budget, the
# model's positions, the weights alone, the search's number of predictions, or the lab's size limits
# (MAX_TOKENS, MAX_MODEL_BATCH, MAX_MODEL_CONTEXT): a figure at the model's positions is not memory's.
ANSWER_BOUNDS = ("memory", "positions", "weights", "search bound", "size limit")


def answer_bound(shape: ModelShape, key: str, answer: int, limit: int, weights_fit: bool, stopped: bool,
                 batch, context, new_tokens: int) -> str:
    """Which of ANSWER_BOUNDS set fit's `key` answer, `answer`, the largest size up to `limit`."""
    if not weights_fit:
        return "weights"
    if stopped:
        return "search bound"
    if key == "largest_context_at_batch":
        if answer >= limit:
            # _fit_search's limit: the positions less the new tokens, where below MAX_MODEL_CONTEXT's
            return "positions" if shape.max_positions and max(shape.max_positions - new_tokens, 1) == limit \
                else "size limit"
        return "size limit" if batch * (answer + 1 + new_tokens) > MAX_TOKENS else "memory"
    return "size limit" if answer >= limit else "memory"


def weights_beyond(shape: ModelShape, dtype: str, budget_bytes: int, degree: int, mesh, allocator, trace_cache) -> dict:
    """Why no size fits: {"weights_bytes": what the load holds (replayed with no cap), "reason"}, and for a
    --quantize shape the parameters bitsandbytes leaves in `dtype` (lab_helpers.real.kept_weights)."""
    weights = load_for_prediction(shape, dtype, None, degree, mesh, allocator, trace_cache)["weights_bytes"]
    out = {"weights_bytes": weights,
           "reason": f"the weights alone, {weights} bytes, exceed the budget of {budget_bytes} bytes"}
    if shape.quantization:
        from lab_helpers.real.kept_weights import kept_parameters
        kept = kept_parameters(shape, dtype)
        out["unquantized_parameters"] = kept
        if kept["kept"]:
            largest = kept["kept"][0]
            out["reason"] += (f"; bitsandbytes quantizes only torch.nn.Linear layers (not the output head), so "
                              f"{kept['kept_bytes']} bytes of parameters stay in {dtype}, "
                              f"{largest['bytes']} of them the {largest['tensor_dims']}-D parameters of "
                              f"{largest['module_class']}")
    return out


# Every search is bounded by the model's limits (positions, MAX_TOKENS) and by a number of
# predictions: each one traces new_tokens decode steps, so the bound shrinks as they grow. Past
# it the search stops, the largest size found so far is kept (a lower bound) and the output says so.
MAX_FIT_PREDICTIONS = 64
MAX_FIT_DECODE_STEPS = 2**15


def prediction_limit(new_tokens: int) -> int:
    """Predictions one fit may run: MAX_FIT_PREDICTIONS, fewer when each traces many decode steps."""
    return max(2, min(MAX_FIT_PREDICTIONS, MAX_FIT_DECODE_STEPS // max(new_tokens, 1)))


class SearchBounded(Exception):
    """The card's search reached its number of predictions (internal: caught where the search runs)."""


def fit_model(shape: ModelShape, dtype: str, new_tokens: int, budget_bytes: int, budget_source: str,
        batch=None, context=None, progress=None, tensor_parallel: int = 1,
        allocator: AllocatorSettings = DEFAULT_SETTINGS, trace_cache=None) -> dict:
    """Does (batch, context) fit the budget, and the largest context at `batch` and batch at `context`.

    At tensor parallel N the budget is one GPU's (what one rank may reserve) and the search runs
    on rank 0: N divides every size the plan splits (checked), so each rank's local shapes are
    the same and the collectives symmetric; a rank's number reaches no size of this protocol, so
    every rank's trace is rank 0's (predict runs them all, and the tests compare them)."""
    if batch is None and context is None:
        raise ParameterError(None, "give {batch}, {context} or both", ("batch", "context"))
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise LabError(f"the memory budget must be a whole number of bytes > 0, got {budget_bytes!r}")
    base = RunSpec(shape.name, dtype=dtype, batch=batch or 1, context=context or 1, new_tokens=new_tokens,
                   decode_record_every=new_tokens, tensor_parallel=tensor_parallel)
    check_tensor_parallel(shape, tensor_parallel)
    if tensor_parallel == 1:
        return _fit_search(shape, base, budget_bytes, budget_source, batch, context, progress, None, allocator,
                           trace_cache)
    with fake_process_group(0, tensor_parallel) as mesh:
        return _fit_search(shape, base, budget_bytes, budget_source, batch, context, progress, mesh, allocator,
                           trace_cache)


def _fit_search(shape: ModelShape, base: RunSpec, budget_bytes: int, budget_source: str, batch, context,
                progress, mesh, allocator: AllocatorSettings = DEFAULT_SETTINGS, trace_cache=None) -> dict:
    dtype, new_tokens, degree = base.dtype, base.new_tokens, base.tensor_parallel
    local = replace(shape, kv_heads=shape.kv_heads // degree)  # one rank's key/value heads
    context_limit = MAX_MODEL_CONTEXT - new_tokens
    if shape.max_positions:
        context_limit = min(context_limit, max(shape.max_positions - new_tokens, 1))
    if context is not None and context > context_limit:  # before any prediction
        raise ParameterError("context", f"{context} is beyond the model's {shape.max_positions} positions "
                                        f"minus {new_tokens} new tokens")
    from lab_helpers.allocator.budget import OutOfMemory
    cache, predictions = {}, []
    limit = prediction_limit(new_tokens)
    try:
        loaded = load_for_prediction(shape, dtype, budget_bytes, degree, mesh, allocator, trace_cache)
    except OutOfMemory:
        loaded = None  # the weights alone do not fit

    def may_fit(b, t):
        # the weights and the full KV cache are both allocated at the end of the last decode step:
        # beyond the budget, the run cannot fit, whatever the allocator does (no prediction needed)
        return (b * (t + new_tokens) <= MAX_TOKENS and
                loaded["weights_bytes"] + local.kv_cache_bytes(b, t + new_tokens, dtype) <= budget_bytes)

    from lab_helpers.real.progress import progress_bar
    bar = progress_bar(None, f"fit {shape.name}", "prediction")

    def probe(b, t):
        """The search's Probe of (b, t), predicted once; None once the search's bound is reached."""
        if (b, t) not in cache:
            if loaded is None or not may_fit(b, t):
                cache[(b, t)] = {"fits": False}
            elif len(predictions) >= limit:
                return None
            else:
                bar.set_postfix_str(f"batch {b}, context {t}")
                cache[(b, t)] = _fits(shape, replace(base, batch=b, context=t), budget_bytes, loaded)
                predictions.append((b, t))
                bar.update()
            if progress:
                progress(b, t, cache[(b, t)]["fits"])
        found = cache[(b, t)]
        return Probe(found["fits"], found.get("peak_reserved_bytes"), found.get("peak_allocated_bytes"),
                     found.get("uncapped"))

    def ceiling(high, holds):
        """The largest v in [0, high] where holds(v) (monotone: weights and cache grow with v), by the
        same search, with no prediction."""
        return largest_fitting(lambda v: Probe(holds(v)), high, budget_bytes)[0]

    result = {
        "config_name": shape.name, "dtype": dtype, "new_tokens": new_tokens,
        **({"quantization": shape.quantization} if shape.quantization else {}),  # a --quantize value
        **({"tensor_parallel": degree, "budget_per": "rank (one GPU)"} if degree > 1 else {}),
        "budget_bytes": budget_bytes, "budget_source": budget_source,
        "criterion": ("the run fits when the replayed allocator never needs more than the budget, "
                      "after releasing its wholly free cached segments as PyTorch does before an "
                      "out-of-memory error; peak reserved is then at most the budget"),
        "allocator_conf": allocator.conf_text(),
    }
    if allocator.expandable_segments:
        result["criterion"] = ("the run fits when the replayed allocator (expandable_segments:True) never needs "
                               "pages beyond the budget, after unmapping every whole free page as PyTorch does "
                               "before an out-of-memory error; peak reserved is then at most the budget")
    if batch is not None and context is not None:
        # the point is predicted first, whatever the bound, and each search starts from it
        point = ({"fits": False} if loaded is None else
                 _fits(shape, replace(base, batch=batch, context=context), budget_bytes, loaded))
        cache[(batch, context)] = point
        result.update({"batch": batch, "context": context, "fits": point["fits"],
                       "peak_reserved_bytes": point.get("peak_reserved_bytes"),
                       "headroom_bytes": budget_bytes - point["peak_reserved_bytes"] if point["fits"] else None})
    bounded = []
    if batch is not None:
        result["batch"] = batch  # the table names it
        high = ceiling(context_limit, lambda t: loaded is not None and may_fit(batch, t))
        result["largest_context_at_batch"], stopped = largest_fitting(lambda t: probe(batch, t), high, budget_bytes,
                                                                      start=context)
        result["context_bound"] = context_limit
        if stopped:
            bounded.append("largest_context_at_batch")
    if context is not None:
        high = min(MAX_MODEL_BATCH, MAX_TOKENS // (context + new_tokens))
        result["context"] = context
        result["largest_batch_at_context"], stopped = largest_fitting(
            lambda b: probe(b, context),
            ceiling(high, lambda b: loaded is not None and may_fit(b, context)), budget_bytes, start=batch)
        result["batch_bound"] = high
        if stopped:
            bounded.append("largest_batch_at_context")
    bar.close()
    result["weights_fit"] = loaded is not None
    if loaded is None:
        result.update(weights_beyond(shape, dtype, budget_bytes, degree, mesh, allocator, trace_cache))
    sizes_limit = {"largest_context_at_batch": context_limit, "largest_batch_at_context": result.get("batch_bound")}
    for key in ("largest_context_at_batch", "largest_batch_at_context"):
        if key in result:
            result[key.split("_at_")[0] + "_bound"] = answer_bound(
                shape, key, result[key], sizes_limit[key], loaded is not None, key in bounded,
                result.get("batch"), result.get("context"), new_tokens)
    result["predictions_run"] = len(predictions)
    result["search_bound"] = (
        f"at most {limit} predictions (MAX_FIT_PREDICTIONS {MAX_FIT_PREDICTIONS}, at most "
        f"{MAX_FIT_DECODE_STEPS} decode steps traced in all), sizes up to the bounds above (the model's "
        f"positions, batch x (context + new tokens) <= {MAX_TOKENS})")
    if bounded:
        result["search_bound"] += (f"; the bound was reached: {' and '.join(bounded)} "
                                   f"{'is a lower bound' if len(bounded) == 1 else 'are lower bounds'}")
    return result


