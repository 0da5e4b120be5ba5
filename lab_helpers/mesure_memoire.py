"""GPU memory lab: estimate weight bytes, describe the environment, measure and
predict PyTorch caching-allocator counters per phase of a tiny synthetic network.

Self-contained: the standard library at import time, torch only inside the
functions that need a GPU. Run it as a script (``python mesure_memoire.py
estimate|environment|measure|predict|compare ...``) or as
``python -m lab_helpers.mesure_memoire ...``.
"""
import argparse
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
GIB = 2**30  # binary gibibyte
GB = 10**9  # decimal gigabyte, as disk and marketing figures use
BITS_PER_BYTE = 8
MAX_BITS = 64  # no common parameter format is wider
MIN_BLOCK_BYTES = 512  # the allocator rounds every request up to a multiple of this
SMALL_REQUEST_MAX_BYTES = 2**20  # requests up to 1 MiB come from the small pool
SMALL_SEGMENT_BYTES = 2 * 2**20  # small-pool segments are 2 MiB
LARGE_SEGMENT_BYTES = 20 * 2**20  # large requests under 10 MiB share 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * 2**20  # from here a segment is the request itself...
ROUND_LARGE_BYTES = 2 * 2**20  # ...rounded up to 2 MiB
# Persistent math-library workspaces allocated at the first matrix product, in
# allocation order. Measured with torch 2.11.0+cu130 on an NVIDIA H200: a 32 MiB
# cuBLAS workspace (PyTorch's default on compute capability 9.0, 4096 * 8 KiB)
# then a 1 MiB block (cuBLASLt's default workspace is 1024 KiB).
DEFAULT_WORKSPACE_BYTES = (32 * 2**20, 2**20)
DEFAULT_WORKSPACE_SOURCE = "measured default: torch 2.11.0+cu130 on NVIDIA H200 (compute capability 9.0)"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PHASES = ("model_load", "inputs", "cold_forward", "warmup", "warm_forward")
COUNTERS = ("allocated", "reserved")
EXIT_OK, EXIT_USAGE, EXIT_PHASE = 0, 2, 3
ESTIMATE_EXCLUDES = (
    "activations", "KV cache", "quantization metadata (scales, zero points)",
    "gradients", "optimizer states", "CUDA context and libraries (cuBLAS, cuDNN, kernels)",
)
RUNTIME_NOTE = ("cuda_build_version / hip_build_version is the runtime built into torch, not the "
                "installed driver; record the driver separately with the vendor tool "
                "(nvidia-smi or rocm-smi).")
UNAVAILABLE = "unavailable"


class LabError(Exception):
    """A bad input or precondition: one line, exit code 2."""


class PhaseError(Exception):
    """A CUDA failure (out of memory included) during a measured phase: exit code 3."""

    def __init__(self, phase, exc):
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        super().__init__(f"phase {phase} failed: {type(exc).__name__}: {first_line[:300]}")
        self.phase = phase


