"""Checks a filled results grid and reports the cost per accepted unit from the rate card.

    python -m lab_helpers.grid check data/resultats-bruts.csv [--tariffs CARD]
    python -m lab_helpers.grid report data/resultats-bruts.csv [--tariffs CARD]

One grid row is one real pass: the work run under one rented forfait (see
data/protocole-qualite.md). Prices and unit costs come from calcul_forfaits, so the
grid and the calculator always agree to the cent.
"""
import argparse
import csv
import io
import sys
from datetime import date
from decimal import Decimal, InvalidOperation
from pathlib import Path

from lab_helpers import calcul_forfaits as calc

PROG = "grid"
GRID_COLUMNS = (
    "date", "gpu_model", "forfait_days", "forfait_lots", "device", "torch_version",
    "measurement_file", "task", "acceptance_threshold", "units_produced", "units_accepted",
    "wall_seconds", "notes",
)
OPTIONAL_COLUMNS = ("measurement_file", "notes")
TEXT_COLUMNS = ("device", "torch_version", "task", "acceptance_threshold")
EXIT_OK = 0
EXIT_USAGE = 2
SECONDS_DECIMALS = 2
NOT_AVAILABLE = "n/a"


class GridError(Exception):
    """A fault in the results grid, named by file and line."""


def _whole(text: str, column: str, where: str, minimum: int) -> int:
    """Return `text` as an int of at least `minimum`, else raise GridError."""
    if not (text.isascii() and text.isdigit()) or int(text) < minimum:
        raise GridError(f"{where}: {column} {text!r} is not a whole number of at least {minimum}")
    return int(text)


def _check_row(record: dict, card: list, where: str) -> dict:
    """Validate one grid row (fields as text) against the card and return it typed."""
    row = dict(record)
    for column in GRID_COLUMNS:
        if column not in OPTIONAL_COLUMNS and not row[column]:
            raise GridError(f"{where}: {column} is empty")
    try:
        date.fromisoformat(row["date"])
    except ValueError:
        raise GridError(f"{where}: date {row['date']!r} is not a date (YYYY-MM-DD)") from None
    row["forfait_days"] = _whole(row["forfait_days"], "forfait_days", where, 1)
    row["forfait_lots"] = _whole(row["forfait_lots"], "forfait_lots", where, 1)
    row["units_produced"] = _whole(row["units_produced"], "units_produced", where, 0)
    row["units_accepted"] = _whole(row["units_accepted"], "units_accepted", where, 0)
    if row["units_accepted"] > row["units_produced"]:
        raise GridError(f"{where}: units_accepted {row['units_accepted']} exceeds "
                        f"units_produced {row['units_produced']}")
    try:
        seconds = Decimal(row["wall_seconds"])
    except InvalidOperation:
        seconds = None
    if seconds is None or not seconds.is_finite() or seconds <= 0:
        raise GridError(f"{where}: wall_seconds {row['wall_seconds']!r} is not a positive number")
    row["wall_seconds"] = seconds
    try:
        forfait = calc.compute_forfait(card, row["gpu_model"], row["forfait_days"],
                                       row["forfait_lots"])
    except calc.ForfaitError as exc:
        raise GridError(f"{where}: {exc}") from None
    row["gpu_model"] = forfait["gpu"]
    return row


def parse_grid(text: str, card: list, source: str) -> list:
    """Validate results grid CSV text against the card; return typed rows, each with its line."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header, rows, thresholds = None, [], {}
    for fields in calc.csv_rows(reader, source):
        where = f"{source}, line {reader.line_num}"
        if header is None:
            if sorted(fields) != sorted(GRID_COLUMNS):
                raise GridError(f"{where}: wrong header; expected: {','.join(GRID_COLUMNS)}")
            header = fields
            continue
        if len(fields) != len(header):
            raise GridError(f"{where}: expected {len(header)} fields, found {len(fields)}")
        row = _check_row(dict(zip(header, fields)), card, where)
        line, threshold = thresholds.setdefault(row["task"], (reader.line_num,
                                                              row["acceptance_threshold"]))
        if row["acceptance_threshold"] != threshold:
            raise GridError(f"{where}: task {row['task']!r} has threshold "
                            f"{row['acceptance_threshold']!r}, but {threshold!r} at line "
                            f"{line}: fix the threshold before the test, not per pass")
        rows.append({"line": reader.line_num, **row})
    if header is None:
        raise GridError(f"{source}, line 1: file is empty (expected the header)")
    return rows


def load_grid(path, card: list) -> list:
    """Read and validate the results grid at `path` against the card rows."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise GridError(f"{path}, line 1: not UTF-8 text") from None
    except OSError as exc:
        raise GridError(f"{path}: cannot read the grid ({exc.strerror or exc})") from None
    return parse_grid(text, card, str(path))


