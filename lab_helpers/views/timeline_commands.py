"""The timeline command line: plot, explain, convert, summary.

The work is in lab_helpers/views/timeline.py (timeline files, peaks, plots) and
lab_helpers/views/explain.py (out-of-memory snapshots)."""
import argparse
import json
import sys

from lab_helpers.allocator.history import MAX_COUNT, timeline_from_snapshot
from lab_helpers.core.cli import Command, Program, error_line, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_OK
from lab_helpers.core.files import check_new_output, read_json_file, write_new_bytes
from lab_helpers.core.numbers import whole_number
from lab_helpers.views.explain import explain_document, explanation_table, load_snapshot
from lab_helpers.views.oom_fit import add_fit_prediction, fit_prediction_lines
from lab_helpers.views.timeline import (MAX_BINS, MAX_FILE_BYTES, MAX_FILE_BYTES_LIMIT, MAX_TOP, TimelineError,
                                        check_timeline, load_timeline, phase_peaks, render_png)

SIZE_HELP = (f"refuse input files larger than this, before reading them (default {MAX_FILE_BYTES}, "
             f"at most {MAX_FILE_BYTES_LIMIT})")
# ASCII digits only, the digit count checked before conversion; each bounded where it is used
_file_bytes = whole_number(minimum=1, maximum=MAX_FILE_BYTES_LIMIT)
_byte_count = whole_number(minimum=0, maximum=MAX_COUNT)


def add_plot_arguments(p) -> None:
    p.add_argument("timeline", help="timeline JSON file (kind 'iteragpu-lab timeline')")
    p.add_argument("--output", required=True, help="new PNG file to create; an existing file is never overwritten")
    p.add_argument("--top", type=whole_number(minimum=0, maximum=MAX_TOP), default=8, help=f"largest unlabelled allocations drawn as their own band (default 8, at most {MAX_TOP})")
    p.add_argument("--bins", type=whole_number(minimum=1, maximum=MAX_BINS), default=2000, help=f"time bins; each shows its highest allocated (default 2000, at most {MAX_BINS})")
    p.add_argument("--max-file-bytes", type=_file_bytes, default=MAX_FILE_BYTES, help=SIZE_HELP)


def add_explain_arguments(p) -> None:
    p.add_argument("snapshot", help="the lab's oom snapshot JSON, or a torch.cuda.memory._dump_snapshot pickle (loaded with classes refused)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="sentences and a table for people, or JSON (default table)")
    p.add_argument("--failed-request-bytes", type=_byte_count, default=None, help="the request that failed, when the file does not say")
    p.add_argument("--device-free-bytes", type=_byte_count, default=None, help="the device's free bytes at the failure, when the file does not say")
    p.add_argument("--process-limit-bytes", type=_byte_count, default=None, help="the cap set_per_process_memory_fraction put on this process's reserved bytes, when the file does not say")
    p.add_argument("--predict-fit", action="store_true", help="for a real model's out-of-memory file (real_model measure --timeline): also predict, with real_model fit's search on the meta device, the largest batch at the run's context and the largest context at its batch under the budget the allocator had at the failure (reserved + the device's free bytes); a prediction, not a measurement")
    p.add_argument("--max-file-bytes", type=_file_bytes, default=MAX_FILE_BYTES, help=SIZE_HELP)


def add_convert_arguments(p) -> None:
    p.add_argument("snapshot", help="torch.cuda.memory._dump_snapshot pickle or the lab's oom snapshot JSON")
    p.add_argument("--output", required=True, help="new timeline JSON file to create; never overwritten")
    p.add_argument("--phases", default=None, help="JSON list of [name, index, start_us, end_us] marks on the trace's clock")
    p.add_argument("--device", type=whole_number(minimum=0, maximum=2**31 - 1), default=None, help="device index of the trace (default: the only one recorded)")
    p.add_argument("--max-file-bytes", type=_file_bytes, default=MAX_FILE_BYTES, help=SIZE_HELP)


def add_summary_arguments(p) -> None:
    p.add_argument("timeline", help="timeline JSON file")
    p.add_argument("--max-file-bytes", type=_file_bytes, default=MAX_FILE_BYTES, help=SIZE_HELP)


def handle_plot(args) -> int:
    check_new_output(args.output)
    timeline = load_timeline(args.timeline, args.max_file_bytes, check=False)
    left_out = []
    try:  # the plot validates the timeline once
        png = render_png(timeline, top=args.top, bins=args.bins, left_out=left_out)
    except TimelineError as exc:
        raise TimelineError(f"{args.timeline}: {exc}") from None
    write_new_bytes(args.output, png)
    if left_out:  # not an error: the plot was drawn, and says the same at its foot
        error_line(f"timeline: note: left out of the plot: {'; '.join(left_out)}")
    print(json.dumps({"output": str(args.output), "png_bytes": len(png)}, indent=2))
    return EXIT_OK


def handle_explain(args) -> int:
    loaded = load_snapshot(args.snapshot, args.max_file_bytes)
    result = explain_document(loaded, args.failed_request_bytes, args.device_free_bytes, args.process_limit_bytes)
    if args.predict_fit:
        add_fit_prediction(result, loaded)
        result["summary"] += fit_prediction_lines(result["fit_prediction"])
    print(json.dumps(result, indent=2) if args.format == "json" else explanation_table(result))
    return EXIT_OK


def handle_convert(args) -> int:
    check_new_output(args.output)
    marks = []
    if args.phases is not None:
        marks = read_json_file(args.phases, args.max_file_bytes)
        if not isinstance(marks, list):
            raise TimelineError(f"{args.phases} must hold a JSON list of phase marks")
    timeline = timeline_from_snapshot(load_snapshot(args.snapshot, args.max_file_bytes)["snapshot"],
                                      marks, device=args.device)
    check_timeline(timeline)
    write_new_bytes(args.output, (json.dumps(timeline, separators=(",", ":")) + "\n").encode("utf-8"))
    print(json.dumps({"output": str(args.output), "events": len(timeline["events"]["time_us"]),
                      "phases": len(timeline["phases"])}, indent=2))
    return EXIT_OK


def handle_summary(args) -> int:
    timeline = load_timeline(args.timeline, args.max_file_bytes)
    print(json.dumps(phase_peaks(timeline), indent=2))
    return EXIT_OK


PROGRAM = Program(
    prog="timeline",
    description=("Offline allocator timeline (allocated bands, reserved, phases and peaks) and "
                 "out-of-memory explainer for PyTorch's caching allocator."),
    commands=(
        Command("plot", "draw a timeline file as a PNG", add_plot_arguments, handle_plot),
        Command("explain", "why an allocation failed, from an out-of-memory snapshot", add_explain_arguments,
                handle_explain),
        Command("convert", "turn a torch snapshot (pickle or the lab's JSON) into a timeline file",
                add_convert_arguments, handle_convert),
        Command("summary", "per-phase peaks of a timeline file, as JSON", add_summary_arguments, handle_summary),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The command line: plot, explain, convert, summary."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    return run(PROGRAM, argv)


if __name__ == "__main__":
    sys.exit(main())