# ---------------------------------------------------------------- estimate
def estimate(parameters: int, bits: int, reserve_gib: float = 0.0) -> dict:
    """Return the weight bytes of `parameters` at `bits` per parameter, plus a stated reserve."""
    if not isinstance(parameters, int) or parameters <= 0:
        raise LabError(f"--parameters must be a positive integer, got {parameters!r}")
    if not isinstance(bits, int) or not 0 < bits <= MAX_BITS:
        raise LabError(f"--bits must be an integer from 1 to {MAX_BITS}, got {bits!r}")
    if not math.isfinite(reserve_gib) or reserve_gib < 0:
        raise LabError(f"--reserve-gib must be a finite number >= 0, got {reserve_gib!r}")
    bytes_per_parameter = -(-bits // BITS_PER_BYTE)  # whole bytes, rounded up
    weight_bytes = parameters * bytes_per_parameter
    weight_gib = weight_bytes / GIB
    return {
        "parameters": parameters,
        "bits": bits,
        "bytes_per_parameter": bytes_per_parameter,
        "weight_bytes": weight_bytes,
        "weight_gib": weight_gib,
        "weight_gb": weight_bytes / GB,
        "reserve_gib": reserve_gib,
        "total_gib": weight_gib + reserve_gib,
        "excludes": list(ESTIMATE_EXCLUDES),
    }


# ------------------------------------------------------------- environment
@dataclass
class EnvironmentReport:
    """Every field the diagnostic reports; what cannot be read says why."""

    python_version: str
    torch_version: str = UNAVAILABLE
    torch_unavailable_reason: str | None = None
    cuda_build_version: str | None = None
    hip_build_version: str | None = None
    runtime_note: str = RUNTIME_NOTE
    device: str = "cuda:0"
    device_count: int = 0
    device_visible: bool = False
    device_unavailable_reason: str | None = None
    device_name: str | None = None
    compute_capability: str | None = None
    total_memory_bytes: int | None = None
    free_memory_bytes: int | None = None
    os: str = field(default_factory=platform.system)
    machine: str = field(default_factory=platform.machine)


def _safe_reason(exc: BaseException) -> str:
    """One line about `exc` with file paths blanked, so no home or user path leaks."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = re.sub(r"(?:[A-Za-z]:)?[\\/][^\s'\"]*", "<path>", text)
    return f"{type(exc).__name__}: {text}"[:300]


def parse_device(device: str) -> int:
    """Return N for an explicit 'cuda:N' device string, else raise LabError."""
    match = re.fullmatch(r"cuda:(\d+)", device or "")
    if not match:
        raise LabError(f"--device must be an explicit cuda:N (e.g. cuda:0), got {device!r}")
    return int(match.group(1))


def environment(device: str = "cuda:0") -> dict:
    """Report Python, torch, its CUDA/HIP build and the chosen device; never raises for a missing GPU."""
    index = parse_device(device)
    report = EnvironmentReport(python_version=platform.python_version(), device=device)
    try:
        import torch
    except Exception as exc:  # an absent or broken torch is a valid report
        report.torch_unavailable_reason = _safe_reason(exc)
        return asdict(report)
    report.torch_version = str(torch.__version__)
    report.cuda_build_version = torch.version.cuda
    report.hip_build_version = getattr(torch.version, "hip", None)
    try:
        if not torch.cuda.is_available():
            report.device_unavailable_reason = "torch.cuda.is_available() is False"
            return asdict(report)
        report.device_count = torch.cuda.device_count()
        if index >= report.device_count:
            report.device_unavailable_reason = f"{report.device_count} device(s) visible"
            return asdict(report)
        props = torch.cuda.get_device_properties(index)
        report.device_visible = True
        report.device_name = props.name
        report.compute_capability = f"{props.major}.{props.minor}"
        report.total_memory_bytes = int(props.total_memory)
        report.free_memory_bytes = int(torch.cuda.mem_get_info(index)[0])
    except Exception as exc:
        report.device_unavailable_reason = _safe_reason(exc)
    return asdict(report)


# ----------------------------------------------------------------- measure
@dataclass(frozen=True)
class MeasureConfig:
    """What to measure; sizes of the Linear -> GELU -> Linear network and its input."""

    device: str = "cuda:0"
    batch: int = 1
    context: int = 16
    width: int = 64
    hidden: int | None = None  # defaults to 4 * width
    dtype: str = "float32"
    warmup: int = 1
    repeats: int = 2
    seed: int = 0

    def checked(self) -> "MeasureConfig":
        """Return the config with `hidden` filled in, or raise LabError on a bad value."""
        for name in ("batch", "context", "width", "repeats"):
            if getattr(self, name) <= 0:
                raise LabError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.hidden is not None and self.hidden <= 0:
            raise LabError(f"--hidden must be > 0, got {self.hidden}")
        if self.warmup < 0:
            raise LabError(f"--warmup must be >= 0, got {self.warmup}")
        if self.dtype not in DTYPE_BYTES:
            raise LabError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        parse_device(self.device)
        hidden = self.hidden if self.hidden is not None else 4 * self.width
        return MeasureConfig(**{**asdict(self), "hidden": hidden})


def synthetic_model(config: MeasureConfig) -> dict:
    """Describe the network: parameter tensors, counts, bytes and forward FLOPs."""
    c = config.checked()
    shapes = {"0.weight": [c.hidden, c.width], "0.bias": [c.hidden],
              "2.weight": [c.width, c.hidden], "2.bias": [c.width]}
    counts = {name: math.prod(shape) for name, shape in shapes.items()}
    element_bytes = DTYPE_BYTES[c.dtype]
    return {
        "layers": ["Linear(width, hidden)", "GELU", "Linear(hidden, width)"],
        "width": c.width, "hidden": c.hidden,
        "parameter_shapes": shapes,
        "parameter_count": sum(counts.values()),
        "parameter_bytes": sum(counts.values()) * element_bytes,
        # two matrix products of 2*N*width*hidden each; bias adds and GELU not counted
        "forward_flops": 4 * c.batch * c.context * c.width * c.hidden,
    }


def _import_torch():
    try:
        import torch
    except Exception as exc:
        raise LabError(f"torch cannot be imported ({_safe_reason(exc)}); measure needs a GPU build of torch")
    return torch


def _check_device(torch, config: MeasureConfig):
    index = parse_device(config.device)
    if not torch.cuda.is_available():
        raise LabError("no CUDA/ROCm device is available to torch; measure never falls back to the CPU")
    if index >= torch.cuda.device_count():
        raise LabError(f"{config.device} is out of range: {torch.cuda.device_count()} device(s) visible")
    try:
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.4 has no emulation flag
        bf16 = torch.cuda.is_bf16_supported()
    if config.dtype == "bfloat16" and not bf16:
        raise LabError(f"bfloat16 is not supported on {config.device}")
    return torch.device(config.device)


def _phase(torch, device, name, action, index=None, passes=0):
    """Run `action` as one phase; return (record, what action returned)."""
    torch.cuda.synchronize(device)
    baseline_allocated = torch.cuda.memory_allocated(device)
    baseline_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        started = time.perf_counter()
        start.record()
        result = action()
        end.record()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        device_seconds = start.elapsed_time(end) / 1000.0  # elapsed_time is in ms
    except RuntimeError as exc:  # torch.OutOfMemoryError and CUDA errors derive from it
        raise PhaseError(name, exc) from None
    stats = torch.cuda.memory_stats(device)
    record = {
        "phase": name, "index": index, "passes": passes,
        "seconds": seconds, "device_seconds": device_seconds,
        "baseline_allocated_bytes": baseline_allocated,
        "baseline_reserved_bytes": baseline_reserved,
        "end_allocated_bytes": stats["allocated_bytes.all.current"],
        "end_reserved_bytes": stats["reserved_bytes.all.current"],
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
    }
    return record, result


def measure(config: MeasureConfig) -> dict:
    """Measure every phase on the GPU and return the measurement document."""
    config = config.checked()
    torch = _import_torch()
    device = _check_device(torch, config)
    torch.cuda.set_device(device)
    torch.cuda.init()
    dtype = getattr(torch, config.dtype)
    env = environment(config.device)
    model_info = synthetic_model(config)
    phases, state = [], {}

    def load_model():
        with torch.random.fork_rng(devices=[]):  # seed the CPU init without touching global RNG
            torch.manual_seed(config.seed)
            model = torch.nn.Sequential(torch.nn.Linear(config.width, config.hidden), torch.nn.GELU(),
                                        torch.nn.Linear(config.hidden, config.width))
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

    phases.append(_phase(torch, device, "model_load", load_model)[0])
    phases.append(_phase(torch, device, "inputs", make_inputs)[0])
    with torch.inference_mode():
        record, output = _phase(torch, device, "cold_forward", forward, passes=1)
        phases.append(record)
        del output  # alive when the end was recorded, released before the next pass
        phases.append(_phase(torch, device, "warmup", warmup, passes=config.warmup)[0])
        for repeat in range(config.repeats):
            record, output = _phase(torch, device, "warm_forward", forward, index=repeat, passes=1)
            del output
            record["achieved_tflops"] = model_info["forward_flops"] / record["device_seconds"] / 1e12
            record["host_to_device_time_ratio"] = record["seconds"] / record["device_seconds"]
            phases.append(record)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab measurement",
        "environment": env,
        "configuration": asdict(config),
        "synthetic_model": model_info,
        "phases": phases,
    }


def new_file_name(folder, stem: str, suffix: str = ".json") -> Path:
    """Return a path in `folder` named after `stem` and the time that no file takes yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        candidate = Path(folder) / f"{stem}-{stamp}{'' if n == 0 else f'-{n}'}{suffix}"
        if not candidate.exists():
            return candidate
    raise LabError(f"no free file name for {stem} in {folder}")


def write_new_text(path, text: str) -> None:
    """Write `text` to `path` whole or not at all; refuse if `path` exists."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)  # atomic and exclusive: fails if another run took the name
    except FileExistsError:
        raise LabError(f"{path} already exists; choose a new file name") from None
    finally:
        os.unlink(tmp)


def write_new_json(path, document) -> None:
    """Write `document` as JSON to `path` whole or not at all; refuse if `path` exists."""
    write_new_text(path, json.dumps(document, indent=2) + "\n")


# ----------------------------------------------------------------- predict
@dataclass(eq=False)
class _Block:
    size: int
    address: int
    segment: list  # the blocks of its segment, in address order
    small: bool
    free: bool = True


class AllocatorModel:
    """Replays PyTorch's CUDA caching allocator (default settings) on request sizes alone."""

    def __init__(self):
        self.free_blocks = {True: [], False: []}  # per pool (small?), the cached free blocks
        self.next_address = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    @staticmethod
    def round_size(request_bytes: int) -> int:
        """Bytes the allocator hands out for a request: a multiple of 512, at least 512."""
        return max(MIN_BLOCK_BYTES, -(-request_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)

    @staticmethod
    def segment_size(rounded: int) -> int:
        """Bytes a new segment for a rounded request reserves from the device."""
        if rounded <= SMALL_REQUEST_MAX_BYTES:
            return SMALL_SEGMENT_BYTES
        if rounded < MIN_LARGE_ALLOC_BYTES:
            return LARGE_SEGMENT_BYTES
        return -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES

    def malloc(self, request_bytes: int) -> _Block:
        """Allocate; return the block to pass to free()."""
        size = self.round_size(request_bytes)
        small = size <= SMALL_REQUEST_MAX_BYTES
        pool = self.free_blocks[small]
        fits = [b for b in pool if b.size >= size]
        if fits:  # best fit: the smallest block, then the lowest address
            block = min(fits, key=lambda b: (b.size, b.address))
            pool.remove(block)
        else:  # a new segment (cudaMalloc)
            total = self.segment_size(size)
            block = _Block(total, self.next_address, [], small)
            block.segment.append(block)
            self.next_address += total
            self.reserved += total
        remaining = block.size - size
        # a small block splits if 512 bytes remain; a large one only if over 1 MiB remains
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_MAX_BYTES:
            rest = _Block(remaining, block.address + size, block.segment, small)
            block.segment.insert(block.segment.index(block) + 1, rest)
            pool.append(rest)
            block.size = size
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: _Block) -> None:
        """Return a block to its pool, merged with its free neighbours in the segment."""
        self.allocated -= block.size
        block.free = True
        pool, segment = self.free_blocks[block.small], block.segment
        i = segment.index(block)
        for j in (i + 1, i - 1):  # the next one first, so index i stays valid
            if 0 <= j < len(segment) and segment[j].free:
                neighbour = segment.pop(j)
                pool.remove(neighbour)
                block.size += neighbour.size
                block.address = min(block.address, neighbour.address)
        pool.append(block)

    def reset_peaks(self) -> None:
        """Restart the peaks from the current values, as reset_peak_memory_stats does."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def predict(config: MeasureConfig, workspace_bytes=DEFAULT_WORKSPACE_BYTES,
            workspace_source: str = DEFAULT_WORKSPACE_SOURCE) -> dict:
    """Predict allocated and reserved bytes per phase, from the allocator's rules alone."""
    c = config.checked()
    element = DTYPE_BYTES[c.dtype]
    tokens = c.batch * c.context
    alloc = AllocatorModel()
    live = {}
    phases = []

    def phase(name, action, index=None, passes=0):
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        alloc.reset_peaks()
        action()
        phases.append({
            "phase": name, "index": index, "passes": passes,
            "baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved,
        })

    def load_model():
        for shape in synthetic_model(c)["parameter_shapes"].values():
            alloc.malloc(math.prod(shape) * element)

    def forward():
        # nn.Linear on a contiguous 3-D input is one addmm: its output comes first,
        # then the math library's workspace on the very first product
        first = alloc.malloc(tokens * c.hidden * element)
        if not live.get("workspace"):
            live["workspace"] = [alloc.malloc(size) for size in workspace_bytes]
        activated = alloc.malloc(tokens * c.hidden * element)  # GELU output
        alloc.free(first)  # Sequential drops the first output once GELU has returned
        output = alloc.malloc(tokens * c.width * element)
        alloc.free(activated)
        return output

    def measured_forward():
        live["output"] = forward()

    def warmup():
        for _ in range(c.warmup):
            alloc.free(forward())

    phase("model_load", load_model)
    phase("inputs", lambda: alloc.malloc(tokens * c.width * element))
    phase("cold_forward", measured_forward, passes=1)
    alloc.free(live.pop("output"))
    phase("warmup", warmup, passes=c.warmup)
    for repeat in range(c.repeats):
        phase("warm_forward", measured_forward, index=repeat, passes=1)
        alloc.free(live.pop("output"))
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": asdict(c),
        "synthetic_model": synthetic_model(c),
        "workspace": {"bytes": list(workspace_bytes), "source": workspace_source},
        "reserved_assumptions": (
            "a fresh process, default allocator settings (no PYTORCH_CUDA_ALLOC_CONF: no "
            "expandable_segments, no max_split_size_mb), enough free memory (no cache flush and "
            "retry), and free blocks of equal size taken in the order their segments were made"),
        "phases": phases,
    }


