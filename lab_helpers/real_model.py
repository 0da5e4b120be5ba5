"""Memory of transformers inference, phase by phase: predicted on any machine, measured on a GPU.

    python -m lab_helpers.real_model predict --config llama-3.1-8b --dtype bfloat16 --batch 1 --context 4096 --new-tokens 64
    python -m lab_helpers.real_model measure --config llama-3.1-8b ... --device cuda:0 --output m.json
    python -m lab_helpers.real_model compare m.json
    python -m lab_helpers.real_model fit --config llama-3.1-8b --gpu h200-sxm --dtype bfloat16 --batch 1 --new-tokens 64

`predict` and `measure` run the same code (`run_protocol`): on the GPU it is measured
with the allocator's own counters, on PyTorch's meta device it is traced op by op
(lab_helpers.alloc_trace) and every allocation is replayed through mesure_memoire's
model of the caching allocator.
"""
import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# >>> library only
from lab_helpers.pricing.card import DURATIONS_DAYS, MAX_ACCEPTED_RESULTS, ForfaitError, load_card
from lab_helpers.allocator.history import HistoryRecorder, INPUTS_LABEL, KV_CACHE_LABEL, WEIGHTS_LABEL
from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.cli import CommandParser, error_line, quiet_broken_pipe
from lab_helpers.core.errors import EXIT_OK, EXIT_PHASE, EXIT_USAGE, LabError
from lab_helpers.core.files import check_new_output, display_path, read_json_file, write_new_json
from lab_helpers.core.numbers import parse_device, whole_number
from lab_helpers.launch.tensor_parallel import TensorParallelRun
from lab_helpers.launch.torchrun import (hold_launcher_stop, keep_own_exit_code, launch_info,
                                         wait_for_every_rank)
from lab_helpers.measurement.environment import environment, usable_memory
from lab_helpers.measurement.protocol import PhaseError, run_phase
from lab_helpers.measurement.recording import (add_timeline_flags, save_oom_snapshot, timeline_recorder,
                                               write_timeline)
from lab_helpers.model_config import (DTYPE_BYTES, MAX_TENSOR_PARALLEL, ConfigError, ModelShape, bundled_names,
                                      check_tensor_parallel, load_config, parse_config)
# <<< library only

SCHEMA_VERSION = 1
PHASE_NAMES = ("model_load", "inputs", "prefill", "decode")
COUNTER_KEYS = ("baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes",
                "end_reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes")
# Absurd requests are refused before any work.
MAX_BATCH = 65536
MAX_CONTEXT = 2**22
MAX_NEW_TOKENS = 4096
MAX_TOKENS = 2**26  # batch x (context + new tokens)
CUDA_SOURCE = ("CUDA behaviour measured with torch 2.11.0+cu130 and transformers 5.17.0 on an NVIDIA H200 "
               "(compute capability 9.0): cuBLAS and cuBLASLt workspaces, cuDNN attention, argmax staging")
ASSUMPTIONS = ("a fresh process; default allocator settings (no PYTORCH_CUDA_ALLOC_CONF); the library's default "
               "attention (SDPA) and cache (DynamicCache); free blocks of equal size taken in the order their "
               "segments were made; reserved without a cache flush unless a capacity is given")
# the repository root: lab_helpers/.. for the module, notebooks/.. in a notebook
_REPOSITORY = Path(globals().get("__file__") or Path.cwd() / "notebook").resolve().parent.parent
RATE_CARD_PATH = _REPOSITORY / "data" / "tarifs-forfaits.csv"


