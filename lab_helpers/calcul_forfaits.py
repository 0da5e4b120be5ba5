"""Price of a GPU forfait from a rate card, and the cost of one accepted result.

    python calcul_forfaits.py --gpu b200 --days 7 --lots 2 [--accepted-results N]
    python calcul_forfaits.py --list

Standard library only, so the file runs on its own next to `tarifs-forfaits.csv`
(kit layout) or from the repository (card in `data/`). Prices are whole US cents;
a forfait lasts 3, 7 or 30 days and is paid whole: no hourly proration and no
currency conversion.
"""
import argparse
import csv
import io
import json
import re
import sys
from datetime import date
from decimal import ROUND_HALF_UP, Decimal, localcontext
from pathlib import Path

PROG = "calcul_forfaits"
CARD_NAME = "tarifs-forfaits.csv"
REPO_CARD_FOLDER = Path("..") / "data"
CARD_COLUMNS = (
    "model_id", "display_name", "gpus_per_lot", "memory_per_gpu_gib", "duration_days",
    "lot_price_cents", "currency", "snapshot_date", "provenance",
)
INTEGER_COLUMNS = ("gpus_per_lot", "memory_per_gpu_gib", "duration_days", "lot_price_cents")
MODEL_COLUMNS = ("display_name", "gpus_per_lot", "memory_per_gpu_gib")
DURATIONS_DAYS = (3, 7, 30)
CURRENCY = "USD"
CENTS_PER_UNIT = 100
MODEL_ID_PATTERN = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
ILLUSTRATIVE_MARKER = "illustrative"
EXIT_OK = 0
EXIT_USAGE = 2
# Extra significant digits for the Decimal division: enough that the quotient is never
# rounded before the final rounding to a whole cent.
GUARD_DIGITS = 5
WHOLE_CENT = Decimal(1)
HUNDREDTH = Decimal("0.01")
UNIT_COST_ROUNDING = (
    "unit_cost_cents = total_price_cents / accepted_results, computed exactly with "
    "Decimal, then rounded to a whole cent, halves rounded up (ROUND_HALF_UP)"
)
NOTICE = ("This rate card proves neither availability nor a reservation: confirm both "
          "with the provider before relying on it.")
ILLUSTRATIVE_NOTICE = " Its figures are illustrative, not a quote."


class ForfaitError(Exception):
    """A fault in the inputs: reported on one line, exit status 2."""


class CardError(ForfaitError):
    """A fault in the rate card file, named by file and line."""


def _positive_int(text: str):
    """Return `text` as an int if it is a whole number of at least 1, else None."""
    return int(text) if text.isascii() and text.isdigit() and int(text) >= 1 else None


def _check_row(record: dict, where: str) -> dict:
    """Validate one card row (all fields as text) and return it typed."""
    row = dict(record)
    if not MODEL_ID_PATTERN.fullmatch(row["model_id"]):
        raise CardError(f"{where}: model_id {row['model_id']!r} is not a lowercase slug "
                        "such as 'h100-sxm'")
    for column in ("display_name", "provenance"):
        if not row[column]:
            raise CardError(f"{where}: {column} is empty")
    for column in INTEGER_COLUMNS:
        value = _positive_int(row[column])
        if value is None:
            raise CardError(f"{where}: {column} {row[column]!r} is not a positive integer")
        row[column] = value
    if row["duration_days"] not in DURATIONS_DAYS:
        raise CardError(f"{where}: duration_days {row['duration_days']} is not one of "
                        f"{_join(DURATIONS_DAYS)}")
    if row["currency"] != CURRENCY:
        raise CardError(f"{where}: currency {row['currency']!r} is not {CURRENCY}")
    try:
        date.fromisoformat(row["snapshot_date"])
    except ValueError:
        raise CardError(f"{where}: snapshot_date {row['snapshot_date']!r} is not a date "
                        "(YYYY-MM-DD)") from None
    return row


