"""The allocator's recorded history: compact timelines from torch's memory snapshots, and the recorder a measuring run uses."""
import os
import re
import time

from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.errors import LabError, safe_reason
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.core.numbers import parse_whole


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


# What the out-of-memory file says of where its snapshot comes from: PyTorch's out-of-memory observer
# (at the failing allocation, before the exception unwinds and frees the failed pass's tensors), or
# the state after the exception reached the phase (the failed pass's intermediates already freed).
SNAPSHOT_SOURCES = ("observer", "after unwinding")


# torch.cuda.memory_stats() figures kept in the observer: the allocator's own counters at the failure.
OBSERVER_STAT_KEYS = (
    "allocated_bytes.all.current", "reserved_bytes.all.current", "active_bytes.all.current",
    "requested_bytes.all.current", "inactive_split_bytes.all.current", "inactive_split.all.current",
    "segment.all.current", "allocated_bytes.small_pool.current", "allocated_bytes.large_pool.current",
    "reserved_bytes.small_pool.current", "reserved_bytes.large_pool.current",
    "inactive_split_bytes.small_pool.current", "inactive_split_bytes.large_pool.current",
    "num_ooms", "num_alloc_retries")


MAX_ERROR_MESSAGE_CHARS = 2000  # PyTorch's out-of-memory message is about 500 characters


def torch_format_size(size_bytes: int) -> str:
    """A byte count as c10's format_size prints it in its out-of-memory message: bytes up to 1 KiB,
    then KiB, MiB or GiB with two decimals (each unit up to and including 1024 of the one below)."""
    if size_bytes <= 1024:
        return f"{size_bytes} bytes"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20)):
        if size_bytes <= scale * 1024:
            return f"{size_bytes / scale:.2f} {unit}"
    return f"{size_bytes / 2**30:.2f} GiB"


_SIZE = r"(\d+(?:\.\d+)? (?:bytes|KiB|MiB|GiB))"
# c10/cuda/CUDACachingAllocator.cpp (torch 2.1 to 2.11): "CUDA out of memory. Tried to allocate X. GPU N
# has a total capacity of T of which F is free. [Process P has M memory in use. ][L allowed; ]Of the
# allocated memory A is allocated by PyTorch, [with G allocated in private pools (e.g., CUDA Graphs), ]
# and R is reserved by PyTorch but unallocated."
_OOM_MESSAGE = re.compile(
    r"Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capacity of " + _SIZE + r" of which " + _SIZE
    + r" is free\. (?:.*?)(?:" + _SIZE + r" allowed; )?Of the allocated memory " + _SIZE
    + r" is allocated by PyTorch, (?:with " + _SIZE + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?"
    r"and " + _SIZE + r" is reserved by PyTorch but unallocated")


def parse_oom_message(text) -> "dict | None":
    """The figures of PyTorch's out-of-memory message, as printed ("22.15 GiB"), or None when `text`
    is not that message: tried_to_allocate, gpu, total_capacity, free, allowed (None without a
    per-process cap), allocated_by_pytorch, private_pools (None without any), reserved_unallocated."""
    if not isinstance(text, str):
        return None
    found = _OOM_MESSAGE.search(text[:MAX_ERROR_MESSAGE_CHARS])
    if found is None:
        return None
    keys = ("tried_to_allocate", "gpu", "total_capacity", "free", "allowed", "allocated_by_pytorch",
            "private_pools", "reserved_unallocated")
    figures = dict(zip(keys, found.groups()))
    figures["gpu"] = int(figures["gpu"])
    return figures


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


