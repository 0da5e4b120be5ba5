"""CUDA's bfloat16 autocast, reproduced for code traced on the meta device.

`torch.autocast("cuda")` acts at the dispatcher's AutocastCUDA key, which only CUDA tensors carry;
on meta it does nothing, and a tensor that claims the CUDA device cannot go through autograd in a
CPU build of torch. `MetaAutocast` applies the same casts one level up, as a function mode, so
autograd records them as it does on CUDA (the casts are ToCopyBackward nodes; the products save the
cast copies for backward). The policy is autocast_mode.h's lists for CUDA, by op name:

- lower precision (products, convolutions, attention): every floating argument that is not already
  bfloat16 is cast to bfloat16. A float32 leaf that requires grad (a trained weight) is cast once
  and the copy cached until the outermost autocast region exits (autocast_mode.cpp, cached_cast):
  the copies of every trained weight stay allocated until the end of the forward, or until backward
  has used them when a product saved them;
- float32 (pow, rsqrt, exp, log, norms, losses): lower-precision arguments are cast to float32;
- float32 with an optional dtype (softmax, log_softmax, sum, cumsum, prod): dtype=float32 is passed
  when the first argument is floating and the call gave none;
- promote (addcmul, addcdiv, dot, index_put, scatter_add...): every floating argument is cast to the
  widest one. cat and stack are in no list (measured on the H200: a float32 and a bfloat16 tensor
  concatenate to float32 with no cast).

Ops in no list run as they are, in their arguments' dtypes. A function mode sees the Python call,
not the ops a composite calls inside it: `cross_entropy`, which autocast reaches through its
log_softmax and nll_loss, is cast as a float32 op at the call. Regions: transformers'
`maybe_autocast(enabled=False)` (the rotary embedding's float32 products) and torch.utils.
checkpoint's recomputation, which restores the forward's autocast state in backward, are
honoured while the mode is installed.
"""
import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

