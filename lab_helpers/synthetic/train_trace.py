"""The synthetic network's training run traced on PyTorch's meta device: every CUDA allocation and release it makes, replayed on the allocator model.

Meta tensors carry exact sizes and no memory. The tracer, a dispatch-level mode, sees every aten
op below autograd, the backward pass and the optimizer's foreach or fused kernels included: each
output whose storage is new is an allocation, and a storage whose last reference died (checked at
op boundaries) is a release. Releases found between two allocations can be applied in any order
without changing the allocator's state, so op-boundary detection is exact.

What a CUDA kernel allocates that its meta version does not is added here: the math library's
workspaces. cuBLAS keeps one workspace per (handle, stream) and a handle per thread
(aten/src/ATen/cuda/CublasHandlePool.cpp), and the autograd engine runs a CUDA graph's backward
on its own device thread, so the first product of the first backward allocates a second cuBLAS
workspace (no cuBLASLt one: backward's products are plain mm, without a bias epilogue).

Standard library at import: torch is imported inside the functions (the standalone file ships
this module).
"""


BACKWARD_WORKSPACE_NOTE = (
    "the backward pass runs on the autograd engine's device thread, whose own cuBLAS handle gets its "
    "own workspace (cuBLAS keys workspaces by handle and stream) at the first product of the first "
    "backward: the size of the first forward workspace block, without cuBLASLt's")


def training_tracer(allocator, forward_workspace_bytes: tuple, backward_workspace_bytes: tuple):
    """A dispatch mode feeding every CUDA-equivalent allocation and release of meta-device code to
    `allocator` (an AllocatorModel). Set its `backward` to True while the backward pass runs, so
    that the backward thread's workspace is allocated at its first product."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    aten = torch.ops.aten
    products = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                aten.linear.default, aten.matmul.default}

    class TrainingTracer(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.allocator = allocator
            self.live = {}  # storage key -> (weak reference, allocator block)
            self.backward = False
            self.workspace_ready = {False: False, True: False}  # per thread: forward, backward
            self.workspace_blocks = []

        def collect(self) -> None:
            """Release every traced storage that no tensor refers to any more."""
            for key, (ref, block) in list(self.live.items()):
                if ref.expired():
                    del self.live[key]
                    self.allocator.free(block)

        def block_of(self, tensor):
            """The allocator block of a traced tensor's storage (None when untraced: a CPU tensor)."""
            entry = self.live.get(tensor.untyped_storage()._cdata)
            return None if entry is None else entry[1]

        def track(self, result, inputs) -> None:
            held = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
            for t in tree_leaves(result):
                if not isinstance(t, torch.Tensor) or t.device.type != "meta":
                    continue  # the optimizer's step counters live on the host
                storage = t.untyped_storage()
                key = storage._cdata
                if key in held:
                    continue  # a view or an in-place result: no new memory
                self.collect()
                entry = self.live.get(key)
                if entry is not None:
                    if not entry[0].expired():
                        continue
                    del self.live[key]
                    self.allocator.free(entry[1])
                if storage.nbytes() == 0:
                    continue  # the caching allocator hands out no block for 0 bytes
                self.live[key] = (StorageWeakRef(storage), self.allocator.malloc(storage.nbytes()))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            self.track(result, tree_leaves((args, kwargs)))
            if func in products and not self.workspace_ready[self.backward]:
                # the first product on a thread: its output first, then that handle's workspace
                self.workspace_ready[self.backward] = True
                self.collect()
                sizes = backward_workspace_bytes if self.backward else forward_workspace_bytes
                self.workspace_blocks += [self.allocator.malloc(size) for size in sizes]
            return result

    return TrainingTracer()


def fused_on_meta():
    """A context in which torch.optim accepts fused=True for meta parameters, so that the traced
    step takes the fused kernel's path as it does on CUDA (torch checks the device type when the
    optimizer is built; the fused kernels have meta versions)."""
    import contextlib

    import torch.optim.optimizer as optimizer_module

    @contextlib.contextmanager
    def context():
        original = optimizer_module._get_fused_kernels_supported_devices
        optimizer_module._get_fused_kernels_supported_devices = lambda: [*original(), "meta"]
        try:
            yield
        finally:
            optimizer_module._get_fused_kernels_supported_devices = original

    return context()
