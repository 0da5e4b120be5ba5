"""Fine-tuning a real model: model_load, inputs, then per optimizer step forward (the causal-LM loss),
backward, optimizer_step and zero_grad; measured on a GPU and traced on meta for the prediction, from one code path.

`run_training_protocol` builds the model through lab_helpers.real.protocol.run_protocol (the
inference run's own model_load), then trains it: on a GPU each phase is measured with the
allocator's counters (`measure_training_model`), on the meta device each is traced op by op by
lab_helpers.real.train_trace and replayed on the allocator model (`predict_training_model`).
With --train qlora the base is the 4-bit model of lab_helpers.real.quantized, prepared by peft's
prepare_model_for_kbit_training before its LoRA adapters are added (`prepare_kbit_training`).
"""
from dataclasses import asdict, dataclass, replace

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.core.numbers import DTYPE_BYTES, parse_device
from lab_helpers.measurement.environment import environment
from lab_helpers.measurement.protocol import run_phase
from lab_helpers.measurement.schema import MAX_TRAIN_STEPS, TRAIN_OPTIMIZERS, TRAIN_STEP_PHASES
from lab_helpers.real.config import ModelShape, parse_config
from lab_helpers.real.protocol import check_cuda, run_protocol
from lab_helpers.measurement.schema import FOUR_BIT_KINDS
from lab_helpers.real.quantized import QUANTIZATIONS, check_quantization, quiet_bitsandbytes_cpu_notice
from lab_helpers.real.spec import COUNTER_KEYS, MAX_MODEL_BATCH, MAX_MODEL_CONTEXT, RunSpec, model_description

TRAIN_MODES = ("full", "lora", "qlora")
AUTOCAST_DTYPES = ("bfloat16",)
ADAPTER_MODES = ("lora", "qlora")  # peft's LoRA adapters on a frozen base: bfloat16 (lora) or 4-bit (qlora)
LEARNING_RATE = 1e-3  # the values never change the bytes
SGD_MOMENTUM = 0.9
MAX_TRAIN_TOKENS = 2**22  # batch x context of one step
MAX_LORA_RANK = 65536
LORA_DROPOUT = 0.0  # dropout would allocate a mask per target; the lab measures without it
# embedding_dense_backward on CUDA takes a sort-based path from this many indices on, whose
# temporaries (sorted indices, counts, segment offsets) are not traced
EMBEDDING_DIRECT_MAX_TOKENS = 3072
ATTENTION_NOTE = ("attention: PyTorch's SDPA with its math backend, in the measured run (torch.nn.attention."
                  "sdpa_kernel) as in the traced one; the fused backends' own workspaces are not predicted yet")
TRAIN_ASSUMPTIONS = (
    "a fresh process; default allocator settings (no PYTORCH_CUDA_ALLOC_CONF); the loss as transformers "
    "computes it with labels=input_ids (float32 logits, cross-entropy over the shifted tokens); the backward "
    "pass on the autograd engine's device thread, whose cuBLAS handle gets its own workspaces; reductions "
    "in one pass (a reduction split across thread blocks allocates a small staging buffer, not added)")
AUTOCAST_NOTE = (
    "autocast bfloat16: each product casts its float32 inputs to bfloat16 (a trained weight once per forward: "
    "autocast keeps that copy until the forward's region exits, and the product keeps it for backward), so the "
    "forward ends holding a bfloat16 copy of every trained weight a product used; float32 ops (pow, rsqrt, "
    "softmax, losses) cast bfloat16 inputs up; gradients and optimizer states stay float32; the trace applies "
    "CUDA's autocast lists at each Python call (lab_helpers.real.autocast)")
TRAIN_NOTES = (
    "the optimizer's states (AdamW: exp_avg and exp_avg_sq per trained parameter, in its dtype; SGD: a "
    "momentum buffer) appear at the first optimizer_step: allocated jumps by their bytes; the second step "
    "shows the steady state",
    "zero_grad(set_to_none=True) frees the gradients' blocks; the reserved segments stay",
)


