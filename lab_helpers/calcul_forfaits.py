"""Price of a GPU forfait from a rate card, and the cost of one accepted result.

    python calcul_forfaits.py --gpu b200 --days 7 --lots 2 [--accepted-results N] [--format table]
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
import os
import re
import stat
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
MODEL_COLUMNS = ("display_name", "gpus_per_lot", "memory_per_gpu_gib")
DURATIONS_DAYS = (3, 7, 30)
CURRENCY = "USD"
CENTS_PER_UNIT = 100
# Documented upper bounds: far above any real forfait, low enough that every total and
# unit cost stays exact in the Decimal arithmetic below.
MAX_LOTS = 10_000
MAX_ACCEPTED_RESULTS = 10**15
MAX_LOT_PRICE_CENTS = 10**15  # ten trillion dollars
MAX_GPUS_PER_LOT = 1_024
MAX_MEMORY_PER_GPU = 1_000_000  # in the vendor's published "GB"
# Whole-number card columns -> their largest accepted value; duration_days is checked
# against DURATIONS_DAYS after.
CARD_NUMBER_MAXIMA = {
    "gpus_per_lot": MAX_GPUS_PER_LOT, "memory_per_gpu_gib": MAX_MEMORY_PER_GPU,
    "duration_days": max(DURATIONS_DAYS), "lot_price_cents": MAX_LOT_PRICE_CENTS,
}
# The card is read whole, so its size is bounded before reading: the shipped one is ~6 kB.
MAX_CARD_BYTES = 1024 * 1024
MODEL_ID_PATTERN = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
DATE_PATTERN = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
ASCII_DIGITS = frozenset("0123456789")
SHOWN_CHARACTERS = 40  # a refused value is quoted in the error up to this length
ILLUSTRATIVE_MARKER = "illustrative"
MEMORY_TITLE = "memory/GPU (vendor GB)"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left
FORMATS = ("json", "table")
# Extra significant digits for the Decimal division: enough that the quotient is never
# rounded before the final rounding to a whole cent.
GUARD_DIGITS = 5
WHOLE_CENT = Decimal(1)
HUNDREDTH = Decimal("0.01")
UNIT_COST_ROUNDING = (
    "unit_cost_cents = total_price_cents / accepted_results, computed exactly with "
    "Decimal, then rounded to a whole cent, halves rounded up (ROUND_HALF_UP)"
)
ASSUMPTIONS = ("the whole forfait is paid; no hourly proration; no currency conversion; "
               "unit cost rounded half up to the cent")
NOTICE = ("This rate card proves neither availability nor a reservation: confirm both "
          "with the provider before relying on it.")
ILLUSTRATIVE_NOTICE = " Its figures are illustrative, not a quote."


class ForfaitError(Exception):
    """A fault in the inputs: reported on one line, exit status 2."""


class CardError(ForfaitError):
    """A fault in the rate card file, named by file and line."""


def printable(text: str) -> str:
    """Return `text` with control, non-printable and unpaired surrogate characters escaped."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _quoted(text: str) -> str:
    """Return `text` quoted for an error line, cut to SHOWN_CHARACTERS."""
    if len(text) > SHOWN_CHARACTERS:
        return repr(text[:SHOWN_CHARACTERS]) + f"... ({len(text)} characters)"
    return repr(text)


def _whole_number(text: str, name: str, minimum: int, maximum: int) -> int:
    """Return `text` as an int in [minimum, maximum]: ASCII digits only, length checked first."""
    label = f"{name} " if name else ""
    if not text:
        raise ForfaitError(f"{label}is empty; expected a whole number")
    if not ASCII_DIGITS.issuperset(text):
        raise ForfaitError(f"{label}{_quoted(text)} is not a whole number "
                           "(ASCII digits 0-9 only: no sign, space, separator or decimal point)")
    if len(text) > len(str(maximum)):  # before int(): a 4300-digit value costs nothing
        raise ForfaitError(f"{label}has {len(text)} digits: too large "
                           f"({minimum} to {maximum} accepted)")
    value = int(text)
    if not minimum <= value <= maximum:
        raise ForfaitError(f"{label}{value} is out of range ({minimum} to {maximum} accepted)")
    return value


