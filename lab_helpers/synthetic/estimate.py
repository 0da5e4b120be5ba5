"""Weight bytes from a parameter count and a bit width (no GPU, no torch)."""
import math

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.numbers import BITS_PER_BYTE, GB, GIB, MAX_BITS, parse_whole


ESTIMATE_EXCLUDES = (
    "activations", "KV cache", "quantization metadata (scales, zero points)",
    "gradients", "optimizer states", "CUDA context and libraries (cuBLAS, cuDNN, kernels)",
)


MAX_PARAMETERS = 10**18  # a billion billion: weight bytes stay exact and GiB figures finite


MAX_RESERVE_GIB = 2**20  # one PiB, far above any device


def estimate(parameters: int, bits: int, reserve_gib: float = 0.0) -> dict:
    """Return the weight bytes of `parameters` at `bits` per parameter, plus a stated reserve."""
    parse_whole(parameters, "parameters", 1, MAX_PARAMETERS)
    parse_whole(bits, "bits", 1, MAX_BITS)
    if isinstance(reserve_gib, bool) or not isinstance(reserve_gib, (int, float)) \
            or not math.isfinite(reserve_gib) or not 0 <= reserve_gib <= MAX_RESERVE_GIB:
        raise ParameterError("reserve_gib", f"must be a finite number from 0 to {MAX_RESERVE_GIB}, got {reserve_gib!r}")
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


def estimate_table(result: dict) -> str:
    """The estimate as lines for people."""
    rows = [
        ("parameters", f"{result['parameters']}"),
        ("bits per parameter", f"{result['bits']} ({result['bytes_per_parameter']} bytes, rounded up)"),
        ("weights", f"{result['weight_gib']:.2f} GiB ({result['weight_bytes']} B; {result['weight_gb']:.2f} GB)"),
        ("reserve (your assumption)", f"{result['reserve_gib']:.2f} GiB"),
        ("total", f"{result['total_gib']:.2f} GiB"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines.append("not counted: " + ", ".join(result["excludes"]))
    return "\n".join(lines)
