"""Comparing measurement files: the tidy table, the bars, throughput and the CLI."""
import json
from pathlib import Path

import jsonschema
import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from lab_helpers.core.errors import LabError  # noqa: E402
from lab_helpers.synthetic.network import MeasureConfig  # noqa: E402
from lab_helpers.synthetic.predict import predict  # noqa: E402
from lab_helpers.views import runs  # noqa: E402
from lab_helpers.views.runs_commands import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "lab_helpers" / "measurement.schema.json").read_text(encoding="utf-8"))
CONFIGS = {
    "mesures-h100": MeasureConfig(batch=2, context=64, width=128, dtype="bfloat16", repeats=2),
    "mesures-h200": MeasureConfig(batch=4, context=32, width=256, hidden=512, dtype="float16", repeats=3),
}
DEVICES = {"mesures-h100": ("NVIDIA H100 80GB HBM3", "2.9.0+cu128", "12.8", "9.0"),
           "mesures-h200": ("NVIDIA H200", "2.11.0+cu130", "13.0", "9.0")}
HOST_SECONDS, DEVICE_SECONDS = 0.0021, 0.002  # every phase; warm forwards get their own below
WARM_DEVICE_SECONDS = (0.5, 0.25, 0.125)
WARM_HOST_SECONDS = (0.75, 0.3, 0.2)


def measurement(name: str) -> dict:
    """A measurement document: the prediction's counters plus set timings and environment."""
    document = predict(CONFIGS[name])
    for key in ("workspace", "reserved_assumptions", "budget", "cache_releases"):  # a prediction's own
        document.pop(key, None)
    device_name, torch_version, cuda, capability = DEVICES[name]
    document["kind"] = "iteragpu-lab measurement"
    document["environment"] = {
        "python_version": "3.12.3", "torch_version": torch_version, "cuda_build_version": cuda,
        "hip_build_version": None, "runtime_note": "note", "device": "cuda:0", "device_count": 1,
        "device_visible": True, "device_name": device_name, "compute_capability": capability,
        "total_memory_bytes": 80 * 2**30, "free_memory_bytes": 79 * 2**30}
    flops = document["synthetic_model"]["forward_flops"]
    for phase in document["phases"]:
        phase.update(seconds=HOST_SECONDS, device_seconds=DEVICE_SECONDS)
        if phase["phase"] == "warm_forward":
            i = phase["index"]
            phase.update(seconds=WARM_HOST_SECONDS[i], device_seconds=WARM_DEVICE_SECONDS[i])
            phase.update(achieved_tflops=flops / WARM_DEVICE_SECONDS[i] / 1e12,
                         host_to_device_time_ratio=WARM_HOST_SECONDS[i] / WARM_DEVICE_SECONDS[i])
    jsonschema.validate(document, SCHEMA)
    return document


@pytest.fixture
def files(tmp_path):
    paths = []
    for name in CONFIGS:
        path = tmp_path / name[-4:] / f"{name}.json"  # separate folders: only the stem names the run
        path.parent.mkdir()
        path.write_text(json.dumps(measurement(name)), encoding="utf-8")
        paths.append(path)
    return paths


