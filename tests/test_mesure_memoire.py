"""CPU tests of mesure_memoire: estimate, environment, CLI errors, file safety, predict.

Every test taking `mm` runs twice: on the generated lab_helpers/mesure_memoire.py and on the
generated cells of notebooks/mesure-memoire.ipynb; one taking `mm_script` or `mm_program` runs the
standalone file and the package's own entry (lab_helpers.synthetic.commands)."""
import json
import math
import shutil
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, cuda_available, full_measurement, run_main_in_process

GIB = 2**30
MIB = 2**20
SMALL_MEASURE = ["measure", "--device", "cuda:0", "--batch", "1", "--context", "16", "--width", "64",
                 "--dtype", "float32", "--warmup", "1", "--repeats", "2"]


def run(script, *args, cwd=None, env=None):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120)


def assert_one_line_error(proc, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    return lines[0]


# ---------------------------------------------------------------- estimate
def test_estimate_seed_example(mm):
    got = mm.estimate(7_000_000_000, 16, 4)
    assert got["weight_bytes"] == 14_000_000_000
    assert got["bytes_per_parameter"] == 2
    assert got["weight_gb"] == 14.0
    assert got["total_gib"] == pytest.approx(17.0385160446167, abs=1e-12)
    assert got["total_gib"] == 14_000_000_000 / GIB + 4
    assert {"activations", "KV cache", "gradients", "optimizer states"} <= set(got["excludes"])
    assert any("quantization" in e for e in got["excludes"])
    assert any("CUDA context" in e for e in got["excludes"])


@pytest.mark.parametrize("bits, per_parameter", [(1, 1), (4, 1), (8, 1), (9, 2), (12, 2), (16, 2), (32, 4), (64, 8)])
def test_bits_round_up_to_whole_bytes(mm, bits, per_parameter):
    got = mm.estimate(1000, bits)
    assert got["bytes_per_parameter"] == per_parameter
    assert got["weight_bytes"] == 1000 * per_parameter
    assert got["reserve_gib"] == 0 and got["total_gib"] == got["weight_gib"]


@settings(max_examples=200, deadline=None)
@given(parameters=st.integers(1, 10**15), bits=st.integers(1, 64),
       reserve=st.floats(0, 1024, allow_nan=False, allow_infinity=False))
def test_estimate_properties(mm, parameters, bits, reserve):
    got = mm.estimate(parameters, bits, reserve)
    per = got["bytes_per_parameter"]
    assert (per - 1) * 8 < bits <= per * 8
    assert isinstance(got["weight_bytes"], int) and got["weight_bytes"] == parameters * per
    assert got["weight_gib"] == got["weight_bytes"] / GIB
    assert got["weight_gb"] == got["weight_bytes"] / 10**9
    assert got["total_gib"] == got["weight_gib"] + reserve


def test_estimate_cli_prints_json(mm_script):
    proc = run(mm_script, "estimate", "--parameters", "7000000000", "--bits", "16", "--reserve-gib", "4")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["weight_bytes"] == 14_000_000_000
    assert math.isclose(got["total_gib"], 17.0385160446167, abs_tol=1e-12)


# ------------------------------------------------------------ bad invocations
BAD_INVOCATIONS = [
    ["no-such-command"],
    ["estimate", "--bits", "16"],
    ["estimate", "--parameters", "0", "--bits", "16"],
    ["estimate", "--parameters", "-5", "--bits", "16"],
    ["estimate", "--parameters", "7e9", "--bits", "16"],
    ["estimate", "--parameters", "100", "--bits", "0"],
    ["estimate", "--parameters", "100", "--bits", "65"],
    ["estimate", "--parameters", "100", "--bits", "16", "--reserve-gib", "-1"],
    ["estimate", "--parameters", "100", "--bits", "16", "--reserve-gib", "nan"],
    ["estimate", "--parameters", "100", "--bits", "16", "--reserve-gib", "inf"],
    ["estimate", "--parameters", "100", "--bits", "16", "--reserve-gib", "four"],
    ["environment", "--device", "cpu"],
    ["environment", "--device", "cuda"],
    ["environment", "--device", "cuda:x"],
    ["measure", "--device", "cuda:0"],
    [*SMALL_MEASURE, "--batch", "0", "--output", "m.json"],
    [*SMALL_MEASURE, "--context", "-1", "--output", "m.json"],
    [*SMALL_MEASURE, "--width", "0", "--output", "m.json"],
    [*SMALL_MEASURE, "--hidden", "0", "--output", "m.json"],
    [*SMALL_MEASURE, "--repeats", "0", "--output", "m.json"],
    [*SMALL_MEASURE, "--warmup", "-1", "--output", "m.json"],
    [*SMALL_MEASURE, "--dtype", "float64", "--output", "m.json"],
    [*SMALL_MEASURE, "--device", "cpu", "--output", "m.json"],
    [*SMALL_MEASURE, "--device", "cuda:-1", "--output", "m.json"],
    [*SMALL_MEASURE, "--output", "missing-folder/m.json"],
    ["predict", "--batch", "0"],
    ["predict", "--dtype", "int8"],
    ["predict", "--workspace-bytes", "-1"],
    ["compare", "missing.json"],
    ["compare", "not-a-measurement.json"],
]


@pytest.mark.parametrize("argv", BAD_INVOCATIONS, ids=lambda a: " ".join(a) or "(none)")
def test_bad_invocation_exits_2_with_one_line(mm_script, tmp_path, argv):
    (tmp_path / "not-a-measurement.json").write_text('{"hello": 1}')
    before = sorted(p.name for p in tmp_path.iterdir())
    line = assert_one_line_error(run(mm_script, *argv, cwd=tmp_path))
    assert "error" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no file written


def test_no_command_lists_the_five_commands(mm_script, tmp_path):
    proc = run(mm_script, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    listed = [line.split()[0] for line in proc.stderr.splitlines() if line.startswith("  ")]
    assert listed == ["estimate", "environment", "measure", "predict", "compare"]


@pytest.mark.parametrize("command", ["estimate", "environment", "measure", "predict", "compare"])
def test_each_command_help_has_a_description_and_an_example(mm_script, command):
    proc = run(mm_script, command, "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert "example:\n  python mesure_memoire.py " + command in proc.stdout
    if command == "compare":
        assert "default: 33554432 then 1048576 bytes, measured default: torch 2.11.0+cu130 on NVIDIA H200" \
            in " ".join(proc.stdout.split())


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU refusal")
def test_measure_without_cuda_exits_2_and_writes_nothing(mm_program, tmp_path):
    # main(argv) in this process (torch's CUDA check is the same there); the fresh script's exit 2 is
    # test_measure_refuses_existing_output_untouched's
    line = assert_one_line_error(run_main_in_process(mm_program.main, [*SMALL_MEASURE, "--output", "m.json"],
                                                     tmp_path))
    assert "no CUDA" in line and "CPU" in line
    assert list(tmp_path.iterdir()) == []


def test_measure_refuses_existing_output_untouched(mm_script, tmp_path):
    target = tmp_path / "m.json"
    target.write_text("keep me")
    line = assert_one_line_error(run(mm_script, *SMALL_MEASURE, "--output", target))
    assert "already exists" in line
    assert target.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


# --------------------------------------------------------- torch unimportable
@pytest.fixture
def no_torch_env(tmp_path):
    """An environment where `import torch` fails, with a path in the message."""
    fake = tmp_path / "fake-site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise ImportError("libtorch_cuda.so: cannot open /home/canary-user-77/lib/libtorch_cuda.so")\n')
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(fake.parent)}


def test_environment_reports_without_torch(mm_script, no_torch_env, tmp_path):
    proc = run(mm_script, "environment", "--device", "cuda:0", env=no_torch_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["torch_version"] == "unavailable"
    assert got["torch_unavailable_reason"].startswith("ImportError: libtorch_cuda.so: cannot open <path>")
    assert got["device_visible"] is False
    assert "canary-user-77" not in proc.stdout + proc.stderr


def test_measure_without_torch_exits_2(mm_script, no_torch_env, tmp_path):
    proc = run(mm_script, *SMALL_MEASURE, "--output", "m.json", env=no_torch_env, cwd=tmp_path)
    line = assert_one_line_error(proc)
    assert "torch cannot be imported" in line
    assert "canary-user-77" not in line
    assert not (tmp_path / "m.json").exists()


# ------------------------------------------------------------------ privacy
CANARIES = {"HOME": "/home/canary-home-5150", "USER": "canary-user-5150", "LOGNAME": "canary-login-5150",
            "SECRET_TOKEN": "canary-secret-5150", "HOSTNAME": "canary-host-5150"}


def test_environment_output_carries_no_private_value(mm_script, tmp_path):
    env = {"PATH": "/usr/bin:/bin", **CANARIES}
    work = tmp_path / "canary-cwd-5150"
    work.mkdir()
    proc = run(mm_script, "environment", "--device", "cuda:0", cwd=work, env=env)
    assert proc.returncode == 0, proc.stderr
    for value in [*CANARIES.values(), "canary-cwd-5150"]:
        assert value not in proc.stdout + proc.stderr


def test_environment_reads_no_host_or_user_name(mm, monkeypatch):
    import getpass
    import platform
    import socket
    monkeypatch.setattr(socket, "gethostname", lambda: "canary-host-9")
    monkeypatch.setattr(platform, "node", lambda: "canary-host-9")
    monkeypatch.setattr(getpass, "getuser", lambda: "canary-user-9")
    text = json.dumps(mm.environment("cuda:0"))
    assert "canary" not in text


@pytest.mark.parametrize("where", ["standalone", "package"])
def test_module_source_never_reads_private_sources(where):
    if where == "standalone":
        source = (ROOT / "lab_helpers" / "mesure_memoire.py").read_text(encoding="utf-8")
    else:  # every module the standalone file bundles
        from lab_helpers.build.bundle import closure
        source = "\n".join((ROOT / path).read_text(encoding="utf-8")
                           for path in closure(["lab_helpers/synthetic/commands.py"]))
    # the one environment read: torchrun's own variables, by name, for a tensor-parallel run
    launcher_read = ("{name: os.environ[name] for name in (*LAUNCHER_VARIABLES, *STORE_VARIABLES) "
                     "if name in os.environ}")
    assert source.count(launcher_read) == 1
    source = source.replace(launcher_read, "")
    # and PyTorch's allocator settings (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF), read and set by name
    allocator_read = "return os.environ  # the allocator's variables only: PyTorch reads its settings there"
    assert source.count(allocator_read) == 1
    source = source.replace(allocator_read, "")
    for forbidden in ("os.environ", "getenv", "gethostname", "getuser", "expanduser", "Path.home", "platform.node", "uname"):
        assert forbidden not in source, forbidden


# ------------------------------------------------------------- file safety
def test_write_new_json_is_exclusive_and_whole(mm, tmp_path):
    target = tmp_path / "out.json"
    mm.write_new_json(target, {"a": 1})
    with pytest.raises(mm.LabError, match="already exists"):
        mm.write_new_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_two_writers_racing_one_wins(mm, tmp_path):
    target = tmp_path / "race.json"
    outcomes = []

    def writer(n):
        try:
            mm.write_new_json(target, {"writer": n, "pad": "x" * 100_000})
            outcomes.append(("won", n))
        except mm.LabError:
            outcomes.append(("lost", n))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [n for kind, n in outcomes if kind == "won"]
    assert len(winners) == 1 and len(outcomes) == 8
    assert json.loads(target.read_text())["writer"] == winners[0]
    assert [p.name for p in tmp_path.iterdir()] == ["race.json"]


def test_new_file_name_never_reuses_a_name(mm, tmp_path):
    first = mm.new_file_name(tmp_path, "mesures")
    first.write_text("{}")
    second = mm.new_file_name(tmp_path, "mesures")
    assert second != first and not second.exists() and second.name.startswith("mesures-")


# ------------------------------------------------------- standalone running
def test_script_runs_alone_from_an_empty_folder(mm_script, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(mm_script, alone / "mesure_memoire.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-I", str(alone / "mesure_memoire.py"), "estimate", "--parameters",
                           "7000000000", "--bits", "16", "--reserve-gib", "4"],
                          capture_output=True, text=True, cwd=elsewhere, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["weight_bytes"] == 14_000_000_000
    proc = subprocess.run([sys.executable, "-I", str(alone / "mesure_memoire.py"), "predict"],
                          capture_output=True, text=True, cwd=elsewhere, timeout=60)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["phases"]) == 6


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.mesure_memoire", "estimate", "--parameters", "10",
                           "--bits", "4"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["weight_bytes"] == 10


def test_estimate_and_predict_never_import_torch(mm_script, tmp_path):
    code = (f"import runpy, sys; sys.argv = ['m', 'estimate', '--parameters', '5', '--bits', '8'];\n"
            f"try:\n    runpy.run_path({str(mm_script)!r}, run_name='__main__')\nexcept SystemExit: pass\n"
            f"sys.argv = ['m', 'predict']\n"
            f"try:\n    runpy.run_path({str(mm_script)!r}, run_name='__main__')\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ tables
ESTIMATE_TABLE = """\
parameters                 7000000000
bits per parameter         16 (2 bytes, rounded up)
weights                    13.04 GiB (14000000000 B; 14.00 GB)
reserve (your assumption)  4.00 GiB
total                      17.04 GiB
not counted: activations, KV cache, quantization metadata (scales, zero points), gradients, optimizer states, \
CUDA context and libraries (cuBLAS, cuDNN, kernels)
"""
PREDICT_TABLE = """\
prediction: batch 1, context 16, width 64, hidden 256, float32, warmup 1, repeats 1
phase                     end allocated          peak allocated            end reserved           peak reserved
model_load          0.13 MiB (132608 B)     0.13 MiB (132608 B)    2.00 MiB (2097152 B)    2.00 MiB (2097152 B)
inputs              0.13 MiB (136704 B)     0.13 MiB (136704 B)    2.00 MiB (2097152 B)    2.00 MiB (2097152 B)
cold_forward     33.13 MiB (34743808 B)  33.16 MiB (34772480 B)  34.00 MiB (35651584 B)  34.00 MiB (35651584 B)
warmup           33.13 MiB (34739712 B)  33.16 MiB (34772480 B)  34.00 MiB (35651584 B)  34.00 MiB (35651584 B)
warm_forward #0  33.13 MiB (34743808 B)  33.16 MiB (34772480 B)  34.00 MiB (35651584 B)  34.00 MiB (35651584 B)
budget: none: reserved is predicted for an unbounded device: no release of cached segments and no out-of-memory \
error are replayed
each phase starts from the previous one's end
workspace: 33554432 + 1048576 bytes (measured default: torch 2.11.0+cu130 on NVIDIA H200 (compute capability 9.0))
reserved assumes: a fresh process, default allocator settings (no PYTORCH_CUDA_ALLOC_CONF: no expandable_segments, \
no max_split_size_mb), free memory as the budget says (without one, unbounded: no cache flush and retry), and free \
blocks of equal size taken in the order their segments were made
"""
COMPARE_TABLE = """\
phase            measured peak allocated               predicted  difference B  measured peak reserved\
               predicted  difference B
model_load           0.13 MiB (132608 B)     0.13 MiB (132608 B)            +0    2.00 MiB (2097152 B)\
    2.00 MiB (2097152 B)            +0
inputs               0.13 MiB (136704 B)     0.13 MiB (136704 B)            +0    2.00 MiB (2097152 B)\
    2.00 MiB (2097152 B)            +0
cold_forward      33.16 MiB (34772480 B)  33.16 MiB (34772480 B)            +0  34.00 MiB (35651584 B)\
  34.00 MiB (35651584 B)            +0
warmup            33.16 MiB (34772480 B)  33.16 MiB (34772480 B)            +0  34.00 MiB (35651584 B)\
  34.00 MiB (35651584 B)            +0
warm_forward #0   33.16 MiB (34772992 B)  33.16 MiB (34772480 B)          +512  34.00 MiB (35651584 B)\
  34.00 MiB (35651584 B)            +0
replayed under an unbounded device: the measurement did not record the device's free bytes (a file written before \
they were recorded), so no release of cached segments and no out-of-memory error are replayed
allocated exact (baseline, end and peak of every phase): no
workspace predicted: 33554432 + 1048576 bytes (measured default: torch 2.11.0+cu130 on NVIDIA H200 (compute \
capability 9.0)); detected from the cold forward: 34603008 bytes
"""


def test_estimate_table(mm_script):
    proc = run(mm_script, "estimate", "--parameters", "7000000000", "--bits", "16", "--reserve-gib", "4",
               "--format", "table")
    assert proc.returncode == 0 and proc.stdout == ESTIMATE_TABLE


def test_predict_table(mm_script):
    proc = run(mm_script, "predict", "--repeats", "1", "--format", "table")
    assert proc.returncode == 0 and proc.stdout == PREDICT_TABLE


def test_compare_table(mm, mm_script, tmp_path):
    (tmp_path / "m.json").write_text(json.dumps(full_measurement(mm, mm.MeasureConfig(repeats=1), shift=512)))
    proc = run(mm_script, "compare", "m.json", "--format", "table", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == COMPARE_TABLE
    proc = run(mm_script, "compare", "m.json", "--format", "table", "--fail-on-difference", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == COMPARE_TABLE


# ---------------------------------------------------- configuration, once
def test_config_is_validated_once_and_the_device_parsed_once(mm, monkeypatch):
    calls = []
    original = mm.parse_device
    monkeypatch.setattr(mm, "parse_device", lambda device: calls.append(device) or original(device))
    config = mm.MeasureConfig(device="cuda:3", width=32)
    assert calls == ["cuda:3"] and config.device_index == 3 and config.hidden is None
    assert config.hidden_features == 128 and config.record()["hidden"] == 128
    mm.predict(config)
    mm.synthetic_model(config)
    assert calls == ["cuda:3"]


@pytest.mark.parametrize("field, value, message", [  # a library caller reads the field's name
    ("batch", "2", "batch must be an integer, got str"),
    ("batch", True, "batch must be an integer, got bool"),
    ("batch", 2.0, "batch must be an integer, got float"),
    ("batch", 0, "batch must be > 0, got 0"),
    ("repeats", 10_001, "repeats must be at most 10000, got 10001"),
    ("warmup", -1, "warmup must be >= 0, got -1"),
    ("hidden", 2**22 + 1, "hidden must be at most 4194304, got 4194305"),
    ("dtype", "float64", "dtype must be one of float32, float16, bfloat16, got 'float64'"),
    ("device", "cuda:0 ", "device must be an explicit cuda:N (e.g. cuda:0), got 'cuda:0 '"),
    ("device", None, "device must be an explicit cuda:N (e.g. cuda:0), got NoneType"),
])
def test_config_refuses_bad_fields(mm, field, value, message):
    with pytest.raises(mm.LabError) as caught:
        mm.MeasureConfig(**{field: value})
    assert str(caught.value) == message


def test_estimate_bounds_keep_figures_finite(mm):
    got = mm.estimate(10**18, 64, 2**20)
    assert got["weight_bytes"] == 8 * 10**18 and math.isfinite(got["total_gib"])
    with pytest.raises(mm.LabError, match="at most 1000000000000000000"):
        mm.estimate(10**400, 16)


# ------------------------------------------------------ measure's failures
@pytest.mark.parametrize("error, reason", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total capacity)", "out_of_memory"),
    ("CUDA error: an illegal memory access was encountered", "cuda_error"),
])
def test_failure_report_is_written_on_exit_3(mm_program, tmp_path, monkeypatch, capsys, error, reason):
    def failing_measure(config):
        raise mm_program.PhaseError("cold_forward", RuntimeError(error + "\nCUDA kernel errors might be reported later"))
    monkeypatch.setattr(mm_program, "measure", failing_measure)
    monkeypatch.chdir(tmp_path)
    assert mm_program.main(["measure", "--output", "m.json", "--failure-report", "failure.json"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "phase cold_forward failed" in err and "failure report: failure.json" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failure.json"]
    assert json.loads((tmp_path / "failure.json").read_text()) == {
        "kind": "iteragpu-lab measure failure", "phase": "cold_forward", "reason": reason,
        "message": f"RuntimeError: {error}"}


def test_failure_report_path_checked_before_measuring(mm_program, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mm_program, "measure", lambda config: pytest.fail("measured despite a taken report path"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "failure.json").write_text("keep")
    assert mm_program.main(["measure", "--output", "m.json", "--failure-report", "failure.json"]) == 2
    assert capsys.readouterr().err == "mesure_memoire: error: failure.json already exists; choose a new file name\n"
    assert (tmp_path / "failure.json").read_text() == "keep" and not (tmp_path / "m.json").exists()


# ------------------------------------------------------------ usable memory
def test_usable_memory_child_command(mm):
    argv = mm.usable_memory_command(3)
    assert argv[:2] == [sys.executable, "-c"] and argv[3:] == ["3", str(2 * MIB), "2048"]
    compile(argv[2], "<usable memory child>", "exec")
    assert "mem_get_info" in argv[2] and "addmm" in argv[2] and "bfloat16" in argv[2]


@pytest.mark.parametrize("script, expected", [
    ('print("noise"); print(\'{"usable_memory_bytes": 150000000000, "tries": 3}\')',
     {"usable_memory_bytes": 150000000000, "usable_memory_unavailable_reason": None}),
    ('print(\'{"usable_memory_bytes": null, "tries": 2048}\')',
     {"usable_memory_bytes": "unavailable", "usable_memory_unavailable_reason": "no allocation succeeded"}),
    ('import sys; print("RuntimeError: CUDA driver too old in /home/someone/x", file=sys.stderr); sys.exit(1)',
     {"usable_memory_bytes": "unavailable",
      "usable_memory_unavailable_reason": "RuntimeError: CUDA driver too old in <path>"}),
    ('print("true")', {"usable_memory_bytes": "unavailable", "usable_memory_unavailable_reason": "no allocation succeeded"}),
    ('import time; time.sleep(600)',
     {"usable_memory_bytes": "unavailable", "usable_memory_unavailable_reason": "no answer within 1 s"}),
])
def test_usable_memory_bookkeeping_with_a_fake_child(mm, script, expected):
    started = time.monotonic()
    assert mm.usable_memory(0, command=[sys.executable, "-c", script], timeout_seconds=1) == expected
    # a hang guard only, against waiting for the silent child (it sleeps 600 s): the 1 s timeout
    # must end it; 300 s leaves any loaded machine room and still fails long before the child wakes
    assert time.monotonic() - started < 300


def test_environment_without_gpu_says_usable_memory_is_unavailable(mm_program, tmp_path):
    proc = run_main_in_process(mm_program.main, ["environment"], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    got = json.loads(proc.stdout)
    if got["device_visible"]:
        pytest.skip("a GPU is visible: the gpu tests check the figure")
    assert got["usable_memory_bytes"] == "unavailable"
    assert got["usable_memory_unavailable_reason"].startswith(("no device visible", "torch cannot"))


def test_environment_measures_usable_memory_before_touching_the_device(mm, monkeypatch):
    torch = pytest.importorskip("torch")
    order = []

    class Props:
        name, major, minor, total_memory = "Fake GPU", 9, 0, 100 * 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: order.append(("props", i)) or Props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: order.append(("free", i)) or (90 * 2**30, 100 * 2**30))

    def probe(index):
        order.append(("probe", index))
        return {"usable_memory_bytes": 89 * 2**30, "usable_memory_unavailable_reason": None}
    got = mm.environment("cuda:1", usable_memory_probe=probe)
    # every GPU's child first, then this process reads each GPU once (the chosen one's fields too)
    assert order == [("probe", 0), ("probe", 1), ("props", 0), ("free", 0), ("props", 1), ("free", 1)]
    assert got["usable_memory_bytes"] == 89 * 2**30 and got["free_memory_bytes"] == 90 * 2**30
    assert got["device_visible"] is True and got["usable_memory_unavailable_reason"] is None
    order.clear()
    got = mm.environment("cuda:1", usable_memory_figure=False, usable_memory_probe=probe)
    assert not [step for step in order if step[0] == "probe"] and got["usable_memory_bytes"] is None


def test_benchmark_refuses_bad_flags_in_one_line(tmp_path):
    for argv in (["--batch", "0"], ["--width", "\u0661"], ["--device", "cpu"], ["--repeats", "10001"]):
        proc = run(ROOT / "benchmarks" / "forward_vs_bare.py", *argv, cwd=tmp_path)
        assert_one_line_error(proc).startswith("forward_vs_bare: error: ")
    assert list(tmp_path.iterdir()) == []
