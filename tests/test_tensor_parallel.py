"""CPU tests of the tensor-parallel side of mesure_memoire: the launcher's environment, the
coordination between ranks (gather, failure publication, the one-line message, bounded waits) over
gloo with real torchrun processes, and the synthetic network's prediction and comparison per rank.

Tests taking `mm` run on the standalone file and on the notebook's cells; tests taking `launcher` run
on the standalone file and on lab_helpers.launch.torchrun (notebooks inline no launcher code); the
multi-process tests run the library under `python -m torch.distributed.run` (torchrun) with gloo."""
import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT, load_module
from lab_helpers.launch.tensor_parallel import FAILURE_ACK_SECONDS

GOOD_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
MEASURE_ARGV = ["-m", "lab_helpers.mesure_memoire", "measure", "--width", "64", "--tensor-parallel", "2",
                "--output", "tp.json"]


# ----------------------------------------------------------- the launcher's environment
@pytest.fixture(scope="module", params=("standalone", "package"))
def launcher(request):
    """The launcher's functions: in the generated standalone file, or in the package."""
    if request.param == "standalone":
        return load_module(ROOT / "lab_helpers" / "mesure_memoire.py")
    from lab_helpers.launch import torchrun
    return torchrun


def test_no_launcher_names_the_exact_command(launcher):
    with pytest.raises(launcher.LabError) as caught:
        launcher.launch_info(2, MEASURE_ARGV, environ={})
    assert str(caught.value) == (
        "tensor_parallel 2 runs one process per GPU, started by torchrun; run: torchrun --nproc-per-node 2 "
        "-m lab_helpers.mesure_memoire measure --width 64 --tensor-parallel 2 --output tp.json")


def test_launcher_command_quotes_an_argv_and_keeps_a_string(launcher):
    assert launcher.launcher_command(4, ["-m", "x", "--output", "a b.json"]) == \
        "torchrun --nproc-per-node 4 -m x --output 'a b.json'"
    assert launcher.launcher_command(2, "-m x y") == "torchrun --nproc-per-node 2 -m x y"


def with_env(**changes):
    env = dict(GOOD_ENV)
    for name, value in changes.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = value
    return env


