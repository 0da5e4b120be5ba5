"""plots: tables and figures of a document with a measurement's layout (library and notebook copy)."""
import json
import types

import matplotlib
import pytest

from conftest import ROOT, full_measurement
from lab_helpers.build.bundle import closure, section_code

matplotlib.use("Agg")

MIB = 2**20


def notebook_module(roots, name="notebook_cells"):
    """What a notebook's kernel defines once its generated cells for `roots` have run: the bundler's
    sections (each module `roots` need, package imports dropped) executed in one namespace."""
    module = types.ModuleType(name)
    for index, source in enumerate(closure(list(roots))):
        code = section_code(source, notebook=True)[1]
        exec(compile(code, f"/tmp/ipykernel_0/cell-{index}-{name}.py", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module", params=("library", "notebook"))
def plots(request):
    """The plots module: the library's, or the notebook's copy of it (its generated cells)."""
    if request.param == "library":
        from lab_helpers.views import plots as library_plots
        return library_plots
    return notebook_module(["lab_helpers/views/plots.py"])


@pytest.fixture(autouse=True)
def close_figures():
    """pyplot keeps every figure a plot function opens: close them after each test."""
    yield
    import matplotlib.pyplot as plt
    plt.close("all")


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


# ------------------------------------------------------------ where the bytes go, real models
# A llama small enough to trace in a second: 2 layers, 4 heads of 16, 2 key/value heads, float32.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
              "max_position_embeddings": 4096}
REAL_MODEL_NOTEBOOK = "notebooks/real-model.ipynb"


@pytest.fixture(scope="module", params=("library", "notebook"))
def model_and_plots(request, tmp_path_factory):
    """(module with predict_model, module with plot_bytes_by_kind): the library's, or what the
    real-model notebook's kernel has defined once its plots cell has run (one namespace)."""
    if request.param == "library":
        import types
        from lab_helpers.real.config import parse_config
        from lab_helpers.real.predict import predict_model
        from lab_helpers.real.spec import RunSpec
        from lab_helpers.views import plots as library_plots
        real_model = types.SimpleNamespace(parse_config=parse_config, RunSpec=RunSpec, predict_model=predict_model)
        return real_model, library_plots
    from conftest import load_module
    from lab_helpers.build.sync import notebook_code_upto
    path = tmp_path_factory.mktemp("real-model-notebook") / "real_model_notebook.py"
    path.write_text(notebook_code_upto(REAL_MODEL_NOTEBOOK, "lab_helpers/views/plots.py"), encoding="utf-8")
    module = load_module(path)
    return module, module


@pytest.fixture(scope="module")
def tiny_prediction(model_and_plots):
    real_model = model_and_plots[0]
    shape = real_model.parse_config(TINY_LLAMA, "tiny")
    spec = real_model.RunSpec("tiny", dtype="float32", batch=3, context=5, new_tokens=3)
    return real_model.predict_model(shape, spec)


def test_real_model_prediction_splits_end_allocated_by_kind_to_the_byte(tiny_prediction):
    phases = tiny_prediction["phases"]
    assert [(p["phase"], p["index"]) for p in phases] == [("model_load", None), ("inputs", None), ("prefill", None),
                                                          ("decode", 0), ("decode", 1), ("decode", 2)]
    # weights: embeddings and lm_head 1000 x 64 x 4 = 256000 each; per layer q, o 16384, k, v 8192,
    # gate, up, down 32768, two norms 256 -> 512; the final norm and the rotary embedding's two
    # buffers (inv_freq, original_inv_freq: 8 floats) take 512 each
    weights = 2 * 256000 + 2 * (2 * 16384 + 2 * 8192 + 3 * 32768 + 2 * 512) + 3 * 512
    assert weights == 810496
    ids = 512  # the prompt: 3 x 5 int64 = 120 bytes, one 512-byte block
    # per layer, keys and values: 3 x 2 heads x positions x 16 x 4 bytes, rounded up to 512
    kv = {5: 4 * 2048, 6: 4 * 2560, 7: 4 * 3072, 8: 4 * 3072}
    workspace = 32 * MIB  # cuBLAS's, held from the first product on
    chosen = 512  # the token each step chose: 3 x 1 int64
    assert [p["end_allocated_bytes_by_kind"] for p in phases] == [
        {"weights": weights, "inputs": 0, "kv_cache": 0, "workspace": 0, "activations": 0},
        {"weights": weights, "inputs": ids, "kv_cache": 0, "workspace": 0, "activations": 0},
        {"weights": weights, "inputs": ids, "kv_cache": kv[5], "workspace": workspace, "activations": chosen},
        {"weights": weights, "inputs": ids, "kv_cache": kv[6], "workspace": workspace, "activations": chosen},
        {"weights": weights, "inputs": ids, "kv_cache": kv[7], "workspace": workspace, "activations": chosen},
        {"weights": weights, "inputs": ids, "kv_cache": kv[8], "workspace": workspace, "activations": chosen},
    ]
    for p in phases:
        assert sum(p["end_allocated_bytes_by_kind"].values()) == p["end_allocated_bytes"]
        # the older split stays as it was: inputs and activations together in other_bytes
        old = p["bytes_at_end"]
        assert sorted(old) == ["kv_cache_bytes", "other_bytes", "weights_bytes", "workspace_bytes"]
        split = p["end_allocated_bytes_by_kind"]
        assert old["other_bytes"] == split["inputs"] + split["activations"]
        assert (old["weights_bytes"], old["kv_cache_bytes"], old["workspace_bytes"]) == (
            split["weights"], split["kv_cache"], split["workspace"])


def real_measurement_of(prediction):
    """The prediction's counters as a measurement would carry them (no by-kind split), with a
    decode step that ended 512 bytes above and its reserved 2 MiB above: a fixture, not a GPU's."""
    measured = json.loads(json.dumps(prediction))
    for p in measured["phases"]:
        for key in ("end_allocated_bytes_by_kind", "bytes_at_end", "transient_peak_bytes"):
            del p[key]
    measured["phases"][4]["end_allocated_bytes"] += 512
    measured["phases"][4]["end_reserved_bytes"] += 2 * MIB
    return measured


def test_plot_bytes_by_kind_stacks_a_real_model_prediction_under_its_measurement(model_and_plots, tiny_prediction):
    plots = model_and_plots[1]
    phases = tiny_prediction["phases"]
    measured = real_measurement_of(tiny_prediction)
    ax = plots.plot_bytes_by_kind(tiny_prediction, measured)
    kinds = ["weights", "inputs", "kv_cache", "workspace", "activations"]
    assert [c.get_label() for c in ax.containers] == [f"allocated: {k}" for k in kinds] + ["reserved"]
    n = len(phases)
    below = [0] * n
    for kind, bars in zip(kinds, ax.containers):
        assert [round(b.get_height() * MIB) for b in bars] == [p["end_allocated_bytes_by_kind"][kind] for p in phases]
        assert [round(b.get_y() * MIB) for b in bars] == below  # stacked on the kinds before it
        below = [b + p["end_allocated_bytes_by_kind"][kind] for b, p in zip(below, phases)]
    assert below == [p["end_allocated_bytes"] for p in phases]
    reserved = ax.containers[-1]
    assert [round(b.get_height() * MIB) for b in reserved] == [p["end_reserved_bytes"] for p in phases]
    allocated_x = [b.get_x() + b.get_width() / 2 for b in ax.containers[0]]
    reserved_x = [b.get_x() + b.get_width() / 2 for b in reserved]
    assert all(a < r for a, r in zip(allocated_x, reserved_x))  # reserved beside, to the right
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["measured end allocated", "measured end reserved"]
    total, cached = lines["measured end allocated"], lines["measured end reserved"]
    # the measured totals sit over their own bars, as markers without a joining line
    assert list(total.get_xdata()) == pytest.approx(allocated_x)
    assert list(cached.get_xdata()) == pytest.approx(reserved_x)
    assert total.get_linestyle() == cached.get_linestyle() == "None"
    assert [round(y * MIB) for y in total.get_ydata()] == [p["end_allocated_bytes"] for p in measured["phases"]]
    assert [round(y * MIB) for y in cached.get_ydata()] == [p["end_reserved_bytes"] for p in measured["phases"]]
    assert round(total.get_ydata()[4] * MIB) == phases[4]["end_allocated_bytes"] + 512
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "model_load", "inputs", "prefill", "decode #0", "decode #1", "decode #2"]
    assert "measured totals as markers" in ax.get_title()


