"""What happens inside a phase: the allocator's timeline, offline, and why an allocation failed.

Three parts, one concern (the allocator's own records):

- the TIMELINE file (``kind: "iteragpu-lab timeline"``, columnar JSON) built from the dict
  ``torch.cuda.memory._snapshot()`` returns while ``_record_memory_history`` is on, with each
  event assigned to the lab's phases (``timeline_from_snapshot``, ``phase_peaks``);
- ``plot_timeline``: allocated bytes as stacked bands (largest allocations and labelled groups),
  reserved as a line, phase boundaries and each phase's peak; binned so that a million events plot
  in seconds;
- ``explain_snapshot``: the request that failed, the free blocks, fragmentation or exhaustion, and
  what ``expandable_segments`` or ``empty_cache()`` would change, in numbers and words.

Run as ``python -m lab_helpers.timeline plot|explain|convert|summary ...``. numpy and matplotlib are
imported only where a timeline is turned into arrays or drawn; torch only inside the GPU helpers.
"""
import argparse
import io
import json
import os
import pickle
import stat
import sys
from pathlib import Path

# >>> library only
from lab_helpers.allocator.history import (DEFAULT_MAX_ENTRIES, NO_PHASE, OOM_SNAPSHOT_KIND, TIMELINE_ACTIONS,
                                           TIMELINE_COLUMNS, TIMELINE_KIND, check_allocator_snapshot,
                                           is_byte_count, now_us, oom_snapshot_document,
                                           timeline_from_snapshot)
from lab_helpers.allocator.model import (AllocatorModel, LARGE_SEGMENT_BYTES, SMALL_REQUEST_MAX_BYTES,
                                         SMALL_SEGMENT_BYTES)
from lab_helpers.core.cli import CommandParser, quiet_broken_pipe
from lab_helpers.core.errors import EXIT_OK, EXIT_USAGE, LabError
from lab_helpers.core.files import check_new_output, write_new_bytes
from lab_helpers.core.numbers import MIB
from lab_helpers.measurement.schema import SCHEMA_VERSION
# <<< library only

ACTIONS, COLUMNS = TIMELINE_ACTIONS, TIMELINE_COLUMNS
ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP = range(len(ACTIONS))
# Files are read whole into memory before parsing; a larger file is refused unread.
MAX_FILE_BYTES = 256 * MIB
# Expandable segments map device memory in pages of the pool's segment size (c10:
# kSmallBuffer 2 MiB for the small pool, kLargeBuffer 20 MiB for the large one).
EXPANDABLE_PAGE_BYTES = {"small": SMALL_SEGMENT_BYTES, "large": LARGE_SEGMENT_BYTES}
PENDING_FREE_STATES = ("active_pending_free", "active_awaiting_free")
TimelineError = LabError  # the name this module's callers catch: a bad file, argument or device state
# The caching allocator's rounding rules, one copy: mesure_memoire's model of the allocator.
round_request = AllocatorModel.round_size
segment_bytes_for = AllocatorModel.segment_size
_is_count = is_byte_count
_check_snapshot = check_allocator_snapshot