def observer_document(observed: dict, device: str) -> dict:
    """The lab's out-of-memory document from what HistoryRecorder.observe kept: the snapshot at the
    failing allocation, the request from its trace's last oom entry (the rounded request; the
    observer's `alloc` is the segment asked for), the observer's four figures and the allocator's
    counters; the per-process cap when the observer's limit is not the device's total."""
    snapshot = observed["snapshot"]
    traces = snapshot.get("device_traces", [])
    index = observed["device_index"]
    oom = [e for e in traces[index] if e.get("action") == "oom"] if index < len(traces) else []
    limit, total = observed["device_limit_bytes"], observed["device_total_bytes"]
    return {"kind": OOM_SNAPSHOT_KIND, "schema_version": SCHEMA_VERSION, "device": device,
            "snapshot_source": "observer",
            "failed_request_bytes": oom[-1]["size"] if oom else None,
            "device_free_bytes": observed["device_free_bytes"], "device_total_bytes": total,
            "process_limit_bytes": limit if limit != total else None,
            "observer": {key: observed[key] for key in ("device_index", "alloc_bytes", "device_limit_bytes",
                                                         "device_free_bytes", "stats")},
            "snapshot": snapshot}


def oom_snapshot_path(timeline_path) -> str:
    """Where `measure --timeline FILE` saves the out-of-memory snapshot: FILE with its .json suffix
    replaced by .oom.json (run.json -> run.oom.json), or FILE.oom.json."""
    text = os.fspath(timeline_path)
    return (text[:-len(".json")] if text.endswith(".json") else text) + ".oom.json"


# c10 offers no way to detach an out-of-memory observer, so the lab attaches one per process and
# routes it to the recorder of the run under way (None between runs).
OOM_OBSERVER_ROUTE = {"attached": False, "recorder": None}


def route_oom_observer(torch, recorder) -> bool:
    """Send PyTorch's out-of-memory observer calls to `recorder` (None: to nobody), attaching the
    observer on the first call with a recorder; True when it is attached.

    ``torch._C._cuda_attach_out_of_memory_observer(fn)`` makes the caching allocator call
    ``fn(device, alloc, device_limit, device_free)`` when an allocation fails for good (after it has
    released its wholly free cached segments and retried), with its lock released and the GIL held,
    just before it raises OutOfMemoryError: `alloc` is the segment it asked the device for
    ("Tried to allocate"), `device_limit` the device's total memory (measured on an H200, torch
    2.11: cudaMemGetInfo's total) or the per-process cap that set_per_process_memory_fraction set,
    `device_free` cudaMemGetInfo's free bytes. The failed pass's tensors are still allocated then."""
    OOM_OBSERVER_ROUTE["recorder"] = recorder
    if OOM_OBSERVER_ROUTE["attached"] or recorder is None:
        return OOM_OBSERVER_ROUTE["attached"]
    attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    if attach is None:  # a torch without the observer (or not built for CUDA)
        return False

    def observer(device, alloc, device_limit, device_free):
        current = OOM_OBSERVER_ROUTE["recorder"]
        if current is not None:
            current.observe(torch, device, alloc, device_limit, device_free)

    attach(observer)
    OOM_OBSERVER_ROUTE["attached"] = True
    return True


