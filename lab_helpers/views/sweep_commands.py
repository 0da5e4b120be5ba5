"""Sweep one size of the synthetic network upward, one fresh measure process per point.

The sweep command line; the work is in lab_helpers/views/sweep.py."""
import json
import os
import sys
from pathlib import Path

from lab_helpers.core.cli import Command, Program, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_FAILURE, EXIT_OK, LabError
from lab_helpers.core.numbers import decimal_number, whole_number
from lab_helpers.measurement.schema import MAX_SEED
from lab_helpers.synthetic.commands import add_size_flags
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.views.sweep import (DEFAULT_POINT_TIMEOUT_SECONDS, DIMENSIONS, ERROR, OK, PLOT_NAME, SIZE_LIMITS,
                                     SUMMARY_NAME, TIMEOUT, SweepError, one_line_text, plot_sweep, run_sweep)

EXIT_INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def add_sweep_arguments(parser) -> None:
    parser.add_argument("--dimension", required=True, choices=DIMENSIONS, help="the size to increase")
    points = parser.add_mutually_exclusive_group(required=True)
    largest = max(SIZE_LIMITS.values())
    points.add_argument("--values", type=whole_number(minimum=1, maximum=largest), nargs="+", metavar="N",
                        help="the points: whole numbers, strictly increasing")
    points.add_argument("--start", type=whole_number(minimum=1, maximum=largest), metavar="N",
                        help="first point; then doubles up to --max")
    parser.add_argument("--max", type=whole_number(minimum=1, maximum=largest), dest="maximum", metavar="M",
                        help="last point allowed when doubling")
    parser.add_argument("--budget-gib", type=decimal_number(minimum=0), default=None, metavar="GIB",
                        help="skip points whose predicted peak reserved exceeds this many GiB "
                             "(default: the device's usable memory, as environment reports it)")
    parser.add_argument("--bisect", action="store_true",
                        help="then find the largest value that fits: by the prediction, confirmed on the GPU "
                             "(measured bisection when the GPU ran out of memory first)")
    parser.add_argument("--point-timeout-seconds", type=whole_number(minimum=1, maximum=7 * 24 * 3600),
                        default=DEFAULT_POINT_TIMEOUT_SECONDS, metavar="S",
                        help="kill a point's process group after S seconds and stop, status timeout "
                             f"(default {DEFAULT_POINT_TIMEOUT_SECONDS})")
    parser.add_argument("--output-dir", required=True, help="new folder for the files; never overwritten")
    parser.add_argument("--plot", action="store_true", help=f"also save {PLOT_NAME} in the folder")
    parser.add_argument("--json", action="store_true", help="print the summary rows as JSON instead of a table")
    parser.add_argument("--device", default="cuda:0", help="device to measure on, cuda:N (default cuda:0)")
    add_size_flags(parser)  # a swept width moves hidden with it (4 x width) unless --hidden is given
    parser.add_argument("--seed", type=whole_number(minimum=0, maximum=MAX_SEED), default=0,
                        help="seed of the weights and inputs (default 0)")


def sweep_and_plot(args, config: MeasureConfig) -> list:
    """Run the sweep the arguments ask for, then draw its plot if asked; return the summary rows."""
    rows = run_sweep(args.dimension, args.output_dir, args.values, args.start, args.maximum,
                     config, args.budget_gib, args.bisect, progress=sys.stderr.isatty(),
                     point_timeout_seconds=args.point_timeout_seconds)
    if args.plot:
        from matplotlib.figure import Figure
        figure = Figure(figsize=(7, 4))
        plot_sweep(rows, figure.add_subplot())
        figure.savefig(Path(args.output_dir) / PLOT_NAME, dpi=120, bbox_inches="tight")
    return rows


def handle_sweep(args) -> int:
    # a bad request (a configuration MeasureConfig refuses, a SweepError) is a usage error, exit 2, which
    # the dispatcher prints; a failure while the sweep writes its folder is exit 1, naming the folder
    config = MeasureConfig(**{k: getattr(args, k) for k in MeasureConfig.__dataclass_fields__ if hasattr(args, k)})
    try:
        rows = sweep_and_plot(args, config)
    except SweepError:
        raise
    except (LabError, OSError) as exc:  # the folder vanished or filled up mid-sweep
        text = str(exc) if isinstance(exc, LabError) else f"{exc.strerror or type(exc).__name__}"
        print(f"sweep: error: {one_line_text(text)} (in {args.output_dir})", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # the running point's process group is already ended
        print(f"sweep: interrupted; {os.path.join(args.output_dir, SUMMARY_NAME)} holds the points "
              "that finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    fits = [row["value"] for row in rows if row["status"] == OK]
    summary = os.path.join(args.output_dir, SUMMARY_NAME)
    if args.json:
        print(json.dumps({"rows": rows, "largest_fit": max(fits) if fits else None, "summary": summary}, indent=2))
    else:
        for row in rows:
            print(f"{row['dimension']}={row['value']:<8} {row['stage']:<8} {row['status']:<12} "
                  f"{row['reason'] or row['file']}")
        print(f"largest {args.dimension} measured that fit: {max(fits) if fits else 'none'}")
        print(f"summary: {summary}")
    return EXIT_FAILURE if rows[-1]["status"] in (ERROR, TIMEOUT) else EXIT_OK


PROGRAM = Program(
    prog="sweep",
    description=__doc__.splitlines()[0],
    commands=(Command("sweep", __doc__.splitlines()[0], add_sweep_arguments, handle_sweep),),
    single=True,
)


def build_sweep_parser():
    """Return the sweep command-line parser."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (2 for a usage error, as for a bad request)."""
    try:
        return run(PROGRAM, argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed on one line
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
