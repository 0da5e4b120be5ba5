"""Price of a GPU forfait from a rate card, and the cost of one accepted result.

    python calcul_forfaits.py --gpu b200 --days 7 --lots 2 [--accepted-results N] [--format table]
    python calcul_forfaits.py --list

Standard library only, so the file runs on its own next to `tarifs-forfaits.csv`
(kit layout) or from the repository (card in `data/`). Prices are whole US cents;
a forfait lasts 3, 7 or 30 days and is paid whole: no hourly proration and no
currency conversion.
"""
import argparse
import json
import sys
from pathlib import Path

from lab_helpers.core.cli import Command, Program, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_OK
from lab_helpers.core.text import printable
from lab_helpers.pricing.card import (CARD_NAME, DURATIONS_DAYS, MAX_ACCEPTED_RESULTS, MAX_LOTS, ForfaitError,
                                      calculator_folder, default_card_path, forfait_whole_number, join_values,
                                      load_card)
from lab_helpers.pricing.forfait import compute_forfait, format_card, format_forfait

FORFAIT_PROG = "calcul_forfaits"
FORFAIT_FORMATS = ("json", "table")
# every usage error of the calculator ends so (the kit's users read it on one line)
SEE_HELP = " (see --help)"


def _usage_text(message: str) -> str:
    """A usage error's message as the parser prints it: one printable line, the hint at the end."""
    return printable(" ".join(message.split())) + SEE_HELP


def _count_argument(name: str, maximum: int):
    """Return an argparse type: a whole number from 1 to `maximum`, ASCII digits only."""
    def parse(text: str) -> int:
        try:
            return forfait_whole_number(text, "", 1, maximum)
        except ForfaitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = name
    return parse


def _days_argument(text: str) -> int:
    """argparse type: 3, 7 or 30, ASCII digits only."""
    expected = f"expected one of {join_values(DURATIONS_DAYS)}"
    try:
        days = forfait_whole_number(text, "", 0, 99)
    except ForfaitError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; {expected}") from None
    if days not in DURATIONS_DAYS:
        raise argparse.ArgumentTypeError(f"{days} is not a forfait duration; {expected}")
    return days


def add_forfait_arguments(parser) -> None:
    """The calculator's flags."""
    parser.add_argument("--gpu", help="GPU model id from the card, e.g. b200 (see --list)")
    parser.add_argument("--days", type=_days_argument,
                        help=f"forfait duration in days: {join_values(DURATIONS_DAYS)}")
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
    parser.add_argument("--format", choices=FORFAIT_FORMATS, default="json",
                        help="json (default): one JSON object for programs; table: aligned "
                             "lines for people, amounts with their cents beside")
    parser.add_argument("--list", action="store_true",
                        help="print the rate card as a table, with the price per GPU-day, "
                             "and exit")


def handle_forfait(args) -> int:
    """Print the forfait as JSON or a table (the card with --list)."""
    if not args.list and (args.gpu is None or args.days is None):
        raise ForfaitError(_usage_text("--gpu and --days are required unless --list is given"))
    if args.tariffs == "":
        raise ForfaitError(_usage_text("argument --tariffs: the path is empty"))
    card_path = Path(args.tariffs) if args.tariffs is not None else default_card_path(calculator_folder())
    shown = args.tariffs if args.tariffs is not None else str(card_path)
    rows = load_card(card_path, shown)
    if args.list:
        print(format_card(rows, shown))
        return EXIT_OK
    result = compute_forfait(rows, args.gpu, args.days, args.lots, args.accepted_results)
    result["tariffs"] = printable(shown)
    print(format_forfait(result) if args.format == "table" else json.dumps(result, indent=2))
    return EXIT_OK


PROGRAM = Program(
    prog=FORFAIT_PROG,
    description="Price of a GPU forfait from a rate card, and the cost of one accepted result.",
    commands=(Command(FORFAIT_PROG, "price a forfait, or list the card", add_forfait_arguments,
                      handle_forfait),),
    single=True,
    usage_hint=SEE_HELP,
)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Print the forfait as JSON or a table (the card with --list); return the exit status.
    A reader that closes stdout early (`--list | head -1`) ends it quietly with exit 141."""
    return run(PROGRAM, argv)


if __name__ == "__main__":
    sys.exit(main())
