"""Sweep one size of the synthetic network upward, one fresh measure process per point.

    python -m lab_helpers.sweep --dimension batch --values 1 2 4 8 --output-dir balayage-batch
    python -m lab_helpers.sweep --dimension context --start 256 --max 65536 --bisect --plot \\
        --width 1024 --dtype bfloat16 --output-dir balayage-context

Stops at the first point that runs out of memory, or before a point whose predicted
peak reserved bytes exceed the budget (default: the device's free memory). Writes one
measurement file per point and summary.csv into a new folder.
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

# >>> library only
# the notebook drops this block: its mesure_memoire cell, run before this one, defines these names
from lab_helpers.mesure_memoire import (EXIT_OK, EXIT_PHASE, EXIT_USAGE, GIB, LabError, MeasureConfig,
                                        _add_size_flags, _non_negative_int, _number, _Parser,
                                        _positive_int, predict)
# <<< library only

DIMENSIONS = ("batch", "context", "width", "hidden")
MEASURE_SCRIPT = "mesure_memoire.py"
SCRIPT_FOLDERS = (".", "lab_helpers", os.path.join("..", "lab_helpers"))  # tried from the cwd
SUMMARY_NAME = "summary.csv"
PLOT_NAME = "sweep.png"
SUMMARY_COLUMNS = ("dimension", "value", "stage", "status", "reason",
                   "predicted_peak_allocated_bytes", "predicted_peak_reserved_bytes",
                   "measured_peak_allocated_bytes", "measured_peak_reserved_bytes", "file")
BYTE_COLUMNS = SUMMARY_COLUMNS[5:9]
OK, OOM, OVER_BUDGET, ERROR = "ok", "oom", "over_budget", "error"
MEMORY_FAILURE = re.compile(r"OutOfMemoryError|out of memory|ALLOC_FAILED", re.IGNORECASE)
EXIT_STOPPED_ON_ERROR = 1  # a point failed for a reason other than memory
MAX_REASON_CHARS = 300
MIB = 2**20


class SweepError(Exception):
    """A bad sweep request: one line, exit code 2."""


def default_measure_script() -> Path:
    """Return mesure_memoire.py: next to this file, else in the cwd, ./lab_helpers or ../lab_helpers."""
    here = globals().get("__file__")  # undefined when this code runs in a notebook cell
    candidates = [Path(here).resolve().parent / MEASURE_SCRIPT] if here else []
    candidates += [Path(folder) / MEASURE_SCRIPT for folder in SCRIPT_FOLDERS]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise SweepError(f"cannot find {MEASURE_SCRIPT} (looked in: {', '.join(map(str, candidates))})")


def free_memory_bytes(device: str) -> int:
    """Free bytes on `device` as seen by mesure_memoire.environment in a fresh process."""
    # a child process, so that this one never holds a CUDA context during the sweep
    command = [sys.executable, str(default_measure_script()), "environment", "--device", device]
    result = subprocess.run(command, capture_output=True, text=True)
    try:
        free = json.loads(result.stdout).get("free_memory_bytes") if result.returncode == 0 else None
    except ValueError:
        free = None
    if free is None:
        raise SweepError(f"no GPU visible at {device}: give --budget-gib to sweep against a fixed budget")
    return int(free)


def sweep_values(values=None, start=None, maximum=None) -> list:
    """Return the points: `values` as given (strictly increasing) or start, 2*start, ... <= maximum."""
    if (values is None) == (start is None) or (values is not None and maximum is not None):
        raise SweepError("give either values, or start and max, not both")
    if values is None:
        if maximum is None:
            raise SweepError("start needs max: the last value allowed when doubling")
        if not 0 < start <= maximum:
            raise SweepError(f"need 0 < start <= max, got start={start} max={maximum}")
        values = [start]
        while values[-1] * 2 <= maximum:
            values.append(values[-1] * 2)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
        raise SweepError(f"values must be positive integers, got {list(values)}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise SweepError(f"values must be strictly increasing, got {list(values)}")
    return list(values)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:MAX_REASON_CHARS] if lines else ""


def measure_point(config, dimension, value, folder, budget, command, stage) -> dict:
    """Predict, then (within budget) measure one point in a fresh process; return its summary row."""
    point = replace(config, **{dimension: value}).checked()
    phases = predict(point)["phases"]
    row = dict.fromkeys(SUMMARY_COLUMNS)  # None: not measured
    row.update(reason="", file="", dimension=dimension, value=value, stage=stage,
               predicted_peak_allocated_bytes=max(p["peak_allocated_bytes"] for p in phases),
               predicted_peak_reserved_bytes=max(p["peak_reserved_bytes"] for p in phases))
    if row["predicted_peak_reserved_bytes"] > budget:
        row.update(status=OVER_BUDGET, reason=f"predicted peak reserved "
                   f"{row['predicted_peak_reserved_bytes']} bytes > budget {budget} bytes; not run")
        return row
    path = Path(folder) / f"{dimension}-{value}.json"
    flags = ["--device", point.device, "--batch", point.batch, "--context", point.context,
             "--width", point.width, "--hidden", point.hidden, "--dtype", point.dtype,
             "--warmup", point.warmup, "--repeats", point.repeats, "--seed", point.seed]
    result = subprocess.run([*map(str, command), *map(str, flags), "--output", str(path)],
                            capture_output=True, text=True)
    reason = _last_line(result.stderr) or f"exit code {result.returncode}"
    try:
        measured = json.loads(path.read_text(encoding="utf-8"))["phases"] if result.returncode == EXIT_OK else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        measured, reason = None, f"exit code 0 but no readable measurement file ({type(exc).__name__})"
    if not measured:
        memory = result.returncode == EXIT_PHASE and MEMORY_FAILURE.search(reason)
        row.update(status=OOM if memory else ERROR, reason=reason)
        return row
    row.update(status=OK, file=path.name,
               measured_peak_allocated_bytes=max(p["peak_allocated_bytes"] for p in measured),
               measured_peak_reserved_bytes=max(p["peak_reserved_bytes"] for p in measured))
    return row


def write_summary(rows, folder) -> Path:
    """Write summary.csv in `folder` whole, through a temporary file renamed over it."""
    path = Path(folder) / SUMMARY_NAME
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{SUMMARY_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=SUMMARY_COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def read_summary(path) -> list:
    """Read a summary.csv back into rows, byte counts as int (None where not measured)."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        row["value"] = int(row["value"])
        for key in BYTE_COLUMNS:
            row[key] = int(row[key]) if row[key] != "" else None
    return rows


