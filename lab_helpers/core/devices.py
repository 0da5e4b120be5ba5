"""Whether this machine can have a GPU at all, asked of the operating system before torch is imported.

Importing torch takes seconds on a small machine; a command that can only measure on a GPU answers a
machine without one at once. Only a certain absence is reported: where the device files exist, or on
a platform this module cannot read, torch decides (lab_helpers.real.protocol.check_cuda)."""
import glob
import os
import sys

# The CUDA driver's device nodes (one per GPU) and ROCm's compute node with its render nodes.
NVIDIA_DEVICE_PATTERN = "/dev/nvidia[0-9]*"
ROCM_COMPUTE_NODE = "/dev/kfd"
ROCM_RENDER_PATTERN = "/dev/dri/renderD*"
# Under WSL 2 the GPU is reached through the DirectX kernel interface, not /dev/nvidia*.
WSL_GPU_NODE = "/dev/dxg"
# CUDA_VISIBLE_DEVICES (and ROCm's HIP_VISIBLE_DEVICES) hide every GPU when empty or when their first
# entry is -1: the runtime stops at the first invalid index.
VISIBILITY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def hidden_by(environ) -> "str | None":
    """The variable of `environ` that hides every GPU from CUDA or ROCm, or None."""
    for name in VISIBILITY_VARIABLES:
        value = environ.get(name)
        if value is not None and (not value.strip() or value.split(",")[0].strip() == "-1"):
            return name
    return None


def no_gpu_reason(environ=None, platform: str = sys.platform, exists=glob.glob) -> "str | None":
    """Why no CUDA or ROCm device can be visible to this process, or None when one may be (torch then
    answers). `exists(pattern)` lists the paths matching a glob pattern."""
    environ = os.environ if environ is None else environ
    variable = hidden_by(environ)
    if variable is not None:
        return f"{variable}={environ[variable]!r} hides every GPU from this process"
    if platform == "darwin":
        return "macOS has no CUDA or ROCm device"
    if not platform.startswith("linux"):
        return None
    if (exists(NVIDIA_DEVICE_PATTERN) or exists(WSL_GPU_NODE)
            or (exists(ROCM_COMPUTE_NODE) and exists(ROCM_RENDER_PATTERN))):
        return None
    return "this machine has no CUDA or ROCm device (no /dev/nvidia* and no /dev/kfd)"
