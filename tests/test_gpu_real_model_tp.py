"""Real transformers models split across two GPUs with transformers' tensor-parallel plan,
measured under torchrun against the per-rank prediction (marker `gpu`; needs 2 CUDA GPUs):

    python3 -m pytest -o addopts= -m gpu tests/test_gpu_real_model_tp.py

Each point is measured by `torchrun --nproc-per-node 2 -m lab_helpers.real_model measure
--tensor-parallel 2`, which writes one file (rank 0, after both ranks finished), then compared
with its prediction on the CPU (every rank traced on meta under the fake process-group backend).
With ITERAGPU_REPORT_DIR set, every row (rank, phase, the six counters measured, predicted and
their difference) goes to real-model-tp-acceptance.jsonl, the documents to
real-model-tp-measurements.jsonl, and NCCL's bytes outside the allocator per rank with them.
Time on two H200s, estimated: the small model under a minute; each 70B point about 1 to 2
minutes (random init of one rank's 72 GB, a 32768- or 65536-token prefill, both ranks
predicted on the CPU, about 10 s each): about 5 minutes in all."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs"),
              pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun on PATH")]

from lab_helpers.real.config import load_config  # noqa: E402
from lab_helpers.real.fit import fits_at_degree, gpu_budget  # noqa: E402
from lab_helpers.real.predict import compare_model  # noqa: E402
from lab_helpers.real.spec import COUNTER_KEYS, RunSpec  # noqa: E402

NEW_TOKENS = 4
# a 4-layer llama of llama-3.1-8b's widths: fast to start, every split of the plan exercised
LLAMA_4_LAYERS = dict(json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text()), num_hidden_layers=4)


def report(name: str, row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / name, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


def torchrun(*argv, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run(["torchrun", "--nproc-per-node", "2", "-m", "lab_helpers.real_model", *map(str, argv)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def measure_and_compare(tmp_path, config, batch, context):
    out = tmp_path / "m.json"
    started = time.perf_counter()
    proc = torchrun("measure", "--config", config, "--batch", batch, "--context", context,
                    "--new-tokens", NEW_TOKENS, "--tensor-parallel", 2, "--output", out)
    wall = time.perf_counter() - started
    document = json.loads(out.read_text()) if out.exists() else None
    report("real-model-tp-measurements.jsonl", {"config": str(config), "batch": batch, "context": context,
                                                "exit": proc.returncode, "stderr": proc.stderr.strip()[-2000:],
                                                "wall_seconds": wall, "document": document})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["rank"] for r in document["ranks"]] == [0, 1] and "phases" not in document
    assert document["configuration"]["tensor_parallel"] == 2
    started = time.perf_counter()
    result = compare_model(document)
    predict_seconds = time.perf_counter() - started
    for row in result["rows"]:
        report("real-model-tp-acceptance.jsonl", {"config": str(config), "batch": batch, "context": context,
                                                  "new_tokens": NEW_TOKENS, **row})
    report("real-model-tp-acceptance.jsonl", {
        "config": str(config), "batch": batch, "context": context, "measure_wall_seconds": wall,
        "predict_both_ranks_seconds": predict_seconds,
        "nccl_outside_allocator_bytes": result["nccl_outside_allocator_bytes"],
        "peak_allocated_worst_relative": result["peak_allocated_worst_relative"],
        "peak_reserved_worst_relative": result["peak_reserved_worst_relative"]})
    return document, result


def check(result, peak_reserved_tolerance=0.01):
    assert len(result["nccl_outside_allocator_bytes"]) == 2
    assert all(isinstance(b, int) and b > 0 for b in result["nccl_outside_allocator_bytes"]), result
    for row in result["rows"]:
        where = f"rank {row['rank']} {row['phase']} {row['index']}"
        for key in ("baseline_allocated_bytes", "end_allocated_bytes"):
            assert row[f"difference_{key}"] == 0, (where, key, row)
        peak = row["measured_peak_allocated_bytes"]
        assert abs(row["difference_peak_allocated_bytes"]) <= peak * 0.001, (where, row)
        reserved = row["measured_peak_reserved_bytes"]
        assert abs(row["difference_peak_reserved_bytes"]) <= reserved * peak_reserved_tolerance, (where, row)


def test_small_llama_at_tp2_every_rank_exact(tmp_path):
    path = tmp_path / "llama-4-layers.json"
    path.write_text(json.dumps(LLAMA_4_LAYERS))
    _, result = measure_and_compare(tmp_path, path, 2, 1024)
    check(result)
    for row in result["rows"]:  # a small model: every counter, reserved too, exact
        for key in COUNTER_KEYS:
            assert row[f"difference_{key}"] == 0, (row["rank"], row["phase"], row["index"], key, row)


@pytest.mark.parametrize("context", [32768, 65536])
def test_acceptance_70b_at_tp2_beyond_one_h200(tmp_path, context):
    shape = load_config("llama-3.1-70b")
    spec = RunSpec("llama-3.1-70b", batch=1, context=context, new_tokens=NEW_TOKENS)
    one, _ = gpu_budget("h200-sxm")
    assert fits_at_degree(shape, spec, 1, one)["fits"] is False  # needs the second GPU
    _, result = measure_and_compare(tmp_path, "llama-3.1-70b", 1, context)
    check(result)


def test_a_degree_other_than_the_world_size_is_one_line_exit_2_on_every_rank(tmp_path):
    out = tmp_path / "m.json"
    proc = torchrun("measure", "--config", "llama-3.1-8b", "--batch", 1, "--context", 8, "--new-tokens", 1,
                    "--tensor-parallel", 4, "--output", out, timeout=300)
    assert proc.returncode != 0 and not out.exists()
    lines = [line for line in proc.stderr.splitlines() if line.startswith("real_model: error: ")]
    assert len(lines) == 2 and all("world size 2" in line for line in lines), proc.stderr[-3000:]


def test_an_existing_output_is_kept_and_every_rank_ends(tmp_path):
    existing = tmp_path / "taken.json"
    existing.write_text("keep")
    proc = torchrun("measure", "--config", "llama-3.1-8b", "--batch", 1, "--context", 8, "--new-tokens", 1,
                    "--tensor-parallel", 2, "--output", existing, timeout=300)
    assert proc.returncode != 0 and existing.read_text() == "keep"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("real_model: error: ")]
    assert len(lines) == 2 and all("rank 0" in line for line in lines), proc.stderr[-3000:]


HOG = r"""
import sys, torch
free, _ = torch.cuda.mem_get_info(1)
hog = torch.empty(free - 4 * 2**30, dtype=torch.uint8, device="cuda:1")  # leave 4 GiB on GPU 1
print("ready", flush=True)
sys.stdin.read()
"""


def test_out_of_memory_on_rank_1_only_ends_both_ranks_naming_it_and_writes_no_file(tmp_path):
    """Another process fills GPU 1 but 4 GiB: rank 1 cannot hold its half of an 8B model (8 GB),
    rank 0 can; both ranks end with one line naming rank 1 and model_load, and no file exists."""
    hog = subprocess.Popen([sys.executable, "-c", HOG], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert hog.stdout.readline().strip() == "ready"
        out = tmp_path / "m.json"
        proc = torchrun("measure", "--config", "llama-3.1-8b", "--batch", 1, "--context", 128, "--new-tokens", 1,
                        "--tensor-parallel", 2, "--output", out, timeout=300)
    finally:
        hog.stdin.close()
        hog.wait(timeout=60)
    report("real-model-tp-measurements.jsonl", {"test": "out of memory on rank 1", "exit": proc.returncode,
                                                "stderr": proc.stderr.strip()[-3000:]})
    assert proc.returncode != 0 and not out.exists()
    lines = [line for line in proc.stderr.splitlines() if line.startswith("real_model: error: ")]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]
    assert "rank 1 failed in phase model_load" in lines[0] and "no file written" in lines[0]