# ------------------------------------------------------------------ reading files safely
class _DataOnlyUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, numbers, strings, bytes, None and bools; refuses every class.

    Loading a pickle can call any importable function (os.system...) through find_class; torch's
    snapshot needs none, so nothing is ever looked up.
    """

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: only plain data is accepted")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refusing a persistent reference: only plain data is accepted")


def read_bounded(path, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, checked before reading (FIFOs never block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise TimelineError(f"cannot read {path}: {exc.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise TimelineError(f"{path} is not a regular file")
    if info.st_size > max_bytes:
        os.close(fd)
        raise TimelineError(f"{path} is {info.st_size} bytes, over the {max_bytes}-byte limit")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TimelineError(f"{path} grew over the {max_bytes}-byte limit while being read")
    if not data:
        raise TimelineError(f"{path} is empty")
    return data


def _parse_json(data: bytes, path):
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise TimelineError(f"{path} is not UTF-8 text") from None
    except RecursionError:
        raise TimelineError(f"{path} is nested too deeply") from None
    except ValueError as exc:
        raise TimelineError(f"{path} is not valid JSON ({exc.msg} at byte {exc.pos})") from None


def _parse_pickle(data: bytes, path):
    try:
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise TimelineError(f"{path}: {exc}") from None
    except RecursionError:
        raise TimelineError(f"{path} is nested too deeply") from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            MemoryError, UnicodeDecodeError) as exc:
        raise TimelineError(f"{path} is not a readable pickle ({type(exc).__name__})") from None


def load_snapshot(path, max_bytes: int = MAX_FILE_BYTES) -> dict:
    """Read an out-of-memory snapshot: the lab's JSON file or a ``_dump_snapshot`` pickle.

    Returns ``{"snapshot": torch-format dict, "failed_request_bytes": int|None,
    "device_free_bytes": int|None, "process_limit_bytes": int|None}``. Pickles are loaded with classes refused.
    """
    data = read_bounded(path, max_bytes)
    if data[:1] == b"\x80":  # pickle protocol 2+ starts with PROTO
        document = _parse_pickle(data, path)
        if not isinstance(document, dict):
            raise TimelineError(f"{path} holds a {type(document).__name__}, not a snapshot dict")
        wrapped = {"snapshot": document, "failed_request_bytes": None, "device_free_bytes": None,
                   "process_limit_bytes": None}
    else:
        document = _parse_json(data, path)
        if not isinstance(document, dict) or document.get("kind") != OOM_SNAPSHOT_KIND:
            raise TimelineError(f"{path} is not an {OOM_SNAPSHOT_KIND} file or a torch snapshot pickle")
        if document.get("schema_version") != SCHEMA_VERSION:
            raise TimelineError(f"{path}: unsupported schema_version {document.get('schema_version')!r}")
        wrapped = {key: document.get(key) for key in ("snapshot", "failed_request_bytes", "device_free_bytes",
                                                      "process_limit_bytes")}
        for key in ("failed_request_bytes", "device_free_bytes", "process_limit_bytes"):
            if wrapped[key] is not None and not _is_count(wrapped[key]):
                raise TimelineError(f"{path}: {key} must be a whole number of bytes >= 0")
    _check_snapshot(wrapped["snapshot"], path)
    return wrapped


# ------------------------------------------------------------------ recording on the GPU
def _require_cuda(torch, what: str) -> None:
    if not torch.cuda.is_available():
        raise TimelineError(f"{what} unavailable: no CUDA/ROCm device visible to this torch "
                            f"({torch.__version__})")


def record_history(torch, device, max_entries: int = DEFAULT_MAX_ENTRIES, stacks=None) -> None:
    """Start recording every allocator event (all devices; `device` is checked, GPU only).

    `max_entries` bounds the ring buffer (older entries are overwritten). `stacks` None records no
    tracebacks (cheapest); "python" or "all" records them at each allocation.
    """
    _require_cuda(torch, "memory history")
    _cuda_device(torch, device)
    if type(max_entries) is not int or max_entries < 1:
        raise TimelineError(f"max_entries must be a positive whole number, got {max_entries!r}")
    if stacks not in (None, "python", "all"):
        raise TimelineError(f"stacks must be None, 'python' or 'all', got {stacks!r}")
    options = {"enabled": "all", "context": None if stacks is None else "alloc", "stacks": stacks or "python",
               "max_entries": max_entries}
    try:  # entries left from an earlier recording would precede this run's phases
        torch.cuda.memory._record_memory_history(**options, clear_history=True)
    except TypeError:  # torch before clear_history existed
        torch.cuda.memory._record_memory_history(**options)


def _cuda_device(torch, device):
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise TimelineError(f"not a device: {device!r}") from None
    if device.type != "cuda" or device.index is None or device.index >= torch.cuda.device_count():
        raise TimelineError(f"device must be an explicit cuda:N of a visible GPU, got {str(device)!r}")
    return device


def stop_history(torch, device) -> dict:
    """Take the snapshot of `device` (segments and trace), then stop recording; return the snapshot."""
    _require_cuda(torch, "memory history")
    snapshot = torch.cuda.memory._snapshot(_cuda_device(torch, device))
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot


def save_oom_snapshot(torch, path, failed_request_bytes, device=None) -> dict:
    """On out-of-memory: write the allocator's state to a new lab JSON file for ``explain``.

    Records the request that failed and the device's free bytes (``mem_get_info``), strips
    tracebacks, writes exclusively (an existing file is refused). Returns the document.
    """
    _require_cuda(torch, "out-of-memory snapshot")
    device = _cuda_device(torch, device if device is not None else f"cuda:{torch.cuda.current_device()}")
    document = oom_snapshot_document(torch, device, failed_request_bytes)
    write_new_bytes(path, (json.dumps(document) + "\n").encode("utf-8"))
    return document


# ------------------------------------------------------------------ the timeline file
def check_timeline(timeline) -> dict:
    """Validate a timeline dict; return its columns as numpy arrays (int64) plus the levels.

    Raises TimelineError naming the first fault. Returned keys: the five columns, ``allocated``
    and ``reserved`` (bytes after each event), ``label`` (list or None) and ``labelled`` (the
    positions of the events that carry a label).
    """
    import numpy as np
    if not isinstance(timeline, dict) or timeline.get("kind") != TIMELINE_KIND:
        raise TimelineError(f"not an {TIMELINE_KIND} document")
    if timeline.get("schema_version") != SCHEMA_VERSION:
        raise TimelineError(f"unsupported schema_version {timeline.get('schema_version')!r}")
    if timeline.get("actions") != list(ACTIONS):
        raise TimelineError(f"'actions' must be {list(ACTIONS)}")
    for key in ("initial_allocated_bytes", "initial_reserved_bytes", "time_origin_us"):
        if not _is_count(timeline.get(key)):
            raise TimelineError(f"'{key}' must be a whole number >= 0")
    events = timeline.get("events")
    if not isinstance(events, dict):
        raise TimelineError("'events' must be an object of columns")
    phases = timeline.get("phases")
    if not isinstance(phases, list):
        raise TimelineError("'phases' must be a list")
    for i, phase in enumerate(phases):
        if not isinstance(phase, dict) or not isinstance(phase.get("name"), str):
            raise TimelineError(f"phase {i} has no name")
        if phase.get("index") is not None and not _is_count(phase.get("index")):
            raise TimelineError(f"phase {i} index must be null or a whole number >= 0")
        if not (_is_count(phase.get("start_us")) and _is_count(phase.get("end_us"))
                and phase["start_us"] <= phase["end_us"]):
            raise TimelineError(f"phase {i} needs whole start_us <= end_us")
        if i and phase["start_us"] < phases[i - 1]["end_us"]:
            raise TimelineError(f"phase {i} starts before phase {i - 1} ends")
    columns = {}
    length = None
    for name in COLUMNS:
        values = events.get(name)
        if not isinstance(values, list):
            raise TimelineError(f"events column '{name}' is missing or not a list")
        if length is None:
            length = len(values)
        elif len(values) != length:
            raise TimelineError(f"events column '{name}' has {len(values)} values, not {length}")
        try:
            array = np.array(values) if values else np.zeros(0, dtype=np.int64)
        except (ValueError, OverflowError, RecursionError):
            raise TimelineError(f"events column '{name}' is not a list of whole numbers") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":  # refuses floats, bools, strings, nesting
            raise TimelineError(f"events column '{name}' is not a list of whole numbers")
        if array.dtype.kind == "u":
            raise TimelineError(f"events column '{name}' holds numbers too large")
        columns[name] = array.astype(np.int64, copy=False)
    t, action, size, phase = columns["time_us"], columns["action"], columns["size_bytes"], columns["phase"]
    checks = ((t < 0, "time_us is negative"), (size < 0, "size_bytes is negative"),
              (columns["address"] < 0, "address is negative"),
              ((action < 0) | (action >= len(ACTIONS)), "action code is unknown"),
              ((phase < NO_PHASE) | (phase >= len(phases)), "phase is not a phase's position or -1"))
    for bad, message in checks:
        if bad.any():
            raise TimelineError(f"event {int(np.argmax(bad))}: {message}")
    if length > 1 and (np.diff(t) < 0).any():
        raise TimelineError(f"event {int(np.argmax(np.diff(t) < 0)) + 1}: time_us goes backwards")
    label, labelled = events.get("label"), None
    if label is not None:
        if not isinstance(label, list) or len(label) != length:
            raise TimelineError("events column 'label' must hold a string or null per event")
        labelled = np.array([i for i, v in enumerate(label) if v is not None], dtype=np.int64)
        if not all(isinstance(label[i], str) for i in labelled.tolist()):
            raise TimelineError("events column 'label' must hold a string or null per event")
    sign_alloc = np.where(action == ALLOC, size, np.where(action == FREE, -size, 0))
    sign_reserved = np.where((action == SEGMENT_ALLOC) | (action == SEGMENT_MAP), size,
                             np.where((action == SEGMENT_FREE) | (action == SEGMENT_UNMAP), -size, 0))
    allocated = timeline["initial_allocated_bytes"] + np.cumsum(sign_alloc)
    reserved = timeline["initial_reserved_bytes"] + np.cumsum(sign_reserved)
    for level, name in ((allocated, "allocated"), (reserved, "reserved")):
        if (level < 0).any():
            raise TimelineError(f"event {int(np.argmax(level < 0))}: {name} bytes fall below zero")
    return {**columns, "allocated": allocated, "reserved": reserved, "label": label, "labelled": labelled}


def load_timeline(path, max_bytes: int = MAX_FILE_BYTES, check: bool = True) -> dict:
    """Read a timeline file and validate it (unless `check` is False: ``plot_timeline`` checks it)."""
    timeline = _parse_json(read_bounded(path, max_bytes), path)
    if not check:
        return timeline
    try:
        check_timeline(timeline)
    except TimelineError as exc:
        raise TimelineError(f"{path}: {exc}") from None
    return timeline


def phase_peaks(timeline, arrays=None) -> list:
    """Per phase: allocated at its start, its peak (bytes, when) and end, and reserved's peak.

    Exact: the peak is the highest ``allocated`` after any of the phase's events, or at its start
    (as ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``).
    """
    import numpy as np
    a = arrays or check_timeline(timeline)
    rows = []
    for k, phase in enumerate(timeline["phases"]):
        inside = np.flatnonzero(a["phase"] == k)
        before = np.searchsorted(a["time_us"], phase["start_us"], side="left") - 1
        if inside.size:
            before = min(before, inside[0] - 1)
        start_alloc = int(a["allocated"][before]) if before >= 0 else timeline["initial_allocated_bytes"]
        start_res = int(a["reserved"][before]) if before >= 0 else timeline["initial_reserved_bytes"]
        peak_alloc, peak_time, end_alloc, peak_res = start_alloc, phase["start_us"], start_alloc, start_res
        if inside.size:
            levels = a["allocated"][inside]
            top = int(np.argmax(levels))
            if levels[top] > start_alloc:
                peak_alloc, peak_time = int(levels[top]), int(a["time_us"][inside[top]])
            end_alloc = int(levels[-1])
            peak_res = max(start_res, int(a["reserved"][inside].max()))
        rows.append({"phase": phase["name"], "index": phase["index"], "start_us": phase["start_us"],
                     "end_us": phase["end_us"], "start_allocated_bytes": start_alloc,
                     "peak_allocated_bytes": peak_alloc, "peak_time_us": peak_time,
                     "end_allocated_bytes": end_alloc, "peak_reserved_bytes": peak_res,
                     "events": int(inside.size)})
    return rows


# ------------------------------------------------------------------ plot
def _intervals(a):
    """Pair each alloc with the next free of its address; return per-event interval ids and sizes.

    A free with no earlier alloc is a tensor made before the trace began: its own interval,
    present from the start.
    """
    import numpy as np
    action, address = a["action"], a["address"]
    events = np.flatnonzero((action == ALLOC) | (action == FREE))
    interval = np.full(action.size, -1, dtype=np.int64)
    if not events.size:
        return interval, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    order = events[np.argsort(address[events], kind="stable")]  # by address, in event order within one
    is_alloc = action[order] == ALLOC
    same = address[order][:-1] == address[order][1:]
    paired = is_alloc[:-1] & ~is_alloc[1:] & same
    starts = np.flatnonzero(is_alloc | ~np.concatenate(([False], paired)))  # allocs and orphan frees
    interval[order[starts]] = np.arange(starts.size)
    interval[order[1:][paired]] = interval[order[:-1][paired]]
    first_event = order[starts]
    preexisting = action[first_event] == FREE
    return interval, first_event, preexisting


def _sample_points(times, levels, bins: int):
    """Event positions to draw: per time bin, the event where `levels` is highest and the last one."""
    import numpy as np
    n = times.size
    if n <= 2 * bins:
        return np.arange(n)
    span = int(times[-1] - times[0]) + 1
    which = ((times - times[0]) * bins) // span
    starts = np.flatnonzero(np.concatenate(([True], which[1:] != which[:-1])))
    top = np.maximum.reduceat(levels, starts)
    counts = np.diff(np.append(starts, n))
    hits = np.flatnonzero(levels == np.repeat(top, counts))
    _, first_hit = np.unique(which[hits], return_index=True)
    last = np.append(starts[1:] - 1, n - 1)
    return np.union1d(hits[first_hit], last)


def plot_timeline(timeline, ax=None, top: int = 8, bins: int = 2000, labels=None, size_labels=None):
    """Allocated bytes as stacked bands, reserved as a line, phases and their peaks (MiB, seconds).

    Bands: one per label (``labels`` {address: name}, then ``size_labels`` {size_bytes: name}, then
    the events' ``label`` column), then the `top` largest unlabelled allocations, the rest "other".
    Time is cut into `bins` bins; each bin is drawn at its highest ``allocated`` and its last
    event, so peaks are exact however many events there are. Returns the Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    if type(top) is not int or top < 0 or type(bins) is not int or bins < 1:
        raise TimelineError("top must be a whole number >= 0 and bins >= 1")
    a = check_timeline(timeline)
    if ax is None:
        _, ax = plt.subplots(figsize=(13, 5.5))
    t, action, size = a["time_us"], a["action"], a["size_bytes"]
    mem = np.flatnonzero((action == ALLOC) | (action == FREE))
    interval, first_event, preexisting = _intervals(a)
    iv_size = size[first_event]
    addresses = a["address"][first_event]
    iv_label = np.full(first_event.size, None, dtype=object)
    if a["label"] is not None:  # the events' own labels first, then sizes, then addresses override
        marked = a["labelled"]
        if marked.size:
            own = interval[marked]
            first = (own >= 0) & (first_event[np.maximum(own, 0)] == marked)
            iv_label[own[first]] = [a["label"][i] for i in marked[first].tolist()]
    for key, name in (size_labels or {}).items():
        iv_label[iv_size == key] = name
    for key, name in (labels or {}).items():
        iv_label[addresses == key] = name
    has_label = np.not_equal(iv_label, None)
    names = sorted(set(iv_label[has_label].tolist()))
    band = np.full(first_event.size, -1, dtype=np.int64)
    for k, name in enumerate(names):
        band[has_label & (iv_label == name)] = k
    unlabelled = np.flatnonzero(band < 0)
    largest = unlabelled[np.argsort(-iv_size[unlabelled], kind="stable")[:top]]
    # a band thinner than 1 % of the peak cannot be seen: such allocations stay in "other"
    peak = int(a["allocated"].max()) if a["allocated"].size else 0
    largest = largest[iv_size[largest] * 100 >= peak]
    for k, i in enumerate(largest.tolist()):
        band[i] = len(names) + k
        names.append(f"{iv_size[i] / MIB:.1f} MiB at 0x{int(addresses[i]):x}")
    delta = np.where(action == ALLOC, size, -size)[mem]
    event_band = band[interval[mem]]
    total = a["allocated"][mem]
    samples = _sample_points(t[mem], total, bins)
    x = np.concatenate(([0], t[mem][samples], [max(int(t[-1]) if t.size else 0, 1)])) / 1e6
    stacks = []
    for k in range(len(names)):
        initial = int(iv_size[(band == k) & preexisting].sum())
        level = initial + np.cumsum(np.where(event_band == k, delta, 0))[samples]
        stacks.append(np.concatenate(([initial], level, level[-1:] if level.size else [initial])))
    start_total = timeline["initial_allocated_bytes"]
    total_s = np.concatenate(([start_total], total[samples], total[samples][-1:] if samples.size else [start_total]))
    other = total_s - (np.sum(stacks, axis=0) if stacks else 0)
    ax.stackplot(x, *[s / MIB for s in stacks], other / MIB, labels=names + ["other"], step="post", alpha=0.85)
    seg = np.flatnonzero(action >= SEGMENT_ALLOC)
    if seg.size:
        picks = _sample_points(t[seg], a["reserved"][seg], bins)
        rx = np.concatenate(([0], t[seg][picks], [x[-1] * 1e6])) / 1e6
        ry = np.concatenate(([timeline["initial_reserved_bytes"]], a["reserved"][seg][picks],
                             a["reserved"][seg][picks][-1:]))
        ax.step(rx, ry / MIB, where="post", color="black", linewidth=1.4, label="reserved")
    elif timeline["initial_reserved_bytes"]:
        ax.axhline(timeline["initial_reserved_bytes"] / MIB, color="black", linewidth=1.4, label="reserved")
    for row in phase_peaks(timeline, a):
        ax.axvline(row["start_us"] / 1e6, color="grey", linestyle=":", linewidth=1)
        title = row["phase"] if row["index"] is None else f"{row['phase']} #{row['index']}"
        ax.annotate(title, (row["start_us"] / 1e6, 1), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8, color="dimgrey")
        ax.plot(row["peak_time_us"] / 1e6, row["peak_allocated_bytes"] / MIB, marker="v", color="crimson")
        ax.annotate(f"{row['peak_allocated_bytes'] / MIB:.1f}", (row["peak_time_us"] / 1e6,
                    row["peak_allocated_bytes"] / MIB), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7, color="crimson")
    ax.set_xlabel("seconds since the first recorded event")
    ax.set_ylabel("MiB")
    ax.set_title(f"allocated (bands) and reserved (line), {timeline['device']}; ▼ each phase's peak allocated")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return ax


def render_png(timeline, **options) -> bytes:
    """The timeline plot as PNG bytes (no pyplot state left behind)."""
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    figure = Figure(figsize=(13, 5.5))
    FigureCanvasAgg(figure)
    plot_timeline(timeline, ax=figure.add_subplot(), **options)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


# ------------------------------------------------------------------ out-of-memory explainer
def _last_oom(snapshot: dict):
    found = None
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        for entry in trace:
            if entry.get("action") == "oom":
                found = (device, entry)
    return found


def explain_snapshot(snapshot: dict, failed_request_bytes=None, device_free_bytes=None,
                     process_limit_bytes=None) -> dict:
    """Why an allocation failed, from the allocator's segments: numbers, a verdict and remedies.

    The request is `failed_request_bytes`, else the last ``oom`` trace entry's size; the device's
    free bytes `device_free_bytes`, else that entry's ``device_free``. `process_limit_bytes`: the
    cap ``torch.cuda.set_per_process_memory_fraction`` set (fraction x total memory), under which
    reserved bytes must stay; what the allocator can still take is ``available_bytes``, the smaller
    of the device's free bytes and the room under the cap. A request can only use free blocks of
    its own pool (small: up to 1 MiB; large) and stream.
    """
    _check_snapshot(snapshot, "snapshot")
    for name, value in (("failed_request_bytes", failed_request_bytes), ("device_free_bytes", device_free_bytes),
                        ("process_limit_bytes", process_limit_bytes)):
        if value is not None and not _is_count(value):
            raise TimelineError(f"{name} must be a whole number of bytes >= 0, got {value!r}")
    oom = _last_oom(snapshot)
    device, stream = None, None
    if oom is not None:
        device, entry = oom
        stream = entry.get("stream")
        if failed_request_bytes is None:
            failed_request_bytes = entry["size"]
        if device_free_bytes is None and _is_count(entry.get("device_free")):
            device_free_bytes = entry["device_free"]
    if failed_request_bytes is None:
        raise TimelineError("no failed request: the snapshot has no 'oom' entry; give the request's bytes")
    segments = [s for s in snapshot["segments"] if device is None or s.get("device", device) == device]
    rounded = round_request(failed_request_bytes)
    pool = "small" if rounded <= SMALL_REQUEST_MAX_BYTES else "large"
    needed_segment = segment_bytes_for(rounded)
    rows = []
    for s in sorted(segments, key=lambda s: s["address"]):
        free_sizes = [b["size"] for b in s["blocks"] if b["state"] == "inactive"]
        last = s["blocks"][-1] if s["blocks"] else None
        page = EXPANDABLE_PAGE_BYTES[s.get("segment_type", "large")]
        inner = [b["size"] for b in s["blocks"] if b["state"] == "inactive" and b is not last]
        rows.append({
            "address": s["address"], "segment_type": s.get("segment_type", "large"),
            "stream": s.get("stream"), "total_size_bytes": s["total_size"],
            "allocated_bytes": sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated"),
            "pending_free_bytes": sum(b["size"] for b in s["blocks"] if b["state"] in PENDING_FREE_STATES),
            "free_bytes": sum(free_sizes), "largest_free_block_bytes": max(free_sizes, default=0),
            "free_blocks": len(free_sizes),
            "tail_free_bytes": last["size"] if last is not None and last["state"] == "inactive" else 0,
            "inner_free_page_bytes": sum(size // page * page for size in inner),
            "wholly_free": bool(s["blocks"]) and len(free_sizes) == len(s["blocks"]),
            "usable": s.get("segment_type", "large") == pool and (stream is None or s.get("stream", stream) == stream),
        })
    usable = [r for r in rows if r["usable"]]
    reserved_free = sum(r["free_bytes"] for r in rows)
    usable_free = sum(r["free_bytes"] for r in usable)
    usable_largest = max((r["largest_free_block_bytes"] for r in usable), default=0)
    reserved = sum(r["total_size_bytes"] for r in rows)
    room = None if process_limit_bytes is None else max(0, process_limit_bytes - reserved)
    available = device_free_bytes if room is None else room if device_free_bytes is None \
        else min(device_free_bytes, room)
    result = {
        "request_bytes": failed_request_bytes, "rounded_request_bytes": rounded, "pool": pool,
        "stream": stream, "segment_bytes_needed": needed_segment, "device_free_bytes": device_free_bytes,
        "process_limit_bytes": process_limit_bytes, "available_bytes": available,
        "reserved_bytes": reserved,
        "allocated_bytes": sum(r["allocated_bytes"] for r in rows),
        "pending_free_bytes": sum(r["pending_free_bytes"] for r in rows),
        "reserved_free_bytes": reserved_free,
        "largest_free_block_bytes": max((r["largest_free_block_bytes"] for r in rows), default=0),
        "usable_free_bytes": usable_free, "usable_largest_free_block_bytes": usable_largest,
        "segments": rows,
    }
    result["verdict"] = _verdict(result)
    result["expandable_segments"] = _expandable(result, usable)
    result["empty_cache"] = _empty_cache(result, rows)
    result["summary"] = _summary(result)
    return result


def _verdict(r: dict) -> str:
    rounded, free = r["rounded_request_bytes"], r["available_bytes"]
    if r["usable_largest_free_block_bytes"] >= rounded or (free is not None and free >= r["segment_bytes_needed"]):
        return "fits_now"  # this state would serve the request: the snapshot is not the failing moment
    if free is None:
        return "fragmentation" if r["usable_free_bytes"] >= rounded else "undetermined"
    if free >= rounded:
        return "segment_size"  # the device has the request's bytes, not the whole segment asked for
    if r["usable_free_bytes"] + free >= rounded:
        return "fragmentation"
    return "exhaustion"


def _expandable(r: dict, usable: list) -> dict:
    """With expandable segments, a segment grows at its end in pages (its tail free block plus new
    pages), and before it gives up the allocator unmaps the whole pages of free blocks inside
    segments (release_cached_blocks), which returns their memory for the new pages."""
    rounded, free = r["rounded_request_bytes"], r["available_bytes"]
    page = EXPANDABLE_PAGE_BYTES[r["pool"]]
    tail = max((row["tail_free_bytes"] for row in usable), default=0)
    reclaim = sum(row["inner_free_page_bytes"] for row in usable)
    # only a segment's tail can grow; a hole inside serves the request only if it is large enough
    missing = 0 if r["usable_largest_free_block_bytes"] >= rounded else rounded - tail
    pages = -(-missing // page) * page
    if missing == 0 or pages <= reclaim:
        fits = True
    else:
        fits = None if free is None else pages <= free + reclaim
    return {"page_bytes": page, "largest_tail_free_bytes": tail, "device_bytes_to_map": pages,
            "unmappable_free_page_bytes": reclaim, "would_fit": fits,
            "explanation": (
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets a segment grow at its end in "
                f"{page // MIB} MiB pages: the free block at a segment's end ({tail} bytes at best here) "
                f"plus {pages} bytes of new pages would hold the request, and the whole pages of free "
                f"blocks inside segments ({reclaim} bytes here) are unmapped to make room for them. Set "
                "it before the first CUDA allocation: the layout then differs from this snapshot's, so "
                "this is an estimate.")}


def _empty_cache(r: dict, rows: list) -> dict:
    """empty_cache() returns wholly free segments to the device; partly used ones stay."""
    released = sum(row["total_size_bytes"] for row in rows if row["wholly_free"])
    free = r["available_bytes"]
    after = None if free is None else free + released
    stuck = r["reserved_free_bytes"] - released
    return {"released_bytes": released, "device_free_after_bytes": after,
            "free_bytes_left_in_partly_used_segments": stuck,
            "would_fit": None if after is None else after >= r["segment_bytes_needed"],
            "explanation": (
                f"torch.cuda.empty_cache() would return {released} bytes of wholly free segments to "
                f"the device; {stuck} free bytes sit in partly used segments and stay reserved. The "
                "allocator already frees wholly free segments itself and retries before it raises "
                "out-of-memory, so this mostly helps other processes.")}


def _summary(r: dict) -> list:
    lines = [f"The request that failed: {r['request_bytes']} bytes ({r['request_bytes'] / MIB:.2f} MiB), "
             f"rounded to {r['rounded_request_bytes']}, from the {r['pool']} pool; a new segment for it "
             f"takes {r['segment_bytes_needed']} bytes from the device.",
             f"Reserved: {r['reserved_bytes']} bytes in {len(r['segments'])} segments; allocated "
             f"{r['allocated_bytes']}; reserved but free {r['reserved_free_bytes']}; the largest free "
             f"block {r['largest_free_block_bytes']}.",
             f"Usable for this request (same pool and stream): {r['usable_free_bytes']} free bytes, "
             f"the largest block {r['usable_largest_free_block_bytes']}.",
             "Device free: unknown." if r["device_free_bytes"] is None
             else f"Device free (outside PyTorch's cache): {r['device_free_bytes']} bytes."]
    if r["process_limit_bytes"] is not None:
        lines.append(f"This process may reserve at most {r['process_limit_bytes']} bytes "
                     f"(set_per_process_memory_fraction): {r['available_bytes']} more bytes can be taken.")
    verdicts = {
        "fragmentation": "Verdict: FRAGMENTATION. Enough bytes are free in total, but no single free block "
                         "holds the request and the device cannot give a new segment.",
        "segment_size": "Verdict: SEGMENT SIZE. The device has the request's bytes free, but the allocator asks "
                        "the device for a whole segment, which is larger than what is free.",
        "exhaustion": "Verdict: EXHAUSTION. Free blocks plus the device's free memory are less than the "
                      "request: the memory is really used; make the work smaller.",
        "fits_now": "Verdict: this state would serve the request (a free block or the device has room): "
                    "the snapshot was taken after memory was released.",
        "undetermined": "Verdict: undetermined without the device's free bytes.",
    }
    lines.append(verdicts[r["verdict"]])
    lines.append(r["expandable_segments"]["explanation"]
                 + f" Would fit: {r['expandable_segments']['would_fit']}.")
    lines.append(r["empty_cache"]["explanation"] + f" Would fit: {r['empty_cache']['would_fit']}.")
    return lines


def explanation_table(result: dict) -> str:
    """The explanation for people: the sentences, then one line per segment."""
    lines = list(result["summary"]) + ["", f"{'segment':>18} {'pool':>5} {'stream':>6} {'size':>14} "
                                           f"{'free':>14} {'largest free':>14} {'blocks free':>11}"]
    for row in result["segments"]:
        lines.append(f"{hex(row['address']):>18} {row['segment_type']:>5} {str(row['stream']):>6} "
                     f"{row['total_size_bytes']:>14} {row['free_bytes']:>14} "
                     f"{row['largest_free_block_bytes']:>14} {row['free_blocks']:>11}")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line
def _non_negative_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line: plot, explain, convert, summary."""
    parser = CommandParser(prog="timeline", description=(
        "Offline allocator timeline (allocated bands, reserved, phases and peaks) and "
        "out-of-memory explainer for PyTorch's caching allocator."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    size_help = f"refuse input files larger than this, before reading them (default {MAX_FILE_BYTES})"
    p = sub.add_parser("plot", help="draw a timeline file as a PNG")
    p.add_argument("timeline", help="timeline JSON file (kind 'iteragpu-lab timeline')")
    p.add_argument("--output", required=True, help="new PNG file to create; an existing file is never overwritten")
    p.add_argument("--top", type=_non_negative_int, default=8, help="largest unlabelled allocations drawn as their own band (default 8)")
    p.add_argument("--bins", type=_positive_int, default=2000, help="time bins; each shows its highest allocated (default 2000)")
    p.add_argument("--max-file-bytes", type=_positive_int, default=MAX_FILE_BYTES, help=size_help)
    p = sub.add_parser("explain", help="why an allocation failed, from an out-of-memory snapshot")
    p.add_argument("snapshot", help="the lab's oom snapshot JSON, or a torch.cuda.memory._dump_snapshot pickle (loaded with classes refused)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="sentences and a table for people, or JSON (default table)")
    p.add_argument("--failed-request-bytes", type=_non_negative_int, default=None, help="the request that failed, when the file does not say")
    p.add_argument("--device-free-bytes", type=_non_negative_int, default=None, help="the device's free bytes at the failure, when the file does not say")
    p.add_argument("--process-limit-bytes", type=_non_negative_int, default=None, help="the cap set_per_process_memory_fraction put on this process's reserved bytes, when the file does not say")
    p.add_argument("--max-file-bytes", type=_positive_int, default=MAX_FILE_BYTES, help=size_help)
    p = sub.add_parser("convert", help="turn a torch snapshot (pickle or the lab's JSON) into a timeline file")
    p.add_argument("snapshot", help="torch.cuda.memory._dump_snapshot pickle or the lab's oom snapshot JSON")
    p.add_argument("--output", required=True, help="new timeline JSON file to create; never overwritten")
    p.add_argument("--phases", default=None, help="JSON list of [name, index, start_us, end_us] marks on the trace's clock")
    p.add_argument("--device", type=_non_negative_int, default=None, help="device index of the trace (default: the only one recorded)")
    p.add_argument("--max-file-bytes", type=_positive_int, default=MAX_FILE_BYTES, help=size_help)
    p = sub.add_parser("summary", help="per-phase peaks of a timeline file, as JSON")
    p.add_argument("timeline", help="timeline JSON file")
    p.add_argument("--max-file-bytes", type=_positive_int, default=MAX_FILE_BYTES, help=size_help)
    return parser


def run_command(args):
    """Execute one parsed command; return text to print."""
    if args.command == "plot":
        check_new_output(args.output)
        timeline = load_timeline(args.timeline, args.max_file_bytes, check=False)
        try:  # the plot validates the timeline once
            png = render_png(timeline, top=args.top, bins=args.bins)
        except TimelineError as exc:
            raise TimelineError(f"{args.timeline}: {exc}") from None
        write_new_bytes(args.output, png)
        return json.dumps({"output": str(args.output), "png_bytes": len(png)}, indent=2)
    if args.command == "explain":
        loaded = load_snapshot(args.snapshot, args.max_file_bytes)
        result = explain_snapshot(
            loaded["snapshot"],
            args.failed_request_bytes if args.failed_request_bytes is not None else loaded["failed_request_bytes"],
            args.device_free_bytes if args.device_free_bytes is not None else loaded["device_free_bytes"],
            args.process_limit_bytes if args.process_limit_bytes is not None else loaded["process_limit_bytes"])
        return json.dumps(result, indent=2) if args.format == "json" else explanation_table(result)
    if args.command == "convert":
        check_new_output(args.output)
        marks = []
        if args.phases is not None:
            marks = _parse_json(read_bounded(args.phases, args.max_file_bytes), args.phases)
            if not isinstance(marks, list):
                raise TimelineError(f"{args.phases} must hold a JSON list of phase marks")
        timeline = timeline_from_snapshot(load_snapshot(args.snapshot, args.max_file_bytes)["snapshot"],
                                          marks, device=args.device)
        check_timeline(timeline)
        write_new_bytes(args.output, (json.dumps(timeline, separators=(",", ":")) + "\n").encode("utf-8"))
        return json.dumps({"output": str(args.output), "events": len(timeline["events"]["time_us"]),
                           "phases": len(timeline["phases"])}, indent=2)
    timeline = load_timeline(args.timeline, args.max_file_bytes)
    return json.dumps(phase_peaks(timeline), indent=2)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        text = run_command(args)
    except TimelineError as exc:
        print(f"timeline: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
