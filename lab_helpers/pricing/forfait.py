"""The price of a forfait from the card's rows, the cost of one accepted result, and their texts for people.

Prices are whole US cents; a forfait lasts 3, 7 or 30 days and is paid whole: no hourly proration and
no currency conversion."""
from decimal import ROUND_HALF_UP, Decimal, localcontext

from lab_helpers.core.text import printable
from lab_helpers.pricing.card import (CARD_NAME, ILLUSTRATIVE_NOTICE, MAX_ACCEPTED_RESULTS, MAX_LOTS, NOTICE,
                                      ForfaitError, is_illustrative, join_values, quoted_value)

CENTS_PER_UNIT = 100
MEMORY_TITLE = "memory/GPU (vendor GB)"
# Extra significant digits for the Decimal division: enough that the quotient is never
# rounded before the final rounding to a whole cent.
GUARD_DIGITS = 5
WHOLE_CENT = Decimal(1)
HUNDREDTH = Decimal("0.01")
UNIT_COST_ROUNDING = (
    "unit_cost_cents = total_price_cents / accepted_results, computed exactly with "
    "Decimal, then rounded to a whole cent, halves rounded up (ROUND_HALF_UP)"
)
FORFAIT_ASSUMPTIONS = ("the whole forfait is paid; no hourly proration; no currency conversion; "
               "unit cost rounded half up to the cent")


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
        raise ForfaitError(f"unknown GPU model {quoted_value(gpu)}; valid choices: {', '.join(models)}")
    for row in rows:
        if row["model_id"] == gpu and row["duration_days"] == days:
            return row
    durations = sorted(row["duration_days"] for row in rows if row["model_id"] == gpu)
    raise ForfaitError(f"no {days!r}-day forfait for {gpu}; "
                       f"valid durations: {join_values(durations)} days")


def card_notice(rows: list) -> str:
    """Return the notice, with the illustrative sentence when any row's provenance says so."""
    return NOTICE + (ILLUSTRATIVE_NOTICE if any(map(is_illustrative, rows)) else "")


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
        "notice": card_notice([row]),
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


def _aligned_lines(table: list, right: set) -> list:
    """Return the rows of `table` (lists of str) as lines of aligned columns."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
            for line in table]


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
    dates = join_values(sorted({row["snapshot_date"] for row in rows}))
    provenances = sorted({row["provenance"] for row in rows})
    return "\n".join([f"Rate card {printable(source)} (snapshot {dates})",
                      *_aligned_lines([[printable(c) for c in line] for line in table],
                                      {2, 3, 4, 5, 6}),
                      "", *(f"Provenance: {printable(text)}" for text in provenances),
                      card_notice(rows)])


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
    lines = _aligned_lines([[label, printable(value)] for label, value in pairs], set())
    return "\n".join([*lines, f"Assumptions: {FORFAIT_ASSUMPTIONS}.",
                      f"Notice: {printable(result['notice'])}"])
