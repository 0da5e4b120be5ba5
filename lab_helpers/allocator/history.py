"""The allocator's recorded history: compact timelines from torch's memory snapshots, and the recorder a measuring run uses."""
import os
import time

from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.errors import LabError, safe_reason
from lab_helpers.core.numbers import parse_whole
from lab_helpers.measurement.schema import SCHEMA_VERSION


# The raw material of lab_helpers.timeline (plot, explain), recorded by `measure --timeline`. It
# lives here so that this file alone can record it; lab_helpers.timeline imports these names.
TIMELINE_KIND = "iteragpu-lab timeline"


OOM_SNAPSHOT_KIND = "iteragpu-lab oom snapshot"


# Event action codes of the columnar file, by position (schema version 1).
TIMELINE_ACTIONS = ("alloc", "free", "segment_alloc", "segment_free", "segment_map", "segment_unmap")


TIMELINE_COLUMNS = ("time_us", "action", "address", "size_bytes", "phase")


NO_PHASE = -1  # an event between two phases (or outside all of them)


MAX_COUNT = 2**63 - 1  # addresses, sizes and times are int64 in c10; larger numbers are not real


# c10 writes "active_pending_free"; torch's docstring calls it "active_awaiting_free"
BLOCK_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free", "inactive")


DEFAULT_MAX_ENTRIES = 1_000_000  # ring buffer of the allocator's history; older entries are dropped


MAX_HISTORY_ENTRIES = 2**31 - 1


STACK_FRAMES_KEPT = 12  # innermost frames kept per allocation with --timeline-stacks


WEIGHTS_LABEL, INPUTS_LABEL, WORKSPACE_LABEL = "weights", "inputs", "workspace"


KV_CACHE_LABEL = "kv_cache"  # a transformers model's key/value cache (real_model measure)


def now_us() -> int:
    """The clock of the allocator's trace (``time_us``): Unix time in microseconds.

    c10 stamps each entry with a TSC reading converted to CLOCK_REALTIME, so phase marks taken with
    this function line up with the trace to within the converter's error (microseconds)."""
    return time.time_ns() // 1000


def is_byte_count(value) -> bool:
    """True for a whole number (not a bool) in [0, 2**63 - 1]: c10's sizes, addresses and times."""
    return type(value) is int and 0 <= value <= MAX_COUNT


def check_allocator_snapshot(snapshot, where) -> None:
    """Validate the parts of a ``torch.cuda.memory._snapshot()`` dict the lab reads (segments,
    blocks, trace entries); raise LabError naming `where` and the first fault."""
    if not isinstance(snapshot, dict):
        raise LabError(f"{where}: the snapshot is not a dict")
    segments = snapshot.get("segments")
    if not isinstance(segments, list):
        raise LabError(f"{where}: the snapshot has no 'segments' list")
    for i, segment in enumerate(segments):
        if not isinstance(segment, dict):
            raise LabError(f"{where}: segment {i} is not a dict")
        for key in ("address", "total_size"):
            if not is_byte_count(segment.get(key)):
                raise LabError(f"{where}: segment {i} '{key}' is not a whole number >= 0")
        if segment.get("segment_type", "large") not in ("small", "large"):
            raise LabError(f"{where}: segment {i} 'segment_type' is not small or large")
        blocks = segment.get("blocks")
        if not isinstance(blocks, list):
            raise LabError(f"{where}: segment {i} has no 'blocks' list")
        total = 0
        for j, block in enumerate(blocks):
            if not isinstance(block, dict) or not is_byte_count(block.get("size")):
                raise LabError(f"{where}: segment {i} block {j} has no whole 'size'")
            if block.get("state") not in BLOCK_STATES:
                raise LabError(f"{where}: segment {i} block {j} state {str(block.get('state'))[:40]!r} is unknown")
            total += block["size"]
        if total != segment["total_size"]:
            raise LabError(f"{where}: segment {i} blocks add up to {total} bytes, "
                           f"not its total_size {segment['total_size']}")
    traces = snapshot.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise LabError(f"{where}: 'device_traces' is not a list of lists")
    for d, trace in enumerate(traces):
        for k, entry in enumerate(trace):
            if not isinstance(entry, dict) or not isinstance(entry.get("action"), str):
                raise LabError(f"{where}: device {d} trace entry {k} has no 'action'")
            if not is_byte_count(entry.get("size")):
                raise LabError(f"{where}: device {d} trace entry {k} has no whole 'size'")