def compare(measurement: dict, workspace_bytes=None) -> dict:
    """Set a measurement beside its prediction; differences are measured minus predicted."""
    try:
        config = MeasureConfig(**measurement["configuration"])
        measured = measurement["phases"]
    except (KeyError, TypeError) as exc:
        raise LabError(f"not a measurement document: {_safe_reason(exc)}") from None
    bare = predict(config, workspace_bytes=())["phases"]
    cold = [m for m, b in zip(measured, bare) if m["phase"] == "cold_forward"]
    detected = cold[0]["end_allocated_bytes"] - bare[PHASES.index("cold_forward")]["end_allocated_bytes"] if cold else None
    if workspace_bytes is None:
        prediction = predict(config)
    else:
        prediction = predict(config, workspace_bytes, "given on the command line")
    rows = []
    for got, want in zip(measured, prediction["phases"]):
        row = {"phase": got["phase"], "index": got.get("index")}
        for key in want:
            if key.endswith("_bytes"):
                row[f"measured_{key}"] = got[key]
                row[f"predicted_{key}"] = want[key]
                row[f"difference_{key}"] = got[key] - want[key]
        rows.append(row)
    allocated_keys = [k for k in rows[0] if k.startswith("difference_") and "allocated" in k] if rows else []
    return {
        "workspace": prediction["workspace"],
        "workspace_detected_bytes": detected,
        "allocated_exact": all(row[k] == 0 for row in rows for k in allocated_keys),
        "rows": rows,
    }


