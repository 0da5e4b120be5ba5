"""Traces kept for the next question: in memory for one command, and on disk under the user's cache
folder (XDG_CACHE_HOME, else ~/.cache, then iteragpu-lab/traces), bounded in size.

An entry is named by a hash of its key (torch and transformers versions, the config, dtype, degree,
rank, sizes, the CUDA behaviour the tracer replays and the tracing code itself) and holds the key
again, checked on reading, with a SHA-256 of its body: a truncated, corrupt or foreign file is
ignored (and rewritten), never trusted. Writes go through a temporary file and a rename.
"""
import functools
import hashlib
import json
import os
import zlib
from array import array
from pathlib import Path

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import read_bounded_bytes, replace_bytes
from lab_helpers.core.packages import installed_version
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.real.replay import LoadTrace, RunTrace

TRACE_FORMAT = 1
MAGIC = b"iteragpu-lab trace 1\n"
MAX_TRACE_CACHE_BYTES = 512 * 2**20  # the folder is trimmed, oldest first, past this
MAX_ENTRY_BYTES = 128 * 2**20  # one entry on disk; a bigger file is not read
MAX_EVENTS = 2**26  # events of one entry, once decompressed (8 bytes each)
MAX_MEMORY_EVENTS = 2**22  # events kept in memory in all (about 36 bytes each in Python lists)
PHASE_NAMES = ("inputs", "prefill", "decode")
MAX_KEPT_EXPANSIONS = 4  # layer expansions kept in memory (two small models on meta each, a few MiB)