def _seconds_per_unit(seconds: Decimal, units: int):
    """Return wall seconds per accepted unit as a float, or None without accepted units."""
    return round(float(seconds / units), SECONDS_DECIMALS) if units else None


def row_costs(rows: list, card: list) -> list:
    """Return, per grid row, the forfait price and the cost per accepted unit in cents."""
    costs = []
    for row in rows:
        accepted = row["units_accepted"] or None
        forfait = calc.compute_forfait(card, row["gpu_model"], row["forfait_days"],
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
        group["unit_cost_cents"] = (calc.unit_cost_cents(group["total_price_cents"], accepted)
                                    if accepted else None)
        group["seconds_per_accepted_unit"] = _seconds_per_unit(group["wall_seconds"], accepted)
        summary.append(group)
    return sorted(summary, key=lambda g: (g["task"], g["unit_cost_cents"] is None,
                                          g["unit_cost_cents"] or 0, g["gpu_model"]))


def _table(records: list, currency: str) -> str:
    """Return records as a pandas text table, unit costs also in currency units."""
    import pandas as pd

    frame = pd.DataFrame(records, dtype=object)
    cents = frame.pop("unit_cost_cents")
    frame["wall_seconds"] = frame["wall_seconds"].map(float)
    frame["seconds_per_accepted_unit"] = frame["seconds_per_accepted_unit"].map(_or_na)
    frame["unit_cost_cents"] = cents.map(_or_na)
    frame[f"unit_cost_{currency.lower()}"] = cents.map(
        lambda value: NOT_AVAILABLE if value is None else calc.format_cents(value))
    return frame.to_string(index=False)


def _or_na(value):
    """Return `value`, or 'n/a' for None."""
    return NOT_AVAILABLE if value is None else value


def report_text(rows: list, card: list, grid_name: str, card_name: str) -> str:
    """Return the report: cost per accepted unit per pass, then per task and GPU model."""
    if not rows:
        return f"{grid_name}: no data rows: nothing to report yet (fill one row per real pass)"
    costs = row_costs(rows, card)
    currency = card[0]["currency"]
    notice = calc.NOTICE + (calc.ILLUSTRATIVE_NOTICE if any(map(calc.is_illustrative, card))
                            else "")
    return "\n".join([
        f"Results grid {grid_name}, rate card {card_name}; "
        f"amounts in {currency} cents, unit_cost_{currency.lower()} in {currency}.",
        f"Rounding: {calc.UNIT_COST_ROUNDING}.",
        "", "Per pass (each row is charged the whole price of its forfait):",
        _table(costs, currency),
        "", "Per task and GPU model (summed prices / summed accepted units):",
        _table(model_costs(costs), currency), "", notice,
    ])


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2."""

    def error(self, message):
        """Print one error line and exit with status 2."""
        self.exit(EXIT_USAGE, f"{PROG}: error: {' '.join(message.split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = _OneLineParser(prog=f"python -m lab_helpers.{PROG}",
                            description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="{check,report}")
    for name, text in (("check", "validate a filled grid (types, units, model and duration, "
                                 "threshold); exit 2 naming file and line on a fault"),
                       ("report", "check the grid, then print the cost per accepted unit per "
                                  "pass and per GPU model")):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("grid", metavar="PATH", help="results grid CSV, e.g. "
                             "data/resultats-bruts.csv")
        command.add_argument("--tariffs", metavar="CARD", help="rate card CSV (default: "
                             f"data/{calc.CARD_NAME})")
    return parser


def main(argv=None) -> int:
    """Run `check` or `report`; return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        card_path = Path(args.tariffs) if args.tariffs else calc.default_card_path()
        card = calc.load_card(card_path)
        rows = load_grid(args.grid, card)
    except (GridError, calc.ForfaitError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "check":
        state = "header only, nothing to check yet" if not rows else "all valid"
        print(f"{args.grid}: {len(rows)} rows ({state}; rate card {card_path})")
    else:
        print(report_text(rows, card, args.grid, str(card_path)))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
