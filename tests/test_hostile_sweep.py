"""Hostile input for the sweep: bad values, numbers, budgets, folders, environments and children.

Every usage error: exit 2, one line on stderr, no traceback, nothing created, nothing measured.
Every failed point: its own status and reason in summary.csv, its file absent, the sweep stopped.
"""
import _thread
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lab_helpers.core.errors import LabError
from lab_helpers.measurement.schema import read_measurement
from lab_helpers.views import sweep
from lab_helpers.views.sweep_commands import main
from test_sweep import (CUDA_REASON, NO_GPU, OOM_REASON, ROOT, VISIBLE, expected_row,  # noqa: F401
                        fake)

DIGITS_4300 = "9" * 4300
LONG_NAME = "b" * 300


def use(monkeypatch, program):
    """Make the command line run `program` instead of mesure_memoire.py."""
    monkeypatch.setattr(sweep, "measuring_program", lambda: program.command)


def only_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err.rstrip("\n")


USAGE_CASES = [
    # (id, extra argv, fragments of the message: the flag at fault and what the line must show)
    ("unknown-dimension", ["--dimension", "depth", "--values", "1"], ("--dimension", "invalid choice: 'depth'")),
    ("values-missing", ["--dimension", "batch", "--values"], ("--values", "expected at least one argument")),
    ("value-zero", ["--dimension", "batch", "--values", "0"], ("argument --values", "0")),
    ("value-negative", ["--dimension", "batch", "--values", "-3"], ("argument --values", "-3")),
    ("value-decimal", ["--dimension", "batch", "--values", "1.5"], ("argument --values", "'1.5'")),
    ("values-decreasing", ["--dimension", "batch", "--values", "4", "2"], ("strictly increasing", "[4, 2]")),
    ("values-repeated", ["--dimension", "batch", "--values", "2", "2"], ("strictly increasing", "[2, 2]")),
    ("value-arabic-indic-digits", ["--dimension", "batch", "--values", "\u0661\u0662"],
     ("argument --values", "'\u0661\u0662'")),
    ("value-fullwidth-digit", ["--dimension", "batch", "--values", "\uff12"], ("argument --values", "'\uff12'")),
    ("value-superscript-digit", ["--dimension", "batch", "--values", "\u00b2"], ("argument --values", "'\u00b2'")),
    ("value-underscore", ["--dimension", "batch", "--values", "1_000"], ("argument --values", "'1_000'")),
    ("value-spaces", ["--dimension", "batch", "--values", " 8 "], ("argument --values", "' 8 '")),
    ("value-4300-digits", ["--dimension", "batch", "--values", DIGITS_4300], ("argument --values",)),
    ("value-exponent", ["--dimension", "batch", "--values", "1e3"], ("argument --values", "'1e3'")),
    ("value-hex", ["--dimension", "batch", "--values", "0x10"], ("argument --values", "'0x10'")),
    ("value-over-the-batch-limit", ["--dimension", "batch", "--values", str(2**21)],
     ("batch must be at most 1048576, got 2097152",)),
    ("value-over-every-limit", ["--dimension", "hidden", "--values", str(2**23)], ("argument --values", "4194304")),
    ("tensor-too-large", ["--dimension", "batch", "--values", str(2**20), "--context", str(2**20),
                          "--width", "4096"], ("batch=1048576: ",)),
    ("start-without-max", ["--dimension", "batch", "--start", "4"], ("start needs max",)),
    ("start-above-max", ["--dimension", "batch", "--start", "4", "--max", "2"], ("start <= max", "start=4 max=2")),
    ("values-and-max", ["--dimension", "batch", "--values", "1", "--max", "8"], ("not both",)),
    ("values-and-start", ["--dimension", "batch", "--values", "1", "--start", "1"], ("not allowed with argument",)),
    ("budget-zero", ["--dimension", "batch", "--values", "1", "--budget-gib", "0"], ("budget must be > 0",)),
    ("budget-negative", ["--dimension", "batch", "--values", "1", "--budget-gib", "-1"],
     ("argument --budget-gib", "-1")),
    ("budget-nan", ["--dimension", "batch", "--values", "1", "--budget-gib", "nan"], ("argument --budget-gib", "nan")),
    ("budget-inf", ["--dimension", "batch", "--values", "1", "--budget-gib", "inf"], ("argument --budget-gib", "inf")),
    ("budget-exponent", ["--dimension", "batch", "--values", "1", "--budget-gib", "1e3"],
     ("argument --budget-gib", "1e3")),
    ("budget-arabic-indic", ["--dimension", "batch", "--values", "1", "--budget-gib", "\u0661"],
     ("argument --budget-gib", "\u0661")),
    ("budget-4300-digits", ["--dimension", "batch", "--values", "1", "--budget-gib", DIGITS_4300],
     ("argument --budget-gib",)),
    ("budget-below-one-byte", ["--dimension", "batch", "--values", "1", "--budget-gib", "0.0000000001"],
     ("at least one byte",)),
    ("timeout-zero", ["--dimension", "batch", "--values", "1", "--point-timeout-seconds", "0"],
     ("argument --point-timeout-seconds", "0")),
    ("timeout-decimal", ["--dimension", "batch", "--values", "1", "--point-timeout-seconds", "1.5"],
     ("argument --point-timeout-seconds", "1.5")),
    ("width-zero", ["--dimension", "batch", "--values", "1", "--width", "0"], ("argument --width", "0")),
    ("dtype-float64", ["--dimension", "batch", "--values", "1", "--dtype", "float64"], ("invalid choice: 'float64'",)),
    ("device-cpu", ["--dimension", "batch", "--values", "1", "--device", "cpu"], ("--device", "cuda:N", "cpu")),
    ("device-unicode-digit", ["--dimension", "batch", "--values", "1", "--device", "cuda:\u0661"],
     ("--device", "cuda:N")),
    ("seed-negative", ["--dimension", "batch", "--values", "1", "--seed", "-1"], ("argument --seed", "-1")),
    ("repeats-too-many", ["--dimension", "batch", "--values", "1", "--repeats", "10001"],
     ("argument --repeats", "10000")),
    ("unknown-flag", ["--dimension", "batch", "--values", "1", "--frobnicate"], ("unrecognized arguments",)),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in USAGE_CASES], ids=[c[0] for c in USAGE_CASES])