class HistoryRecorder:
    """Records the allocator's history during `measure` and the phases' marks on the trace's clock.

    After a successful `measure(config, recorder)`, ``timeline`` holds the timeline document; after
    an out-of-memory PhaseError, the error's ``oom_snapshot`` holds the snapshot at the failure."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, stacks: bool = False):
        self.max_entries = parse_whole(max_entries, "max_entries", 1, MAX_HISTORY_ENTRIES)
        if not isinstance(stacks, bool):
            raise LabError("stacks must be True or False")
        self.stacks = stacks
        self.marks = []
        self.timeline = None
        self.observed = None  # the last out-of-memory observer call of this run, with its snapshot
        self.observer_problem = None
        self.run = None  # what the run was (a real model's config and sizes), written into the oom file

    def start(self, torch) -> None:
        # context None records no traceback at all: the cheapest recording, the same bytes
        options = {"enabled": "all", "context": "alloc" if self.stacks else None,
                   "stacks": "all" if self.stacks else "python", "max_entries": self.max_entries}
        try:  # entries left from an earlier recording would precede this run's phases
            torch.cuda.memory._record_memory_history(**options, clear_history=True)
        except TypeError:  # torch before clear_history existed
            torch.cuda.memory._record_memory_history(**options)
        self.observed, self.observer_problem = None, None
        if not route_oom_observer(torch, self):
            self.observer_problem = "this torch has no out-of-memory observer"

    def stop(self, torch) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)
        if OOM_OBSERVER_ROUTE["recorder"] is self:
            route_oom_observer(torch, None)

    def observe(self, torch, device, alloc_bytes, device_limit_bytes, device_free_bytes) -> None:
        """PyTorch's out-of-memory observer (see route_oom_observer): keep the allocator's snapshot
        and counters now, at the failing allocation. It never raises: an exception raised here would
        replace the OutOfMemoryError. It allocates no device memory."""
        try:
            stats = torch.cuda.memory_stats(device)
            snapshot = _strip_frames(torch.cuda.memory._snapshot(device))
            total_bytes = int(torch.cuda.mem_get_info(device)[1])
            self.observed = {
                "observed_us": now_us(), "device_index": int(device), "alloc_bytes": int(alloc_bytes),
                "device_limit_bytes": int(device_limit_bytes), "device_free_bytes": int(device_free_bytes),
                "device_total_bytes": total_bytes,
                "stats": {key: int(stats.get(key, 0)) for key in OBSERVER_STAT_KEYS},
                "snapshot": snapshot}
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.observed, self.observer_problem = None, f"the observer failed: {safe_reason(exc)}"

    def mark(self, name, index, start_us, end_us) -> None:
        self.marks.append((name, index, start_us, end_us))

    def failure(self, torch, device, error) -> None:
        """At a phase's out-of-memory failure: attach the out-of-memory document to `error`.

        The observer's snapshot, taken at the failing allocation, when it was called in this phase
        for the request PyTorch's message names; otherwise (an error raised outside the caching
        allocator, a torch without the observer) the allocator's state now, after the exception has
        unwound and freed the failed pass's intermediates, the trace's last oom entry naming the
        request. The document says which (``snapshot_source``) and keeps PyTorch's message."""
        if error.reason != "out_of_memory":
            return
        message = getattr(error, "error_text", None) or error.message
        observed, self.observed = self.observed, None
        problem = self.observer_problem
        if observed is None and problem is None:
            problem = "PyTorch's caching allocator did not call the observer for this failure"
        if observed is not None and self.marks and observed["observed_us"] < self.marks[-1][2]:
            observed, problem = None, "the observer's last call was in an earlier phase"
        figures = parse_oom_message(message)
        if observed is not None:
            asked = torch_format_size(observed["alloc_bytes"])
            if figures is not None and figures["tried_to_allocate"] != asked:
                observed, problem = None, (f"the observer's last call was for {asked}, "
                                           f"the error's for {figures['tried_to_allocate']}")
            elif figures is None and f"Tried to allocate {asked}" not in message:
                # not the caching allocator's message: the observer's call was for another failure
                observed, problem = None, ("the error is not the caching allocator's out-of-memory message; "
                                           "the observer's last call was for another failure")
        try:
            if observed is not None:
                document = observer_document(observed, str(device))
            else:
                document = oom_snapshot_document(torch, device, None)
                document.update({"snapshot_source": "after unwinding", "observer": None,
                                 "observer_problem": problem})
                traces = document["snapshot"]["device_traces"]
                oom = [e for e in traces[device.index] if e.get("action") == "oom"] \
                    if device.index < len(traces) else []
                if oom:
                    document["failed_request_bytes"] = oom[-1]["size"]
            document["phase"] = error.phase
            document["error_message"] = message[:MAX_ERROR_MESSAGE_CHARS]
            if self.run is not None:
                document["run"] = self.run
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