@dataclass(frozen=True)
class RunSpec:
    """One inference run: a model config, dtype, sizes and the decode recording."""

    config_name: str
    dtype: str = "bfloat16"
    batch: int = 1
    context: int = 128
    new_tokens: int = 8
    device: str = "cuda:0"
    seed: int = 0
    decode_record_every: int = 1
    tensor_parallel: int = 1  # GPUs the model is split across with transformers' plan

    def checked(self) -> "RunSpec":
        """Raise LabError on a bad value; return self."""
        parse_device(self.device)  # an explicit cuda:N, checked before torch is imported
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TENSOR_PARALLEL:
            raise LabError(f"--tensor-parallel must be a whole number from 1 to {MAX_TENSOR_PARALLEL}, got {tp!r}")
        if self.dtype not in DTYPE_BYTES:
            raise LabError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        for name, high in (("batch", MAX_BATCH), ("context", MAX_CONTEXT), ("new_tokens", MAX_NEW_TOKENS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise LabError(f"--{name.replace('_', '-')} must be a whole number from 1 to {high}, got {value!r}")
        if self.batch * (self.context + self.new_tokens) > MAX_TOKENS:
            raise LabError(f"batch x (context + new tokens) must be at most {MAX_TOKENS}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise LabError(f"--seed must be a whole number >= 0, got {self.seed!r}")
        if not isinstance(self.decode_record_every, int) or self.decode_record_every < 1:
            raise LabError(f"--decode-record-every must be a whole number >= 1, got {self.decode_record_every!r}")
        return self


def recorded_steps(new_tokens: int, every: int) -> list:
    """Decode steps (0-based) that get a record: every `every`-th one, and the last.

    `new_tokens` N is N decode steps after the prefill (whose greedy token feeds step 0)."""
    steps = [s for s in range(new_tokens) if s % every == 0]
    if new_tokens - 1 not in steps:
        steps.append(new_tokens - 1)
    return steps


def load_shape(config: str) -> ModelShape:
    try:
        return load_config(config)
    except ConfigError as exc:
        raise LabError(str(exc)) from None


def _hf_config(shape: ModelShape):
    from transformers import AutoConfig
    raw = {k: v for k, v in shape.raw.items() if k not in ("model_type", "architectures", "auto_map",
                                                           "torch_dtype", "dtype", "transformers_version")}
    config = AutoConfig.for_model(shape.model_type, **raw)
    config._attn_implementation = "sdpa"
    return config


def _import_model_code(hf_config) -> None:
    """Import everything building the model imports, outside any phase.

    transformers imports some modules lazily on the first build; one of them (torchaudio's
    kaldi helpers, where installed) makes a tensor at import time, which under the
    build's device context would land on the GPU and open a 2 MiB segment."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    tiny = copy.deepcopy(hf_config)
    tiny.num_hidden_layers = 1
    if getattr(tiny, "layer_types", None):
        tiny.layer_types = tiny.layer_types[:1]
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(tiny, attn_implementation="sdpa")


@contextlib.contextmanager
def _weight_init_on_meta(device):
    """On meta, make transformers run its weight init as it does on a GPU.

    transformers skips the init when the build's device is meta. On a GPU each
    sub-model's init runs at the end of its constructor (before the LM head exists), and
    the rotary-frequency recomputation there allocates temporaries; the init's in-place
    fills are no-ops on meta, so running it traces exactly the GPU's requests."""
    if device.type != "meta":
        yield
        return
    import torch
    import transformers.modeling_utils as modeling_utils
    # transformers' own check (a module-level function of 5.17) decides whether to skip the init
    original = modeling_utils.get_torch_context_manager_or_global_device
    modeling_utils.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        modeling_utils.get_torch_context_manager_or_global_device = original


def _tensor_parallel_skeleton(hf_config, dtype, mesh):
    """The model on meta with transformers' own plan applied (tp_plan "auto": the config
    class's base_model_tp_plan and the model's _tp_plan): every split parameter becomes a
    DTensor placeholder whose local meta shard has this rank's shape; nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    if not getattr(type(hf_config), "base_model_tp_plan", None):
        raise LabError(f"{type(hf_config).__name__} has no tensor-parallel plan in transformers; "
                       f"--tensor-parallel must be 1 for this architecture")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    return apply_tensor_parallelism(model, mesh)


def _materialise_local_shards(model, device, std: float, seed: int, rank: int):
    """Give every parameter and buffer of a meta skeleton this rank's local memory on `device`.

    Parameters in named_modules order, each allocated at its local (sharded) shape and
    initialised in place as transformers' _init_weights does (normal for projections and
    embeddings, zeros for biases, ones for norms), so the full weights never exist on one
    GPU. Buffers (the rotary frequencies, float32) are computed on the CPU by a fresh module
    of the same class and copied to the device, one allocation each. Whole tensors draw from
    the global generator (seeded with `seed`: equal on every rank, as they must be); shards
    from a generator of this rank's own, so that the ranks' shards differ."""
    import torch
    from torch.distributed.tensor import DTensor
    # a generator holds its state on the host: the caching allocator sees nothing of it
    shards = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed + 1 + rank)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            shard = param.to_local() if isinstance(param, DTensor) else param
            local = torch.empty(tuple(shard.shape), dtype=shard.dtype, device=device)
            with torch.no_grad():
                if name == "bias":
                    local.zero_()
                elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                    local.normal_(0.0, std, generator=shards if isinstance(param, DTensor) else None)
                else:
                    local.fill_(1.0)
            if isinstance(param, DTensor):
                local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
            module._parameters[name] = torch.nn.Parameter(local, requires_grad=False)
        buffers = list(module.named_buffers(recurse=False))
        if buffers:
            if not hasattr(module, "config"):
                raise LabError(f"cannot rebuild the buffers of {type(module).__name__} at tensor parallel > 1")
            with torch.device("cpu"):
                fresh = type(module)(config=module.config)
            for name, _ in buffers:
                module._buffers[name] = getattr(fresh, name).to(device)


def run_protocol(shape: ModelShape, spec: RunSpec, device, phase, model=None, mesh=None) -> None:
    """Build, feed, prefill and decode; `phase(name, action, index, recorded)` runs each step.

    The same function runs on a GPU (measured) and on the meta device (traced), so the
    order in which tensors are made and dropped is the same in both. With `model` (an
    already built one), the model_load phase is skipped. At tensor parallel N, `mesh` is
    this rank's one-dimensional DeviceMesh (NCCL on a GPU, the fake backend on meta): the
    skeleton is built on meta before the phase and model_load allocates the local shards."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    hf_config = _hf_config(shape)
    dtype = getattr(torch, spec.dtype)
    state = {}
    if model is None:
        _import_model_code(hf_config)
    if spec.tensor_parallel > 1 and mesh is None:
        raise LabError("tensor parallel > 1 needs a device mesh")
    skeleton = (_tensor_parallel_skeleton(hf_config, dtype, mesh)
                if model is None and spec.tensor_parallel > 1 else None)

    def load_model():
        torch.manual_seed(spec.seed)
        if skeleton is not None:
            _materialise_local_shards(skeleton, device, hf_config.initializer_range, spec.seed,
                                      mesh.get_local_rank())
            state["model"] = skeleton.eval()
            return state["model"]
        with torch.device(device), _weight_init_on_meta(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
        state["model"] = model.eval()
        return state["model"]

    def make_inputs():
        if device.type == "meta":
            ids = torch.randint(0, shape.vocab, (spec.batch, spec.context), device=device)
        else:
            generator = torch.Generator(device=device).manual_seed(spec.seed)
            ids = torch.randint(0, shape.vocab, (spec.batch, spec.context), device=device, generator=generator)
        state["ids"] = ids
        return ids

    def prefill():
        cache = DynamicCache(config=hf_config)
        out = state["model"](input_ids=state["ids"], past_key_values=cache, use_cache=True, logits_to_keep=1)
        state["next"] = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        state["cache"] = cache
        return cache

    def decode_step():
        out = state["model"](input_ids=state["next"], past_key_values=state["cache"], use_cache=True,
                             logits_to_keep=1)
        state["next"] = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)

    if model is None:
        phase("model_load", load_model, None, True)
    else:
        state["model"] = model
    phase("inputs", make_inputs, None, True)
    with torch.inference_mode():
        phase("prefill", prefill, None, True)
        recorded = set(recorded_steps(spec.new_tokens, spec.decode_record_every))
        for step in range(spec.new_tokens):
            phase("decode", decode_step, step, step in recorded)
    state.clear()


def model_description(shape: ModelShape, dtype: str) -> dict:
    import transformers
    info = shape.describe()
    info["parameter_bytes"] = shape.parameter_bytes(dtype)
    info["transformers_version"] = transformers.__version__
    info["config"] = shape.raw  # so that a measurement file can be predicted again on its own
    return info


# ----------------------------------------------------------------- measure
def _check_cuda(torch, spec: RunSpec):
    try:
        index = parse_device(spec.device)
    except LabError as exc:
        raise LabError(str(exc)) from None
    if not torch.cuda.is_available():
        raise LabError("no CUDA device is available to torch; measure never falls back to the CPU")
    if index >= torch.cuda.device_count():
        raise LabError(f"{spec.device} is out of range: {torch.cuda.device_count()} device(s) visible")
    # before any call that initialises CUDA on the current device, which is cuda:0 until set
    torch.cuda.set_device(index)
    if spec.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise LabError(f"bfloat16 is not supported on {spec.device}")
    return torch.device(spec.device)


def measure_model(shape: ModelShape, spec: RunSpec, history: "HistoryRecorder | None" = None) -> dict:
    """Measure every phase on the GPU and return the measurement document. With a HistoryRecorder
    (mesure_memoire's), the allocator's history is recorded for the run and `history.timeline`
    holds the timeline, weights, inputs, KV cache and workspaces labelled."""
    spec.checked()
    try:
        import torch
        import transformers  # noqa: F401
    except Exception as exc:
        raise LabError(f"torch and transformers must import to measure: {type(exc).__name__}") from None
    device = _check_cuda(torch, spec)
    torch.cuda.set_device(device)
    torch.cuda.init()
    env = environment(spec.device, usable_memory_figure=False)  # a probe child would fill the GPU mid-run
    phases, alive = [], {}  # alive: the model, inputs and cache, kept for the timeline's labels

    def phase(name, action, index, recorded):
        failed_as = name if index is None else f"{name} {index}"
        if not recorded:
            try:
                action()
            except RuntimeError as exc:
                error = PhaseError(failed_as, exc)
                if history is not None:
                    history.failure(torch, device, error)
                raise error from None
            return
        record, result = run_phase(torch, device, name, action, index, 1 if name in ("prefill", "decode") else 0,
                                   history, failed_as)
        phases.append(record)
        if history is not None and name in ("model_load", "inputs", "prefill"):
            alive[name] = result

    if history is None:
        run_protocol(shape, spec, device, phase)
    else:
        history.start(torch)
        try:
            run_protocol(shape, spec, device, phase)
            history.finish_labelled(torch, device, _timeline_labels(alive), workspace_phase="prefill")
        finally:
            history.stop(torch)
            alive.clear()
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab measurement",
        "environment": env,
        "configuration": _configuration(spec),
        "model": model_description(shape, spec.dtype),
        "phases": phases,
    }


def measure_model_parallel(shape: ModelShape, spec: RunSpec, command, output: "Path | None" = None) -> "dict | None":
    """Measure one rank of a tensor-parallel run started by torchrun (spec.tensor_parallel ranks).

    Every rank measures its phases on cuda:LOCAL_RANK exactly as one GPU does; rank 0 gathers
    every rank's records (over gloo, after every rank finished) and, with `output`, creates the one
    result file. Returns the document on rank 0, None on the others. A failure on any rank ends
    every rank with the same exit code and one line (mesure_memoire.TensorParallelRun); no file is
    written. `command` is the argv given, to say how to launch it when no launcher did."""
    spec.checked()
    check_degree(shape, spec.tensor_parallel)
    info = launch_info(spec.tensor_parallel, command)  # LabError before torch touches a GPU
    try:
        import torch
        import transformers  # noqa: F401
        from torch.distributed.device_mesh import DeviceMesh
    except Exception as exc:
        raise LabError(f"torch and transformers must import to measure: {type(exc).__name__}") from None
    spec = replace(spec, device=info.device)
    device = _check_cuda(torch, spec)
    torch.cuda.init()
    with TensorParallelRun(info, device, prog="real_model") as run:
        if run.rank == 0 and output is not None:
            try:
                check_new_output(output)  # before minutes of loading, on every rank's behalf
            except LabError as exc:
                run.fail(exc)
        env = environment(spec.device, usable_memory_figure=False)
        phases = []

        def phase(name, action, index, recorded):
            failed_as = name if index is None else f"{name} {index}"
            try:
                if not recorded:
                    action()
                    return
                record, _ = run_phase(torch, device, name, action, index,
                                      1 if name in ("prefill", "decode") else 0, None, failed_as)
            except RuntimeError as exc:
                raise PhaseError(failed_as, exc) from None
            phases.append(record)

        try:
            run_protocol(shape, spec, device, phase, mesh=DeviceMesh.from_group(run.group, "cuda"))
        except (PhaseError, LabError) as exc:
            run.fail(exc)
        mine = {"rank": run.rank, "device": spec.device, "device_name": env.get("device_name"),
                "outside_allocator": run.outside_allocator, "phases": phases}
        ranks = run.gather((mine, env))
        document = None
        if run.rank == 0:
            document = {
                "schema_version": SCHEMA_VERSION,
                "kind": "iteragpu-lab measurement",
                "environment": env,
                "configuration": _configuration(spec),  # rank 0's device
                "model": model_description(shape, spec.dtype),
                "ranks": [record for record, _ in ranks],
            }
            if output is not None:
                try:
                    write_new_json(output, document)
                except LabError as exc:
                    run.fail(exc)
        run.broadcast(None)  # every rank ends after the file exists
    return document


def _timeline_labels(alive: dict) -> dict:
    """{storage address: label} of the tensors alive at the end of the run: the parameters, the
    prompt's token ids and the key/value tensors the cache holds after the last decode step."""
    labels = {p.untyped_storage().data_ptr(): WEIGHTS_LABEL for p in alive["model_load"].parameters()}
    labels[alive["inputs"].untyped_storage().data_ptr()] = INPUTS_LABEL
    for layer in getattr(alive["prefill"], "layers", ()):  # transformers 5: one DynamicLayer per layer
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and hasattr(tensor, "untyped_storage") and tensor.numel():
                labels[tensor.untyped_storage().data_ptr()] = KV_CACHE_LABEL
    return labels


# ----------------------------------------------------------------- predict
def _tracing():
    """lab_helpers.alloc_trace, imported on first use because it imports torch; in a notebook,
    where an earlier cell defined its names, the notebook's namespace."""
    import importlib
    try:
        return importlib.import_module("lab_helpers.alloc_trace")
    except ImportError:
        return sys.modules["__main__"]


def load_for_prediction(shape: ModelShape, dtype: str, capacity_bytes=None, tensor_parallel: int = 1,
                        mesh=None) -> dict:
    """Trace the model_load phase once; predictions of other sizes start from a copy of it.

    At tensor parallel N, `mesh` is the rank's fake-backend mesh, which must stay alive
    while the loaded model is used (its forward hooks call the mesh's process group)."""
    import torch
    AllocationTracer = _tracing().AllocationTracer
    CappedAllocator = _tracing().CappedAllocator
    tracer = AllocationTracer(None if capacity_bytes is None else CappedAllocator(capacity_bytes))
    loaded = {"dtype": dtype, "capacity_bytes": capacity_bytes, "tensor_parallel": tensor_parallel, "mesh": mesh}

    def phase(name, action, index, recorded):
        with tracer:
            loaded["model"] = action()
        tracer.collect(settled=True)
        alloc = tracer.allocator
        loaded["record"] = {
            "phase": name, "index": index, "passes": 0,
            "baseline_allocated_bytes": 0, "baseline_reserved_bytes": 0,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved,
        }
        raise _Loaded()

    spec = RunSpec(shape.name, dtype=dtype, tensor_parallel=tensor_parallel).checked()
    hf_config = _hf_config(shape)
    _import_model_code(hf_config)
    try:
        run_protocol(shape, spec, torch.device("meta"), phase, mesh=mesh)
    except _Loaded:
        pass
    tracer.settle()
    # the weights live as long as the model: their blocks stay allocated in the copies
    loaded["weights_bytes"] = sum(block.size for _, block, _ in tracer.settled.values())
    loaded["allocator"] = tracer.allocator
    return loaded


class _Loaded(Exception):
    """Stops run_protocol once the model is built."""


def _configuration(spec: RunSpec) -> dict:
    """The configuration block of a document; a one-GPU document keeps its format (no tensor_parallel)."""
    configuration = {"kind": "transformers", **asdict(spec)}
    if spec.tensor_parallel == 1:
        del configuration["tensor_parallel"]
    return configuration


def check_degree(shape: ModelShape, degree: int) -> None:
    """LabError unless `degree` GPUs can split `shape` with transformers' plan."""
    try:
        check_tensor_parallel(shape, degree)
    except ConfigError as exc:
        raise LabError(str(exc)) from None


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
                  tensor_parallel: "int | None" = None) -> dict:
    """Predict allocated and reserved bytes of every phase, tracing the run on the meta device.

    At tensor parallel N (`tensor_parallel`, or spec.tensor_parallel) every rank is traced in
    turn under torch's fake process-group backend, and the document has a "ranks" list (each
    rank's "overall" and "phases") instead of "phases"; its "overall" is the worst rank's. With
    `loaded` at N > 1 (from load_for_prediction, whose fake group must still be open), only that
    loaded rank is predicted, and returned as the document of one rank."""
    if tensor_parallel is not None:
        spec = replace(spec, tensor_parallel=tensor_parallel)
    spec.checked()
    check_degree(shape, spec.tensor_parallel)
    degree = spec.tensor_parallel
    if degree == 1 or loaded is not None:
        return _predict_rank(shape, spec, capacity_bytes, loaded)
    ranks = []
    for rank in range(degree):
        with fake_process_group(rank, degree) as mesh:
            one = _predict_rank(shape, spec, capacity_bytes, None, mesh)
        ranks.append({"rank": rank, "overall": one.pop("overall"), "phases": one.pop("phases")})
    one["overall"] = {key: max(r["overall"][key] for r in ranks) for key in ("peak_allocated_bytes",
                                                                           "peak_reserved_bytes")}
    one["ranks"] = ranks
    return one