def test_bad_request_exits_2_with_one_line_and_creates_nothing(tmp_path, fake, monkeypatch, capsys, argv, message):
    program = fake("batch")
    use(monkeypatch, program)
    out = tmp_path / "out"
    assert main(argv + ["--output-dir", str(out)]) == 2
    line = only_line(capsys.readouterr().err)
    assert line.startswith("sweep: error: ") and all(fragment in line for fragment in message), line
    assert not out.exists() and program.calls() == []


def folder_cases(tmp_path: Path):
    (tmp_path / "a-file").write_text("x")
    read_only = Path("/sys/kernel/sweep-out") if os.geteuid() == 0 else tmp_path / "locked" / "out"
    if os.geteuid() != 0:
        read_only.parent.mkdir(mode=0o500)
    return {
        "under-a-file": (tmp_path / "a-file" / "out", "a parent is not a folder"),
        "name-of-300-characters": (tmp_path / LONG_NAME, "longer than"),
        "read-only-parent": (read_only, "cannot create"),
        "missing-parent": (tmp_path / "missing" / "out", "parent folder does not exist"),
        "an-existing-file": (tmp_path / "a-file", "already exists"),
        "empty-name": (Path(""), "already exists"),
    }


@pytest.mark.parametrize("case", ["under-a-file", "name-of-300-characters", "read-only-parent", "missing-parent",
                                  "an-existing-file", "empty-name"])
def test_bad_output_dir_exits_2_naming_it_and_creates_nothing(tmp_path, fake, monkeypatch, capsys, case):
    program = fake("batch")
    use(monkeypatch, program)
    out, message = folder_cases(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["--dimension", "batch", "--values", "1", "--output-dir", str(out)]) == 2
    line = only_line(capsys.readouterr().err)
    assert message in line and str(out) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before and program.calls() == []
    if case == "read-only-parent":
        assert not os.path.lexists(out)


