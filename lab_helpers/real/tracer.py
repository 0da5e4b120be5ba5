"""Trace the CUDA caching allocator's requests of PyTorch code run on the meta device.

Meta tensors carry exact sizes and no memory. `AllocationTracer`, a dispatch-level mode,
sees every aten op: each output whose storage is new is an allocation, and a storage
whose last reference died (checked at op boundaries) is a release. Releases found
between two allocations can be applied in any order without changing the allocator's
state, so op-boundary detection is exact. Each request goes straight into
lab_helpers.allocator.model.AllocatorModel, so the trace itself is never stored.

Where a CUDA kernel allocates differently from its meta version, the tracer replays the
CUDA behaviour measured with torch 2.11.0+cu130 on an NVIDIA H200 (see `CudaBehaviour`).
"""
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lab_helpers.allocator.addressed import AddressedAllocator
from lab_helpers.allocator.model import AllocatorModel
# the rules the tracer replays, kept where a trace's key and the replay read them without torch
from lab_helpers.real.behaviour import DEFAULT_BEHAVIOUR, CudaBehaviour, cudnn_decode_workspace_bytes

aten = torch.ops.aten
_storage_expired = torch.UntypedStorage._expired  # what StorageWeakRef.expired() ends in
# Collectives, as CUDA runs them under NCCL: c10d's in-place ones (all_reduce and the like)
# allocate nothing through the caching allocator (NCCL's own buffers live outside it); a
# functional all_gather allocates its output, which its meta kernel reproduces; wrapping
# that output for autograd (_wrap_tensor_autograd) makes no new storage on CUDA, while its
# meta kernel returns a fresh empty_like: it is replaced by the input itself.




def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def argmax_staging_bytes(outputs: int, inputs_per_output: int, element_bytes: int,
                         behaviour: CudaBehaviour, accumulator_bytes: int = 16) -> tuple:
    """(staging bytes, semaphore bytes) of argmax over the last, contiguous dimension:
    reduction_staging_bytes along the fastest dimension (512 threads at most, input vectorised
    by 4, each output split across blocks when a thread would still see >= 256 values).
    The accumulator of argmax is a (float, int64) pair: 16 bytes; a mean's is one float (4 bytes):
    a whole-tensor mean is one output over every input (measured on the H200: 448 bytes of staging
    and a 4-byte semaphore for the mean of 917504 float32 values, 128 bytes for 262144, none for
    65536)."""
    return reduction_staging_bytes((outputs, inputs_per_output), (inputs_per_output, 1), {1}, element_bytes,
                                   accumulator_bytes, behaviour)


# CUB's temporary storage for the scan of one row, by the output's element size: measured on the
# H200 (2026-12-02) at 128 and 3072 int64 values (transformers' packed-sequence check) and at 8 int32
# values (the MoE experts' offsets); other lengths are assumed to ask the same
CUB_SCAN_TEMPORARY_BYTES = {4: 1023, 8: 1279}


