"""Predicting the synthetic network's allocator counters per phase, and comparing a measurement with its prediction."""
import math

from lab_helpers.allocator.budget import (BudgetedAllocatorModel, OutOfMemory, UNBOUNDED_NOTE, UNRECORDED_NOTE,
                                          measured_budgets)
from lab_helpers.allocator.expandable import CappedExpandableAllocator
from lab_helpers.allocator.model import DEFAULT_WORKSPACE_BYTES, DEFAULT_WORKSPACE_SOURCE
from lab_helpers.allocator.settings import (DEFAULT_SETTINGS, AllocatorSettings, parse_allocator_conf, recorded_settings,
                                            replay_allocator)
from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.core.numbers import DTYPE_BYTES, parse_whole
from lab_helpers.measurement.schema import (COUNTERS, MAX_PASSES, MAX_TENSOR_PARALLEL, MEASUREMENT_SCHEMA,
                                            PHASES, schema_errors)
from lab_helpers.synthetic.network import MeasureConfig, parameter_shapes, synthetic_model


ALLOCATION_KINDS = ("weights", "inputs", "workspace", "activations")


RESERVED_ASSUMPTIONS = (
    "a fresh process, default allocator settings (no PYTORCH_CUDA_ALLOC_CONF: no "
    "expandable_segments, no max_split_size_mb), free memory as the budget says (without one, "
    "unbounded: no cache flush and retry), and free blocks of equal size taken in the order their "
    "segments were made")


EXPANDABLE_RESERVED_ASSUMPTIONS = (
    "a fresh process, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (one segment per pool that grows "
    "at its end in pages: 2 MiB for requests up to 1 MiB, 20 MiB for larger ones; no other setting), "
    "enough free memory (no release of free pages and retry)")


OUTSIDE_ALLOCATOR_NOT_PREDICTED = (
    "not predicted: what NCCL holds outside PyTorch's allocator (its buffers and communicators) is "
    "measured per rank by measure, from the device's free memory")


def predict(config: MeasureConfig, workspace_bytes=DEFAULT_WORKSPACE_BYTES,
            workspace_source: str = DEFAULT_WORKSPACE_SOURCE, allocator: AllocatorSettings = DEFAULT_SETTINGS,
            budget_bytes=None, budget_source=None) -> dict:
    """Predict allocated and reserved bytes per phase, from the allocator's rules alone (under the
    `allocator` settings). Each phase also has ``end_allocated_bytes_by_kind``: its end allocated
    bytes split into ALLOCATION_KINDS. At tensor parallel N the document holds ``ranks`` (each
    rank's phases) instead of ``phases``.

    With `budget_bytes` (what one GPU's reserved may reach), the allocator's release of its free
    cached segments and retry is replayed (lab_helpers.allocator.budget); a run that still runs out
    ends at the failing phase, and the document holds ``out_of_memory``."""
    workspace_bytes = tuple(workspace_bytes)
    _check_workspace(workspace_bytes)
    document = {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": config.record(),
        "synthetic_model": synthetic_model(config),
        "workspace": {"bytes": list(workspace_bytes), "source": workspace_source},
        "reserved_assumptions": EXPANDABLE_RESERVED_ASSUMPTIONS if allocator.expandable_segments else RESERVED_ASSUMPTIONS,
        "budget": ({"bytes": budget_bytes, "source": budget_source or "given"} if budget_bytes is not None else
                   {"bytes": None, "source": None, "note": UNBOUNDED_NOTE}),
    }
    if allocator.expandable_segments:  # PyTorch's defaults keep the document as it always was
        document["allocator_conf"] = allocator.conf_text()
    if config.tensor_parallel is None:
        replay = replay_under_budget(config, workspace_bytes, config.hidden_features, budget_bytes, allocator)
        document["phases"] = replay["phases"]
        document.update({k: replay[k] for k in ("cache_releases", "out_of_memory") if k in replay})
        return document
    # Every rank runs the same requests in the same order: its shard of hidden / N features (N
    # divides hidden, checked when the config was built), the whole input, output and second bias.
    # The all-reduce is in place and allocates nothing in the caching allocator, so each rank's
    # replay is computed, not copied, with the same sizes.
    document["outside_allocator"] = OUTSIDE_ALLOCATOR_NOT_PREDICTED
    document["ranks"] = [{"rank": rank, **replay_under_budget(config, workspace_bytes, config.shard_hidden,
                                                              budget_bytes, allocator)}
                         for rank in range(config.tensor_parallel)]
    failed = [{"rank": r["rank"], **r["out_of_memory"]} for r in document["ranks"] if "out_of_memory" in r]
    if failed:
        document["out_of_memory"] = failed[0]
    return document


