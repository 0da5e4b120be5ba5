"""What happens inside a phase: the allocator's timeline, offline.

The TIMELINE file (``kind: "iteragpu-lab timeline"``, columnar JSON) is built from the dict
``torch.cuda.memory._snapshot()`` returns while ``_record_memory_history`` is on, with each event
assigned to the lab's phases (``allocator.history.timeline_from_snapshot``); here it is read and
checked (``load_timeline``, ``check_timeline``), reduced to per-phase peaks (``phase_peaks``) and
drawn (``plot_timeline``: allocated bytes as stacked bands of the largest allocations and labelled
groups, reserved as a line, phase boundaries and each phase's peak; binned so that a million events
plot in seconds). ``record_history``, ``stop_history`` and ``capture_oom_snapshot`` record on the GPU.
Why an allocation failed is ``views/explain.py``; the command line ``views/timeline_commands.py``.

numpy and matplotlib are imported only where a timeline is turned into arrays or drawn; torch only
inside the GPU helpers.
"""
import io
import json

from lab_helpers.allocator.history import (DEFAULT_MAX_ENTRIES, NO_PHASE, TIMELINE_ACTIONS, TIMELINE_COLUMNS,
                                           TIMELINE_KIND, is_byte_count, oom_snapshot_document)
from lab_helpers.core.errors import LabError
from lab_helpers.core.files import SCHEMA_VERSION, read_json_file, write_new_bytes
from lab_helpers.core.numbers import MIB
from lab_helpers.views.plots import MAX_DRAWN_CHARS, drawn_text, plain_texts

ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP = range(len(TIMELINE_ACTIONS))
# Files are read whole into memory before parsing; a larger file is refused unread.
MAX_FILE_BYTES = 256 * MIB
# --max-file-bytes at most: the reader asks the system for that many bytes at once, and a parsed
# JSON takes about ten times its size in memory
MAX_FILE_BYTES_LIMIT = 1024 * MIB
MAX_PHASES = 100_000  # a run records a few phases per repeat; per-phase work stays bounded
MAX_DEVICE_CHARS = 64
# What one plot draws at most (the rest is said in a note): more cannot be read and hangs the layout.
MAX_DRAWN_PHASES = 40  # the phases with the highest peaks keep their line, name and peak
MAX_LABEL_BANDS = 24  # the labels holding the most bytes keep their band; the rest join "other"
MAX_TOP = 32  # --top: the largest unlabelled allocations drawn as bands
MAX_BINS = 100_000


class TimelineError(LabError):
    """A bad timeline or snapshot file, argument or device state: one line, exit code 2."""


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


