"""A real sweep on the GPU, each point measured by mesure_memoire.py in a fresh process."""
import json

import pytest

from lab_helpers import sweep
from lab_helpers.mesure_memoire import MeasureConfig, predict

pytestmark = pytest.mark.gpu

VALUES = (1, 2, 4)
CONFIG = MeasureConfig(context=16, width=256, dtype="float32", warmup=1, repeats=2)
TINY_BUDGET_GIB = 2**-30  # one byte: no point can fit


def test_real_three_point_sweep_matches_the_prediction(tmp_path):
    out = tmp_path / "balayage-batch"
    rows = sweep.run_sweep("batch", out, values=list(VALUES), config=CONFIG, progress=False)
    assert [(r["value"], r["status"], r["reason"]) for r in rows] == [(v, "ok", "") for v in VALUES]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"batch-{v}.json" for v in VALUES] + ["summary.csv"])
    assert sweep.read_summary(out / "summary.csv") == rows
    for row in rows:
        document = json.loads((out / row["file"]).read_text(encoding="utf-8"))
        assert document["configuration"]["batch"] == row["value"]
        predicted = predict(MeasureConfig(**{**CONFIG.__dict__, "batch": row["value"]}))["phases"]
        assert row["measured_peak_allocated_bytes"] == row["predicted_peak_allocated_bytes"]
        assert row["predicted_peak_allocated_bytes"] == max(p["peak_allocated_bytes"] for p in predicted)
        assert [p["peak_allocated_bytes"] for p in document["phases"]] == [
            p["peak_allocated_bytes"] for p in predicted]
        assert row["measured_peak_reserved_bytes"] >= row["measured_peak_allocated_bytes"]


def test_tiny_budget_stops_before_running(tmp_path, capsys):
    out = tmp_path / "balayage-tiny"
    status = sweep.main(["--dimension", "batch", "--values", "1", "2", "--width", "256",
                         "--budget-gib", str(TINY_BUDGET_GIB), "--output-dir", str(out)])
    assert status == 0
    assert [p.name for p in out.iterdir()] == ["summary.csv"]
    (row,) = sweep.read_summary(out / "summary.csv")
    assert (row["value"], row["status"], row["file"]) == (1, "over_budget", "")
    assert row["measured_peak_allocated_bytes"] is None
    assert "largest batch measured that fit: none" in capsys.readouterr().out


def test_default_budget_is_the_free_device_memory():
    free = sweep.free_memory_bytes("cuda:0")
    assert free > 0
