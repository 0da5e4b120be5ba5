"""A CUDA context that cannot be created (other processes hold the device's memory, a device in a bad
state) ends each one-GPU measuring command in one line, exit 3, nothing written: CUDA faked on the CPU,
the failure raised where torch raises it (set_device, which creates the context). Tensor-parallel
ranks open their device through the same open_device."""
import json

import pytest

from conftest import command_module, run_main_in_process
from lab_helpers.real import commands as real_commands
from lab_helpers.real import early_commands

torch = pytest.importorskip("torch")

CONTEXT_ERRORS = {
    "out_of_memory": torch.AcceleratorError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'"),
    "cuda_error": torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered"),
}

# (name, the program's main, argv before --output)
COMMANDS = [
    ("mesure_memoire standalone", lambda: command_module("standalone", "mesure_memoire").main,
     ["measure", "--batch", "1", "--context", "8", "--width", "16", "--hidden", "32"]),
    ("mesure_memoire package", lambda: command_module("package", "mesure_memoire").main,
     ["measure", "--batch", "1", "--context", "8", "--width", "16", "--hidden", "32"]),
    ("mesure_memoire train", lambda: command_module("package", "mesure_memoire").main,
     ["measure", "--task", "train", "--batch", "1", "--context", "8", "--width", "16", "--hidden", "32"]),
    ("real_model", lambda: real_commands.main,
     ["measure", "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "8", "--new-tokens", "1"]),
    ("real_model train", lambda: real_commands.main,
     ["measure", "--task", "train", "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "8"]),
]


@pytest.fixture
def context_fails(monkeypatch):
    """CUDA visible, one device, and creating its context raising `error` (set per test)."""
    calls = []

    def failing(error):
        def set_device(device):
            calls.append(("set_device", str(device)))
            raise error
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "init", lambda: calls.append(("init",)))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: calls.append(("bf16",)) or True)
        monkeypatch.setattr(early_commands, "no_gpu_reason", lambda: None)  # the device files, as on a GPU machine
        return calls
    return failing


@pytest.mark.parametrize("reason", sorted(CONTEXT_ERRORS))
@pytest.mark.parametrize("name, main, argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_context_that_cannot_be_created_is_one_line_exit_3_and_no_file(tmp_path, context_fails, name, main, argv,
                                                                         reason):
    calls = context_fails(CONTEXT_ERRORS[reason])
    proc = run_main_in_process(main(), [*argv, "--output", "m.json"], tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    first_line = str(CONTEXT_ERRORS[reason]).splitlines()[0]
    assert f"phase cuda_context failed: AcceleratorError: {first_line}; no file written" in proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []
    # the context is the first thing asked of the device: nothing queried it before
    assert calls == [("set_device", "cuda:0" if "real_model" not in name else "0")]


@pytest.mark.parametrize("reason", sorted(CONTEXT_ERRORS))
def test_the_failure_report_names_the_context_and_its_reason(tmp_path, context_fails, reason):
    context_fails(CONTEXT_ERRORS[reason])
    main = command_module("standalone", "mesure_memoire").main
    proc = run_main_in_process(main, [*COMMANDS[0][2], "--output", "m.json", "--failure-report", "f.json",
                                      "--timeline", "t.json"], tmp_path)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
    report = json.loads((tmp_path / "f.json").read_text())
    # cuda_error even for CUDA's out of memory: the run's size is not the cause, and a sweep reading
    # out_of_memory would take the size for one that does not fit
    assert report == {"kind": "iteragpu-lab measure failure", "phase": "cuda_context", "reason": "cuda_error",
                      "message": "AcceleratorError: " + str(CONTEXT_ERRORS[reason]).splitlines()[0]}
    # no snapshot named: the allocator never started, and the failure is not an out-of-memory one
    assert proc.stderr.endswith("; no file written; failure report: f.json\n"), proc.stderr