def run_sweep(dimension, output_dir, values=None, start=None, maximum=None, config=None,
              budget_gib=None, bisect=False, measure_command=None, progress=True) -> list:
    """Measure `dimension` at each value until one fails or is over budget; return the summary rows."""
    if dimension not in DIMENSIONS:
        raise SweepError(f"dimension must be one of {', '.join(DIMENSIONS)}, got {dimension!r}")
    points = sweep_values(values, start, maximum)
    config = config if config is not None else MeasureConfig()
    try:
        replace(config, **{dimension: points[0]}).checked()
    except LabError as exc:
        raise SweepError(str(exc)) from None
    if budget_gib is not None and not 0 < budget_gib < float("inf"):
        raise SweepError(f"budget must be > 0 GiB, got {budget_gib}")
    folder = Path(output_dir)
    if folder.exists():
        raise SweepError(f"{folder} already exists; choose a new folder")
    command = measure_command or [sys.executable, str(default_measure_script()), "measure"]
    budget = int(budget_gib * GIB) if budget_gib is not None else free_memory_bytes(config.device)
    try:
        folder.mkdir(parents=True)  # exclusive: fails if another run took the name meanwhile
    except FileExistsError:
        raise SweepError(f"{folder} already exists; choose a new folder") from None
    rows = []
    with tqdm(total=len(points), desc=f"sweep {dimension}", unit="point", disable=not progress) as bar:
        def run(value, stage):
            bar.set_postfix_str(f"{dimension}={value}")
            rows.append(measure_point(config, dimension, value, folder, budget, command, stage))
            write_summary(rows, folder)
            bar.update()
            return rows[-1]["status"]

        fitted = None
        for value in points:
            status = run(value, "sweep")
            if status != OK:
                break
            fitted = value
        else:
            return rows
        if bisect and fitted is not None and status in (OOM, OVER_BUDGET):
            failed = value
            while failed - fitted > 1:
                bar.total += 1
                middle = (fitted + failed) // 2
                status = run(middle, "bisect")
                if status == ERROR:
                    break
                fitted, failed = (middle, failed) if status == OK else (fitted, middle)
    return rows


