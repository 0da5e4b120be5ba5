"""What the phases of a fine-tuning run show, read from a training document, measured or predicted.

The optimizer's states appear at the first optimizer_step (allocated jumps by their bytes) and the
later steps allocate nothing more; backward's peak is above forward's (the gradients and backward's
temporaries join the saved activations); zero_grad(set_to_none=True) frees the gradients' blocks and
keeps the reserved segments; gradient checkpointing keeps fewer activations after forward and lowers
backward's peak. Every figure is a difference of one document's own counters, so a run measured in a
process that already holds a cuBLAS workspace shows the same facts as a fresh one. Standard library."""
from lab_helpers.core.errors import LabError


def records_by_phase(document: dict) -> dict:
    """{(phase, index): record} of a training document's phases."""
    try:
        return {(p["phase"], p["index"]): p for p in document["phases"]}
    except (KeyError, TypeError) as exc:
        raise LabError(f"not a training document: its phases lack {exc}") from None


def expected_bytes(prediction: dict) -> dict:
    """The gradients' and the optimizer states' bytes of a training prediction (its by-kind split):
    {"gradient_bytes": {step: the gradients' blocks at that backward's end}, "optimizer_state_bytes":
    the states' blocks at the first optimizer_step's end}. The gradients' blocks are per step: a
    large-pool block is not split when 1 MiB or less would remain, so a gradient can hold a larger
    block in one step than in the next."""
    records = records_by_phase(prediction)
    try:
        return {"gradient_bytes": {index: r["end_allocated_bytes_by_kind"]["gradients"]
                                   for (phase, index), r in records.items() if phase == "backward"},
                "optimizer_state_bytes": records[("optimizer_step", 0)]["end_allocated_bytes_by_kind"]["optimizer_states"]}
    except KeyError:
        raise LabError("not a training prediction: it needs its phases split by kind") from None


def training_facts(document: dict, gradient_bytes: dict, optimizer_state_bytes: int) -> list:
    """One row per fact and step: {"fact", "phase", "bytes", "expected", "holds"}; `bytes` is the
    document's own difference, `expected` what it must be ("> 0" where only the sign is known).
    `gradient_bytes` maps each step to its gradients' bytes (expected_bytes gives both figures)."""
    records = records_by_phase(document)
    steps = sorted(index for phase, index in records if phase == "optimizer_step")
    if not steps:
        raise LabError("not a training document: it has no optimizer_step")
    rows = []

    def fact(text, phase, value, expected):
        holds = value > 0 if expected == "> 0" else value == expected
        rows.append({"fact": text, "phase": phase, "bytes": value, "expected": expected, "holds": holds})

    for step in steps:
        forward, backward = records[("forward", step)], records[("backward", step)]
        optimizer, zero = records[("optimizer_step", step)], records[("zero_grad", step)]
        fact("backward's peak allocated above forward's", f"backward {step}",
             backward["peak_allocated_bytes"] - forward["peak_allocated_bytes"], "> 0")
        grown = optimizer["end_allocated_bytes"] - optimizer["baseline_allocated_bytes"]
        if step == steps[0]:
            fact("the optimizer's states appear: allocated grows by their bytes", f"optimizer_step {step}", grown,
                 optimizer_state_bytes)
        else:
            fact("a later step allocates nothing more (the steady state)", f"optimizer_step {step}", grown, 0)
        fact("zero_grad(set_to_none=True) frees the gradients' bytes", f"zero_grad {step}",
             zero["baseline_allocated_bytes"] - zero["end_allocated_bytes"], gradient_bytes[step])
        fact("zero_grad keeps the reserved segments", f"zero_grad {step}",
             zero["end_reserved_bytes"] - zero["baseline_reserved_bytes"], 0)
    return rows


def checkpointing_savings(plain: dict, checkpointed: dict, step: int = 1) -> dict:
    """What gradient checkpointing saves at optimizer step `step` (1: the steady state, every
    workspace already made): the activations kept after forward and backward's peak, in bytes."""
    a, b = records_by_phase(plain), records_by_phase(checkpointed)
    try:
        return {"saved_activations_bytes": a[("forward", step)]["end_allocated_bytes"]
                - b[("forward", step)]["end_allocated_bytes"],
                "backward_peak_bytes": a[("backward", step)]["peak_allocated_bytes"]
                - b[("backward", step)]["peak_allocated_bytes"]}
    except KeyError:
        raise LabError(f"both documents need forward {step} and backward {step}") from None
