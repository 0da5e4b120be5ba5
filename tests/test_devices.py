"""The operating system's answer to 'can this process see a GPU at all', asked before torch is imported."""
import pytest

from lab_helpers.core.devices import no_gpu_reason


def files(*present):
    return lambda pattern: [pattern] if pattern in present else []


@pytest.mark.parametrize("environ, platform, present, expected", [
    ({}, "linux", ("/dev/nvidia[0-9]*",), None),
    ({}, "linux", ("/dev/dxg",), None),
    ({}, "linux", ("/dev/kfd", "/dev/dri/renderD*"), None),
    ({}, "linux", ("/dev/kfd",), "this machine has no CUDA or ROCm device (no /dev/nvidia* and no /dev/kfd)"),
    ({}, "linux", (), "this machine has no CUDA or ROCm device (no /dev/nvidia* and no /dev/kfd)"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "linux", ("/dev/nvidia[0-9]*",),
     "CUDA_VISIBLE_DEVICES='' hides every GPU from this process"),
    ({"CUDA_VISIBLE_DEVICES": "-1,0"}, "linux", ("/dev/nvidia[0-9]*",),
     "CUDA_VISIBLE_DEVICES='-1,0' hides every GPU from this process"),
    ({"HIP_VISIBLE_DEVICES": " "}, "linux", ("/dev/kfd", "/dev/dri/renderD*"),
     "HIP_VISIBLE_DEVICES=' ' hides every GPU from this process"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "linux", ("/dev/nvidia[0-9]*",), None),
    ({"CUDA_VISIBLE_DEVICES": "GPU-5d3f"}, "linux", ("/dev/nvidia[0-9]*",), None),
    ({}, "darwin", (), "macOS has no CUDA or ROCm device"),
    ({}, "win32", (), None),  # no device files to read there: torch answers
])
def test_only_a_certain_absence_is_reported(environ, platform, present, expected):
    assert no_gpu_reason(environ, platform, files(*present)) == expected


def test_this_machine_is_read_by_default(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert no_gpu_reason() == "CUDA_VISIBLE_DEVICES='-1' hides every GPU from this process"