def test_existing_output_dir_is_refused_and_left_untouched(tmp_path, fake, monkeypatch, capsys):
    use(monkeypatch, fake("batch"))
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["--dimension", "batch", "--values", "1", "--output-dir", str(out)]) == 2
    assert "already exists" in only_line(capsys.readouterr().err)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


ENVIRONMENT_CASES = [
    ("no-gpu-without-budget", NO_GPU, [], "no GPU is visible at cuda:0 (torch.cuda.is_available() is False)"),
    ("no-gpu-with-budget", NO_GPU, ["--budget-gib", "80"], "no GPU is visible at cuda:0"),
    ("no-gpu-with-tiny-budget", NO_GPU, ["--budget-gib", "0.0009765625"], "no GPU is visible"),
    ("usable-memory-unavailable", {**VISIBLE, "usable_memory_bytes": "unavailable",
                                   "usable_memory_unavailable_reason": "no allocation succeeded"}, [],
     "the usable memory of cuda:0 is unknown (no allocation succeeded); give --budget-gib"),
    ("usable-memory-not-a-number", {**VISIBLE, "usable_memory_bytes": True}, [], "give --budget-gib"),
    ("environment-not-json", "garbage", [], "cannot read the environment of cuda:0: exit code 0, no JSON report"),
    ("environment-crashes", "crash", [], "cannot read the environment of cuda:0: RuntimeError: driver exploded"),
]


@pytest.mark.parametrize("environment, extra, message", [c[1:] for c in ENVIRONMENT_CASES],
                         ids=[c[0] for c in ENVIRONMENT_CASES])
def test_environment_that_cannot_sweep_exits_2_before_anything(tmp_path, fake, monkeypatch, capsys,
                                                                environment, extra, message):
    program = fake("batch", environment=environment)
    use(monkeypatch, program)
    out = tmp_path / "out"
    assert main(["--dimension", "batch", "--values", "1", *extra, "--output-dir", str(out)]) == 2
    line = only_line(capsys.readouterr().err)
    assert line.startswith("sweep: error: ") and message in line
    assert not out.exists() and program.calls() == []


def reason_of_invalid_file(path: Path, content: bytes) -> str:
    """What read_measurement says about `content` at `path` (the sweep removed its copy)."""
    path.write_bytes(content)
    try:
        read_measurement(path)
    except LabError as exc:
        return " ".join(f"not a valid measurement: {exc}".split())[:300]
    finally:
        path.unlink()
    raise AssertionError("the content was valid")


# (mode of point 2, its status, its reason or a callable(out) giving it, exit code)
CHILD_CASES = [
    ("oom-report", "oom", OOM_REASON, 0),
    ("cuda-error-report", "error", CUDA_REASON, 1),
    ("exit-3-without-report", "error", "measure exited with code 3 without a readable failure report; "
     "mesure_memoire: error: phase inputs failed: something", 1),
    ("exit-3-with-truncated-report", "error", "measure exited with code 3 without a readable failure report; "
     "nothing on stderr", 1),
    ("killed-by-a-signal", "error", "measure was killed by SIGKILL", 1),
    ("garbage-file", "error", lambda out: reason_of_invalid_file(out / "batch-2.json", b"\x00\xff not JSON at all"), 1),
    ("not-a-measurement", "error", lambda out: reason_of_invalid_file(
        out / "batch-2.json", b'{"kind": "iteragpu-lab measurement", "phases": []}'), 1),
    ("another-configuration", "error", "batch-2.json measures another configuration: seed=1 (expected 0)", 1),
    ("exit-0-without-file", "error", "measure exited with code 0 but wrote no batch-2.json", 1),
    ("usage-error", "error", "mesure_memoire: error: bfloat16 is not supported on cuda:0", 1),
    ("noisy-stderr", "error", "=last " + "x" * 294, 1),  # the last line, cut at 300 characters
    ("exit-leaving-a-grandchild", "error", "measure exited with code 2", 1),
]
MODES = {"oom-report": "oom", "cuda-error-report": "cuda_error", "exit-3-without-report": "exit3_no_report",
         "exit-3-with-truncated-report": "exit3_garbage_report", "killed-by-a-signal": "signal",
         "garbage-file": "garbage", "not-a-measurement": "not_measurement", "another-configuration": "wrong_config",
         "exit-0-without-file": "no_file", "usage-error": "usage", "noisy-stderr": "noisy",
         "exit-leaving-a-grandchild": "exit_leaving_grandchild"}


