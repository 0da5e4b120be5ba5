"""CPU tests of the tensor-parallel side of mesure_memoire: the launcher's environment, the
coordination between ranks (gather, failure publication, the one-line message, bounded waits) over
gloo with real torchrun processes, and the synthetic network's prediction and comparison per rank.

Tests taking `mm` run on the library and on the notebook's copy; the multi-process tests run the
library under `python -m torch.distributed.run` (torchrun) with the gloo backend."""
import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT

GOOD_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
MEASURE_ARGV = ["-m", "lab_helpers.mesure_memoire", "measure", "--width", "64", "--tensor-parallel", "2",
                "--output", "tp.json"]


# ----------------------------------------------------------- the launcher's environment
def test_no_launcher_names_the_exact_command(mm):
    with pytest.raises(mm.LabError) as caught:
        mm.launch_info(2, MEASURE_ARGV, environ={})
    assert str(caught.value) == (
        "--tensor-parallel 2 runs one process per GPU, started by torchrun; run: torchrun --nproc-per-node 2 "
        "-m lab_helpers.mesure_memoire measure --width 64 --tensor-parallel 2 --output tp.json")


def test_launcher_command_quotes_an_argv_and_keeps_a_string(mm):
    assert mm.launcher_command(4, ["-m", "x", "--output", "a b.json"]) == \
        "torchrun --nproc-per-node 4 -m x --output 'a b.json'"
    assert mm.launcher_command(2, "-m x y") == "torchrun --nproc-per-node 2 -m x y"


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
    ("rank-negative", with_env(RANK="-1"), 2, "the launcher's RANK not an integer: '-1'"),
    ("world-size-empty", with_env(WORLD_SIZE=""), 2, "the launcher's WORLD_SIZE not an integer: ''"),
    ("world-size-float", with_env(WORLD_SIZE="2.0"), 2, "the launcher's WORLD_SIZE not an integer: '2.0'"),
    ("local-rank-arabic-digit", with_env(LOCAL_RANK="\u0661"), 2, "the launcher's LOCAL_RANK not an integer"),
    ("world-size-huge", with_env(WORLD_SIZE="9" * 2000), 2, "the launcher's WORLD_SIZE has 2000 characters"),
    ("world-size-mismatch", with_env(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4"), 2,
     "--tensor-parallel 2 disagrees with the launcher's world size 4 (WORLD_SIZE)"),
    ("world-size-mismatch-other-way", GOOD_ENV, 4,
     "--tensor-parallel 4 disagrees with the launcher's world size 2 (WORLD_SIZE)"),
    ("rank-equals-world-size", with_env(RANK="2"), 2, "the launcher's RANK 2 is not below its WORLD_SIZE 2"),
    ("rank-above-world-size", with_env(RANK="7"), 2, "the launcher's RANK 7 is not below its WORLD_SIZE 2"),
    ("local-rank-out-of-range", with_env(LOCAL_RANK="2"), 2,
     "the launcher's LOCAL_RANK 2 is not below its LOCAL_WORLD_SIZE 2"),
    ("local-world-size-zero", with_env(LOCAL_WORLD_SIZE="0"), 2,
     "the launcher's LOCAL_WORLD_SIZE 0 is not between 1 and its WORLD_SIZE 2"),
    ("local-world-size-above-world", with_env(LOCAL_WORLD_SIZE="3"), 2,
     "the launcher's LOCAL_WORLD_SIZE 3 is not between 1 and its WORLD_SIZE 2"),
    # a CPU build of torch sees no device: the last check refuses before any process group exists
    ("no-cuda-device", GOOD_ENV, 2, "no CUDA device is visible to torch; --tensor-parallel 2 needs one GPU per rank"),
]


@pytest.mark.parametrize("environ, degree, message", [c[1:] for c in BAD_ENVIRONMENTS],
                         ids=[c[0] for c in BAD_ENVIRONMENTS])
def test_bad_launcher_environment_is_one_line(mm, environ, degree, message):
    with pytest.raises(mm.LabError) as caught:
        mm.launch_info(degree, MEASURE_ARGV, environ=environ)
    text = str(caught.value)
    assert text.startswith(message), text
    assert "\n" not in text


@pytest.mark.parametrize("degree", [0, 65, "0", "-1", "abc", True, 2.0])
def test_launch_info_refuses_a_bad_degree(mm, degree):
    with pytest.raises(mm.LabError, match="--tensor-parallel"):
        mm.launch_info(degree, MEASURE_ARGV, environ=GOOD_ENV)