def cache_folder() -> Path:
    """The user's cache folder for traces."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "iteragpu-lab" / "traces"


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """A hash of the code whose changes change a trace (the tracer, the protocol, the recorder), read
    from the checkout (a notebook's kernel has no __file__; its cells are these files, generated).
    Where the files cannot be read, a digest of this process alone: its traces are never reused by
    another process."""
    digest = hashlib.sha256()
    try:
        for name in ("tracer.py", "behaviour.py", "protocol.py", "config.py", "raw_config.py", "spec.py", "replay.py",
                     "traces.py", "layers.py"):
            digest.update((REPOSITORY / "lab_helpers" / "real" / name).read_bytes())
    except OSError:
        digest.update(os.urandom(32))
    return digest.hexdigest()[:16]


def library_versions() -> tuple:
    """(torch's version, transformers'), without importing either (lab_helpers.core.packages)."""
    return installed_version("torch"), installed_version("transformers")


def base_key(shape, dtype: str, tensor_parallel: int, rank: int) -> dict:
    """What every trace of one model, dtype and rank depends on."""
    from dataclasses import asdict

    from lab_helpers.real.behaviour import DEFAULT_BEHAVIOUR
    torch_version, transformers_version = library_versions()
    config = json.dumps(shape.raw, sort_keys=True, separators=(",", ":"))
    return {"format": TRACE_FORMAT, "torch": torch_version, "transformers": transformers_version,
            "code": code_digest(), "behaviour": asdict(DEFAULT_BEHAVIOUR),
            "config_sha256": hashlib.sha256(config.encode()).hexdigest(), "dtype": dtype,
            "tensor_parallel": tensor_parallel, "rank": rank, "quantization": shape.quantization}


def shape_key(raw: dict) -> dict:
    """What a config's shape (lab_helpers.real.config.parse_config) depends on: the config, torch,
    transformers and the lab's code."""
    torch_version, transformers_version = library_versions()
    config = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    return {"format": TRACE_FORMAT, "kind": "shape", "torch": torch_version,
            "transformers": transformers_version, "code": code_digest(),
            "config_sha256": hashlib.sha256(config.encode()).hexdigest()}


def _pack(trace) -> tuple:
    if isinstance(trace, dict):  # a config's shape (shape_key): a JSON document, no events
        return {"kind": "shape", "document": trace}, array("q")
    if isinstance(trace, LoadTrace):
        layout = {"kind": "load", "requests": trace.requests, "events": len(trace.events),
                  "weights": len(trace.weights)}
        values = trace.events + trace.weights
    else:
        layout = {"kind": "run", "decode_steps": trace.decode_steps, "persistent": len(trace.persistent),
                  "phases": [[name, index, len(pre), len(own)] for name, index, pre, own in trace.phases]}
        values = [v for _, _, pre, own in trace.phases for v in (*pre, *own)] + trace.persistent
    return layout, array("q", values)


def _unpack(layout: dict, values: list):
    """The trace of a layout and its values; ValueError, KeyError or TypeError when they disagree."""
    if layout["kind"] == "shape":
        if values or not isinstance(layout["document"], dict):
            raise ValueError("shape")
        return layout["document"]
    if layout["kind"] == "load":
        n, w = layout["events"], layout["weights"]
        if not all(isinstance(x, int) and x >= 0 for x in (n, w, layout["requests"])) or n + w != len(values):
            raise ValueError("lengths")
        return LoadTrace(values[:n], values[n:], layout["requests"])
    if layout["kind"] != "run":
        raise ValueError("kind")
    phases, at = [], 0
    for name, index, pre, own in layout["phases"]:
        if name not in PHASE_NAMES or not (index is None or isinstance(index, int)):
            raise ValueError("phase")
        if not (isinstance(pre, int) and isinstance(own, int) and pre >= 0 and own >= 0):
            raise ValueError("lengths")
        phases.append((name, index, values[at:at + pre], values[at + pre:at + pre + own]))
        at += pre + own
    persistent = layout["persistent"]
    if not isinstance(persistent, int) or at + persistent != len(values) or not isinstance(layout["decode_steps"], int):
        raise ValueError("lengths")
    return RunTrace(phases, values[at:], layout["decode_steps"])


def encode_entry(key: dict, trace) -> bytes:
    """The bytes of a cache file holding `trace` under `key`."""
    layout, values = _pack(trace)
    header = json.dumps({"key": key, "layout": layout}, sort_keys=True).encode()
    # level 1: a cold fit writes a trace per probe, and level 6 took three times the CPU for files
    # about a seventh smaller (events are 8-byte integers, mostly repeated sizes); reading is as fast
    body = zlib.compress(len(header).to_bytes(8, "little") + header + values.tobytes(), 1)
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def decode_entry(data: bytes, key: dict):
    """The trace a cache file holds for `key`, or None when the file is not a whole, intact entry
    for that key."""
    head = len(MAGIC) + 65
    if not data.startswith(MAGIC) or len(data) < head or data[head - 1:head] != b"\n":
        return None
    body = data[head:]
    if hashlib.sha256(body).hexdigest().encode() != data[len(MAGIC):head - 1]:
        return None
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(body, 8 * MAX_EVENTS + 2**20)
        if inflater.unconsumed_tail or not inflater.eof:
            return None
        size = int.from_bytes(raw[:8], "little")
        document = json.loads(raw[8:8 + size])
        if document["key"] != key or (len(raw) - 8 - size) % 8:
            return None
        values = array("q")
        values.frombytes(raw[8 + size:])
        return _unpack(document["layout"], values.tolist())
    except (zlib.error, ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None


def _event_count(trace) -> int:
    if isinstance(trace, dict):
        return 1
    if isinstance(trace, LoadTrace):
        return len(trace.events) + len(trace.weights)
    return sum(len(pre) + len(own) for _, _, pre, own in trace.phases)


_DEFAULT_CACHES = {}


def default_cache() -> "TraceCache":
    """The process's cache over the user's cache folder (one per folder, shared by every call)."""
    folder = cache_folder()
    if folder not in _DEFAULT_CACHES:
        _DEFAULT_CACHES[folder] = TraceCache(folder)
    return _DEFAULT_CACHES[folder]


class TraceCache:
    """Traces by key: in memory always, on disk in `folder` unless it is None."""

    def __init__(self, folder="default", max_bytes: int = MAX_TRACE_CACHE_BYTES):
        self.folder = cache_folder() if folder == "default" else (None if folder is None else Path(folder))
        self.max_bytes = max_bytes
        self.memory = {}  # name -> trace, least recently used first
        # the layer expansions of tensor-parallel-1 sessions (lab_helpers.real.traces), in memory only:
        # the next question on the same model traces its runs on the same two smaller models, built
        # and their loads traced once in this process (a rank's models at N > 1 hold the fake process
        # group of one question, so they are not kept)
        self.expansions = {}

    @staticmethod
    def shape_key(raw: dict) -> dict:
        """The key of a config's shape (the module's shape_key), for lab_helpers.real.config."""
        return shape_key(raw)

    def _remember(self, name: str, trace) -> None:
        self.memory.pop(name, None)
        self.memory[name] = trace
        total = sum(map(_event_count, self.memory.values()))
        while total > MAX_MEMORY_EVENTS and len(self.memory) > 1:
            total -= _event_count(self.memory.pop(next(iter(self.memory))))

    def expansion(self, key: dict, prepare):
        """The layer expansion kept for `key` (a base_key), else `prepare()`'s, kept: the last
        MAX_KEPT_EXPANSIONS models asked."""
        name = self._name(key)
        found = self.expansions.pop(name) if name in self.expansions else prepare()
        self.expansions[name] = found
        while len(self.expansions) > MAX_KEPT_EXPANSIONS:
            self.expansions.pop(next(iter(self.expansions)))
        return found

    @staticmethod
    def _name(key: dict) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40] + ".trace"

    def get(self, key: dict):
        name = self._name(key)
        if name in self.memory:
            trace = self.memory[name]
            self._remember(name, trace)
            return trace
        if self.folder is None:
            return None
        path = self.folder / name
        try:
            data = read_bounded_bytes(path, MAX_ENTRY_BYTES, "trace cache entry")
        except LabError:
            return None
        trace = decode_entry(data, key)
        if trace is not None:
            self._remember(name, trace)
            try:
                os.utime(path)  # the most recently used entries are kept when the folder is trimmed
            except OSError:
                pass
        return trace

    def put(self, key: dict, trace) -> None:
        name = self._name(key)
        self._remember(name, trace)
        if self.folder is None:
            return
        data = encode_entry(key, trace)
        if len(data) > MAX_ENTRY_BYTES:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            replace_bytes(self.folder / name, data)
        except (LabError, OSError):
            return  # a cache that cannot be written only makes the next question slower
        self.trim()

    def trim(self) -> None:
        """Remove the least recently used entries until the folder holds at most max_bytes."""
        try:
            entries = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.folder.glob("*.trace")]
        except OSError:
            return
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: (e[0], e[2].name)):
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
                total -= size
            except OSError:
                pass