BAD_ENVIRONMENTS = [
    ("missing-rank", with_env(RANK=None), 2, "the launcher's environment is incomplete: RANK is not set"),
    ("missing-local-world-size", with_env(LOCAL_WORLD_SIZE=None), 2,
     "the launcher's environment is incomplete: LOCAL_WORLD_SIZE is not set"),
    ("rank-not-a-number", with_env(RANK="one"), 2, "the launcher's RANK not an integer: 'one'"),
    ("rank-negative", with_env(RANK="-1"), 2, "the launcher's RANK must be >= 0, got -1"),
    ("world-size-empty", with_env(WORLD_SIZE=""), 2, "the launcher's WORLD_SIZE not an integer: ''"),
    ("world-size-float", with_env(WORLD_SIZE="2.0"), 2, "the launcher's WORLD_SIZE not an integer: '2.0'"),
    ("local-rank-arabic-digit", with_env(LOCAL_RANK="\u0661"), 2, "the launcher's LOCAL_RANK not an integer"),
    ("world-size-huge", with_env(WORLD_SIZE="9" * 2000), 2, "the launcher's WORLD_SIZE has 2000 characters"),
    ("world-size-mismatch", with_env(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4"), 2,
     "tensor_parallel 2 disagrees with the launcher's world size 4 (WORLD_SIZE)"),
    ("world-size-mismatch-other-way", GOOD_ENV, 4,
     "tensor_parallel 4 disagrees with the launcher's world size 2 (WORLD_SIZE)"),
    ("rank-equals-world-size", with_env(RANK="2"), 2, "the launcher's RANK 2 is not below its WORLD_SIZE 2"),
    ("rank-above-world-size", with_env(RANK="7"), 2, "the launcher's RANK 7 is not below its WORLD_SIZE 2"),
    ("local-rank-out-of-range", with_env(LOCAL_RANK="2"), 2,
     "the launcher's LOCAL_RANK 2 is not below its LOCAL_WORLD_SIZE 2"),
    ("local-world-size-zero", with_env(LOCAL_WORLD_SIZE="0"), 2,
     "the launcher's LOCAL_WORLD_SIZE 0 is not between 1 and its WORLD_SIZE 2"),
    ("local-world-size-above-world", with_env(LOCAL_WORLD_SIZE="3"), 2,
     "the launcher's LOCAL_WORLD_SIZE 3 is not between 1 and its WORLD_SIZE 2"),
    # a CPU build of torch sees no device: the last check refuses before any process group exists
    ("no-cuda-device", GOOD_ENV, 2, "no CUDA device is visible to torch; tensor_parallel 2 needs one GPU per rank"),
]


@pytest.mark.parametrize("environ, degree, message", [c[1:] for c in BAD_ENVIRONMENTS],
                         ids=[c[0] for c in BAD_ENVIRONMENTS])
def test_bad_launcher_environment_is_one_line(launcher, environ, degree, message):
    with pytest.raises(launcher.LabError) as caught:
        launcher.launch_info(degree, MEASURE_ARGV, environ=environ)
    text = str(caught.value)
    assert text.startswith(message), text
    assert "\n" not in text


@pytest.mark.parametrize("degree", [0, 65, "0", "-1", "abc", True, 2.0])
def test_launch_info_refuses_a_bad_degree(launcher, degree):
    with pytest.raises(launcher.LabError, match="^tensor_parallel "):
        launcher.launch_info(degree, MEASURE_ARGV, environ=GOOD_ENV)


def test_more_ranks_than_gpus(launcher, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(launcher.LabError) as caught:
        launcher.launch_info(2, MEASURE_ARGV, environ=GOOD_ENV)
    assert str(caught.value) == ("2 ranks on this machine (LOCAL_WORLD_SIZE) but 1 GPU(s) visible: one GPU per "
                                 "rank; lower --nproc-per-node and --tensor-parallel")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launcher.launch_info(2, MEASURE_ARGV, environ=GOOD_ENV) == launcher.LaunchInfo(1, 2, 1, 2)
    assert launcher.LaunchInfo(1, 2, 1, 2).device == "cuda:1"


def test_launcher_environment_reads_only_torchrun_variables(launcher, monkeypatch):
    monkeypatch.setenv("HOME", "/home/canary")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    got = launcher.launcher_environment()
    assert got["RANK"] == "0" and "HOME" not in got and "WORLD_SIZE" not in got
    assert set(got) <= set(launcher.LAUNCHER_VARIABLES) | set(launcher.STORE_VARIABLES)


# ---------------------------------------------------------------- ranks over gloo, under torchrun
WORKER = r'''
import json, os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import mesure_memoire as mm
import torch
import torch.distributed as dist

scenario, output = sys.argv[2], sys.argv[3]


def mark(name):  # when the event a test times happened (the ranks' start-up is no part of it)
    with open(name, "w") as file:
        file.write(repr(time.time()))


env = mm.launcher_environment()
info = mm.LaunchInfo(*(int(env[name]) for name in mm.LAUNCHER_VARIABLES))
with mm.TensorParallelRun(info, "cpu", prog="worker", timeout_seconds=60) as run:
    assert (run.rank, run.world_size) == (info.rank, info.world_size)
    assert run.outside_allocator is None  # measured on a GPU only
    values = torch.full((4,), float(run.rank + 1))
    dist.all_reduce(values, group=run.group)
    if scenario == "phase-failure" and run.rank == 1:
        time.sleep(1.0)  # rank 0 is blocked in the collective below by then
        mark("failed-at")
        run.fail(mm.PhaseError("warm_forward", RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")))
    if scenario == "usage-failure" and run.rank == 0:
        raise mm.LabError("out.json already exists; choose a new file name")
    if scenario in ("vanish", "vanish-while-busy") and run.rank == 1:
        time.sleep(1.0)
        mark("vanished-at")
        os._exit(9)
    if scenario == "vanish-while-busy":
        time.sleep(50)  # rank 0 is busy (as in a kernel waiting for its peer), in no collective
    if scenario != "ok":
        dist.all_reduce(values, group=run.group)
    records = run.gather({"rank": run.rank, "sum": values.tolist()})
    shared = run.broadcast({"from": run.rank})
    assert shared == {"from": 0}, shared
    if run.rank == 0:
        mm.write_new_json(output, records)
    else:
        assert records is None
    if scenario == "store-stalls-at-exit" and run.rank == 1:
        # torchrun, which hosts the store, is not scheduled for 4 s as this rank leaves (a busy
        # machine): the monitor's read of the store is under way and waits
        launcher = os.getppid()
        subprocess.Popen(["sh", "-c", f"sleep 4; kill -CONT {launcher}"])
        os.kill(launcher, signal.SIGSTOP)
        time.sleep(0.5)


class SlowExit:
    """The interpreter's exit takes 3 s (a busy machine): the store answers the monitor during it."""

    def __del__(self):
        time.sleep(3)


if scenario == "store-stalls-at-exit":
    slow_exit = SlowExit()
'''


def torchrun(tmp_path, scenario, ranks=2):
    (tmp_path / "worker.py").write_text(WORKER, encoding="utf-8")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), "worker.py", str(ROOT / "lab_helpers"), scenario, "out.json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=240)
    return proc, time.monotonic() - started


def seconds_since(tmp_path, mark):
    """Seconds from the event the worker marked in `mark` to now: a bound on what follows an event
    leaves out torchrun's and the ranks' start-up (importing torch: seconds idle, a minute on a busy
    machine), which no code of the lab's controls."""
    return time.time() - float((tmp_path / mark).read_text())


def worker_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("worker:")]


