"""Sweep one size of the synthetic network upward, one fresh measure process per point.

The command line (lab_helpers/views/sweep_commands.py):

    python -m lab_helpers.sweep --dimension batch --values 1 2 4 8 --output-dir balayage-batch
    python -m lab_helpers.sweep --dimension context --start 256 --max 65536 --bisect --plot \\
        --width 1024 --dtype bfloat16 --output-dir balayage-context

Refuses to start without a visible GPU. Stops before a point whose predicted peak reserved
bytes exceed the budget (default: the device's usable memory), at the first point that runs
out of memory, fails or exceeds its time limit. Writes one measurement file per point and
summary.csv into a new folder.
"""
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from lab_helpers.core.errors import EXIT_OK, EXIT_PHASE, LabError
from lab_helpers.core.files import csv_text, display_path, read_bounded_text, read_json_file, replace_text
from lab_helpers.core.numbers import GIB, MIB
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.measurement.schema import MAX_BATCH, MAX_CONTEXT, MAX_HIDDEN, MAX_WIDTH, read_measurement
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.predict import predict
from lab_helpers.views.plots import drawn_text, plain_texts

DIMENSIONS = ("batch", "context", "width", "hidden")
SIZE_LIMITS = {"batch": MAX_BATCH, "context": MAX_CONTEXT, "width": MAX_WIDTH, "hidden": MAX_HIDDEN}
SUMMARY_NAME = "summary.csv"
PLOT_NAME = "sweep.png"
SUMMARY_COLUMNS = ("dimension", "value", "stage", "status", "reason",
                   "predicted_peak_allocated_bytes", "predicted_peak_reserved_bytes",
                   "measured_peak_allocated_bytes", "measured_peak_reserved_bytes", "file")
BYTE_COLUMNS = SUMMARY_COLUMNS[5:9]
MAX_BUDGET_BYTES = 2**50  # the largest budget any command of the lab accepts
OK, OOM, OVER_BUDGET, ERROR, TIMEOUT = "ok", "oom", "over_budget", "error", "timeout"
SWEEP, BISECT, CONFIRM = "sweep", "bisect", "confirm"
DEFAULT_POINT_TIMEOUT_SECONDS = 1800  # a point of the synthetic network takes seconds; this catches a hang
ENVIRONMENT_TIMEOUT_SECONDS = 600  # environment probes usable memory in its own child, within 180 s
FAILURE_REPORT_KIND = "iteragpu-lab measure failure"
OUT_OF_MEMORY = "out_of_memory"
# the generated standalone file: it runs alone, so a child needs nothing of the package
MEASURING_FILE = Path("lab_helpers") / "mesure_memoire.py"
MAX_REASON_CHARS = 300
MAX_CHILD_OUTPUT_BYTES = 2**20  # an environment report is a few KiB; stderr's last line is what counts


class SweepError(LabError):
    """A bad sweep request: one line, exit code 2, nothing created."""


# ------------------------------------------------------------ child processes
def run_child(argv, timeout_seconds):
    """Run `argv` in its own process group; return (exit code, stdout, stderr), exit code None when it
    was killed at `timeout_seconds`. The group is ended once the child is done, so no grandchild keeps
    the GPU; output goes through files, so a grandchild holding a pipe open cannot stall the sweep."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                   start_new_session=True)
        finished = False
        try:
            finished = _wait_unreaped(process, timeout_seconds)
        finally:  # an interrupted notebook cell must not leave a child on the GPU either
            _end_group(process)
        return (process.returncode if finished else None), _tail(out, MAX_CHILD_OUTPUT_BYTES), \
            _tail(err, MAX_CHILD_OUTPUT_BYTES)


def _wait_unreaped(process, timeout_seconds) -> bool:
    """Wait until `process` exits, without reaping it: its pid, which is its group's id, stays taken
    until the group is ended, so no other process group can be hit. False at the time limit."""
    if not hasattr(os, "waitid"):
        try:
            process.wait(timeout=timeout_seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout_seconds
    delay = 0.001
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, 0.05)
    return True


def _end_group(process) -> None:
    """Kill what is left of the child's process group, then reap the child."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):  # AttributeError: no killpg (Windows)
        if process.poll() is None:
            process.kill()
    process.wait()


