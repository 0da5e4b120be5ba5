"""Why an allocation failed, from an out-of-memory snapshot of PyTorch's caching allocator.

``load_snapshot`` reads the lab's OOM snapshot JSON or a ``torch.cuda.memory._dump_snapshot`` pickle
(loaded with every class refused); ``explain_snapshot`` gives the request that failed, the free
blocks, fragmentation or exhaustion, and what ``expandable_segments`` or ``empty_cache()`` would
change, in numbers and words; ``explanation_table`` says it for people.
"""
import io
import pickle

from lab_helpers.allocator.history import (MAX_ERROR_MESSAGE_CHARS, OBSERVER_STAT_KEYS, OOM_SNAPSHOT_KIND,
                                           SNAPSHOT_SOURCES, check_allocator_snapshot, is_byte_count,
                                           parse_oom_message, torch_format_size)
from lab_helpers.allocator.model import (AllocatorModel, LARGE_SEGMENT_BYTES, SMALL_REQUEST_MAX_BYTES,
                                         SMALL_SEGMENT_BYTES)
from lab_helpers.core.files import SCHEMA_VERSION, read_bounded_bytes, read_json_file
from lab_helpers.core.numbers import MIB
from lab_helpers.core.text import printable
from lab_helpers.views.timeline import MAX_FILE_BYTES, MAX_FILE_BYTES_LIMIT, TimelineError

# Expandable segments map device memory in pages of the pool's segment size (c10:
# kSmallBuffer 2 MiB for the small pool, kLargeBuffer 20 MiB for the large one).
EXPANDABLE_PAGE_BYTES = {"small": SMALL_SEGMENT_BYTES, "large": LARGE_SEGMENT_BYTES}
PENDING_FREE_STATES = ("active_pending_free", "active_awaiting_free")
PICKLE_PROTO = b"\x80"  # the first byte of a pickle of protocol 2 or later; no JSON text starts with it
# The caching allocator's rounding rules, one copy: the lab's model of the allocator.
round_request = AllocatorModel.round_size
segment_bytes_for = AllocatorModel.segment_size


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
    """The bytes of a snapshot file (core.files' bounded reader: a regular file of at most `max_bytes`,
    checked before reading, FIFOs never block). Only a pickle needs bytes: JSON is read by
    core.files.read_json_file."""
    data = read_bounded_bytes(path, max_bytes, "snapshot")
    if not data:
        raise TimelineError(f"{path} is empty")
    return data


# What a pickle may make the unpickler do, checked on its opcodes before it runs: the unpickler's
# own work is linear in them except where a dict key or set item is a container (hashing a tuple
# built from memo references doubles at each level: a few hundred bytes that never finish), and a
# memo index sizes the memo's table (an index of 2**32 asks for 32 GiB).
MAX_PICKLE_STACK = 100_000  # torch's pickler batches 1000 items per APPENDS or SETITEMS
MAX_PICKLE_OBJECTS = 50_000_000
_ATOM, _CONTAINER = "atom", "container"
_ATOM_OPCODES = frozenset((
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
    "BINUNICODE8", "NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT"))