def test_gather_brings_every_rank_to_rank_0(tmp_path):
    proc, _ = torchrun(tmp_path, "ok", ranks=3)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "out.json").read_text())
    assert records == [{"rank": r, "sum": [6.0] * 4} for r in range(3)]
    assert worker_lines(proc) == []


def test_a_store_that_answers_during_the_exit_does_not_abort_a_rank(tmp_path):
    """The monitor thread reads the store without the GIL; one still inside a read when the
    interpreter exits is ended inside C++ and the rank dies in std::terminate (SIGABRT, "terminate
    called without an active exception", seen on a busy machine). The run waits for its monitor."""
    proc, _ = torchrun(tmp_path, "store-stalls-at-exit")
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr
    records = json.loads((tmp_path / "out.json").read_text())
    assert records == [{"rank": r, "sum": [6.0] * 4} for r in range(2)]  # two all-reduces: 1 + 2, twice
    assert worker_lines(proc) == []


def test_failure_on_one_rank_ends_every_rank_with_one_line(tmp_path):
    proc, _ = torchrun(tmp_path, "phase-failure")
    seconds = seconds_since(tmp_path, "failed-at")
    line = ("worker: error: rank 1 failed in phase warm_forward: RuntimeError: CUDA out of memory. Tried to "
            "allocate 2.00 GiB; no file written")
    assert worker_lines(proc) == [line, line], proc.stderr  # each rank printed it, rank 0 while blocked
    assert proc.returncode != 0
    # torchrun reports each worker's exit code: both ended with EXIT_PHASE
    assert proc.stderr.count("exitcode  : 3 ") == 2, proc.stderr
    assert not (tmp_path / "out.json").exists()
    # rank 0 did not wait for its blocked collective to time out (the worker's timeout_seconds=60)
    assert seconds < 60, seconds


def test_a_usage_error_on_rank_0_ends_every_rank_with_exit_2(tmp_path):
    proc, _ = torchrun(tmp_path, "usage-failure")
    line = ("worker: error: rank 0 failed outside the measured phases: out.json already exists; choose a new "
            "file name; no file written")
    assert worker_lines(proc) == [line, line], proc.stderr
    assert proc.stderr.count("exitcode  : 2 ") == 2, proc.stderr
    assert not (tmp_path / "out.json").exists()


def test_a_rank_that_vanishes_ends_the_others_in_bounded_time(tmp_path):
    proc, _ = torchrun(tmp_path, "vanish")
    seconds = seconds_since(tmp_path, "vanished-at")
    assert proc.returncode != 0
    assert "exitcode  : 9 " in proc.stderr, proc.stderr
    # rank 0, blocked in a collective, ends with one line: gloo sees the closed connection, or
    # torchrun stops it first
    lines = worker_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("worker: error: rank 0 "), proc.stderr
    assert lines[0].endswith("; no file written")
    # no wait for an acknowledgement that cannot come: from the vanish, gloo's closed connection or
    # torchrun's SIGTERM (which wakes the monitor and the acknowledgement wait at once) ends rank 0;
    # the wait itself would last FAILURE_ACK_SECONDS (20 s). Measured from the vanish to torchrun's own
    # end: 1.5 to 4.9 s with two busy-loop processes and other test suites on 2 cores, so the bound
    # holds with a margin of 4 while a rank that waited out the acknowledgement would still break it
    assert seconds < FAILURE_ACK_SECONDS, (seconds, proc.stderr)


