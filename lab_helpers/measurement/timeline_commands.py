"""The --timeline flags of every measuring command, and the recorder they ask for."""
from lab_helpers.allocator.history import DEFAULT_MAX_ENTRIES, MAX_HISTORY_ENTRIES, STACK_FRAMES_KEPT
from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.numbers import whole_number
from lab_helpers.measurement.recording import timeline_recorder


def add_timeline_flags(parser) -> None:
    """--timeline FILE, --timeline-stacks and --timeline-max-entries N, for every measuring command."""
    parser.add_argument("--timeline", metavar="FILE",
                        help="record the allocator's history and write the compact timeline (every allocation "
                             "and release with bytes, time and phase; segments; phase boundaries) to this new "
                             "file, after --output; on out of memory, save the allocator's snapshot to FILE "
                             "with .json replaced by .oom.json instead (read it with: python -m "
                             "lab_helpers.timeline explain)")
    parser.add_argument("--timeline-stacks", action="store_true",
                        help="with --timeline: also record Python and C++ stacks of each allocation (slower; "
                             f"the innermost {STACK_FRAMES_KEPT} frames are kept)")
    parser.add_argument("--timeline-max-entries", type=whole_number(1, MAX_HISTORY_ENTRIES), metavar="N",
                        default=DEFAULT_MAX_ENTRIES,
                        help=f"with --timeline: events kept, the oldest dropped beyond (default {DEFAULT_MAX_ENTRIES})")


def timeline_recorder_of(args, outputs: dict):
    """The HistoryRecorder the parsed timeline flags ask for, or None (measurement.recording's
    timeline_recorder); `outputs` {flag: path or None} are the run's other files, already checked."""
    if args.timeline is None:
        if args.timeline_stacks or args.timeline_max_entries != DEFAULT_MAX_ENTRIES:
            raise LabError("--timeline-stacks and --timeline-max-entries need --timeline FILE")
        return None
    try:
        return timeline_recorder(args.timeline, args.timeline_stacks, args.timeline_max_entries, outputs.values())
    except ParameterError as exc:
        if exc.parameter != "timeline":
            raise
        raise LabError(f"{', '.join(outputs)}, --timeline and its .oom.json must be different files") from None