LOWER_PRECISION = frozenset((
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"))
FLOAT32 = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "native_layer_norm", "rms_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "cross_entropy"))
FLOAT32_OPTIONAL_DTYPE = frozenset(("prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                                    "linalg_matrix_norm", "sum"))
PROMOTE = frozenset(("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                     "index_put", "tensordot", "scatter_add"))
POLICIES = {**{n: "lower" for n in LOWER_PRECISION}, **{n: "float32" for n in FLOAT32},
            **{n: "float32_dtype" for n in FLOAT32_OPTIONAL_DTYPE}, **{n: "promote" for n in PROMOTE}}


def policy_of(func) -> "str | None":
    """The autocast policy of a torch function, by its name (None: in no list)."""
    return POLICIES.get(getattr(func, "__name__", None))


def _eligible(t) -> bool:
    # autocast_mode.h is_eligible: a floating tensor of the autocast device, never float64
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


class MetaAutocast(TorchFunctionMode):
    """The CUDA autocast policy (lower precision: bfloat16) at the Python call, for meta tensors.
    `region(enabled)` is torch.autocast's __enter__/__exit__: nesting, and the cache of cast
    weights cleared when the outermost region exits."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.dtype = dtype
        self.enabled = False
        self.cache_enabled = True
        self.nesting = 0
        self.cache = {}  # id(weight) -> (weight, its cast copy)

    @contextlib.contextmanager
    def region(self, enabled=True, dtype=None, cache_enabled=None):
        # the outermost region pushes the mode: a region opened in backward (checkpointing's
        # recomputation) runs inside the autograd engine, which a mode on the stack when
        # loss.backward() was called would not reach (the mode's own handler ran that call)
        previous = (self.enabled, self.dtype, self.cache_enabled)
        self.enabled = bool(enabled)
        self.dtype = dtype if dtype is not None else self.dtype
        self.cache_enabled = self.cache_enabled if cache_enabled is None else bool(cache_enabled)
        self.nesting += 1
        push = self.nesting == 1
        if push:
            self.__enter__()
        try:
            yield
        finally:
            if push:
                self.__exit__(None, None, None)
            self.nesting -= 1
            if self.nesting == 0:
                self.cache.clear()
            self.enabled, self.dtype, self.cache_enabled = previous

    def _cast(self, value, to_type):
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, to_type) for v in value)
        if not _eligible(value) or value.dtype is to_type:
            return value
        cacheable = (to_type is self.dtype and value.dtype is torch.float32 and value.requires_grad
                     and value.is_leaf and not value._is_view() and self.cache_enabled)
        if not cacheable:
            return value.to(to_type)
        hit = self.cache.get(id(value))
        if hit is None:
            hit = self.cache[id(value)] = (value, value.to(to_type))
        return hit[1]

    def _promoted(self, args, kwargs):
        widest = self.dtype
        stack = [*args, *kwargs.values()]
        while stack:
            value = stack.pop()
            if isinstance(value, (list, tuple)):
                stack.extend(value)
            elif _eligible(value) and value.dtype is torch.float32:
                widest = torch.float32
        return widest

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        policy = policy_of(func) if self.enabled else None
        if policy == "float32_dtype":
            if args and _eligible(args[0]) and kwargs.get("dtype") is None and not any(
                    isinstance(a, torch.dtype) for a in args):
                kwargs["dtype"] = torch.float32
        elif policy is not None:
            to_type = {"lower": self.dtype, "float32": torch.float32}.get(policy) or self._promoted(args, kwargs)
            # last argument first: the wrapper casts its arguments in a C++ parameter-pack expansion,
            # which GCC evaluates right to left (measured: a linear casts its weight, then its input)
            kwargs = dict(reversed([(k, self._cast(v, to_type)) for k, v in reversed(kwargs.items())]))
            args = tuple(reversed([self._cast(a, to_type) for a in reversed(args)]))
        return func(*args, **kwargs)


@contextlib.contextmanager
def installed(mode: MetaAutocast):
    """The two regions CUDA code opens itself routed to `mode`: transformers' maybe_autocast (it
    returns a null context for the meta device) and torch.utils.checkpoint's recomputation (it saves
    and restores the autocast state of the forward's device type). `mode.region()` opens a region."""
    import torch.utils.checkpoint as checkpoint

    def maybe_autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type != "meta":
            return original_maybe(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        return mode.region(enabled, dtype, cache_enabled)

    def autocast_kwargs(device_type="cuda"):
        if device_type != "meta":
            return original_kwargs(device_type)
        _, cpu_kwargs = original_kwargs("cpu")  # torch has no autocast state for meta to read
        return {"enabled": mode.enabled, "dtype": mode.dtype, "cache_enabled": mode.cache_enabled}, cpu_kwargs

    def autocast(device_type, *args, **kwargs):
        if device_type == "meta":
            return mode.region(*args, **kwargs)
        return original_autocast(device_type, *args, **kwargs)

    def available(device_type):
        return device_type == "meta" or original_available(device_type)

    from transformers.utils import generic
    original_maybe = generic.maybe_autocast
    original_kwargs, original_autocast = checkpoint._get_autocast_kwargs, torch.amp.autocast
    original_available = torch.amp.is_autocast_available
    # the modeling modules imported the name; read their dicts (a lazy module's getattr would import)
    patched = [(module, "maybe_autocast", original_maybe) for module in list(sys.modules.values())
               if vars(module).get("maybe_autocast") is original_maybe]
    patched += [(checkpoint, "_get_autocast_kwargs", original_kwargs), (torch.amp, "autocast", original_autocast),
                (torch.amp, "is_autocast_available", original_available)]
    replacements = {"maybe_autocast": maybe_autocast, "_get_autocast_kwargs": autocast_kwargs,
                    "autocast": autocast, "is_autocast_available": available}
    for module, name, _ in patched:
        setattr(module, name, replacements[name])
    try:
        yield mode
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
