"""The synthetic network at tensor parallel 2 on two GPUs (marker `gpu`; skipped with fewer).

Each test starts `torchrun --nproc-per-node 2 -m lab_helpers.mesure_memoire measure
--tensor-parallel 2 ...` (as `python -m torch.distributed.run`), then sets every rank's phases
beside their prediction. With ITERAGPU_REPORT_DIR set, each run's measurement and comparison are
written there (tp-synthetic-NAME.json) for README's Validation section.

Run on the two-GPU machine: `python3 -m pytest -o addopts= -m gpu tests/test_gpu_tensor_parallel.py`."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from lab_helpers.measurement.schema import measurement_problems, read_measurement
from lab_helpers.synthetic.predict import compare

pytestmark = pytest.mark.gpu
PEAK_TOLERANCE = 0.001  # peaks within 0.1 % of the prediction
# name: (batch, context, width, hidden, dtype, warmup, repeats)
SIZES = {
    "small-float32": (1, 16, 64, 256, "float32", 1, 2),
    "seed-bfloat16-repeats": (2, 128, 1024, 4096, "bfloat16", 2, 4),
    # 0.weight and 2.weight shards of 4096 x 2048 float32 = 32 MiB each: segments of their own
    "large-segment-float32": (4, 512, 2048, 8192, "float32", 1, 2),
    "large-bfloat16": (8, 1024, 4096, 16384, "bfloat16", 2, 3),
}


def gpu_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif(gpu_count() < 2, reason="tensor parallel 2 needs two visible GPUs")


def torchrun_measure(out, batch, context, width, hidden, dtype, warmup, repeats, env=None, timeout=600):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "lab_helpers.mesure_memoire", "measure", "--batch", batch, "--context", context, "--width", width,
            "--hidden", hidden, "--dtype", dtype, "--warmup", warmup, "--repeats", repeats,
            "--tensor-parallel", "2", "--output", out]
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def report(name, document):
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        with open(os.path.join(folder, f"tp-synthetic-{name}.json"), "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)


@needs_two
@pytest.mark.parametrize("name", list(SIZES))
def test_every_rank_matches_its_prediction(name, tmp_path):
    batch, context, width, hidden, dtype, warmup, repeats = SIZES[name]
    out = tmp_path / f"{name}.json"
    proc = torchrun_measure(out, *SIZES[name])
    assert proc.returncode == 0, proc.stderr[-4000:]
    document = json.loads(out.read_text())
    assert measurement_problems(document) == []  # the schema's every rule, without jsonschema
    assert read_measurement(out) == document
    assert "phases" not in document and document["configuration"]["tensor_parallel"] == 2
    assert [r["rank"] for r in document["ranks"]] == [0, 1]
    assert [r["device"] for r in document["ranks"]] == ["cuda:0", "cuda:1"]
    result = compare(document)
    summary = {"name": name, "configuration": document["configuration"], "ranks": []}
    for rank, compared in zip(document["ranks"], result["ranks"]):
        outside = rank["outside_allocator"]
        assert outside["nccl_outside_allocator_bytes"] > 0, outside
        assert outside["before_bytes"] - outside["after_bytes"] >= outside["nccl_outside_allocator_bytes"]
        worst_peak = 0.0
        for row in compared["rows"]:
            for point in ("baseline", "end"):
                assert row[f"difference_{point}_allocated_bytes"] == 0, (rank["rank"], row)
            for counter in ("allocated", "reserved"):
                predicted = row[f"predicted_peak_{counter}_bytes"]
                relative = abs(row[f"difference_peak_{counter}_bytes"]) / predicted
                if counter == "allocated":
                    assert relative <= PEAK_TOLERANCE, (rank["rank"], row)
                    worst_peak = max(worst_peak, relative)
        summary["ranks"].append({
            "rank": rank["rank"], "device_name": rank["device_name"],
            "nccl_outside_allocator_bytes": outside["nccl_outside_allocator_bytes"],
            "allocated_exact": compared["allocated_exact"], "worst_peak_allocated_relative": worst_peak,
            "workspace_detected_bytes": compared["workspace_detected_bytes"],
            "reserved_differences_bytes": [
                {"phase": r["phase"], "index": r["index"], "end": r["difference_end_reserved_bytes"],
                 "peak": r["difference_peak_reserved_bytes"]} for r in compared["rows"]],
        })
    report(name, {"summary": summary, "measurement": document, "compare": result})
    assert result["allocated_exact"], json.dumps(summary)


FILLER = r"""
import sys, time, torch
device = torch.device("cuda", int(sys.argv[1]))
leave = int(sys.argv[2])
torch.cuda.set_device(device)
free = torch.cuda.mem_get_info(device)[0]
block = torch.empty(free - leave, dtype=torch.uint8, device=device)
torch.cuda.synchronize(device)
print("filled", block.numel(), flush=True)
time.sleep(600)
"""
LEFT_ON_GPU1_BYTES = 4 * 2**30  # room for rank 1's CUDA context, NCCL, weights and input, not the activations


@needs_two
def test_out_of_memory_on_rank_1_ends_every_rank_with_one_line(tmp_path):
    # the first Linear's output is 64 x 4096 tokens x 8192 features x 4 B = 8 GiB per rank
    filler = subprocess.Popen([sys.executable, "-c", FILLER, "1", str(LEFT_ON_GPU1_BYTES)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert filler.stdout.readline().startswith("filled"), filler.stderr.read()
        out = tmp_path / "never.json"
        started = time.monotonic()
        proc = torchrun_measure(out, 64, 4096, 256, 16384, "float32", 1, 2, timeout=300)
        seconds = time.monotonic() - started
    finally:
        filler.kill()
        filler.wait(timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mesure_memoire: error:")]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-4000:]
    assert lines[0].startswith("mesure_memoire: error: rank 1 failed in phase cold_forward: OutOfMemoryError"), lines
    assert lines[0].endswith("; no file written")
    assert proc.returncode != 0
    assert proc.stderr.count("exitcode  : 3 ") == 2, proc.stderr[-4000:]
    assert not out.exists()
    report("oom-rank-1", {"stderr_lines": lines, "torchrun_exit_code": proc.returncode, "seconds": seconds})


@needs_two
def test_environment_lists_both_gpus():
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.mesure_memoire", "environment"], capture_output=True,
                          text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert [d["index"] for d in got["devices"]] == list(range(got["device_count"]))
    for device in got["devices"]:
        assert device["total_memory_bytes"] >= device["free_memory_bytes"] > 0
        assert isinstance(device["usable_memory_bytes"], int), device
        assert device["usable_memory_bytes"] <= device["total_memory_bytes"]
    report("environment", got)