def test_a_rank_busy_when_another_vanishes_is_stopped_by_torchrun_in_one_line(tmp_path):
    proc, _ = torchrun(tmp_path, "vanish-while-busy")
    seconds = seconds_since(tmp_path, "vanished-at")
    assert worker_lines(proc) == ["worker: error: rank 0 stopped by torchrun (another rank ended without "
                                  "reporting); no file written"], proc.stderr
    assert "exitcode  : 9 " in proc.stderr and "exitcode  : 143 " in proc.stderr, proc.stderr
    assert not (tmp_path / "out.json").exists()
    # stopped, not done sleeping: rank 0's 50 s sleep began before the vanish; the same bound as for a
    # rank blocked in a collective (its monitor wakes on torchrun's SIGTERM)
    assert seconds < FAILURE_ACK_SECONDS, (seconds, proc.stderr)


# ---------------------------------------------------------------- prediction per rank
def test_each_rank_holds_its_shard_and_the_whole_second_bias(mm):
    config = mm.MeasureConfig(width=64, hidden=256, dtype="float32", tensor_parallel=2)
    document = mm.predict(config)
    assert "phases" not in document and [r["rank"] for r in document["ranks"]] == [0, 1]
    for rank in document["ranks"]:
        load = rank["phases"][0]
        # 0.weight [128, 64], 0.bias [128], 2.weight [64, 128] in float32, 2.bias [64] rounded to 512 B
        assert load["end_allocated_bytes"] == 32768 + 512 + 32768 + 512 == 66560
        cold = rank["phases"][2]
        # weights, input [1, 16, 64], workspace 32 MiB + 1 MiB, output [1, 16, 64]
        assert cold["end_allocated_bytes"] == 66560 + 4096 + 33554432 + 1048576 + 4096
        # the first Linear's output [16, 128] and GELU's live together at the peak
        assert cold["peak_allocated_bytes"] == cold["end_allocated_bytes"] - 4096 + 8192 + 8192
    assert document["ranks"][0]["phases"] == document["ranks"][1]["phases"]
    shard = document["synthetic_model"]["tensor_parallel"]
    assert shard["rank_parameter_shapes"] == {"0.weight": [128, 64], "0.bias": [128], "2.weight": [64, 128],
                                              "2.bias": [64]}
    assert shard["all_reduce_bytes"] == 16 * 64 * 4
    assert shard["rank_forward_flops"] * 2 == document["synthetic_model"]["forward_flops"]
    assert document["configuration"]["tensor_parallel"] == 2
    assert document["outside_allocator"].startswith("not predicted")


def test_tensor_parallel_1_predicts_what_one_gpu_predicts(mm):
    one = mm.predict(mm.MeasureConfig(width=96, dtype="bfloat16", repeats=3))
    ranked = mm.predict(mm.MeasureConfig(width=96, dtype="bfloat16", repeats=3, tensor_parallel=1))
    assert ranked["ranks"] == [{"rank": 0, "phases": one["phases"]}]
    assert "tensor_parallel" not in one["configuration"] and "tensor_parallel" not in one["synthetic_model"]


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_a_shard_over_2_mib_takes_its_own_large_segment(mm, degree):
    # 0.weight is hidden x width floats: 4096 x 1024 x 4 B = 16 MiB whole, 16 / N MiB per rank
    config = mm.MeasureConfig(width=1024, hidden=4096, tensor_parallel=degree)
    load = mm.predict(config)["ranks"][degree - 1]["phases"][0]
    weight = 4096 // degree * 1024 * 4
    assert load["end_allocated_bytes"] == 2 * weight + 4096 // degree * 4 + 4096
    segment = weight if weight >= 10 * 2**20 else 20 * 2**20
    assert load["end_reserved_bytes"] >= segment


