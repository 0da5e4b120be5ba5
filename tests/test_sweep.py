"""The sweep, driven through a fake measure command (no GPU needed)."""
import json
import re
import sys
from pathlib import Path

import jsonschema
import matplotlib
import pytest

matplotlib.use("Agg")

from conftest import cuda_available  # noqa: E402
from lab_helpers import notebook_sync  # noqa: E402
from lab_helpers import sweep  # noqa: E402
from lab_helpers.mesure_memoire import GIB, MeasureConfig, predict  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "lab_helpers" / "measurement.schema.json").read_text(encoding="utf-8"))
EXTRA_RESERVED = 2 * 2**20  # the fake reports this much more reserved than predicted
OOM_LINE = ("mesure_memoire: error: phase cold_forward failed: OutOfMemoryError: CUDA out of memory. "
            "Tried to allocate 2.00 GiB; no file written")
BIG_BUDGET_GIB = 1000.0

# A stand-in for `mesure_memoire.py measure`: same flags, a schema-valid file whose
# counters are the prediction (reserved + EXTRA_RESERVED), or exit 3 above a threshold.
FAKE = '''
import argparse, json, sys
sys.path.insert(0, {root!r})
from lab_helpers.mesure_memoire import MeasureConfig, predict
parser = argparse.ArgumentParser()
parser.add_argument("subcommand", nargs="?", choices=["measure"])
for flag in ("batch", "context", "width", "hidden", "warmup", "repeats", "seed"):
    parser.add_argument("--" + flag, type=int, required=True)
parser.add_argument("--device", required=True)
parser.add_argument("--dtype", required=True)
parser.add_argument("--output", required=True)
args = parser.parse_args()
with open({calls!r}, "a") as log:
    log.write(str(getattr(args, {dimension!r})) + "\\n")
if {oom_above!r} is not None and getattr(args, {dimension!r}) > {oom_above!r}:
    print("some progress noise")
    print({oom_line!r}, file=sys.stderr)
    sys.exit(3)
config = MeasureConfig(**{{k: getattr(args, k) for k in MeasureConfig.__dataclass_fields__}})
document = predict(config)
for name in ("workspace", "reserved_assumptions"):
    del document[name]
document["kind"] = "iteragpu-lab measurement"
document["environment"] = {{
    "python_version": "3.12.0", "torch_version": "2.11.0+cu130", "cuda_build_version": "13.0",
    "hip_build_version": None, "runtime_note": "n", "device": args.device, "device_count": 1,
    "device_visible": True, "device_name": "Fake GPU", "compute_capability": "9.0",
    "total_memory_bytes": 150 * 2**30, "free_memory_bytes": 140 * 2**30}}
for phase in document["phases"]:
    phase.update(seconds=0.002, device_seconds=0.001)
    for key in ("baseline_reserved_bytes", "end_reserved_bytes", "peak_reserved_bytes"):
        phase[key] += {extra}
with open(args.output, "x") as handle:
    json.dump(document, handle)
'''


@pytest.fixture
def fake(tmp_path):
    """Return make(dimension, oom_above) -> (command, calls): a fake measure command and its call log."""
    def make(dimension="batch", oom_above=None):
        calls = tmp_path / f"calls-{dimension}-{oom_above}.txt"
        calls.touch()
        script = tmp_path / f"fake_measure_{dimension}_{oom_above}.py"
        script.write_text(FAKE.format(root=str(ROOT), calls=str(calls), dimension=dimension,
                                      oom_above=oom_above, oom_line=OOM_LINE, extra=EXTRA_RESERVED))
        return [sys.executable, str(script)], lambda: [int(v) for v in calls.read_text().split()]
    return make


def peaks(config: MeasureConfig):
    phases = predict(config)["phases"]
    return max(p["peak_allocated_bytes"] for p in phases), max(p["peak_reserved_bytes"] for p in phases)