@dataclass(frozen=True)
class TrainSpec:
    """One fine-tuning run of a real model; checked when built."""

    config_name: str
    dtype: str = "bfloat16"
    batch: int = 1
    context: int = 128
    steps: int = 3
    optimizer: str = "adamw"
    fused: bool = False
    train: str = "full"
    gradient_checkpointing: bool = False
    device: str = "cuda:0"
    seed: int = 0
    lora_rank: "int | None" = None
    lora_targets: "tuple | None" = None  # None: peft's default targets for the model type
    quantize: "str | None" = None  # --train qlora: the 4-bit base's --quantize value (lab_helpers.real.quantized)
    autocast: "str | None" = None  # "bfloat16": float32 weights, the forward under torch.autocast("cuda", bfloat16)

    def __post_init__(self):
        parse_device(self.device)
        if isinstance(self.lora_targets, list):
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.dtype not in DTYPE_BYTES:
            raise ParameterError("dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        for name, low, high in (("batch", 1, MAX_MODEL_BATCH), ("context", 2, MAX_MODEL_CONTEXT),
                                ("steps", 2, MAX_TRAIN_STEPS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ParameterError(name, f"must be a whole number from {low} to {high} with {{task}} train, got {value!r}",
                                     ("task",))
        if self.batch * self.context > MAX_TRAIN_TOKENS:
            raise ParameterError(None, f"batch x context must be at most {MAX_TRAIN_TOKENS} with {{task}} train", ("task",))
        if self.optimizer not in TRAIN_OPTIMIZERS:
            raise ParameterError("optimizer", f"must be one of {', '.join(TRAIN_OPTIMIZERS)}, got {self.optimizer!r}")
        if self.fused and self.optimizer != "adamw":
            raise ParameterError("fused", "is for {optimizer} adamw only", ("optimizer",))
        if self.train not in TRAIN_MODES:
            raise ParameterError("train", f"must be one of {', '.join(TRAIN_MODES)}, got {self.train!r}")
        if self.train in ADAPTER_MODES:
            rank = self.lora_rank
            if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_LORA_RANK:
                raise ParameterError("lora_rank", f"must be a whole number from 1 to {MAX_LORA_RANK} with {{train}} "
                                                  f"{self.train}, got {rank!r}", ("train",))
            targets = self.lora_targets
            if targets is not None and (not isinstance(targets, tuple) or not targets or len(targets) > 64
                                        or not all(isinstance(t, str) and t.isidentifier() for t in targets)):
                raise ParameterError("lora_targets", "must name modules, such as q_proj v_proj (1 to 64 names)")
        elif self.lora_rank is not None or self.lora_targets is not None:
            raise ParameterError("lora_rank", "and {lora_targets} need {train} lora or qlora", ("lora_targets", "train"))
        if self.train == "qlora" and self.quantize is None:
            raise ParameterError("train", f"qlora needs {{quantize}} ({', '.join(FOUR_BIT_KINDS)}): the 4-bit base it "
                                          "trains adapters on", ("quantize",))
        if self.train != "qlora" and self.quantize is not None:
            raise ParameterError("quantize", f"with {{train}} {self.train}: 4-bit weights are frozen, QLoRA trains "
                                             "adapters on them: use {train} qlora", ("train",))
        if self.quantize is not None:
            check_quantization(self.quantize, self.dtype, 1)
            if QUANTIZATIONS[self.quantize] is None:
                raise ParameterError("train", f"qlora on {{quantize}} {self.quantize} is not predicted: QLoRA's base is "
                                              f"one of the 4-bit kinds ({', '.join(FOUR_BIT_KINDS)})", ("quantize",))
        if self.autocast is not None:
            if self.autocast not in AUTOCAST_DTYPES:
                raise ParameterError("autocast", f"must be one of {', '.join(AUTOCAST_DTYPES)}, got {self.autocast!r}")
            if self.dtype != "float32":
                raise ParameterError("autocast", f"{self.autocast} keeps float32 master weights: give {{dtype}} float32 "
                                                 f"(got {self.dtype}; bfloat16 weights train without autocast)",
                                     ("dtype",))
            if self.train == "qlora":
                raise ParameterError("autocast", "with {train} qlora is not predicted: the 4-bit product computes in its "
                                                 "own compute dtype; leave {autocast} out", ("train", "autocast"))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ParameterError("seed", f"must be a whole number >= 0, got {self.seed!r}")

    def record(self) -> dict:
        record = {"kind": "transformers", "task": "train", **asdict(self)}
        if self.autocast is None:
            del record["autocast"]  # the schema takes an autocast dtype or nothing
        if self.quantize is None:
            del record["quantize"]  # the schema takes a --quantize value or nothing
        if self.train not in ADAPTER_MODES:
            del record["lora_rank"], record["lora_targets"]
        elif self.lora_targets is None:
            del record["lora_targets"]  # peft's defaults for the model type; the schema takes a list or nothing
        else:
            record["lora_targets"] = list(self.lora_targets)
        return record

    @property
    def implementation(self) -> str:
        return "fused" if self.fused else "foreach"


def make_model_optimizer(torch, parameters, spec: TrainSpec, device_type: str):
    """The optimizer as a user builds it on CUDA (torch's default there: foreach); on meta, torch
    would take the per-tensor loop, so the implementation CUDA takes is passed explicitly."""
    chosen = {"fused": True} if spec.fused else ({} if device_type == "cuda" else {"foreach": True})
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=LEARNING_RATE, **chosen)
    return torch.optim.SGD(parameters, lr=LEARNING_RATE, momentum=SGD_MOMENTUM, **chosen)


def trained_shape(shape: ModelShape, spec: TrainSpec) -> ModelShape:
    """`shape` with the 4-bit base of --train qlora (its documents' model block names it)."""
    return replace(shape, quantization=spec.quantize) if spec.quantize else shape


def run_training_protocol(shape: ModelShape, spec: TrainSpec, device, phase, empty_cache) -> None:
    """Build the model (run_protocol's model_load), feed it, then train `spec.steps` steps;
    `phase(name, action, index, state)` runs each step and returns what the action returned.
    `empty_cache()` is torch.cuda.empty_cache on a GPU, its replay on the allocator model on meta
    (prepare_model_for_kbit_training calls it after its casts)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    state = {}
    shape = trained_shape(shape, spec)

    def build(name, action, index, recorded):
        def load():
            model = action().train()
            if spec.train == "qlora":
                model = prepare_kbit_training(model, spec, empty_cache)
            elif spec.gradient_checkpointing:
                model.gradient_checkpointing_enable()  # transformers' own: non-reentrant torch.utils.checkpoint
            if spec.train in ADAPTER_MODES:
                model = wrap_lora(model, spec)
            return model
        state["model"] = phase("model_load", load, None, state)

    run_protocol(shape, RunSpec(shape.name, dtype=spec.dtype, device=spec.device, seed=spec.seed), device,
                 build, stop_after="model_load")
    # built outside any phase: the constructor allocates nothing on the device
    trained = [p for p in state["model"].parameters() if p.requires_grad]
    state["optimizer"] = make_model_optimizer(torch, trained, spec, device.type)

    def make_inputs():
        size = (spec.batch, spec.context)
        if device.type == "meta":
            state["ids"] = torch.randint(0, shape.vocab, size, device=device)
        else:
            generator = torch.Generator(device=device).manual_seed(spec.seed)
            state["ids"] = torch.randint(0, shape.vocab, size, device=device, generator=generator)

    def forward():
        with sdpa_kernel([SDPBackend.MATH]), autocast_forward(device.type, spec.autocast):
            # the output (its logits) is dropped here: the graph keeps what backward needs
            state["loss"] = state["model"](input_ids=state["ids"], labels=state["ids"], use_cache=False).loss

    def backward():
        # checkpointing's recomputed forward runs here, under the forward's autocast state
        with sdpa_kernel([SDPBackend.MATH]), autocast_backward(device.type, spec.autocast):
            state.pop("loss").backward()

    def optimizer_step():
        state["optimizer"].step()

    def zero_grad():
        state["optimizer"].zero_grad(set_to_none=True)

    phase("inputs", make_inputs, None, state)
    for step in range(spec.steps):
        for name, action in zip(TRAIN_STEP_PHASES, (forward, backward, optimizer_step, zero_grad)):
            phase(name, action, step, state)
    state.clear()


def autocast_forward(device_type: str, autocast: "str | None"):
    """The forward's autocast region, as users write it: torch.autocast("cuda", dtype=torch.bfloat16)
    around the model call and its loss (backward outside it); on meta, its reproduction."""
    import contextlib

    import torch
    if autocast is None:
        return contextlib.nullcontext()
    dtype = getattr(torch, autocast)
    if device_type != "meta":
        return torch.autocast(device_type, dtype=dtype)
    from lab_helpers.real.autocast import MetaAutocast, installed
    stack = contextlib.ExitStack()
    mode = stack.enter_context(installed(MetaAutocast(dtype)))
    stack.enter_context(mode.region(True, dtype))
    return stack


def autocast_backward(device_type: str, autocast: "str | None"):
    """Backward runs outside autocast; on meta the reproduction stays installed (disabled) so that
    checkpointing's recomputation can restore the forward's state, as it does on CUDA."""
    import contextlib
    if autocast is None or device_type != "meta":
        return contextlib.nullcontext()
    import torch

    from lab_helpers.real.autocast import MetaAutocast, installed
    return installed(MetaAutocast(getattr(torch, autocast)))


def import_peft(mode: str = "lora"):
    quiet_bitsandbytes_cpu_notice()  # peft imports bitsandbytes where it is installed
    try:
        import peft
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "peft":
            raise
        from lab_helpers.core.packages import missing_message
        raise LabError(missing_message("peft", f"--train {mode}")) from None
    return peft


def prepare_kbit_training(model, spec: TrainSpec, empty_cache):
    """peft's prepare_model_for_kbit_training, as QLoRA users call it on the 4-bit model: every
    parameter frozen, the float16/bfloat16 ones that are not 4-bit (embeddings, norms, the output
    head, biases) cast to float32 (param.data = param.data.to(float32): the cast copy is made, then
    the old storage freed), then torch.cuda.empty_cache(); with --gradient-checkpointing, the input
    embeddings' output made to require grad and transformers' checkpointing enabled with
    gradient_checkpointing_kwargs={} (torch's default then: reentrant checkpoint). peft calls
    empty_cache only where torch.cuda.is_available(): its own call is turned off here and made
    through `empty_cache`, so that the meta trace replays it wherever the prediction runs."""
    import inspect

    from lab_helpers.core.packages import install_command
    peft = import_peft("qlora")
    # the replay follows peft 0.21.2, which empties the cache after its casts behind this switch: a
    # peft without the switch is not the one modelled (its release, if any, is unknown to the lab)
    if "auto_clear_cache" not in inspect.signature(peft.prepare_model_for_kbit_training).parameters:
        raise ParameterError("train", f"qlora is modelled with peft 0.21.2's prepare_model_for_kbit_training (its "
                                      f"auto_clear_cache); peft {peft.__version__} has none: {install_command('peft')}")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec.gradient_checkpointing,
                                                 auto_clear_cache=False)
    empty_cache()
    return model


def wrap_lora(model, spec: TrainSpec):
    """The model with peft's LoRA adapters on `spec.lora_targets` (peft's defaults when None), the
    base frozen, as a user wraps it (get_peft_model, lora_alpha = 2 x rank, no dropout)."""
    peft = import_peft(spec.train)
    config = peft.LoraConfig(r=spec.lora_rank, lora_alpha=2 * spec.lora_rank, lora_dropout=LORA_DROPOUT,
                             target_modules=list(spec.lora_targets) if spec.lora_targets else None,
                             task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or ["ValueError"])[0][:300]
        raise LabError(f"peft cannot wrap this model with LoRA: {first}") from None


def check_lora_targets(shape: ModelShape, spec: TrainSpec) -> None:
    """Refuse, before any GPU work, a LoRA target that names no module of the model (checked on a
    one-layer copy built on meta) and a model type peft has no default targets for."""
    if spec.train not in ADAPTER_MODES:
        return
    import_peft(spec.train)
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from lab_helpers.real.protocol import transformers_config
    hf_config = copy.deepcopy(transformers_config(shape))
    hf_config.num_hidden_layers = 1
    if getattr(hf_config, "layer_types", None):
        hf_config.layer_types = hf_config.layer_types[:1]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    if spec.lora_targets is None:
        import_peft()
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        defaults = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(shape.model_type)
        if not defaults:
            raise LabError(f"peft has no default LoRA targets for model type {shape.model_type!r}: name them with "
                           f"--lora-targets (linear layers of this model: {', '.join(sorted(linear))})")
        return
    missing = [t for t in spec.lora_targets if t not in linear]
    if missing:
        raise ParameterError("lora_targets", f"{' '.join(missing)}: no such linear layer in this model (it has "
                                             f"{', '.join(sorted(linear))})")


def measure_training_model(shape: ModelShape, spec: TrainSpec) -> dict:
    """Measure every training phase on the GPU and return the measurement document."""
    try:
        import torch
        import transformers
    except ModuleNotFoundError:
        raise
    except Exception as exc:
        raise LabError(f"torch and transformers must import to measure: {type(exc).__name__}") from None
    del transformers
    device = check_cuda(torch, spec)
    env = environment(spec.device, usable_memory_figure=False)
    phases = []

    def phase(name, action, index, state):
        record, result = run_phase(torch, device, name, action, index, 1 if name in ("forward", "backward") else 0,
                                   None, name if index is None else f"{name} {index}")
        phases.append(record)
        return result

    run_training_protocol(shape, spec, device, phase, torch.cuda.empty_cache)
    return {"schema_version": SCHEMA_VERSION, "kind": "iteragpu-lab measurement", "environment": env,
            "configuration": spec.record(), "model": model_description(trained_shape(shape, spec), spec.dtype),
            "phases": phases}


def predict_training_model(shape: ModelShape, spec: TrainSpec, capacity_bytes=None, allocator=None) -> dict:
    """Predict allocated and reserved bytes of every training phase, tracing the run on meta. With
    `capacity_bytes`, the replayed allocator is capped there and raises lab_helpers.allocator.budget's
    OutOfMemory when the run does not fit. `allocator` (instead of a capacity) is the allocator model
    the trace feeds: lab_helpers.real.train_replay's recorder, which also hears where each phase starts
    and ends (phase_started, phase_ended)."""
    import torch

    from lab_helpers.allocator.budget import OutOfMemory
    from lab_helpers.allocator.addressed import CappedAllocator
    from lab_helpers.real.train_trace import TrainingTracer
    if allocator is None and capacity_bytes is not None:
        allocator = CappedAllocator(capacity_bytes)
    tracer = TrainingTracer(allocator)
    alloc = tracer.allocator
    hears = hasattr(alloc, "phase_started")
    phases = []
    overall = {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0}
    prepared = {}  # --train qlora: what prepare_model_for_kbit_training cast

    def phase(name, action, index, state):
        tracer.collect(settled=True)
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        if hears:
            alloc.phase_started(name, index)
        alloc.reset_peaks()
        tracer.backward = name == "backward"
        if name == "backward":
            tracer.watch_accumulation(state["loss"])
        try:
            with tracer:
                result = action()
        except OutOfMemory as exc:
            exc.phase, exc.index = name, index  # where the capped replay ran out: the phase a GPU run fails in
            raise
        finally:
            tracer.backward = False
        tracer.collect(settled=True)
        if name == "model_load":
            tracer.settle()  # the weights outlive every later phase: scanned at phase ends only
        for key in overall:
            overall[key] = max(overall[key], getattr(alloc, key.replace("_bytes", "")))
        if hears:
            alloc.phase_ended()
        if name == "model_load" and spec.train == "qlora":
            prepared.update(kbit_cast_elements(result, spec))
        phases.append({
            "phase": name, "index": index, "passes": 1 if name in ("forward", "backward") else 0,
            "baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved,
            "end_allocated_bytes_by_kind": _model_bytes_by_kind(tracer, state, result if name == "model_load" else None,
                                                                alloc.allocated),
        })
        return result

    run_training_protocol(shape, spec, torch.device("meta"), phase, tracer.empty_cache)
    notes = list(TRAIN_NOTES)
    if spec.train == "qlora":
        notes.append(qlora_note(spec, **prepared))
    if spec.autocast:
        notes.append(AUTOCAST_NOTE)
    if spec.batch * spec.context > EMBEDDING_DIRECT_MAX_TOKENS:
        notes.append(f"batch x context is above {EMBEDDING_DIRECT_MAX_TOKENS}: the embedding's backward on CUDA "
                     "then sorts the token ids, with temporaries this trace does not add (peaks of backward can "
                     "be higher)")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": spec.record(),
        "model": model_description(trained_shape(shape, spec), spec.dtype),
        "optimizer": {"name": spec.optimizer, "implementation": spec.implementation,
                      "note": ("torch.optim's default on CUDA for float parameters is foreach (never fused unless "
                               "fused=True is passed)" if not spec.fused else "AdamW(fused=True): torch._fused_adamw_")},
        "attention": ATTENTION_NOTE,
        "workspace": {"bytes": tracer.workspace_bytes},
        "assumptions": TRAIN_ASSUMPTIONS,
        "notes": notes,
        "overall": overall,
        "phases": phases,
    }


def kbit_cast_elements(model, spec: TrainSpec) -> dict:
    """The base's parameters prepare_model_for_kbit_training cast to float32 (every one that is
    neither 4-bit nor a LoRA adapter, when the model's dtype is 16-bit): their count and elements."""
    cast = [p for name, p in model.named_parameters()
            if "lora_" not in name and type(p).__name__ != "Params4bit"] if spec.dtype != "float32" else []
    return {"cast_parameters": len(cast), "cast_elements": sum(p.numel() for p in cast)}


def qlora_note(spec: TrainSpec, cast_parameters: int, cast_elements: int) -> str:
    what = (f"cast {cast_parameters} {spec.dtype} parameters ({cast_elements} elements: embeddings, norms, the "
            f"output head, biases) to float32, 2 more bytes per element in model_load, then emptied the cache"
            if cast_parameters else "cast nothing (the model's dtype is already float32), then emptied the cache")
    checkpointing = ("; with --gradient-checkpointing it made the input embeddings' output require grad and "
                     "enabled transformers' checkpointing with gradient_checkpointing_kwargs={} (torch's "
                     "reentrant checkpoint)" if spec.gradient_checkpointing else "")
    return (f"qlora: the {spec.quantize} base loaded as from_pretrained quantizes it; peft's "
            f"prepare_model_for_kbit_training froze every parameter and {what}{checkpointing}; the LoRA adapters "
            "(float32) are the only trained parameters, and the 4-bit product's backward dequantizes each weight "
            "(bitsandbytes' dequantize_4bit) to compute the input's gradient")


def _model_bytes_by_kind(tracer, state: dict, model, allocated: int) -> dict:
    """Allocated bytes at a phase's end by kind: weights (parameters and buffers), gradients,
    optimizer_states, inputs, workspace; activations is the rest (what autograd keeps)."""
    held = {"weights": 0, "inputs": 0, "workspace": 0, "gradients": 0, "optimizer_states": 0, "activations": 0}
    seen = set()
    tables = (tracer.live, tracer.settled)

    def add(kind, tensor):
        key = tensor.untyped_storage()._cdata
        for table in tables:
            if key in table and key not in seen:
                seen.add(key)
                held[kind] += table[key][1].size

    model = model if model is not None else state.get("model")
    if model is not None:
        for tensor in [*model.parameters(), *model.buffers()]:
            add("weights", tensor)
        for parameter in model.parameters():
            if parameter.grad is not None:
                add("gradients", parameter.grad)
    optimizer = state.get("optimizer")
    for values in optimizer.state.values() if optimizer is not None else ():
        for value in values.values():
            if hasattr(value, "untyped_storage") and value.device.type == "meta":
                add("optimizer_states", value)
    if "ids" in state:
        add("inputs", state["ids"])
    held["workspace"] = tracer.workspace_bytes
    held["activations"] = allocated - sum(held.values())
    return held


def train_spec_from(configuration: dict) -> TrainSpec:
    settings = {k: v for k, v in configuration.items() if k not in ("kind", "task")}
    return TrainSpec(**settings)


def compare_training_model(measurement: dict) -> dict:
    """A training measurement beside its prediction; differences are measured minus predicted."""
    try:
        spec = train_spec_from(measurement["configuration"])
        shape = parse_config(measurement["model"]["config"], spec.config_name)
        measured_kind = measurement["model"].get("quantization")
        if measured_kind != spec.quantize:
            raise ValueError(f"the model block's quantization {measured_kind!r} is not the configuration's "
                             f"quantize {spec.quantize!r}")
        measured = measurement["phases"]
        [[m[k] for k in COUNTER_KEYS] for m in measured]
    except (KeyError, TypeError, ValueError) as exc:
        raise LabError(f"not a transformers training measurement ({type(exc).__name__}: {exc})") from None
    predicted = predict_training_model(shape, spec)["phases"]
    if [(m["phase"], m["index"]) for m in measured] != [(p["phase"], p["index"]) for p in predicted]:
        raise LabError("the measurement's phases differ from the prediction's: not the same protocol")
    rows = []
    for got, want in zip(measured, predicted):
        row = {"phase": got["phase"], "index": got["index"]}
        for key in COUNTER_KEYS:
            row[f"measured_{key}"] = got[key]
            row[f"predicted_{key}"] = want[key]
            row[f"difference_{key}"] = got[key] - want[key]
        rows.append(row)

    def worst(counter):
        return max((abs(r[f"difference_{counter}"]) / r[f"measured_{counter}"] for r in rows
                    if r[f"measured_{counter}"]), default=0.0)

    return {
        "config_name": spec.config_name,
        "task": "train",
        "allocated_exact": all(r[f"difference_{k}"] == 0 for r in rows for k in COUNTER_KEYS if "allocated" in k),
        "peak_allocated_worst_relative": worst("peak_allocated_bytes"),
        "peak_reserved_worst_relative": worst("peak_reserved_bytes"),
        "rows": rows,
    }
