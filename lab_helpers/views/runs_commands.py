"""Put measurement files side by side: one tidy table, grouped bars, and warm-forward throughput.

The runs command line; the work is in lab_helpers/views/runs.py."""
import sys

from lab_helpers.core.cli import Command, Program, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_OK
from lab_helpers.core.files import check_new_output, display_path
from lab_helpers.views.runs import BYTE_COUNTERS, load_runs, read_runs, runs_report, write_new_csv, write_new_plot


def add_runs_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="measurement JSON files (of mesure_memoire measure, or of a transformers model)")
    parser.add_argument("--counter", choices=BYTE_COUNTERS, default="peak_allocated_bytes",
                        help="counter of the per-phase table and of the bars (default peak_allocated_bytes)")
    parser.add_argument("--csv", metavar="OUT", help="also write the tidy table to this new CSV file")
    parser.add_argument("--plot", metavar="PNG",
                        help="also draw the counter as grouped bars (one per run, per phase) into this new PNG file")


def handle_runs(args) -> int:
    for output in (args.csv, args.plot):
        if output is not None:
            check_new_output(output)
    documents = read_runs(args.files)
    df = load_runs(args.files, documents)
    if args.csv:
        write_new_csv(df, args.csv)
    if args.plot:
        write_new_plot(df, args.plot, args.counter)
    print(runs_report(df, args.counter))
    if args.csv:
        print(f"\ntidy table: {display_path(args.csv)}")
    if args.plot:
        print(f"bars: {display_path(args.plot)}")
    return EXIT_OK


PROGRAM = Program(
    prog="runs",
    description=__doc__.splitlines()[0],
    commands=(Command("runs", __doc__.splitlines()[0], add_runs_arguments, handle_runs),),
    single=True,
    epilog=("example:\n  iteragpu-runs mesures-h100.json mesures-h200.json "
            "--counter peak_reserved_bytes --csv runs.csv --plot runs.png"),
)


def build_parser():
    """The runs command's parser."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (2 for a usage error, as for a bad file)."""
    try:
        return run(PROGRAM, argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed on one line
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
