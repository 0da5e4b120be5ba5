"""Training the synthetic network: model_load, inputs, then per optimizer step forward (with the loss),
backward, optimizer_step and zero_grad; measured on the GPU and traced on meta for the prediction, from one code path.

`run_training` is the one run: `measure_training` times each phase on a GPU with the allocator's
own counters, `predict_training` runs it on the meta device under the tracer of
lab_helpers.synthetic.train_trace, every request replayed on the allocator model. Standard library
at import: torch is imported inside the functions.
"""
from dataclasses import dataclass

from lab_helpers.allocator.model import AllocatorModel, DEFAULT_WORKSPACE_BYTES, DEFAULT_WORKSPACE_SOURCE
from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.core.numbers import DTYPE_BYTES, parse_whole
from lab_helpers.measurement.environment import environment_document
from lab_helpers.measurement.protocol import import_torch, run_phase
from lab_helpers.measurement.schema import (MAX_TRAIN_STEPS, TRAIN_OPTIMIZERS, TRAIN_STEP_PHASES,
                                            schema_errors, MEASUREMENT_SCHEMA)
from lab_helpers.synthetic.measure import check_device
from lab_helpers.synthetic.network import MeasureConfig, synthetic_model
from lab_helpers.synthetic.train_trace import BACKWARD_WORKSPACE_NOTE, fused_on_meta, training_tracer


DEFAULT_TRAIN_STEPS = 3


LEARNING_RATE = 1e-3  # torch.optim.AdamW's default; the values never change the bytes


SGD_MOMENTUM = 0.9  # a momentum buffer per parameter, created at the first step


TRAIN_KINDS = ("weights", "inputs", "workspace", "gradients", "optimizer_states", "activations")


TRAIN_NOTES = (
    "the optimizer's states (AdamW: exp_avg and exp_avg_sq per parameter, in the parameter's dtype; "
    "SGD: one momentum buffer) are created at the first optimizer_step: allocated jumps there by "
    "their bytes; from the second step on, each step repeats the same requests (the steady state)",
    "backward allocates the gradients (set to None again by zero_grad, which frees their blocks but "
    "keeps the reserved segments) and frees the activations forward saved for it",
    "not added: the staging buffer a CUDA reduction allocates when it splits one output across thread "
    "blocks (the loss's mean over about 131072 values or more, a bias gradient's sum over many tokens); "
    "it is freed within the op, so only peaks can differ, by a few KiB",
)


@dataclass(frozen=True)
class TrainSettings:
    """What a training run does beyond the network's sizes: optimizer steps and the optimizer.
    Validated once, when built."""

    steps: int = DEFAULT_TRAIN_STEPS
    optimizer: str = "adamw"
    fused: bool = False

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int):
            raise ParameterError("steps", f"must be an integer, got {type(self.steps).__name__}")
        parse_whole(self.steps, "steps", 2, MAX_TRAIN_STEPS)
        if self.optimizer not in TRAIN_OPTIMIZERS:
            raise ParameterError("optimizer", f"must be one of {', '.join(TRAIN_OPTIMIZERS)}, got {str(self.optimizer)[:40]!r}")
        if not isinstance(self.fused, bool):
            raise LabError("fused must be true or false")
        if self.fused and self.optimizer != "adamw":
            raise ParameterError("fused", "is for {optimizer} adamw only (SGD runs its default foreach implementation)",
                                 ("optimizer",))

    @property
    def implementation(self) -> str:
        """The kernel family of the optimizer's step on CUDA."""
        return "fused" if self.fused else "foreach"

    def record(self) -> dict:
        """The training keys of a document's configuration."""
        return {"task": "train", "steps": self.steps, "optimizer": self.optimizer, "fused": self.fused}


def implementation_note(settings: TrainSettings) -> str:
    """Which optimizer implementation runs on CUDA, and why, for the output."""
    if settings.fused:
        return ("AdamW(fused=True): torch._fused_adamw_, one kernel per step; its step counters are "
                "one-element float32 tensors on the GPU, one per parameter")
    name = "AdamW" if settings.optimizer == "adamw" else f"SGD(momentum={SGD_MOMENTUM})"
    return (f"{name} with torch's default on CUDA for float parameters: foreach (torch.optim's "
            "default picks foreach and never fused, unless fused=True is passed); "
            + ("its step counters are float32 scalars on the host" if settings.optimizer == "adamw"
               else "no step counter"))


def settings_from_record(configuration: dict) -> TrainSettings:
    return TrainSettings(steps=configuration["steps"], optimizer=configuration["optimizer"],
                         fused=configuration["fused"])


def make_optimizer(torch, parameters, settings: TrainSettings, device_type: str):
    """The optimizer as a user builds it on CUDA. On meta, torch's default would be the per-tensor
    loop (meta is not a foreach device), so the implementation CUDA takes is passed explicitly."""
    chosen = {"fused": True} if settings.fused else ({} if device_type == "cuda" else {"foreach": True})
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=LEARNING_RATE, **chosen)
    return torch.optim.SGD(parameters, lr=LEARNING_RATE, momentum=SGD_MOMENTUM, **chosen)