def test_load_runs_is_one_row_per_phase_record(files):
    df = runs.load_runs(files)
    assert list(df.columns) == [
        "run", "phase", "index", "passes", "seconds", "device_seconds",
        "baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes", "end_reserved_bytes",
        "peak_allocated_bytes", "peak_reserved_bytes", "achieved_tflops", "host_to_device_time_ratio",
        "kind", "config_name", "device", "batch", "context", "width", "hidden", "dtype", "warmup", "repeats",
        "new_tokens", "seed", "parameter_count", "parameter_bytes", "forward_flops",
        "device_name", "torch_version", "cuda_build_version", "compute_capability"]
    assert df.shape == (6 + 7, 33)
    assert set(df["kind"]) == {"synthetic"} and df["new_tokens"].isna().all() and df["config_name"].isna().all()
    assert list(df["run"]) == ["mesures-h100"] * 6 + ["mesures-h200"] * 7
    assert list(df["phase"][:6]) == ["model_load", "inputs", "cold_forward", "warmup", "warm_forward", "warm_forward"]
    assert df["index"].tolist()[:6] == [pd.NA] * 4 + [0, 1]
    assert str(df["index"].dtype) == "Int64" and str(df["peak_allocated_bytes"].dtype) == "Int64"
    for name, path in zip(CONFIGS, files):
        sub = df[df["run"] == name]
        predicted = predict(CONFIGS[name])["phases"]
        assert sub["peak_allocated_bytes"].tolist() == [p["peak_allocated_bytes"] for p in predicted]
        assert sub["end_reserved_bytes"].tolist() == [p["end_reserved_bytes"] for p in predicted]
        assert set(sub["device_name"]) == {DEVICES[name][0]} and set(sub["cuda_build_version"]) == {DEVICES[name][2]}
        checked = CONFIGS[name].checked()
        assert set(sub["hidden"]) == {checked.hidden} and set(sub["dtype"]) == {checked.dtype}
    assert df["achieved_tflops"].isna().tolist() == [True] * 4 + [False] * 2 + [True] * 4 + [False] * 3


def test_throughput_numbers_come_from_flops_and_device_time(files):
    table = runs.throughput_table(runs.load_runs(files))
    assert list(table.columns) == list(runs.THROUGHPUT_COLUMNS)
    expected = []
    for name, repeats in (("mesures-h100", 2), ("mesures-h200", 3)):
        c = CONFIGS[name].checked()
        flops = 4 * c.batch * c.context * c.width * c.hidden
        for i in range(repeats):
            expected.append((name, i, flops, flops / WARM_DEVICE_SECONDS[i] / 1e12,
                             WARM_HOST_SECONDS[i] / WARM_DEVICE_SECONDS[i]))
    got = list(zip(table["run"], table["index"], table["forward_flops"], table["achieved_tflops"],
                   table["host_to_device_time_ratio"]))
    assert got == expected


def test_plot_runs_draws_one_labelled_bar_group_per_run(files):
    df = runs.load_runs(files)
    ax = runs.plot_runs(df, counter="peak_reserved_bytes")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(CONFIGS)
    assert len(ax.patches) == 2 * 7  # 7 phase labels (h200 has a third warm forward), 2 runs
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["model_load", "inputs", "cold_forward", "warmup", "warm_forward #0",
                      "warm_forward #1", "warm_forward #2"]
    first = predict(CONFIGS["mesures-h100"])["phases"][0]["peak_reserved_bytes"] / 2**20
    assert ax.patches[0].get_height() == first
    assert ax.containers[0].datavalues[0] == first and len(ax.texts) == 2 * 7
    assert ax.get_ylabel() == "peak reserved (MiB)"
    matplotlib.pyplot.close(ax.figure)
    with pytest.raises(runs.RunsError, match="counter must be one of"):
        runs.plot_runs(df, counter="peak_bytes")


def test_same_stem_twice_and_non_measurement_are_refused(tmp_path, files):
    twin = tmp_path / "other" / files[0].name
    twin.parent.mkdir()
    twin.write_text(files[0].read_text())
    with pytest.raises(runs.RunsError, match="two files are named"):
        runs.load_runs([files[0], twin])
    bad = tmp_path / "prediction.json"
    bad.write_text(json.dumps(predict(MeasureConfig())))
    with pytest.raises(LabError, match=r"prediction.json: \$: lacks the required key 'environment'"):
        runs.load_runs([bad])


