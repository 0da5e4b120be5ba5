"""The allocation tracer for a training step on meta: the backward thread's own math-library
workspaces, and the one data-dependent branch of transformers' forward.

The autograd engine runs a CUDA graph's backward on its own device thread; cuBLAS keeps a handle
per thread and a workspace per (handle, stream), cuBLASLt likewise (aten/src/ATen/cuda/
CublasHandlePool.cpp), so the first product and the first product with a bias epilogue run by the
backward thread (gradient checkpointing's recomputed forward included) each allocate that
thread's own workspace, as the first ones of the process did on the main thread.
"""
import torch

from lab_helpers.core.errors import LabError
from lab_helpers.real.tracer import AllocationTracer


class TrainingTracer(AllocationTracer):
    """AllocationTracer that knows which thread a CUDA run would be on: set `backward` to True
    while the backward pass runs (thread_workspaces then starts from nothing, once)."""

    def __init__(self, allocator=None):
        super().__init__(allocator)
        self._ready = {False: (False, False), True: (False, False)}  # per thread: (cuBLAS, cuBLASLt)
        self._on_backward = False

    @property
    def backward(self) -> bool:
        return self._on_backward

    @backward.setter
    def backward(self, value: bool) -> None:
        self._ready[self._on_backward] = (self.cublas_ready, self.cublaslt_ready)
        self._on_backward = bool(value)
        self.cublas_ready, self.cublaslt_ready = self._ready[self._on_backward]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args and args[0].device.type == "meta":
            # transformers' packed-sequence check, (packed[:, -1] == 0).all(), on position ids
            # 0..T-1 in every row: True on the GPU. No other branch of the step reads a value.
            if args[0].dtype is torch.bool:
                return True
            raise LabError(f"the traced training step read a {args[0].dtype} value of a tensor; the prediction "
                           "cannot know it on the meta device")
        return super().__torch_dispatch__(func, types, args, kwargs)