def _phase_marks(phase_marks) -> list:
    """Validate (name, index, start_us, end_us) marks: in order, not overlapping."""
    phases = []
    for i, mark in enumerate(phase_marks):
        if not isinstance(mark, (list, tuple)) or len(mark) != 4:
            raise LabError(f"phase mark {i} is not (name, index, start_us, end_us)")
        name, index, start, end = mark
        if not isinstance(name, str) or not name:
            raise LabError(f"phase mark {i}: the name must be a non-empty string")
        if index is not None and not is_byte_count(index):
            raise LabError(f"phase mark {i}: the index must be None or a whole number >= 0")
        if not (type(start) is int and type(end) is int and start <= end):
            raise LabError(f"phase mark {i}: start_us and end_us must be whole numbers, start <= end")
        if phases and start < phases[-1][3]:
            raise LabError(f"phase mark {i} starts before phase mark {i - 1} ends")
        phases.append((name, index, start, end))
    return phases


def _device_trace(snapshot: dict, device) -> tuple:
    traces = snapshot.get("device_traces", [])
    if device is None:
        used = [d for d, trace in enumerate(traces) if trace]
        if len(used) > 1:
            raise LabError(f"the snapshot has traces for devices {used}; choose one")
        device = used[0] if used else 0
    if type(device) is not int or device < 0:
        raise LabError(f"device must be a device index >= 0, got {device!r}")
    return device, (traces[device] if device < len(traces) else [])


def _frames_text(entry) -> list:
    frames = entry.get("frames")
    if not isinstance(frames, list):
        return []
    return [f"{f.get('name')} {f.get('filename')}:{f.get('line')}" for f in frames[:STACK_FRAMES_KEPT]
            if isinstance(f, dict)]