_EMPTY_OPCODES = frozenset(("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"))
# these look a class up by name: find_class refuses it by name, so the scan stops there
_CLASS_OPCODES = frozenset(("GLOBAL", "STACK_GLOBAL", "INST", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"))


def check_pickle_work(data: bytes, path) -> None:
    """Refuse, before unpickling, a pickle whose loading would not be bounded by its size: a
    container as a dict key or set item, a memo index past the objects made so far, a stack or an
    object count past its bound, or an opcode that builds anything but plain data."""
    import pickletools
    stack, marks, memo, made = [], [], {}, 0

    def pop_mark():
        if not marks:
            raise TimelineError(f"{path} is not a readable pickle (no MARK)")
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def keys_plain(keys, what):
        if any(key is not _ATOM for key in keys):
            raise TimelineError(f"{path}: a pickled {what} holds a container as a key or item; "
                                "torch's snapshot never does (refused: hashing it is unbounded)")

    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            made += 1
            if made > MAX_PICKLE_OBJECTS or len(stack) > MAX_PICKLE_STACK:
                raise TimelineError(f"{path}: the pickle makes more than {MAX_PICKLE_STACK} pending items or "
                                    f"{MAX_PICKLE_OBJECTS} objects")
            if name in _ATOM_OPCODES:
                stack.append(_ATOM)
            elif name in _EMPTY_OPCODES:
                stack.append(_CONTAINER)
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("LIST", "TUPLE"):
                pop_mark()
                stack.append(_CONTAINER)
            elif name in ("DICT", "SETITEMS"):
                items = pop_mark()
                keys_plain(items[0::2], "dict")
                if name == "DICT":
                    stack.append(_CONTAINER)
            elif name in ("FROZENSET", "ADDITEMS"):
                keys_plain(pop_mark(), "set")
                if name == "FROZENSET":
                    stack.append(_CONTAINER)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                count = int(name[-1])
                if len(stack) < count:
                    raise TimelineError(f"{path} is not a readable pickle (stack underflow)")
                del stack[len(stack) - count:]
                stack.append(_CONTAINER)
            elif name == "APPEND":
                stack[-1:] = []
            elif name == "APPENDS":
                pop_mark()
            elif name == "SETITEM":
                keys_plain(stack[-2:-1], "dict")
                stack[-2:] = []
            elif name == "POP":
                if marks and marks[-1] == len(stack):
                    marks.pop()  # POP of a MARK on the stack's top
                else:
                    stack[-1:] = []
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(stack[-1] if stack else _ATOM)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                index = len(memo) if name == "MEMOIZE" else int(arg)
                if index > made:  # the unpickler sizes its memo table by the largest index
                    raise TimelineError(f"{path}: a memo index ({index}) past the objects made so far")
                memo[index] = stack[-1] if stack else _ATOM
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(int(arg), _ATOM))
            elif name in _CLASS_OPCODES or name == "STOP":
                return
            elif name not in ("PROTO", "FRAME"):
                raise TimelineError(f"{path}: refusing the pickle opcode {name}: only plain data is accepted")
    except ValueError as exc:
        raise TimelineError(f"{path} is not a readable pickle ({printable(str(exc))[:80]})") from None


def _parse_pickle(data: bytes, path):
    check_pickle_work(data, path)
    try:
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise TimelineError(f"{path}: {exc}") from None
    except RecursionError:
        raise TimelineError(f"{path} is nested too deeply") from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            MemoryError, UnicodeDecodeError) as exc:
        raise TimelineError(f"{path} is not a readable pickle ({type(exc).__name__})") from None


# The lab's out-of-memory file: the keys explain reads, each None when absent (files of older versions)
OOM_DOCUMENT_KEYS = ("snapshot", "failed_request_bytes", "device_free_bytes", "process_limit_bytes",
                     "device_total_bytes", "snapshot_source", "observer", "observer_problem", "error_message",
                     "phase", "run")
_OOM_BYTE_KEYS = ("failed_request_bytes", "device_free_bytes", "process_limit_bytes", "device_total_bytes")
_OBSERVER_BYTE_KEYS = ("device_index", "alloc_bytes", "device_limit_bytes", "device_free_bytes")
MAX_TEXT_FIELD_CHARS = 1000  # the phase's name and why the observer was not used


def load_snapshot(path, max_bytes: int = MAX_FILE_BYTES) -> dict:
    """Read an out-of-memory snapshot: the lab's JSON file or a ``_dump_snapshot`` pickle.

    Returns {key: value or None} for every key of OOM_DOCUMENT_KEYS ("snapshot" is the torch-format
    dict). Pickles are loaded with classes refused; the lab's new fields are checked by
    check_oom_fields."""
    check_max_file_bytes(max_bytes)
    data = read_bounded(path, max_bytes)
    if data[:1] == PICKLE_PROTO:
        document = _parse_pickle(data, path)
        if not isinstance(document, dict):
            raise TimelineError(f"{path} holds a {type(document).__name__}, not a snapshot dict")
        wrapped = {key: None for key in OOM_DOCUMENT_KEYS}
        wrapped["snapshot"] = document
    else:
        document = read_json_file(path, max_bytes)
        if not isinstance(document, dict) or document.get("kind") != OOM_SNAPSHOT_KIND:
            raise TimelineError(f"{path} is not an {OOM_SNAPSHOT_KIND} file or a torch snapshot pickle")
        if document.get("schema_version") != SCHEMA_VERSION:
            raise TimelineError(f"{path}: unsupported schema_version {document.get('schema_version')!r}")
        wrapped = {key: document.get(key) for key in OOM_DOCUMENT_KEYS}
        check_oom_fields(wrapped, path)
    check_snapshot_shape(wrapped["snapshot"], path)
    check_allocator_snapshot(wrapped["snapshot"], path)
    return wrapped