def _predict_rank(shape: ModelShape, spec: RunSpec, capacity_bytes, loaded, mesh=None) -> dict:
    import copy

    import torch
    AllocationTracer = _tracing().AllocationTracer
    if (loaded is None or loaded["dtype"] != spec.dtype or loaded["capacity_bytes"] != capacity_bytes
            or loaded["tensor_parallel"] != spec.tensor_parallel):
        loaded = load_for_prediction(shape, spec.dtype, capacity_bytes, spec.tensor_parallel, mesh)
    tracer = AllocationTracer(copy.deepcopy(loaded["allocator"]))
    alloc = tracer.allocator
    phases = [dict(loaded["record"])]
    totals = {"peak_allocated_bytes": loaded["record"]["peak_allocated_bytes"],
              "peak_reserved_bytes": loaded["record"]["peak_reserved_bytes"]}

    def phase(name, action, index, recorded):
        tracer.collect()
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        alloc.reset_peaks()
        with tracer:
            action()
        tracer.collect()
        totals["peak_allocated_bytes"] = max(totals["peak_allocated_bytes"], alloc.peak_allocated)
        totals["peak_reserved_bytes"] = max(totals["peak_reserved_bytes"], alloc.peak_reserved)
        if recorded:
            phases.append({
                "phase": name, "index": index, "passes": 1 if name in ("prefill", "decode") else 0,
                "baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
                "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
                "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved,
            })

    run_protocol(shape, spec, torch.device("meta"), phase, model=loaded["model"], mesh=loaded["mesh"])
    prediction = {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": _configuration(spec),
        "model": model_description(shape, spec.dtype),
        "workspace": {"bytes": tracer.workspace_bytes, "source": CUDA_SOURCE},
        "assumptions": ASSUMPTIONS,
        "overall": totals,
        "phases": phases,
    }
    # a rank's key/value cache holds its own heads: num_key_value_heads / N
    local = replace(shape, kv_heads=shape.kv_heads // spec.tensor_parallel)
    _where_the_bytes_go(prediction, local, spec, loaded["weights_bytes"], tracer.workspace_bytes)
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


# ----------------------------------------------------------------- compare
def compare_model(measurement: dict) -> dict:
    """A measurement beside its prediction, phase by phase (every rank's at tensor parallel N);
    differences are measured - predicted."""
    try:
        configuration = dict(measurement["configuration"])
        if configuration.pop("kind") != "transformers":
            raise KeyError("kind")
        spec = RunSpec(**configuration).checked()
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


# --------------------------------------------------------------------- fit
# What a real-model measuring process holds outside the allocator (cuBLAS, cuDNN attention, argmax
# kernels) is loaded before the search, so the figure is what such a process can reach; handed to
# mesure_memoire.usable_memory, which runs it in a child process (argv: the device index).
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
# Measured with the probe above on 2026-11-29 (`fit` runs it itself when a GPU is visible
# and no budget is given).
MEASURED_USABLE = {
    "h200-sxm": (149380136960, "NVIDIA H200 143771 MiB, driver 580.159.04, torch 2.11.0+cu130"),
}


def usable_memory_bytes(device: str = "cuda:0") -> int:
    """The largest reserved a fresh real-model measuring process can reach on `device`, measured now
    in a child process; LabError when no GPU answers."""
    index = parse_device(device)
    answer = usable_memory(index, command=[sys.executable, "-c", USABLE_PROBE, str(index)])
    if not isinstance(answer["usable_memory_bytes"], int):
        raise LabError(f"cannot measure the usable memory of {device} "
                       f"({answer['usable_memory_unavailable_reason']}); give --gpu or --memory-bytes")
    return answer["usable_memory_bytes"]


# What NCCL holds outside PyTorch's allocator per rank once its communicator has run a first
# collective (as TensorParallelRun leaves it before the first phase): free memory before the
# process group less free memory after, with the allocator empty. (model_id, degree) -> bytes, where.
MEASURED_NCCL_OUTSIDE = {
    ("h200-sxm", 2): (977272832, "2 x NVIDIA H200 143771 MiB, driver 580.159.04, torch 2.11.0+cu130, NCCL 2.28.9"),
}


def gpu_budget(gpu: str, tariffs=None, tensor_parallel: int = 1) -> tuple:
    """(bytes, source) of a rate-card GPU: the measured usable figure where the lab has one,
    else the vendor's "GB" figure read as 10^9 bytes (an upper bound: the CUDA context and
    the libraries take some of it). At tensor parallel N > 1, one rank's budget: less NCCL's
    bytes outside the allocator where they were measured on that GPU at that degree; where
    not, nothing is subtracted and the source says so."""
    if gpu in MEASURED_USABLE:
        value, where = MEASURED_USABLE[gpu]
        source = f"measured usable memory of a fresh measuring process ({where})"
    else:
        try:
            rows = load_card(tariffs or RATE_CARD_PATH)
        except ForfaitError as exc:
            raise LabError(str(exc)) from None
        found = [row for row in rows if row["model_id"] == gpu]
        if not found:
            raise LabError(f"unknown --gpu {gpu!r}; valid choices: {', '.join(sorted({r['model_id'] for r in rows}))}")
        gb = found[0]["memory_per_gpu_gib"]
        value = gb * 10**9
        source = (f"vendor figure {gb} GB from the rate card, read as {gb} x 10^9 bytes: not measured; "
                  f"the CUDA context and libraries take part of it")
    if tensor_parallel == 1:
        return value, source
    if (gpu, tensor_parallel) in MEASURED_NCCL_OUTSIDE:
        nccl, where = MEASURED_NCCL_OUTSIDE[(gpu, tensor_parallel)]
        return value - nccl, (f"{source}, less {nccl} bytes NCCL holds outside the allocator per rank at "
                              f"tensor parallel {tensor_parallel} (measured: {where})")
    return value, (f"{source}; NCCL's memory outside the allocator at tensor parallel {tensor_parallel} is not "
                   f"measured on {gpu}: not subtracted, so the budget per rank is an upper bound")


def _fits(shape: ModelShape, spec: RunSpec, budget: int, loaded: dict) -> dict:
    OutOfMemory = _tracing().OutOfMemory
    try:
        prediction = predict_model(shape, spec, capacity_bytes=budget, loaded=loaded)
    except OutOfMemory:
        return {"fits": False}
    return {"fits": True, "peak_reserved_bytes": prediction["overall"]["peak_reserved_bytes"],
            "peak_allocated_bytes": prediction["overall"]["peak_allocated_bytes"]}


def fits_at_degree(shape: ModelShape, spec: RunSpec, degree: int, budget_bytes: int) -> dict:
    """Does `spec` fit `degree` GPUs of `budget_bytes` each, the model split with transformers' plan?

    `budget_bytes` is what one rank's allocator may reserve (a GPU's usable memory less what
    NCCL holds outside the allocator, when known). Every rank is predicted with no GPU, each
    under a replayed allocator capped at the budget (see `fit`'s criterion). Returns
    {"fits": bool, "peak_reserved_bytes": int | None, "peak_allocated_bytes": int | None,
    "reason": str | None}: the peaks are the worst rank's (None when it does not fit);
    "reason" says why not (a degree the plan cannot split the model by, weights and cache
    beyond the budget, or the rank that ran out). Raises LabError on a bad spec or budget."""
    spec = replace(spec, tensor_parallel=1).checked()
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
    OutOfMemory = _tracing().OutOfMemory
    try:
        prediction = predict_model(shape, spec, capacity_bytes=budget_bytes, tensor_parallel=degree)
    except OutOfMemory as exc:
        return {**no, "reason": f"out of memory in the replayed allocator: {exc}"}
    return {"fits": True, "peak_reserved_bytes": prediction["overall"]["peak_reserved_bytes"],
            "peak_allocated_bytes": prediction["overall"]["peak_allocated_bytes"], "reason": None}


def _largest(fits, high: int) -> int:
    """Largest v in [1, high] with fits(v), assuming fits is monotone; 0 if none."""
    if not fits(1):
        return 0
    low = 1
    probe = 2
    while probe <= high and fits(probe):
        low, probe = probe, probe * 2
    top = min(probe, high + 1)  # fits(top) is False, or top is beyond the bound
    while top - low > 1:
        middle = (low + top) // 2
        if fits(middle):
            low = middle
        else:
            top = middle
    return low


def fit_model(shape: ModelShape, dtype: str, new_tokens: int, budget_bytes: int, budget_source: str,
        batch=None, context=None, progress=None, tensor_parallel: int = 1) -> dict:
    """Does (batch, context) fit the budget, and the largest context at `batch` and batch at `context`.

    At tensor parallel N the budget is one GPU's (what one rank may reserve) and the search runs
    on rank 0: N divides every size the plan splits (checked), so each rank's local shapes are
    the same and the collectives symmetric; a rank's number reaches no size of this protocol, so
    every rank's trace is rank 0's (predict runs them all, and the tests compare them)."""
    if batch is None and context is None:
        raise LabError("give --batch, --context or both")
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise LabError(f"the memory budget must be a whole number of bytes > 0, got {budget_bytes!r}")
    base = RunSpec(shape.name, dtype=dtype, batch=batch or 1, context=context or 1, new_tokens=new_tokens,
                   decode_record_every=new_tokens, tensor_parallel=tensor_parallel).checked()
    check_degree(shape, tensor_parallel)
    if tensor_parallel == 1:
        return _fit_search(shape, base, budget_bytes, budget_source, batch, context, progress, None)
    with fake_process_group(0, tensor_parallel) as mesh:
        return _fit_search(shape, base, budget_bytes, budget_source, batch, context, progress, mesh)


def _fit_search(shape: ModelShape, base: RunSpec, budget_bytes: int, budget_source: str, batch, context,
                progress, mesh) -> dict:
    dtype, new_tokens, degree = base.dtype, base.new_tokens, base.tensor_parallel
    local = replace(shape, kv_heads=shape.kv_heads // degree)  # one rank's key/value heads
    context_limit = MAX_CONTEXT - new_tokens
    if shape.max_positions:
        context_limit = min(context_limit, max(shape.max_positions - new_tokens, 1))
    cache, predictions = {}, []
    OutOfMemory = _tracing().OutOfMemory
    try:
        loaded = load_for_prediction(shape, dtype, budget_bytes, degree, mesh)
    except OutOfMemory:
        loaded = None  # the weights alone do not fit

    def may_fit(b, t):
        # the weights and the full KV cache are both allocated at the end of the last decode step:
        # beyond the budget, the run cannot fit, whatever the allocator does (no prediction needed)
        return (b * (t + new_tokens) <= MAX_TOKENS and
                loaded["weights_bytes"] + local.kv_cache_bytes(b, t + new_tokens, dtype) <= budget_bytes)

    def fits(b, t):
        if (b, t) not in cache:
            if loaded is None or not may_fit(b, t):
                cache[(b, t)] = {"fits": False}
            else:
                cache[(b, t)] = _fits(shape, replace(base, batch=b, context=t), budget_bytes, loaded)
                predictions.append((b, t))
            if progress:
                progress(b, t, cache[(b, t)]["fits"])
        return cache[(b, t)]["fits"]

    result = {
        "config_name": shape.name, "dtype": dtype, "new_tokens": new_tokens,
        **({"tensor_parallel": degree, "budget_per": "rank (one GPU)"} if degree > 1 else {}),
        "budget_bytes": budget_bytes, "budget_source": budget_source,
        "criterion": ("the run fits when the replayed allocator never needs more than the budget, "
                      "after releasing its wholly free cached segments as PyTorch does before an "
                      "out-of-memory error; peak reserved is then at most the budget"),
    }
    if batch is not None and context is not None:
        point = ({"fits": False} if loaded is None else
                 _fits(shape, replace(base, batch=batch, context=context), budget_bytes, loaded))
        result.update({"batch": batch, "context": context, "fits": point["fits"],
                       "peak_reserved_bytes": point.get("peak_reserved_bytes"),
                       "headroom_bytes": budget_bytes - point["peak_reserved_bytes"] if point["fits"] else None})
    if batch is not None:
        result["batch"] = batch  # the table names it
        result["largest_context_at_batch"] = _largest(lambda t: fits(batch, t), context_limit)
        result["context_bound"] = context_limit
    if context is not None:
        if context > context_limit:
            raise LabError(f"--context {context} is beyond the model's {shape.max_positions} positions "
                           f"minus {new_tokens} new tokens")
        high = min(MAX_BATCH, MAX_TOKENS // (context + new_tokens))
        result["context"] = context
        result["largest_batch_at_context"] = _largest(lambda b: fits(b, context), high)
    result["weights_fit"] = loaded is not None
    result["predictions_run"] = len(predictions)
    return result


# --------------------------------------------------------------------- CLI
def _run_flags(parser, sizes_required=True) -> None:
    parser.add_argument("--config", required=True, metavar="PATH|NAME",
                        help=f"a Hugging Face config.json, or a bundled config: {', '.join(bundled_names())}")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16",
                        help="weights and activations dtype (default bfloat16)")
    parser.add_argument("--batch", type=whole_number(1, MAX_BATCH), required=sizes_required, default=None,
                        help="sequences decoded together")
    parser.add_argument("--context", type=whole_number(1, MAX_CONTEXT), required=sizes_required, default=None,
                        help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=whole_number(1, MAX_NEW_TOKENS), required=True,
                        help="decode steps after the prefill, one greedy token each")
    parser.add_argument("--tensor-parallel", type=whole_number(1, MAX_TENSOR_PARALLEL), default=1, metavar="N",
                        help="split the model across N GPUs with transformers' tensor-parallel plan; figures are "
                             "per rank (default 1: one GPU)")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: one sub-parser per command."""
    parser = CommandParser(prog="real_model", description=(
        "Allocator-exact memory of transformers inference from a config.json: predict on any machine, "
        "measure on a GPU, compare, and find what fits."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    every = "record every K-th decode step and the last (default 1: every step)"
    p = sub.add_parser("predict", help="per-phase allocated and reserved bytes, no GPU needed")
    _run_flags(p)
    p.add_argument("--decode-record-every", type=whole_number(1, MAX_NEW_TOKENS), default=1, metavar="K", help=every)
    p.add_argument("--format", choices=("json", "table"), default="json", help="json (default) or table for people")
    p = sub.add_parser("measure", help="measure every phase on a CUDA GPU (never the CPU)")
    _run_flags(p)
    p.add_argument("--decode-record-every", type=whole_number(1, MAX_NEW_TOKENS), default=1, metavar="K", help=every)
    p.add_argument("--device", default=None,
                   help="an explicit cuda:N (default cuda:0); at --tensor-parallel N > 1 each rank uses "
                        "cuda:LOCAL_RANK, set by torchrun")
    p.add_argument("--seed", type=whole_number(0, 2**63 - 1), default=0, help="seed of the weights and tokens (default 0)")
    p.add_argument("--output", required=True, help="new JSON file, created after the last phase; never overwritten")
    add_timeline_flags(p)
    p = sub.add_parser("compare", help="a measurement file beside its prediction, phase by phase")
    p.add_argument("measurement", help="a JSON file written by measure")
    p.add_argument("--format", choices=("json", "table"), default="json", help="json (default) or table for people")
    p = sub.add_parser("fit", help="does it fit a GPU, and the largest batch and context that do")
    _run_flags(p, sizes_required=False)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--gpu", metavar="MODEL_ID", help="a model_id of the rate card data/tarifs-forfaits.csv")
    budget.add_argument("--memory-bytes", type=whole_number(1, 2**50), metavar="N", help="the budget in bytes")
    p.add_argument("--device", default=None, help="without --gpu, --memory-bytes or --card: the GPU whose usable memory "
                   "is measured (default cuda:0)")
    # --tensor-parallel N: --gpu and --memory-bytes are one GPU's budget, what one rank may reserve
    p.add_argument("--card", action="store_true",
                   help="the buyer's question: for every GPU model of the rate card, the smallest tensor-parallel "
                        "degree that fits, the lots it needs and their price for --days, sorted by price; needs "
                        "--batch, --context and --days, not --gpu or --memory-bytes")
    p.add_argument("--days", type=whole_number(0), choices=DURATIONS_DAYS, metavar="D",
                   help=f"with --card: the forfait's duration in days, one of {', '.join(map(str, DURATIONS_DAYS))}")
    p.add_argument("--accepted-results", type=whole_number(1, MAX_ACCEPTED_RESULTS), metavar="N",
                   help=f"with --card: results accepted over the whole forfait, 1 to {MAX_ACCEPTED_RESULTS}; adds "
                        "the cost per accepted result (rounded half up to the cent, as calcul_forfaits does)")
    p.add_argument("--tariffs", metavar="PATH",
                   help="with --card: a rate card CSV (default data/tarifs-forfaits.csv)")
    p.add_argument("--format", choices=("json", "table"), default="json", help="json (default) or table for people")
    return parser


def _card_fit():
    """lab_helpers.forfait_fit (in a notebook, its cell's names; it imports this module, so not at the top)."""
    import importlib
    try:
        return importlib.import_module("lab_helpers.forfait_fit")
    except ImportError:
        return sys.modules["__main__"]


def _table(rows: list, columns: list) -> str:
    text = [[str(r.get(c, "")) if r.get(c) is not None else "-" for c in columns] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) if text else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(t, widths)) for t in text]
    return "\n".join(lines)


def format_table(command: str, result: dict) -> str:
    """The result as text for people."""
    if command == "fit" and result.get("kind") == _card_fit().CARD_FIT_KIND:
        return _card_fit().format_card_fit(result)
    if command == "predict":
        head = (f"{result['model']['config_name']} ({result['model']['architecture']}, "
                f"{result['model']['parameter_count']} parameters), transformers {result['model']['transformers_version']}\n")
        if "ranks" in result:
            head += f"tensor parallel {len(result['ranks'])}: every figure is one rank's (one GPU's)\n"
            rows = [{"rank": rank["rank"], **r, **r["bytes_at_end"]} for rank in result["ranks"] for r in rank["phases"]]
        else:
            rows = [{**r, **r["bytes_at_end"]} for r in result["phases"]]
        return head + _table(rows, (["rank"] if "ranks" in result else []) + [
            "phase", "index", "end_allocated_bytes", "peak_allocated_bytes", "end_reserved_bytes", "peak_reserved_bytes",
            "weights_bytes", "kv_cache_bytes", "workspace_bytes", "other_bytes", "transient_peak_bytes"])
    if command == "compare":
        cols = (["rank"] if "tensor_parallel" in result else []) + ["phase", "index"] + [
            f"difference_{k}" for k in COUNTER_KEYS]
        return (f"{result['config_name']}: measured - predicted, bytes; allocated exact: {result['allocated_exact']}\n"
                + _table(result["rows"], cols))
    lines = [f"budget: {result['budget_bytes']} bytes ({result['budget_source']})"]
    if "tensor_parallel" in result:
        lines.append(f"tensor parallel {result['tensor_parallel']}: the budget and every figure are one rank's")
    if "fits" in result:
        lines.append(f"batch {result['batch']} x context {result['context']}: "
                     f"{'fits' if result['fits'] else 'does NOT fit'}"
                     + (f", peak reserved {result['peak_reserved_bytes']}, headroom {result['headroom_bytes']} bytes"
                        if result["fits"] else ""))
    if "largest_context_at_batch" in result:
        lines.append(f"largest context at batch {result.get('batch')}: {result['largest_context_at_batch']}")
    if "largest_batch_at_context" in result:
        lines.append(f"largest batch at context {result.get('context')}: {result['largest_batch_at_context']}")
    return "\n".join(lines)


def run_command(args, argv=None) -> dict:
    """Execute one parsed command and return its JSON-ready result (None on a tensor-parallel
    measuring rank other than 0). `argv`: the arguments given, for the launcher hint."""
    if args.command == "compare":
        document = read_json_file(args.measurement)  # bounded size and depth; a FIFO or folder refused
        if not isinstance(document, dict):
            raise LabError(f"{display_path(args.measurement)} is not a measurement document")
        return compare_model(document)
    if args.command == "fit":
        _card_fit().check_card_flags(args)  # before the config is read
    shape = load_shape(args.config)
    if args.command == "fit" and args.card:
        spec = RunSpec(shape.name, dtype=args.dtype, batch=args.batch, context=args.context,
                       new_tokens=args.new_tokens, decode_record_every=args.new_tokens).checked()
        return _card_fit().card_fit(shape, spec, args.days, args.accepted_results, args.tariffs)
    if args.command == "fit":
        degree = args.tensor_parallel
        check_degree(shape, degree)
        if args.gpu:
            budget, source = gpu_budget(args.gpu, tensor_parallel=degree)
        elif args.memory_bytes:
            budget, source = args.memory_bytes, "given with --memory-bytes"
        else:
            device = args.device or "cuda:0"
            budget = usable_memory_bytes(device)
            source = f"usable memory of {device}, measured now in a fresh child process"
            if degree > 1:
                source += ("; NCCL's memory outside the allocator is not subtracted, so the budget per rank "
                           "is an upper bound")
        return fit_model(shape, args.dtype, args.new_tokens, budget, source, args.batch, args.context,
                         tensor_parallel=degree)
    degree = args.tensor_parallel
    check_degree(shape, degree)
    measuring = args.command == "measure"
    if measuring and degree > 1:
        if args.device is not None:
            raise LabError("--device is set by the launcher at --tensor-parallel > 1: rank R uses cuda:LOCAL_RANK")
        if args.timeline is not None:
            raise LabError("--timeline records one GPU's allocator: not available at --tensor-parallel > 1")
    spec = RunSpec(shape.name, dtype=args.dtype, batch=args.batch, context=args.context,
                   new_tokens=args.new_tokens, decode_record_every=args.decode_record_every, tensor_parallel=degree,
                   **({"device": args.device or "cuda:0", "seed": args.seed} if measuring else {})).checked()
    if args.command == "predict":
        return predict_model(shape, spec)
    output = Path(args.output)
    if degree > 1:
        command = ["-m", "lab_helpers.real_model", *(sys.argv[1:] if argv is None else argv)]
        document = measure_model_parallel(shape, spec, command, output)
        if document is None:
            return None
        return {"output": str(output), "ranks": len(document["ranks"]),
                "phases": len(document["ranks"][0]["phases"])}
    check_new_output(output)  # before the model is built, not after minutes of work
    history = timeline_recorder(args, {"--output": args.output})
    document = measure_model(shape, spec, history)
    write_new_json(output, document)
    result = {"output": str(output), "phases": len(document["phases"])}
    if history is not None:
        result.update(write_timeline(args.timeline, history))
    return result


@quiet_broken_pipe
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    hold_launcher_stop()
    args = build_parser().parse_args(argv)
    try:
        result = run_command(args, argv)
    except LabError as exc:
        keep_own_exit_code()
        error_line(f"real_model: error: {exc}")
        wait_for_every_rank()
        return EXIT_USAGE
    except PhaseError as exc:
        note = save_oom_snapshot(args.timeline, exc) if getattr(args, "timeline", None) is not None else ""
        error_line(f"real_model: error: {exc}; no file written{note}")
        return EXIT_PHASE
    if result is None:  # a measuring rank other than 0: rank 0 reports
        return EXIT_OK
    if getattr(args, "format", "json") == "table":
        print(format_table(args.command, result))
    else:
        print(json.dumps(result, indent=2))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
