"""Calls run under bfloat16 autocast: on CUDA by torch.autocast, on meta by
lab_helpers.real.autocast.MetaAutocast. Each case builds its tensors on `device` and returns
its outputs; `aten_calls` lists the aten ops a case dispatches below autocast (the casts among
them), which both sides must agree on, op for op, with the same output dtypes."""
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

f32, bf16 = torch.float32, torch.bfloat16


def _t(device, *shape, dtype=f32, grad=False):
    return torch.ones(*shape, device=device, dtype=dtype, requires_grad=grad)


def _weight(device, *shape):
    return torch.nn.Parameter(torch.ones(*shape, device=device))


CASES = {
    # name: (inputs on a device, the call). Products: float32 activations and trained weights cast
    # to bfloat16 (trained weights once: cached while the region lasts)
    "linear": (lambda d: (_t(d, 4, 8), _weight(d, 16, 8), _weight(d, 16)), lambda x, w, b: F.linear(x, w, b)),
    "linear weight used twice": (lambda d: (_t(d, 4, 8), _weight(d, 16, 8)),
                                 lambda x, w: (F.linear(x, w), F.linear(x, w))),
    "linear frozen weight": (lambda d: (_t(d, 4, 8), _t(d, 16, 8)), lambda x, w: F.linear(x, w)),
    "linear bfloat16 input": (lambda d: (_t(d, 4, 8, dtype=bf16), _weight(d, 16, 8)), lambda x, w: F.linear(x, w)),
    "matmul": (lambda d: (_t(d, 2, 4, 8), _t(d, 8, 3)), torch.matmul),
    "@": (lambda d: (_t(d, 4, 8), _t(d, 8, 3)), lambda a, b: a @ b),
    "bmm": (lambda d: (_t(d, 2, 4, 8), _t(d, 2, 8, 3)), torch.bmm),
    "addmm": (lambda d: (_weight(d, 3), _t(d, 4, 8), _weight(d, 8, 3)), torch.addmm),
    "baddbmm": (lambda d: (_t(d, 2, 4, 3), _t(d, 2, 4, 8), _t(d, 2, 8, 3)), torch.baddbmm),
    "einsum": (lambda d: (_t(d, 4, 8), _t(d, 8, 3)), lambda a, b: torch.einsum("ij,jk->ik", a, b)),
    "sdpa math": (lambda d: (_t(d, 1, 2, 8, 16), _t(d, 1, 2, 8, 16), _t(d, 1, 2, 8, 16, dtype=bf16)),
                  lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    # float32 ops: bfloat16 inputs cast up
    "pow": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: x.pow(2)),
    "**": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: x ** 2),
    "rsqrt": (lambda d: (_t(d, 4, 8, dtype=bf16),), torch.rsqrt),
    "exp": (lambda d: (_t(d, 4, 8, dtype=bf16),), torch.exp),
    "layer_norm": (lambda d: (_t(d, 4, 8, dtype=bf16), _weight(d, 8), _weight(d, 8)),
                   lambda x, w, b: F.layer_norm(x, (8,), w, b)),
    "cross_entropy": (lambda d: (_t(d, 4, 8), torch.zeros(4, device=d, dtype=torch.long)), F.cross_entropy),
    # float32 with an optional dtype: float32 outputs from bfloat16 inputs
    "softmax": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: F.softmax(x, dim=-1)),
    "log_softmax": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: torch.log_softmax(x, -1)),
    "sum": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: x.sum(-1)),
    "cumsum": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: torch.cumsum(x, 0)),
    "softmax given dtype": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: F.softmax(x, dim=-1, dtype=bf16)),
    # promote: the widest floating input wins
    "cat mixed": (lambda d: (_t(d, 4, 8), _t(d, 4, 8, dtype=bf16)), lambda a, b: torch.cat([a, b], dim=-1)),
    "cat bfloat16": (lambda d: (_t(d, 4, 8, dtype=bf16), _t(d, 4, 8, dtype=bf16)),
                     lambda a, b: torch.cat([a, b], dim=-1)),
    "stack mixed": (lambda d: (_t(d, 4, 8, dtype=bf16), _t(d, 4, 8)), lambda a, b: torch.stack([a, b])),
    # in no list: run in their inputs' dtypes
    "mul mixed": (lambda d: (_t(d, 4, 8, dtype=bf16), _t(d, 4, 8)), lambda a, b: a * b),
    "silu": (lambda d: (_t(d, 4, 8, dtype=bf16),), F.silu),
    "mean": (lambda d: (_t(d, 4, 8, dtype=bf16),), lambda x: x.mean(-1)),
    "embedding": (lambda d: (torch.zeros(4, device=d, dtype=torch.long), _weight(d, 10, 8)), F.embedding),
}


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append(f"{func.overloadpacket.__name__} -> {_dtypes(out)}")
        return out


def _dtypes(out) -> str:
    return ",".join(str(t.dtype).replace("torch.", "") for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor))


def aten_calls(case: str, device: str, autocast) -> list:
    """The aten ops `case`'s call dispatches on `device` inside `autocast` (a context manager), with
    their output dtypes, then the call's own output dtypes (its inputs are built before)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    build, call = CASES[case]
    inputs = build(device)
    with sdpa_kernel([SDPBackend.MATH]), autocast, _Calls() as mode:
        out = call(*inputs)
    return [*mode.calls, f"result -> {_dtypes(out)}"]