def check_oom_fields(document: dict, where) -> None:
    """Refuse the lab's out-of-memory fields of a wrong type or that contradict each other."""
    for key in _OOM_BYTE_KEYS:
        if document.get(key) is not None and not is_byte_count(document[key]):
            raise TimelineError(f"{where}: {key} must be a whole number of bytes >= 0")
    source = document.get("snapshot_source")
    if source is not None and source not in SNAPSHOT_SOURCES:
        raise TimelineError(f"{where}: snapshot_source must be one of {', '.join(map(repr, SNAPSHOT_SOURCES))}")
    for key, bound in (("error_message", MAX_ERROR_MESSAGE_CHARS), ("observer_problem", MAX_TEXT_FIELD_CHARS),
                       ("phase", MAX_TEXT_FIELD_CHARS)):
        value = document.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > bound):
            raise TimelineError(f"{where}: {key} must be a string of at most {bound} characters")
    run = document.get("run")
    if run is not None and not (isinstance(run, dict) and isinstance(run.get("configuration"), dict)
                                and isinstance(run.get("model_config"), dict)):
        raise TimelineError(f"{where}: run must be an object with a 'configuration' and a 'model_config' object")
    observer = document.get("observer")
    if source == "observer" and not isinstance(observer, dict):
        raise TimelineError(f"{where}: snapshot_source is 'observer' but 'observer' is not an object")
    if observer is None:
        return
    if source != "observer":
        raise TimelineError(f"{where}: an 'observer' object needs snapshot_source 'observer'")
    if not isinstance(observer, dict):
        raise TimelineError(f"{where}: observer must be an object")
    for key in _OBSERVER_BYTE_KEYS:
        if not is_byte_count(observer.get(key)):
            raise TimelineError(f"{where}: observer '{key}' must be a whole number >= 0")
    stats = observer.get("stats")
    if not isinstance(stats, dict):
        raise TimelineError(f"{where}: observer 'stats' must be an object of torch.cuda.memory_stats() figures")
    if set(stats) - set(OBSERVER_STAT_KEYS):
        raise TimelineError(f"{where}: observer 'stats' holds a figure the lab does not record")
    for key in OBSERVER_STAT_KEYS:
        if not is_byte_count(stats.get(key)):
            raise TimelineError(f"{where}: observer stats '{key}' must be a whole number >= 0")
    if stats["allocated_bytes.all.current"] > stats["reserved_bytes.all.current"]:
        raise TimelineError(f"{where}: observer stats: allocated is larger than reserved")
    if document.get("device_free_bytes") != observer["device_free_bytes"]:
        raise TimelineError(f"{where}: device_free_bytes differs from the observer's device_free_bytes")


_INT_OR_NONE = (int, type(None))
_SEGMENT_FIELDS = (("device", int), ("stream", _INT_OR_NONE), ("segment_type", str))
# torch writes no address (None) for entries that are not a block's, e.g. its "oom" and "snapshot" entries
_ENTRY_FIELDS = (("addr", _INT_OR_NONE), ("stream", _INT_OR_NONE), ("time_us", int), ("device_free", _INT_OR_NONE),
                 ("action", str))


