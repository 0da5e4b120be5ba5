"""At the edge of the card, on a CUDA GPU (marker `gpu`): the point `fit` (or the synthetic
prediction) finds to be the largest that fits is measured and compared exactly, all six counters
of every record, under the budget the measurement recorded; the point one past it is measured to
fail and predicted, under that same budget, to fail in the same phase.

    ITERAGPU_TEST_DEVICE=cuda:0 python3 -m pytest -o addopts= -m gpu tests/test_gpu_edge.py

Each boundary is picked on the CPU (a prediction under the usable memory measured in a child
process), never by a search on the GPU: four real-model runs and two synthetic runs near the full
device, each about 10 to 30 s. With ITERAGPU_REPORT_DIR set, every figure is appended to
edge-budget.jsonl there."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from conftest import gpu_child_environment  # noqa: E402
from lab_helpers.allocator.budget import measured_budgets  # noqa: E402
from lab_helpers.allocator.model import DEFAULT_WORKSPACE_BYTES  # noqa: E402
from lab_helpers.real.config import load_config, parse_config  # noqa: E402
from lab_helpers.real.fit import fit_model  # noqa: E402
from lab_helpers.real.predict import budget_by_phase, compare_model, predict_model  # noqa: E402
from lab_helpers.real.spec import COUNTER_KEYS, RunSpec  # noqa: E402
from lab_helpers.synthetic.network import MeasureConfig  # noqa: E402
from lab_helpers.synthetic.predict import compare, predict, replay_under_budget  # noqa: E402

TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
CHILD_ENV, CHILD_DEVICE = gpu_child_environment(TEST_DEVICE)
NEW_TOKENS = 4
LLAMA_4_LAYERS = dict(json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text()), num_hidden_layers=4)
# (config, context): on the H200 (usable 149380136960) batch 192 / 193 and 100 / 101
REAL_BOUNDARIES = [("qwen1.5-0.5b", 4096), ("llama-3.1-8b-4-layers", 8192)]
FAILED = re.compile(r"phase (\w+)(?: (\d+))? failed: OutOfMemoryError")


def report(row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "edge-budget.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"device": TEST_DEVICE, **row}) + "\n")


@pytest.fixture(scope="module")
def real_usable():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from lab_helpers.real.fit import usable_memory_bytes; "
         "print(usable_memory_bytes(sys.argv[1]))", CHILD_DEVICE],
        cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().splitlines()[-1])


def run(argv, timeout=600):
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True,
                          timeout=timeout)


def failed_phase(stderr: str) -> tuple:
    found = FAILED.search(stderr)
    assert found, stderr
    return found.group(1), None if found.group(2) is None else int(found.group(2))


@pytest.mark.parametrize("config,context", REAL_BOUNDARIES)
def test_the_real_model_boundary_is_exact_and_the_next_point_fails_where_predicted(tmp_path, real_usable, config,
                                                                                   context):
    if config == "llama-3.1-8b-4-layers":
        path = tmp_path / "llama-3.1-8b-4-layers.json"
        path.write_text(json.dumps(LLAMA_4_LAYERS))
        shape, config = parse_config(LLAMA_4_LAYERS, "llama-3.1-8b-4-layers"), str(path)
    else:
        shape = load_config(config)
    largest = fit_model(shape, "bfloat16", NEW_TOKENS, real_usable, "usable memory, measured",
                        context=context)["largest_batch_at_context"]
    assert largest > 0
    outcomes = {}
    for batch in (largest, largest + 1):
        out = tmp_path / f"{batch}.json"
        proc = run(["lab_helpers.real_model", "measure", "--config", config, "--dtype", "bfloat16", "--batch",
                    str(batch), "--context", str(context), "--new-tokens", str(NEW_TOKENS), "--device", CHILD_DEVICE,
                    "--output", str(out)])
        outcomes[batch] = (proc.returncode, out if out.exists() else None, proc.stderr.strip()[-1500:])
    report({"config": shape.name, "context": context, "usable_memory_bytes": real_usable, "fit_largest": largest,
            "exits": {b: o[0] for b, o in outcomes.items()}, "stderr": outcomes[largest + 1][2]})
    code, path, stderr = outcomes[largest]
    assert code == 0, stderr
    document = json.loads(path.read_text())
    result = compare_model(document)
    report({"config": shape.name, "batch": largest, "compare": result})
    assert result["budget"]["replayed_under"] == "the measured budget of each phase"
    assert result["outcomes_agree"], result["budget"]
    for row in result["rows"]:
        for key in COUNTER_KEYS:
            assert row[f"difference_{key}"] == 0, (row["phase"], row["index"], key, row)
    code, path, stderr = outcomes[largest + 1]
    assert code == 3 and path is None, stderr
    phase = failed_phase(stderr)
    # one past the boundary, under the budgets the run that fitted recorded, phase by phase
    spec = RunSpec(shape.name, dtype="bfloat16", batch=largest + 1, context=context, new_tokens=NEW_TOKENS)
    budgets = budget_by_phase([measured_budgets(document["phases"])], spec)
    predicted = predict_model(shape, spec, phase_budget=budgets, report_out_of_memory=True)
    report({"config": shape.name, "batch": largest + 1, "measured_failure": phase,
            "predicted_out_of_memory": predicted.get("out_of_memory")})
    assert "out_of_memory" in predicted
    assert (predicted["out_of_memory"]["phase"], predicted["out_of_memory"]["index"]) == phase


# The synthetic network: a wide hidden layer and a narrow width, so that the device fills with
# activations at little compute (each forward takes well under a second).
SYNTHETIC = dict(context=4096, width=256, hidden=65536, dtype="bfloat16", warmup=1, repeats=1)


@pytest.fixture(scope="module")
def synthetic_usable():
    proc = run(["lab_helpers.mesure_memoire", "environment", "--device", CHILD_DEVICE], timeout=600)
    assert proc.returncode == 0, proc.stderr
    value = json.loads(proc.stdout)["usable_memory_bytes"]
    assert isinstance(value, int), proc.stdout
    return value


def largest_synthetic_batch(budget: int) -> int:
    """The largest batch predicted to fit `budget` (the prediction is monotone in the batch)."""
    def fits(batch):
        config = MeasureConfig(batch=batch, **SYNTHETIC)
        return "out_of_memory" not in predict(config, budget_bytes=budget)
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def test_the_synthetic_boundary_is_exact_and_the_next_point_fails_where_predicted(tmp_path, synthetic_usable):
    largest = largest_synthetic_batch(synthetic_usable)
    outcomes = {}
    for batch in (largest, largest + 1):
        out = tmp_path / f"{batch}.json"
        flags = [f"--{k}={v}" for k, v in SYNTHETIC.items()]
        proc = run(["lab_helpers.mesure_memoire", "measure", "--device", CHILD_DEVICE, "--batch", str(batch), *flags,
                    "--output", str(out)])
        outcomes[batch] = (proc.returncode, out if out.exists() else None, proc.stderr.strip()[-1500:])
    report({"synthetic": SYNTHETIC, "usable_memory_bytes": synthetic_usable, "predicted_largest": largest,
            "exits": {b: o[0] for b, o in outcomes.items()}, "stderr": outcomes[largest + 1][2]})
    code, path, stderr = outcomes[largest]
    assert code == 0, stderr
    document = json.loads(path.read_text())
    result = compare(document)
    report({"synthetic_batch": largest, "compare": result})
    assert result["budget"]["replayed_under"] == "the measured budget of each phase" and result["outcomes_agree"]
    for row in result["rows"]:
        for key in COUNTER_KEYS:
            assert row[f"difference_{key}"] == 0, (row["phase"], row["index"], key, row)
    code, path, stderr = outcomes[largest + 1]
    assert code == 3 and path is None, stderr
    phase = failed_phase(stderr)
    config = MeasureConfig(batch=largest + 1, **SYNTHETIC)
    replay = replay_under_budget(config, DEFAULT_WORKSPACE_BYTES, config.hidden_features,
                                 measured_budgets(document["phases"]))
    report({"synthetic_batch": largest + 1, "measured_failure": phase,
            "predicted_out_of_memory": replay.get("out_of_memory")})
    assert "out_of_memory" in replay
    assert (replay["out_of_memory"]["phase"], replay["out_of_memory"]["index"]) == phase