def run_training(torch, device, config: MeasureConfig, settings: TrainSettings, phase) -> None:
    """Build, feed, then `settings.steps` optimizer steps; `phase(name, action, index, state)` runs
    each step. The same function runs on a GPU (measured) and on meta (traced)."""
    dtype = getattr(torch, config.dtype)
    hidden = config.hidden_features
    state = {}

    def load_model():
        with torch.random.fork_rng(devices=[]):  # seed the CPU init without touching global RNG
            torch.manual_seed(config.seed)
            model = torch.nn.Sequential(torch.nn.Linear(config.width, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, config.width))
        # convert on the CPU, then copy: the device only ever holds the final tensors
        state["model"] = model.to(dtype=dtype).to(device).train()

    def make_inputs():
        size = (config.batch, config.context, config.width)
        if device.type == "meta":
            state["x"] = torch.randn(size, device=device, dtype=dtype)
        else:
            generator = torch.Generator(device=device).manual_seed(config.seed)
            state["x"] = torch.randn(size, generator=generator, device=device, dtype=dtype)

    def forward():
        # the loss: the mean square of the output; autograd keeps what backward needs
        state["loss"] = state["model"](state["x"]).square().mean()

    def backward():
        state.pop("loss").backward()

    def optimizer_step():
        state["optimizer"].step()

    def zero_grad():
        state["optimizer"].zero_grad(set_to_none=True)

    phase("model_load", load_model, None, state)
    # built outside any phase: the constructor allocates nothing on the device
    state["optimizer"] = make_optimizer(torch, state["model"].parameters(), settings, device.type)
    phase("inputs", make_inputs, None, state)
    for step in range(settings.steps):
        for name, action in zip(TRAIN_STEP_PHASES, (forward, backward, optimizer_step, zero_grad)):
            phase(name, action, step, state)
    state.clear()


def _document_base(config: MeasureConfig, settings: TrainSettings, kind: str) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "configuration": {**config.record(), **settings.record()},
        "synthetic_model": synthetic_model(config),
    }


def measure_training(config: MeasureConfig, settings: TrainSettings) -> dict:
    """Measure every training phase on the GPU and return the measurement document."""
    torch = import_torch()
    device = check_device(torch, config)
    env = environment_document(config.device, config.device_index, usable_memory_figure=False,
                               usable_memory_probe=None)
    phases = []

    def phase(name, action, index, state):
        passes = 1 if name in ("forward", "backward") else 0
        phases.append(run_phase(torch, device, name, action, index=index, passes=passes,
                                failed_as=name if index is None else f"{name} {index}")[0])

    run_training(torch, device, config, settings, phase)
    return {**_document_base(config, settings, "iteragpu-lab measurement"), "environment": env,
            "phases": phases}


def predict_training(config: MeasureConfig, settings: TrainSettings, workspace_bytes=DEFAULT_WORKSPACE_BYTES,
                     workspace_source: str = DEFAULT_WORKSPACE_SOURCE) -> dict:
    """Predict allocated and reserved bytes of every training phase: the run traced on the meta
    device, every request replayed on the allocator model. Each phase also has
    ``end_allocated_bytes_by_kind`` (TRAIN_KINDS; they add up to end_allocated_bytes)."""
    if config.tensor_parallel is not None:
        raise ParameterError(None, "tensor-parallel training is out of scope: leave {tensor_parallel} out with {task} train",
                             ("tensor_parallel", "task"))
    workspace_bytes = tuple(workspace_bytes)
    torch = _import_torch_for_prediction()
    backward_workspace = workspace_bytes[:1]
    alloc = AllocatorModel()
    tracer = training_tracer(alloc, workspace_bytes, backward_workspace)
    phases = []

    def phase(name, action, index, state):
        tracer.collect()
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        alloc.reset_peaks()
        tracer.backward = name == "backward"
        with tracer:
            action()
        tracer.backward = False
        tracer.collect()
        phases.append({
            "phase": name, "index": index, "passes": 1 if name in ("forward", "backward") else 0,
            "baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved,
            "end_allocated_bytes_by_kind": _bytes_by_kind(tracer, state, alloc.allocated),
        })

    with fused_on_meta() if settings.fused else _nothing():
        run_training(torch, torch.device("meta"), config, settings, phase)
    return {
        **_document_base(config, settings, "iteragpu-lab prediction"),
        "optimizer": {"name": settings.optimizer, "implementation": settings.implementation,
                      "note": implementation_note(settings)},
        "workspace": {"bytes": list(workspace_bytes), "backward_bytes": list(backward_workspace),
                      "source": workspace_source, "backward_note": BACKWARD_WORKSPACE_NOTE},
        "reserved_assumptions": ("a fresh process, default allocator settings (no PYTORCH_CUDA_ALLOC_CONF), "
                                 "enough free memory (no cache flush and retry)"),
        "notes": list(TRAIN_NOTES),
        "phases": phases,
    }