@pytest.mark.parametrize("status, reason, code", [c[1:] for c in CHILD_CASES], ids=[c[0] for c in CHILD_CASES])
def test_failed_point_stays_in_the_summary_and_stops_the_sweep(tmp_path, fake, monkeypatch, capsys, request,
                                                               status, reason, code):
    case = request.node.callspec.id
    program = fake("batch", fail_above=1, mode=MODES[case])
    use(monkeypatch, program)
    out = tmp_path / "out"
    argv = ["--dimension", "batch", "--values", "1", "2", "4", "--bisect", "--json", "--output-dir", str(out)]
    assert main(argv) == code
    captured = capsys.readouterr()
    assert captured.err == ""
    rows = sweep.read_summary(out / "summary.csv")
    reason = reason(out) if callable(reason) else reason
    assert rows == [expected_row("batch", 1, "ok"), expected_row("batch", 2, status, reason=reason)]
    assert json.loads(captured.out)["rows"] == rows
    assert program.calls() == [1, 2]  # stopped: 4 never run, no bisection after an error
    assert sorted(p.name for p in out.iterdir()) == ["batch-1.json", "summary.csv"]  # no file of point 2


def test_noisy_reason_is_stored_formula_safe(tmp_path, fake):
    program = fake("batch", fail_above=0, mode="noisy")
    out = tmp_path / "out"
    sweep.run_sweep("batch", out, values=[1], measure_command=program.command, progress=False)
    line = (out / "summary.csv").read_text(encoding="utf-8").splitlines()[1]
    assert ",'=last xxx" in line  # a spreadsheet shows it as text, never runs it