def check_snapshot_shape(snapshot, where) -> None:
    """Refuse a snapshot whose parts the lab reads are shared (one object at two places: a pickle's
    memo makes a few bytes stand for millions of blocks) or of a type a comparison or a message
    could not handle in bounded time (a nested list as a stream); check_allocator_snapshot checks
    the rest. Torch's snapshots hold fresh dicts with numbers and strings there."""
    if not isinstance(snapshot, dict):
        raise TimelineError(f"{where}: the snapshot is not a dict")
    seen = set()

    def fresh(value, what):
        if isinstance(value, (dict, list)):
            if id(value) in seen:
                raise TimelineError(f"{where}: {what} is the same object as an earlier part (a pickle memo "
                                    "reference); torch's snapshots never share one")
            seen.add(id(value))

    def typed(item, fields, what):
        for key, kind in fields:
            value = item.get(key)
            if key in item and (not isinstance(value, kind) or isinstance(value, bool)):
                raise TimelineError(f"{where}: {what} '{key}' is a {type(value).__name__}, not a "
                                    f"{'whole number' if kind is not str else 'string'}")

    segments, traces = snapshot.get("segments"), snapshot.get("device_traces", [])
    for name, parts in (("segments", segments), ("device_traces", traces)):
        fresh(parts, f"'{name}'")
    for i, segment in enumerate(segments if isinstance(segments, list) else []):
        fresh(segment, f"segment {i}")
        if isinstance(segment, dict):
            typed(segment, _SEGMENT_FIELDS, f"segment {i}")
            blocks = segment.get("blocks")
            fresh(blocks, f"segment {i} 'blocks'")
            for j, block in enumerate(blocks if isinstance(blocks, list) else []):
                fresh(block, f"segment {i} block {j}")
                if isinstance(block, dict):
                    typed(block, (("state", str),), f"segment {i} block {j}")
    for d, trace in enumerate(traces if isinstance(traces, list) else []):
        fresh(trace, f"device {d} trace")
        for k, entry in enumerate(trace if isinstance(trace, list) else []):
            fresh(entry, f"device {d} trace entry {k}")
            if isinstance(entry, dict):
                typed(entry, _ENTRY_FIELDS, f"device {d} trace entry {k}")


def check_max_file_bytes(max_bytes) -> None:
    """Refuse a size bound that is not a whole number from 1 to MAX_FILE_BYTES_LIMIT."""
    if type(max_bytes) is not int or not 1 <= max_bytes <= MAX_FILE_BYTES_LIMIT:
        raise TimelineError(f"max_bytes must be a whole number from 1 to {MAX_FILE_BYTES_LIMIT}")


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
    check_snapshot_shape(snapshot, "snapshot")
    check_allocator_snapshot(snapshot, "snapshot")
    for name, value in (("failed_request_bytes", failed_request_bytes), ("device_free_bytes", device_free_bytes),
                        ("process_limit_bytes", process_limit_bytes)):
        if value is not None and not is_byte_count(value):
            raise TimelineError(f"{name} must be a whole number of bytes >= 0, got {value!r}")
    oom = _last_oom(snapshot)
    device, stream = None, None
    if oom is not None:
        device, entry = oom
        stream = entry.get("stream")
        if failed_request_bytes is None:
            failed_request_bytes = entry["size"]
        if device_free_bytes is None and is_byte_count(entry.get("device_free")):
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


# ------------------------------------------------------------------ the lab's file: observer and message
_UNIT_BYTES = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def printed_bytes(text: str) -> float:
    """The bytes a figure of PyTorch's message stands for ("22.15 GiB"), to its two decimals."""
    number, unit = text.split()
    return float(number) * _UNIT_BYTES[unit]


