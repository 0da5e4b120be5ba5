"""The rate card: its CSV columns and bounds, its reader and validator, and where the default card lies."""
import csv
import io
import os
import re
from datetime import date
from pathlib import Path

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import read_bounded_text
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.core.text import printable

CARD_NAME = "tarifs-forfaits.csv"
REPO_CARD_FOLDER = Path("..") / "data"
# the checkout's card: data/ of the repository
RATE_CARD_PATH = REPOSITORY / "data" / CARD_NAME
CARD_COLUMNS = (
    "model_id", "display_name", "gpus_per_lot", "memory_per_gpu_gib", "duration_days",
    "lot_price_cents", "currency", "snapshot_date", "provenance",
)
CARD_MODEL_COLUMNS = ("display_name", "gpus_per_lot", "memory_per_gpu_gib")
DURATIONS_DAYS = (3, 7, 30)
CURRENCY = "USD"
# Documented upper bounds: far above any real forfait, low enough that every total and
# unit cost stays exact in the Decimal arithmetic of lab_helpers/pricing/forfait.py.
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
NOTICE = ("This rate card proves neither availability nor a reservation: confirm both "
          "with the provider before relying on it.")
ILLUSTRATIVE_NOTICE = " Its figures are illustrative, not a quote."


class ForfaitError(LabError):
    """A fault in the inputs: reported on one line, exit status 2."""


class CardError(ForfaitError):
    """A fault in the rate card file, named by file and line."""


def quoted_value(text: str) -> str:
    """Return `text` quoted for an error line, cut to SHOWN_CHARACTERS."""
    if len(text) > SHOWN_CHARACTERS:
        return repr(text[:SHOWN_CHARACTERS]) + f"... ({len(text)} characters)"
    return repr(text)


def join_values(values) -> str:
    """Return `values` joined with ', '."""
    return ", ".join(str(value) for value in values)


def forfait_whole_number(text: str, name: str, minimum: int, maximum: int) -> int:
    """Return `text` as an int in [minimum, maximum]: ASCII digits only, length checked first.

    The card's cells and the calculator's flags keep these messages (they name the accepted range),
    which core.numbers words differently."""
    label = f"{name} " if name else ""
    if not text:
        raise ForfaitError(f"{label}is empty; expected a whole number")
    if not ASCII_DIGITS.issuperset(text):
        raise ForfaitError(f"{label}{quoted_value(text)} is not a whole number "
                           "(ASCII digits 0-9 only: no sign, space, separator or decimal point)")
    if len(text) > len(str(maximum)):  # before int(): a 4300-digit value costs nothing
        raise ForfaitError(f"{label}has {len(text)} digits: too large "
                           f"({minimum} to {maximum} accepted)")
    value = int(text)
    if not minimum <= value <= maximum:
        raise ForfaitError(f"{label}{value} is out of range ({minimum} to {maximum} accepted)")
    return value


def _check_card_row(record: dict, where: str) -> dict:
    """Validate one card row (all fields as text) and return it typed."""
    row = dict(record)
    if not MODEL_ID_PATTERN.fullmatch(row["model_id"]):
        raise CardError(f"{where}: model_id {quoted_value(row['model_id'])} is not a lowercase slug "
                        "such as 'h100-sxm'")
    for column in ("display_name", "provenance"):
        if not row[column].strip():
            raise CardError(f"{where}: {column} is empty")
    for column, maximum in CARD_NUMBER_MAXIMA.items():
        try:
            row[column] = forfait_whole_number(row[column], column, 1, maximum)
        except ForfaitError as exc:
            raise CardError(f"{where}: {exc}") from None
    if row["duration_days"] not in DURATIONS_DAYS:
        raise CardError(f"{where}: duration_days {row['duration_days']} is not one of "
                        f"{join_values(DURATIONS_DAYS)}")
    if row["currency"] != CURRENCY:
        raise CardError(f"{where}: currency {quoted_value(row['currency'])} is not {CURRENCY}")
    if not is_iso_date(row["snapshot_date"]):
        raise CardError(f"{where}: snapshot_date {quoted_value(row['snapshot_date'])} is not a date "
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
            _check_card_header(fields, where)
            header = fields
            continue
        if len(fields) != len(header):
            raise CardError(f"{where}: expected {len(header)} fields, found {len(fields)}")
        row = _check_card_row(dict(zip(header, fields)), where)
        model, days = row["model_id"], row["duration_days"]
        if (model, days) in seen:
            raise CardError(f"{where}: duplicate price for {model} {days} days "
                            f"(first given at line {seen[model, days]})")
        seen[model, days] = reader.line_num
        line, first = first_of.setdefault(model, (reader.line_num, row))
        for column in CARD_MODEL_COLUMNS:
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
                            f"{join_values(missing)}-day forfait (needs {join_values(DURATIONS_DAYS)} days)")
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


def _check_card_header(fields: list, where: str) -> None:
    """Raise CardError unless `fields` holds the card's columns, once each, in any order."""
    faults = {
        "missing": [name for name in CARD_COLUMNS if name not in fields],
        "unexpected": [quoted_value(name) for name in fields if name not in CARD_COLUMNS][:5],
        "repeated": [name for name in CARD_COLUMNS if fields.count(name) > 1],
    }
    if any(faults.values()):
        found = "; ".join(f"{kind}: {join_values(names)}" for kind, names in faults.items() if names)
        raise CardError(f"{where}: wrong header ({found}); expected: {','.join(CARD_COLUMNS)}")


def load_card(path, shown=None) -> list:
    """Read and validate the rate card at `path`; return its rows as typed dicts.

    Errors name the file as `shown` (default: `path` as given)."""
    shown = printable(path if shown is None else shown)
    try:
        text = read_bounded_text(path, MAX_CARD_BYTES, "rate card", shown)
    except LabError as exc:  # a file fault is a card fault for the caller
        raise CardError(str(exc)) from None
    return parse_card(text, shown)


def _card_shown_relative(path: Path) -> Path:
    """Return `path` relative to the current folder (as it is shown), or as is if impossible."""
    try:
        return Path(os.path.relpath(path))
    except (ValueError, OSError):  # another drive, or the current folder was deleted
        return path


def calculator_folder() -> Path:
    """The folder of the standalone calcul_forfaits.py: the kit's folder, beside its card, or the
    checkout's lab_helpers/, whose ../data holds the card."""
    # The standalone file is run as a script, where __file__ always exists and names that file. In
    # the package this module is lab_helpers/pricing/card.py, and the standalone file lies in
    # lab_helpers/ of the same checkout.
    here = Path(__file__).resolve().parent
    return REPOSITORY / "lab_helpers" if here == REPOSITORY / "lab_helpers" / "pricing" else here


def default_card_path(folder=None) -> Path:
    """Find the card next to the calculator's `folder` (kit), else in its ../data (repository).

    `folder` None: the checkout's lab_helpers/ (in a notebook too, where REPOSITORY is the
    checkout seen from notebooks/). The path returned is relative to the current folder, so that it
    prints as such."""
    base = REPOSITORY / "lab_helpers" if folder is None else Path(folder)
    candidates = (base / CARD_NAME, (base / REPO_CARD_FOLDER / CARD_NAME).resolve())
    for candidate in candidates:
        if candidate.is_file():
            return _card_shown_relative(candidate)
    shown = " or ".join(printable(_card_shown_relative(c)) for c in candidates)
    raise ForfaitError(f"no rate card found at {shown}; give one with --tariffs PATH")


def is_illustrative(row: dict) -> bool:
    """True when the row's provenance labels its figures as illustrative."""
    return ILLUSTRATIVE_MARKER in row["provenance"].lower()