def test_more_ranks_than_gpus(mm, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(mm.LabError) as caught:
        mm.launch_info(2, MEASURE_ARGV, environ=GOOD_ENV)
    assert str(caught.value) == ("2 ranks on this machine (LOCAL_WORLD_SIZE) but 1 GPU(s) visible: one GPU per "
                                 "rank; lower --nproc-per-node and --tensor-parallel")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert mm.launch_info(2, MEASURE_ARGV, environ=GOOD_ENV) == mm.LaunchInfo(1, 2, 1, 2)
    assert mm.LaunchInfo(1, 2, 1, 2).device == "cuda:1"


def test_launcher_environment_reads_only_torchrun_variables(mm, monkeypatch):
    monkeypatch.setenv("HOME", "/home/canary")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    got = mm.launcher_environment()
    assert got["RANK"] == "0" and "HOME" not in got and "WORLD_SIZE" not in got
    assert set(got) <= set(mm.LAUNCHER_VARIABLES) | set(mm.STORE_VARIABLES)


# ---------------------------------------------------------------- ranks over gloo, under torchrun
WORKER = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import mesure_memoire as mm
import torch
import torch.distributed as dist

scenario, output = sys.argv[2], sys.argv[3]
env = mm.launcher_environment()
info = mm.LaunchInfo(*(int(env[name]) for name in mm.LAUNCHER_VARIABLES))
with mm.TensorParallelRun(info, "cpu", prog="worker", timeout_seconds=60) as run:
    assert (run.rank, run.world_size) == (info.rank, info.world_size)
    assert run.outside_allocator is None  # measured on a GPU only
    values = torch.full((4,), float(run.rank + 1))
    dist.all_reduce(values, group=run.group)
    if scenario == "phase-failure" and run.rank == 1:
        time.sleep(1.0)  # rank 0 is blocked in the collective below by then
        run.fail(mm.PhaseError("warm_forward", RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")))
    if scenario == "usage-failure" and run.rank == 0:
        raise mm.LabError("out.json already exists; choose a new file name")
    if scenario == "vanish" and run.rank == 1:
        time.sleep(1.0)
        os._exit(9)
    if scenario != "ok":
        dist.all_reduce(values, group=run.group)
    records = run.gather({"rank": run.rank, "sum": values.tolist()})
    shared = run.broadcast({"from": run.rank})
    assert shared == {"from": 0}, shared
    if run.rank == 0:
        mm.write_new_json(output, records)
    else:
        assert records is None
'''


def torchrun(tmp_path, scenario, ranks=2):
    (tmp_path / "worker.py").write_text(WORKER, encoding="utf-8")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), "worker.py", str(ROOT / "lab_helpers"), scenario, "out.json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=240)
    return proc, time.monotonic() - started


def worker_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("worker:")]


def test_gather_brings_every_rank_to_rank_0(tmp_path):
    proc, _ = torchrun(tmp_path, "ok", ranks=3)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "out.json").read_text())
    assert records == [{"rank": r, "sum": [6.0] * 4} for r in range(3)]
    assert worker_lines(proc) == []


def test_failure_on_one_rank_ends_every_rank_with_one_line(tmp_path):
    proc, seconds = torchrun(tmp_path, "phase-failure")
    line = ("worker: error: rank 1 failed in phase warm_forward: RuntimeError: CUDA out of memory. Tried to "
            "allocate 2.00 GiB; no file written")
    assert worker_lines(proc) == [line, line], proc.stderr  # each rank printed it, rank 0 while blocked
    assert proc.returncode != 0
    # torchrun reports each worker's exit code: both ended with EXIT_PHASE
    assert proc.stderr.count("exitcode  : 3 ") == 2, proc.stderr
    assert not (tmp_path / "out.json").exists()
    assert seconds < 60


def test_a_usage_error_on_rank_0_ends_every_rank_with_exit_2(tmp_path):
    proc, _ = torchrun(tmp_path, "usage-failure")
    line = ("worker: error: rank 0 failed outside the measured phases: out.json already exists; choose a new "
            "file name; no file written")
    assert worker_lines(proc) == [line, line], proc.stderr
    assert proc.stderr.count("exitcode  : 2 ") == 2, proc.stderr
    assert not (tmp_path / "out.json").exists()


def test_a_rank_that_vanishes_ends_the_others_in_bounded_time(tmp_path):
    proc, seconds = torchrun(tmp_path, "vanish")
    assert proc.returncode != 0
    assert "exitcode  : 9 " in proc.stderr, proc.stderr
    assert not (tmp_path / "out.json").exists()
    assert seconds < 60