# --------------------------------------------------------------------- CLI
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit code 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_size_flags(parser) -> None:
    parser.add_argument("--batch", type=_positive_int, default=1, help="sequences per forward pass (default 1)")
    parser.add_argument("--context", type=_positive_int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--width", type=_positive_int, default=64, help="model width: Linear input/output features (default 64)")
    parser.add_argument("--hidden", type=_positive_int, default=None, help="hidden features of the first Linear (default 4 x width)")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="float32", help="parameter and input dtype (default float32)")
    parser.add_argument("--warmup", type=_non_negative_int, default=1, help="warm-up passes, recorded as one phase (default 1)")
    parser.add_argument("--repeats", type=_positive_int, default=2, help="measured warm passes, one record each (default 2)")


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser with its five subcommands."""
    parser = _Parser(prog="mesure_memoire", description=(
        "Estimate weight bytes, describe the environment, and measure or predict PyTorch "
        "allocator counters per phase of a tiny Linear -> GELU -> Linear network."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("estimate", help="weight bytes from a parameter count and a bit width (no GPU)")
    p.add_argument("--parameters", type=_positive_int, required=True, help="number of model parameters")
    p.add_argument("--bits", type=_positive_int, required=True, help="bits per parameter, rounded up to whole bytes")
    p.add_argument("--reserve-gib", type=_number, default=0.0, help="extra GiB you choose to add, stated as an assumption (default 0)")
    p = sub.add_parser("environment", help="privacy-safe diagnostic of Python, torch and the device")
    p.add_argument("--device", default="cuda:0", help="device to describe, cuda:N (default cuda:0)")
    p = sub.add_parser("measure", help="measure memory and time per phase on the GPU (never on the CPU)")
    p.add_argument("--device", default="cuda:0", help="device to measure on, an explicit cuda:N (default cuda:0)")
    _add_size_flags(p)
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the weights and inputs (default 0)")
    p.add_argument("--output", required=True, help="new JSON file to create; an existing file is never overwritten")
    p = sub.add_parser("predict", help="predict allocated/reserved bytes per phase (no GPU)")
    _add_size_flags(p)
    p.add_argument("--workspace-bytes", type=_non_negative_int, nargs="*", default=None, metavar="N",
                   help="math-library workspace blocks allocated at the first matrix product "
                        f"(default {' '.join(map(str, DEFAULT_WORKSPACE_BYTES))}: {DEFAULT_WORKSPACE_SOURCE})")
    p = sub.add_parser("compare", help="a measurement file beside its prediction, per phase")
    p.add_argument("measurement", help="JSON file written by measure")
    p.add_argument("--workspace-bytes", type=_non_negative_int, nargs="*", default=None, metavar="N",
                   help="override the workspace blocks (default: the measured default above)")
    p.add_argument("--fail-on-difference", action="store_true",
                   help="exit 1 if any predicted allocated count differs from the measured one")
    return parser


def _config_from(args) -> MeasureConfig:
    return MeasureConfig(**{k: getattr(args, k) for k in MeasureConfig.__dataclass_fields__ if hasattr(args, k)})


def run_command(args) -> dict:
    """Execute one parsed command and return its JSON-ready result."""
    if args.command == "estimate":
        return estimate(args.parameters, args.bits, args.reserve_gib)
    if args.command == "environment":
        return environment(args.device)
    if args.command == "predict":
        if args.workspace_bytes is None:
            return predict(_config_from(args))
        return predict(_config_from(args), tuple(args.workspace_bytes), "given on the command line")
    if args.command == "compare":
        try:
            document = json.loads(Path(args.measurement).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LabError(f"cannot read {args.measurement}: {_safe_reason(exc)}") from None
        ws = None if args.workspace_bytes is None else tuple(args.workspace_bytes)
        return compare(document, ws)
    config = _config_from(args).checked()
    output = Path(args.output)
    if output.exists():
        raise LabError(f"{output} already exists; choose a new file name")
    if not output.parent.is_dir():
        raise LabError(f"folder {output.parent} does not exist")
    document = measure(config)
    write_new_json(output, document)
    return {"output": str(output), "phases": len(document["phases"])}


def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        result = run_command(args)
    except LabError as exc:
        print(f"mesure_memoire: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PhaseError as exc:
        print(f"mesure_memoire: error: {exc}; no file written", file=sys.stderr)
        return EXIT_PHASE
    print(json.dumps(result, indent=2))
    if args.command == "compare" and args.fail_on_difference and not result["allocated_exact"]:
        return 1
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
