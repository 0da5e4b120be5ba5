"""The --timeline flags of every measuring command, and what they write."""
import json
import os

from lab_helpers.allocator.history import (DEFAULT_MAX_ENTRIES, HistoryRecorder, MAX_HISTORY_ENTRIES,
                                           STACK_FRAMES_KEPT, oom_snapshot_path)
from lab_helpers.core.errors import LabError, safe_reason
from lab_helpers.core.files import check_new_output, display_path, write_new_text
from lab_helpers.core.numbers import whole_number
from lab_helpers.measurement.protocol import PhaseError


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


def timeline_recorder(args, outputs: dict) -> "HistoryRecorder | None":
    """The HistoryRecorder that parsed timeline flags ask for, or None; checks before any work that
    the timeline and its .oom.json can be created and differ from `outputs` {flag: path or None},
    already checked by the caller."""
    if args.timeline is None:
        if args.timeline_stacks or args.timeline_max_entries != DEFAULT_MAX_ENTRIES:
            raise LabError("--timeline-stacks and --timeline-max-entries need --timeline FILE")
        return None
    check_new_output(args.timeline)
    check_new_output(oom_snapshot_path(args.timeline))
    paths = [os.path.abspath(p) for p in (*outputs.values(), args.timeline, oom_snapshot_path(args.timeline))
             if p is not None]
    if len(set(paths)) != len(paths):
        raise LabError(f"{', '.join(outputs)}, --timeline and its .oom.json must be different files")
    return HistoryRecorder(args.timeline_max_entries, args.timeline_stacks)


def write_timeline(path, history: "HistoryRecorder") -> dict:
    """Write the recorded timeline to the new file `path`; return the result's fields about it."""
    write_new_text(path, json.dumps(history.timeline, separators=(",", ":"), allow_nan=False) + "\n")
    return {"timeline": display_path(path), "timeline_events": len(history.timeline["events"]["time_us"])}


def save_oom_snapshot(timeline_path, error: PhaseError) -> str:
    """Write the snapshot the failed phase left (if any) to oom_snapshot_path(timeline_path);
    return the note for the error line."""
    if error.oom_snapshot is None:
        if error.oom_snapshot_problem:
            return f"; no out-of-memory snapshot: {error.oom_snapshot_problem}"
        return "" if error.reason != "out_of_memory" else "; no out-of-memory snapshot"
    path = oom_snapshot_path(timeline_path)
    try:
        text = json.dumps(error.oom_snapshot, separators=(",", ":"), allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:  # a snapshot field that is not plain data
        return f"; out-of-memory snapshot not written: {safe_reason(exc)}"
    try:
        write_new_text(path, text)
    except LabError as write_error:
        return f"; out-of-memory snapshot not written: {write_error}"
    return f"; out-of-memory snapshot: {display_path(path)}"
