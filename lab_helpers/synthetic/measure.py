"""Measuring the synthetic network on one GPU, phase by phase."""
from lab_helpers.allocator.history import HistoryRecorder
from lab_helpers.core.errors import LabError
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.measurement.environment import environment_document
from lab_helpers.measurement.protocol import import_torch, open_device, run_phase
from lab_helpers.synthetic.network import MeasureConfig, synthetic_model


def check_device(torch, config: MeasureConfig):
    if not torch.cuda.is_available():
        raise LabError("no CUDA/ROCm device is available to torch; measure never falls back to the CPU")
    if config.device_index >= torch.cuda.device_count():
        raise LabError(f"{config.device} is out of range: {torch.cuda.device_count()} device(s) visible")
    device = torch.device("cuda", config.device_index)
    open_device(torch, device)  # before the bfloat16 query, which would open the current device
    try:
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.4 has no emulation flag
        bf16 = torch.cuda.is_bf16_supported()
    if config.dtype == "bfloat16" and not bf16:
        raise LabError(f"bfloat16 is not supported on {config.device}")
    return device


def measure(config: MeasureConfig, history: "HistoryRecorder | None" = None) -> dict:
    """Measure every phase on the GPU and return the measurement document. With a HistoryRecorder,
    the allocator's history is recorded for the run and `history.timeline` holds the timeline."""
    torch = import_torch()
    device = check_device(torch, config)
    dtype = getattr(torch, config.dtype)
    hidden = config.hidden_features
    # no usable-memory child here: it would compete with this process's own context
    env = environment_document(config.device, config.device_index, usable_memory_figure=False, usable_memory_probe=None)
    model_info = synthetic_model(config)
    phases, state = [], {}

    def load_model():
        with torch.random.fork_rng(devices=[]):  # seed the CPU init without touching global RNG
            torch.manual_seed(config.seed)
            model = torch.nn.Sequential(torch.nn.Linear(config.width, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, config.width))
        # convert on the CPU, then copy: the device only ever holds the final tensors
        state["model"] = model.to(dtype=dtype).to(device).eval()

    def make_inputs():
        generator = torch.Generator(device=device).manual_seed(config.seed)
        state["x"] = torch.randn((config.batch, config.context, config.width),
                                 generator=generator, device=device, dtype=dtype)

    def forward():
        return state["model"](state["x"])

    def warmup():
        for _ in range(config.warmup):
            forward()  # each output is released before the next pass

    def run_phases():
        phases.append(run_phase(torch, device, "model_load", load_model, history=history)[0])
        phases.append(run_phase(torch, device, "inputs", make_inputs, history=history)[0])
        with torch.inference_mode():
            record, output = run_phase(torch, device, "cold_forward", forward, passes=1, history=history)
            phases.append(record)
            del output  # alive when the end was recorded, released before the next pass
            phases.append(run_phase(torch, device, "warmup", warmup, passes=config.warmup, history=history)[0])
            for repeat in range(config.repeats):
                record, output = run_phase(torch, device, "warm_forward", forward, index=repeat, passes=1,
                                        history=history)
                del output
                record["achieved_tflops"] = model_info["forward_flops"] / record["device_seconds"] / 1e12
                record["host_to_device_time_ratio"] = record["seconds"] / record["device_seconds"]
                phases.append(record)

    if history is None:
        run_phases()
    else:
        history.start(torch)
        try:
            run_phases()
            history.finish(torch, device, state)
        finally:
            history.stop(torch)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab measurement",
        "environment": env,
        "configuration": config.record(),
        "synthetic_model": model_info,
        "phases": phases,
    }
