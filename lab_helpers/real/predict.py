"""Predict a real model's memory with no GPU: the run traced on PyTorch's meta device, every allocation
replayed through the model of the caching allocator; and a measurement set beside its prediction.

`predict_model` runs the same protocol as `measure_model` (lab_helpers.real.protocol), at tensor
parallel N every rank in turn under torch's fake process-group backend.
"""
import contextlib
from dataclasses import replace

from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.errors import LabError
from lab_helpers.core.numbers import DTYPE_BYTES
from lab_helpers.measurement.schema import SCHEMA_VERSION
from lab_helpers.real.config import ModelShape, check_tensor_parallel, parse_config
from lab_helpers.real.spec import COUNTER_KEYS, RunSpec, model_description, recorded_steps, run_configuration

CUDA_SOURCE = ("CUDA behaviour measured with torch 2.11.0+cu130 and transformers 5.17.0 on an NVIDIA H200 "
               "(compute capability 9.0): cuBLAS and cuBLASLt workspaces, cuDNN attention, argmax staging")
REAL_MODEL_ASSUMPTIONS = (
    "a fresh process; default allocator settings (no PYTORCH_CUDA_ALLOC_CONF); the library's default "
    "attention (SDPA) and cache (DynamicCache); free blocks of equal size taken in the order their "
    "segments were made; reserved without a cache flush unless a capacity is given")


def load_for_prediction(shape: ModelShape, dtype: str, capacity_bytes=None, tensor_parallel: int = 1,
                        mesh=None, trace_cache=None, rank: int = 0) -> dict:
    """The traces of one rank of `shape` in `dtype` (a TraceSession: the load traced or read once, each
    size's run after it), and the load replayed under `capacity_bytes` (OutOfMemory when the weights
    alone do not fit). At tensor parallel N, `mesh` is the rank's fake-backend mesh, which must stay
    alive while the session traces (the model's forward hooks call the mesh's process group)."""
    from lab_helpers.real.trace_cache import default_cache
    from lab_helpers.real.traces import TraceSession
    session = TraceSession(shape, dtype, tensor_parallel, rank, trace_cache or default_cache())
    weights = session.replay_load(capacity_bytes, mesh)["weights_bytes"]
    return {"dtype": dtype, "capacity_bytes": capacity_bytes, "tensor_parallel": tensor_parallel, "mesh": mesh,
            "session": session, "weights_bytes": weights}


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
                  tensor_parallel: "int | None" = None, trace_cache=None) -> dict:
    """Predict allocated and reserved bytes of every phase: the run traced on the meta device (or its
    trace read from `trace_cache`, default the user's cache folder), replayed through the allocator model.

    At tensor parallel N (`tensor_parallel`, or spec.tensor_parallel) every rank is traced in
    turn under torch's fake process-group backend, and the document has a "ranks" list (each
    rank's "overall" and "phases") instead of "phases"; its "overall" is the worst rank's. With
    `loaded` at N > 1 (from load_for_prediction, whose fake group must still be open), only that
    loaded rank is predicted, and returned as the document of one rank."""
    from lab_helpers.real.trace_cache import default_cache
    from lab_helpers.real.traces import ModelNeeded, TraceSession
    if tensor_parallel is not None:
        spec = replace(spec, tensor_parallel=tensor_parallel)
    check_tensor_parallel(shape, spec.tensor_parallel)
    degree = spec.tensor_parallel
    cache = trace_cache or default_cache()
    if loaded is not None and (loaded["dtype"], loaded["tensor_parallel"]) == (spec.dtype, degree):
        return _predict_rank(shape, spec, capacity_bytes, loaded["session"], loaded["mesh"])
    if degree == 1:
        return _predict_rank(shape, spec, capacity_bytes, TraceSession(shape, spec.dtype, 1, 0, cache))
    ranks = []
    for rank in range(degree):
        session = TraceSession(shape, spec.dtype, degree, rank, cache)
        try:
            one = _predict_rank(shape, spec, capacity_bytes, session)
        except ModelNeeded:  # a trace is missing: the rank's model is built in its process group
            with fake_process_group(rank, degree) as mesh:
                one = _predict_rank(shape, spec, capacity_bytes, session, mesh)
        ranks.append({"rank": rank, "overall": one.pop("overall"), "phases": one.pop("phases")})
    one["overall"] = {key: max(r["overall"][key] for r in ranks) for key in ("peak_allocated_bytes",
                                                                           "peak_reserved_bytes")}
    one["ranks"] = ranks
    return one


def _predict_rank(shape: ModelShape, spec: RunSpec, capacity_bytes, session, mesh=None) -> dict:
    replayed = session.replay(spec, capacity_bytes, recorded_steps(spec.new_tokens, spec.decode_record_every), mesh)
    workspace = replayed["workspace_bytes"]
    prediction = {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": run_configuration(spec),
        "model": model_description(shape, spec.dtype),
        "workspace": {"bytes": workspace, "source": CUDA_SOURCE},
        "assumptions": REAL_MODEL_ASSUMPTIONS,
        "overall": replayed["overall"],
        "phases": replayed["phases"],
    }
    # a rank's key/value cache holds its own heads: num_key_value_heads / N
    local = replace(shape, kv_heads=shape.kv_heads // spec.tensor_parallel)
    _where_the_bytes_go(prediction, local, spec, replayed["weights_bytes"], workspace)
    return prediction


def _kv_cache_bytes(shape: ModelShape, batch: int, positions: int, dtype: str) -> int:
    """Allocated bytes of DynamicCache's keys and values: one tensor each per layer."""
    one = batch * shape.kv_heads * positions * shape.head_dim * DTYPE_BYTES[dtype]
    return 2 * shape.layers * AllocatorModel.round_size(one) if positions else 0


def _where_the_bytes_go(prediction: dict, shape: ModelShape, spec: RunSpec, weights: int, workspace: int) -> None:
    """Add to each predicted phase what its allocated bytes are made of at its end:
    ``end_allocated_bytes_by_kind`` (weights, inputs, kv_cache, workspace, activations; they add up
    to end_allocated_bytes) and, as earlier versions wrote it, ``bytes_at_end``."""
    prompt = _prompt_bytes(spec)
    for record in prediction["phases"]:
        if record["phase"] in ("model_load", "inputs"):
            positions = 0
        elif record["phase"] == "prefill":
            positions = spec.context
        else:
            positions = spec.context + record["index"] + 1
        kv = _kv_cache_bytes(shape, spec.batch, positions, spec.dtype)
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
    prediction = predict_model(shape, spec)
    predicted_ranks = ([prediction["phases"]] if spec.tensor_parallel == 1 else
                       [r["phases"] for r in prediction["ranks"]])
    rows = []
    for (rank, measured), predicted in zip(measured_ranks, predicted_ranks):
        if [(m["phase"], m["index"]) for m in measured] != [(p["phase"], p["index"]) for p in predicted]:
            raise LabError("the measurement's phases differ from the prediction's: not the same protocol")
        for got, want in zip(measured, predicted):
            row = {"phase": got["phase"], "index": got["index"]}
            if rank is not None:
                row = {"rank": rank, **row}
            for key in COUNTER_KEYS:
                row[f"measured_{key}"] = got[key]
                row[f"predicted_{key}"] = want[key]
                row[f"difference_{key}"] = got[key] - want[key]
            rows.append(row)

    def worst(counter):
        return max((abs(r[f"difference_{counter}"]) / r[f"measured_{counter}"] for r in rows
                    if r[f"measured_{counter}"]), default=0.0)

    measured_env = measurement.get("environment") or {}
    return {
        "config_name": spec.config_name,
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


