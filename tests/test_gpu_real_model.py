"""Real transformers models measured on a CUDA GPU against their prediction (marker `gpu`).

Run from the repository root on the GPU machine:

    python3 -m pytest -m gpu tests/test_gpu_real_model.py -v

Each point is measured in a fresh process with `real_model measure`, then compared with
`predict`. Set ITERAGPU_REPORT_DIR to also write every difference (acceptance table) and
the out-of-memory boundaries there."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from lab_helpers import real_model  # noqa: E402
from lab_helpers.model_config import load_config  # noqa: E402

COUNTERS = real_model.COUNTER_KEYS
# (config, batch, context): four points per family, one of them at a context >= 32768
ACCEPTANCE = [
    ("llama-3.1-8b", 1, 512), ("llama-3.1-8b", 4, 2048), ("llama-3.1-8b", 8, 1000), ("llama-3.1-8b", 1, 32768),
    ("qwen2.5-7b", 1, 512), ("qwen2.5-7b", 4, 2048), ("qwen2.5-7b", 8, 1000), ("qwen2.5-7b", 1, 32768),
    ("qwen1.5-0.5b", 1, 512), ("qwen1.5-0.5b", 16, 2048), ("qwen1.5-0.5b", 32, 1000), ("qwen1.5-0.5b", 1, 32768),
]
NEW_TOKENS = 8


def report(name: str, row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        with open(Path(folder) / name, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


def measure(tmp_path, config, batch, context, new_tokens, every=1, name="m.json"):
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "lab_helpers.real_model", "measure", "--config", str(config), "--dtype", "bfloat16",
         "--batch", str(batch), "--context", str(context), "--new-tokens", str(new_tokens),
         "--decode-record-every", str(every), "--device", "cuda:0", "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.parametrize("config,batch,context", ACCEPTANCE)
def test_prediction_matches_measurement(tmp_path, config, batch, context):
    proc, out = measure(tmp_path, config, batch, context, NEW_TOKENS)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(out.read_text())
    result = real_model.compare_model(document)
    for row in result["rows"]:
        report("real-model-acceptance.jsonl", {"config": config, "batch": batch, "context": context, **row})
    for row in result["rows"]:
        where = f"{row['phase']} {row['index']}"
        for key in ("baseline_allocated_bytes", "end_allocated_bytes"):
            assert row[f"difference_{key}"] == 0, (where, key, row)
        peak = row["measured_peak_allocated_bytes"]
        assert abs(row["difference_peak_allocated_bytes"]) <= peak * 0.001, (where, row)
        reserved = row["measured_peak_reserved_bytes"]
        assert abs(row["difference_peak_reserved_bytes"]) <= reserved * 0.01, (where, row)


def test_measure_refuses_an_existing_file_and_writes_nothing_on_bad_input(tmp_path):
    existing = tmp_path / "taken.json"
    existing.write_text("keep")
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.real_model", "measure", "--config", "qwen1.5-0.5b",
                           "--batch", "1", "--context", "8", "--new-tokens", "1", "--output", str(existing)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and existing.read_text() == "keep"


def test_out_of_memory_exits_3_naming_the_phase_and_writes_no_file(tmp_path):
    proc, out = measure(tmp_path, "qwen1.5-0.5b", 2000, 32000, 1)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "phase prefill" in lines[0] and "OutOfMemoryError" in lines[0]
    assert not out.exists()


@pytest.fixture(scope="module")
def usable():
    value = real_model.usable_memory_bytes("cuda:0")
    report("real-model-boundaries.jsonl", {"usable_memory_bytes": value})
    return value


LLAMA_4_LAYERS = dict(json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text()), num_hidden_layers=4)
# (config, fixed dimension, its value, the dimension searched)
SWEEPS = [("qwen1.5-0.5b", "context", 4096, "batch"),
          ("qwen1.5-0.5b", "batch", 64, "context"),
          ("llama-3.1-8b-4-layers", "context", 8192, "batch")]


@pytest.mark.parametrize("config,fixed,value,searched", SWEEPS)
def test_fit_finds_the_measured_out_of_memory_boundary(tmp_path, usable, config, fixed, value, searched):
    if config == "llama-3.1-8b-4-layers":
        path = tmp_path / "llama-3.1-8b-4-layers.json"
        path.write_text(json.dumps(LLAMA_4_LAYERS))
        config = str(path)
    shape = load_config(config)
    sizes = {fixed: value}
    result = real_model.fit_model(shape, "bfloat16", 4, usable, "usable memory, measured", **sizes)
    largest = result[f"largest_{searched}_at_{fixed}"]
    assert largest > 0
    outcomes = {}
    for probe in (largest, largest + 1):
        point = {fixed: value, searched: probe}
        proc, out = measure(tmp_path, config, point["batch"], point["context"], 4, every=4, name=f"{probe}.json")
        outcomes[probe] = proc.returncode
        report("real-model-boundaries.jsonl", {"config": shape.name, **point, "predicted_largest": largest,
                                               "exit": proc.returncode, "stderr": proc.stderr.strip()[-300:]})
    assert outcomes == {largest: 0, largest + 1: 3}