def timeline_from_snapshot(snapshot: dict, phase_marks: list = (), device=None, labels=None,
                           stacks: bool = False) -> dict:
    """Turn ``torch.cuda.memory._snapshot()`` into the lab's columnar timeline (standard library).

    `phase_marks`: (name, index, start_us, end_us) on the trace's clock (``now_us``); each event
    falls in the phase whose [start, end] holds its time, else -1. Tensor sizes are the trace's
    requested bytes rounded up to 512, the allocator's block size (a large block that kept an
    unsplit remainder of up to 1 MiB is larger; the trace does not say). A tensor's release is its
    ``free_requested`` (when ``allocated`` drops), or its ``free_completed`` when no request was
    recorded. ``initial_*_bytes`` are what the trace's first event found, derived from the segments
    the snapshot ends with. `labels`: {address: label} stored on the last alloc event at that
    address (the tensor made there last: an address is reused once its block is free). `stacks`: keep each allocation's innermost frames (column
    ``frames``). lab_helpers.views.timeline.check_timeline validates the result.
    """
    check_allocator_snapshot(snapshot, "snapshot")
    phases = _phase_marks(phase_marks)
    device, trace = _device_trace(snapshot, device)
    ALLOC, FREE, SEGMENT_ALLOC = (TIMELINE_ACTIONS.index(a) for a in ("alloc", "free", "segment_alloc"))
    codes = {name: code for code, name in enumerate(TIMELINE_ACTIONS) if name != "free"}
    times, actions, addresses, sizes, frames, ooms = [], [], [], [], [], []
    requested = set()  # addresses whose free_requested was recorded since their alloc
    for k, entry in enumerate(trace):
        action, size = entry["action"], entry["size"]
        when = entry.get("time_us")
        if type(when) is not int:
            raise LabError(f"trace entry {k} has no whole 'time_us' (torch 2.1 or newer records it)")
        if action == "oom":
            if entry.get("device_free") is not None and not is_byte_count(entry.get("device_free")):
                raise LabError(f"trace entry {k} (oom) has a 'device_free' that is not a whole number")
            ooms.append({"time_us": when, "size_bytes": size, "device_free_bytes": entry.get("device_free")})
            continue
        if action == "snapshot":
            continue
        address = entry.get("addr")
        if not is_byte_count(address):
            raise LabError(f"trace entry {k} ({str(action)[:40]}) has no whole 'addr'")
        if action == "free_requested":
            requested.add(address)
            code = FREE
        elif action == "free_completed":
            if address in requested:
                requested.discard(address)
                continue
            code = FREE
        elif action in codes:
            code = codes[action]
            if code == ALLOC:
                requested.discard(address)
        else:
            raise LabError(f"trace entry {k} has an unknown action {str(action)[:40]!r}")
        times.append(when)
        actions.append(code)
        addresses.append(address)
        # the trace records a tensor's requested bytes; its block (what `allocated` counts) is rounded
        sizes.append(AllocatorModel.round_size(size) if code in (ALLOC, FREE) else size)
        if stacks:
            frames.append(_frames_text(entry) if code == ALLOC else None)
    starts = [p[2] for p in phases]
    origin = min(times[:1] + starts[:1] + [o["time_us"] for o in ooms[:1]] or [0])
    # the order is the allocator's own; its times are TSC readings converted to Unix time, so a
    # time a microsecond before the previous one is lifted to it (the file's times never go back)
    for k in range(1, len(times)):
        if times[k] < times[k - 1]:
            times[k] = times[k - 1]
    phase_column = _assign_phases(times, phases)
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    end_reserved = sum(s["total_size"] for s in segments)
    end_allocated = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated")
    net_allocated = sum(s if a == ALLOC else -s for a, s in zip(actions, sizes) if a in (ALLOC, FREE))
    net_reserved = sum(s if a in (SEGMENT_ALLOC, codes["segment_map"]) else -s
                       for a, s in zip(actions, sizes) if a >= SEGMENT_ALLOC)
    events = {"time_us": [t - origin for t in times], "action": actions, "address": addresses,
              "size_bytes": sizes, "phase": phase_column}
    if labels:
        # an address is reused once its block is free: the label names the last tensor made there
        last = {a: k for k, (a, c) in enumerate(zip(addresses, actions)) if c == ALLOC and a in labels}
        marked = {k: labels[a] for a, k in last.items()}
        events["label"] = [marked.get(k) for k in range(len(addresses))]
    if stacks:
        events["frames"] = frames
    return {
        "kind": TIMELINE_KIND, "schema_version": SCHEMA_VERSION, "device": f"cuda:{device}",
        "time_origin_us": origin, "actions": list(TIMELINE_ACTIONS),
        "initial_allocated_bytes": max(0, end_allocated - net_allocated),
        "initial_reserved_bytes": max(0, end_reserved - net_reserved),
        "events": events,
        "phases": [{"name": n, "index": i, "start_us": s - origin, "end_us": e - origin} for n, i, s, e in phases],
        "ooms": [{**o, "time_us": o["time_us"] - origin} for o in ooms],
    }


def _assign_phases(times: list, phases: list) -> list:
    import bisect
    starts = [p[2] for p in phases]
    column = []
    for t in times:
        k = bisect.bisect_right(starts, t) - 1
        column.append(k if k >= 0 and t <= phases[k][3] else NO_PHASE)
    return column


def workspace_addresses(trace: list, start_us: int, end_us: int) -> set:
    """Addresses allocated in [start_us, end_us] and never released later in `trace`: in the cold
    forward pass, the math libraries' persistent workspaces (cuBLAS, cuBLASLt)."""
    made, released = {}, set()
    for entry in trace:
        when, address = entry.get("time_us"), entry.get("addr")
        if entry.get("action") == "alloc" and type(when) is int and start_us <= when <= end_us:
            made[address] = True
            released.discard(address)
        elif entry.get("action") in ("free_requested", "free_completed") and address in made:
            released.add(address)
    return {address for address in made if address not in released}


def _strip_frames(snapshot: dict) -> dict:
    """The snapshot without tracebacks (they are most of its size and none of the explanation)."""
    segments = [{**{k: v for k, v in s.items() if k != "frames"},
                 "blocks": [{k: v for k, v in b.items() if k != "frames"} for b in s.get("blocks", [])]}
                for s in snapshot.get("segments", [])]
    traces = [[{k: v for k, v in e.items() if k in ("action", "addr", "size", "stream", "time_us",
                                                      "device_free")} for e in trace]
              for trace in snapshot.get("device_traces", [])]
    return {"segments": segments, "device_traces": traces}