def parse_card(text: str, source: str = CARD_NAME) -> list:
    """Validate rate card CSV text; return its rows as typed dicts (`source` names it in errors)."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header, rows, seen = None, [], {}
    first_of = {}  # model_id -> (line, row) of its first row
    for fields in csv_rows(reader, source):
        where = f"{source}, line {reader.line_num}"
        if header is None:
            _check_header(fields, where)
            header = fields
            continue
        if len(fields) != len(header):
            raise CardError(f"{where}: expected {len(header)} fields, found {len(fields)}")
        row = _check_row(dict(zip(header, fields)), where)
        model, days = row["model_id"], row["duration_days"]
        if (model, days) in seen:
            raise CardError(f"{where}: duplicate price for {model} {days} days "
                            f"(first given at line {seen[model, days]})")
        seen[model, days] = reader.line_num
        line, first = first_of.setdefault(model, (reader.line_num, row))
        for column in MODEL_COLUMNS:
            if row[column] != first[column]:
                raise CardError(f"{where}: {column} {row[column]!r} for {model} differs from "
                                f"{first[column]!r} at line {line}")
        rows.append(row)
    if header is None:
        raise CardError(f"{source}, line 1: file is empty")
    if not rows:
        raise CardError(f"{source}, line {reader.line_num}: no price rows after the header")
    for model, (line, _) in first_of.items():
        missing = [days for days in DURATIONS_DAYS if (model, days) not in seen]
        if missing:
            raise CardError(f"{source}, line {line}: model {model} lacks the "
                            f"{_join(missing)}-day forfait (needs {_join(DURATIONS_DAYS)} days)")
    return rows


def csv_rows(reader, source: str):
    """Yield the reader's non-blank rows, fields stripped; CSV syntax faults become CardError."""
    try:
        for fields in reader:
            fields = [field.strip() for field in fields]
            if any(fields):
                yield fields
    except csv.Error as exc:
        raise CardError(f"{source}, line {reader.line_num}: {exc}") from None


def _check_header(fields: list, where: str) -> None:
    """Raise CardError unless `fields` holds the card's columns, once each, in any order."""
    faults = {
        "missing": [name for name in CARD_COLUMNS if name not in fields],
        "unexpected": [repr(name) for name in fields if name not in CARD_COLUMNS],
        "repeated": [name for name in CARD_COLUMNS if fields.count(name) > 1],
    }
    if any(faults.values()):
        found = "; ".join(f"{kind}: {_join(names)}" for kind, names in faults.items() if names)
        raise CardError(f"{where}: wrong header ({found}); expected: {','.join(CARD_COLUMNS)}")


def load_card(path) -> list:
    """Read and validate the rate card at `path`; return its rows as typed dicts."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise CardError(f"{path}, line 1: not UTF-8 text") from None
    except OSError as exc:
        raise CardError(f"{path}: cannot read the rate card ({exc.strerror or exc})") from None
    return parse_card(text, str(path))


def default_card_path() -> Path:
    """Find the card next to this file (kit), else in ../data (repository); cwd in a notebook."""
    here = globals().get("__file__")
    base = Path(here).resolve().parent if here else Path.cwd()
    candidates = (base / CARD_NAME, (base / REPO_CARD_FOLDER / CARD_NAME).resolve())
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ForfaitError(f"no rate card found at {' or '.join(map(str, candidates))}; "
                       f"give one with --tariffs PATH")


def unit_cost_cents(total_price_cents: int, accepted_results: int) -> int:
    """Return total / accepted in whole cents, computed with Decimal, rounded half up."""
    _require_count("accepted_results", accepted_results)
    _require_count("total_price_cents", total_price_cents)
    digits = len(str(total_price_cents)) + len(str(accepted_results)) + GUARD_DIGITS
    with localcontext() as context:
        context.prec = digits
        exact = Decimal(total_price_cents) / Decimal(accepted_results)
        return int(exact.quantize(WHOLE_CENT, rounding=ROUND_HALF_UP))


def _require_count(name: str, value) -> None:
    """Raise ForfaitError unless `value` is an int of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ForfaitError(f"{name} must be a whole number of at least 1, got {value!r}")


def find_row(rows: list, gpu: str, days: int) -> dict:
    """Return the card row for (`gpu`, `days`); ForfaitError lists the valid choices."""
    models = sorted({row["model_id"] for row in rows})
    if gpu not in models:
        raise ForfaitError(f"unknown GPU model {gpu!r}; valid choices: {', '.join(models)}")
    for row in rows:
        if row["model_id"] == gpu and row["duration_days"] == days:
            return row
    durations = sorted(row["duration_days"] for row in rows if row["model_id"] == gpu)
    raise ForfaitError(f"no {days!r}-day forfait for {gpu}; "
                       f"valid durations: {_join(durations)} days")


def is_illustrative(row: dict) -> bool:
    """True when the row's provenance labels its figures as illustrative."""
    return ILLUSTRATIVE_MARKER in row["provenance"].lower()


