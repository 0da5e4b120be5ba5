"""What bitsandbytes' CUDA kernels allocate, for the meta-device tracer.

bitsandbytes (pinned 0.50.2) defines its operators with torch.library; on meta their fake
kernels make the outputs alone, while the CUDA kernels (bitsandbytes/backends/cuda/ops.py) are
Python functions that allocate through the caching allocator before calling the library's C
code. `run_kernel` makes, in the tracer's mode, the tensors each CUDA kernel makes, in its
order, so that the trace sees what the GPU's allocator sees (the 8-bit kernels: int8 values and
row scales, the int32 product, its float16 dequantization and cast). The 4-bit product chooses between
a fused kernel and dequantize-then-linear by bitsandbytes' own per-device rule,
`_gemm_4bit_use_custom_cuda`: its CUDA module cannot be imported without CUDA, so the rule is
compiled from the installed bitsandbytes' source and asked about the predicted device."""
import ast
import functools

import torch

from lab_helpers.core.errors import LabError

# bitsandbytes/backends/cuda/ops.py: the product of more rows than this dequantizes the weight
# first; its per-device rule decides below it
CUSTOM_MAX_ROWS = 1536
RULE_NAMES = ("_gemm_4bit_use_custom_cuda",)
RULE_CONSTANTS = ("_GEMM_4BIT_CUSTOM_FLOOR_M",)


@functools.lru_cache(maxsize=None)
def _device_rule(multiprocessors: int, major: int, minor: int):
    """bitsandbytes' gemm_4bit kernel choice (device index, dtype, M, N, K) -> fused, for a device of
    `multiprocessors` SMs and compute capability major.minor."""
    import bitsandbytes
    from pathlib import Path
    path = Path(bitsandbytes.__file__).parent / "backends" / "cuda" / "ops.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kept = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in RULE_NAMES)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in RULE_CONSTANTS for t in node.targets))]
    if len(kept) != len(RULE_NAMES) + len(RULE_CONSTANTS):
        raise LabError(f"bitsandbytes {bitsandbytes.__version__}: its 4-bit product rule is not where 0.50.2 "
                       f"keeps it; this bitsandbytes is not the one the lab models")
    namespace = {"torch": torch, "functools": functools, "_gpu_dispatch_props": lambda index: (multiprocessors, major, minor)}
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(path), "exec"), namespace)  # its own code, unchanged
    return namespace["_gemm_4bit_use_custom_cuda"]


def _empty(shape, dtype):
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _quantize_4bit(tracer, A, blocksize, quant_type, quant_storage):
    n = A.numel()
    absmax = _empty((-(n // -blocksize),), torch.float32)
    out = _empty(((n + 1) // (quant_storage.itemsize * 2), 1), quant_storage)
    return out, absmax


def _quantize_blockwise(tracer, A, code, blocksize):
    n = A.numel()
    absmax = _empty((-(n // -blocksize),), torch.float32)
    out = torch.empty_like(A, dtype=torch.uint8)
    return out, absmax


def _dequantize_blockwise(tracer, A, absmax, code, blocksize, dtype):
    return torch.empty_like(A, dtype=dtype)


def _dequantize_4bit(tracer, A, absmax, blocksize, quant_type, shape, dtype):
    return _empty(shape, dtype)


def _gemm_4bit(tracer, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
               absmax_code=None, absmax_offset=None):
    K = A.shape[-1]
    M = A.numel() // K
    N = shapeB[0]
    behaviour = tracer.behaviour
    if M > CUSTOM_MAX_ROWS or K % blocksize != 0:
        fused = False
    else:
        rule = _device_rule(behaviour.multiprocessors, behaviour.compute_major, behaviour.compute_minor)
        fused = rule(0, A.dtype, M, N, K)
    if fused:
        A = A.contiguous()
        out = _empty((*A.shape[:-1], N), A.dtype)
        if absmax_offset is not None:
            absmax_offset = absmax_offset.to(dtype=torch.float32)
        return out
    # _dequant_linear_fallback: the nested absmax rebuilt, the weight dequantized whole, then linear
    held = []  # alive until the kernel returns, as its locals are
    if absmax_8bit is not None:
        absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
        held += [absmax_dq, absmax_dq + absmax_offset]
        del absmax_dq
    B_dq = _empty(shapeB, A.dtype)
    out = torch.nn.functional.linear(A, B_dq, bias)
    del held, B_dq
    return out


def _int8_vectorwise_quant(tracer, A, threshold=0.0):
    if threshold != 0.0:
        # the held-back columns are found from A's values (lab_helpers.real.quantized)
        raise LabError("bitsandbytes' int8_vectorwise_quant with an outlier threshold depends on the values; "
                       "only threshold 0 is modelled")
    rows = A.numel() // A.shape[-1]
    row_stats = _empty((rows,), torch.float32)
    out_row = _empty(A.shape, torch.int8)
    return out_row, row_stats, None


def _int8_linear_matmul(tracer, A, B):
    out = _empty((*A.shape[:-1], B.shape[0]), torch.int32)
    if A.shape[-1] % 4 != 0:
        # cuBLASLt's int8 product needs an inner size divisible by 4: bitsandbytes computes in float32
        # and copies into the int32 output
        result = torch.matmul(A.float(), B.float().t()).to(torch.int32)
        out.copy_(result)
        del result
    return out


def _int8_mm_dequant(tracer, A, row_stats, col_stats, dtype=None, bias=None):
    # the kernel writes float16 only; a bias of another dtype is added after, then the cast
    out = torch.empty_like(A, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype or torch.float16)


def _int8_scaled_mm(tracer, A, B, row_stats, col_stats, bias=None, dtype=None):
    out_i32 = torch.ops.bitsandbytes.int8_linear_matmul.default(A, B)
    return torch.ops.bitsandbytes.int8_mm_dequant.default(out_i32, row_stats, col_stats,
                                                         dtype=dtype or torch.float16, bias=bias)


KERNELS = {
    "int8_vectorwise_quant.default": _int8_vectorwise_quant,
    "int8_linear_matmul.default": _int8_linear_matmul,
    "int8_mm_dequant.default": _int8_mm_dequant,
    "int8_scaled_mm.default": _int8_scaled_mm,
    "quantize_4bit.default": _quantize_4bit,
    "quantize_blockwise.default": _quantize_blockwise,
    "dequantize_blockwise.default": _dequantize_blockwise,
    "dequantize_4bit.default": _dequantize_4bit,
    "gemm_4bit.default": _gemm_4bit,
}


def run_kernel(tracer, func, args, kwargs):
    """The outputs of bitsandbytes operator `func`, its CUDA kernel's allocations made in `tracer`."""
    name = f"{func.__name__}"
    kernel = KERNELS.get(name)
    if kernel is None:
        raise LabError(f"bitsandbytes' {name} is not modelled: its CUDA kernel's allocations are unknown to the "
                       f"lab, so this run cannot be predicted")
    with tracer:
        return kernel(tracer, *args, **kwargs)
