"""What fits under the budget of an out-of-memory failure: real_model fit's search on the run that the
lab's out-of-memory file names. A prediction on PyTorch's meta device, never a measurement."""
from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.text import printable
from lab_helpers.real.config import parse_config
from lab_helpers.real.fit import fit_model
from lab_helpers.real.spec import RunSpec

PREDICTION_LABEL = "prediction (real_model fit's search on the meta device), not a measurement"


def failure_budget(loaded: dict) -> tuple:
    """(bytes, how) the allocator could reserve at the failure: what it had reserved plus the device's
    free bytes (it had already released its wholly free cached segments), at most the per-process cap.
    Reserved is the observer's counter, else the snapshot's segments (unwinding frees blocks, not
    segments, so reserved is the same after it)."""
    observer = loaded.get("observer")
    if observer is not None:
        reserved, free = observer["stats"]["reserved_bytes.all.current"], observer["device_free_bytes"]
        where = "the observer's reserved_bytes and device free"
    else:
        reserved = sum(s["total_size"] for s in loaded["snapshot"]["segments"])
        free = loaded.get("device_free_bytes")
        if free is None:
            raise ParameterError("predict_fit", "needs the device's free bytes at the failure; the file does not say")
        where = "the snapshot's reserved and the device's free bytes"
    budget, how = reserved + free, f"reserved {reserved} + device free {free} bytes ({where})"
    cap = loaded.get("process_limit_bytes")
    if cap is not None and cap < budget:
        budget, how = cap, f"the per-process cap of {cap} bytes (less than {how})"
    if budget <= 0:
        raise ParameterError("predict_fit", ": the budget at the failure is 0 bytes")
    return budget, how


def add_fit_prediction(result: dict, loaded: dict) -> None:
    """Add result["fit_prediction"]: the largest batch at the run's context and the largest context
    at its batch that fit the failure's budget, as real_model fit predicts them."""
    run = loaded.get("run")
    if run is None:
        raise ParameterError("predict_fit", "needs the run the file names (real_model measure --timeline writes "
                                            "it); this file names none")
    configuration = run["configuration"]
    if configuration.get("tensor_parallel", 1) != 1:
        raise ParameterError("predict_fit", ": the file's run is tensor-parallel; one GPU's allocator is recorded")
    name = configuration.get("config_name")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ParameterError("predict_fit", ": the run's config_name must be a non-empty string of at most 200 "
                                            "characters")
    try:
        spec = RunSpec(printable(name), dtype=configuration.get("dtype"), batch=configuration.get("batch"),
                       context=configuration.get("context"), new_tokens=configuration.get("new_tokens"))
        shape = parse_config(run["model_config"], spec.config_name)
    except LabError as exc:  # a field of the run in the words of the flag that sets it
        inner = exc.flagged(lambda name: True) if isinstance(exc, ParameterError) else str(exc)
        raise ParameterError("predict_fit", f": the file's run: {inner}") from None
    budget, how = failure_budget(loaded)
    search = fit_model(shape, spec.dtype, spec.new_tokens, budget, f"the failure's budget: {how}",
                       batch=spec.batch, context=spec.context)
    result["fit_prediction"] = {
        "label": PREDICTION_LABEL, "budget_bytes": budget, "budget_rule": how,
        "batch": spec.batch, "context": spec.context, "new_tokens": spec.new_tokens, "dtype": spec.dtype,
        "fits": search.get("fits"), "largest_batch_at_context": search.get("largest_batch_at_context"),
        "largest_context_at_batch": search.get("largest_context_at_batch"), "search": search}


def fit_prediction_lines(prediction: dict) -> list:
    """The prediction in words, labelled as one."""
    fits = {True: "fits", False: "does not fit", None: "unknown"}[prediction["fits"]]
    return [f"PREDICTION, not a measurement (real_model fit's search on the meta device), under the failure's "
            f"budget of {prediction['budget_bytes']} bytes ({prediction['budget_bytes'] / 2**30:.2f} GiB; "
            f"{prediction['budget_rule']}): batch {prediction['batch']} at context {prediction['context']} "
            f"{fits}; the largest batch at context {prediction['context']}: "
            f"{prediction['largest_batch_at_context']}; the largest context at batch {prediction['batch']}: "
            f"{prediction['largest_context_at_batch']}."]