def _replay_phases(config: MeasureConfig, workspace_bytes: tuple, hidden: int,
                   allocator: AllocatorSettings = DEFAULT_SETTINGS) -> list:
    """The phases of one process holding `hidden` features of the first Linear (all of them on one
    GPU, hidden / N on each of N ranks), replayed on the model of the allocator under `allocator`, for an
    unbounded device."""
    return replay_under_budget(config, workspace_bytes, hidden, None, allocator)["phases"]


def replay_under_budget(config: MeasureConfig, workspace_bytes: tuple, hidden: int, budget,
                        allocator: AllocatorSettings = DEFAULT_SETTINGS) -> dict:
    """{"phases"[, "cache_releases", "out_of_memory"]} of one process holding `hidden` features of
    the first Linear, replayed on the allocator model under `allocator` and `budget`: None
    (unbounded), bytes, or a list of bytes, one per phase record (a measurement's, see
    measured_budgets). A predicted out-of-memory ends the phases before the one that fails."""
    c = config
    element = DTYPE_BYTES[c.dtype]
    tokens = c.batch * c.context
    if budget is None:
        alloc = replay_allocator(allocator)
    elif allocator.expandable_segments:  # its own capacity, set per phase below
        alloc = CappedExpandableAllocator(None, OutOfMemory)
    else:
        alloc = BudgetedAllocatorModel()
    live = {}
    phases = []
    releases = []
    held = dict.fromkeys(ALLOCATION_KINDS, 0)  # allocated bytes per kind, as the allocator counts them
    kind_of = {}

    def malloc(size, kind):
        block = alloc.malloc(size)
        kind_of[block] = kind
        held[kind] += block.size
        return block

    def free(block):
        held[kind_of.pop(block)] -= block.size  # before free(): merging grows the block
        alloc.free(block)

    def phase(name, action, index=None, passes=0):
        phase_budget = budget[len(phases)] if isinstance(budget, list) else budget
        if isinstance(alloc, BudgetedAllocatorModel):
            alloc.budget_bytes = phase_budget
        elif phase_budget is not None:  # the expandable-segments model's own capacity
            alloc.capacity_bytes = phase_budget
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        alloc.reset_peaks()
        seen = len(getattr(alloc, "releases", ()))
        try:
            action()
        except OutOfMemory as exc:
            exc.phase, exc.index = name, index
            raise
        finally:
            releases.extend({"phase": name, "index": index, "released_bytes": r, "reserved_bytes_after": after}
                            for r, after in getattr(alloc, "releases", ())[seen:])
        phases.append({
            "phase": name, "index": index, "passes": passes,
            "baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved,
            "end_allocated_bytes_by_kind": dict(held),
        })

    def load_model():
        for shape in parameter_shapes(c.width, hidden).values():
            malloc(math.prod(shape) * element, "weights")

    def forward():
        # nn.Linear on a contiguous 3-D input is one addmm: its output comes first,
        # then the math library's workspace on the very first product
        first = malloc(tokens * hidden * element, "activations")
        if not live.get("workspace"):
            live["workspace"] = [malloc(size, "workspace") for size in workspace_bytes]
        activated = malloc(tokens * hidden * element, "activations")  # GELU output
        free(first)  # Sequential drops the first output once GELU has returned
        output = malloc(tokens * c.width * element, "activations")
        free(activated)
        return output  # at tensor parallel N, all-reduced and biased in place: no new block

    def measured_forward():
        live["output"] = forward()

    def warmup():
        for _ in range(c.warmup):
            free(forward())

    try:
        phase("model_load", load_model)
        phase("inputs", lambda: malloc(tokens * c.width * element, "inputs"))
        phase("cold_forward", measured_forward, passes=1)
        free(live.pop("output"))
        phase("warmup", warmup, passes=c.warmup)
        for repeat in range(c.repeats):
            phase("warm_forward", measured_forward, index=repeat, passes=1)
            free(live.pop("output"))
    except OutOfMemory as exc:
        return {"phases": phases, "cache_releases": releases, "out_of_memory": exc.report()}
    # without a budget nothing is ever released: the document keeps its earlier form
    return {"phases": phases, "cache_releases": releases} if budget is not None else {"phases": phases}