def test_plot_bytes_by_kind_without_a_measurement_draws_the_prediction_alone(model_and_plots, tiny_prediction):
    ax = model_and_plots[1].plot_bytes_by_kind(tiny_prediction)
    assert ax.get_lines() == []
    assert len(ax.containers) == 6 and "measured" not in ax.get_title()


def test_plot_bytes_by_kind_refuses_what_it_cannot_draw_truthfully(model_and_plots, tiny_prediction):
    plots = model_and_plots[1]
    measured = real_measurement_of(tiny_prediction)
    with pytest.raises(Exception, match=r"phase 0 has no end_allocated_bytes_by_kind: use a prediction") as caught:
        plots.plot_bytes_by_kind(measured)  # a measurement knows totals, not what they are made of
    assert type(caught.value).__name__ == "LabError"
    skipped = json.loads(json.dumps(measured))
    del skipped["phases"][3]  # decode #0 not recorded: another protocol
    with pytest.raises(Exception, match="the measurement's phases differ from the prediction's"):
        plots.plot_bytes_by_kind(tiny_prediction, skipped)
    for value, shown in ((-512, "-512"), (512.0, "512.0"), (True, "True"), ("512", "'512'"), (None, "None")):
        bad = json.loads(json.dumps(tiny_prediction))
        split = bad["phases"][2]["end_allocated_bytes_by_kind"]
        split["kv_cache"], split["activations"] = value, split["activations"] + split["kv_cache"]
        with pytest.raises(Exception, match=rf"phase 2: end_allocated_bytes_by_kind\['kv_cache'\] is {shown}, "
                                            "not a whole number of bytes >= 0"):
            plots.plot_bytes_by_kind(bad)
    bad = json.loads(json.dumps(tiny_prediction))
    bad["phases"][5]["end_allocated_bytes_by_kind"]["inputs"] += 512
    with pytest.raises(Exception, match=r"phase 5: end_allocated_bytes_by_kind adds up to \d+ bytes, not its "
                                        r"end_allocated_bytes \d+"):
        plots.plot_bytes_by_kind(bad)


