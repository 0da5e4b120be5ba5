"""fit --task train: does a fine-tuning run fit a budget, and the largest batch and context that do,
from predictions of the traced training run under a replayed allocator capped at the budget."""
from dataclasses import replace

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.real.config import ModelShape
from lab_helpers.real.search import Probe, largest_fitting
from lab_helpers.real.spec import MAX_MODEL_BATCH, MAX_MODEL_CONTEXT
from lab_helpers.real.train import MAX_TRAIN_TOKENS, TrainSpec, predict_training_model

# each traces a whole training run: the search stops here, saying so (a run that does not fit is not
# traced again with no cap for its peaks: the search is guided by the peaks of the runs that fit)
MAX_TRAIN_FIT_PREDICTIONS = 24
TRAIN_FIT_STEPS = 2  # the second step is the steady state: states, gradients and activations at once
TRAIN_FIT_CRITERION = (f"{TRAIN_FIT_STEPS} optimizer steps (the second is the steady state) fit when the replayed "
                       "allocator never needs more than the budget, after releasing its wholly free cached "
                       "segments as PyTorch does before an out-of-memory error")


def training_bound(stopped: bool, at_limit: bool, next_tokens: int, limit_bound: str) -> str:
    """What set a largest-size answer of fit --task train, as fit's (lab_helpers.real.fit.ANSWER_BOUNDS):
    the search's bound, the size's own limit (`limit_bound`: positions or the lab's), the tokens of the
    next size beyond MAX_TRAIN_TOKENS, else the memory. (The weights are not told apart here: a
    training run whose weights do not fit is one whose every size runs out of memory.)"""
    if stopped:
        return "search bound"
    if at_limit:
        return limit_bound
    return "size limit" if next_tokens > MAX_TRAIN_TOKENS else "memory"


def fit_training(shape: ModelShape, base: TrainSpec, budget_bytes: int, budget_source: str,
                 batch=None, context=None) -> dict:
    """Does (batch, context) fit, the largest context at `batch` and the largest batch at `context`,
    for the fine-tuning run `base` (its optimizer, what is trained, checkpointing) of two steps."""
    from lab_helpers.allocator.budget import OutOfMemory
    if batch is None and context is None:
        raise ParameterError(None, "give {batch}, {context} or both", ("batch", "context"))
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise LabError(f"the memory budget must be a whole number of bytes > 0, got {budget_bytes!r}")
    base = replace(base, steps=TRAIN_FIT_STEPS)
    cache, predictions = {}, []

    def probe(b, t):
        """The search's Probe of (b, t), predicted once; None once the search's bound is reached."""
        if (b, t) not in cache:
            if b * t > MAX_TRAIN_TOKENS:
                cache[(b, t)] = None
            else:
                if len(predictions) >= MAX_TRAIN_FIT_PREDICTIONS:
                    return None
                predictions.append((b, t))
                try:
                    cache[(b, t)] = predict_training_model(shape, replace(base, batch=b, context=t),
                                                           budget_bytes)["overall"]
                except OutOfMemory:
                    cache[(b, t)] = None
        found = cache[(b, t)]
        return (Probe(False) if found is None else
                Probe(True, found["peak_reserved_bytes"], found["peak_allocated_bytes"]))

    result = {
        "config_name": shape.name, "task": "train", "train": base.train, "dtype": base.dtype,
        "optimizer": base.optimizer, "fused": base.fused, "gradient_checkpointing": base.gradient_checkpointing,
        **({"quantize": base.quantize} if base.quantize else {}),  # --train qlora's 4-bit base
        **({"autocast": base.autocast} if base.autocast else {}),  # float32 weights, the forward under autocast
        "budget_bytes": budget_bytes, "budget_source": budget_source,
        "criterion": TRAIN_FIT_CRITERION,
    }
    bounded = []
    if batch is not None and context is not None:
        result.update({"batch": batch, "context": context, "fits": probe(batch, context).fits})
        if result["fits"]:
            result["peak_reserved_bytes"] = cache[(batch, context)]["peak_reserved_bytes"]
            result["headroom_bytes"] = budget_bytes - result["peak_reserved_bytes"]
    if batch is not None:
        result["batch"] = batch
        high = min(MAX_MODEL_CONTEXT, shape.max_positions or MAX_MODEL_CONTEXT)
        # a training sequence has 2 tokens at least (one predicts the next): search v = context - 1
        found, stopped = largest_fitting(lambda v: probe(batch, v + 1), high - 1, budget_bytes,
                                         start=None if context is None else context - 1)
        result["largest_context_at_batch"] = found + 1 if found else 0
        result["largest_context_bound"] = training_bound(stopped, found + 1 >= high, batch * (found + 2),
                                                         "positions" if shape.max_positions == high else "size limit")
        if stopped:
            bounded.append("largest_context_at_batch")
    if context is not None:
        result["context"] = context
        found, stopped = largest_fitting(lambda b: probe(b, context), MAX_MODEL_BATCH, budget_bytes, start=batch)
        result["largest_batch_at_context"] = found
        result["largest_batch_bound"] = training_bound(stopped, found >= MAX_MODEL_BATCH, (found + 1) * context,
                                                       "size limit")
        if stopped:
            bounded.append("largest_batch_at_context")
    result["predictions"] = len(predictions)
    if bounded:
        result["bounded"] = (f"{', '.join(bounded)}: the search stopped after {MAX_TRAIN_FIT_PREDICTIONS} "
                             "predictions; the figure is a size that fits, a lower bound of the largest")
    return result