def _check_row(record: dict, where: str) -> dict:
    """Validate one card row (all fields as text) and return it typed."""
    row = dict(record)
    if not MODEL_ID_PATTERN.fullmatch(row["model_id"]):
        raise CardError(f"{where}: model_id {_quoted(row['model_id'])} is not a lowercase slug "
                        "such as 'h100-sxm'")
    for column in ("display_name", "provenance"):
        if not row[column].strip():
            raise CardError(f"{where}: {column} is empty")
    for column, maximum in CARD_NUMBER_MAXIMA.items():
        try:
            row[column] = _whole_number(row[column], column, 1, maximum)
        except ForfaitError as exc:
            raise CardError(f"{where}: {exc}") from None
    if row["duration_days"] not in DURATIONS_DAYS:
        raise CardError(f"{where}: duration_days {row['duration_days']} is not one of "
                        f"{_join(DURATIONS_DAYS)}")
    if row["currency"] != CURRENCY:
        raise CardError(f"{where}: currency {_quoted(row['currency'])} is not {CURRENCY}")
    if not is_iso_date(row["snapshot_date"]):
        raise CardError(f"{where}: snapshot_date {_quoted(row['snapshot_date'])} is not a date "
                        "(YYYY-MM-DD)")
    return row


def is_iso_date(text: str) -> bool:
    """True when `text` is a real calendar date written YYYY-MM-DD in ASCII digits."""
    if not DATE_PATTERN.fullmatch(text):
        return False
    try:
        date.fromisoformat(text)
    except ValueError:
        return False
    return True


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
    """Yield the reader's rows that are not blank, fields as written (nothing stripped).

    CSV syntax faults become CardError naming `source` and the line."""
    try:
        for fields in reader:
            if any(field.strip() for field in fields):
                yield fields
    except csv.Error as exc:
        raise CardError(f"{source}, line {reader.line_num}: {exc}") from None


def _check_header(fields: list, where: str) -> None:
    """Raise CardError unless `fields` holds the card's columns, once each, in any order."""
    faults = {
        "missing": [name for name in CARD_COLUMNS if name not in fields],
        "unexpected": [_quoted(name) for name in fields if name not in CARD_COLUMNS][:5],
        "repeated": [name for name in CARD_COLUMNS if fields.count(name) > 1],
    }
    if any(faults.values()):
        found = "; ".join(f"{kind}: {_join(names)}" for kind, names in faults.items() if names)
        raise CardError(f"{where}: wrong header ({found}); expected: {','.join(CARD_COLUMNS)}")