def _tail(handle, limit: int) -> str:
    """The last `limit` bytes written to `handle`, as text."""
    size = handle.seek(0, os.SEEK_END)
    handle.seek(max(0, size - limit))
    return handle.read().decode("utf-8", errors="replace")


def measuring_program() -> list:
    """Return the argv prefix that runs the measuring program: this Python on the checkout's generated
    mesure_memoire.py. `-P` keeps the script's own folder off sys.path, so no module lying there can
    stand in for the standard library's."""
    script = REPOSITORY / MEASURING_FILE
    if not script.is_file():
        raise SweepError(f"cannot find the measuring program {script}: run this from the lab's checkout "
                         "(a notebook from its notebooks/ folder), or pass measure_command=")
    return [sys.executable, "-P", str(script)]


def read_environment(program, device, usable_memory=True, timeout_seconds=ENVIRONMENT_TIMEOUT_SECONDS) -> dict:
    """Return the `environment` report of `device`, run in a child so this process holds no CUDA context;
    `usable_memory=False` skips the probe of usable memory (a budget was given)."""
    argv = [*program, "environment", "--device", device, *([] if usable_memory else ["--no-usable-memory"])]
    try:
        code, stdout, stderr = run_child(argv, timeout_seconds)
    except OSError as exc:  # the program itself cannot start
        raise SweepError(f"cannot run {display_path(str(program[0]))}: {exc.strerror or type(exc).__name__}") from None
    if code is None:
        raise SweepError(f"the environment of {device} gave no answer within {timeout_seconds} s")
    try:
        report = json.loads(stdout) if code == EXIT_OK else None
    except ValueError:
        report = None
    if not isinstance(report, dict):
        raise SweepError(f"cannot read the environment of {device}: "
                         f"{_last_line(stderr) or f'exit code {code}, no JSON report'}")
    return report


def budget_bytes(report, device, budget_gib=None) -> int:
    """The budget in bytes: `budget_gib`, else the usable memory `report` gives; refuse without a GPU."""
    if report.get("device_visible") is not True:
        why = report.get("device_unavailable_reason") or report.get("torch_unavailable_reason") or "not visible"
        raise SweepError(f"no GPU is visible at {device} ({one_line_text(why)}); a sweep measures every point on "
                         "the GPU, never on the CPU")
    if budget_gib is not None:
        return int(budget_gib * GIB)
    usable = report.get("usable_memory_bytes")
    if isinstance(usable, bool) or not isinstance(usable, int) or usable <= 0:
        why = report.get("usable_memory_unavailable_reason") or f"usable_memory_bytes is {usable!r}"
        raise SweepError(f"the usable memory of {device} is unknown ({one_line_text(why)}); give --budget-gib")
    return usable