def _import_torch_for_prediction():
    try:
        import torch
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "torch":
            raise
        raise LabError("predict --task train traces the run on torch's meta device: it needs torch "
                       "(any build, no GPU)") from None
    return torch


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def _bytes_by_kind(tracer, state: dict, allocated: int) -> dict:
    """Split the allocated bytes at a phase's end: the blocks of the parameters, their gradients, the
    optimizer's state tensors, the inputs and the workspaces; the rest is what autograd keeps for
    backward (and the loss)."""
    held = dict.fromkeys(TRAIN_KINDS, 0)
    seen = set()

    def add(kind, tensor):
        block = tracer.block_of(tensor)
        if block is not None and id(block) not in seen:
            seen.add(id(block))
            held[kind] += block.size

    model = state.get("model")
    for parameter in model.parameters() if model is not None else ():
        add("weights", parameter)
        if parameter.grad is not None:
            add("gradients", parameter.grad)
    optimizer = state.get("optimizer")
    for values in optimizer.state.values() if optimizer is not None else ():
        for value in values.values():
            if hasattr(value, "untyped_storage"):
                add("optimizer_states", value)
    if "x" in state:
        add("inputs", state["x"])
    held["workspace"] = sum(block.size for block in tracer.workspace_blocks)
    held["activations"] = allocated - sum(held.values())
    return held


def optimizer_state_bytes(config: MeasureConfig, settings: TrainSettings) -> int:
    """Allocated bytes of the optimizer's states once created: per parameter, AdamW's two moments
    (and with fused=True its float32 step counter on the GPU) or SGD's momentum buffer, each one
    block of the allocator (a multiple of 512 bytes)."""
    element = DTYPE_BYTES[config.dtype]
    shapes = synthetic_model(config)["parameter_shapes"].values()
    total = 0
    for shape in shapes:
        count = 1
        for n in shape:
            count *= n
        one = AllocatorModel.round_size(count * element)
        if settings.optimizer == "adamw":
            total += 2 * one + (AllocatorModel.round_size(4) if settings.fused else 0)
        else:
            total += one
    return total


# What compare needs of a training document: a synthetic configuration with the training keys, and phases
TRAIN_COMPARABLE_SCHEMA = {
    "type": "object",
    "required": ["configuration", "phases"],
    "properties": {
        "configuration": {"allOf": [{"$ref": "#/$defs/synthetic_configuration"},
                                    {"required": ["task", "steps", "optimizer", "fused"]}]},
        "phases": {"type": "array", "minItems": 2 + 4 * 2, "maxItems": 2 + 4 * MAX_TRAIN_STEPS, "items": {
            "type": "object",
            "required": ["phase", "index", *(f"{when}_{counter}_bytes" for when in ("baseline", "end", "peak")
                                             for counter in ("allocated", "reserved"))],
            "properties": MEASUREMENT_SCHEMA["$defs"]["phase"]["properties"],
        }},
    },
}


def compare_training(measurement: dict, workspace_bytes=None) -> dict:
    """A training measurement of the synthetic network beside its prediction; differences are
    measured minus predicted, for every counter of every record."""
    problem = next(schema_errors(measurement, TRAIN_COMPARABLE_SCHEMA, "$", MEASUREMENT_SCHEMA), None)
    if problem:
        raise LabError(f"not a training measurement: {problem[0]}: {problem[1]}")
    configuration = measurement["configuration"]
    settings = settings_from_record(configuration)
    try:
        config = MeasureConfig(**{k: v for k, v in configuration.items()
                                  if k in MeasureConfig.__dataclass_fields__})
    except ParameterError as exc:  # a file's field refused in the words of the flag that sets it
        raise LabError(exc.flagged(lambda name: True)) from None
    if workspace_bytes is None:
        workspace = {"bytes": list(DEFAULT_WORKSPACE_BYTES), "source": DEFAULT_WORKSPACE_SOURCE}
    else:
        workspace = {"bytes": list(workspace_bytes), "source": "given on the command line"}
    predicted = predict_training(config, settings, workspace["bytes"], workspace["source"])["phases"]
    measured = measurement["phases"]
    expected = [(p["phase"], p["index"]) for p in predicted]
    if [(m["phase"], m["index"]) for m in measured] != expected:
        raise LabError(f"$.phases: the records are not the {len(expected)} phases measure --task train writes "
                       f"for {settings.steps} steps (model_load, inputs, then forward, backward, optimizer_step, "
                       "zero_grad per step)")
    rows = []
    for got, want in zip(measured, predicted):
        row = {"phase": got["phase"], "index": got["index"]}
        for key in want:
            if key.endswith("_bytes"):
                row[f"measured_{key}"] = got[key]
                row[f"predicted_{key}"] = want[key]
                row[f"difference_{key}"] = got[key] - want[key]
        rows.append(row)
    differences = [k for k in rows[0] if k.startswith("difference_")]
    return {
        "task": "train",
        "optimizer": {"name": settings.optimizer, "implementation": settings.implementation},
        "workspace": workspace,
        "allocated_exact": all(row[k] == 0 for row in rows for k in differences if "allocated" in k),
        "exact": all(row[k] == 0 for row in rows for k in differences),
        "rows": rows,
    }