def where_the_bytes_go_cell() -> str:
    import nbformat
    nb = nbformat.read(ROOT / REAL_MODEL_NOTEBOOK, as_version=4)
    found = [c.source for c in nb.cells if c.cell_type == "code" and "plot_bytes_by_kind(prediction" in c.source
             and not c.metadata.get("tags")]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("measured", (False, True), ids=("no-gpu", "measured"))
def test_the_notebook_cell_says_when_no_gpu_measured_and_draws_the_prediction(measured, tiny_prediction, capsys):
    from lab_helpers.views import plots as library_plots
    measurement = real_measurement_of(tiny_prediction) if measured else None
    scope = {"prediction": tiny_prediction, "measurement": measurement,
             "plot_bytes_by_kind": library_plots.plot_bytes_by_kind}
    exec(where_the_bytes_go_cell(), scope)
    out = capsys.readouterr().out
    ax = scope["ax"]
    if measured:
        assert out == "" and len(ax.get_lines()) == 2
    else:
        assert out.startswith("No CUDA GPU, so no measurement: the bars are the prediction alone.")
        assert ax.get_lines() == [] and len(ax.containers) == 6


def test_a_tensor_parallel_document_is_drawn_one_rank_at_a_time(mm, plots, tmp_path):
    tp = mm.predict(mm.MeasureConfig(batch=1, context=16, width=64, tensor_parallel=2))
    for draw in (plots.phase_table, plots.plot_phases, plots.bytes_by_kind, plots.plot_bytes_by_kind):
        with pytest.raises(plots.LabError, match=r"^a tensor-parallel document \(2 ranks\) has phases per rank"):
            draw(tp)
    view = plots.rank_view(tp, 1)
    assert "ranks" not in view and view["phases"] == tp["ranks"][1]["phases"]
    split = plots.bytes_by_kind(view)
    # rank 1 holds 0.weight [128, 64] and 0.bias [128] of the hidden 256, 2.weight [64, 128], 2.bias [64]
    # whole, float32, each rounded to 512 bytes
    assert split["by_kind"]["weights"][0] == 32768 + 512 + 32768 + 512
    assert plots.phase_table(view).shape == (6, 6)
    for bad in (2, -1, True, "0", None):
        with pytest.raises(plots.LabError, match=r"^rank must be a whole number from 0 to 1"):
            plots.rank_view(tp, bad)
    with pytest.raises(plots.LabError, match="not a tensor-parallel document"):
        plots.rank_view(mm.predict(mm.MeasureConfig(width=64)), 0)