def explain_document(loaded: dict, failed_request_bytes=None, device_free_bytes=None,
                     process_limit_bytes=None) -> dict:
    """explain_snapshot on what load_snapshot read (the arguments, when given, override the file's),
    with where the snapshot comes from and the figures side by side: PyTorch's message as it printed
    them, the observer's (its four arguments and torch.cuda.memory_stats() in it) and the
    explainer's, from the snapshot's segments."""
    observer = loaded.get("observer")
    request = failed_request_bytes if failed_request_bytes is not None else loaded.get("failed_request_bytes")
    request_note = None
    if request is None and observer is not None and not _last_oom(loaded["snapshot"]):
        # no trace: the observer's `alloc` is the segment asked for, the request rounded up to it
        request, request_note = observer["alloc_bytes"], "the observer's segment size (the snapshot has no trace)"
    result = explain_snapshot(
        loaded["snapshot"], request,
        device_free_bytes if device_free_bytes is not None else loaded.get("device_free_bytes"),
        process_limit_bytes if process_limit_bytes is not None else loaded.get("process_limit_bytes"))
    source = loaded.get("snapshot_source")
    result["snapshot_source"] = source
    result["observer_problem"] = loaded.get("observer_problem")
    result["phase"] = loaded.get("phase")
    result["request_note"] = request_note
    result["reserved_unallocated_bytes"] = result["reserved_bytes"] - result["allocated_bytes"]
    figures = parse_oom_message(loaded.get("error_message"))
    result["error_message"] = loaded.get("error_message")
    result["message_figures"] = figures
    # side by side only where there is something to set beside the snapshot: the message or the observer
    result["figures"] = _figures(result, loaded, figures) if figures or loaded.get("observer") else []
    result["figures_agree"] = (all(row["agree"] is not False for row in result["figures"])
                               if result["figures"] else None)
    result["message_verdict"] = _message_verdict(figures)
    result["summary"] = _source_lines(result) + result["summary"] + _message_lines(result)
    return result


def _figures(r: dict, loaded: dict, figures) -> list:
    observer = loaded.get("observer")
    stats = observer["stats"] if observer else None
    allocated = "allocated_bytes.all.current"
    rows = [
        ("tried to allocate (the segment asked for)", "tried_to_allocate",
         observer and observer["alloc_bytes"], r["segment_bytes_needed"]),
        ("total capacity", "total_capacity", observer and loaded.get("device_total_bytes"),
         loaded.get("device_total_bytes")),
        ("free on the device", "free", observer and observer["device_free_bytes"], r["device_free_bytes"]),
        ("allowed (per-process cap)", "allowed",
         observer and (observer["device_limit_bytes"] if loaded.get("process_limit_bytes") is not None else None),
         r["process_limit_bytes"]),
        ("allocated by PyTorch", "allocated_by_pytorch", stats and stats[allocated], r["allocated_bytes"]),
        ("reserved by PyTorch but unallocated", "reserved_unallocated",
         stats and stats["reserved_bytes.all.current"] - stats[allocated], r["reserved_unallocated_bytes"]),
        ("reserved", None, stats and stats["reserved_bytes.all.current"], r["reserved_bytes"]),
        ("free in partly used segments (inactive_split_bytes)", None,
         stats and stats["inactive_split_bytes.all.current"], r["reserved_free_bytes"]),
    ]
    out = []
    for name, key, observed, explained in rows:
        printed = figures.get(key) if figures and key else None
        if key == "allowed" and printed is None and observed is None and explained is None:
            continue
        shown = [torch_format_size(v) for v in (observed, explained) if v is not None]
        checks = [printed == text for text in shown] if printed is not None else []
        if observed is not None and explained is not None:
            checks.append(observed == explained)
        out.append({"figure": name, "message": printed, "observer_bytes": observed,
                    "explainer_bytes": explained,
                    "printed": torch_format_size(explained if explained is not None else observed)
                    if (explained is not None or observed is not None) else None,
                    "agree": all(checks) if checks else None})
    return out


def _message_verdict(figures) -> "str | None":
    """Fragmentation or exhaustion from the message's rounded figures alone: the segment asked for
    against what could be taken (the device's free bytes, or the room under the per-process cap) plus
    the reserved but unallocated bytes (every pool: an estimate)."""
    if not figures:
        return None
    asked, free = printed_bytes(figures["tried_to_allocate"]), printed_bytes(figures["free"])
    unallocated = printed_bytes(figures["reserved_unallocated"])
    if figures["allowed"] is not None:  # under set_per_process_memory_fraction: the room under the cap
        reserved = printed_bytes(figures["allocated_by_pytorch"]) + unallocated
        free = min(free, max(0.0, printed_bytes(figures["allowed"]) - reserved))
    if asked <= free:
        return "fits_now"
    return "fragmentation" if asked <= free + unallocated else "exhaustion"


