"""The run every real-model command follows: build the model, feed the prompt, prefill, decode.

`run_protocol` runs the same steps on a GPU (measured phase by phase with the allocator's own
counters) and on PyTorch's meta device (traced op by op by lab_helpers.real.tracer), so the order in
which tensors are made and dropped is the same in both. `measure_model` measures it on
one GPU (lab_helpers/real/parallel.py measures one rank of a tensor-parallel run).
"""
import contextlib

from lab_helpers.allocator.history import HistoryRecorder, INPUTS_LABEL, KV_CACHE_LABEL, WEIGHTS_LABEL
from lab_helpers.core.errors import LabError
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.core.numbers import parse_device
from lab_helpers.measurement.environment import environment
from lab_helpers.measurement.protocol import PhaseError, open_device, run_phase
from lab_helpers.real.config import ConfigError, ModelShape, key_named, one_line_reason, transformers_config_of
from lab_helpers.real.quantized import load_on_gpu, load_on_meta, quantized_skeleton, random_checkpoint
from lab_helpers.real.spec import RunSpec, model_description, recorded_steps, run_configuration

def transformers_config(shape: ModelShape):
    """The transformers config of `shape`, with the attention the lab measures (SDPA)."""
    return transformers_config_of(shape.raw)


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
        try:
            AutoModelForCausalLM.from_config(tiny, attn_implementation="sdpa")
        except (TypeError, ValueError, KeyError, AssertionError, OverflowError, ZeroDivisionError) as exc:
            # a config transformers accepted but cannot build a model of (the first build is this one)
            raise ConfigError(f"{key_named(exc, dict(hf_config.to_dict()))}refused by transformers as the model "
                              f"is built: {one_line_reason(exc)}") from None


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


def run_protocol(shape: ModelShape, spec: RunSpec, device, phase, model=None, mesh=None,
                 stop_after: "str | None" = None) -> None:
    """Build, feed, prefill and decode; `phase(name, action, index, recorded)` runs each step.

    The same function runs on a GPU (measured) and on the meta device (traced), so the
    order in which tensors are made and dropped is the same in both. With `model` (an
    already built one), the model_load phase is skipped. With `stop_after="model_load"`,
    the run ends once the model is built (a prediction traces the load once and starts
    every size from a copy of it). At tensor parallel N, `mesh` is this rank's
    one-dimensional DeviceMesh (NCCL on a GPU, the fake backend on meta): the skeleton is
    built on meta before the phase and model_load allocates the local shards."""
    if stop_after not in (None, "model_load"):
        raise ValueError(f"stop_after must be None or 'model_load', got {stop_after!r}")
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    hf_config = transformers_config(shape)
    dtype = getattr(torch, spec.dtype)
    state = {}
    if device.type == "meta":
        phase = _refusing_what_meta_cannot_run(phase)
    if model is None:
        _import_model_code(hf_config)
    if spec.tensor_parallel > 1 and mesh is None:
        raise LabError("tensor parallel > 1 needs a device mesh")
    skeleton = (_tensor_parallel_skeleton(hf_config, dtype, mesh)
                if model is None and spec.tensor_parallel > 1 else None)
    quantized = model is None and bool(shape.quantization)
    checkpoint = contextlib.nullcontext()
    if quantized and device.type == "meta":
        skeleton, quantizer = quantized_skeleton(hf_config, spec.dtype, shape.quantization)
    elif quantized:
        # the checkpoint from_pretrained quantizes, saved from the CPU before the GPU is touched
        checkpoint = random_checkpoint(hf_config, spec.dtype, spec.seed)

    def load_model():
        torch.manual_seed(spec.seed)
        if quantized:
            state["model"] = (load_on_meta(skeleton, quantizer) if device.type == "meta" else
                              load_on_gpu(state["checkpoint"], shape.quantization, spec.dtype, device)).eval()
            return state["model"]
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
        with checkpoint as folder:
            state["checkpoint"] = folder
            phase("model_load", load_model, None, True)
        if stop_after == "model_load":
            return
    else:
        state["model"] = model
    phase("inputs", make_inputs, None, True)
    with torch.inference_mode():
        phase("prefill", prefill, None, True)
        recorded = set(recorded_steps(spec.new_tokens, spec.decode_record_every))
        for step in range(spec.new_tokens):
            phase("decode", decode_step, step, step in recorded)
    state.clear()


def _refusing_what_meta_cannot_run(phase):
    """`phase` whose action, traced on the meta device, turns an op that needs values (a
    data-dependent size, .item(), an op without a meta kernel) into one line naming the op."""
    def guarded_phase(name, action, index, recorded):
        def guarded():
            try:
                return action()
            except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError, AssertionError) as exc:
                if isinstance(exc, LabError):
                    raise
                raise LabError(f"the {name} phase cannot be traced on the meta device (sizes without values): "
                               f"{one_line_reason(exc)}") from None
        return phase(name, guarded, index, recorded)
    return guarded_phase


def check_cuda(torch, spec: RunSpec):
    index = parse_device(spec.device)
    if not torch.cuda.is_available():
        raise LabError("no CUDA device is available to torch; measure never falls back to the CPU")
    if index >= torch.cuda.device_count():
        raise LabError(f"{spec.device} is out of range: {torch.cuda.device_count()} device(s) visible")
    # before any call that initialises CUDA on the current device, which is cuda:0 until set
    open_device(torch, index)
    if spec.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise LabError(f"bfloat16 is not supported on {spec.device}")
    return torch.device(spec.device)


def measure_model(shape: ModelShape, spec: RunSpec, history: "HistoryRecorder | None" = None) -> dict:
    """Measure every phase on the GPU and return the measurement document. With a HistoryRecorder
    (lab_helpers.allocator.history's), the allocator's history is recorded for the run and `history.timeline`
    holds the timeline, weights, inputs, KV cache and workspaces labelled."""
    try:
        import torch
        import transformers
    except ModuleNotFoundError:
        raise  # not installed: core.cli.run names the package and `make lab`
    except Exception as exc:
        raise LabError(f"torch and transformers must import to measure: {type(exc).__name__}") from None
    del transformers  # imported only to fail here, before the GPU is touched, if it cannot
    device = check_cuda(torch, spec)
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
        # the oom file names the run, so that `timeline explain --predict-fit` can search what fits
        history.run = {"configuration": run_configuration(spec), "model_config": shape.raw}
        history.start(torch)
        try:
            run_protocol(shape, spec, device, phase)
            history.finish_labelled(torch, device, timeline_labels(alive), workspace_phase="prefill")
        finally:
            history.stop(torch)
            alive.clear()
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab measurement",
        "environment": env,
        "configuration": run_configuration(spec),
        "model": model_description(shape, spec.dtype),
        "phases": phases,
    }


def timeline_labels(alive: dict) -> dict:
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