def expected_row(dimension, value, status, config=MeasureConfig(), stage="sweep", reason=""):
    alloc, reserved = peaks(MeasureConfig(**{**config.__dict__, dimension: value}))
    ok = status == "ok"
    return {"dimension": dimension, "value": value, "stage": stage, "status": status, "reason": reason,
            "predicted_peak_allocated_bytes": alloc, "predicted_peak_reserved_bytes": reserved,
            "measured_peak_allocated_bytes": alloc if ok else None,
            "measured_peak_reserved_bytes": reserved + EXTRA_RESERVED if ok else None,
            "file": f"{dimension}-{value}.json" if ok else ""}


def test_doubling_measures_every_point_and_writes_valid_files(tmp_path, fake):
    command, calls = fake("context")
    out = tmp_path / "balayage"
    rows = sweep.run_sweep("context", out, start=16, maximum=100, budget_gib=BIG_BUDGET_GIB,
                           measure_command=command, progress=False)
    assert calls() == [16, 32, 64]
    assert rows == [expected_row("context", v, "ok") for v in (16, 32, 64)]
    assert sorted(p.name for p in out.iterdir()) == ["context-16.json", "context-32.json",
                                                      "context-64.json", "summary.csv"]
    for value in (16, 32, 64):
        document = json.loads((out / f"context-{value}.json").read_text())
        jsonschema.validate(document, SCHEMA)
        assert document["configuration"]["context"] == value


def test_explicit_values_and_exact_summary_csv(tmp_path, fake):
    command, calls = fake("width")
    out = tmp_path / "balayage"
    config = MeasureConfig(batch=2, context=8, dtype="bfloat16")
    rows = sweep.run_sweep("width", out, values=[32, 48, 96], config=config, budget_gib=BIG_BUDGET_GIB,
                           measure_command=command, progress=False)
    assert calls() == [32, 48, 96]
    lines = [",".join(sweep.SUMMARY_COLUMNS)]
    for value in (32, 48, 96):
        a, r = peaks(MeasureConfig(batch=2, context=8, width=value, dtype="bfloat16"))
        lines.append(f"width,{value},sweep,ok,,{a},{r},{a},{r + EXTRA_RESERVED},width-{value}.json")
    assert (out / "summary.csv").read_text(encoding="utf-8") == "\n".join(lines) + "\n"
    assert sweep.read_summary(out / "summary.csv") == rows
    assert not list(out.glob(".*"))  # no temporary file left behind


def test_hidden_sweep_keeps_width(tmp_path, fake):
    command, _ = fake("hidden")
    rows = sweep.run_sweep("hidden", tmp_path / "b", values=[8, 16], config=MeasureConfig(width=32),
                           budget_gib=BIG_BUDGET_GIB, measure_command=command, progress=False)
    document = json.loads((tmp_path / "b" / "hidden-16.json").read_text())
    assert (document["configuration"]["width"], document["configuration"]["hidden"]) == (32, 16)
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_stops_at_first_oom_and_records_its_reason(tmp_path, fake):
    command, calls = fake("batch", oom_above=3)
    out = tmp_path / "balayage"
    rows = sweep.run_sweep("batch", out, values=[1, 2, 4, 8], budget_gib=BIG_BUDGET_GIB,
                           measure_command=command, progress=False)
    assert calls() == [1, 2, 4]  # 8 never run
    assert rows == [expected_row("batch", 1, "ok"), expected_row("batch", 2, "ok"),
                    expected_row("batch", 4, "oom", reason=OOM_LINE)]
    assert sweep.read_summary(out / "summary.csv") == rows
    assert not (out / "batch-4.json").exists()


