"""Predict a real model's memory with no GPU: the run traced on PyTorch's meta device, every allocation
replayed through the model of the caching allocator; and a measurement set beside its prediction.

`predict_model` runs the same protocol as `measure_model` (lab_helpers.real.protocol), at tensor
parallel N every rank in turn under torch's fake process-group backend. The run's allocation requests
are traced once (lab_helpers.real.traces: decode steps extended from traced ones where they repeat,
traces kept in memory and under the user's cache folder) and replayed through the allocator model of
the settings asked (lab_helpers.real.replay), under any budget.
"""
import contextlib
from dataclasses import replace

from lab_helpers.allocator.budget import UNBOUNDED_NOTE, UNRECORDED_NOTE, measured_budgets
from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.allocator.settings import DEFAULT_SETTINGS, AllocatorSettings, recorded_settings
from lab_helpers.core.errors import LabError
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.real.quantized import check_quantization
from lab_helpers.real.config import ModelShape, check_tensor_parallel, parse_config
from lab_helpers.real.replay import allocator_factory
from lab_helpers.real.spec import COUNTER_KEYS, RunSpec, model_description, recorded_steps, run_configuration

CUDA_SOURCE = ("CUDA behaviour measured with torch 2.11.0+cu130 and transformers 5.17.0 on an NVIDIA H200 "
               "(compute capability 9.0): cuBLAS and cuBLASLt workspaces, cuDNN attention, argmax staging")
REAL_MODEL_ASSUMPTIONS = (
    "a fresh process; default allocator settings (no PYTORCH_CUDA_ALLOC_CONF); the library's default "
    "attention (SDPA) and cache (DynamicCache); free blocks of equal size taken in the order their "
    "segments were made; reserved without a cache flush unless a capacity is given")
EXPANDABLE_ASSUMPTIONS = (
    "a fresh process; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and no other setting (one segment per "
    "pool, grown at its end in 2 MiB pages for requests up to 1 MiB and 20 MiB pages above); the library's "
    "default attention (SDPA) and cache (DynamicCache); reserved without a release of free pages unless a "
    "capacity is given")


