"""plots: tables and figures of a document with a measurement's layout (library and notebook copy)."""
import json

import matplotlib
import pytest

from conftest import full_measurement

matplotlib.use("Agg")

MIB = 2**20


def document(mm):
    return mm.predict(mm.MeasureConfig(batch=2, context=128, width=1024, repeats=2))


def test_phase_labels_and_table(mm, plots):
    doc = document(mm)
    table = plots.phase_table(doc)
    assert list(table.index) == ["model_load", "inputs", "cold_forward", "warmup", "warm_forward #0", "warm_forward #1"]
    assert list(table.columns) == [f"{point}_{counter}_mib" for counter in ("allocated", "reserved")
                                   for point in ("baseline", "end", "peak")]
    assert table.loc["model_load", "end_allocated_mib"] == 33574912 / MIB
    assert table.loc["cold_forward", "peak_reserved_mib"] == 88.0


def test_table_keeps_measured_times(mm, plots):
    doc = document(mm)
    for i, p in enumerate(doc["phases"]):
        p.update(seconds=0.5 + i, device_seconds=0.25 + i)
    table = plots.phase_table(doc)
    assert list(table["seconds"]) == [0.5 + i for i in range(6)]
    assert list(table["device_seconds"]) == [0.25 + i for i in range(6)]


def test_plot_phases_draws_three_bars_per_phase_and_counter(mm, plots):
    doc = document(mm)
    axes = plots.plot_phases(doc)
    for ax, counter in zip(axes, ("allocated", "reserved")):
        assert [c.get_label() for c in ax.containers] == ["baseline", "end", "peak"]
        heights = [bar.get_height() for bar in ax.containers[2]]
        assert heights == [p[f"peak_{counter}_bytes"] / MIB for p in doc["phases"]]
        assert ax.get_ylabel() == "MiB"
        assert [t.get_text() for t in ax.get_xticklabels()] == plots.phase_labels(doc["phases"])


def test_plot_prediction_marks_exact_and_differences(mm, plots):
    doc = document(mm)
    comparison = mm.compare(doc)
    comparison["rows"][-1]["difference_peak_allocated_bytes"] = 512
    ax = plots.plot_prediction(comparison)
    notes = [t.get_text() for t in ax.texts]
    assert notes == ["exact"] * 5 + ["+512 B"]
    assert len(ax.containers) == 4


def test_a_path_is_read_and_validated(mm, plots, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(full_measurement(mm, mm.MeasureConfig(batch=2, context=128, width=1024))))
    table = plots.phase_table(str(path))
    assert table.loc["cold_forward", "peak_reserved_mib"] == 88.0
    assert list(table["seconds"]) == [0.002] * 6
    axes = plots.plot_phases(path)
    assert [bar.get_height() for bar in axes[1].containers[2]][2] == 88.0
    bad = tmp_path / "bad.json"
    broken = json.loads(path.read_text())
    del broken["phases"][0]["index"]
    bad.write_text(json.dumps(broken))
    with pytest.raises(Exception, match=r"bad.json: \$.phases\[0\]: lacks the required key 'index'") as caught:
        plots.phase_table(str(bad))
    assert type(caught.value).__name__ == "LabError"  # the library's or the notebook's own class


def test_transformers_phases_plot_like_synthetic_ones(mm, plots):
    doc = full_measurement(mm, mm.MeasureConfig())
    doc["phases"] = doc["phases"][:5]
    for phase, (name, index) in zip(doc["phases"], [("model_load", None), ("inputs", None), ("prefill", None),
                                                    ("decode", 0), ("decode", 1)]):
        phase.update(phase=name, index=index)
    table = plots.phase_table(doc)
    assert list(table.index) == ["model_load", "inputs", "prefill", "decode #0", "decode #1"]
