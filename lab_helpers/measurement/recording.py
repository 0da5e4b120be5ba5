"""The allocator's timeline of a measuring run: its recorder, and what it writes (the --timeline flags:
lab_helpers.measurement.timeline_commands)."""
import json
import os

from lab_helpers.allocator.history import DEFAULT_MAX_ENTRIES, HistoryRecorder, oom_snapshot_path
from lab_helpers.core.errors import LabError, ParameterError, safe_reason
from lab_helpers.core.files import check_new_output, display_path, write_new_text
from lab_helpers.measurement.protocol import PhaseError


def timeline_recorder(timeline=None, stacks: bool = False, max_entries: int = DEFAULT_MAX_ENTRIES,
                      outputs=()) -> "HistoryRecorder | None":
    """The HistoryRecorder of a run whose timeline goes to the new file `timeline` (None: no timeline,
    and then neither `stacks` nor a `max_entries` of its own), keeping `max_entries` events, with the
    stacks of each allocation if `stacks`; checks before any work that the timeline and its .oom.json
    can be created and differ from the run's other `outputs` (paths or None, already checked)."""
    if timeline is None:
        if stacks or max_entries != DEFAULT_MAX_ENTRIES:
            raise LabError("stacks and max_entries need a timeline file")
        return None
    check_new_output(timeline)
    check_new_output(oom_snapshot_path(timeline))
    paths = [os.path.abspath(p) for p in (*outputs, timeline, oom_snapshot_path(timeline)) if p is not None]
    if len(set(paths)) != len(paths):
        raise ParameterError("timeline", "and its .oom.json must be different files from the run's other outputs")
    return HistoryRecorder(max_entries, stacks)


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
