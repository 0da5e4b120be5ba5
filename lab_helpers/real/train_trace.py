"""The allocation tracer for a training step on meta: the backward thread's own math-library
workspaces, and the one data-dependent branch of transformers' forward.

The autograd engine runs a CUDA graph's backward on its own device thread; cuBLAS keeps a handle
per thread and a workspace per (handle, stream), cuBLASLt likewise (aten/src/ATen/cuda/
CublasHandlePool.cpp), so the first product and the first product with a bias epilogue run by the
backward thread (gradient checkpointing's recomputed forward included) each allocate that
thread's own workspace, as the first ones of the process did on the main thread.

When two gradients reach one input of a node, the engine adds them (torch/csrc/autograd/
input_buffer.cpp, `accumulate`): in place into the first one (`old_var.add_(var)`, no allocation)
when it holds the last reference to that tensor and to its storage and the tensor is dense,
otherwise out of place. Under a dispatch mode every tensor counts as a subclass there, so a traced
backward would always add out of place; the tracer makes the same choice as a CUDA run instead.
"""
import torch

from lab_helpers.core.errors import LabError
from lab_helpers.real.tracer import AllocationTracer


def is_non_overlapping_and_dense(t) -> bool:
    """TensorImpl's rule: some order of the dimensions makes the tensor contiguous."""
    expected = 1
    dimensions = [(size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1]
    for size, stride in sorted(dimensions, key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class TrainingTracer(AllocationTracer):
    """AllocationTracer that knows which thread a CUDA run would be on: set `backward` to True
    while the backward pass runs (thread_workspaces then starts from nothing, once)."""

    def __init__(self, allocator=None):
        super().__init__(allocator)
        self._ready = {False: (False, False), True: (False, False)}  # per thread: (cuBLAS, cuBLASLt)
        self._on_backward = False
        self._accumulating = False  # between a node's end and the next node's start: the engine's adds

    def watch_accumulation(self, loss) -> None:
        """Hook every node of `loss`'s graph: what the engine dispatches after a node's post hook
        and before the next node's pre hook is its accumulation of that node's outputs, and the
        buffers holding each gradient are counted (a gradient an add's backward sends to both of
        its inputs sits in two buffers: not the last reference, so added out of place)."""
        from torch.utils.weak import WeakIdKeyDictionary
        held = self._held = WeakIdKeyDictionary()

        def started(grad_outputs):
            self._accumulating = False
            for grad in grad_outputs:
                if grad is not None and grad in held:
                    held[grad] -= 1

        def ended(valid):
            # `valid` (which outputs have an edge), not the node: a hook that referred to its node
            # would keep it alive in a cycle, and with it what its context holds (a reentrant
            # checkpoint's ctx.run_function keeps the layer's keyword tensors: 4326400 bytes a step
            # of QLoRA with checkpointing, measured on the H200 against a run that freed them)
            def hook(grad_inputs, _):
                for grad, has_edge in zip(grad_inputs, valid):
                    if grad is not None and has_edge:
                        held[grad] = held.get(grad, 0) + 1
                self._accumulating = True
            return hook

        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(started)
            node.register_hook(ended(tuple(next_node is not None for next_node, _ in node.next_functions)))
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _accumulate(self, types, old, new):
        """The engine's `old_var + var` into one input's buffer, as input_buffer.cpp decides it."""
        held = self._held
        sole = (held.get(old, 0) == 1 and is_non_overlapping_and_dense(old)
                and torch._C._storage_Use_Count(old.untyped_storage()._cdata) == 2)  # + this Python storage
        held[new] = held.get(new, 0) - 1
        if sole:
            return super().__torch_dispatch__(torch.ops.aten.add_.Tensor, types, (old, new), {})
        held[old] -= 1
        result = super().__torch_dispatch__(torch.ops.aten.add.Tensor, types, (old, new), {})
        held[result] = 1
        return result

    @property
    def backward(self) -> bool:
        return self._on_backward

    @backward.setter
    def backward(self, value: bool) -> None:
        self._ready[self._on_backward] = (self.cublas_ready, self.cublaslt_ready)
        self._on_backward = bool(value)
        self._accumulating = False
        self.cublas_ready, self.cublaslt_ready = self._ready[self._on_backward]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args and args[0].device.type == "meta":
            # transformers' packed-sequence check, (packed[:, -1] == 0).all(), on position ids
            # 0..T-1 in every row: True on the GPU. No other branch of the step reads a value.
            if args[0].dtype is torch.bool:
                return True
            raise LabError(f"the traced training step read a {args[0].dtype} value of a tensor; the prediction "
                           "cannot know it on the meta device")
        if self._accumulating and func is torch.ops.aten.add.Tensor and not kwargs and len(args) == 2:
            return self._accumulate(types, *args)
        return super().__torch_dispatch__(func, types, args, kwargs)