def compute_forfait(rows: list, gpu: str, days: int, lots: int = 1,
                    accepted_results=None) -> dict:
    """Return the price of `lots` lots of `gpu` for `days` days, and the unit cost if asked."""
    row = find_row(rows, str(gpu).strip().lower(), days)
    _require_count("lots", lots)
    total = row["lot_price_cents"] * lots
    unit = None if accepted_results is None else unit_cost_cents(total, accepted_results)
    return {
        "gpu": row["model_id"], "display_name": row["display_name"],
        "days": row["duration_days"], "lots": lots, "gpus_per_lot": row["gpus_per_lot"],
        "gpus": row["gpus_per_lot"] * lots, "memory_per_gpu_gib": row["memory_per_gpu_gib"],
        "lot_price_cents": row["lot_price_cents"], "total_price_cents": total,
        "total_price": format_cents(total), "currency": row["currency"],
        "snapshot_date": row["snapshot_date"], "accepted_results": accepted_results,
        "unit_cost_cents": unit, "unit_cost": None if unit is None else format_cents(unit),
        "unit_cost_rounding": UNIT_COST_ROUNDING, "provenance": row["provenance"],
        "notice": NOTICE + (ILLUSTRATIVE_NOTICE if is_illustrative(row) else ""),
    }


def format_cents(cents: int) -> str:
    """Return whole cents as a decimal amount with two decimals, e.g. 169707 -> '1697.07'."""
    return f"{cents // CENTS_PER_UNIT}.{cents % CENTS_PER_UNIT:02d}"


def gpu_day_price(row: dict) -> Decimal:
    """Return the row's price per GPU-day in currency units, rounded half up to the cent."""
    per_gpu_day = Decimal(row["lot_price_cents"]) / (row["gpus_per_lot"] * row["duration_days"])
    return (per_gpu_day / CENTS_PER_UNIT).quantize(HUNDREDTH, rounding=ROUND_HALF_UP)


def format_card(rows: list, source: str = CARD_NAME) -> str:
    """Return the card as a readable text table, with its notice."""
    titles = ("model", "name", "GPUs/lot", "GiB/GPU", "days", "lot price", "per GPU-day",
              "currency")
    table = [titles] + [
        (row["model_id"], row["display_name"], str(row["gpus_per_lot"]),
         str(row["memory_per_gpu_gib"]), str(row["duration_days"]),
         format_cents(row["lot_price_cents"]), str(gpu_day_price(row)), row["currency"])
        for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(titles))]
    numeric = {2, 3, 4, 5, 6}
    lines = ["  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in table]
    dates = _join(sorted({row["snapshot_date"] for row in rows}))
    provenances = sorted({row["provenance"] for row in rows})
    notice = NOTICE + (ILLUSTRATIVE_NOTICE if any(map(is_illustrative, rows)) else "")
    return "\n".join([f"Rate card {source} (snapshot {dates})", *lines, "",
                      *(f"Provenance: {text}" for text in provenances), notice])


def _join(values) -> str:
    """Return `values` joined with ', '."""
    return ", ".join(str(value) for value in values)


def _count_argument(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    value = _positive_int(text.strip())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2."""

    def error(self, message):
        """Print one error line and exit with status 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = _OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", help="GPU model id from the card, e.g. b200 (see --list)")
    parser.add_argument("--days", type=int,
                        help=f"forfait duration in days: {_join(DURATIONS_DAYS)}")
    parser.add_argument("--lots", type=_count_argument, default=1,
                        help="number of lots rented (default 1); a b200 lot holds 2 GPUs, others 1")
    parser.add_argument("--accepted-results", type=_count_argument, metavar="N",
                        help="distinct results accepted over the whole forfait; gives the cost "
                             "per accepted result (no default: without it the unit cost is null)")
    parser.add_argument("--tariffs", metavar="PATH",
                        help=f"rate card CSV (default: {CARD_NAME} next to this script, "
                             f"else ../data/{CARD_NAME})")
    parser.add_argument("--list", action="store_true",
                        help="print the rate card as a table and exit")
    return parser


def main(argv=None) -> int:
    """Print the forfait as JSON (the card with --list); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.list and (args.gpu is None or args.days is None):
        parser.error("--gpu and --days are required unless --list is given")
    try:
        card_path = Path(args.tariffs) if args.tariffs else default_card_path()
        rows = load_card(card_path)
        if args.list:
            print(format_card(rows, str(card_path)))
            return EXIT_OK
        result = compute_forfait(rows, args.gpu, args.days, args.lots, args.accepted_results)
    except ForfaitError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result["tariffs"] = str(card_path)
    print(json.dumps(result, indent=2))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
