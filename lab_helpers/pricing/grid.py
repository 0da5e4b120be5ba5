"""The results grid: one row per real pass under a rented forfait, checked against the rate card,
and the cost per accepted unit per pass and per task and GPU model.

One grid row is one real pass: the work run under one rented forfait (see
data/protocole-qualite.md). Prices and unit costs come from lab_helpers/pricing/forfait.py, so the
grid and the calculator always agree to the cent.
"""
import csv
import io
from decimal import Decimal

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import csv_text, read_bounded_text
from lab_helpers.core.numbers import parse_decimal, parse_whole
from lab_helpers.core.text import printable
from lab_helpers.pricing.card import (DURATIONS_DAYS, MAX_ACCEPTED_RESULTS, MAX_LOTS, ForfaitError, csv_rows,
                                      default_card_path, is_iso_date, load_card)
from lab_helpers.pricing.forfait import (UNIT_COST_ROUNDING, card_notice, compute_forfait, format_cents,
                                         unit_cost_cents)

GRID_COLUMNS = (
    "date", "gpu_model", "forfait_days", "forfait_lots", "device", "torch_version",
    "measurement_file", "task", "acceptance_threshold", "units_produced", "units_accepted",
    "wall_seconds", "notes",
)
OPTIONAL_COLUMNS = ("measurement_file", "notes")
# The grid is read whole, so its size is bounded before reading: a row is ~150 bytes, so
# this leaves room for ~100 000 passes.
MAX_GRID_BYTES = 16 * 1024 * 1024
MAX_UNITS = MAX_ACCEPTED_RESULTS
MAX_WALL_SECONDS = 10**9  # about 31 years: longer than any forfait
SECONDS_DECIMALS = 2
NOT_AVAILABLE = "n/a"
# Per-pass columns of `report --csv`, in order.
REPORT_CSV_COLUMNS = (
    "line", "date", "task", "gpu_model", "days", "lots", "gpus", "total_price_cents",
    "units_accepted", "unit_cost_cents", "wall_seconds", "seconds_per_accepted_unit",
)


class GridError(LabError):
    """A fault in the results grid, named by file and line."""


def _grid_number(parse, text: str, column: str, where: str, minimum, maximum):
    """Return parse(text) under the lab's one number rule; faults name file, line and column."""
    try:
        return parse(text, column, minimum, maximum)
    except LabError as exc:
        raise GridError(f"{where}: {printable(exc)}") from None


def _check_grid_row(record: dict, card: list, where: str) -> dict:
    """Validate one grid row (fields as text) against the card and return it typed."""
    row = dict(record)
    for column in GRID_COLUMNS:
        if column not in OPTIONAL_COLUMNS and not row[column].strip():
            raise GridError(f"{where}: {column} is empty")
    if not is_iso_date(row["date"]):
        raise GridError(f"{where}: date {printable(repr(row['date'][:40]))} is not a date "
                        "(YYYY-MM-DD)")
    row["forfait_days"] = _grid_number(parse_whole, row["forfait_days"], "forfait_days", where,
                                       1, max(DURATIONS_DAYS))
    row["forfait_lots"] = _grid_number(parse_whole, row["forfait_lots"], "forfait_lots", where,
                                       1, MAX_LOTS)
    for column in ("units_produced", "units_accepted"):
        row[column] = _grid_number(parse_whole, row[column], column, where, 0, MAX_UNITS)
    if row["units_accepted"] > row["units_produced"]:
        raise GridError(f"{where}: units_accepted {row['units_accepted']} exceeds "
                        f"units_produced {row['units_produced']}")
    seconds = _grid_number(parse_decimal, row["wall_seconds"], "wall_seconds", where,
                           0, MAX_WALL_SECONDS)
    if seconds <= 0:
        raise GridError(f"{where}: wall_seconds {row['wall_seconds']} is not a positive number")
    row["wall_seconds"] = Decimal(row["wall_seconds"])  # exact: the text is digits and one '.'
    try:
        forfait = compute_forfait(card, row["gpu_model"], row["forfait_days"],
                                  row["forfait_lots"])
    except ForfaitError as exc:
        raise GridError(f"{where}: {printable(exc)}") from None
    row["gpu_model"] = forfait["gpu"]
    return row


