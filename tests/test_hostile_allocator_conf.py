"""Allocator settings the lab does not model, given with --allocator-conf, in PYTORCH_CUDA_ALLOC_CONF or
PYTORCH_ALLOC_CONF, or recorded in a measurement file: every command that replays or measures the
allocator ends in exit 2 and one line naming the setting, with no traceback, nothing on stdout and
nothing created. Most rows run in-process; one in 24 also as a fresh `python -m`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_main_in_process
from test_hostile_real import TINY, measurement

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_EVERY = 24
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

BAD = {
    "max-split": ("max_split_size_mb:128", "'max_split_size_mb' is an allocator setting the lab does not model"),
    "gc-threshold": ("garbage_collection_threshold:0.6", "'garbage_collection_threshold' is an allocator setting"),
    "roundup": ("roundup_power2_divisions:4", "'roundup_power2_divisions' is an allocator setting"),
    "roundup-list": ("roundup_power2_divisions:[256:1,>:4]", "not a key:value pair"),
    "backend": ("backend:cudaMallocAsync", "'backend' is an allocator setting the lab does not model"),
    "release-lock": ("release_lock_on_cudamalloc:True", "does not model"),
    "mixed": ("expandable_segments:True,max_split_size_mb:64", "'max_split_size_mb' is an allocator setting"),
    "lowercase": ("expandable_segments:true", "expandable_segments must be True or False"),
    "number": ("expandable_segments:1", "expandable_segments must be True or False"),
    "no-value": ("expandable_segments", "not a key:value pair"),
    "empty-value": ("expandable_segments:", "not a key:value pair"),
    "two-colons": ("expandable_segments:True:False", "not a key:value pair"),
    "no-key": (":True", "not a key:value pair"),
    "twice": ("expandable_segments:True,expandable_segments:False", "expandable_segments is given twice"),
    "trailing-comma": ("expandable_segments:True,", "not a key:value pair"),
    "comma": (",", "not a key:value pair"),
    "long": ("expandable_segments:True" + " " * 300, "has 324 characters; at most 200 are accepted"),
    "huge": ("x" * 100000, "has 100000 characters; at most 200 are accepted"),
    "non-ascii": ("expandable_segments:Tru\u00e9", "not printable ASCII"),
    "newline": ("expandable_segments:True\nmax_split_size_mb:64", "not printable ASCII"),
    "escape": ("\x1b[31mexpandable_segments:True", "not printable ASCII"),
    "tab": ("expandable_segments:\tTrue", "not printable ASCII"),
}

COMMANDS = {
    "mm-predict": ("mesure_memoire", ["predict"]),
    "mm-measure": ("mesure_memoire", ["measure", "--output", "m.json"]),
    "rm-predict": ("real_model", ["predict", "--config", "CONFIG", "--batch", "1", "--context", "8", "--new-tokens", "2"]),
    "rm-measure": ("real_model", ["measure", "--config", "CONFIG", "--batch", "1", "--context", "8", "--new-tokens",
                                  "2", "--output", "m.json"]),
    "rm-fit": ("real_model", ["fit", "--config", "CONFIG", "--batch", "1", "--new-tokens", "2", "--memory-bytes",
                              str(10**9)]),
}

ROWS = sorted((command, how, case) for command in COMMANDS for how in ("flag", *VARIABLES) for case in BAD)


def run_program(prog, argv, cwd, environ, in_process):
    if in_process:
        if prog == "mesure_memoire":
            from lab_helpers.synthetic.commands import main
        else:
            from lab_helpers.real.commands import main
        return run_main_in_process(main, argv, cwd)
    module = "lab_helpers.mesure_memoire" if prog == "mesure_memoire" else "lab_helpers.real_model"
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**environ, "PYTHONPATH": str(ROOT)})


def assert_one_line_refusal(proc, prog, cwd, expected):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines
    assert expected in lines[0], lines
    assert len(lines[0]) < 400, lines
    assert proc.stdout == ""
    assert sorted(os.listdir(cwd)) == [], "nothing is created in the working folder"
    assert str(ROOT) not in lines[0] and "/tmp" not in lines[0], lines


@pytest.fixture
def clean_environment(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def prepare(tmp_path, command):
    cwd, files = tmp_path / "cwd", tmp_path / "files"
    cwd.mkdir()
    files.mkdir()
    config = files / "tiny.json"
    config.write_text(json.dumps(TINY))
    prog, argv = COMMANDS[command]
    return cwd, prog, [str(config) if a == "CONFIG" else a for a in argv]


@pytest.mark.parametrize("command, how, case", ROWS)
def test_an_unmodelled_allocator_setting_ends_in_one_line(tmp_path, clean_environment, command, how, case):
    text, expected = BAD[case]
    cwd, prog, argv = prepare(tmp_path, command)
    if how == "flag":
        argv = [*argv, "--allocator-conf", text]
        where = "--allocator-conf"
    else:
        clean_environment.setenv(how, text)
        where = how
    in_process = ROWS.index((command, how, case)) % SUBPROCESS_EVERY != 0
    proc = run_program(prog, argv, cwd, dict(os.environ), in_process)
    assert_one_line_refusal(proc, prog, cwd, expected)
    assert where in proc.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_two_variables_with_different_settings_are_refused(tmp_path, clean_environment, command):
    cwd, prog, argv = prepare(tmp_path, command)
    clean_environment.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    clean_environment.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    proc = run_program(prog, argv, cwd, dict(os.environ), in_process=True)
    assert_one_line_refusal(proc, prog, cwd, "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are both set")


def test_fit_card_refuses_expandable_segments(tmp_path, clean_environment):
    cwd, prog, argv = prepare(tmp_path, "rm-fit")
    argv = ["fit", "--config", argv[2], "--batch", "1", "--context", "8", "--new-tokens", "2", "--card", "--days",
            "30", "--allocator-conf", "expandable_segments:True"]
    proc = run_program(prog, argv, cwd, dict(os.environ), in_process=True)
    assert_one_line_refusal(proc, prog, cwd, "--card predicts PyTorch's default allocator only")


def synthetic_measurement(conf):
    from lab_helpers.synthetic.network import MeasureConfig
    from lab_helpers.synthetic.predict import predict
    document = predict(MeasureConfig())
    for key in ("workspace", "reserved_assumptions", "allocator_conf", "budget"):  # a prediction's own
        document.pop(key, None)
    document["kind"] = "iteragpu-lab measurement"
    document["environment"] = {
        "python_version": "3.12.3", "torch_version": "2.11.0+cu130", "cuda_build_version": "13.0",
        "hip_build_version": None, "runtime_note": "note", "device": "cuda:0", "device_count": 1,
        "device_visible": True, "device_name": "NVIDIA H200", "compute_capability": "9.0",
        "total_memory_bytes": 150754820096, "free_memory_bytes": 150000000000, "pytorch_cuda_alloc_conf": conf}
    for phase in document["phases"]:
        phase.update(seconds=0.002, device_seconds=0.001)
        if phase["phase"] == "warm_forward":
            phase.update(achieved_tflops=1.5, host_to_device_time_ratio=2.0)
    return document


@pytest.mark.parametrize("case", ["max-split", "lowercase", "huge", "escape", "twice"])
@pytest.mark.parametrize("prog", ["mesure_memoire", "real_model"])
def test_compare_refuses_a_measurement_recorded_under_an_unmodelled_setting(tmp_path, clean_environment, prog, case):
    text, expected = BAD[case]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = tmp_path / "m.json"
    if prog == "mesure_memoire":
        document = synthetic_measurement(text)
    else:
        def change(d):
            d["environment"] = {**d["environment"], "pytorch_cuda_alloc_conf": text}
        document = measurement(tmp_path, change)
    path.write_text(json.dumps(document))
    proc = run_program(prog, ["compare", str(path)], cwd, dict(os.environ), in_process=True)
    assert_one_line_refusal(proc, prog, cwd, expected)
    assert "the measurement's environment.pytorch_cuda_alloc_conf" in proc.stderr
