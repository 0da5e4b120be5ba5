"""Measured under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on a CUDA GPU against the prediction
of the expandable-segments model (marker `gpu`): every counter of every record, allocated and
reserved, to the byte.

    python3 -m pytest -o addopts= -m gpu tests/test_gpu_expandable.py -k "not boundary"   # about a minute
    python3 -m pytest -o addopts= -m gpu tests/test_gpu_expandable.py -k boundary         # a near-full run

Each point is measured in a fresh process (the setting must be in force before CUDA starts), with
--allocator-conf, and once with the variable in the environment instead. With ITERAGPU_REPORT_DIR set,
every row (measured, predicted, difference) is appended to expandable-acceptance.jsonl there.

The `fit` check: the allocator's true limit is the device, so a budget passed with --memory-bytes
cannot be checked without filling the GPU (a memory fraction is not the same limit: PyTorch checks it
against its own sizing, before any page is mapped). The cheapest honest check is one small model at
one fixed context: `fit` under the setting with the GPU's measured usable memory, then the largest
batch it finds measured (must run) and one more (must fail with exit 3, out of memory), both under
the setting."""
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
from lab_helpers.measurement.schema import read_measurement  # noqa: E402
from lab_helpers.real.config import load_config  # noqa: E402
from lab_helpers.real.fit import fit_model  # noqa: E402
from lab_helpers.real.predict import compare_model  # noqa: E402
from lab_helpers.allocator.settings import AllocatorSettings  # noqa: E402
from lab_helpers.synthetic.predict import compare  # noqa: E402

CONF = "expandable_segments:True"
TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
BASE_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
CHILD_ENV, CHILD_DEVICE = gpu_child_environment(TEST_DEVICE, BASE_ENV)
LLAMA_4_LAYERS = dict(json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text()), num_hidden_layers=4)


def report(row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "expandable-acceptance.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"device": TEST_DEVICE, **row}) + "\n")


def run(module, argv, from_environment=False):
    env = {**CHILD_ENV, "PYTORCH_CUDA_ALLOC_CONF": CONF} if from_environment else CHILD_ENV
    flag = [] if from_environment else ["--allocator-conf", CONF]
    return subprocess.run([sys.executable, "-m", module, *argv, *flag], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def assert_every_counter_exact(rows, what):
    differences = [(row.get("rank"), row["phase"], row["index"], key, row[key])
                   for row in rows for key in row if key.startswith("difference_") and row[key] != 0]
    for row in rows:
        report({"what": what, **row})
    assert differences == [], differences


SYNTHETIC = [("--batch", "2", "--context", "128", "--width", "1024", "--dtype", "bfloat16"),
             ("--batch", "4", "--context", "512", "--width", "4096", "--dtype", "bfloat16", "--repeats", "3"),
             ("--batch", "1", "--context", "16", "--width", "64", "--dtype", "float32")]


@pytest.mark.parametrize("sizes", SYNTHETIC, ids=["small", "large", "tiny"])
@pytest.mark.parametrize("from_environment", [False, True], ids=["flag", "environment"])
def test_synthetic_network_is_exact_in_every_record(tmp_path, sizes, from_environment):
    out = tmp_path / "m.json"
    proc = run("lab_helpers.mesure_memoire", ["measure", "--device", CHILD_DEVICE, *sizes, "--output", str(out)],
               from_environment)
    assert proc.returncode == 0, proc.stderr
    document = read_measurement(str(out))
    assert document["environment"]["pytorch_cuda_alloc_conf"] == CONF
    result = compare(document)
    assert result["allocator_conf"] == CONF
    assert_every_counter_exact(result["rows"], f"synthetic {' '.join(sizes)}")


REAL = [("qwen1.5-0.5b", 1, 512), ("qwen1.5-0.5b", 8, 1000), ("llama-3.1-8b-4-layers", 1, 512),
        ("llama-3.1-8b-4-layers", 4, 2048)]


def config_path(tmp_path, config):
    if config != "llama-3.1-8b-4-layers":
        return config
    path = tmp_path / "llama-3.1-8b-4-layers.json"
    path.write_text(json.dumps(LLAMA_4_LAYERS))
    return str(path)


def measure_model(tmp_path, config, batch, context, from_environment=False, name="m.json"):
    out = tmp_path / name
    proc = run("lab_helpers.real_model", ["measure", "--config", config, "--dtype", "bfloat16", "--batch", str(batch),
                                          "--context", str(context), "--new-tokens", "4", "--device", CHILD_DEVICE,
                                          "--output", str(out)], from_environment)
    return proc, out


@pytest.mark.parametrize("config,batch,context", REAL)
def test_real_models_are_exact_in_every_record(tmp_path, config, batch, context):
    proc, out = measure_model(tmp_path, config_path(tmp_path, config), batch, context)
    assert proc.returncode == 0, proc.stderr
    document = read_measurement(str(out))
    assert document["environment"]["pytorch_cuda_alloc_conf"] == CONF
    result = compare_model(document)
    assert result["allocator_conf"] == CONF
    assert_every_counter_exact(result["rows"], f"{config} batch {batch} context {context}")


def test_real_model_reads_the_setting_from_the_environment(tmp_path):
    proc, out = measure_model(tmp_path, "qwen1.5-0.5b", 2, 256, from_environment=True)
    assert proc.returncode == 0, proc.stderr
    result = compare_model(read_measurement(str(out)))
    assert result["allocator_conf"] == CONF
    assert_every_counter_exact(result["rows"], "qwen1.5-0.5b batch 2 context 256, from the environment")


def test_boundary_fit_under_expandable_segments_finds_the_measured_boundary(tmp_path):
    # the usable memory of a fresh process, measured under PyTorch's defaults (a cudaMalloc of whole
    # 2 MiB steps): the physical bytes are the same ones that expandable segments map in pages
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from lab_helpers.real.fit import usable_memory_bytes; "
         "print(usable_memory_bytes(sys.argv[1]))", CHILD_DEVICE],
        cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr
    usable = int(probe.stdout.strip().splitlines()[-1])
    shape = load_config("qwen1.5-0.5b")
    result = fit_model(shape, "bfloat16", 4, usable, "usable memory, measured", context=4096,
                       allocator=AllocatorSettings(expandable_segments=True))
    largest = result["largest_batch_at_context"]
    report({"what": "fit boundary", "usable_memory_bytes": usable, "fit": result})
    assert largest > 0 and result["allocator_conf"] == CONF
    outcomes = {}
    for batch in (largest, largest + 1):
        proc, out = measure_model(tmp_path, "qwen1.5-0.5b", batch, 4096, name=f"{batch}.json")
        outcomes[batch] = proc.returncode
        report({"what": "fit boundary point", "batch": batch, "exit": proc.returncode,
                "stderr": proc.stderr.strip()[-300:],
                "measured_peak_reserved_bytes": (max(p["peak_reserved_bytes"] for p in read_measurement(str(out))["phases"])
                                                 if out.exists() else None)})
    assert outcomes == {largest: 0, largest + 1: 3}