# What compare needs of a document: a synthetic configuration and phases with their counters (a
# measurement file, or a prediction laid out like one).
COMPARABLE_SCHEMA = {
    "type": "object",
    "required": ["configuration", "phases"],
    "properties": {
        "configuration": {"$ref": "#/$defs/synthetic_configuration"},
        "phases": {"type": "array", "minItems": 5, "maxItems": 4 + MAX_PASSES, "items": {
            "type": "object",
            "required": ["phase", "index", *(f"{when}_{counter}_bytes" for when in ("baseline", "end", "peak")
                                             for counter in COUNTERS)],
            "properties": {**MEASUREMENT_SCHEMA["$defs"]["phase"]["properties"], "phase": {"enum": list(PHASES)}},
        }},
    },
}


COMPARABLE_RANKS_SCHEMA = {
    "type": "object",
    "required": ["configuration", "ranks"],
    "properties": {
        "configuration": {"$ref": "#/$defs/synthetic_configuration"},
        "ranks": {"type": "array", "minItems": 1, "maxItems": MAX_TENSOR_PARALLEL, "items": {
            "type": "object", "required": ["rank", "phases"],
            "properties": {"rank": {"type": "integer", "minimum": 0, "maximum": MAX_TENSOR_PARALLEL - 1},
                           "phases": COMPARABLE_SCHEMA["properties"]["phases"]},
        }},
    },
}


def compare(measurement: dict, workspace_bytes=None) -> dict:
    """Set a measurement of the synthetic network beside its prediction; differences are measured
    minus predicted. The document is checked against the schema and the phases predict would give.
    A tensor-parallel file is compared rank by rank (``ranks``: each rank's rows)."""
    configuration = measurement.get("configuration") if isinstance(measurement, dict) else None
    if isinstance(configuration, dict) and configuration.get("kind", "synthetic") != "synthetic":
        hint = ("; compare it with python -m lab_helpers.real_model compare FILE"
                if configuration.get("kind") == "transformers" else "")
        raise LabError("compare predicts the synthetic network only; this file measured a "
                       f"{str(configuration['kind'])[:40]} model{hint}")
    parallel = isinstance(configuration, dict) and "tensor_parallel" in configuration
    problem = next(schema_errors(measurement, COMPARABLE_RANKS_SCHEMA if parallel else COMPARABLE_SCHEMA,
                                  "$", MEASUREMENT_SCHEMA), None)
    if problem:
        raise LabError(f"not a measurement: {problem[0]}: {problem[1]}")
    settings = {k: v for k, v in measurement["configuration"].items() if k != "kind"}
    try:
        config = MeasureConfig(**settings)
    except ParameterError as exc:  # a file's field refused in the words of the flag that sets it
        raise LabError(exc.flagged(lambda name: True)) from None
    if workspace_bytes is None:
        workspace = {"bytes": list(DEFAULT_WORKSPACE_BYTES), "source": DEFAULT_WORKSPACE_SOURCE}
    else:
        workspace = {"bytes": list(workspace_bytes), "source": "given on the command line"}
    _check_workspace(workspace["bytes"])
    # the measurement is replayed under the settings its process ran with (its environment block)
    allocator = recorded_settings(measurement.get("environment"))
    if "environment" not in measurement and "allocator_conf" in measurement:  # a prediction's own setting
        allocator = parse_allocator_conf(measurement["allocator_conf"], "$.allocator_conf")
    if not parallel:
        return {"workspace": workspace, "allocator_conf": allocator.conf_text(),
                **_compare_phases(config, measurement["phases"], tuple(workspace["bytes"]),
                                  config.hidden_features, "$.phases", allocator)}
    ranks = measurement["ranks"]
    if len(ranks) != config.tensor_parallel:
        raise LabError(f"$.ranks: {len(ranks)} ranks, but tensor_parallel is {config.tensor_parallel}")
    results = []
    for i, rank in enumerate(ranks):
        if rank["rank"] != i:
            raise LabError(f"$.ranks[{i}].rank: {rank['rank']}, but ranks are listed in order from 0")
        compared = _compare_phases(config, rank["phases"], tuple(workspace["bytes"]), config.shard_hidden,
                                   f"$.ranks[{i}].phases", allocator)
        results.append({"rank": i, "device": rank.get("device"), "outside_allocator": rank.get("outside_allocator"),
                        **compared})
    return {"tensor_parallel": config.tensor_parallel, "workspace": workspace, "allocator_conf": allocator.conf_text(),
            "allocated_exact": all(r["allocated_exact"] for r in results), "ranks": results}


