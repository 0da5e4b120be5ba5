"""`real_model measure --timeline` on a CUDA GPU (marker `gpu`; skipped without one).

    ITERAGPU_TEST_DEVICE=cuda:0 python3 -m pytest -o addopts= -m gpu tests/test_gpu_real_model_timeline.py

A 2-layer llama-shaped model written to a temporary config.json is measured in a fresh process
that sees only the test's GPU; its timeline's per-phase figures must equal the measurement's."""
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

from conftest import gpu_child_environment  # noqa: E402
from lab_helpers.allocator.history import OOM_SNAPSHOT_KIND  # noqa: E402
from lab_helpers.views import timeline as tl  # noqa: E402
from lab_helpers.real.config import load_config  # noqa: E402

TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
CHILD_ENV, CHILD_DEVICE = gpu_child_environment(TEST_DEVICE)
SMALL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
         "tie_word_embeddings": False}
# embeddings, 2 x (q, k, v, o, gate, up, down, 2 norms), the final norm, the LM head
SMALL_PARAMETERS = 1 + 2 * 9 + 1 + 1
CONTEXT, NEW_TOKENS = 256, 2
# a prompt of 16 x (2**22 - 1) tokens: its hidden states alone, 16 x (2**22 - 1) x 4096 x 2 bytes
# (about 512 GiB), are more than any GPU holds, so the prefill runs out of memory at once
WIDE = {**SMALL, "hidden_size": 4096, "intermediate_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 2**22}
WIDE_BATCH, WIDE_CONTEXT = 16, 2**22 - 1
WIDE_HIDDEN_BYTES = WIDE_BATCH * WIDE_CONTEXT * 4096 * 2


def config_file(tmp_path, document) -> Path:
    path = tmp_path / "config" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(document))
    return path


def measure(config, batch, context, new_tokens, folder, *flags):
    folder.mkdir()
    return subprocess.run(
        [sys.executable, "-m", "lab_helpers.real_model", "measure", "--config", str(config), "--dtype", "bfloat16",
         "--batch", str(batch), "--context", str(context), "--new-tokens", str(new_tokens), "--device", CHILD_DEVICE,
         "--output", str(folder / "m.json"), "--timeline", str(folder / "t.json"), *flags],
        cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=300)


def timeline_command(*argv):
    return subprocess.run([sys.executable, "-m", "lab_helpers.timeline", *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_real_model_timeline_peaks_equal_the_measurement_in_every_phase(tmp_path):
    config = config_file(tmp_path, SMALL)
    out = tmp_path / "out"
    proc = measure(config, 1, CONTEXT, NEW_TOKENS, out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["m.json", "t.json"]
    assert json.loads(proc.stdout)["timeline_events"] > 0
    measurement = json.loads((out / "m.json").read_text())
    timeline = tl.load_timeline(out / "t.json")
    peaks = tl.phase_peaks(timeline)
    assert [(p["phase"], p["index"]) for p in measurement["phases"]] == [
        ("model_load", None), ("inputs", None), ("prefill", None), ("decode", 0), ("decode", 1)]
    assert [(p["phase"], p["index"]) for p in peaks] == [(p["phase"], p["index"]) for p in measurement["phases"]]
    for got, want in zip(peaks, measurement["phases"]):
        assert got["peak_allocated_bytes"] == want["peak_allocated_bytes"], (got, want)
        assert got["end_allocated_bytes"] == want["end_allocated_bytes"], (got, want)
    events = timeline["events"]
    labelled = {}
    for size, label in zip(events["size_bytes"], events["label"]):
        if label:
            labelled.setdefault(label, []).append(size)
    # every tensor here is a multiple of 512 bytes, the allocator's block size, so the sizes are exact
    assert len(labelled["weights"]) == SMALL_PARAMETERS
    assert sum(labelled["weights"]) == measurement["model"]["parameter_bytes"]
    assert labelled["inputs"] == [CONTEXT * 8]  # one int64 token id per position
    shape = load_config(str(config))
    assert len(labelled["kv_cache"]) == 2 * SMALL["num_hidden_layers"]  # keys and values of each layer
    assert sum(labelled["kv_cache"]) == shape.kv_cache_bytes(1, CONTEXT + NEW_TOKENS, "bfloat16")
    # the math libraries' workspaces: allocated in the first forward pass, never released
    prefill = next(p for p in measurement["phases"] if p["phase"] == "prefill")
    assert 0 < sum(labelled.get("workspace", [])) <= prefill["end_allocated_bytes"]
    proc = timeline_command("plot", out / "t.json", "--output", tmp_path / "t.png")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_model_out_of_memory_with_timeline_saves_only_the_snapshot(tmp_path):
    out = tmp_path / "out"
    proc = measure(config_file(tmp_path, WIDE), WIDE_BATCH, WIDE_CONTEXT, 1, out)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("\n") == 1 and "phase prefill failed" in proc.stderr, proc.stderr
    assert proc.stderr.endswith(f"no file written; out-of-memory snapshot: {out / 't.oom.json'}\n"), proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["t.oom.json"]
    document = json.loads((out / "t.oom.json").read_text())
    assert document["kind"] == OOM_SNAPSHOT_KIND and document["phase"] == "prefill"
    assert document["snapshot_source"] == "observer", document.get("observer_problem")
    assert document["failed_request_bytes"] >= WIDE_HIDDEN_BYTES > document["device_free_bytes"]
    proc = timeline_command("explain", out / "t.oom.json", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["request_bytes"] == document["failed_request_bytes"]