def oom_snapshot_document(torch, device, failed_request_bytes) -> dict:
    """The lab's out-of-memory snapshot of `device` (a torch.device cuda:N) now: the allocator's
    segments and trace without tracebacks, the request that failed and the device's free bytes
    (``mem_get_info``), as ``python -m lab_helpers.timeline explain`` reads it."""
    if failed_request_bytes is not None and not is_byte_count(failed_request_bytes):
        raise LabError(f"failed_request_bytes must be a whole number >= 0, got {failed_request_bytes!r}")
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return {"kind": OOM_SNAPSHOT_KIND, "schema_version": SCHEMA_VERSION, "device": str(device),
            "failed_request_bytes": failed_request_bytes, "device_free_bytes": int(free_bytes),
            "device_total_bytes": int(total_bytes),
            "snapshot": _strip_frames(torch.cuda.memory._snapshot(device))}


def oom_snapshot_path(timeline_path) -> str:
    """Where `measure --timeline FILE` saves the out-of-memory snapshot: FILE with its .json suffix
    replaced by .oom.json (run.json -> run.oom.json), or FILE.oom.json."""
    text = os.fspath(timeline_path)
    return (text[:-len(".json")] if text.endswith(".json") else text) + ".oom.json"


class HistoryRecorder:
    """Records the allocator's history during `measure` and the phases' marks on the trace's clock.

    After a successful `measure(config, recorder)`, ``timeline`` holds the timeline document; after
    an out-of-memory PhaseError, the error's ``oom_snapshot`` holds the snapshot at the failure."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, stacks: bool = False):
        self.max_entries = parse_whole(max_entries, "--timeline-max-entries", 1, MAX_HISTORY_ENTRIES)
        if not isinstance(stacks, bool):
            raise LabError("stacks must be True or False")
        self.stacks = stacks
        self.marks = []
        self.timeline = None

    def start(self, torch) -> None:
        # context None records no traceback at all: the cheapest recording, the same bytes
        options = {"enabled": "all", "context": "alloc" if self.stacks else None,
                   "stacks": "all" if self.stacks else "python", "max_entries": self.max_entries}
        try:  # entries left from an earlier recording would precede this run's phases
            torch.cuda.memory._record_memory_history(**options, clear_history=True)
        except TypeError:  # torch before clear_history existed
            torch.cuda.memory._record_memory_history(**options)

    @staticmethod
    def stop(torch) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)

    def mark(self, name, index, start_us, end_us) -> None:
        self.marks.append((name, index, start_us, end_us))

    def failure(self, torch, device, error) -> None:
        """At a phase's failure (tensors of the failed pass still referenced by the traceback):
        attach the out-of-memory snapshot to `error`, the trace's last oom entry naming the request."""
        if error.reason != "out_of_memory":
            return
        try:
            document = oom_snapshot_document(torch, device, None)
            oom = [e for e in document["snapshot"]["device_traces"][device.index]
                   if e.get("action") == "oom"] if device.index < len(document["snapshot"]["device_traces"]) else []
            if oom:
                document["failed_request_bytes"] = oom[-1]["size"]
            document["phase"] = error.phase
            error.oom_snapshot = document
        except Exception as exc:  # the device may be unusable after the failure
            error.oom_snapshot_problem = safe_reason(exc)

    def finish(self, torch, device, state) -> None:
        """Build the timeline from the snapshot, labelling weights, inputs and workspaces."""
        labels = {p.untyped_storage().data_ptr(): WEIGHTS_LABEL for p in state["model"].parameters()}
        labels[state["x"].untyped_storage().data_ptr()] = INPUTS_LABEL
        self.finish_labelled(torch, device, labels, "cold_forward")

    def finish_labelled(self, torch, device, labels: dict, workspace_phase=None) -> None:
        """Build the timeline from the snapshot now. `labels` {storage address: label} names the
        tensors still alive; addresses allocated in the first phase named `workspace_phase` (the
        first forward pass) and never released are labelled workspaces unless already labelled."""
        snapshot = torch.cuda.memory._snapshot(device)
        labels = dict(labels)
        cold = [m for m in self.marks if m[0] == workspace_phase]
        traces = snapshot.get("device_traces", [])
        trace = traces[device.index] if device.index < len(traces) else []
        if cold:
            for address in workspace_addresses(trace, cold[0][2], cold[0][3]):
                labels.setdefault(address, WORKSPACE_LABEL)
        self.timeline = timeline_from_snapshot(snapshot, self.marks, device=device.index, labels=labels,
                                               stacks=self.stacks)