def load_for_prediction(shape: ModelShape, dtype: str, capacity_bytes=None, tensor_parallel: int = 1,
                        mesh=None, allocator: AllocatorSettings = DEFAULT_SETTINGS, trace_cache=None,
                        rank: int = 0) -> dict:
    """The traces of one rank of `shape` in `dtype` (a TraceSession: the load traced or read once, each
    size's run after it), and the load replayed under `capacity_bytes` with the allocator model of
    `allocator` (OutOfMemory when the weights alone do not fit). At tensor parallel N, `mesh` is the
    rank's fake-backend mesh, which must stay alive while the session traces (the model's forward
    hooks call the mesh's process group)."""
    from lab_helpers.real.trace_cache import default_cache
    from lab_helpers.real.traces import TraceSession
    session = TraceSession(shape, dtype, tensor_parallel, rank, trace_cache or default_cache())
    weights = session.replay_load(capacity_bytes, mesh, allocator_factory(allocator))["weights_bytes"]
    return {"dtype": dtype, "capacity_bytes": capacity_bytes, "tensor_parallel": tensor_parallel, "mesh": mesh,
            "allocator_settings": allocator, "session": session, "weights_bytes": weights}


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """This process as rank `rank` of `world_size` on torch's fake backend (collectives do
    nothing); yields the one-dimensional DeviceMesh the model is split over."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise LabError("a torch.distributed process group already exists in this process; a tensor-parallel "
                       "prediction runs its own (fake) one, so run it in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield DeviceMesh.from_group(dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()


def predict_model(shape: ModelShape, spec: RunSpec, capacity_bytes=None, loaded=None,
                  tensor_parallel: "int | None" = None, allocator: "AllocatorSettings | None" = None,
                  phase_budget=None, budget_source=None, report_out_of_memory: bool = False,
                  trace_cache=None, expand_decode_steps: bool = True, expand_layers: "bool | None" = None) -> dict:
    """Predict allocated and reserved bytes of every phase: the run traced on the meta device (or its
    trace read from `trace_cache`, default the user's cache folder), replayed through the allocator model.

    At tensor parallel N (`tensor_parallel`, or spec.tensor_parallel) every rank is traced in
    turn under torch's fake process-group backend, and the document has a "ranks" list (each
    rank's "overall" and "phases") instead of "phases"; its "overall" is the worst rank's. With
    `loaded` at N > 1 (from load_for_prediction, whose fake group must still be open), only that
    loaded rank is predicted, and returned as the document of one rank.

    The budget: `capacity_bytes` (what one rank's reserved may reach, None: unbounded), or
    `phase_budget(rank, phase, index)` giving it phase by phase (a measurement's, see compare_model).
    Under a budget the allocator's release-and-retry is replayed (lab_helpers.allocator.budget);
    when it still runs out, OutOfMemory is raised, or with `report_out_of_memory` the document ends
    at the failing phase and holds "out_of_memory" (the phase, the request, reserved and allocated
    then, the budget). `budget_source` says where the budget came from, in the document.
    `allocator`: the allocator settings replayed (default: `loaded`'s, else PyTorch's defaults).
    `expand_decode_steps` False traces every decode step (the exact slow path that the extension of
    decode steps from traced ones is checked against, tests/test_replay.py), and traces every layer;
    `expand_layers` False alone traces every layer (a run expanded from a few traced layers is checked
    against it, tests/test_layer_expansion.py)."""
    from lab_helpers.real.trace_cache import default_cache
    from lab_helpers.real.traces import ModelNeeded, TraceSession
    if allocator is None:
        allocator = loaded.get("allocator_settings", DEFAULT_SETTINGS) if loaded is not None else DEFAULT_SETTINGS
    if tensor_parallel is not None:
        spec = replace(spec, tensor_parallel=tensor_parallel)
    check_tensor_parallel(shape, spec.tensor_parallel)
    degree = spec.tensor_parallel
    cache = trace_cache or default_cache()
    options = {"allocator": allocator, "phase_budget": phase_budget, "report": report_out_of_memory}
    if loaded is not None and (loaded["dtype"], loaded["tensor_parallel"]) == (spec.dtype, degree):
        one = _predict_rank(shape, spec, capacity_bytes, loaded["session"], loaded["mesh"], **options)
    elif degree == 1:
        session = TraceSession(shape, spec.dtype, 1, 0, cache, expand_decode_steps, expand_layers)
        one = _predict_rank(shape, spec, capacity_bytes, session, **options)
    else:
        ranks = []
        for rank in range(degree):
            session = TraceSession(shape, spec.dtype, degree, rank, cache, expand_decode_steps, expand_layers)
            try:
                one = _predict_rank(shape, spec, capacity_bytes, session, rank=rank, **options)
            except ModelNeeded:  # a trace is missing: the rank's model is built in its process group
                with fake_process_group(rank, degree) as mesh:
                    one = _predict_rank(shape, spec, capacity_bytes, session, mesh, rank=rank, **options)
            ranks.append({"rank": rank, **{key: one.pop(key) for key in ("overall", "phases", "cache_releases",
                                                                       "out_of_memory") if key in one}})
        one["overall"] = {key: max(r["overall"][key] for r in ranks) for key in ("peak_allocated_bytes",
                                                                               "peak_reserved_bytes")}
        one["ranks"] = ranks
        failed = [{"rank": r["rank"], **r["out_of_memory"]} for r in ranks if "out_of_memory" in r]
        if failed:
            one["out_of_memory"] = failed[0]
    one["budget"] = _budget_block(capacity_bytes, budget_source, phase_budget is not None)
    return one


def _budget_block(capacity_bytes, source, per_phase: bool) -> dict:
    """Where the budget came from, in the document; without one, that reserved is unbounded."""
    if per_phase:
        return {"bytes": None, "source": source or "given phase by phase"}
    if capacity_bytes is not None:
        return {"bytes": capacity_bytes, "source": source or "given"}
    return {"bytes": None, "source": None, "note": UNBOUNDED_NOTE}


def _predict_rank(shape: ModelShape, spec: RunSpec, capacity_bytes, session, mesh=None,
                  allocator: AllocatorSettings = DEFAULT_SETTINGS, rank: int = 0, phase_budget=None,
                  report: bool = False) -> dict:
    budgets = None if phase_budget is None else (lambda name, index: phase_budget(rank, name, index))
    replayed = session.replay(spec, capacity_bytes, recorded_steps(spec.new_tokens, spec.decode_record_every), mesh,
                              allocator_factory(allocator), budgets, report)
    failure = replayed["out_of_memory"]
    if failure is not None and replayed["load_failed"]:
        return _out_of_memory_document(spec, shape, [], {"peak_allocated_bytes": failure.allocated_bytes,
                                                         "peak_reserved_bytes": failure.reserved_bytes}, failure, [])
    workspace = replayed["workspace_bytes"]
    # a rank's key/value cache holds its own heads: num_key_value_heads / N
    local = replace(shape, kv_heads=shape.kv_heads // spec.tensor_parallel)
    if failure is not None:
        document = _out_of_memory_document(spec, shape, replayed["phases"], replayed["overall"], failure,
                                           replayed["releases"])
        document["workspace"] = {"bytes": workspace, "source": CUDA_SOURCE}
        _where_the_bytes_go(document, local, spec, replayed["weights_bytes"], workspace)
        return document
    prediction = {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": run_configuration(spec),
        "model": model_description(shape, spec.dtype),
        "workspace": {"bytes": workspace, "source": CUDA_SOURCE},
        "assumptions": EXPANDABLE_ASSUMPTIONS if allocator.expandable_segments else REAL_MODEL_ASSUMPTIONS,
        "overall": replayed["overall"],
        "phases": replayed["phases"],
    }
    if phase_budget is not None or capacity_bytes is not None:  # without a budget nothing is released
        prediction["cache_releases"] = replayed["releases"]
    if allocator.expandable_segments:  # PyTorch's defaults keep the document as it always was
        prediction["allocator_conf"] = allocator.conf_text()
    _where_the_bytes_go(prediction, local, spec, replayed["weights_bytes"], workspace)
    return prediction


MEASURED_BUDGET_SOURCE = (
    "measured: per phase, the smaller of the device's free bytes plus reserved at the phase's start and at "
    "its end (what the allocator could reach, less what appeared outside it: CUDA context, cuBLAS/cuBLASLt "
    "and cuDNN handles, lazily loaded kernels, NCCL); an unrecorded decode step takes the next recorded one's")


def budget_by_phase(budgets: list, spec: RunSpec):
    """phase_budget(rank, phase, index) for predict_model from each rank's measured_budgets: an
    unrecorded decode step runs under the budget of the next recorded step (read after it)."""
    recorded = recorded_steps(spec.new_tokens, spec.decode_record_every)

    def phase_budget(rank, name, index):
        of_rank = budgets[rank]
        if name != "decode":
            return of_rank[("model_load", "inputs", "prefill").index(name)]
        step = next(s for s in recorded if s >= index)
        return of_rank[3 + recorded.index(step)]
    return phase_budget


def _out_of_memory_document(spec: RunSpec, shape: ModelShape, phases: list, totals: dict, exc, releases) -> dict:
    """The prediction of a run that runs out of memory: the phases completed before it, then where it failed."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": run_configuration(spec),
        "model": model_description(shape, spec.dtype),
        "assumptions": REAL_MODEL_ASSUMPTIONS,
        "overall": totals,
        "phases": phases,
        "cache_releases": releases,
        "out_of_memory": exc.report(),
    }


def _kv_cache_bytes(shape: ModelShape, batch: int, positions: int, dtype: str, last_update: int = 1) -> int:
    """Allocated bytes of DynamicCache's keys and values: one tensor each per cache layer, a sliding
    layer's cropped to its window as transformers' DynamicSlidingWindowLayer keeps it
    (ModelShape.kv_cache_bytes)."""
    return shape.kv_cache_bytes(batch, positions, dtype, last_update=last_update, rounded=True)


def _where_the_bytes_go(prediction: dict, shape: ModelShape, spec: RunSpec, weights: int, workspace: int) -> None:
    """Add to each predicted phase what its allocated bytes are made of at its end:
    ``end_allocated_bytes_by_kind`` (weights, inputs, kv_cache, workspace, activations; they add up
    to end_allocated_bytes) and, as earlier versions wrote it, ``bytes_at_end``."""
    prompt = _prompt_bytes(spec)
    for record in prediction["phases"]:
        last_update = 1
        if record["phase"] in ("model_load", "inputs"):
            positions = 0
        elif record["phase"] == "prefill":
            positions = last_update = spec.context
        else:
            positions = spec.context + record["index"] + 1
        kv = _kv_cache_bytes(shape, spec.batch, positions, spec.dtype, last_update)
        held_workspace = workspace if record["phase"] in ("prefill", "decode") else 0
        record["bytes_at_end"] = {
            "weights_bytes": weights,
            "kv_cache_bytes": kv,
            "workspace_bytes": held_workspace,
            "other_bytes": record["end_allocated_bytes"] - weights - kv - held_workspace,
        }
        inputs = 0 if record["phase"] == "model_load" else prompt
        record["end_allocated_bytes_by_kind"] = {
            "weights": weights,
            "inputs": inputs,
            "kv_cache": kv,
            "workspace": held_workspace,
            # the rest: the last token chosen, and whatever the step still holds
            "activations": record["end_allocated_bytes"] - weights - inputs - kv - held_workspace,
        }
        # alive at the phase's peak and gone by its end: activations, logits, kernel scratch
        record["transient_peak_bytes"] = record["peak_allocated_bytes"] - record["end_allocated_bytes"]


def _prompt_bytes(spec: RunSpec) -> int:
    """Allocated bytes of the prompt: one int64 tensor of token ids (8 bytes each), batch x context,
    alive from the inputs phase to the end of the run."""
    return AllocatorModel.round_size(spec.batch * spec.context * 8)


def compare_model(measurement: dict) -> dict:
    """A measurement beside its prediction, phase by phase (every rank's at tensor parallel N);
    differences are measured - predicted."""
    try:
        configuration = dict(measurement["configuration"])
        if configuration.pop("kind") != "transformers":
            raise KeyError("kind")
        spec = RunSpec(**configuration)
        shape = parse_config(measurement["model"]["config"], spec.config_name)
        kind = measurement["model"].get("quantization")
        if kind is not None:  # bitsandbytes' 4-bit weights, as measured (lab_helpers.real.quantized)
            check_quantization(kind, spec.dtype, spec.tensor_parallel)
            shape = replace(shape, quantization=kind)
        if spec.tensor_parallel == 1:
            measured_ranks = [(None, measurement["phases"])]
        else:
            listed = measurement["ranks"]
            if [r["rank"] for r in listed] != list(range(spec.tensor_parallel)):
                raise ValueError(f"ranks must be 0 to {spec.tensor_parallel - 1}, each once, in order")
            measured_ranks = [(r["rank"], r["phases"]) for r in listed]
        for _, measured in measured_ranks:
            [[m[k] for k in COUNTER_KEYS] for m in measured]
    except (KeyError, TypeError, ValueError) as exc:
        raise LabError(f"not a transformers measurement document ({type(exc).__name__}: {exc})") from None
    expected = [("model_load", None), ("inputs", None), ("prefill", None),
                *(("decode", step) for step in recorded_steps(spec.new_tokens, spec.decode_record_every))]
    for _, measured in measured_ranks:
        if [(m["phase"], m["index"]) for m in measured] != expected:
            raise LabError("the measurement's phases differ from the prediction's: not the same protocol")
    budgets = [measured_budgets(measured) for _, measured in measured_ranks]
    bounded = all(b is not None for b in budgets)
    # replayed under the allocator settings the measuring process ran with (its environment block)
    allocator = recorded_settings(measurement.get("environment"))
    if bounded:
        prediction = predict_model(shape, spec, allocator=allocator, phase_budget=budget_by_phase(budgets, spec),
                                   report_out_of_memory=True, budget_source=MEASURED_BUDGET_SOURCE)
    else:
        prediction = predict_model(shape, spec, allocator=allocator)
    predicted_ranks = ([prediction["phases"]] if spec.tensor_parallel == 1 else
                       [r["phases"] for r in prediction["ranks"]])
    rows = []
    for i, ((rank, measured), predicted) in enumerate(zip(measured_ranks, predicted_ranks)):
        for j, (got, want) in enumerate(zip(measured, predicted)):
            row = {"phase": got["phase"], "index": got["index"]}
            if rank is not None:
                row = {"rank": rank, **row}
            row["budget_bytes"] = budgets[i][j] if bounded else None
            for key in COUNTER_KEYS:
                row[f"measured_{key}"] = got[key]
                row[f"predicted_{key}"] = want[key]
                row[f"difference_{key}"] = got[key] - want[key]
            rows.append(row)

    def worst(counter):
        return max((abs(r[f"difference_{counter}"]) / r[f"measured_{counter}"] for r in rows
                    if r[f"measured_{counter}"]), default=0.0)

    measured_env = measurement.get("environment") or {}
    budget = {"replayed_under": "the measured budget of each phase" if bounded else "an unbounded device",
              "rule": MEASURED_BUDGET_SOURCE if bounded else UNRECORDED_NOTE}
    if "out_of_memory" in prediction:
        budget["predicted_out_of_memory"] = prediction["out_of_memory"]
    return {
        "config_name": spec.config_name,
        "budget": budget,
        "outcomes_agree": "out_of_memory" not in prediction,
        "allocator_conf": allocator.conf_text(),
        "measured_on": {k: measured_env.get(k) for k in ("device_name", "torch_version", "cuda_build_version")},
        "measured_transformers_version": measurement["model"].get("transformers_version"),
        "predicted_transformers_version": prediction["model"]["transformers_version"],
        "allocated_exact": all(r[f"difference_{k}"] == 0 for r in rows for k in COUNTER_KEYS if "allocated" in k and "peak" not in k),
        "peak_allocated_worst_relative": worst("peak_allocated_bytes"),
        "peak_reserved_worst_relative": worst("peak_reserved_bytes"),
        **({"tensor_parallel": spec.tensor_parallel, "nccl_outside_allocator_bytes": [
            (r.get("outside_allocator") or {}).get("nccl_outside_allocator_bytes") for r in measurement["ranks"]]}
           if spec.tensor_parallel > 1 else {}),
        "rows": rows,
    }