def test_cli_prints_tables_and_writes_new_csv(tmp_path, files, capsys):
    out = tmp_path / "runs.csv"
    assert main([*map(str, files), "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "warm forward throughput:" in printed and "NVIDIA H200" in printed and "warm_forward #2" in printed
    back = pd.read_csv(out)
    assert list(back.columns) == list(runs.COLUMNS) and len(back) == 13
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_refuses_to_overwrite_csv(tmp_path, files, capsys):
    out = tmp_path / "runs.csv"
    out.write_text("keep")
    assert main([*map(str, files), "--csv", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and err.count("\n") == 1
    assert out.read_text() == "keep"


def test_cli_missing_file_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "absent.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def transformers_measurement() -> dict:
    """A transformers-kind measurement: the common phases layout, its own configuration and model."""
    document = measurement("mesures-h200")
    del document["synthetic_model"]
    document["configuration"] = {"kind": "transformers", "config_name": "llama-3.1-8b", "dtype": "bfloat16",
                                 "batch": 1, "context": 128, "new_tokens": 2, "device": "cuda:0", "seed": 0,
                                 "decode_record_every": 1}
    document["model"] = {"architecture": "LlamaForCausalLM", "parameter_count": 8030261248,
                         "parameter_bytes": 16060522496}
    names = [("model_load", None), ("inputs", None), ("prefill", None), ("decode", 0), ("decode", 1)]
    phases = document["phases"][:5]
    for phase, (name, index) in zip(phases, names):
        phase.update(phase=name, index=index)
        phase.pop("achieved_tflops", None)
        phase.pop("host_to_device_time_ratio", None)
    document["phases"] = phases
    jsonschema.validate(document, SCHEMA)
    return document


def test_transformers_files_sit_beside_synthetic_ones(tmp_path, files):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(transformers_measurement()), encoding="utf-8")
    df = runs.load_runs([files[0], path])
    llama = df[df["run"] == "llama"]
    assert llama["phase"].tolist() == ["model_load", "inputs", "prefill", "decode", "decode"]
    assert set(llama["kind"]) == {"transformers"} and set(llama["config_name"]) == {"llama-3.1-8b"}
    assert llama["new_tokens"].tolist() == [2] * 5 and llama["width"].isna().all()
    assert llama["parameter_count"].tolist() == [8030261248] * 5 and llama["forward_flops"].isna().all()
    assert runs.memory_table(df).loc["decode #1", "llama"] == transformers_measurement()["phases"][4]["peak_allocated_bytes"]
    assert len(runs.throughput_table(df)) == 2  # warm forwards of the synthetic run only


def test_csv_cells_cannot_start_a_formula(tmp_path, files):
    document = json.loads(files[0].read_text())
    document["environment"]["device_name"] = "=HYPERLINK(\"http://x\")"
    document["environment"]["torch_version"] = "-2+3"
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(document))
    out = tmp_path / "runs.csv"
    assert main([str(hostile), "--csv", str(out)]) == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    first = lines[1].split(",")
    header = lines[0].split(",")
    assert first[header.index("torch_version")] == "'-2+3"
    assert "'=HYPERLINK" in lines[1]
    assert first[header.index("peak_allocated_bytes")] == str(document["phases"][0]["peak_allocated_bytes"])
    assert first[header.index("index")] == "" and first[header.index("config_name")] == ""


def test_plot_option_writes_a_new_png_once(tmp_path, files, capsys):
    out = tmp_path / "runs.png"
    assert main([*map(str, files), "--plot", str(out), "--counter", "peak_reserved_bytes"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = out.read_bytes()
    capsys.readouterr()
    assert main([*map(str, files), "--plot", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h100", "h200", "runs.png"]


@pytest.mark.parametrize("module", ["pandas", "matplotlib"])
def test_missing_optional_package_names_make_lab(tmp_path, files, module):
    import subprocess
    import sys
    out = tmp_path / "runs.png"
    code = (f"import sys; sys.modules[{module!r}] = None; sys.path.insert(0, {str(ROOT)!r}); "
            "from lab_helpers.views.runs_commands import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, files), "--plot", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"runs: error: {module} is not installed: run make lab (or pip install -r requirements.txt)\n"
    assert not out.exists()