def test_over_budget_point_is_not_run(tmp_path, fake):
    command, calls = fake("batch")
    config = MeasureConfig(context=512, width=512)
    fits, over = peaks(MeasureConfig(batch=2, context=512, width=512))[1], peaks(
        MeasureConfig(batch=4, context=512, width=512))[1]
    assert fits < over
    budget = (fits + over) / 2 / GIB
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2, 4, 8], config=config,
                           budget_gib=budget, measure_command=command, progress=False)
    assert calls() == [1, 2]
    assert [(r["value"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok"), (4, "over_budget")]
    assert rows[-1]["reason"] == f"predicted peak reserved {over} bytes > budget {int(budget * GIB)} bytes; not run"
    assert rows[-1]["measured_peak_allocated_bytes"] is None and rows[-1]["file"] == ""


def test_bisection_finds_the_exact_threshold(tmp_path, fake):
    command, calls = fake("batch", oom_above=37)
    rows = sweep.run_sweep("batch", tmp_path / "b", start=1, maximum=64, bisect=True,
                           budget_gib=BIG_BUDGET_GIB, measure_command=command, progress=False)
    assert calls() == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert [r["stage"] for r in rows] == ["sweep"] * 7 + ["bisect"] * 5
    assert max(r["value"] for r in rows if r["status"] == "ok") == 37
    assert [r["status"] for r in rows[-5:]] == ["oom", "oom", "ok", "oom", "ok"]


def test_bisection_against_the_budget_runs_no_point_over_it(tmp_path, fake):
    command, calls = fake("batch")
    config = MeasureConfig(context=512, width=512)
    reserved = {b: peaks(MeasureConfig(batch=b, context=512, width=512))[1] for b in range(1, 9)}
    budget = reserved[5] / GIB  # batch 5 fits exactly, 6 and up do not
    assert reserved[6] > reserved[5]
    rows = sweep.run_sweep("batch", tmp_path / "b", start=1, maximum=8, config=config, bisect=True,
                           budget_gib=budget, measure_command=command, progress=False)
    assert calls() == [1, 2, 4, 5]
    assert [(r["value"], r["status"]) for r in rows] == [
        (1, "ok"), (2, "ok"), (4, "ok"), (8, "over_budget"), (6, "over_budget"), (5, "ok")]


def test_failure_that_is_not_memory_is_an_error_and_main_exits_1(tmp_path, fake, capsys):
    if cuda_available():
        pytest.skip("the real measure command succeeds on a GPU")
    out = tmp_path / "b"
    status = sweep.main(["--dimension", "batch", "--values", "1", "2", "--budget-gib", "1",
                         "--output-dir", str(out)])
    assert status == 1
    (row,) = sweep.read_summary(out / "summary.csv")
    assert (row["status"], row["file"]) == ("error", "")
    assert row["reason"].startswith("mesure_memoire: error: no CUDA/ROCm device")


@pytest.mark.parametrize("code, status, reason", [
    ("pass", "error", "exit code 0 but no readable measurement file (FileNotFoundError)"),
    ("import sys; print('mesure_memoire: error: bfloat16 is not supported', file=sys.stderr); sys.exit(2)",
     "error", "mesure_memoire: error: bfloat16 is not supported"),
    ("import sys; print('phase warmup failed: AcceleratorError: illegal memory access', file=sys.stderr); "
     "sys.exit(3)", "error", "phase warmup failed: AcceleratorError: illegal memory access"),
    ("import sys; sys.exit(3)", "error", "exit code 3"),
])
def test_other_failures_are_errors_and_stop_the_sweep(tmp_path, code, status, reason):
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2], budget_gib=BIG_BUDGET_GIB, bisect=True,
                           measure_command=[sys.executable, "-c", code], progress=False)
    assert [(r["value"], r["status"], r["reason"]) for r in rows] == [(1, status, reason)]


@pytest.mark.parametrize("args, message", [
    (["--dimension", "depth", "--values", "1"], "invalid choice: 'depth'"),
    (["--dimension", "batch", "--values", "0", "1"], "must be > 0"),
    (["--dimension", "batch", "--values", "1.5"], "not an integer"),
    (["--dimension", "batch", "--values", "4", "2"], "strictly increasing"),
    (["--dimension", "batch", "--values", "1", "--start", "1"], "not allowed with argument"),
    (["--dimension", "batch", "--start", "4"], "start needs max"),
    (["--dimension", "batch", "--start", "4", "--max", "2"], "start <= max"),
    (["--dimension", "batch", "--values", "1", "--max", "8"], "not both"),
    (["--dimension", "batch", "--values", "1", "--budget-gib", "0"], "budget must be > 0"),
    (["--dimension", "batch", "--values", "1", "--dtype", "float64"], "invalid choice: 'float64'"),
])
def test_bad_requests_exit_2_with_one_line_and_create_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "b"
    budget = [] if "--budget-gib" in args else ["--budget-gib", "1"]
    assert sweep.main(args + budget + ["--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_existing_output_dir_exits_2_and_is_untouched(tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert sweep.main(["--dimension", "batch", "--values", "1", "--budget-gib", "1", "--output-dir", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_no_gpu_and_no_budget_exits_2(tmp_path, capsys):
    if cuda_available():
        pytest.skip("a GPU is visible here")
    out = tmp_path / "b"
    assert sweep.main(["--dimension", "batch", "--values", "1", "--output-dir", str(out)]) == 2
    assert "no GPU visible" in capsys.readouterr().err
    assert not out.exists()


def test_plot_sweep_draws_measured_and_predicted_lines(tmp_path, fake):
    command, _ = fake("batch", oom_above=3)
    out = tmp_path / "b"
    rows = sweep.run_sweep("batch", out, values=[1, 2, 4], budget_gib=BIG_BUDGET_GIB,
                           measure_command=command, progress=False)
    for source in (rows, out / "summary.csv", str(out / "summary.csv")):
        ax = sweep.plot_sweep(source)
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"measured peak allocated", "measured peak reserved", "predicted peak allocated",
                              "predicted peak reserved", "did not fit (oom / over budget)"}
        assert list(lines["measured peak allocated"].get_xdata()) == [1, 2]
        assert list(lines["predicted peak reserved"].get_xdata()) == [1, 2, 4]
        assert list(lines["measured peak reserved"].get_ydata()) == [
            r["measured_peak_reserved_bytes"] / 2**20 for r in rows[:2]]
        assert ax.get_xlabel() == "batch"
        matplotlib.pyplot.close(ax.figure)


def test_cli_plot_writes_png(tmp_path, fake, monkeypatch, capsys):
    command, _ = fake("batch")
    monkeypatch.setattr(sweep, "default_measure_script", lambda: Path(command[1]))
    out = tmp_path / "b"
    assert sweep.main(["--dimension", "batch", "--values", "1", "2", "--budget-gib", "1", "--plot",
                       "--output-dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["batch-1.json", "batch-2.json", "summary.csv", "sweep.png"]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "largest batch measured that fit: 2" in capsys.readouterr().out


def notebook_cells_code() -> str:
    """What the notebook's kernel runs: the generated cells in order, up to sweep's."""
    sources = notebook_sync.NOTEBOOK_SOURCES["notebooks/mesure-memoire.ipynb"]
    sources = sources[: sources.index("lab_helpers/sweep.py") + 1]
    return "\n\n".join(notebook_sync.module_text(notebook_sync.cell_text(s)) for s in sources)


def test_notebook_inlined_copy_finds_the_script_from_notebooks_folder(tmp_path, fake, monkeypatch, capsys):
    """Run as notebook cells: no __file__, cwd notebooks/, no lab_helpers import available."""
    code = notebook_cells_code()
    assert not re.search(r"^\s*(from|import)\s+lab_helpers\b", code, re.MULTILINE)
    monkeypatch.setitem(sys.modules, "lab_helpers.mesure_memoire", None)  # any such import would fail
    monkeypatch.chdir(ROOT / "notebooks")
    namespace = {"__name__": "notebook_cells"}
    exec(compile(code, "<notebook>", "exec"), namespace)
    assert "__file__" not in namespace
    assert namespace["default_measure_script"]() == ROOT / "lab_helpers" / "mesure_memoire.py"
    command, calls = fake("batch", oom_above=1)
    rows = namespace["run_sweep"]("batch", tmp_path / "b", values=[1, 2], budget_gib=BIG_BUDGET_GIB,
                                  measure_command=command, progress=False)
    assert rows == [expected_row("batch", 1, "ok"), expected_row("batch", 2, "oom", reason=OOM_LINE)]
    ax = namespace["plot_sweep"](tmp_path / "b" / "summary.csv")
    assert len(ax.get_lines()) == 5
    matplotlib.pyplot.close(ax.figure)
    assert namespace["main"](["--dimension", "batch", "--values", "1", "--budget-gib", "1",
                              "--output-dir", str(tmp_path / "b")]) == 2
    assert "already exists" in capsys.readouterr().err
