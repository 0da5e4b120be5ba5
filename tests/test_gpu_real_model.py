"""Real transformers models measured on a CUDA GPU against their prediction (marker `gpu`).

Two groups, each on a GPU of its own (ITERAGPU_TEST_DEVICE, default cuda:0; the measuring
processes see only that GPU), so they can run at once on a two-GPU machine:

    ITERAGPU_TEST_DEVICE=cuda:0 python3 -m pytest -o addopts= -m gpu tests/test_gpu_real_model.py -k acceptance
    ITERAGPU_TEST_DEVICE=cuda:1 python3 -m pytest -o addopts= -m gpu tests/test_gpu_real_model.py -k boundary

Each point is measured in a fresh process with `real_model measure`, then compared with its
prediction. With ITERAGPU_REPORT_DIR set, every figure is appended there as JSON lines:
real-model-acceptance.jsonl (every record: the six counters measured, predicted and their
difference), real-model-measurements.jsonl (the measurement documents) and
real-model-boundaries.jsonl (usable memory, fit results, the measured boundary points)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from conftest import gpu_child_environment  # noqa: E402
from lab_helpers.real.config import load_config  # noqa: E402
from lab_helpers.real.fit import fit_model  # noqa: E402
from lab_helpers.real.predict import compare_model  # noqa: E402
from lab_helpers.real.spec import COUNTER_KEYS  # noqa: E402

COUNTERS = COUNTER_KEYS
TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
# The measuring processes see only the test's GPU: another group may be filling the other one.
CHILD_ENV, CHILD_DEVICE = gpu_child_environment(TEST_DEVICE)
# (config, batch, context): four points per family, one of them at a context >= 32768
ACCEPTANCE = [
    ("llama-3.1-8b", 1, 512), ("llama-3.1-8b", 4, 2048), ("llama-3.1-8b", 8, 1000), ("llama-3.1-8b", 1, 32768),
    ("qwen2.5-7b", 1, 512), ("qwen2.5-7b", 4, 2048), ("qwen2.5-7b", 8, 1000), ("qwen2.5-7b", 1, 32768),
    ("qwen1.5-0.5b", 1, 512), ("qwen1.5-0.5b", 16, 2048), ("qwen1.5-0.5b", 32, 1000), ("qwen1.5-0.5b", 1, 32768),
]
NEW_TOKENS = 4


def report(name: str, row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / name, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"device": TEST_DEVICE, **row}) + "\n")


def measure(tmp_path, config, batch, context, new_tokens, every=1, name="m.json"):
    out = tmp_path / name
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lab_helpers.real_model", "measure", "--config", str(config), "--dtype", "bfloat16",
         "--batch", str(batch), "--context", str(context), "--new-tokens", str(new_tokens),
         "--decode-record-every", str(every), "--device", CHILD_DEVICE, "--output", str(out),
         # the lab refuses a run past the config's positions unless told: these points run there on purpose
         *(["--beyond-positions"] if context + new_tokens > (load_config(str(config)).max_positions or 2**62) else [])],
        cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    report("real-model-measurements.jsonl", {
        "config": str(config), "batch": batch, "context": context, "new_tokens": new_tokens,
        "exit": proc.returncode, "stderr": proc.stderr.strip()[-1000:], "wall_seconds": time.perf_counter() - started,
        "document": json.loads(out.read_text()) if out.exists() else None})
    return proc, out


@pytest.mark.parametrize("config,batch,context", ACCEPTANCE)
def test_acceptance_prediction_matches_measurement(tmp_path, config, batch, context):
    proc, out = measure(tmp_path, config, batch, context, NEW_TOKENS)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(out.read_text())
    result = compare_model(document)
    for row in result["rows"]:
        report("real-model-acceptance.jsonl", {"config": config, "batch": batch, "context": context,
                                               "new_tokens": NEW_TOKENS, **row})
    for row in result["rows"]:
        where = f"{row['phase']} {row['index']}"
        for key in ("baseline_allocated_bytes", "end_allocated_bytes"):
            assert row[f"difference_{key}"] == 0, (where, key, row)
        peak = row["measured_peak_allocated_bytes"]
        assert abs(row["difference_peak_allocated_bytes"]) <= peak * 0.001, (where, row)
        reserved = row["measured_peak_reserved_bytes"]
        assert abs(row["difference_peak_reserved_bytes"]) <= reserved * 0.01, (where, row)


def test_acceptance_measure_refuses_an_existing_file_and_writes_nothing(tmp_path):
    existing = tmp_path / "taken.json"
    existing.write_text("keep")
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.real_model", "measure", "--config", "qwen1.5-0.5b",
                           "--batch", "1", "--context", "8", "--new-tokens", "1", "--device", CHILD_DEVICE,
                           "--output", str(existing)],
                          cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and existing.read_text() == "keep"
    assert len(proc.stderr.strip().splitlines()) == 1


def test_acceptance_out_of_memory_exits_3_naming_the_phase_and_writes_no_file(tmp_path):
    proc, out = measure(tmp_path, "qwen1.5-0.5b", 2000, 32000, 1)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "phase prefill" in lines[0] and "OutOfMemoryError" in lines[0]
    assert not out.exists()


@pytest.fixture(scope="module")
def usable():
    # in a child that sees only the test's GPU, as the measuring processes do
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from lab_helpers.real.fit import usable_memory_bytes; "
         "print(usable_memory_bytes(sys.argv[1]))", CHILD_DEVICE],
        cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    value = int(proc.stdout.strip().splitlines()[-1])
    report("real-model-boundaries.jsonl", {"usable_memory_bytes": value})
    return value


LLAMA_4_LAYERS = dict(json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text()), num_hidden_layers=4)
# (config, fixed dimension, its value, the dimension searched): small models, whose processes start fast
SWEEPS = [("qwen1.5-0.5b", "context", 4096, "batch"),
          ("qwen1.5-0.5b", "batch", 64, "context"),
          ("llama-3.1-8b-4-layers", "context", 8192, "batch")]


@pytest.mark.parametrize("config,fixed,value,searched", SWEEPS)
def test_boundary_fit_finds_the_measured_out_of_memory_boundary(tmp_path, usable, config, fixed, value, searched):
    if config == "llama-3.1-8b-4-layers":
        path = tmp_path / "llama-3.1-8b-4-layers.json"
        path.write_text(json.dumps(LLAMA_4_LAYERS))
        config = str(path)
    shape = load_config(config)
    started = time.perf_counter()
    result = fit_model(shape, "bfloat16", 4, usable, "usable memory, measured", **{fixed: value})
    report("real-model-boundaries.jsonl", {"config": shape.name, "fit": result,
                                           "fit_seconds": time.perf_counter() - started})
    largest = result[f"largest_{searched}_at_{fixed}"]
    assert largest > 0
    outcomes = {}
    for probe in (largest, largest + 1):
        point = {fixed: value, searched: probe}
        proc, out = measure(tmp_path, config, point["batch"], point["context"], 4, every=4, name=f"{probe}.json")
        outcomes[probe] = proc.returncode
        measured = json.loads(out.read_text()) if out.exists() else None
        report("real-model-boundaries.jsonl", {
            "config": shape.name, **point, "predicted_largest": largest, "exit": proc.returncode,
            "stderr": proc.stderr.strip()[-300:],
            "measured_peak_reserved_bytes": max(p["peak_reserved_bytes"] for p in measured["phases"]) if measured else None})
    assert outcomes == {largest: 0, largest + 1: 3}