def reduction_staging_bytes(shape, strides, reduced, element_bytes: int, accumulator_bytes: int,
                            behaviour: CudaBehaviour, input_vector: int = 4) -> tuple:
    """(staging bytes, semaphore bytes) of a CUDA reduction (gpu_reduce_kernel) of a tensor of
    `shape` and `strides` (elements) over the dimensions `reduced`, or (0, 0) when each output
    is reduced within one thread block.

    TensorIterator's layout (aten/src/ATen/TensorIterator.cpp: the reduced dimensions first, then
    by stride; adjacent dimensions coalesced) and setReduceConfig (aten/src/ATen/native/cuda/
    Reduce.cuh): a reduction over the fastest dimension splits it across the lanes of a warp,
    one over slower dimensions vectorises 4 outputs a thread; where a thread would still see
    >= 256 values and the grid is small beside the device (132 multiprocessors x 2048 threads),
    each output is split across `ctas` blocks whose partial results are staged in device memory,
    with an int semaphore per block column. Measured on the H200 for the weight gradients of
    RMSNorm (bf16, float accumulator): 4096 outputs over 3072 rows: 100663296 bytes and 128;
    over 2048 rows: 67108864 and 128; 128 outputs over 65536 rows: 67108864 and 4, over 16384
    rows: 16777216 and 4."""
    dims = [(size, stride, index in reduced) for index, (size, stride) in enumerate(zip(shape, strides))]
    out_strides, running = {}, 1
    for index in reversed(range(len(dims))):  # the output: contiguous over the kept dimensions
        size, _, is_reduced = dims[index]
        out_strides[index] = 0 if is_reduced else running
        running *= 1 if is_reduced else size
    order = list(range(len(dims)))[::-1]

    def should_swap(a: int, b: int) -> int:
        oa, ob = out_strides[a], out_strides[b]
        if (oa == 0) != (ob == 0):
            return 1 if ob == 0 else -1
        for sa, sb in ((oa, ob), (dims[a][1], dims[b][1])):
            if sa == 0 or sb == 0:
                continue
            if sa != sb:
                return -1 if sa < sb else 1
            if dims[a][0] > dims[b][0]:
                return 1
        return 0

    for i in range(1, len(order)):  # TensorIterator's insertion sort
        moving = i
        for j in range(i - 1, -1, -1):
            comparison = should_swap(order[j], order[moving])
            if comparison > 0:
                order[j], order[moving] = order[moving], order[j]
                moving = j
            elif comparison < 0:
                break
    layout = [[dims[i][0], dims[i][1], out_strides[i], dims[i][2]] for i in order]
    merged = [layout[0]] if layout else []
    for size, stride, out_stride, is_reduced in layout[1:]:
        last = merged[-1]
        if last[0] == 1 or size == 1 or (last[0] * last[1] == stride and last[0] * last[2] == out_stride):
            if last[0] == 1:
                last[1], last[2], last[3] = stride, out_stride, is_reduced
            last[0] *= size
        else:
            merged.append([size, stride, out_stride, is_reduced])
    merged = [d for d in merged if d[0] != 1] or [[1, 1, 1, False]]
    outputs = 1
    for size, _, _, is_reduced in merged:
        outputs *= 1 if is_reduced else size
    total = 1
    for size, *_ in merged:
        total *= size
    if outputs == 0 or total == 0:
        return 0, 0
    per_output = total // outputs
    reduce_dims = sum(1 for d in merged if d[3])
    max_threads, warp = 512, 32
    fastest = reduce_dims == len(merged) or merged[0][1] < merged[reduce_dims][1]
    if fastest:
        dim0, dim1, moving_stride = per_output, outputs, merged[0][1]
    else:
        dim0, dim1, moving_stride = outputs, per_output, merged[reduce_dims][1]
    output_vector = 1
    if moving_stride == 1:
        if fastest and dim0 > 128 and reduce_dims == 1 and 4 >= input_vector:
            dim0 //= input_vector
        elif not fastest:
            output_vector = 4
            for n in [merged[reduce_dims][0]] + [d[1] for i, d in enumerate(merged) if i != reduce_dims]:
                while n % output_vector:
                    output_vector //= 2
            dim0 //= output_vector
    threads_cap = max_threads // output_vector
    dim0_pow2 = _last_pow2(dim0) if dim0 < threads_cap else threads_cap
    dim1_pow2 = _last_pow2(dim1) if dim1 < threads_cap else threads_cap
    width = min(dim0_pow2, warp)
    height = min(dim1_pow2, threads_cap // width)
    width = min(dim0_pow2, threads_cap // height)
    threads = width * height
    step_input, step_output, block_x_reduce = 1, 1, fastest
    if fastest:
        step_input *= width
    else:
        step_output *= width
    per_thread = -(-per_output // step_input)
    if not (per_thread >= height * 16 or per_thread >= 256):
        return 0, 0  # each warp takes its own outputs: no split across warps, nor across blocks
    step_input *= height
    per_thread = -(-per_output // step_input)
    grid_x = -(-(outputs // output_vector) // step_output)
    target_grid = behaviour.multiprocessors * (behaviour.threads_per_multiprocessor // threads)
    if per_thread < 256 or grid_x > target_grid:
        return 0, 0
    ctas = max(min(-(-target_grid // grid_x), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return 0, 0
    staging = accumulator_bytes * outputs * ctas
    if not block_x_reduce:
        staging *= width * output_vector
    return staging, 4 * grid_x


# The scaled_dot_product_attention backends, as aten/src/ATen/native/transformers/cuda/
# sdp_utils.cpp (select_sdp_backend) picks them for torch 2.11 on compute capability 9.0.
# check_prefer_cudnn_attention puts cuDNN first on sm90/sm100 with cuDNN > 9.15 (CUDA >= 13
# builds); measured on the H200 image (torch 2.11.0+cu130): torch._fused_sdp_choice was 3
# (cuDNN) for every call of the probed families.
CUDNN, OTHER = "cudnn", "other"


def cudnn_sdpa_supported(query, key, value, attn_mask, dropout_p: float, enable_gqa: bool,
                         behaviour: CudaBehaviour = None) -> bool:
    """Whether can_use_cudnn_attention (sdp_utils.cpp, torch 2.11) accepts the call on the H200.

    The filters, in its order: cuDNN SDP enabled (check_runtime_disabled_cudnn); no
    deterministic algorithms unless warn-only (check_cudnn_deterministic); q, k, v 4-D
    (check_tensor_shapes); q, k, v all fp16 or all bf16 (check_dtypes_low_precision, sm >= 80);
    the mask 2-D or 4-D, not requiring grad, each dim equal to the query's (B, H, L, S) or 1
    (check_attn_mask_shape, sdp_utils_cpp.h); the device sm80..sm121 (H200: sm90); dropout a
    multiple of 1/16 (check_cudnn_dropout); non-zero L and S (check_nonzero_sequence_lengths_
    dense); last-dim stride 1 of q, k, v (or head dim 1) and of the mask on the GPU
    (check_last_dim_stride_equals_1_dense<true>); same batch of q, k, v and, with enable_gqa,
    q's heads a multiple of k's and of v's, else equal heads (check_batch_size_and_num_heads_
    dense<gqa, not same kv heads, mqa>); B and H at most 65535, head dims at most 256 and
    multiples of 8, S not 1 (check_cudnn_tensor_shapes); with grad, head dims <= 128 or
    (192, 128) or (256, 256) (check_cudnn_d256_bprop_head_dim). Not modelled here, so left
    to the other path: dropout > 0 (cuDNN 9.11-9.13 refuse it, and the runtime's version is
    not known here; the lab measures without dropout)."""
    behaviour = behaviour or DEFAULT_BEHAVIOUR
    if not torch.backends.cuda.cudnn_sdp_enabled() or dropout_p != 0.0:
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or not (query.dtype == key.dtype == value.dtype):
        return False
    batch, heads, q_length, head_dim = query.shape
    kv_length, v_dim = key.shape[-2], value.shape[-1]
    if attn_mask is not None:
        if attn_mask.requires_grad or attn_mask.dim() not in (2, 4):
            return False
        wanted = (q_length, kv_length) if attn_mask.dim() == 2 else (batch, heads, q_length, kv_length)
        if any(n not in (w, 1) for n, w in zip(attn_mask.shape, wanted)):
            return False
        if attn_mask.stride(-1) != 1:
            return False
    if q_length == 0 or kv_length == 0:
        return False
    if head_dim != 1 and not (query.stride(-1) == key.stride(-1) == value.stride(-1) == 1):
        return False
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return False
    if enable_gqa:
        if heads % key.shape[1] or heads % value.shape[1]:
            return False
    elif not (heads == key.shape[1] == value.shape[1]):
        return False
    if batch > 65535 or heads > 65535:
        return False
    if max(head_dim, v_dim) > behaviour.cudnn_max_head_dim or head_dim % 8 or v_dim % 8:
        return False
    if kv_length == 1:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return (max(head_dim, v_dim) <= 128 or (head_dim, v_dim) in ((192, 128), (256, 256)))
    return True


def cudnn_output_like(query, v_dim: int):
    """cuDNN attention's output: (B, H, L, v_dim) laid out in q's dimension order.

    aten/src/ATen/native/cudnn/MHA.cpp, alloc_with_matching_layout: empty_like(q) when the
    shapes agree, else strides filled in the order of q's strides, smallest first (a stable
    sort; a zero stride last). Measured on the H200: a q of [B, L, H, D] in memory (Mistral,
    Gemma) or from GPT-2's fused qkv gave a dense [B, L, H, D] output; Phi-3's contiguous
    [B, H, L, D] q gave a contiguous [B, H, L, D] output, which transformers' transpose(1, 2)
    .contiguous() then copies."""
    shape = (*query.shape[:-1], v_dim)
    if tuple(query.shape) == shape:
        return torch.empty_like(query)
    order = sorted(range(query.dim()), key=lambda d: query.stride(d) or float("inf"))
    strides, running = [0] * query.dim(), 1
    for d in order:
        strides[d] = running
        running *= shape[d]
    return torch.empty_strided(shape, strides, dtype=query.dtype, device="meta")


def sdpa_backend(query, key, value, attn_mask=None, dropout_p: float = 0.0, enable_gqa: bool = False,
                 behaviour: CudaBehaviour = None) -> str:
    """CUDNN where CUDA on the H200 runs cuDNN attention; OTHER where it runs another backend
    (flash, memory-efficient or math), which the tracer models as it did before cuDNN was known
    to take masks (not measured: no probed call took one of them)."""
    return CUDNN if cudnn_sdpa_supported(query, key, value, attn_mask, dropout_p, enable_gqa, behaviour) else OTHER


def _layout_key(value):
    """A hashable key of an argument: tensors by layout, never by value."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type,
                value.storage_offset())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_layout_key(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _layout_key(v)) for k, v in value.items()))
    hash(value)
    return (type(value).__name__, value)


def _tensors(value, found=None) -> list:
    """The tensors in an op's arguments or results, in order (what pytree's tree_leaves keeps of
    them: an aten op's arguments hold tensors, scalars and lists of them; its results are a tensor
    or a tuple), at a fraction of tree_leaves' cost, which ran twice per traced op."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


def _plain_storage(t) -> bool:
    """True when `t` owns exactly the storage empty_strided would give it."""
    if t.device.type != "meta" or t.storage_offset() != 0:
        return False
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.untyped_storage().nbytes() == span * t.element_size()


# Python data made a tensor on the device (torch.tensor(3.5, device=...)) reaches no aten op a
# dispatch mode sees: the copy to the device happens inside the factory. On CUDA it is an
# allocation all the same (Gemma's embed_scale buffer, 512 bytes once rounded).
DATA_FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)

# In-place random fills, whose result on a meta tensor is that tensor: their meta kernel is a Python
# reference that draws into a new tensor and copies it back (0.2 ms a weight; a 70B model's weight
# initialisation makes 660 such calls per model built), below this mode, where the tracer sees nothing
DATA_ONLY_IN_PLACE = frozenset({aten.normal_.default})


# SDPA's math composite adds the mask in place on CUDA (attn.add_(mask)); under a dispatch mode
# every tensor counts as a subclass (areAnyTensorSubclassLike) and it adds out of place. While a
# tracer runs, torch.nn.functional.scaled_dot_product_attention is wrapped so that the tracer
# knows the call (a function mode would not: gradient checkpointing's recomputed forward runs
# in backward without it) and makes that one add in place again.
_SDPA = torch.nn.functional.scaled_dot_product_attention
_ACTIVE = []  # the tracers whose `with` block runs, innermost last


def _traced_attention(*args, **kwargs):
    tracer = _ACTIVE[-1] if _ACTIVE else None
    if tracer is None:
        return _SDPA(*args, **kwargs)
    previous, tracer._math_attention = tracer._math_attention, True
    try:
        return _SDPA(*args, **kwargs)
    finally:
        tracer._math_attention = previous


class _DataFactories(TorchFunctionMode):
    """Hands the meta tensors that DATA_FACTORIES make to the tracer as new storages."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in DATA_FACTORIES and isinstance(result, torch.Tensor) and result.device.type == "meta":
            self.tracer._track(result, ())
        return result


class AllocationTracer(TorchDispatchMode):
    """Feeds every CUDA-equivalent allocation and release of meta-device code to an AllocatorModel."""

    def __init__(self, allocator: AllocatorModel = None, behaviour: CudaBehaviour = DEFAULT_BEHAVIOUR,
                 layouts: "dict | None" = None):
        super().__init__()
        self.allocator = allocator if allocator is not None else AddressedAllocator()
        self.behaviour = behaviour
        self.live = {}  # storage key -> (weak reference, allocator block, nbytes)
        # storages known to outlive the next phase (the weights): checked at phase
        # boundaries only, so that each allocation scans just the young storages
        self.settled = {}
        self.cublas_ready = False
        self.cublaslt_ready = False
        self.persistent = []  # the blocks cuBLAS/cuBLASLt hold for the process's life
        self.requests = 0
        # (op, input layouts) -> output layouts, see _run: a meta kernel's output layouts depend on its
        # inputs' layouts alone, so tracers of the same model may share one (`layouts`)
        self.layouts = {} if layouts is None else layouts
        self._math_attention = False  # inside scaled_dot_product_attention: its mask's add is in place

    def __enter__(self):
        factories = _DataFactories(self)
        factories.__enter__()
        self.factory_modes = getattr(self, "factory_modes", []) + [factories]
        if not _ACTIVE:
            torch.nn.functional.scaled_dot_product_attention = _traced_attention
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            _ACTIVE.pop()
            if not _ACTIVE:
                torch.nn.functional.scaled_dot_product_attention = _SDPA
            self.factory_modes.pop().__exit__(*exc_info)

    # ------------------------------------------------------------ bookkeeping
    def collect(self, settled: bool = False) -> None:
        """Release every traced storage that no tensor refers to any more."""
        for table in (self.live, self.settled) if settled else (self.live,):
            # StorageWeakRef.expired() without its Python wrapper: this scan runs before every
            # allocation, over every young storage (a long trace's hottest loop)
            dead = [key for key, entry in table.items() if _storage_expired(entry[0].cdata)]
            for key in dead:
                self.allocator.free(table.pop(key)[1])

    def settle(self) -> None:
        """Mark every storage alive now as long-lived (checked at phase boundaries only)."""
        self.collect(settled=True)
        self.settled.update(self.live)
        self.live.clear()

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every storage no tensor holds is released, then every wholly
        free segment goes back to the device (its address range with it)."""
        self.collect(settled=True)
        for block in self.allocator.release_free_segments():
            self.allocator.give_back(block)

    @property
    def workspace_bytes(self) -> int:
        return sum(block.size for block in self.persistent)

    def live_bytes(self) -> int:
        return sum(n for table in (self.live, self.settled) for _, _, n in table.values())

    def _track(self, result, inputs) -> None:
        held = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
        for t in _tensors(result):
            if t.device.type != "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in held or key in self.settled:
                continue  # a view or an in-place result: no new memory
            # releases since the last allocation, in any order: the allocator's state is the same
            self.collect()
            entry = self.live.get(key)
            if entry is not None:
                if not entry[0].expired():
                    continue
                del self.live[key]
                self.allocator.free(entry[1])
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue  # the caching allocator hands out no block for 0 bytes
            self.requests += 1
            self.live[key] = (StorageWeakRef(storage), self.allocator.malloc(nbytes), nbytes)

    def _scratch(self, nbytes: int) -> None:
        """A kernel-internal buffer: allocated, then freed before the op returns."""
        if nbytes > 0:
            self.collect()
            self.allocator.free(self.allocator.malloc(nbytes))

    def _persistent(self, nbytes: int) -> None:
        if nbytes > 0:
            self.collect()
            self.persistent.append(self.allocator.malloc(nbytes))  # held for the process's life

    # --------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.scaled_dot_product_attention.default:
            return self._attention(*args, **kwargs)
        if func.namespace == "_c10d_functional" and func.__name__.startswith("_wrap_tensor_autograd"):
            return args[0]
        if self._math_attention and func is aten.add.Tensor and not kwargs:
            func = aten.add_.Tensor
        if func.namespace == "bitsandbytes":
            from lab_helpers.real.bnb_kernels import run_kernel
            return run_kernel(self, func, args, kwargs)
        result = self._run(func, args, kwargs)
        self._track(result, _tensors((args, kwargs)))
        self._after_kernel(func, args, kwargs)
        return result

    def _run(self, func, args, kwargs):
        """Run a meta kernel, or rebuild its outputs from a cache of output layouts.

        Many meta kernels are Python reference implementations, slow next to the empty
        tensors they produce; a decoder repeats the same ops on the same shapes in every
        layer, so an op that creates fresh outputs (no aliasing, no mutation) is run once
        per distinct input layout."""
        if func in DATA_ONLY_IN_PLACE and args[0].device.type == "meta":
            return args[0]
        schema = func._schema
        if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            return func(*args, **kwargs)
        try:
            key = (func, _layout_key(args), _layout_key(kwargs))
            layouts = self.layouts.get(key)
        except TypeError:  # an argument that cannot be a key
            return func(*args, **kwargs)
        if layouts is not None:
            outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in layouts]
            return outs[0] if len(outs) == 1 and not isinstance(layouts, tuple) else tuple(outs)
        result = func(*args, **kwargs)
        outs = [result] if isinstance(result, torch.Tensor) else list(result) if isinstance(result, tuple) else None
        # an op that returned an input as it is (dropout in eval) makes no storage: not cached,
        # or its next call would get a fresh one (Phi-3's second dropout of each layer did)
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        if outs and all(isinstance(t, torch.Tensor) and _plain_storage(t) and t.untyped_storage()._cdata not in inputs
                        for t in outs):
            found = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in outs]
            self.layouts[key] = found if isinstance(result, torch.Tensor) else tuple(found)
        return result

    def _after_kernel(self, func, args, kwargs) -> None:
        if func in (aten.linear.default, aten.addmm.default):
            has_bias = func is aten.addmm.default or (len(args) > 2 and args[2] is not None)
            self._blas(lt=has_bias)
        elif func in (aten.mm.default, aten.bmm.default, aten.matmul.default, aten.baddbmm.default):
            self._blas(lt=False)
        elif func is aten.argmax.default:
            self._argmax_staging(*args)
        elif func is aten.mean.default:
            self._mean_staging(*args)
        elif func is aten.layer_norm.default:
            self._layer_norm_statistics(*args)
        elif func is aten.sum.dim_IntList:
            self._sum_staging(*args)
        elif func is aten._safe_softmax.default:
            self._safe_softmax_temporaries(*args)
        elif func is aten.cumsum.default:
            self._cumsum_temporaries(*args, **kwargs)
        elif func is aten._softmax_backward_data.default:
            # softmax_backward_cuda_out computes grad * output into a temporary of grad's size
            # after its own output, freed as it returns (measured on the H200 at 128 and 3072 keys)
            grad, output = args[0], args[1]
            self._scratch(grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize)
        elif func is aten.pow.Scalar:
            # CUDA wraps the scalar base in a one-element double tensor on the device
            self._scratch(8)

    def _blas(self, lt: bool) -> None:
        if not self.cublas_ready:
            self.cublas_ready = True
            self._persistent(self.behaviour.cublas_workspace_bytes)
        if lt and not self.cublaslt_ready:
            self.cublaslt_ready = True
            self._persistent(self.behaviour.cublaslt_workspace_bytes)

    def _layer_norm_statistics(self, values, normalized_shape, *rest) -> None:
        """layer_norm reaches the tracer whole (inference mode); on CUDA it runs native_layer_norm,
        which allocates the output, then the mean and the reciprocal deviation (one float32 per
        normalised row, float64 for float64 input), freed as layer_norm returns (measured on the
        H200 for GPT-2: output, 8192, 8192, both freed, at (4, 512))."""
        rows = values.numel()
        for n in normalized_shape:
            rows //= max(1, n)
        nbytes = rows * (8 if values.dtype is torch.float64 else 4)
        if nbytes:
            self.collect()
            mean, rstd = self.allocator.malloc(nbytes), self.allocator.malloc(nbytes)
            self.allocator.free(mean)
            self.allocator.free(rstd)

    def _argmax_staging(self, values, dim=None, keepdim=False) -> None:
        """argmax along a contiguous last dimension: CUDA's reduction may split each row
        across thread blocks, staging partial results and semaphores in device memory."""
        if dim is None or values.dim() == 0 or dim % values.dim() != values.dim() - 1 or not values.is_contiguous():
            return
        self._staged(*argmax_staging_bytes(values.numel() // values.shape[-1], values.shape[-1],
                                           values.element_size(), self.behaviour))

    def _mean_staging(self, values, *rest) -> None:
        """The mean of a whole contiguous tensor (bitsandbytes' absmax offset): one output, split
        across thread blocks as argmax's rows are, with a float accumulator."""
        if values.dim() == 0 or not values.is_contiguous():
            return
        self._staged(*argmax_staging_bytes(1, values.numel(), values.element_size(), self.behaviour, 4))

    def _sum_staging(self, values, dims=None, keepdim=False, *rest) -> None:
        """A sum over some dimensions (the weight and bias gradients of training): CUDA may split
        each output across thread blocks (reduction_staging_bytes)."""
        if values.dim() == 0 or values.numel() == 0 or values.dtype not in (torch.float16, torch.bfloat16,
                                                                               torch.float32):
            return
        reduced = set(range(values.dim())) if not dims else {d % values.dim() for d in dims}
        self._staged(*reduction_staging_bytes(tuple(values.shape), tuple(values.stride()), reduced,
                                              values.element_size(), 4, self.behaviour))

    def _cumsum_temporaries(self, values, dim, dtype=None) -> None:
        """cumsum on CUDA casts an input of another dtype (transformers' packed-sequence check
        sums a boolean into int64) into a buffer of the output's dtype, and a scan of a single row
        runs through CUB, whose temporary storage is CUB_SCAN_TEMPORARY_BYTES; both freed as it
        returns."""
        out_dtype = dtype or (torch.int64 if not values.dtype.is_floating_point and not values.dtype.is_complex
                              else values.dtype)
        sizes = []
        if out_dtype != values.dtype:
            sizes.append(values.numel() * out_dtype.itemsize)
        if values.dim() and values.numel() == values.shape[dim] > 1:
            sizes.append(CUB_SCAN_TEMPORARY_BYTES[min(8, max(4, out_dtype.itemsize))])
        if sizes:
            self.collect()
            blocks = [self.allocator.malloc(n) for n in sizes]
            for block in blocks:
                self.allocator.free(block)

    def _safe_softmax_temporaries(self, values, dim, *rest) -> None:
        """_safe_softmax on CUDA (math attention's softmax): after its output, a boolean of the
        input's shape (input == -inf), its rows all-masked (keepdim), and a 4-byte scalar, freed
        as the op returns (measured on the H200: 524288, 4096 and 4 bytes for 32 x 128 x 128
        scores)."""
        self.collect()
        rows = values.numel() // max(1, values.shape[dim])
        blocks = [self.allocator.malloc(n) for n in (values.numel(), rows, 4) if n > 0]
        for block in blocks:
            self.allocator.free(block)

    def _staged(self, staging: int, semaphores: int) -> None:
        """A split reduction's partial results and semaphores, freed before the kernel returns."""
        if staging:
            self.collect()
            buffer = self.allocator.malloc(staging)
            flags = self.allocator.malloc(semaphores)
            self.allocator.free(buffer)
            self.allocator.free(flags)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        """scaled_dot_product_attention as CUDA runs it: the backend decides what is allocated."""
        batch, heads, q_length, _ = query.shape
        kv_length, v_dim = key.shape[-2], value.shape[-1]
        if sdpa_backend(query, key, value, attn_mask, dropout_p, enable_gqa, self.behaviour) == CUDNN:
            return self._cudnn_attention(query, attn_mask, batch, heads, q_length, kv_length, v_dim, key.shape[1])
        fused = attn_mask is None and dropout_p == 0.0 and query.shape[-1] <= 128
        if fused and query.dtype in (torch.float16, torch.bfloat16):
            # not cuDNN's filters (e.g. a head dim not a multiple of 8): flash attention on
            # CUDA, whose padded copies are not measured; modelled as cuDNN's sequence
            return self._cudnn_attention(query, None, batch, heads, q_length, kv_length, v_dim, None)
        if fused and not enable_gqa:
            # memory-efficient attention: the output only (no logsumexp in inference)
            with self:
                return torch.empty((batch, q_length, heads, v_dim), dtype=query.dtype,
                                   device="meta").transpose(1, 2)
        # the math fallback: its composite runs op by op, as on CUDA (its mask's add: see _traced_attention)
        with self:
            return aten._scaled_dot_product_attention_math.default.decompose(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
                enable_gqa=enable_gqa)[0]

    def _cudnn_attention(self, query, attn_mask, batch, heads, q_length, kv_length, v_dim, key_heads):
        """cuDNN attention's allocations, in the order measured on the H200 (torch 2.11.0+cu130).

        A boolean mask first becomes an additive bias in q's dtype (attention.cpp,
        convert_boolean_attn_mask_cudnn: a where() over two scalar tensors made on the device):
        the two scalars, then the bias at the mask's own shape with broadcast dims of size 1
        kept and expanded (stride 0) dims made whole ((2, 1, 1, 4096) with batch stride 0:
        16384 bytes in bf16), then the scalars freed. Then the philox seed and offset, the
        output in q's layout (cudnn_output_like), the workspace, freed before the call
        returns; the bias is freed last. An additive (non-boolean) mask is passed through.
        `key_heads` None: a call cuDNN would not take, given cuDNN's prefill sequence and no
        decode workspace (cudnn_decode_workspace_bytes models cuDNN's split of the keys only)."""
        bias = None
        with self:
            if attn_mask is not None and attn_mask.dtype is torch.bool:
                scalars = [torch.empty((), dtype=query.dtype, device="meta") for _ in range(2)]
                bias = torch.empty(tuple(attn_mask.shape), dtype=query.dtype, device="meta")
                scalars.clear()
            seed = torch.empty((), dtype=torch.int64, device="meta")
            offset = torch.empty((), dtype=torch.int64, device="meta")
            out = cudnn_output_like(query, v_dim)
        if q_length > 1:
            self._scratch(self.behaviour.cudnn_prefill_workspace_bytes)
        elif key_heads is not None:
            self._scratch(cudnn_decode_workspace_bytes(batch, heads, key_heads, kv_length, v_dim))
        del seed, offset, bias
        return out