# ------------------------------------------------------------------- points
def sweep_values(values=None, start=None, maximum=None) -> list:
    """Return the points: `values` as given (strictly increasing) or start, 2*start, ... <= maximum."""
    if (values is None) == (start is None) or (values is not None and maximum is not None):
        raise SweepError("give either values, or start and max, not both")
    if values is None:
        if maximum is None:
            raise SweepError("start needs max: the last value allowed when doubling")
        if not all(_is_whole(v) for v in (start, maximum)) or not 0 < start <= maximum:
            raise SweepError(f"need whole numbers 0 < start <= max, got start={start!r} max={maximum!r}")
        values = [start]
        while values[-1] * 2 <= maximum:
            values.append(values[-1] * 2)
    values = list(values) if isinstance(values, (list, tuple, range)) else values
    if not isinstance(values, list) or not values or not all(_is_whole(v) and v > 0 for v in values):
        raise SweepError(f"values must be positive whole numbers, got {_short(values)}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise SweepError(f"values must be strictly increasing, got {_short(values)}")
    return values


def predicted_peaks(config) -> tuple:
    """(peak allocated, peak reserved) bytes predicted for `config`, the largest over the phases."""
    phases = predict(config)["phases"]
    return max(p["peak_allocated_bytes"] for p in phases), max(p["peak_reserved_bytes"] for p in phases)


def largest_predicted_fit(config, dimension, low, high, budget) -> int:
    """Bisect on the prediction alone: the largest value in [low, high) whose predicted peak reserved
    fits `budget`, given that `low` fits (or is 0) and `high` does not."""
    while high - low > 1:
        middle = (low + high) // 2
        if predicted_peaks(replace(config, **{dimension: middle}))[1] <= budget:
            low = middle
        else:
            high = middle
    return low


def measure_point(config, dimension, value, folder, budget, program, stage,
                  timeout_seconds=DEFAULT_POINT_TIMEOUT_SECONDS, report_path=None) -> dict:
    """Predict, then (within budget) measure one point in a fresh process; return its summary row."""
    point = replace(config, **{dimension: value}).checked()
    row = dict.fromkeys(SUMMARY_COLUMNS)  # None: not measured
    allocated, reserved = predicted_peaks(point)
    row.update(dimension=dimension, value=value, stage=stage, reason="", file="",
               predicted_peak_allocated_bytes=allocated, predicted_peak_reserved_bytes=reserved)
    if reserved > budget:
        row.update(status=OVER_BUDGET, reason=f"predicted peak reserved {reserved} bytes > budget {budget} bytes; not run")
        return row
    path = Path(folder) / f"{dimension}-{value}.json"
    report = Path(report_path) if report_path is not None else Path(folder) / f".{path.stem}.failure.json"
    flags = ["--device", point.device, "--batch", point.batch, "--context", point.context,
             "--width", point.width, "--hidden", point.hidden, "--dtype", point.dtype,
             "--warmup", point.warmup, "--repeats", point.repeats, "--seed", point.seed]
    try:
        code, _, stderr = run_child([*program, "measure", *flags, "--output", path, "--failure-report", report],
                                    timeout_seconds)
        status, reason, document = _outcome(code, stderr, path, report, point, timeout_seconds)
    except BaseException:  # interrupted: the point is in no summary, so its file goes too
        _discard(path)
        raise
    finally:
        _remove(report)
    if status != OK:
        _discard(path)  # a failed point leaves no file: the folder holds measurements only
        row.update(status=status, reason=reason)
        return row
    phases = document["phases"]
    row.update(status=OK, file=path.name,
               measured_peak_allocated_bytes=max(p["peak_allocated_bytes"] for p in phases),
               measured_peak_reserved_bytes=max(p["peak_reserved_bytes"] for p in phases))
    return row


def _outcome(code, stderr, path, report, point, timeout_seconds) -> tuple:
    """(status, reason, document) of a finished measure child; OK only for a valid file of this point."""
    if code is None:
        return TIMEOUT, f"no result within {timeout_seconds} s; its process group was killed", None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return ERROR, f"measure was killed by {name}", None
    if code == EXIT_PHASE:
        return (*_failure_report_outcome(report, stderr), None)
    if code != EXIT_OK:
        return ERROR, _last_line(stderr) or f"measure exited with code {code}", None
    if not os.path.lexists(path):
        return ERROR, f"measure exited with code 0 but wrote no {path.name}", None
    try:
        document = read_measurement(path)
    except LabError as exc:
        return ERROR, one_line_text(f"not a valid measurement: {exc}"), None
    expected = asdict(point)
    found = {key: document["configuration"].get(key) for key in expected}
    if found != expected:
        wrong = [f"{key}={found[key]!r} (expected {expected[key]!r})" for key in expected if found[key] != expected[key]]
        return ERROR, one_line_text(f"{path.name} measures another configuration: {', '.join(wrong)}"), None
    return OK, "", document


def _failure_report_outcome(report, stderr) -> tuple:
    """measure exited 3: its failure report says whether the phase ran out of memory."""
    try:
        document = read_json_file(report, max_bytes=2**20)
    except LabError:
        document = None
    if not (isinstance(document, dict) and document.get("kind") == FAILURE_REPORT_KIND
            and isinstance(document.get("reason"), str)):
        return ERROR, one_line_text(f"measure exited with code 3 without a readable failure report; "
                                f"{_last_line(stderr) or 'nothing on stderr'}")
    message = document.get("message") if isinstance(document.get("message"), str) else ""
    phase = document.get("phase") if isinstance(document.get("phase"), str) else "?"
    reason = one_line_text(f"phase {phase}: {message or document['reason']}")
    return (OOM if document["reason"] == OUT_OF_MEMORY else ERROR), reason


def _discard(path: Path) -> None:
    """Remove a point's file and any temporary file its writer left beside it."""
    _remove(path)
    for stray in path.parent.glob(f".{path.name}.*"):
        _remove(stray)


def _remove(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------ summary
def summary_text(rows) -> str:
    """The summary.csv text of `rows` (formula-safe, numbers as numbers, None as empty)."""
    return csv_text(SUMMARY_COLUMNS, [[row[key] for key in SUMMARY_COLUMNS] for row in rows])


def write_summary(rows, folder) -> Path:
    """Replace summary.csv in `folder` whole (temporary file, then rename)."""
    path = Path(folder) / SUMMARY_NAME
    replace_text(path, summary_text(rows))
    return path


MAX_SUMMARY_BYTES = 16 * 2**20  # a summary holds one short line per point


def read_summary(path) -> list:
    """Read a summary.csv back into rows, byte counts as int (None where not measured); raise SweepError
    naming the file and line of the first fault."""
    import csv
    shown = os.fspath(path)
    try:  # bounded: a summary holds one line per point
        text = read_bounded_text(path, MAX_SUMMARY_BYTES, "sweep summary")
    except LabError as exc:  # the message starts with the path
        raise SweepError(f"cannot read {exc}") from None
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if tuple(reader.fieldnames or ()) != SUMMARY_COLUMNS:
            raise SweepError(f"{shown}: line 1: the header is not {','.join(SUMMARY_COLUMNS)}")
        rows = [(reader.line_num, row) for row in reader]
    except csv.Error as exc:
        raise SweepError(f"cannot read {shown}: {one_line_text(getattr(exc, 'strerror', None) or exc)}") from None
    for line, row in rows:
        if None in row or None in row.values():
            raise SweepError(f"{shown}: line {line}: not {len(SUMMARY_COLUMNS)} cells")
        for key, text in row.items():  # undo csv_text's guard against spreadsheet formulas
            if text[:1] == "'" and text[1:2] in ("=", "+", "-", "@", "\t", "\r"):
                row[key] = text[1:]
        for key in ("value", *BYTE_COLUMNS):
            text = row[key]
            if text == "" and key != "value":
                row[key] = None
            elif re.fullmatch(r"[0-9]{1,20}", text):
                row[key] = int(text)
            else:
                raise SweepError(f"{shown}: line {line}: {key} is not a whole number: {_short(text)}")
    return [row for _, row in rows]


# -------------------------------------------------------------------- sweep
def _check_request(dimension, values, start, maximum, config, budget_gib, point_timeout_seconds):
    """Validate a sweep request once; return (points, config). Raise SweepError on any fault."""
    if dimension not in DIMENSIONS:
        raise SweepError(f"dimension must be one of {', '.join(DIMENSIONS)}, got {_short(dimension)}")
    points = sweep_values(values, start, maximum)
    if points[-1] > SIZE_LIMITS[dimension]:
        raise SweepError(f"{dimension} must be at most {SIZE_LIMITS[dimension]}, got {_short(points[-1])}")
    config = config if config is not None else MeasureConfig()
    if not isinstance(config, MeasureConfig):
        raise SweepError(f"config must be a MeasureConfig, got {type(config).__name__}")
    try:
        for value in points:  # a MeasureConfig validates itself when built
            replace(config, **{dimension: value})
    except LabError as exc:
        raise SweepError(f"{dimension}={value}: {exc}") from None
    if budget_gib is not None:
        if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) \
                or not 0 < budget_gib < math.inf:
            raise SweepError(f"budget must be > 0 GiB and finite, got {_short(budget_gib)}")
        if int(budget_gib * GIB) < 1:
            raise SweepError(f"budget must be at least one byte, got {budget_gib} GiB")
        # a budget is whole bytes: 0.1 GiB is 107374182.4 bytes, which no allocator can hold to
        if budget_gib * GIB != int(budget_gib * GIB):
            raise SweepError(f"budget must be a whole number of bytes, got {budget_gib} GiB = "
                             f"{budget_gib * GIB} bytes")
        if budget_gib * GIB > MAX_BUDGET_BYTES:
            raise SweepError(f"budget must be at most {MAX_BUDGET_BYTES} bytes (2^50, {MAX_BUDGET_BYTES // GIB} GiB), "
                             f"got {budget_gib} GiB")
    if isinstance(point_timeout_seconds, bool) or not isinstance(point_timeout_seconds, (int, float)) \
            or not 0 < point_timeout_seconds < math.inf:
        raise SweepError(f"point timeout must be > 0 seconds and finite, got {_short(point_timeout_seconds)}")
    return points, config


def _check_output_dir(folder: Path, shown: str) -> None:
    """Refuse, before anything runs, a folder that exists or cannot be made (named `shown`, as the user
    wrote it); mkdir checks again."""
    if os.path.lexists(folder):
        raise SweepError(f"{shown} already exists; choose a new folder")
    parent = folder.parent
    if not parent.is_dir():
        why = "a parent is not a folder" if os.path.lexists(parent) else "its parent folder does not exist"
        raise SweepError(f"cannot create {shown}: {why}")
    try:
        longest = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        longest = 255
    if len(os.fsencode(folder.name)) > longest:
        raise SweepError(f"cannot create {shown}: its name is longer than {longest} bytes")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SweepError(f"cannot create {shown}: its parent folder is not writable")


def _make_output_dir(folder: Path, shown: str) -> None:
    try:
        folder.mkdir()  # exclusive, and no missing parent is made up
    except FileExistsError:
        raise SweepError(f"{shown} already exists; choose a new folder") from None
    except OSError as exc:
        raise SweepError(f"cannot create {shown}: {one_line_text(exc.strerror or type(exc).__name__)}") from None


def run_sweep(dimension, output_dir, values=None, start=None, maximum=None, config=None,
              budget_gib=None, bisect=False, measure_command=None, progress=True,
              point_timeout_seconds=DEFAULT_POINT_TIMEOUT_SECONDS) -> list:
    """Measure `dimension` at each value until one does not fit or fails; return the summary rows.

    `measure_command`: argv prefix running the measuring program, to which the sweep appends
    `environment ...` once, then `measure ...` per point (default: measuring_program(), this Python
    on the checkout's generated mesure_memoire.py)."""
    points, config = _check_request(dimension, values, start, maximum, config, budget_gib, point_timeout_seconds)
    if not isinstance(output_dir, (str, os.PathLike)) or "\0" in os.fspath(output_dir):
        raise SweepError(f"output_dir must be a path, got {_short(output_dir)}")
    if measure_command is not None and (isinstance(measure_command, (str, bytes)) or not measure_command
                                        or not all(isinstance(a, (str, os.PathLike)) for a in measure_command)):
        raise SweepError(f"measure_command must be a list of arguments, got {_short(measure_command)}")
    folder = Path(output_dir)
    _check_output_dir(folder, os.fspath(output_dir))
    program = list(measure_command) if measure_command else measuring_program()
    with tempfile.TemporaryDirectory(prefix="sweep-") as workdir:  # the points' failure reports
        report = read_environment(program, config.device, usable_memory=budget_gib is None)
        budget = budget_bytes(report, config.device, budget_gib)
        _make_output_dir(folder, os.fspath(output_dir))
        return _run_points(dimension, folder, points, config, budget, bisect, program, progress,
                           point_timeout_seconds, workdir)


def _run_points(dimension, folder, points, config, budget, bisect, program, progress, timeout, workdir) -> list:
    rows = []
    done = {}  # value -> its row, for the values measured ok
    with tqdm(total=len(points), desc=f"sweep {dimension}", unit="point", disable=not progress) as bar:
        def run(value, stage):
            bar.set_postfix_str(f"{dimension}={value}")
            report = Path(workdir) / f"failure-{len(rows)}.json"
            row = measure_point(config, dimension, value, folder, budget, program, stage, timeout, report)
            rows.append(row)
            write_summary(rows, folder)
            bar.update()
            if row["status"] == OK:
                done[value] = row
            return row["status"]

        def confirm(value):
            bar.total += 1
            if value not in done:
                return run(value, CONFIRM)
            # already measured in a fresh process during the sweep: that measurement confirms it
            rows.append({**done[value], "stage": CONFIRM})
            write_summary(rows, folder)
            bar.update()
            return OK

        def measured_bisection(fitted, failed):
            while failed - fitted > 1:
                bar.total += 1
                middle = (fitted + failed) // 2
                status = run(middle, BISECT)
                if status in (ERROR, TIMEOUT):
                    return
                fitted, failed = (middle, failed) if status == OK else (fitted, middle)

        fitted = 0  # the largest value that fit so far; 0: none yet
        for value in points:
            status = run(value, SWEEP)
            if status != OK:
                break
            fitted = value
        else:
            return rows
        if not bisect or status not in (OOM, OVER_BUDGET):
            return rows
        if status == OOM:  # predicted to fit, yet out of memory: the prediction cannot find this limit
            measured_bisection(fitted, value)
            return rows
        best = largest_predicted_fit(config, dimension, fitted, value, budget)
        if best == 0:  # not even 1 is predicted to fit
            return rows
        status = confirm(best)  # must fit...
        if status == OK:
            bar.total += 1
            run(best + 1, CONFIRM)  # ...and the next value must not: refused by the prediction
        elif status == OOM:  # the GPU refused what the prediction allowed: measure instead
            measured_bisection(fitted, best)
    return rows


# --------------------------------------------------------------------- plot
def plot_sweep(summary, ax=None):
    """Plot measured peak allocated/reserved MiB against the dimension, the prediction beside it."""
    rows = read_summary(summary) if isinstance(summary, (str, os.PathLike)) else list(summary)
    if ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=(7, 4))[1]
    unique = {}
    for row in rows:  # a confirmation repeats a value: keep its first row
        unique.setdefault(int(row["value"]), row)
    rows = [unique[v] for v in sorted(unique)]
    done = [r for r in rows if r["status"] == OK]
    failed = [r for r in rows if r["status"] in (OOM, OVER_BUDGET)]
    for counter, color in (("allocated", "tab:blue"), ("reserved", "tab:orange")):
        ax.plot([int(r["value"]) for r in done], [r[f"measured_peak_{counter}_bytes"] / MIB for r in done],
                "o-", color=color, markersize=9, alpha=0.5, label=f"measured peak {counter}")
        # drawn on top, so that a prediction equal to the measurement still shows
        ax.plot([int(r["value"]) for r in rows], [r[f"predicted_peak_{counter}_bytes"] / MIB for r in rows],
                "x--", color=color, markersize=9, markeredgewidth=2, label=f"predicted peak {counter}")
    if failed:
        ax.plot([int(r["value"]) for r in failed], [r["predicted_peak_reserved_bytes"] / MIB for r in failed],
                "rv", linestyle="none", label="did not fit (oom / over budget)")
    dimension = drawn_text(rows[0]["dimension"]) if rows else "value"
    ax.set(xlabel=dimension, ylabel="MiB",
           title=f"Peak memory against {dimension} (x on a dot: predicted = measured)")
    if len(rows) > 1 and int(rows[-1]["value"]) >= 8 * int(rows[0]["value"]):
        ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    plain_texts([ax.title, ax.xaxis.label])
    return ax


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:MAX_REASON_CHARS] if lines else ""


def one_line_text(text: str) -> str:
    return " ".join(str(text).split())[:MAX_REASON_CHARS]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."