def read_text_file(path, what: str, max_bytes: int, shown=None) -> str:
    """Return the UTF-8 text of the regular file at `path`, at most `max_bytes` long.

    Faults raise ForfaitError naming the file as `shown` (default: `path` as given): a
    missing or unreadable path, a folder, a pipe or device (opened without blocking, never
    read), a file over `max_bytes` (checked before reading), UTF-16, binary or non-UTF-8 text.
    """
    shown = printable(path if shown is None else shown)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except ValueError:
        raise ForfaitError(f"{shown}: cannot read the {what} (the path holds a NUL character)") from None
    except OSError as exc:
        raise ForfaitError(f"{shown}: cannot read the {what} ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd)
        if stat.S_ISDIR(mode.st_mode):
            raise ForfaitError(f"{shown}: is a folder, not a {what} file")
        if not stat.S_ISREG(mode.st_mode):
            raise ForfaitError(f"{shown}: is not a regular file (a pipe, socket or device); "
                               f"give the {what} as a file")
        if mode.st_size > max_bytes:
            raise ForfaitError(f"{shown}: is {mode.st_size} bytes, over the {max_bytes}-byte "
                               f"limit for a {what}")
        chunks, size = [], 0
        while size <= max_bytes:  # never more than max_bytes + 1, even if the file grows
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ForfaitError(f"{shown}: cannot read the {what} ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:  # the file grew after fstat
        raise ForfaitError(f"{shown}: is over the {max_bytes}-byte limit for a {what}")
    return _decode(data, shown, what)


def _decode(data: bytes, shown: str, what: str) -> str:
    """Return `data` decoded as UTF-8 (BOM allowed); refuse UTF-16 and binary data."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ForfaitError(f"{shown}, line 1: the {what} is UTF-16 text; save it as UTF-8")
    if b"\x00" in data:
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise ForfaitError(f"{shown}, line {line}: binary data (a NUL byte), not a CSV {what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ForfaitError(f"{shown}, line {line}: not UTF-8 text (byte {exc.start})") from None


def load_card(path, shown=None) -> list:
    """Read and validate the rate card at `path`; return its rows as typed dicts.

    Errors name the file as `shown` (default: `path` as given)."""
    shown = printable(path if shown is None else shown)
    try:
        text = read_text_file(path, "rate card", MAX_CARD_BYTES, shown)
    except ForfaitError as exc:  # a file fault is a card fault for the caller
        raise CardError(str(exc)) from None
    return parse_card(text, shown)


def _relative_to_cwd(path: Path) -> Path:
    """Return `path` relative to the current folder (as it is shown), or as is if impossible."""
    try:
        return Path(os.path.relpath(path))
    except (ValueError, OSError):  # another drive, or the current folder was deleted
        return path


def default_card_path() -> Path:
    """Find the card next to this file (kit), else in ../data (repository); cwd in a notebook.

    The path returned is relative to the current folder, so that it prints as such."""
    here = globals().get("__file__")
    base = Path(here).resolve().parent if here else Path.cwd()
    candidates = (base / CARD_NAME, (base / REPO_CARD_FOLDER / CARD_NAME).resolve())
    for candidate in candidates:
        if candidate.is_file():
            return _relative_to_cwd(candidate)
    shown = " or ".join(printable(_relative_to_cwd(c)) for c in candidates)
    raise ForfaitError(f"no rate card found at {shown}; give one with --tariffs PATH")


def unit_cost_cents(total_price_cents: int, accepted_results: int) -> int:
    """Return total / accepted in whole cents, computed with Decimal, rounded half up."""
    _require_count("accepted_results", accepted_results)
    _require_count("total_price_cents", total_price_cents)
    digits = len(str(total_price_cents)) + len(str(accepted_results)) + GUARD_DIGITS
    with localcontext() as context:
        context.prec = digits
        exact = Decimal(total_price_cents) / Decimal(accepted_results)
        return int(exact.quantize(WHOLE_CENT, rounding=ROUND_HALF_UP))


def _require_count(name: str, value, maximum=None) -> None:
    """Raise ForfaitError unless `value` is an int of at least 1 (and at most `maximum`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ForfaitError(f"{name} must be a whole number of at least 1, got {value!r}")
    if maximum is not None and value > maximum:
        raise ForfaitError(f"{name} {value} is over the limit of {maximum}")


def find_row(rows: list, gpu: str, days: int) -> dict:
    """Return the card row for (`gpu`, `days`); ForfaitError lists the valid choices."""
    models = sorted({row["model_id"] for row in rows})
    if gpu not in models:
        raise ForfaitError(f"unknown GPU model {_quoted(gpu)}; valid choices: {', '.join(models)}")
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
    _require_count("lots", lots, MAX_LOTS)
    if accepted_results is not None:
        _require_count("accepted_results", accepted_results, MAX_ACCEPTED_RESULTS)
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


def format_money(cents: int, currency: str) -> str:
    """Return whole cents as money with the cents beside, e.g. '1,697.07 USD (169707 cents)'."""
    return f"{cents // CENTS_PER_UNIT:,}.{cents % CENTS_PER_UNIT:02d} {currency} ({cents} cents)"


def gpu_day_price(row: dict) -> Decimal:
    """Return the row's price per GPU-day in currency units, rounded half up to the cent."""
    with localcontext() as context:
        context.prec = len(str(row["lot_price_cents"])) + GUARD_DIGITS
        per_gpu_day = Decimal(row["lot_price_cents"]) / (row["gpus_per_lot"] * row["duration_days"])
        return (per_gpu_day / CENTS_PER_UNIT).quantize(HUNDREDTH, rounding=ROUND_HALF_UP)


def card_table(rows: list) -> list:
    """Return the card's rows as dicts with the price per GPU-day added.

    Each dict holds the card's columns (names unchanged: `memory_per_gpu_gib` is the vendor's
    published "GB" figure) plus `gpu_day_price_usd` (Decimal, US dollars since the card is
    in USD, rounded half up to the cent).
    """
    return [{**row, "gpu_day_price_usd": gpu_day_price(row)} for row in rows]


def _aligned(table: list, right: set) -> list:
    """Return the rows of `table` (lists of str) as lines of aligned columns."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
            for line in table]


def _notice(rows: list) -> str:
    """Return the notice, with the illustrative sentence when any row's provenance says so."""
    return NOTICE + (ILLUSTRATIVE_NOTICE if any(map(is_illustrative, rows)) else "")


def format_card(rows: list, source: str = CARD_NAME) -> str:
    """Return the card as a readable text table, with its notice."""
    titles = ("model", "name", "GPUs/lot", MEMORY_TITLE, "days", "lot price", "per GPU-day",
              "currency")
    table = [titles] + [
        (row["model_id"], row["display_name"], str(row["gpus_per_lot"]),
         str(row["memory_per_gpu_gib"]), str(row["duration_days"]),
         format_cents(row["lot_price_cents"]), str(row["gpu_day_price_usd"]), row["currency"])
        for row in card_table(rows)
    ]
    dates = _join(sorted({row["snapshot_date"] for row in rows}))
    provenances = sorted({row["provenance"] for row in rows})
    return "\n".join([f"Rate card {printable(source)} (snapshot {dates})",
                      *_aligned([[printable(c) for c in line] for line in table],
                                {2, 3, 4, 5, 6}),
                      "", *(f"Provenance: {printable(text)}" for text in provenances),
                      _notice(rows)])


def format_forfait(result: dict) -> str:
    """Return a compute_forfait result (with `tariffs`) as aligned lines for people."""
    currency = result["currency"]
    unit = ("n/a (give --accepted-results N)" if result["unit_cost_cents"] is None else
            f"{format_money(result['unit_cost_cents'], currency)} per accepted result")
    accepted = "n/a" if result["accepted_results"] is None else f"{result['accepted_results']:,}"
    pairs = [
        ("GPU model", f"{result['gpu']} ({result['display_name']})"),
        ("forfait", f"{result['days']} days x {result['lots']:,} lots of "
                    f"{result['gpus_per_lot']} GPU = {result['gpus']:,} GPUs"),
        (MEMORY_TITLE, str(result["memory_per_gpu_gib"])),
        ("lot price", format_money(result["lot_price_cents"], currency)),
        ("total price", format_money(result["total_price_cents"], currency)),
        ("accepted results", accepted),
        ("unit cost", unit),
        ("rate card", f"{result.get('tariffs', '')} (snapshot {result['snapshot_date']})"),
    ]
    lines = _aligned([[label, printable(value)] for label, value in pairs], set())
    return "\n".join([*lines, f"Assumptions: {ASSUMPTIONS}.",
                      f"Notice: {printable(result['notice'])}"])


def _join(values) -> str:
    """Return `values` joined with ', '."""
    return ", ".join(str(value) for value in values)


def _count_argument(name: str, maximum: int):
    """Return an argparse type: a whole number from 1 to `maximum`, ASCII digits only."""
    def parse(text: str) -> int:
        try:
            return _whole_number(text, "", 1, maximum)
        except ForfaitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = name
    return parse


def _days_argument(text: str) -> int:
    """argparse type: 3, 7 or 30, ASCII digits only."""
    expected = f"expected one of {_join(DURATIONS_DAYS)}"
    try:
        days = _whole_number(text, "", 0, 99)
    except ForfaitError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; {expected}") from None
    if days not in DURATIONS_DAYS:
        raise argparse.ArgumentTypeError(f"{days} is not a forfait duration; {expected}")
    return days


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2."""

    def error(self, message):
        """Print one error line and exit with status 2."""
        message = printable(" ".join(message.split()))
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = _OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", help="GPU model id from the card, e.g. b200 (see --list)")
    parser.add_argument("--days", type=_days_argument,
                        help=f"forfait duration in days: {_join(DURATIONS_DAYS)}")
    parser.add_argument("--lots", type=_count_argument("lots", MAX_LOTS), default=1,
                        help=f"number of lots rented, 1 to {MAX_LOTS} (default 1); "
                             "a b200 lot holds 2 GPUs, others 1")
    parser.add_argument("--accepted-results", type=_count_argument("count", MAX_ACCEPTED_RESULTS),
                        metavar="N",
                        help="distinct results accepted over the whole forfait, 1 to 10^15; "
                             "gives the cost per accepted result (no default: without it the "
                             "unit cost is null)")
    parser.add_argument("--tariffs", metavar="PATH",
                        help=f"rate card CSV (default: {CARD_NAME} next to this script, "
                             f"else ../data/{CARD_NAME} from it; shown relative to the "
                             "current folder)")
    parser.add_argument("--format", choices=FORMATS, default="json",
                        help="json (default): one JSON object for programs; table: aligned "
                             "lines for people, amounts with their cents beside")
    parser.add_argument("--list", action="store_true",
                        help="print the rate card as a table, with the price per GPU-day, "
                             "and exit")
    return parser


def main(argv=None) -> int:
    """Print the forfait as JSON or a table (the card with --list); return the exit status.
    A reader that closes stdout early (`--list | head -1`) ends it quietly with exit 141."""
    try:
        try:
            return _run(argv)
        finally:  # argparse's --help leaves its text in the buffer and raises SystemExit
            sys.stdout.flush()
    except BrokenPipeError:
        # standalone copy of mesure_memoire.quiet_broken_pipe: point stdout at devnull so that
        # Python's flush at exit has nothing left to write
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_BROKEN_PIPE


def _run(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.list and (args.gpu is None or args.days is None):
        parser.error("--gpu and --days are required unless --list is given")
    if args.tariffs == "":
        parser.error("argument --tariffs: the path is empty")
    try:
        card_path = Path(args.tariffs) if args.tariffs is not None else default_card_path()
        shown = args.tariffs if args.tariffs is not None else str(card_path)
        rows = load_card(card_path, shown)
        if args.list:
            print(format_card(rows, shown))
            return EXIT_OK
        result = compute_forfait(rows, args.gpu, args.days, args.lots, args.accepted_results)
    except ForfaitError as exc:
        print(f"{PROG}: error: {printable(exc)}", file=sys.stderr)
        return EXIT_USAGE
    result["tariffs"] = printable(shown)
    print(format_forfait(result) if args.format == "table" else json.dumps(result, indent=2))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
