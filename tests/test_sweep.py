"""The sweep, driven through a fake measuring program (no GPU needed)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jsonschema
import matplotlib
import pytest

matplotlib.use("Agg")

from lab_helpers.build.bundle import closure, section_code  # noqa: E402
from lab_helpers.core.numbers import GIB  # noqa: E402
from lab_helpers.measurement.schema import read_measurement  # noqa: E402
from lab_helpers.synthetic.network import MeasureConfig  # noqa: E402
from lab_helpers.synthetic.predict import predict  # noqa: E402
from lab_helpers.views import sweep  # noqa: E402
from lab_helpers.views.sweep_commands import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "lab_helpers" / "measurement.schema.json").read_text(encoding="utf-8"))
EXTRA_RESERVED = 2 * 2**20  # the fake reports this much more reserved than predicted
USABLE_BYTES = 1000 * GIB  # what the fake environment reports as usable memory
OOM_MESSAGE = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
CUDA_MESSAGE = "AcceleratorError: CUDA error: an illegal memory access was encountered"
OOM_REASON = "phase cold_forward: " + OOM_MESSAGE  # what the summary records
CUDA_REASON = "phase warmup: " + CUDA_MESSAGE
VISIBLE = {"device": "cuda:0", "device_visible": True, "usable_memory_bytes": USABLE_BYTES}
NO_GPU = {"device": "cuda:0", "device_visible": False, "usable_memory_bytes": "unavailable",
          "device_unavailable_reason": "torch.cuda.is_available() is False"}

# A stand-in for `mesure_memoire.py`: `environment` prints B["environment"]; `measure` takes the same
# flags, logs the swept value, and above B["fail_above"] behaves as B["mode"] says; otherwise it writes a
# schema-valid file whose counters are the prediction (reserved + EXTRA_RESERVED).
FAKE_PROGRAM = r'''
import json, os, signal, subprocess, sys, time
B = json.loads(@BEHAVIOUR@)
args = sys.argv[1:]
if args[:1] == ["environment"]:
    env = B["environment"]
    if env == "garbage":
        print("this is not JSON")
    elif env == "crash":
        print("Traceback (most recent call last):\nRuntimeError: driver exploded", file=sys.stderr)
        sys.exit(1)
    elif env == "hang":
        time.sleep(60)
    else:
        print(json.dumps(env))
    sys.exit(0)
assert args[0] == "measure", args
flags = dict(zip(args[1::2], args[2::2]))
value = int(flags["--" + B["dimension"]])
with open(B["calls"], "a") as log:
    log.write(f"{value}\n")
mode = B["mode"] if B["fail_above"] is not None and value > B["fail_above"] else "ok"
output, report = flags["--output"], flags["--failure-report"]


def failure(phase, reason, message):
    with open(report, "x") as handle:
        json.dump({"kind": "iteragpu-lab measure failure", "phase": phase, "reason": reason,
                   "message": message}, handle)
    print(f"mesure_memoire: error: phase {phase} failed: {message}; no file written", file=sys.stderr)
    sys.exit(3)


if mode == "oom":
    failure("cold_forward", "out_of_memory", B["oom_message"])
if mode == "cuda_error":
    failure("warmup", "cuda_error", B["cuda_message"])
if mode == "exit3_no_report":
    print("mesure_memoire: error: phase inputs failed: something", file=sys.stderr)
    sys.exit(3)
if mode == "exit3_garbage_report":
    with open(report, "w") as handle:
        handle.write('{"kind": "iteragpu-lab measure failure", "reason": ')
    sys.exit(3)
if mode == "hang":
    time.sleep(60)
if mode == "hang_group":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(B["pidfile"], "w") as handle:
        handle.write(str(child.pid))
    time.sleep(60)
if mode == "exit_leaving_grandchild":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(B["pidfile"], "w") as handle:
        handle.write(str(child.pid))
    sys.exit(2)
if mode == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "garbage":
    with open(output, "wb") as handle:
        handle.write(b"\x00\xff not JSON at all")
    sys.exit(0)
if mode == "not_measurement":
    with open(output, "w") as handle:
        json.dump({"kind": "iteragpu-lab measurement", "phases": []}, handle)
    sys.exit(0)
if mode == "no_file":
    sys.exit(0)
if mode == "usage":
    print("mesure_memoire: error: bfloat16 is not supported on cuda:0", file=sys.stderr)
    sys.exit(2)
if mode == "noisy":
    for i in range(50):
        print(f"line {i}", file=sys.stderr)
    print("=last " + "x" * 1000, file=sys.stderr)
    sys.exit(1)
sys.path.insert(0, B["root"])
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.predict import predict
names = ("batch", "context", "width", "hidden", "warmup", "repeats", "seed")
config = MeasureConfig(device=flags["--device"], dtype=flags["--dtype"], **{n: int(flags["--" + n]) for n in names})
if mode == "wrong_config":
    config = MeasureConfig(device=flags["--device"], dtype=flags["--dtype"],
                           **{n: int(flags["--" + n]) + (n == "seed") for n in names})
prediction = predict(config)
phases = prediction["phases"]
for phase in phases:
    phase.update(seconds=0.002, device_seconds=0.001)
    for key in ("baseline_reserved_bytes", "end_reserved_bytes", "peak_reserved_bytes"):
        phase[key] += B["extra"]
document = {
    "schema_version": prediction["schema_version"], "kind": "iteragpu-lab measurement",
    "environment": {
        "python_version": "3.12.0", "torch_version": "2.11.0+cu130", "cuda_build_version": "13.0",
        "hip_build_version": None, "runtime_note": "n", "device": config.device, "device_count": 1,
        "device_visible": True, "device_name": "Fake GPU", "compute_capability": "9.0",
        "total_memory_bytes": 150 * 2**30, "free_memory_bytes": 140 * 2**30},
    "configuration": prediction["configuration"], "synthetic_model": prediction["synthetic_model"],
    "phases": phases}
with open(output, "x") as handle:
    json.dump(document, handle)
sys.exit(0)
'''


class Fake:
    """A fake measuring program: its argv prefix, and the swept values `measure` was called with."""

    def __init__(self, folder: Path, dimension="batch", fail_above=None, mode="oom", environment=None):
        self.folder = folder
        self.calls_file = folder / f"calls-{id(self)}.txt"
        self.calls_file.touch()
        self.pidfile = folder / f"pid-{id(self)}.txt"
        behaviour = {"dimension": dimension, "fail_above": fail_above, "mode": mode, "root": str(ROOT),
                     "calls": str(self.calls_file), "pidfile": str(self.pidfile), "extra": EXTRA_RESERVED,
                     "environment": VISIBLE if environment is None else environment,
                     "oom_message": OOM_MESSAGE, "cuda_message": CUDA_MESSAGE}
        script = folder / f"fake_mesure_memoire_{id(self)}.py"
        script.write_text(FAKE_PROGRAM.replace("@BEHAVIOUR@", repr(json.dumps(behaviour))), encoding="utf-8")
        self.command = [sys.executable, str(script)]

    def calls(self) -> list:
        return [int(v) for v in self.calls_file.read_text().split()]


@pytest.fixture
def fake(tmp_path):
    """make(dimension, fail_above, mode, environment) -> Fake, its files outside any output folder."""
    home = tmp_path / "fakes"
    home.mkdir()
    return lambda *args, **kwargs: Fake(home, *args, **kwargs)


def peaks(config: MeasureConfig):
    phases = predict(config)["phases"]
    return max(p["peak_allocated_bytes"] for p in phases), max(p["peak_reserved_bytes"] for p in phases)


def expected_row(dimension, value, status, config=MeasureConfig(), stage="sweep", reason="", budget=None):
    alloc, reserved = peaks(replace(config, **{dimension: value}))
    ok = status == "ok"
    if status == "over_budget":
        reason = f"predicted peak reserved {reserved} bytes > budget {budget} bytes; not run"
    return {"dimension": dimension, "value": value, "stage": stage, "status": status, "reason": reason,
            "predicted_peak_allocated_bytes": alloc, "predicted_peak_reserved_bytes": reserved,
            "measured_peak_allocated_bytes": alloc if ok else None,
            "measured_peak_reserved_bytes": reserved + EXTRA_RESERVED if ok else None,
            "file": f"{dimension}-{value}.json" if ok else ""}


def test_doubling_measures_every_point_and_writes_valid_files(tmp_path, fake):
    program = fake("context")
    out = tmp_path / "balayage"
    rows = sweep.run_sweep("context", out, start=16, maximum=100, measure_command=program.command, progress=False)
    assert program.calls() == [16, 32, 64]
    assert rows == [expected_row("context", v, "ok") for v in (16, 32, 64)]
    assert sorted(p.name for p in out.iterdir()) == ["context-16.json", "context-32.json",
                                                      "context-64.json", "summary.csv"]
    for value in (16, 32, 64):
        document = read_measurement(out / f"context-{value}.json")
        jsonschema.validate(document, SCHEMA)
        assert document["configuration"]["context"] == value


def test_explicit_values_and_exact_summary_csv(tmp_path, fake):
    program = fake("width")
    out = tmp_path / "balayage"
    config = MeasureConfig(batch=2, context=8, dtype="bfloat16")
    rows = sweep.run_sweep("width", out, values=[32, 48, 96], config=config, budget_gib=1,
                           measure_command=program.command, progress=False)
    assert program.calls() == [32, 48, 96]
    lines = [",".join(sweep.SUMMARY_COLUMNS)]
    for value in (32, 48, 96):
        a, r = peaks(MeasureConfig(batch=2, context=8, width=value, dtype="bfloat16"))
        lines.append(f"width,{value},sweep,ok,,{a},{r},{a},{r + EXTRA_RESERVED},width-{value}.json")
    assert (out / "summary.csv").read_text(encoding="utf-8") == "\n".join(lines) + "\n"
    assert sweep.read_summary(out / "summary.csv") == rows
    assert not list(out.glob(".*"))  # no temporary file left behind


def test_hidden_sweep_keeps_width(tmp_path, fake):
    program = fake("hidden")
    rows = sweep.run_sweep("hidden", tmp_path / "b", values=[8, 16], config=MeasureConfig(width=32),
                           measure_command=program.command, progress=False)
    document = json.loads((tmp_path / "b" / "hidden-16.json").read_text())
    assert (document["configuration"]["width"], document["configuration"]["hidden"]) == (32, 16)
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_default_budget_is_the_usable_memory_the_environment_reports(tmp_path, fake):
    config = MeasureConfig(context=512, width=512)
    reserved = {b: peaks(MeasureConfig(batch=b, context=512, width=512))[1] for b in (1, 2, 4)}
    usable = (reserved[2] + reserved[4]) // 2
    program = fake("batch", environment={**VISIBLE, "free_memory_bytes": 10 * usable, "usable_memory_bytes": usable})
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2, 4], config=config,
                           measure_command=program.command, progress=False)
    assert program.calls() == [1, 2]
    assert rows[-1] == expected_row("batch", 4, "over_budget", config, budget=usable)


def test_stops_at_first_oom_and_records_the_failure_report(tmp_path, fake):
    program = fake("batch", fail_above=3, mode="oom")
    out = tmp_path / "balayage"
    rows = sweep.run_sweep("batch", out, values=[1, 2, 4, 8], measure_command=program.command, progress=False)
    assert program.calls() == [1, 2, 4]  # 8 never run
    assert rows == [expected_row("batch", 1, "ok"), expected_row("batch", 2, "ok"),
                    expected_row("batch", 4, "oom", reason=OOM_REASON)]
    assert sweep.read_summary(out / "summary.csv") == rows
    assert sorted(p.name for p in out.iterdir()) == ["batch-1.json", "batch-2.json", "summary.csv"]


def test_over_budget_point_is_not_run(tmp_path, fake):
    program = fake("batch")
    config = MeasureConfig(context=512, width=512)
    fits, over = peaks(MeasureConfig(batch=2, context=512, width=512))[1], peaks(
        MeasureConfig(batch=4, context=512, width=512))[1]
    assert fits < over
    budget = (fits + over) / 2 / GIB
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2, 4, 8], config=config,
                           budget_gib=budget, measure_command=program.command, progress=False)
    assert program.calls() == [1, 2]
    assert [(r["value"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok"), (4, "over_budget")]
    assert rows[-1] == expected_row("batch", 4, "over_budget", config, budget=int(budget * GIB))


def test_measured_bisection_after_an_oom_finds_the_exact_threshold(tmp_path, fake):
    program = fake("batch", fail_above=37, mode="oom")
    rows = sweep.run_sweep("batch", tmp_path / "b", start=1, maximum=64, bisect=True,
                           measure_command=program.command, progress=False)
    assert program.calls() == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert [r["stage"] for r in rows] == ["sweep"] * 7 + ["bisect"] * 5
    assert max(r["value"] for r in rows if r["status"] == "ok") == 37
    assert [r["status"] for r in rows[-5:]] == ["oom", "oom", "ok", "oom", "ok"]


BUDGET_CONFIG = MeasureConfig(context=512, width=512)


def reserved_by_batch(last=8):
    values = {b: peaks(replace(BUDGET_CONFIG, batch=b))[1] for b in range(1, last + 1)}
    assert all(values[b] < values[b + 1] for b in range(1, last))
    return values


def test_bisection_on_the_prediction_runs_one_process_and_confirms(tmp_path, fake):
    program = fake("batch")
    reserved = reserved_by_batch()
    budget = reserved[5]  # batch 5 fits exactly, 6 and up do not
    rows = sweep.run_sweep("batch", tmp_path / "b", start=1, maximum=8, config=BUDGET_CONFIG, bisect=True,
                           budget_gib=budget / GIB, measure_command=program.command, progress=False)
    assert program.calls() == [1, 2, 4, 5]  # 6 and 7 were ruled out by the prediction alone
    assert rows == [expected_row("batch", 1, "ok", BUDGET_CONFIG), expected_row("batch", 2, "ok", BUDGET_CONFIG),
                    expected_row("batch", 4, "ok", BUDGET_CONFIG),
                    expected_row("batch", 8, "over_budget", BUDGET_CONFIG, budget=budget),
                    expected_row("batch", 5, "ok", BUDGET_CONFIG, stage="confirm"),
                    expected_row("batch", 6, "over_budget", BUDGET_CONFIG, stage="confirm", budget=budget)]
    assert sweep.read_summary(tmp_path / "b" / "summary.csv") == rows


def test_bisection_on_the_prediction_reuses_a_point_already_measured(tmp_path, fake):
    program = fake("batch")
    budget = reserved_by_batch()[4]
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2, 4, 8], config=BUDGET_CONFIG, bisect=True,
                           budget_gib=budget / GIB, measure_command=program.command, progress=False)
    assert program.calls() == [1, 2, 4]
    assert rows[-2:] == [expected_row("batch", 4, "ok", BUDGET_CONFIG, stage="confirm"),
                         expected_row("batch", 5, "over_budget", BUDGET_CONFIG, stage="confirm", budget=budget)]


def test_bisection_on_the_prediction_when_the_first_point_is_over_budget(tmp_path, fake):
    program = fake("batch")
    budget = reserved_by_batch()[3]
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[8], config=BUDGET_CONFIG, bisect=True,
                           budget_gib=budget / GIB, measure_command=program.command, progress=False)
    assert program.calls() == [3]
    assert [(r["value"], r["stage"], r["status"]) for r in rows] == [
        (8, "sweep", "over_budget"), (3, "confirm", "ok"), (4, "confirm", "over_budget")]


def test_confirmation_out_of_memory_falls_back_to_measured_bisection(tmp_path, fake):
    program = fake("batch", fail_above=4, mode="oom")  # the GPU holds less than the budget says
    budget = reserved_by_batch()[6]
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2, 8], config=BUDGET_CONFIG, bisect=True,
                           budget_gib=budget / GIB, measure_command=program.command, progress=False)
    assert program.calls() == [1, 2, 6, 4, 5]
    assert [(r["value"], r["stage"], r["status"]) for r in rows] == [
        (1, "sweep", "ok"), (2, "sweep", "ok"), (8, "sweep", "over_budget"), (6, "confirm", "oom"),
        (4, "bisect", "ok"), (5, "bisect", "oom")]
    assert rows[3]["reason"] == OOM_REASON


def test_nothing_fits_not_even_one(tmp_path, fake):
    program = fake("batch")
    budget = reserved_by_batch()[1] - 1
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[2, 4], config=BUDGET_CONFIG, bisect=True,
                           budget_gib=budget / GIB, measure_command=program.command, progress=False)
    assert program.calls() == []
    assert rows == [expected_row("batch", 2, "over_budget", BUDGET_CONFIG, budget=budget)]


def test_largest_predicted_fit_is_the_boundary_of_the_prediction():
    reserved = reserved_by_batch()
    for fits in range(1, 8):
        assert sweep.largest_predicted_fit(BUDGET_CONFIG, "batch", 0, 8, reserved[fits]) == fits
    assert sweep.largest_predicted_fit(BUDGET_CONFIG, "batch", 0, 8, reserved[1] - 1) == 0


def test_an_error_stops_the_sweep_and_bisection(tmp_path, fake):
    program = fake("batch", fail_above=1, mode="cuda_error")
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2, 4], bisect=True,
                           measure_command=program.command, progress=False)
    assert program.calls() == [1, 2]
    assert rows == [expected_row("batch", 1, "ok"), expected_row("batch", 2, "error", reason=CUDA_REASON)]


def test_plot_sweep_draws_measured_and_predicted_lines(tmp_path, fake):
    program = fake("batch", fail_above=3, mode="oom")
    out = tmp_path / "b"
    rows = sweep.run_sweep("batch", out, values=[1, 2, 4], measure_command=program.command, progress=False)
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


def test_plot_draws_a_confirmed_value_once(tmp_path, fake):
    program = fake("batch")
    budget = reserved_by_batch()[4]
    rows = sweep.run_sweep("batch", tmp_path / "b", values=[1, 2, 4, 8], config=BUDGET_CONFIG, bisect=True,
                           budget_gib=budget / GIB, measure_command=program.command, progress=False)
    ax = sweep.plot_sweep(rows)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["predicted peak allocated"].get_xdata()) == [1, 2, 4, 5, 8]
    assert list(lines["measured peak allocated"].get_xdata()) == [1, 2, 4]
    matplotlib.pyplot.close(ax.figure)


def test_cli_plot_writes_png_and_prints_a_table(tmp_path, fake, monkeypatch, capsys):
    program = fake("batch")
    monkeypatch.setattr(sweep, "measuring_program", lambda: program.command)
    out = tmp_path / "b"
    assert main(["--dimension", "batch", "--values", "1", "2", "--plot", "--output-dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["batch-1.json", "batch-2.json", "summary.csv", "sweep.png"]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["batch=1", "sweep", "ok", "batch-1.json"]
    assert printed[-2:] == ["largest batch measured that fit: 2", f"summary: {out / 'summary.csv'}"]


def test_cli_json_output_is_the_summary(tmp_path, fake, monkeypatch, capsys):
    program = fake("batch", fail_above=1, mode="oom")
    monkeypatch.setattr(sweep, "measuring_program", lambda: program.command)
    out = tmp_path / "b"
    assert main(["--dimension", "batch", "--values", "1", "2", "--json", "--output-dir", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"rows": sweep.read_summary(out / "summary.csv"), "largest_fit": 1,
                       "summary": str(out / "summary.csv")}


MEASURING_FILE = ROOT / "lab_helpers" / "mesure_memoire.py"


def test_library_runs_the_generated_measuring_file(tmp_path):
    """The child is this Python on the checkout's generated mesure_memoire.py, with -P: a json.py in the
    folder it runs in is never imported, and its output is read."""
    program = sweep.measuring_program()
    assert program == [sys.executable, "-P", str(MEASURING_FILE)]
    (tmp_path / "json.py").write_text("raise SystemExit('the folder json.py was imported')\n", encoding="utf-8")
    result = subprocess.run([*program, "predict", "--batch", "3", "--width", "32"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == predict(MeasureConfig(batch=3, width=32))
    assert [p.name for p in tmp_path.iterdir()] == ["json.py"]  # the program is not copied anywhere


# ------------------------------------------------------------ notebook form
NOTEBOOK_ROOTS = ("lab_helpers/views/sweep.py",)


def notebook_cells(roots=NOTEBOOK_ROOTS) -> list:
    """The generated cells a notebook holds for `roots`: each module the bundler takes, in its notebook
    form (package imports dropped, core.paths as a kernel sees it)."""
    return [section_code(source, notebook=True)[1] for source in closure(list(roots))]


def run_as_notebook_cells() -> dict:
    """Run the generated cells as a Jupyter kernel does: one namespace, no __file__, no lab_helpers
    import, each cell compiled under its own name that is no file on disk."""
    namespace = {"__name__": "__main__"}
    for index, code in enumerate(notebook_cells()):
        exec(compile(code, f"/tmp/ipykernel_0/cell-{index}-{id(namespace)}.py", "exec"), namespace)
    return namespace


def block_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "lab_helpers.mesure_memoire", None)  # any such import would fail
    monkeypatch.setitem(sys.modules, "lab_helpers", None)


@pytest.fixture
def notebook_in_checkout(monkeypatch):
    """The notebook's kernel as `make lab` starts it: in the checkout's notebooks/ folder, with no
    lab_helpers reachable."""
    block_the_package(monkeypatch)
    monkeypatch.chdir(ROOT / "notebooks")


@pytest.fixture
def notebook_alone(tmp_path, monkeypatch):
    """The notebook's namespace with no lab_helpers reachable, downloaded into a folder of its own:
    no checkout, so no mesure_memoire.py above it."""
    block_the_package(monkeypatch)
    folder = tmp_path / "downloaded"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def test_notebook_runs_the_generated_measuring_file(notebook_in_checkout, tmp_path):
    namespace = run_as_notebook_cells()
    assert "__file__" not in namespace
    program = namespace["measuring_program"]()
    assert program == [sys.executable, "-P", str(MEASURING_FILE)]
    (tmp_path / "json.py").write_text("raise SystemExit('the folder json.py was imported')\n", encoding="utf-8")
    result = subprocess.run([*program, "predict", "--batch", "3", "--width", "32"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == predict(MeasureConfig(batch=3, width=32))


def test_notebook_alone_sweeps_with_a_given_command(notebook_alone, tmp_path):
    namespace = run_as_notebook_cells()
    with pytest.raises(namespace["SweepError"], match="cannot find the measuring program"):
        namespace["measuring_program"]()
    with pytest.raises(namespace["SweepError"], match="pass measure_command="):
        namespace["run_sweep"]("batch", tmp_path / "never", values=[1], progress=False)
    assert not (tmp_path / "never").exists()
    fake = Fake(tmp_path, "batch", fail_above=1, mode="oom")
    out = tmp_path / "b"
    rows = namespace["run_sweep"]("batch", out, values=[1, 2], measure_command=fake.command, progress=False)
    assert rows == [expected_row("batch", 1, "ok"), expected_row("batch", 2, "oom", reason=OOM_REASON)]
    assert sorted(p.name for p in out.iterdir()) == ["batch-1.json", "summary.csv"]
    assert fake.calls() == [1, 2]
    ax = namespace["plot_sweep"](out / "summary.csv")
    assert len(ax.get_lines()) == 5
    matplotlib.pyplot.close(ax.figure)


def test_notebook_in_a_real_kernel(tmp_path):
    """The generated cells, run by a Jupyter kernel in the checkout's notebooks/ folder: the sweep's
    measuring program is the generated mesure_memoire.py, and it answers."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [nbformat.v4.new_code_cell(code) for code in notebook_cells()]
    cells.append(nbformat.v4.new_code_cell(
        "import json, subprocess, sys\n"
        "from pathlib import Path\n"
        "program = measuring_program()\n"
        "answer = subprocess.run([*program, 'predict', '--batch', '3'], capture_output=True, text=True)\n"
        "generated = Path.cwd().resolve().parent / 'lab_helpers' / 'mesure_memoire.py'\n"
        "print(json.dumps({'generated': program[2:] == [str(generated)],\n"
        "                  'python': program[:2] == [sys.executable, '-P'],\n"
        "                  'predict': json.loads(answer.stdout) == predict(MeasureConfig(batch=3))}))"))
    folder = ROOT / "notebooks"
    before = sorted(os.listdir(folder))
    notebook = nbformat.v4.new_notebook(cells=cells)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}}).execute()
    printed = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    assert json.loads(printed) == {"generated": True, "python": True, "predict": True}
    assert sorted(os.listdir(folder)) == before