BAD_DEGREES = [
    (["--tensor-parallel", "3"], "--tensor-parallel 3 does not divide the hidden size 256"),
    (["--hidden", "100", "--tensor-parallel", "8"], "--tensor-parallel 8 does not divide the hidden size 100"),
    (["--tensor-parallel", "0"], "argument --tensor-parallel: must be > 0, got 0"),
    (["--tensor-parallel", "-1"], "argument --tensor-parallel: must be > 0, got -1"),
    (["--tensor-parallel", "abc"], "argument --tensor-parallel: not an integer: 'abc'"),
    (["--tensor-parallel", "65"], "argument --tensor-parallel: must be at most 64, got 65"),
    (["--tensor-parallel", "2.0"], "argument --tensor-parallel: not an integer: '2.0'"),
    (["--tensor-parallel", ""], "argument --tensor-parallel: not an integer: ''"),
]


def run_mm(*argv, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "lab_helpers.mesure_memoire", *argv], capture_output=True,
                          text=True, cwd=cwd or ROOT, env=env, timeout=120)


def one_line(proc, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    return lines[0]


@pytest.mark.parametrize("argv, message", BAD_DEGREES, ids=[" ".join(c[0]) for c in BAD_DEGREES])
def test_predict_refuses_a_bad_degree_in_one_line(argv, message):
    line = one_line(run_mm("predict", "--width", "64", *argv))
    assert line.startswith(f"mesure_memoire: error: {message}"), line


@pytest.fixture
def launcher_env(monkeypatch):
    import os
    env = {k: v for k, v in os.environ.items() if k not in (*GOOD_ENV, "MASTER_ADDR", "MASTER_PORT")}

    def make(**variables):
        return {**env, **variables}
    return make


def test_measure_refusals_are_one_line_and_leave_no_file(tmp_path, launcher_env):
    out = tmp_path / "tp.json"
    base = ["measure", "--width", "64", "--output", str(out)]
    cases = [
        (base + ["--tensor-parallel", "2"], launcher_env(),
         f"--tensor-parallel 2 runs one process per GPU, started by torchrun; run: torchrun --nproc-per-node 2 "
         f"-m lab_helpers.mesure_memoire measure --width 64 --output {out} --tensor-parallel 2"),
        (base + ["--tensor-parallel", "3"], launcher_env(), "--tensor-parallel 3 does not divide the hidden size 256"),
        (base + ["--tensor-parallel", "2", "--device", "cuda:1"], launcher_env(**GOOD_ENV),
         "--device is not used with --tensor-parallel 2: each rank measures on cuda:LOCAL_RANK"),
        (base + ["--tensor-parallel", "2"], launcher_env(**{**GOOD_ENV, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}),
         "--tensor-parallel 2 disagrees with the launcher's world size 4 (WORLD_SIZE)"),
        (base + ["--tensor-parallel", "2"], launcher_env(**{**GOOD_ENV, "RANK": "x"}),
         "the launcher's RANK not an integer: 'x'"),
        # a fake launcher on a machine whose torch sees no GPU: more ranks than GPUs
        (base + ["--tensor-parallel", "2"], launcher_env(**GOOD_ENV),
         "no CUDA device is visible to torch; --tensor-parallel 2 needs one GPU per rank"),
        (base + ["--tensor-parallel", "2", "--timeline", str(tmp_path / "t.json")], launcher_env(**GOOD_ENV),
         "--failure-report and the --timeline flags record one GPU; leave them out with --tensor-parallel"),
        (base + ["--tensor-parallel", "2", "--failure-report", str(tmp_path / "f.json")], launcher_env(**GOOD_ENV),
         "--failure-report and the --timeline flags record one GPU"),
    ]
    for argv, env, message in cases:
        line = one_line(run_mm(*argv, env=env))
        assert line.startswith(f"mesure_memoire: error: {message}"), (argv, line)
        assert list(tmp_path.iterdir()) == []


def test_the_script_copy_names_itself_in_the_command(tmp_path, launcher_env):
    import shutil
    shutil.copy(ROOT / "lab_helpers" / "mesure_memoire.py", tmp_path / "mesure_memoire.py")
    proc = subprocess.run([sys.executable, "mesure_memoire.py", "measure", "--tensor-parallel", "2", "--output",
                           "a b.json"], capture_output=True, text=True, cwd=tmp_path, env=launcher_env(), timeout=60)
    assert one_line(proc) == ("mesure_memoire: error: --tensor-parallel 2 runs one process per GPU, started by "
                              "torchrun; run: torchrun --nproc-per-node 2 mesure_memoire.py measure "
                              "--tensor-parallel 2 --output 'a b.json'")


# ---------------------------------------------------------------- compare per rank
def tp_measurement(mm, config, shift=None):
    """A schema-valid tensor-parallel measurement whose counters are `config`'s prediction (a
    fixture: no GPU made it); `shift` = (rank, record, bytes) added to that record's peak allocated."""
    document = mm.predict(config)
    for key in ("workspace", "reserved_assumptions", "outside_allocator", "budget"):  # a prediction's own
        document.pop(key, None)
    document["kind"] = "iteragpu-lab measurement"
    document["configuration"]["device"] = "cuda:0"
    document["environment"] = {
        "python_version": "3.12.3", "torch_version": "2.11.0+cu130", "cuda_build_version": "13.0",
        "hip_build_version": None, "runtime_note": "note", "device": "cuda:0", "device_count": 2,
        "device_visible": True, "device_name": "NVIDIA H200", "compute_capability": "9.0",
        "total_memory_bytes": 150754820096, "free_memory_bytes": 150000000000}
    for rank in document["ranks"]:
        rank.update(device=f"cuda:{rank['rank']}", device_name="NVIDIA H200",
                    outside_allocator={"label": "outside", "before_bytes": 150000000000, "after_bytes": 149000000000,
                                       "nccl_outside_allocator_bytes": 1000000000})
        for phase in rank["phases"]:
            del phase["end_allocated_bytes_by_kind"]
            phase.update(seconds=0.002, device_seconds=0.001)
    if shift:
        rank, record, extra = shift
        document["ranks"][rank]["phases"][record]["peak_allocated_bytes"] += extra
    return document


def test_compare_sets_every_rank_beside_its_prediction(mm):
    config = mm.MeasureConfig(width=64, tensor_parallel=2, repeats=3)
    document = tp_measurement(mm, config)
    assert mm.measurement_problems(document) == []
    result = mm.compare(document)
    assert result["allocated_exact"] is True and result["tensor_parallel"] == 2
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert [r["device"] for r in result["ranks"]] == ["cuda:0", "cuda:1"]
    assert all(len(r["rows"]) == 7 for r in result["ranks"])
    assert result["ranks"][1]["workspace_detected_bytes"] == 33554432 + 1048576
    shifted = mm.compare(tp_measurement(mm, config, shift=(1, 5, 512)))
    assert shifted["allocated_exact"] is False
    assert shifted["ranks"][0]["allocated_exact"] is True and shifted["ranks"][1]["allocated_exact"] is False
    assert shifted["ranks"][1]["rows"][5]["difference_peak_allocated_bytes"] == 512


def test_compare_cli_on_a_tensor_parallel_file(mm, tmp_path):
    config = mm.MeasureConfig(width=64, tensor_parallel=2)
    (tmp_path / "ok.json").write_text(json.dumps(tp_measurement(mm, config)))
    (tmp_path / "off.json").write_text(json.dumps(tp_measurement(mm, config, shift=(0, 2, 1024))))
    proc = run_mm("compare", str(tmp_path / "ok.json"), "--fail-on-difference", "--format", "table")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tensor parallel 2: allocated exact on every rank: yes\n")
    assert "rank 1 (cuda:1): NCCL outside the allocator 953.67 MiB (1000000000 B)" in proc.stdout
    proc = run_mm("compare", str(tmp_path / "off.json"), "--fail-on-difference")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["ranks"][0]["rows"][2]["difference_peak_allocated_bytes"] == 1024


def bad_tp_files(mm):
    config = mm.MeasureConfig(width=64, tensor_parallel=2)

    def changed(change):
        document = tp_measurement(mm, config)
        change(document)
        return document
    return [
        ("ranks-missing", changed(lambda d: d.pop("ranks")), "lacks the required key 'ranks'"),
        ("top-level-phases-too", changed(lambda d: d.update(phases=d["ranks"][0]["phases"])),
         "$.phases: is not allowed here"),
        ("one-rank-for-two", changed(lambda d: d["ranks"].pop()), "$.ranks: 1 ranks, but tensor_parallel is 2"),
        ("ranks-swapped", changed(lambda d: d["ranks"].reverse()),
         "$.ranks[0].rank: 1, but ranks are listed in order from 0"),
        ("rank-negative", changed(lambda d: d["ranks"][0].update(rank=-1)), "$.ranks[0].rank: must be at least 0"),
        ("rank-device-cpu", changed(lambda d: d["ranks"][1].update(device="cpu")), "$.ranks[1].device: does not match"),
        ("rank-phase-unknown", changed(lambda d: d["ranks"][1]["phases"][0].update(phase="prefill")),
         "$.ranks[1].phases[0].phase: must be one of"),
        ("rank-phase-missing", changed(lambda d: d["ranks"][1]["phases"].pop()),
         "$.ranks[1].phases: 5 records, but measure writes 6"),
        ("degree-zero", changed(lambda d: d["configuration"].update(tensor_parallel=0)),
         "$.configuration.tensor_parallel: must be at least 1"),
        ("degree-not-dividing", changed(lambda d: d["configuration"].update(tensor_parallel=3)),
         "--tensor-parallel 3 does not divide the hidden size 256"),
        ("one-gpu-file-with-ranks", changed(lambda d: (d["configuration"].pop("tensor_parallel"),
                                                       d.update(phases=d["ranks"][0]["phases"]))),
         "$.ranks: is not allowed here"),
        ("negative-counter", changed(lambda d: d["ranks"][0]["phases"][1].update(end_reserved_bytes=-1)),
         "$.ranks[0].phases[1].end_reserved_bytes: must be at least 0"),
    ]


def test_compare_refuses_bad_tensor_parallel_files_in_one_line(mm, tmp_path):
    from conftest import run_main_in_process
    from lab_helpers.mesure_memoire import main as mm_main
    for index, (name, document, message) in enumerate(bad_tp_files(mm)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        # the first file as a fresh `python -m`, the rest through the same main(argv) in this process
        proc = run_mm("compare", str(path)) if index == 0 else run_main_in_process(mm_main, ["compare", str(path)],
                                                                                    ROOT)
        line = one_line(proc)
        assert message in line, (name, line)


def test_schema_file_and_jsonschema_agree_on_tensor_parallel_files(mm):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "lab_helpers" / "measurement.schema.json").read_text(encoding="utf-8"))
    assert schema == json.loads(json.dumps(mm.MEASUREMENT_SCHEMA))
    validator = jsonschema.Draft202012Validator(schema)
    good = tp_measurement(mm, mm.MeasureConfig(width=64, tensor_parallel=2))
    assert validator.is_valid(good) and mm.measurement_problems(good) == []
    for name, document, _ in bad_tp_files(mm):
        if name in ("one-rank-for-two", "ranks-swapped", "rank-phase-missing", "degree-not-dividing"):
            continue  # rules compare checks beyond the schema
        assert not validator.is_valid(document), name
        assert mm.measurement_problems(document) != [], name