def parse_grid(text: str, card: list, source: str) -> list:
    """Validate results grid CSV text against the card; return typed rows, each with its line."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header, rows, thresholds = None, [], {}
    try:
        for fields in csv_rows(reader, source):
            where = f"{source}, line {reader.line_num}"
            if header is None:
                if sorted(fields) != sorted(GRID_COLUMNS):
                    raise GridError(f"{where}: wrong header; expected: {','.join(GRID_COLUMNS)}")
                header = fields
                continue
            if len(fields) != len(header):
                raise GridError(f"{where}: expected {len(header)} fields, found {len(fields)}")
            row = _check_grid_row(dict(zip(header, fields)), card, where)
            line, threshold = thresholds.setdefault(row["task"], (reader.line_num,
                                                                  row["acceptance_threshold"]))
            if row["acceptance_threshold"] != threshold:
                raise GridError(f"{where}: task {row['task'][:40]!r} has threshold "
                                f"{row['acceptance_threshold'][:40]!r}, but {threshold[:40]!r} at "
                                f"line {line}: fix the threshold before the test, not per pass")
            rows.append({"line": reader.line_num, **row})
    except ForfaitError as exc:  # a CSV syntax fault, named by file and line
        raise GridError(str(exc)) from None
    if header is None:
        raise GridError(f"{source}, line 1: file is empty (expected the header)")
    return rows


def load_grid(path, card: list, shown=None) -> list:
    """Read and validate the results grid at `path` against the card rows.

    Errors name the file as `shown` (default: `path` as given); the file must be a regular
    UTF-8 file of at most MAX_GRID_BYTES."""
    shown = printable(path if shown is None else shown)
    try:
        text = read_bounded_text(path, MAX_GRID_BYTES, "results grid", shown)
    except LabError as exc:  # a file fault is a grid fault for the caller
        raise GridError(str(exc)) from None
    return parse_grid(text, card, shown)


def _seconds_per_unit(seconds: Decimal, units: int):
    """Return wall seconds per accepted unit as a float, or None without accepted units."""
    return round(float(seconds / units), SECONDS_DECIMALS) if units else None


def row_costs(rows: list, card: list) -> list:
    """Return, per grid row, the forfait price and the cost per accepted unit in cents."""
    costs = []
    for row in rows:
        accepted = row["units_accepted"] or None
        forfait = compute_forfait(card, row["gpu_model"], row["forfait_days"],
                                  row["forfait_lots"], accepted)
        costs.append({
            "line": row["line"], "date": row["date"], "task": row["task"],
            "gpu_model": forfait["gpu"], "days": forfait["days"], "lots": forfait["lots"],
            "gpus": forfait["gpus"], "total_price_cents": forfait["total_price_cents"],
            "units_accepted": row["units_accepted"], "unit_cost_cents": forfait["unit_cost_cents"],
            "wall_seconds": row["wall_seconds"],
            "seconds_per_accepted_unit": _seconds_per_unit(row["wall_seconds"],
                                                           row["units_accepted"]),
        })
    return costs


def model_costs(costs: list) -> list:
    """Return, per (task, GPU model), summed prices and units and the cost per accepted unit."""
    groups = {}
    for cost in costs:
        group = groups.setdefault((cost["task"], cost["gpu_model"]), {
            "task": cost["task"], "gpu_model": cost["gpu_model"], "passes": 0,
            "total_price_cents": 0, "units_accepted": 0, "wall_seconds": Decimal(0)})
        group["passes"] += 1
        for key in ("total_price_cents", "units_accepted", "wall_seconds"):
            group[key] += cost[key]
    summary = []
    for group in groups.values():
        accepted = group["units_accepted"]
        group["unit_cost_cents"] = (unit_cost_cents(group["total_price_cents"], accepted)
                                    if accepted else None)
        group["seconds_per_accepted_unit"] = _seconds_per_unit(group["wall_seconds"], accepted)
        summary.append(group)
    return sorted(summary, key=lambda g: (g["task"], g["unit_cost_cents"] is None,
                                          g["unit_cost_cents"] or 0, g["gpu_model"]))


def grid_report(grid_path, card_path=None) -> dict:
    """Check the grid at `grid_path` against the card and return its costs.

    `card_path` None takes the default card. Returns a dict: `grid` and `tariffs` (the paths
    as shown: as given, the default card relative to the current folder), `currency`,
    `rounding`, `notice`, `rows` (row_costs: one dict per pass) and `models` (model_costs:
    one dict per task and GPU model). Raises GridError or ForfaitError on a fault."""
    if card_path is None:
        card_path = default_card_path()
    card = load_card(card_path)
    rows = load_grid(grid_path, card)
    costs = row_costs(rows, card)
    return {
        "grid": printable(grid_path), "tariffs": printable(card_path),
        "currency": card[0]["currency"], "rounding": UNIT_COST_ROUNDING,
        "notice": card_notice(card),
        "rows": costs, "models": model_costs(costs),
    }


def _report_table(records: list, currency: str) -> str:
    """Return records as a pandas text table, unit costs also in currency units."""
    import pandas as pd

    frame = pd.DataFrame(records, dtype=object)
    cents = frame.pop("unit_cost_cents")
    frame["task"] = frame["task"].map(printable)
    frame["wall_seconds"] = frame["wall_seconds"].map(float)
    frame["seconds_per_accepted_unit"] = frame["seconds_per_accepted_unit"].map(_or_not_available)
    frame["unit_cost_cents"] = cents.map(_or_not_available)
    frame[f"unit_cost_{currency.lower()}"] = cents.map(
        lambda value: NOT_AVAILABLE if value is None else format_cents(value))
    return frame.to_string(index=False)


def _or_not_available(value):
    """Return `value`, or 'n/a' for None."""
    return NOT_AVAILABLE if value is None else value


def report_text(report: dict) -> str:
    """Return grid_report's result for people: per pass, then per task and GPU model."""
    if not report["rows"]:
        return (f"{report['grid']}: no data rows: nothing to report yet "
                "(fill one row per real pass)")
    currency = report["currency"]
    return "\n".join([
        f"Results grid {report['grid']}, rate card {report['tariffs']}; "
        f"amounts in {currency} cents, unit_cost_{currency.lower()} in {currency}.",
        f"Rounding: {report['rounding']}.",
        "", "Per pass (each row is charged the whole price of its forfait):",
        _report_table(report["rows"], currency),
        "", "Per task and GPU model (summed prices / summed accepted units):",
        _report_table(report["models"], currency), "", report["notice"],
    ])


def json_ready(value):
    """Return `value` with Decimal seconds as JSON numbers."""
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_ready(item) for item in value]
    return float(value) if isinstance(value, Decimal) else value


def report_csv(report: dict) -> str:
    """Return the per-pass costs as CSV text (text cells neutralised against formulas)."""
    rows = [[json_ready(cost[column]) for column in REPORT_CSV_COLUMNS]
            for cost in report["rows"]]
    return csv_text(REPORT_CSV_COLUMNS, rows)