def _check_workspace(workspace_bytes) -> None:
    if len(workspace_bytes) > MAX_WORKSPACE_BLOCKS:
        raise LabError(f"at most {MAX_WORKSPACE_BLOCKS} workspace blocks, got {len(workspace_bytes)}")
    for size in workspace_bytes:
        parse_whole(size, "workspace_bytes", 0, MAX_WORKSPACE_BYTES)


def _compare_phases(config: MeasureConfig, measured: list, workspace_bytes: tuple, hidden: int, where: str,
                    allocator: AllocatorSettings = DEFAULT_SETTINGS) -> dict:
    """One process's measured phases beside their replay (`hidden` features of the first Linear)."""
    bare = _replay_phases(config, (), hidden, allocator)
    expected = [(p["phase"], p["index"]) for p in bare]
    if len(measured) != len(expected):
        raise LabError(f"{where}: {len(measured)} records, but measure writes {len(expected)} for "
                       f"warmup {config.warmup} and repeats {config.repeats}")
    for i, (got, want) in enumerate(zip(measured, expected)):
        if (got["phase"], got["index"]) != want:
            raise LabError(f"{where}[{i}]: phase {got['phase']!r} index {got['index']!r}, but measure "
                           f"writes phase {want[0]!r} index {want[1]!r} there")
    # under the budget the measured device gave each phase (older files: unbounded, and said so)
    budgets = measured_budgets(measured)
    replay = replay_under_budget(config, workspace_bytes, hidden, budgets, allocator)
    predicted = replay["phases"]
    cold = PHASES.index("cold_forward")
    detected = measured[cold]["end_allocated_bytes"] - bare[cold]["end_allocated_bytes"]
    rows = []
    for i, (got, want) in enumerate(zip(measured, predicted)):
        row = {"phase": got["phase"], "index": got["index"], "budget_bytes": None if budgets is None else budgets[i]}
        for key in want:
            if key.endswith("_bytes"):
                row[f"measured_{key}"] = got[key]
                row[f"predicted_{key}"] = want[key]
                row[f"difference_{key}"] = got[key] - want[key]
        rows.append(row)
    allocated_keys = [k for k in COMPARED_KEYS if "allocated" in k]
    budget = {"replayed_under": "an unbounded device" if budgets is None else "the measured budget of each phase",
              "rule": UNRECORDED_NOTE if budgets is None else MEASURED_BUDGET_RULE}
    if "out_of_memory" in replay:
        budget["predicted_out_of_memory"] = replay["out_of_memory"]
    return {
        "budget": budget,
        "outcomes_agree": "out_of_memory" not in replay,
        "workspace_detected_bytes": detected,
        "allocated_exact": "out_of_memory" not in replay and all(row[f"difference_{k}"] == 0 for row in rows
                                                                 for k in allocated_keys),
        "rows": rows,
    }


COMPARED_KEYS = tuple(f"{when}_{counter}_bytes" for when in ("baseline", "end", "peak") for counter in COUNTERS)


MEASURED_BUDGET_RULE = (
    "measured: per phase, the smaller of the device's free bytes plus reserved at the phase's start and at its "
    "end (what the allocator could reach, less what appeared outside it: the CUDA context, cuBLAS/cuBLASLt "
    "handles, lazily loaded kernels, NCCL)")


MAX_WORKSPACE_BLOCKS = 16


MAX_WORKSPACE_BYTES = 2**40