def plot_sweep(summary, ax=None):
    """Plot measured peak allocated/reserved MiB against the dimension, the prediction beside it."""
    rows = read_summary(summary) if isinstance(summary, (str, os.PathLike)) else list(summary)
    if ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=(7, 4))[1]
    rows = sorted(rows, key=lambda r: int(r["value"]))
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
    dimension = rows[0]["dimension"] if rows else "value"
    ax.set(xlabel=dimension, ylabel="MiB",
           title=f"Peak memory against {dimension} (x on a dot: predicted = measured)")
    if len(rows) > 1 and int(rows[-1]["value"]) >= 8 * int(rows[0]["value"]):
        ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return ax


def build_sweep_parser() -> argparse.ArgumentParser:
    """Return the sweep command-line parser."""
    parser = _Parser(prog="sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--dimension", required=True, choices=DIMENSIONS, help="the size to increase")
    points = parser.add_mutually_exclusive_group(required=True)
    points.add_argument("--values", type=_positive_int, nargs="+", metavar="N", help="the points, increasing")
    points.add_argument("--start", type=_positive_int, help="first point; then doubles up to --max")
    parser.add_argument("--max", type=_positive_int, dest="maximum", help="last point allowed when doubling")
    parser.add_argument("--budget-gib", type=_number, default=None,
                        help="skip points whose predicted peak reserved exceeds this (default: free device memory)")
    parser.add_argument("--bisect", action="store_true",
                        help="then find the largest value that fits, between the last fit and the first failure")
    parser.add_argument("--output-dir", required=True, help="new folder for the files; never overwritten")
    parser.add_argument("--plot", action="store_true", help=f"also save {PLOT_NAME} in the folder")
    parser.add_argument("--device", default="cuda:0", help="device to measure on, cuda:N (default cuda:0)")
    _add_size_flags(parser)
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the weights and inputs (default 0)")
    return parser


def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    try:
        args = build_sweep_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed on one line
        return exc.code
    sizes = {k: getattr(args, k) for k in MeasureConfig.__dataclass_fields__}
    try:
        rows = run_sweep(args.dimension, args.output_dir, args.values, args.start, args.maximum,
                         MeasureConfig(**sizes), args.budget_gib, args.bisect)
    except SweepError as exc:
        print(f"sweep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.plot:
        from matplotlib.figure import Figure
        figure = Figure(figsize=(7, 4))
        plot_sweep(rows, figure.add_subplot())
        figure.savefig(Path(args.output_dir) / PLOT_NAME, dpi=120, bbox_inches="tight")
    for row in rows:
        print(f"{row['dimension']}={row['value']:<8} {row['status']:<12} {row['reason'] or row['file']}")
    fits = [row["value"] for row in rows if row["status"] == OK]
    print(f"largest {args.dimension} measured that fit: {max(fits) if fits else 'none'}")
    print(f"summary: {Path(args.output_dir) / SUMMARY_NAME}")
    return EXIT_STOPPED_ON_ERROR if rows[-1]["status"] == ERROR else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