def _source_lines(r: dict) -> list:
    if r["snapshot_source"] == "observer":
        return ["Snapshot: taken by PyTorch's out-of-memory observer at the failing allocation, before the "
                "exception unwound: the failed pass's tensors are in it."]
    if r["snapshot_source"] == "after unwinding":
        why = f" ({r['observer_problem']})" if r["observer_problem"] else ""
        return [f"Snapshot: taken after the exception unwound{why}: the failed pass's intermediates were "
                "already freed, so allocated is lower and free blocks larger than at the failure; PyTorch's "
                "message below has the failure's figures."]
    return []


def _message_lines(r: dict) -> list:
    lines = []
    holes = sorted((row for row in r["segments"] if row["free_bytes"]), key=lambda row: -row["largest_free_block_bytes"])
    if holes:
        lines.append(f"Reserved but free: {r['reserved_free_bytes']} bytes ({r['reserved_free_bytes'] / 2**30:.2f} GiB) "
                     f"in {len(holes)} of {len(r['segments'])} "
                     f"segments; the largest holes {', '.join(str(row['largest_free_block_bytes']) for row in holes[:3])} "
                     f"bytes; the largest of the {r['pool']} pool {r['usable_largest_free_block_bytes']}.")
    es = r["expandable_segments"]
    lines.append(f"Rule used for expandable_segments:True: the request fits when a free block holds it, or when "
                 f"the pages it lacks beyond a segment's free tail ({es['device_bytes_to_map']} bytes) are at most "
                 f"the device's free bytes plus the whole pages of inner free blocks ({es['unmappable_free_page_bytes']}"
                 f" bytes); roughly, free bytes + reserved but free >= the rounded request.")
    if r["figures"]:
        agree = "agree" if r["figures_agree"] else "DISAGREE (see the table)"
        lines.append(f"PyTorch's message, the observer and the explainer {agree}"
                     + ("" if r["message_figures"] else " (the file holds no PyTorch message to read)") + ".")
    if r["message_verdict"] is not None and r["snapshot_source"] != "observer":
        lines.append(f"From PyTorch's message alone (its rounded figures, every pool): "
                     f"{r['message_verdict'].upper().replace('_', ' ')}.")
    if r["snapshot_source"] == "observer" and r["verdict"] == "fits_now":
        lines.append("The observer's snapshot has room for the request, yet the allocator refused it: it was asked "
                     "for on another stream, or from a private pool (CUDA graphs), or under a setting of "
                     "PYTORCH_CUDA_ALLOC_CONF (max_split_size_mb) this explainer does not model.")
    if r["request_note"]:
        lines.append(f"The request is {r['request_note']}.")
    return lines


def explanation_table(result: dict) -> str:
    """The explanation for people: the sentences, the figures side by side, then one line per segment."""
    lines = list(result["summary"])
    if result.get("figures"):
        lines += ["", f"{'figure':<52} {'PyTorch message':>16} {'observer':>16} {'explainer':>16} {'printed':>12} agree"]
        for row in result["figures"]:
            cells = [row["message"] or "-", *("-" if v is None else str(v)
                                               for v in (row["observer_bytes"], row["explainer_bytes"])),
                     row["printed"] or "-"]
            lines.append(f"{row['figure']:<52} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {cells[3]:>12} "
                         f"{ {True: 'yes', False: 'NO', None: '-'}[row['agree']]}")
    lines += ["", f"{'segment':>18} {'pool':>5} {'stream':>6} {'size':>14} "
                  f"{'free':>14} {'largest free':>14} {'blocks free':>11}"]
    for row in result["segments"]:
        lines.append(f"{hex(row['address']):>18} {row['segment_type']:>5} {str(row['stream']):>6} "
                     f"{row['total_size_bytes']:>14} {row['free_bytes']:>14} "
                     f"{row['largest_free_block_bytes']:>14} {row['free_blocks']:>11}")
    return "\n".join(lines)
