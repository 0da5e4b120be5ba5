"""Training measured on a CUDA GPU against its prediction (marker `gpu`): the synthetic network
(AdamW foreach, AdamW fused, SGD with momentum) and two layers of qwen1.5-0.5b (full fine-tuning,
AdamW, bfloat16 weights, with and without gradient checkpointing). Each run is measured in a fresh
process; each is a few seconds on the GPU.

    ITERAGPU_TEST_DEVICE=cuda:0 python3 -m pytest -o addopts= -m gpu tests/test_gpu_train.py

With ITERAGPU_REPORT_DIR set, every record's six counters (measured, predicted, difference) are
appended to train-acceptance.jsonl there."""
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

from lab_helpers.core.numbers import parse_device  # noqa: E402
from lab_helpers.real.train import compare_training_model  # noqa: E402
from lab_helpers.synthetic.training import compare_training  # noqa: E402

TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
if "CUDA_VISIBLE_DEVICES" in os.environ:
    CHILD_ENV, CHILD_DEVICE = dict(os.environ), TEST_DEVICE
else:
    CHILD_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": str(parse_device(TEST_DEVICE))}
    CHILD_DEVICE = "cuda:0"
COUNTERS = ("baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes", "end_reserved_bytes",
            "peak_allocated_bytes", "peak_reserved_bytes")


def report(row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "train-acceptance.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"device": TEST_DEVICE, **row}) + "\n")


def run(*argv):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True,
                          timeout=600)


def test_torch_defaults_to_foreach_for_adamw_and_sgd_on_cuda():
    # what the prediction assumes: torch.optim's default on CUDA for float parameters is foreach, not fused
    code = ("import torch; from torch.optim.optimizer import _default_to_fused_or_foreach as d; "
            "p = [torch.zeros(4, device='cuda', dtype=t) for t in (torch.float32, torch.bfloat16)]; "
            "print(d(p, False, use_fused=False))")
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(False, True)"


SYNTHETIC = [
    ((), ("--batch", "1", "--context", "16", "--width", "64")),
    (("--fused",), ("--batch", "1", "--context", "16", "--width", "64")),
    (("--optimizer", "sgd"), ("--batch", "1", "--context", "16", "--width", "64")),
    ((), ("--batch", "2", "--context", "32", "--width", "256", "--dtype", "bfloat16")),
]


@pytest.mark.parametrize("optimizer,sizes", SYNTHETIC)
def test_synthetic_training_is_exact_in_every_counter(tmp_path, optimizer, sizes):
    out = tmp_path / "train.json"
    proc = run("-m", "lab_helpers.mesure_memoire", "measure", "--task", "train", "--steps", "3", *optimizer, *sizes,
               "--device", CHILD_DEVICE, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    result = compare_training(json.loads(out.read_text()))
    for row in result["rows"]:
        report({"model": "synthetic", "flags": [*optimizer, *sizes], **row})
    differences = [(row["phase"], row["index"], key, row[f"difference_{key}"]) for row in result["rows"]
                   for key in COUNTERS if row[f"difference_{key}"]]
    assert differences == []


def _qwen_two_layers(tmp_path) -> Path:
    raw = json.loads((ROOT / "data/models/qwen1.5-0.5b.json").read_text())
    raw["num_hidden_layers"] = 2
    path = tmp_path / "qwen1.5-0.5b-2-layers.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("flags", [(), ("--gradient-checkpointing",)])
def test_two_layers_of_qwen_full_fine_tuning(tmp_path, flags):
    out = tmp_path / "train.json"
    proc = run("-m", "lab_helpers.real_model", "measure", "--task", "train", "--config", str(_qwen_two_layers(tmp_path)),
               "--dtype", "bfloat16", "--batch", "2", "--context", "64", "--steps", "2", *flags,
               "--device", CHILD_DEVICE, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    result = compare_training_model(json.loads(out.read_text()))
    for row in result["rows"]:
        report({"model": "qwen1.5-0.5b, 2 layers", "flags": list(flags), **row})
    for row in result["rows"]:
        where = f"{row['phase']} {row['index']}"
        # exact in all six counters on the H200 (2026-12-01), with and without checkpointing
        for key in COUNTERS:
            assert row[f"difference_{key}"] == 0, (where, key, row)


# Measured on the H200 (2026-12-01): allocated exact in every record; reserved 77594624 bytes above the
# prediction from backward 1 on, a segment the replay does not make: not yet explained, so not hidden.
@pytest.mark.xfail(strict=True, reason="LoRA's reserved is 77594624 bytes above the prediction from backward 1 on "
                                      "(H200, 2026-12-01); allocated is exact")
def test_two_layers_of_qwen_lora(tmp_path):
    # the GPU image has no peft of its own: install the wheel the lab pins (peft==0.21.2) first
    pytest.importorskip("peft", reason="peft is not installed (pip install peft==0.21.2): the LoRA run was NOT checked")
    out = tmp_path / "lora.json"
    proc = run("-m", "lab_helpers.real_model", "measure", "--task", "train", "--config", str(_qwen_two_layers(tmp_path)),
               "--dtype", "bfloat16", "--batch", "2", "--context", "64", "--steps", "2", "--train", "lora",
               "--lora-rank", "8", "--device", CHILD_DEVICE, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    result = compare_training_model(json.loads(out.read_text()))
    for row in result["rows"]:
        report({"model": "qwen1.5-0.5b, 2 layers", "flags": ["--train", "lora", "--lora-rank", "8"], **row})
    for row in result["rows"]:
        where = f"{row['phase']} {row['index']}"
        for key in COUNTERS:
            assert row[f"difference_{key}"] == 0, (where, key, row)
