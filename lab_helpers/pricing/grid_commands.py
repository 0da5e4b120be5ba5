"""Checks a filled results grid and reports the cost per accepted unit from the rate card.

    python -m lab_helpers.grid check data/resultats-bruts.csv [--tariffs CARD]
    python -m lab_helpers.grid report data/resultats-bruts.csv [--tariffs CARD]
        [--format table|json] [--csv OUT]
"""
import argparse
import json
import sys

from lab_helpers.core.cli import Command, Program, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_OK, LabError
from lab_helpers.core.files import write_new_text
from lab_helpers.core.text import printable
from lab_helpers.pricing.card import CARD_NAME
from lab_helpers.pricing.grid import GridError, grid_report, json_ready, report_csv, report_text

GRID_PROG = "grid"
REPORT_FORMATS = ("table", "json")
CHECK_HELP = ("validate a filled grid (types, units, model and duration, threshold); exit 2 naming "
              "file and line on a fault")
REPORT_HELP = "check the grid, then print the cost per accepted unit per pass and per task and GPU model"


def add_check_arguments(parser) -> None:
    """The grid file and the card: what `check` and `report` both take."""
    parser.add_argument("grid", metavar="PATH", help="results grid CSV, e.g. "
                        "data/resultats-bruts.csv")
    parser.add_argument("--tariffs", metavar="CARD", help="rate card CSV (default: "
                        f"data/{CARD_NAME}, shown relative to the current folder)")


def add_report_arguments(parser) -> None:
    add_check_arguments(parser)
    parser.add_argument("--format", choices=REPORT_FORMATS, default="table",
                        help="table (default): text tables for people; json: one JSON object "
                             "for programs (rows, models, grid, tariffs, currency, notice)")
    parser.add_argument("--csv", metavar="OUT",
                        help="also write the per-pass costs to the new CSV file OUT (refused if "
                             "it exists; written whole or not at all)")


def _checked_report(args) -> dict:
    """grid_report of the paths given; an empty path is refused as the parser would."""
    for flag, value in (("PATH", args.grid), ("--tariffs", args.tariffs),
                        ("--csv", getattr(args, "csv", None))):
        if value == "":
            raise GridError(f"argument {flag}: the path is empty")
    return grid_report(args.grid, args.tariffs)


def handle_check(args) -> int:
    report = _checked_report(args)
    rows = len(report["rows"])
    state = "header only, nothing to check yet" if not rows else "all valid"
    print(f"{report['grid']}: {rows} rows ({state}; rate card {report['tariffs']})")
    return EXIT_OK


def handle_report(args) -> int:
    report = _checked_report(args)
    if args.csv is not None:
        try:
            write_new_text(args.csv, report_csv(report))
        except LabError as exc:  # the path as typed: escape what a terminal would act on
            raise GridError(printable(exc)) from None
    if args.format == "json":
        print(json.dumps(json_ready(report), indent=2))
    else:
        print(report_text(report))
    return EXIT_OK


PROGRAM = Program(
    prog=GRID_PROG,
    description="Checks a filled results grid and reports the cost per accepted unit from the rate card.",
    commands=(Command("check", CHECK_HELP, add_check_arguments, handle_check),
              Command("report", REPORT_HELP, add_report_arguments, handle_report)),
)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Run `check` or `report`; return the exit status."""
    return run(PROGRAM, argv)


if __name__ == "__main__":
    sys.exit(main())