def test_a_degree_of_one_is_a_one_gpu_file_for_both_validators(mm):
    """configuration.tensor_parallel 1 (what a real-model RunSpec carries) is a one-GPU file: top-level
    phases, no ranks; from 2 on, ranks are required."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(json.dumps(mm.MEASUREMENT_SCHEMA)))
    one = tp_measurement(mm, mm.MeasureConfig(width=64, tensor_parallel=2))
    one["configuration"]["tensor_parallel"] = 1
    one["phases"] = one.pop("ranks")[0]["phases"]
    assert validator.is_valid(one) and mm.measurement_problems(one) == []
    one["configuration"]["tensor_parallel"] = 2
    assert not validator.is_valid(one) and mm.measurement_problems(one) != []


# ---------------------------------------------------------------- environment lists every GPU
def test_environment_lists_every_visible_gpu(mm, monkeypatch):
    torch = pytest.importorskip("torch")

    class Props:
        major, minor, total_memory = 9, 0, 150 * 2**30

        def __init__(self, index):
            self.name = f"Fake GPU {index}"

    def properties(index):
        if index == 2:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered at /opt/driver/x.c")
        return Props(index)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (100 * 2**30 + i, 150 * 2**30))

    def probe(index):
        if index == 1:
            return {"usable_memory_bytes": "unavailable", "usable_memory_unavailable_reason": "no answer within 180 s"}
        return {"usable_memory_bytes": 99 * 2**30 + index, "usable_memory_unavailable_reason": None}
    got = mm.environment("cuda:0", usable_memory_probe=probe)
    assert got["device_name"] == "Fake GPU 0" and got["usable_memory_bytes"] == 99 * 2**30
    assert got["devices"] == [
        {"index": 0, "name": "Fake GPU 0", "total_memory_bytes": 150 * 2**30, "free_memory_bytes": 100 * 2**30,
         "usable_memory_bytes": 99 * 2**30, "usable_memory_unavailable_reason": None},
        {"index": 1, "name": "Fake GPU 1", "total_memory_bytes": 150 * 2**30, "free_memory_bytes": 100 * 2**30 + 1,
         "usable_memory_bytes": "unavailable", "usable_memory_unavailable_reason": "no answer within 180 s"},
        {"index": 2, "unavailable_reason": "RuntimeError: CUDA error: uncorrectable ECC error encountered at <path>",
         "usable_memory_bytes": 99 * 2**30 + 2, "usable_memory_unavailable_reason": None},
    ]
    table = mm.environment_table(got).splitlines()
    assert table[-4:-3] == ["visible GPUs:"] or "visible GPUs:" in table
    assert [line.split(None, 1) for line in table if line.startswith(("total_memory_bytes", "usable_memory_bytes"))] == [
        ["total_memory_bytes", "150.00 GiB (161061273600 B)"], ["usable_memory_bytes", "99.00 GiB (106300440576 B)"]]
    rows = table[table.index("visible GPUs:") + 2:]
    assert [row.split()[0] for row in rows] == ["cuda:0", "cuda:1", "cuda:2"]
    assert "unavailable: no answer within 180 s" in rows[1]
    assert "unavailable: RuntimeError: CUDA error" in rows[2]
    skipped = mm.environment("cuda:1", usable_memory_figure=False, usable_memory_probe=probe)
    assert [d["usable_memory_bytes"] for d in skipped["devices"]] == [None, None, None]


def test_environment_without_gpu_lists_none(mm):
    got = mm.environment("cuda:0", usable_memory_figure=False)
    if got["device_count"]:
        pytest.skip("a GPU is visible: the gpu tests check the list")
    assert got["devices"] == []
    assert mm.environment_table(got).endswith("visible GPUs: none")


def test_runs_refuses_a_tensor_parallel_file_in_one_line(mm, tmp_path):
    (tmp_path / "tp.json").write_text(json.dumps(tp_measurement(mm, mm.MeasureConfig(width=64, tensor_parallel=2))))
    import os
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.runs", "tp.json"], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert one_line(proc) == ("runs: error: tp.json: a tensor-parallel measurement (phases per rank); runs compares "
                              "one-GPU files; set its ranks beside their prediction with: python -m "
                              "lab_helpers.mesure_memoire compare FILE")


@pytest.mark.parametrize("module, argv, attempts", [
    ("lab_helpers.mesure_memoire", ["measure", "--width", "64", "--tensor-parallel", "4"], 3),
    ("lab_helpers.real_model", ["measure", "--config", "llama-3.1-8b", "--batch", "1", "--context", "8",
                                "--new-tokens", "1", "--tensor-parallel", "4"], 1),
])
def test_every_rank_prints_its_own_line_for_a_bad_degree_despite_torchrun_stopping_them(tmp_path, module, argv,
                                                                                      attempts):
    """torchrun sends SIGTERM to the ranks still running once one has ended; each rank meets the same bad
    input and must still print its line and end with exit 2 (three runs of the standalone file: the race
    is not won by luck; real_model's ranks end through the same launch code, so one run shows its line)."""
    for attempt in range(attempts):
        out = tmp_path / f"out-{attempt}.json"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", module, *argv, "--output", str(out)],
                              capture_output=True, text=True, cwd=ROOT, timeout=240)
        prog = module.rsplit(".", 1)[1]
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{prog}: error: ")]
        assert proc.returncode != 0 and not out.exists()
        shown = "\n".join(line for line in proc.stderr.splitlines()
                           if "error" in line or "exitcode" in line or "signal" in line or not line.strip())
        assert len(lines) == 2 and lines[0] == lines[1] and "world size 2" in lines[0], shown[-3000:]
        assert "SIGTERM" not in proc.stderr.split("Root Cause")[-1] and "exitcode  : -15" not in proc.stderr, \
            proc.stderr[-3000:]
