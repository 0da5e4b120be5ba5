"""A real sweep on the GPU, each point measured by mesure_memoire.py in a fresh process."""
import re

import pytest

from lab_helpers.core.numbers import MIB
from lab_helpers.measurement.schema import read_measurement
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.predict import predict
from lab_helpers.views import sweep
from lab_helpers.views.sweep_commands import main

pytestmark = pytest.mark.gpu

VALUES = (1, 2, 4)
CONFIG = MeasureConfig(context=16, width=256, dtype="float32", warmup=1, repeats=2)
# about 1.1 GiB per batch on top of 1 GiB of weights: a few points reach an H200's memory
LARGE = MeasureConfig(context=8192, width=8192, dtype="bfloat16", warmup=0, repeats=1)
TINY_BUDGET_GIB = 2**-30  # one byte: no point can fit


def test_real_three_point_sweep_with_the_default_budget_matches_the_prediction(tmp_path):
    out = tmp_path / "balayage-batch"
    rows = sweep.run_sweep("batch", out, values=list(VALUES), config=CONFIG, progress=False)  # no budget given
    assert [(r["value"], r["stage"], r["status"], r["reason"]) for r in rows] == [
        (v, "sweep", "ok", "") for v in VALUES]
    assert sorted(p.name for p in out.iterdir()) == sorted([f"batch-{v}.json" for v in VALUES] + ["summary.csv"])
    assert sweep.read_summary(out / "summary.csv") == rows
    for row in rows:
        document = read_measurement(out / row["file"])
        assert document["configuration"]["batch"] == row["value"]
        predicted = predict(MeasureConfig(**{**document["configuration"]}))["phases"]
        assert [p["peak_allocated_bytes"] for p in document["phases"]] == [
            p["peak_allocated_bytes"] for p in predicted]
        assert row["measured_peak_allocated_bytes"] == row["predicted_peak_allocated_bytes"]
        assert row["measured_peak_reserved_bytes"] == row["predicted_peak_reserved_bytes"]


def test_tiny_budget_stops_before_running(tmp_path, capsys):
    out = tmp_path / "balayage-tiny"
    status = main(["--dimension", "batch", "--values", "1", "2", "--width", "256",
                   "--budget-gib", "0.000000000931322574615478515625", "--output-dir", str(out)])
    assert status == 0
    assert [p.name for p in out.iterdir()] == ["summary.csv"]
    (row,) = sweep.read_summary(out / "summary.csv")
    assert (row["value"], row["status"], row["file"]) == (1, "over_budget", "")
    assert row["measured_peak_allocated_bytes"] is None
    assert "largest batch measured that fit: none" in capsys.readouterr().out


def test_default_budget_is_the_usable_memory_and_the_predicted_limit_runs(tmp_path):
    """No --budget-gib: the sweep reads usable_memory_bytes, bisects on the prediction, and the largest
    value predicted to fit that budget really runs on the GPU, while the next one is refused."""
    report = sweep.read_environment(sweep.measuring_program(), "cuda:0")
    usable = report["usable_memory_bytes"]
    assert isinstance(usable, int) and 0 < usable <= report["total_memory_bytes"]
    out = tmp_path / "balayage-usable"
    rows = sweep.run_sweep("batch", out, start=1, maximum=1024, config=LARGE, bisect=True, progress=False)
    swept = [r for r in rows if r["stage"] == "sweep"]
    assert [r["status"] for r in swept[:-1]] == ["ok"] * (len(swept) - 1) and swept[-1]["status"] == "over_budget"
    budget = int(re.search(r"budget (\d+) bytes", swept[-1]["reason"]).group(1))
    assert abs(budget - usable) <= 256 * MIB  # the sweep's own probe of usable memory, not free memory
    for row in (r for r in rows if r["status"] == "ok"):
        assert row["measured_peak_allocated_bytes"] == row["predicted_peak_allocated_bytes"]
        assert row["measured_peak_reserved_bytes"] == row["predicted_peak_reserved_bytes"]
    best = sweep.largest_predicted_fit(LARGE, "batch", swept[-2]["value"], swept[-1]["value"], budget)
    confirm = [(r["value"], r["status"]) for r in rows if r["stage"] == "confirm"]
    assert confirm == [(best, "ok"), (best + 1, "over_budget")], rows[-1]["reason"]
    assert not [r for r in rows if r["stage"] == "bisect"]  # no measured probe was needed


def test_real_out_of_memory_is_read_from_the_failure_report(tmp_path, capsys):
    out = tmp_path / "balayage-oom"
    # a budget far above the device: the point runs, and the GPU refuses it
    status = main(["--dimension", "batch", "--values", "1", "512", "--context", "8192", "--width", "8192",
                   "--dtype", "bfloat16", "--warmup", "0", "--repeats", "1", "--budget-gib", "100000",
                   "--output-dir", str(out)])
    assert status == 0, capsys.readouterr().err
    rows = sweep.read_summary(out / "summary.csv")
    assert [(r["value"], r["status"]) for r in rows] == [(1, "ok"), (512, "oom")]
    assert re.match(r"phase \w+: OutOfMemoryError: ", rows[1]["reason"]), rows[1]["reason"]
    assert sorted(p.name for p in out.iterdir()) == ["batch-1.json", "summary.csv"]