def capture_oom_snapshot(torch, path, failed_request_bytes, device=None) -> dict:
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
    version = timeline.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise TimelineError(f"unsupported schema_version {drawn_text(repr(version))}")
    device = timeline.get("device")
    if not isinstance(device, str) or not 0 < len(device) <= MAX_DEVICE_CHARS:
        raise TimelineError(f"'device' must be the device's name (e.g. \"cuda:0\"), a string of 1 to "
                            f"{MAX_DEVICE_CHARS} characters")
    if timeline.get("actions") != list(TIMELINE_ACTIONS):
        raise TimelineError(f"'actions' must be {list(TIMELINE_ACTIONS)}")
    for key in ("initial_allocated_bytes", "initial_reserved_bytes", "time_origin_us"):
        if not is_byte_count(timeline.get(key)):
            raise TimelineError(f"'{key}' must be a whole number >= 0")
    events = timeline.get("events")
    if not isinstance(events, dict):
        raise TimelineError("'events' must be an object of columns")
    phases = timeline.get("phases")
    if not isinstance(phases, list):
        raise TimelineError("'phases' must be a list")
    if len(phases) > MAX_PHASES:
        raise TimelineError(f"'phases' holds {len(phases)} phases; at most {MAX_PHASES} are read")
    for i, phase in enumerate(phases):
        if not isinstance(phase, dict) or not isinstance(phase.get("name"), str):
            raise TimelineError(f"phase {i} has no name")
        if phase.get("index") is not None and not is_byte_count(phase.get("index")):
            raise TimelineError(f"phase {i} index must be null or a whole number >= 0")
        if not (is_byte_count(phase.get("start_us")) and is_byte_count(phase.get("end_us"))
                and phase["start_us"] <= phase["end_us"]):
            raise TimelineError(f"phase {i} needs whole start_us <= end_us")
        if i and phase["start_us"] < phases[i - 1]["end_us"]:
            raise TimelineError(f"phase {i} starts before phase {i - 1} ends")
    columns = {}
    length = None
    for name in TIMELINE_COLUMNS:
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
        if any(value.__class__ is bool for value in values):  # numpy reads [1, true] as [1, 1]
            raise TimelineError(f"events column '{name}' is not a list of whole numbers")
        columns[name] = array.astype(np.int64, copy=False)
    t, action, size, phase = columns["time_us"], columns["action"], columns["size_bytes"], columns["phase"]
    checks = ((t < 0, "time_us is negative"), (size < 0, "size_bytes is negative"),
              (columns["address"] < 0, "address is negative"),
              ((action < 0) | (action >= len(TIMELINE_ACTIONS)), "action code is unknown"),
              ((phase < NO_PHASE) | (phase >= len(phases)), "phase is not a phase's position or -1"))
    for bad, message in checks:
        if bad.any():
            raise TimelineError(f"event {int(np.argmax(bad))}: {message}")
    if length > 1 and (np.diff(t) < 0).any():
        raise TimelineError(f"event {int(np.argmax(np.diff(t) < 0)) + 1}: time_us goes backwards")
    # every level below is a sum of sizes: past int64 it would wrap around silently
    total = float(size.astype(np.float64).sum()) + timeline["initial_allocated_bytes"] \
        + timeline["initial_reserved_bytes"]
    if total > 2**62:
        raise TimelineError("size_bytes and the initial bytes add up past 2**62 bytes: not a real trace")
    for key in ("frames",):
        column = events.get(key)
        if column is not None and (not isinstance(column, list) or len(column) != length or not all(
                v is None or (isinstance(v, list) and all(isinstance(f, str) for f in v)) for v in column)):
            raise TimelineError(f"events column '{key}' must hold a list of strings or null per event")
    ooms = timeline.get("ooms", [])
    if not isinstance(ooms, list) or not all(
            isinstance(o, dict) and is_byte_count(o.get("time_us")) and is_byte_count(o.get("size_bytes"))
            and (o.get("device_free_bytes") is None or is_byte_count(o.get("device_free_bytes"))) for o in ooms):
        raise TimelineError("'ooms' must be a list of {time_us, size_bytes, device_free_bytes} with whole numbers")
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
    if type(max_bytes) is not int or not 1 <= max_bytes <= MAX_FILE_BYTES_LIMIT:
        raise TimelineError(f"max_bytes must be a whole number from 1 to {MAX_FILE_BYTES_LIMIT}")
    timeline = read_json_file(path, max_bytes)
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
    # each phase's events, in event order, without a pass over every event per phase
    order = np.argsort(a["phase"], kind="stable")
    grouped = a["phase"][order]
    count = len(timeline["phases"])
    lows = np.searchsorted(grouped, np.arange(count), side="left")
    highs = np.searchsorted(grouped, np.arange(count), side="right")
    for k, phase in enumerate(timeline["phases"]):
        inside = order[lows[k]:highs[k]]
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
        rows.append({"phase": phase["name"], "index": phase.get("index"), "start_us": phase["start_us"],
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
    if span * bins <= 2**63 - 1:
        which = ((times - times[0]) * bins) // span
    else:  # the product would wrap around in int64: bins of a whole number of microseconds
        which = (times - times[0]) // -(-span // bins)
    starts = np.flatnonzero(np.concatenate(([True], which[1:] != which[:-1])))
    top = np.maximum.reduceat(levels, starts)
    counts = np.diff(np.append(starts, n))
    hits = np.flatnonzero(levels == np.repeat(top, counts))
    _, first_hit = np.unique(which[hits], return_index=True)
    last = np.append(starts[1:] - 1, n - 1)
    return np.union1d(hits[first_hit], last)


def plot_timeline(timeline, ax=None, top: int = 8, bins: int = 2000, labels=None, size_labels=None,
                  left_out=None):
    """Allocated bytes as stacked bands, reserved as a line, phases and their peaks (MiB, seconds).

    Bands: one per label (``labels`` {address: name}, then ``size_labels`` {size_bytes: name}, then
    the events' ``label`` column), then the `top` largest unlabelled allocations, the rest "other".
    Time is cut into `bins` bins; each bin is drawn at its highest ``allocated`` and its last
    event, so peaks are exact however many events there are. What a reader could not see is not
    drawn: at most MAX_DRAWN_PHASES phases (the highest peaks), MAX_LABEL_BANDS labels (the most
    bytes; the others join "other"), names cut to MAX_DRAWN_CHARS characters; a note on the plot
    says what was left out, and so does each line appended to `left_out` (a list) if given.
    Returns the Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    if type(top) is not int or not 0 <= top <= MAX_TOP or type(bins) is not int or not 1 <= bins <= MAX_BINS:
        raise TimelineError(f"top must be a whole number from 0 to {MAX_TOP} and bins from 1 to {MAX_BINS}")
    notes = []
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
    has_label = np.flatnonzero(np.not_equal(iv_label, None))
    every = sorted(set(iv_label[has_label].tolist()))
    code = {name: k for k, name in enumerate(every)}
    codes = np.array([code[name] for name in iv_label[has_label].tolist()], dtype=np.int64)
    names = every
    if len(every) > MAX_LABEL_BANDS:  # the labels holding the most bytes keep their band
        weight = np.bincount(codes, weights=iv_size[has_label].astype(np.float64), minlength=len(every))
        kept = sorted(np.argsort(-weight, kind="stable")[:MAX_LABEL_BANDS].tolist())
        names = [every[k] for k in kept]
        notes.append(f"{len(every) - len(kept)} of {len(every)} labels drawn within 'other'")
        remap = np.full(len(every), -1, dtype=np.int64)
        remap[kept] = np.arange(len(kept))
        codes = remap[codes]
    band = np.full(first_event.size, -1, dtype=np.int64)
    band[has_label] = codes
    names = [drawn_text(name) for name in names]
    unlabelled = np.flatnonzero(band < 0)
    largest = unlabelled[np.argsort(-iv_size[unlabelled], kind="stable")[:top]]
    # a band thinner than 1 % of the peak cannot be seen: such allocations stay in "other"
    peak = int(a["allocated"].max()) if a["allocated"].size else 0
    largest = largest[iv_size[largest].astype(np.float64) * 100 >= peak]  # int64 would wrap past 2**63 / 100
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
    rows = phase_peaks(timeline, a)
    if len(rows) > MAX_DRAWN_PHASES:  # the highest peaks keep their line, name and peak, in time order
        highest = np.argsort([-row["peak_allocated_bytes"] for row in rows], kind="stable")[:MAX_DRAWN_PHASES]
        notes.append(f"{len(rows) - MAX_DRAWN_PHASES} of {len(rows)} phases not drawn "
                     f"(the {MAX_DRAWN_PHASES} with the highest peaks are)")
        rows = [rows[k] for k in sorted(highest.tolist())]
    cut = sum(len(row["phase"]) > MAX_DRAWN_CHARS for row in rows) + sum(
        len(name) > MAX_DRAWN_CHARS for name in every)
    if cut:
        notes.append(f"{cut} names cut to {MAX_DRAWN_CHARS} characters")
    for row in rows:
        ax.axvline(row["start_us"] / 1e6, color="grey", linestyle=":", linewidth=1)
        name = drawn_text(row["phase"])
        title = name if row["index"] is None else f"{name} #{row['index']}"
        ax.annotate(title, (row["start_us"] / 1e6, 1), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8, color="dimgrey", usetex=False)
        ax.plot(row["peak_time_us"] / 1e6, row["peak_allocated_bytes"] / MIB, marker="v", color="crimson")
        ax.annotate(f"{row['peak_allocated_bytes'] / MIB:.1f}", (row["peak_time_us"] / 1e6,
                    row["peak_allocated_bytes"] / MIB), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7, color="crimson")
    ax.set_xlabel("seconds since the first recorded event")
    ax.set_ylabel("MiB")
    ax.set_title(f"allocated (bands) and reserved (line), {drawn_text(timeline['device'])}; "
                 "▼ each phase's peak allocated", usetex=False)
    plain_texts(ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7).get_texts())
    if notes:
        ax.text(0, -0.12, "left out: " + "; ".join(notes), transform=ax.transAxes, fontsize=7,
                color="dimgrey", va="top", usetex=False)
    if left_out is not None:
        left_out.extend(notes)
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