def process_gone(pid: int) -> bool:
    """True once `pid` no longer runs (a zombie counts as gone: it holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("mode", ["hang", "hang_group"])
def test_hanging_point_is_killed_with_its_group_and_recorded_as_timeout(tmp_path, fake, monkeypatch, capsys, mode):
    program = fake("batch", fail_above=0, mode=mode)
    use(monkeypatch, program)
    out = tmp_path / "out"
    started = time.monotonic()
    assert main(["--dimension", "batch", "--values", "1", "2", "--bisect", "--point-timeout-seconds", "1",
                 "--output-dir", str(out)]) == 1
    # a hang guard only (the hanging child would sleep far longer): the 1 s timeout ends it in about
    # a second on an idle machine; 120 s leaves any loaded machine room
    assert time.monotonic() - started < 120
    assert capsys.readouterr().err == ""
    assert sweep.read_summary(out / "summary.csv") == [expected_row(
        "batch", 1, "timeout", reason="no result within 1 s; its process group was killed")]
    assert program.calls() == [1]
    assert sorted(p.name for p in out.iterdir()) == ["summary.csv"]
    if mode == "hang_group":
        pid = int(program.pidfile.read_text())
        deadline = time.monotonic() + 60  # waits for the kill to land, not a speed bound
        while not process_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(pid), "the measure child's own child survived"


def test_a_grandchild_left_behind_does_not_hold_the_sweep(tmp_path, fake):
    program = fake("batch", fail_above=0, mode="exit_leaving_grandchild")
    started = time.monotonic()
    rows = sweep.run_sweep("batch", tmp_path / "out", values=[1], measure_command=program.command,
                           point_timeout_seconds=2, progress=False)
    assert time.monotonic() - started < 120  # a hang guard: the grandchild must not hold the sweep open
    assert [(r["status"], r["reason"]) for r in rows] == [("error", "measure exited with code 2")]
    pid = int(program.pidfile.read_text())
    deadline = time.monotonic() + 10
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(pid)


def test_interrupting_the_sweep_kills_the_running_point_and_keeps_no_file(tmp_path, fake):
    """Interrupting a notebook cell raises KeyboardInterrupt: the point's process group goes with it."""
    program = fake("batch", fail_above=0, mode="hang_group")

    def interrupt_once_the_point_runs():
        deadline = time.monotonic() + 30
        while not program.pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    # a process started in the background by a shell without job control (nohup ... &) inherits SIGINT
    # ignored, and then interrupt_main does nothing: the test sets Python's own handler, as a kernel has it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_the_point_runs, daemon=True).start()
        out = tmp_path / "out"
        with pytest.raises(KeyboardInterrupt):
            sweep.run_sweep("batch", out, values=[1], measure_command=program.command, progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    pid = int(program.pidfile.read_text())
    deadline = time.monotonic() + 10
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(pid)
    assert list(out.iterdir()) == []


def test_command_line_interrupted_exits_130_with_one_line(tmp_path, fake, monkeypatch, capsys):
    program = fake("batch")
    use(monkeypatch, program)
    real = sweep.run_child

    def interrupted_at_the_second_point(argv, timeout_seconds):
        if argv[len(program.command)] == "measure" and str(argv[argv.index("--batch") + 1]) == "2":
            raise KeyboardInterrupt
        return real(argv, timeout_seconds)

    monkeypatch.setattr(sweep, "run_child", interrupted_at_the_second_point)
    out = tmp_path / "out"
    assert main(["--dimension", "batch", "--values", "1", "2", "--output-dir", str(out)]) == 130
    assert only_line(capsys.readouterr().err) == (
        f"sweep: interrupted; {out / 'summary.csv'} holds the points that finished")
    assert sweep.read_summary(out / "summary.csv") == [expected_row("batch", 1, "ok")]
    assert sorted(p.name for p in out.iterdir()) == ["batch-1.json", "summary.csv"]


def test_interrupted_point_leaves_no_file(tmp_path, fake, monkeypatch):
    program = fake("batch")
    real = sweep.run_child

    def measured_then_interrupted(argv, timeout_seconds):
        answer = real(argv, timeout_seconds)
        if argv[len(program.command)] == "measure":  # the file is written, then the user interrupts
            raise KeyboardInterrupt
        return answer

    monkeypatch.setattr(sweep, "run_child", measured_then_interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep("batch", out, values=[1], measure_command=program.command, progress=False)
    assert program.calls() == [1] and list(out.iterdir()) == []


PYTHON_CASES = [
    ("values-strings", dict(values=["1", "2"]), "positive whole numbers"),
    ("values-bool", dict(values=[True]), "positive whole numbers"),
    ("values-float", dict(values=[1.0]), "positive whole numbers"),
    ("values-empty", dict(values=[]), "positive whole numbers"),
    ("values-a-string", dict(values="12"), "positive whole numbers"),
    ("start-float", dict(start=1.5, maximum=4), "whole numbers"),
    ("budget-nan", dict(values=[1], budget_gib=float("nan")), "budget must be > 0"),
    ("budget-inf", dict(values=[1], budget_gib=float("inf")), "budget must be > 0"),
    ("budget-bool", dict(values=[1], budget_gib=True), "budget must be > 0"),
    ("budget-string", dict(values=[1], budget_gib="8"), "budget must be > 0"),
    ("timeout-negative", dict(values=[1], point_timeout_seconds=-1), "point timeout"),
    ("timeout-nan", dict(values=[1], point_timeout_seconds=float("nan")), "point timeout"),
    ("config-not-a-config", dict(values=[1], config={"batch": 1}), "MeasureConfig"),
    ("command-bytes", dict(values=[1], measure_command=b"print()"), "measure_command"),
    ("command-a-string", dict(values=[1], measure_command="python mesure_memoire.py"), "measure_command"),
    ("command-empty", dict(values=[1], measure_command=[]), "measure_command"),
    ("command-not-text", dict(values=[1], measure_command=[sys.executable, 3]), "measure_command"),
    ("command-missing", dict(values=[1], measure_command=["/nonexistent/python3"]),
     "cannot run /nonexistent/python3: No such file or directory"),
]


@pytest.mark.parametrize("kwargs, message", [c[1:] for c in PYTHON_CASES], ids=[c[0] for c in PYTHON_CASES])
def test_bad_python_call_raises_sweep_error_and_creates_nothing(tmp_path, kwargs, message):
    out = tmp_path / "out"
    with pytest.raises(sweep.SweepError, match=message):
        sweep.run_sweep("batch", out, progress=False, **kwargs)
    assert not out.exists()


@pytest.mark.parametrize("output_dir", [None, 3, "out\0put", b"out"], ids=["none", "number", "nul-byte", "bytes"])
def test_bad_output_dir_in_python_raises_sweep_error(tmp_path, monkeypatch, output_dir):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sweep.SweepError, match="output_dir must be a path"):
        sweep.run_sweep("batch", output_dir, values=[1], progress=False)
    assert list(tmp_path.iterdir()) == []


def test_command_line_without_gpu_refuses_even_with_a_budget(tmp_path):
    """The real program, in a real process: without a GPU nothing can be measured, so nothing starts."""
    from conftest import cuda_available
    if cuda_available():
        pytest.skip("a GPU is visible here")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "lab_helpers.sweep", "--dimension", "batch", "--values", "1",
                             "--budget-gib", "1", "--output-dir", str(out)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    line = only_line(result.stderr)
    assert line.startswith("sweep: error: no GPU is visible at cuda:0 (")
    assert not out.exists()


def test_command_line_unicode_digits_in_a_real_process(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "lab_helpers.sweep", "--dimension", "batch", "--values",
                             "\u0661", "--output-dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "argument --values" in only_line(result.stderr)
    assert not out.exists()


@pytest.mark.parametrize("given", ["taken", "./taken/", "{cwd}/taken", "{cwd}/missing/out"])
def test_output_dir_shown_as_given(tmp_path, fake, monkeypatch, capsys, given):
    use(monkeypatch, fake("batch"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").mkdir()
    given = given.format(cwd=tmp_path)
    assert main(["--dimension", "batch", "--values", "1", "--output-dir", given]) == 2
    line = only_line(capsys.readouterr().err)
    assert line in (f"sweep: error: {given} already exists; choose a new folder",
                    f"sweep: error: cannot create {given}: its parent folder does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fakes", "taken"]


HEADER = ",".join(sweep.SUMMARY_COLUMNS)
BAD_SUMMARIES = [
    ("empty", "", "line 1: the header is not"),
    ("other-header", "a,b,c\n1,2,3\n", "line 1: the header is not"),
    ("short-row", HEADER + "\nbatch,1,sweep\n", "line 2: not 10 cells"),
    ("long-row", HEADER + "\nbatch,1,sweep,ok,,1,2,1,2,f.json,extra\n", "line 2: not 10 cells"),
    ("value-not-a-number", HEADER + "\nbatch,one,sweep,ok,,1,2,1,2,f.json\n", "line 2: value is not a whole number"),
    ("bytes-negative", HEADER + "\nbatch,1,sweep,ok,,-1,2,1,2,f.json\n", "line 2: predicted_peak_allocated_bytes"),
    ("bytes-unicode-digits", HEADER + "\nbatch,1,sweep,ok,,\u0661,2,1,2,f.json\n", "line 2: predicted_peak_allocated"),
    ("value-empty", HEADER + "\nbatch,,sweep,ok,,1,2,1,2,f.json\n", "line 2: value is not a whole number"),
    ("not-utf8", None, "cannot read"),
    ("a-folder", "folder", "cannot read"),
]


@pytest.mark.parametrize("text, message", [c[1:] for c in BAD_SUMMARIES], ids=[c[0] for c in BAD_SUMMARIES])
def test_bad_summary_file_is_one_sweep_error_naming_the_line(tmp_path, text, message):
    path = tmp_path / "summary.csv"
    if text == "folder":
        path.mkdir()
    elif text is None:
        path.write_bytes(HEADER.encode() + b"\nbatch,1,sweep,ok,\xff\xfe,1,2,1,2,f.json\n")
    else:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(sweep.SweepError, match=re.escape(message)) as caught:
        sweep.plot_sweep(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
