"""GPU memory lab: estimate weight bytes, describe the environment, measure and
predict PyTorch caching-allocator counters per phase of a tiny synthetic network.

Self-contained: the standard library at import time, torch only inside the
functions that need a GPU. Run it as a script (``python mesure_memoire.py
estimate|environment|measure|predict|compare ...``) or as
``python -m lab_helpers.mesure_memoire ...``.
"""
import argparse
import csv
import functools
import io
import json
import math
import numbers
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

SCHEMA_VERSION = 1
GIB = 2**30  # binary gibibyte
GB = 10**9  # decimal gigabyte, as disk and marketing figures use
BITS_PER_BYTE = 8
MAX_BITS = 64  # no common parameter format is wider
MIN_BLOCK_BYTES = 512  # the allocator rounds every request up to a multiple of this
SMALL_REQUEST_MAX_BYTES = 2**20  # requests up to 1 MiB come from the small pool
SMALL_SEGMENT_BYTES = 2 * 2**20  # small-pool segments are 2 MiB
LARGE_SEGMENT_BYTES = 20 * 2**20  # large requests under 10 MiB share 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * 2**20  # from here a segment is the request itself...
ROUND_LARGE_BYTES = 2 * 2**20  # ...rounded up to 2 MiB
# Persistent math-library workspaces allocated at the first matrix product, in
# allocation order. Measured with torch 2.11.0+cu130 on an NVIDIA H200: a 32 MiB
# cuBLAS workspace (PyTorch's default on compute capability 9.0, 4096 * 8 KiB)
# then a 1 MiB block (cuBLASLt's default workspace is 1024 KiB).
DEFAULT_WORKSPACE_BYTES = (32 * 2**20, 2**20)
DEFAULT_WORKSPACE_SOURCE = "measured default: torch 2.11.0+cu130 on NVIDIA H200 (compute capability 9.0)"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PHASES = ("model_load", "inputs", "cold_forward", "warmup", "warm_forward")
COUNTERS = ("allocated", "reserved")
EXIT_OK, EXIT_USAGE, EXIT_PHASE = 0, 2, 3  # EXIT_FAILURE (1) is defined with the public API below
ESTIMATE_EXCLUDES = (
    "activations", "KV cache", "quantization metadata (scales, zero points)",
    "gradients", "optimizer states", "CUDA context and libraries (cuBLAS, cuDNN, kernels)",
)
RUNTIME_NOTE = ("cuda_build_version / hip_build_version is the runtime built into torch, not the "
                "installed driver; record the driver separately with the vendor tool "
                "(nvidia-smi or rocm-smi).")
UNAVAILABLE = "unavailable"


class LabError(Exception):
    """A bad input or precondition: one line, exit code 2."""


class PhaseError(Exception):
    """A CUDA failure (out of memory included) during a measured phase: exit code 3."""

    def __init__(self, phase, exc):
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        super().__init__(f"phase {phase} failed: {type(exc).__name__}: {first_line[:300]}")
        self.phase = phase
        memory = type(exc).__name__ == "OutOfMemoryError" or "out of memory" in first_line.lower()
        self.reason = "out_of_memory" if memory else "cuda_error"
        self.message = f"{type(exc).__name__}: {first_line[:300]}"
        self.oom_snapshot = None  # set by measure's HistoryRecorder on out-of-memory
        self.oom_snapshot_problem = None

    def report(self) -> dict:
        """The structured failure that `measure --failure-report` writes."""
        return {"kind": "iteragpu-lab measure failure", "phase": self.phase, "reason": self.reason,
                "message": self.message}


# -------------------------------------------------------------- public API
# Shared by every command of the lab (runs, sweep, grid, kit import these names).
EXIT_FAILURE = 1  # the command ran but its check failed (e.g. compare --fail-on-difference)
MAX_DIGITS = 1000  # checked before int(): Python refuses over 4300 digits, and slowly
MAX_MEASUREMENT_FILE_BYTES = 64 * 2**20  # a real measurement file is a few KiB
MAX_JSON_DEPTH = 32  # a measurement nests 4 levels deep; more is not a measurement
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() and \d accept other scripts' digits
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`'s writer


def quiet_broken_pipe(main_function):
    """Wrap a command's `main(argv=None) -> int` so that a reader closing its stdout early
    (`iteragpu-memory predict ... | head -1`) ends it quietly with EXIT_BROKEN_PIPE instead of
    a BrokenPipeError traceback. stdout is flushed inside the wrapper (after `--help` too), then
    pointed at devnull, so Python's own flush at exit finds nothing left to write."""
    @functools.wraps(main_function)
    def main(argv=None) -> int:
        try:
            try:
                return main_function(argv)
            finally:  # argparse's --help leaves its text in the buffer and raises SystemExit
                sys.stdout.flush()
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
                pass
            return EXIT_BROKEN_PIPE
    return main


class CommandParser(argparse.ArgumentParser):
    """argparse that reports every usage error as one line `prog: error: msg` and exit code 2."""

    def error(self, message):
        # a subcommand's parser is named "prog sub": its errors start "prog: error:", as the
        # command's other errors do
        self.exit(EXIT_USAGE, f"{self.prog.split()[0]}: error: {message}\n")


def _whole_problem(text, minimum, maximum):
    """Return (value, None) for a valid whole number, else (None, what is wrong)."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        return None, f"must be a whole number, got {type(text).__name__}"
    if isinstance(text, str):
        if len(text) > MAX_DIGITS:
            return None, f"has {len(text)} characters; at most {MAX_DIGITS} digits are accepted"
        if not _DIGITS.fullmatch(text):
            return None, f"not an integer: {text[:40]!r} (a whole number, digits 0-9 only)"
        value = int(text)
    else:
        value = text
    if minimum is not None and value < minimum:
        return None, f"must be > 0, got {value}" if minimum == 1 else f"must be >= {minimum}, got {value}"
    if maximum is not None and value > maximum:
        shown = str(value) if value < 10**40 else f"a {len(str(value))}-digit number"
        return None, f"must be at most {maximum}, got {shown}"
    return value, None


def parse_whole(text, name: str, minimum=None, maximum=None) -> int:
    """Return the whole number written in `text` (ASCII digits 0-9 only, no sign, no '_', no spaces),
    within [minimum, maximum]; raise LabError naming `name` otherwise. The digit count is checked
    before conversion, so a huge string is refused at once."""
    return _checked(_whole_problem, text, name, minimum, maximum)


def whole_number(minimum=None, maximum=None):
    """Return an argparse `type=` callable that accepts what parse_whole accepts."""
    return _argument_type(_whole_problem, minimum, maximum, "whole number")


def _checked(problem_of, text, name, minimum, maximum):
    value, problem = problem_of(text, minimum, maximum)
    if problem:
        raise LabError(f"{name} {problem}")
    return value


def _argument_type(problem_of, minimum, maximum, type_name):
    def convert(text):
        value, problem = problem_of(text, minimum, maximum)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    convert.__name__ = type_name  # argparse names a type that fails by its __name__
    return convert


def _decimal_problem(text, minimum, maximum):
    if not isinstance(text, str):
        return None, f"must be a number, got {type(text).__name__}"
    if len(text) > MAX_DIGITS:
        return None, f"has {len(text)} characters; at most {MAX_DIGITS} are accepted"
    if not _DECIMAL.fullmatch(text):
        return None, f"must be a decimal number written with the digits 0-9 and '.', got {text[:40]!r}"
    value = float(text)
    if not math.isfinite(value):
        return None, f"must be finite, got {text[:40]!r}"
    if minimum is not None and value < minimum:
        return None, f"must be at least {minimum}, got {value}"
    if maximum is not None and value > maximum:
        return None, f"must be at most {maximum}, got {value}"
    return value, None


def parse_decimal(text, name: str, minimum=None, maximum=None) -> float:
    """Return the finite, non-negative number written in `text` (ASCII digits and one '.', no sign,
    no exponent, no nan/inf), within [minimum, maximum]; raise LabError naming `name` otherwise."""
    return _checked(_decimal_problem, text, name, minimum, maximum)


def decimal_number(minimum=None, maximum=None):
    """Return an argparse `type=` callable that accepts what parse_decimal accepts."""
    return _argument_type(_decimal_problem, minimum, maximum, "number")


def display_path(path) -> str:
    """The path as the user gave it if relative; relative to the cwd when it lies under it."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    try:
        relative = os.path.relpath(text)
    except ValueError:  # another drive on Windows
        return text
    return text if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


_OS_REASONS = {"ENOENT": "its folder does not exist", "ENOTDIR": "a parent is not a folder",
               "EACCES": "permission denied", "EPERM": "permission denied", "EROFS": "read-only file system",
               "ENAMETOOLONG": "file name too long", "ENOSPC": "no space left on the device",
               "EDQUOT": "disk quota exceeded", "EISDIR": "it is a folder", "ELOOP": "too many symbolic links"}


def _os_problem(exc: OSError) -> str:
    import errno
    name = errno.errorcode.get(exc.errno, "")  # not every platform defines every code
    return _OS_REASONS.get(name, os.strerror(exc.errno) if exc.errno else type(exc).__name__)


def _output_error(shown: str, exc: OSError) -> LabError:
    import errno
    if exc.errno == errno.EEXIST:
        return LabError(f"{shown} already exists; choose a new file name")
    return LabError(f"cannot write {shown}: {_os_problem(exc)}")


def _file_mode() -> int:
    """0o666 minus the umask: the mode the user's tools give a new file."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:  # reads the umask without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def _link_unnamed(folder: str, name: str, data: bytes):
    """Write `data` into an unnamed file of `folder`, then give it `name` exclusively; a process
    killed before the link leaves nothing behind. Return False where unnamed files are refused."""
    import errno
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        fd = os.open(folder, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o666)  # umask applies
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return False  # an old kernel or a file system without O_TMPFILE
        raise
    try:
        _write_all(fd, data)
        folder_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            # a dir fd makes os.link call linkat(AT_SYMLINK_FOLLOW): it links the file the /proc
            # entry points to, and fails with EEXIST if the name is taken
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=folder_fd, follow_symlinks=True)
        finally:
            os.close(folder_fd)
    finally:
        os.close(fd)
    return True


def _link_named(folder: str, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name[:100]}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, _file_mode())
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.link(tmp, os.path.join(folder, name))  # atomic and exclusive
    finally:
        os.unlink(tmp)


def _write_new_bytes(path, data: bytes) -> None:
    shown = display_path(path)
    text = os.fspath(path)
    folder, name = os.path.split(text)
    folder = folder or os.curdir
    try:
        if not name or name in (os.curdir, os.pardir):
            raise IsADirectoryError(21, "is a folder")
        if os.path.lexists(text):
            raise FileExistsError(17, "exists")
        if not _link_unnamed(folder, name, data):
            _link_named(folder, name, data)
    except OSError as exc:
        raise _output_error(shown, exc) from None


def write_new_bytes(path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all; refuse if `path` exists (see write_new_text)."""
    _write_new_bytes(path, bytes(data))


def write_new_text(path, text: str) -> None:
    """Write `text` (UTF-8) to `path` whole or not at all; refuse if `path` exists. The file gets the
    user's usual mode; any OS error is a LabError naming `path` as given."""
    _write_new_bytes(path, text.encode("utf-8"))


def _json_text(document, shown: str) -> str:
    try:
        return json.dumps(document, indent=2, allow_nan=False) + "\n"
    except ValueError:  # NaN or an infinity: not JSON, and not a measurement
        raise LabError(f"{shown}: refusing to write a number that is not finite (NaN or infinity)") from None


def write_new_json(path, document) -> None:
    """Write `document` as JSON to `path` whole or not at all; refuse if `path` exists or if the
    document holds NaN or an infinity."""
    write_new_text(path, _json_text(document, display_path(path)))


def replace_bytes(path, data: bytes) -> None:
    """Replace `path` whole with `data` (temporary file in the same folder, then os.replace): for
    files rewritten on purpose, never left half-written. The file gets the user's usual mode."""
    shown = display_path(path)
    folder, name = os.path.split(os.fspath(path))
    folder = folder or os.curdir
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name[:100]}.", suffix=".tmp")
    except OSError as exc:
        raise _output_error(shown, exc) from None
    try:
        try:
            os.fchmod(fd, _file_mode())
            _write_all(fd, bytes(data))
        finally:
            os.close(fd)
        os.replace(tmp, os.fspath(path))
    except OSError as exc:
        os.unlink(tmp)
        raise _output_error(shown, exc) from None


def replace_text(path, text: str) -> None:
    """Replace `path` whole with `text` (UTF-8); see replace_bytes."""
    replace_bytes(path, text.encode("utf-8"))


_CSV_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Number):
        if isinstance(value, float) and not math.isfinite(value):
            return ""  # a missing measurement in pandas, never a number
        return value
    text = str(value)
    # a spreadsheet runs a cell starting with these as a formula (OWASP CSV injection)
    return "'" + text if text.startswith(_CSV_TRIGGERS) else text


def csv_text(header, rows) -> str:
    """CSV text ('\\n' line ends) of `header` and `rows`: numbers stay numbers, None is empty, and a
    text cell starting with = + - @ tab or carriage return gets a leading ' so no spreadsheet runs it."""
    lines = []
    for row in [header, *rows]:
        buffer = io.StringIO()
        # "\r\n" as the writer's terminator makes it quote a cell holding "\r" as well as "\n"
        csv.writer(buffer, lineterminator="\r\n").writerow([_csv_cell(cell) for cell in row])
        lines.append(buffer.getvalue()[:-2] + "\n")
    return "".join(lines)


# ------------------------------------------------------- measurement files
MAX_BATCH = 2**20
MAX_CONTEXT = 2**20
MAX_WIDTH = 2**20
MAX_HIDDEN = 2**22
MAX_PASSES = 10_000  # --warmup and --repeats: each pass is a record or a loop turn
MAX_SEED = 2**63 - 1
MAX_NEW_TOKENS = 2**20
MAX_COUNTER_BYTES = 2**60  # far above any device; keeps byte arithmetic within int64
MAX_PHASE_RECORDS = 2**20 + 16
_COUNT = {"type": "integer", "minimum": 1}
_MAX_RANKS = 64  # MAX_TENSOR_PARALLEL: ranks of one tensor-parallel run
_BYTES = {"$ref": "#/$defs/bytes"}
# The JSON Schema of a measurement file, written out as measurement.schema.json; read_measurement
# applies it with the standard library alone (this file ships without jsonschema).
MEASUREMENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "iteragpu-lab/measurement.schema.json",
    "title": "IteraGPU Lab measurement (synthetic network or transformers model)",
    "type": "object",
    "required": ["schema_version", "kind", "environment", "configuration"],
    "additionalProperties": False,
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "kind": {"const": "iteragpu-lab measurement"},
        "environment": {"$ref": "#/$defs/environment"},
        "configuration": {"type": "object"},
        "synthetic_model": {"type": "object"},
        "model": {"type": "object"},
        "phases": {"type": "array", "minItems": 1, "maxItems": MAX_PHASE_RECORDS,
                   "items": {"$ref": "#/$defs/phase"}},
        # a tensor-parallel file: every rank's phases instead of top-level phases
        "ranks": {"type": "array", "minItems": 1, "maxItems": _MAX_RANKS, "items": {"$ref": "#/$defs/rank"}},
    },
    "allOf": [
        {"if": {"required": ["configuration"],
                "properties": {"configuration": {"type": "object", "required": ["tensor_parallel"],
                                                 "properties": {"tensor_parallel": {"minimum": 2}}}}},
         "then": {"required": ["ranks"]}, "else": {"properties": {"ranks": False}}},
        {"if": {"required": ["ranks"]}, "then": {"properties": {"phases": False}}, "else": {"required": ["phases"]}},
    ],
    "if": {"required": ["configuration"],
           "properties": {"configuration": {"type": "object", "required": ["kind"],
                                            "properties": {"kind": {"const": "transformers"}}}}},
    "then": {"required": ["model"], "properties": {
        "configuration": {"$ref": "#/$defs/transformers_configuration"},
        "synthetic_model": False,
        "phases": {"items": {"properties": {"phase": {"enum": ["model_load", "inputs", "prefill", "decode"]}}}},
        "ranks": {"items": {"properties": {"phases": {"items": {"properties": {
            "phase": {"enum": ["model_load", "inputs", "prefill", "decode"]}}}}}}},
    }},
    "else": {"required": ["synthetic_model"], "properties": {
        "configuration": {"$ref": "#/$defs/synthetic_configuration"},
        "synthetic_model": {"$ref": "#/$defs/synthetic_model"},
        "model": False,
        "phases": {"minItems": 5, "maxItems": 4 + MAX_PASSES,
                   "items": {"properties": {"phase": {"enum": list(PHASES)}}}},
        "ranks": {"items": {"properties": {"phases": {"minItems": 5, "maxItems": 4 + MAX_PASSES,
                                                      "items": {"properties": {"phase": {"enum": list(PHASES)}}}}}}},
    }},
    "$defs": {
        "bytes": {"type": "integer", "minimum": 0, "maximum": MAX_COUNTER_BYTES},
        "device": {"type": "string", "pattern": "^cuda:[0-9]{1,6}$"},
        "dtype": {"enum": list(DTYPE_BYTES)},
        "environment": {
            "type": "object",
            "required": ["python_version", "torch_version", "cuda_build_version", "hip_build_version",
                         "runtime_note", "device", "device_count", "device_visible", "device_name",
                         "compute_capability", "total_memory_bytes", "free_memory_bytes"],
            "properties": {
                "python_version": {"type": "string"},
                "torch_version": {"type": "string"},
                "cuda_build_version": {"type": ["string", "null"]},
                "hip_build_version": {"type": ["string", "null"]},
                "runtime_note": {"type": "string"},
                "device": {"$ref": "#/$defs/device"},
                "device_count": _COUNT,
                "device_visible": {"const": True},
                "device_name": {"type": "string"},
                "compute_capability": {"type": "string", "pattern": "^[0-9]{1,4}\\.[0-9]{1,4}$"},
                "total_memory_bytes": {"type": "integer", "minimum": 1, "maximum": MAX_COUNTER_BYTES},
                "free_memory_bytes": _BYTES,
                "usable_memory_bytes": {"type": ["integer", "string", "null"]},
            },
        },
        "synthetic_configuration": {
            "type": "object",
            "required": ["device", "batch", "context", "width", "hidden", "dtype", "warmup", "repeats", "seed"],
            "additionalProperties": False,
            "properties": {
                "kind": {"const": "synthetic"},
                "device": {"$ref": "#/$defs/device"},
                "batch": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH},
                "context": {"type": "integer", "minimum": 1, "maximum": MAX_CONTEXT},
                "width": {"type": "integer", "minimum": 1, "maximum": MAX_WIDTH},
                "hidden": {"type": "integer", "minimum": 1, "maximum": MAX_HIDDEN},
                "dtype": {"$ref": "#/$defs/dtype"},
                "warmup": {"type": "integer", "minimum": 0, "maximum": MAX_PASSES},
                "repeats": {"type": "integer", "minimum": 1, "maximum": MAX_PASSES},
                "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
                "tensor_parallel": {"type": "integer", "minimum": 1, "maximum": _MAX_RANKS},
            },
        },
        "rank": {
            "type": "object",
            "required": ["rank", "device", "phases"],
            "properties": {
                "rank": {"type": "integer", "minimum": 0, "maximum": _MAX_RANKS - 1},
                "device": {"$ref": "#/$defs/device"},
                "device_name": {"type": "string"},
                # what NCCL holds outside PyTorch's allocator on this rank's device
                "outside_allocator": {"type": ["object", "null"], "properties": {
                    "before_bytes": _BYTES, "after_bytes": _BYTES,
                    "nccl_outside_allocator_bytes": {"type": "integer", "minimum": -MAX_COUNTER_BYTES,
                                                     "maximum": MAX_COUNTER_BYTES}}},
                "phases": {"type": "array", "minItems": 1, "maxItems": MAX_PHASE_RECORDS,
                           "items": {"$ref": "#/$defs/phase"}},
            },
        },
        "transformers_configuration": {
            "type": "object",
            "required": ["kind", "config_name", "dtype", "batch", "context", "new_tokens", "device", "seed",
                         "decode_record_every"],
            "properties": {
                "kind": {"const": "transformers"},
                "config_name": {"type": "string", "minLength": 1},
                "dtype": {"$ref": "#/$defs/dtype"},
                "batch": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH},
                "context": {"type": "integer", "minimum": 1, "maximum": MAX_CONTEXT},
                "new_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_NEW_TOKENS},
                "device": {"$ref": "#/$defs/device"},
                "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
                "decode_record_every": {"type": "integer", "minimum": 1, "maximum": MAX_NEW_TOKENS},
            },
        },
        "synthetic_model": {
            "type": "object",
            "required": ["layers", "width", "hidden", "parameter_shapes", "parameter_count", "parameter_bytes",
                         "forward_flops"],
            "properties": {
                "layers": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3},
                "width": {"type": "integer", "minimum": 1, "maximum": MAX_WIDTH},
                "hidden": {"type": "integer", "minimum": 1, "maximum": MAX_HIDDEN},
                "parameter_shapes": {"type": "object"},
                "parameter_count": {"type": "integer", "minimum": 1},
                "parameter_bytes": {"type": "integer", "minimum": 1},
                "forward_flops": {"type": "integer", "minimum": 1},
            },
        },
        "phase": {
            "type": "object",
            "required": ["phase", "index", "passes", "seconds", "device_seconds",
                         "baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes",
                         "end_reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes"],
            "additionalProperties": False,
            "properties": {
                "phase": {"type": "string"},
                "index": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_PHASE_RECORDS},
                "passes": {"type": "integer", "minimum": 0, "maximum": MAX_NEW_TOKENS},
                "seconds": {"type": "number", "minimum": 0},
                "device_seconds": {"type": "number", "minimum": 0},
                "baseline_allocated_bytes": _BYTES,
                "baseline_reserved_bytes": _BYTES,
                "end_allocated_bytes": _BYTES,
                "end_reserved_bytes": _BYTES,
                "peak_allocated_bytes": _BYTES,
                "peak_reserved_bytes": _BYTES,
                "achieved_tflops": {"type": "number", "exclusiveMinimum": 0},
                "host_to_device_time_ratio": {"type": "number", "exclusiveMinimum": 0},
                # kind -> bytes (weights, inputs, workspace, activations, kv_cache...): a prediction's split
                "end_allocated_bytes_by_kind": {"type": "object"},
            },
        },
    },
}
_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    # JSON Schema counts 3.0 as an integer: a number with no fractional part
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
}


def _same_json(a, b) -> bool:
    """Equality as JSON Schema's const/enum mean it: true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _schema_errors(value, schema, where: str, root: dict):
    """Yield (json path, problem) for every rule of `schema` that `value` breaks (the keywords
    measurement.schema.json uses; its nesting is bounded by MAX_JSON_DEPTH)."""
    if schema is True:
        return
    if schema is False:
        yield where, "is not allowed here"
        return
    if "if" in schema:  # first: a kind's own bounds (phases of a synthetic file) fail before a long walk
        branch = "then" if next(_schema_errors(value, schema["if"], where, root), None) is None else "else"
        if branch in schema:
            yield from _schema_errors(value, schema[branch], where, root)
    for part in schema.get("allOf", ()):
        yield from _schema_errors(value, part, where, root)
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        yield from _schema_errors(value, target, where, root)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_JSON_TYPES[t](value) for t in types):
            yield where, f"must be {' or '.join(types)}, got {_json_type_name(value)}"
            return
    if "const" in schema and not _same_json(value, schema["const"]):
        yield where, f"must be {json.dumps(schema['const'])}, got {_short_json(value)}"
    if "enum" in schema and not any(_same_json(value, option) for option in schema["enum"]):
        yield where, f"must be one of {', '.join(json.dumps(o) for o in schema['enum'])}, got {_short_json(value)}"
    if _JSON_TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            yield where, f"must be at least {schema['minimum']}, got {_short_json(value)}"
        if "maximum" in schema and value > schema["maximum"]:
            yield where, f"must be at most {schema['maximum']}, got {_short_json(value)}"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            yield where, f"must be more than {schema['exclusiveMinimum']}, got {_short_json(value)}"
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            yield where, f"must have at least {schema['minLength']} character(s)"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield where, f"does not match {schema['pattern']}: {_short_json(value)}"
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            yield where, f"must hold at least {schema['minItems']} item(s), got {len(value)}"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield where, f"must hold at most {schema['maxItems']} items, got {len(value)}"
        if "items" in schema:
            for i, item in enumerate(value):
                yield from _schema_errors(item, schema["items"], f"{where}[{i}]", root)
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                yield where, f"lacks the required key {key!r}"
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                yield from _schema_errors(item, properties[key], _json_path(where, key), root)
            elif schema.get("additionalProperties", True) is False:
                yield where, f"has an unknown key {key[:60]!r}"


def _json_path(where: str, key: str) -> str:
    return f"{where}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{where}[{json.dumps(key[:60])}]"


def _json_type_name(value) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def _short_json(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else _json_type_name(value)
    return text if len(text) <= 40 else text[:40] + "..."


def measurement_problems(document) -> list:
    """Every (json path, problem) of `document` against MEASUREMENT_SCHEMA; empty when valid."""
    return list(_schema_errors(document, MEASUREMENT_SCHEMA, "$", MEASUREMENT_SCHEMA))


def _too_deep(text: str, limit: int) -> bool:
    """True if the JSON text nests arrays/objects deeper than `limit` (checked without recursion)."""
    brackets = re.sub(r'"[^"\\]*(?:\\.[^"\\]*)*"', "", text)  # strings may hold any bracket
    brackets = re.sub(r"[^\[\]{}]", "", brackets)
    for _ in range(limit):
        if not brackets:
            return False
        reduced = re.sub(r"\[\]|\{\}", "", brackets)  # one level of innermost pairs per round
        if reduced == brackets:
            return False  # unbalanced: the JSON parser reports it
        brackets = reduced
    return bool(brackets)


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def read_json_file(path, max_bytes: int = MAX_MEASUREMENT_FILE_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """Parse the JSON file at `path` with bounds: a regular file (a FIFO or device is refused without
    blocking), at most `max_bytes`, UTF-8, nesting at most `max_depth`, no NaN or infinities.
    Raise LabError naming `path` as given."""
    import stat
    shown = display_path(path)
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        reason = "no such file" if exc.errno == 2 else _os_problem(exc)
        raise LabError(f"cannot read {shown}: {reason}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise LabError(f"cannot read {shown}: it is a folder")
        if not stat.S_ISREG(info.st_mode):
            raise LabError(f"cannot read {shown}: not a regular file")
        if info.st_size > max_bytes:
            raise LabError(f"{shown}: {info.st_size} bytes; a measurement file holds at most {max_bytes} bytes")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise LabError(f"cannot read {shown}: {_os_problem(exc)}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise LabError(f"{shown}: more than {max_bytes} bytes; a measurement file holds at most that")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LabError(f"{shown}: not UTF-8 text (byte {exc.start})") from None
    if _too_deep(text, max_depth):
        raise LabError(f"{shown}: JSON nested deeper than {max_depth} levels")
    try:
        document = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise LabError(f"{shown}: JSON nested too deeply") from None
    except ValueError as exc:
        first = (str(exc).splitlines() or ["invalid"])[0][:120]
        raise LabError(f"{shown}: not valid JSON: {first}") from None
    if "\\u" in text:  # an escape may spell half a surrogate pair, which no text can print
        try:
            json.dumps(document, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise LabError(f"{shown}: a string holds a lone surrogate escape (not Unicode text)") from None
    return document


def read_measurement(path) -> dict:
    """Read and validate a measurement file (synthetic or transformers) against every rule of
    measurement.schema.json; raise LabError '<path>: <json path>: <problem>' on the first fault."""
    document = read_json_file(path)
    problem = next(_schema_errors(document, MEASUREMENT_SCHEMA, "$", MEASUREMENT_SCHEMA), None)
    if problem:
        raise LabError(f"{display_path(path)}: {problem[0]}: {problem[1]}")
    return document


# ---------------------------------------------------------------- estimate
MAX_PARAMETERS = 10**18  # a billion billion: weight bytes stay exact and GiB figures finite
MAX_RESERVE_GIB = 2**20  # one PiB, far above any device


def estimate(parameters: int, bits: int, reserve_gib: float = 0.0) -> dict:
    """Return the weight bytes of `parameters` at `bits` per parameter, plus a stated reserve."""
    parse_whole(parameters, "--parameters", 1, MAX_PARAMETERS)
    parse_whole(bits, "--bits", 1, MAX_BITS)
    if isinstance(reserve_gib, bool) or not isinstance(reserve_gib, (int, float)) \
            or not math.isfinite(reserve_gib) or not 0 <= reserve_gib <= MAX_RESERVE_GIB:
        raise LabError(f"--reserve-gib must be a finite number from 0 to {MAX_RESERVE_GIB}, got {reserve_gib!r}")
    bytes_per_parameter = -(-bits // BITS_PER_BYTE)  # whole bytes, rounded up
    weight_bytes = parameters * bytes_per_parameter
    weight_gib = weight_bytes / GIB
    return {
        "parameters": parameters,
        "bits": bits,
        "bytes_per_parameter": bytes_per_parameter,
        "weight_bytes": weight_bytes,
        "weight_gib": weight_gib,
        "weight_gb": weight_bytes / GB,
        "reserve_gib": reserve_gib,
        "total_gib": weight_gib + reserve_gib,
        "excludes": list(ESTIMATE_EXCLUDES),
    }


# ------------------------------------------------------------- environment
USABLE_MEMORY_TIMEOUT_SECONDS = 180
USABLE_MEMORY_STEP_BYTES = 2 * 2**20  # the allocator's large segments are whole multiples of 2 MiB
USABLE_MEMORY_MAX_TRIES = 2048  # at most 4 GiB below the free figure
# Runs in a fresh process: the caller then holds no CUDA context that would take device memory.
# It creates what a measuring process has (CUDA context, a float32 cuBLAS product, a bfloat16 addmm
# with bias for cuBLASLt, their workspaces), then asks for the largest block that succeeds.
USABLE_MEMORY_CHILD = r"""
import json, sys
import torch
index, step, max_tries = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
device = torch.device("cuda", index)
torch.cuda.set_device(device)
a = torch.ones((64, 64), device=device)
keep = [a @ a]
if torch.cuda.is_bf16_supported():
    b = torch.ones((64, 64), device=device, dtype=torch.bfloat16)
    keep.append(torch.addmm(b[0], b, b.t()))
torch.cuda.synchronize(device)
size = torch.cuda.mem_get_info(device)[0] // step * step
tries = 0
while size > 0 and tries < max_tries:
    tries += 1
    try:
        block = torch.empty(size, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        size -= step
        continue
    torch.cuda.synchronize(device)
    print(json.dumps({"usable_memory_bytes": torch.cuda.memory_reserved(device), "block_bytes": size,
                      "tries": tries}))
    sys.exit(0)
print(json.dumps({"usable_memory_bytes": None, "tries": tries}))
"""


def usable_memory_command(index: int) -> list:
    """The argv of the child process that measures usable memory on cuda:`index`."""
    return [sys.executable, "-c", USABLE_MEMORY_CHILD, str(index), str(USABLE_MEMORY_STEP_BYTES),
            str(USABLE_MEMORY_MAX_TRIES)]


def usable_memory(index: int, command=None, timeout_seconds: float = USABLE_MEMORY_TIMEOUT_SECONDS) -> dict:
    """Measure, in a child process, the largest `reserved` a fresh process reaches on cuda:`index`
    (its handles and workspaces included). Return usable_memory_bytes (or "unavailable") and the reason."""
    import subprocess
    argv = usable_memory_command(index) if command is None else list(command)
    unavailable = {"usable_memory_bytes": UNAVAILABLE, "usable_memory_unavailable_reason": None}
    try:
        child = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_seconds,
                               stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {**unavailable, "usable_memory_unavailable_reason": f"no answer within {timeout_seconds} s"}
    except OSError as exc:
        return {**unavailable, "usable_memory_unavailable_reason": _safe_reason(exc)}
    lines = child.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
        value = answer["usable_memory_bytes"] if isinstance(answer, dict) else None
    except (ValueError, KeyError):
        value = None
    if child.returncode == 0 and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return {"usable_memory_bytes": value, "usable_memory_unavailable_reason": None}
    last = (child.stderr.strip().splitlines() or [f"exit code {child.returncode}, no figure"])[-1]
    if child.returncode == 0:
        last = "no allocation succeeded"
    return {**unavailable, "usable_memory_unavailable_reason": _safe_reason(RuntimeError(last))[14:]}


@dataclass
class EnvironmentReport:
    """Every field the diagnostic reports; what cannot be read says why."""

    python_version: str
    torch_version: str = UNAVAILABLE
    torch_unavailable_reason: str | None = None
    cuda_build_version: str | None = None
    hip_build_version: str | None = None
    runtime_note: str = RUNTIME_NOTE
    device: str = "cuda:0"
    device_count: int = 0
    device_visible: bool = False
    device_unavailable_reason: str | None = None
    device_name: str | None = None
    compute_capability: str | None = None
    total_memory_bytes: int | None = None
    free_memory_bytes: int | None = None
    usable_memory_bytes: int | str | None = None  # None: not measured (inside a measuring process)
    usable_memory_unavailable_reason: str | None = None
    os: str = field(default_factory=platform.system)
    machine: str = field(default_factory=platform.machine)


def _safe_reason(exc: BaseException) -> str:
    """One line about `exc` with file paths blanked, so no home or user path leaks."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = re.sub(r"(?:[A-Za-z]:)?[\\/][^\s'\"]*", "<path>", text)
    return f"{type(exc).__name__}: {text}"[:300]


MAX_DEVICE_DIGITS = 6


def parse_device(device: str) -> int:
    """Return N for an explicit 'cuda:N' device string (N: ASCII digits), else raise LabError."""
    match = re.fullmatch(r"cuda:([0-9]{1,%d})" % MAX_DEVICE_DIGITS, device) if isinstance(device, str) else None
    if not match:
        shown = repr(device[:40]) if isinstance(device, str) else type(device).__name__
        raise LabError(f"--device must be an explicit cuda:N (e.g. cuda:0), got {shown}")
    return int(match.group(1))


def environment(device: str = "cuda:0", usable_memory_figure: bool = True, usable_memory_probe=None) -> dict:
    """Report Python, torch, its CUDA/HIP build and the chosen device, and in ``devices`` every
    visible GPU (index, name, total, free and usable memory, or why it is unavailable); never raises
    for a missing GPU. With `usable_memory_figure`, usable_memory_bytes is measured in a child
    process per GPU (see usable_memory); `usable_memory_probe` replaces that function (for tests)."""
    return _environment(device, parse_device(device), usable_memory_figure, usable_memory_probe, all_devices=True)


def _environment(device: str, index: int, usable_memory_figure: bool, usable_memory_probe,
                 all_devices: bool = False) -> dict:
    """The environment report; `all_devices` adds the ``devices`` list (left out of measurement
    files: reading another GPU's free memory would put a CUDA context on it)."""
    probe = usable_memory if usable_memory_probe is None else usable_memory_probe
    report = EnvironmentReport(python_version=platform.python_version(), device=device)
    devices = []

    def result():
        document = asdict(report)
        if all_devices:
            document["devices"] = devices
        return document

    if usable_memory_figure:
        report.usable_memory_bytes = UNAVAILABLE
    try:
        import torch
    except Exception as exc:  # an absent or broken torch is a valid report
        report.torch_unavailable_reason = _safe_reason(exc)
        report.usable_memory_unavailable_reason = "torch cannot be imported" if usable_memory_figure else None
        return result()
    report.torch_version = str(torch.__version__)
    report.cuda_build_version = torch.version.cuda
    report.hip_build_version = getattr(torch.version, "hip", None)
    try:
        if not torch.cuda.is_available():
            report.device_unavailable_reason = "torch.cuda.is_available() is False"
        else:
            report.device_count = torch.cuda.device_count()
            if index >= report.device_count:
                report.device_unavailable_reason = f"{report.device_count} device(s) visible"
    except Exception as exc:
        report.device_unavailable_reason = _safe_reason(exc)
    listed = range(report.device_count) if all_devices else ([] if report.device_unavailable_reason else [index])
    figures = {}
    if usable_memory_figure:
        # every child before this process reads free memory: that creates a CUDA context, which
        # takes device memory
        held = torch.cuda.is_initialized()
        for i in listed:
            figures[i] = dict(probe(i))
            if held and isinstance(figures[i]["usable_memory_bytes"], int):
                figures[i]["usable_memory_unavailable_reason"] = (
                    "this process already held a CUDA context: a fresh process can reach more")
    readings = {}
    for i in listed:
        try:
            props = torch.cuda.get_device_properties(i)
            readings[i] = {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                           "total_memory_bytes": int(props.total_memory),
                           "free_memory_bytes": int(torch.cuda.mem_get_info(i)[0])}
        except Exception as exc:
            readings[i] = {"unavailable_reason": _safe_reason(exc)}
    for i in listed if all_devices else ():
        entry = {"index": i, **readings[i]}
        entry.pop("compute_capability", None)
        if usable_memory_figure:
            entry.update(figures[i])
        else:
            entry.update(usable_memory_bytes=None, usable_memory_unavailable_reason="not measured (--no-usable-memory)")
        devices.append(entry)
    if report.device_unavailable_reason:
        if usable_memory_figure:
            report.usable_memory_unavailable_reason = "no device visible: " + report.device_unavailable_reason
        return result()
    if usable_memory_figure:
        report.usable_memory_bytes = figures[index]["usable_memory_bytes"]
        report.usable_memory_unavailable_reason = figures[index]["usable_memory_unavailable_reason"]
    reading = readings[index]
    if "unavailable_reason" in reading:
        report.device_visible = False
        report.device_unavailable_reason = reading["unavailable_reason"]
        return result()
    report.device_visible = True
    report.device_name = reading["name"]
    report.compute_capability = reading["compute_capability"]
    report.total_memory_bytes = reading["total_memory_bytes"]
    report.free_memory_bytes = reading["free_memory_bytes"]
    return result()


# ----------------------------------------------------------------- measure
MAX_TENSOR_BYTES = 2**48  # 256 TiB: above any device, and byte arithmetic stays exact
_CONFIG_BOUNDS = {"batch": (1, MAX_BATCH), "context": (1, MAX_CONTEXT), "width": (1, MAX_WIDTH),
                  "hidden": (1, MAX_HIDDEN), "warmup": (0, MAX_PASSES), "repeats": (1, MAX_PASSES),
                  "seed": (0, MAX_SEED)}


@dataclass(frozen=True)
class MeasureConfig:
    """What to measure; sizes of the Linear -> GELU -> Linear network and its input. Validated once,
    when built: integer types and bounds, dtype, and the device string (parsed into device_index)."""

    device: str = "cuda:0"
    batch: int = 1
    context: int = 16
    width: int = 64
    hidden: int | None = None  # defaults to 4 * width
    dtype: str = "float32"
    warmup: int = 1
    repeats: int = 2
    seed: int = 0
    tensor_parallel: int | None = None  # None: one GPU, the one-GPU file format; N: N ranks under torchrun

    def __post_init__(self):
        for name, (low, high) in _CONFIG_BOUNDS.items():
            value = getattr(self, name)
            if name == "hidden" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise LabError(f"--{name} must be an integer, got {type(value).__name__}")
            parse_whole(value, f"--{name}", low, high)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            shown = repr(self.dtype[:40]) if isinstance(self.dtype, str) else type(self.dtype).__name__
            raise LabError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {shown}")
        object.__setattr__(self, "_device_index", parse_device(self.device))
        if self.tensor_parallel is not None:
            parse_whole(self.tensor_parallel, "--tensor-parallel", 1, MAX_TENSOR_PARALLEL)
            if self.hidden_features % self.tensor_parallel:
                raise LabError(f"--tensor-parallel {self.tensor_parallel} does not divide the hidden size "
                               f"{self.hidden_features}: each rank holds hidden / N features of the first Linear")
        largest = max(self.batch * self.context * max(self.hidden_features, self.width),
                      self.hidden_features * self.width) * DTYPE_BYTES[self.dtype]
        if largest > MAX_TENSOR_BYTES:
            raise LabError(f"the largest tensor would take {largest} bytes, more than {MAX_TENSOR_BYTES} "
                           "(256 TiB): lower batch, context, width or hidden")

    @property
    def device_index(self) -> int:
        """N of the device cuda:N, parsed once when the config was built."""
        return self._device_index

    @property
    def hidden_features(self) -> int:
        """`hidden`, or 4 x width when it was not given."""
        return 4 * self.width if self.hidden is None else self.hidden

    def checked(self) -> "MeasureConfig":
        """The same config with `hidden` filled in (validation already ran when it was built)."""
        return self if self.hidden is not None else replace(self, hidden=self.hidden_features)

    @property
    def shard_hidden(self) -> int:
        """Hidden features each rank holds: hidden / tensor_parallel (hidden on one GPU)."""
        return self.hidden_features // (self.tensor_parallel or 1)

    def record(self) -> dict:
        """The configuration as a measurement file stores it (`hidden` filled in; `tensor_parallel`
        only for a tensor-parallel run, so one-GPU files keep their format)."""
        record = {**asdict(self), "hidden": self.hidden_features}
        if self.tensor_parallel is None:
            del record["tensor_parallel"]
        return record


def parameter_shapes(width: int, hidden: int) -> dict:
    """The network's parameter shapes, in the order the model holds (and copies) them."""
    return {"0.weight": [hidden, width], "0.bias": [hidden], "2.weight": [width, hidden], "2.bias": [width]}


def synthetic_model(config: MeasureConfig) -> dict:
    """Describe the network: parameter tensors, counts, bytes and forward FLOPs. At tensor parallel
    N, `tensor_parallel` adds what each rank holds: the first Linear split by output features, the
    second by input features, its bias whole on every rank, and the all-reduce after it."""
    width, hidden = config.width, config.hidden_features
    shapes = parameter_shapes(width, hidden)
    counts = {name: math.prod(shape) for name, shape in shapes.items()}
    element_bytes = DTYPE_BYTES[config.dtype]
    # two matrix products of 2*N*width*hidden each; bias adds and GELU not counted
    flops = 4 * config.batch * config.context * width * hidden
    description = {
        "layers": ["Linear(width, hidden)", "GELU", "Linear(hidden, width)"],
        "width": width, "hidden": hidden,
        "parameter_shapes": shapes,
        "parameter_count": sum(counts.values()),
        "parameter_bytes": sum(counts.values()) * element_bytes,
        "forward_flops": flops,
    }
    if config.tensor_parallel is not None:
        rank_shapes = parameter_shapes(width, config.shard_hidden)
        rank_count = sum(math.prod(shape) for shape in rank_shapes.values())
        description["tensor_parallel"] = {
            "degree": config.tensor_parallel,
            "split": "0.weight and 0.bias by output features, 2.weight by input features; 2.bias whole on "
                     "every rank, added once after the all-reduce",
            "rank_parameter_shapes": rank_shapes,
            "rank_parameter_count": rank_count,
            "rank_parameter_bytes": rank_count * element_bytes,
            "rank_forward_flops": flops // config.tensor_parallel,
            "all_reduce_bytes": config.batch * config.context * width * element_bytes,
        }
    return description


def _import_torch():
    try:
        import torch
    except Exception as exc:
        raise LabError(f"torch cannot be imported ({_safe_reason(exc)}); measure needs a GPU build of torch")
    return torch


def _check_device(torch, config: MeasureConfig):
    if not torch.cuda.is_available():
        raise LabError("no CUDA/ROCm device is available to torch; measure never falls back to the CPU")
    if config.device_index >= torch.cuda.device_count():
        raise LabError(f"{config.device} is out of range: {torch.cuda.device_count()} device(s) visible")
    try:
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.4 has no emulation flag
        bf16 = torch.cuda.is_bf16_supported()
    if config.dtype == "bfloat16" and not bf16:
        raise LabError(f"bfloat16 is not supported on {config.device}")
    return torch.device("cuda", config.device_index)


def _phase(torch, device, name, action, index=None, passes=0, history=None, failed_as=None):
    """Run `action` as one phase; return (record, what action returned). With a HistoryRecorder
    `history`, mark the phase on the trace's clock (between the synchronizations) and on failure
    let it save the allocator's state. A failure names the phase `failed_as` (default `name`)."""
    torch.cuda.synchronize(device)
    baseline_allocated = torch.cuda.memory_allocated(device)
    baseline_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_us = now_us()
    try:
        started = time.perf_counter()
        start.record()
        result = action()
        end.record()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        device_seconds = start.elapsed_time(end) / 1000.0  # elapsed_time is in ms
    except RuntimeError as exc:  # torch.OutOfMemoryError and CUDA errors derive from it
        error = PhaseError(failed_as or name, exc)
        if history is not None:
            history.mark(name, index, start_us, now_us())
            history.failure(torch, device, error)
        raise error from None
    if history is not None:
        history.mark(name, index, start_us, now_us())
    stats = torch.cuda.memory_stats(device)
    record = {
        "phase": name, "index": index, "passes": passes,
        "seconds": seconds, "device_seconds": device_seconds,
        "baseline_allocated_bytes": baseline_allocated,
        "baseline_reserved_bytes": baseline_reserved,
        "end_allocated_bytes": stats["allocated_bytes.all.current"],
        "end_reserved_bytes": stats["reserved_bytes.all.current"],
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
    }
    return record, result


def run_phase(torch, device, name, action, index=None, passes=0, history=None, failed_as=None):
    """One phase measured as `measure` measures it (for other measuring commands): synchronize,
    reset the peaks, run `action`, read the allocator's counters; return (record, what action
    returned). PhaseError on a CUDA failure; with `history`, the phase is marked on the timeline."""
    return _phase(torch, device, name, action, index, passes, history, failed_as)


def measure(config: MeasureConfig, history: "HistoryRecorder | None" = None) -> dict:
    """Measure every phase on the GPU and return the measurement document. With a HistoryRecorder,
    the allocator's history is recorded for the run and `history.timeline` holds the timeline."""
    torch = _import_torch()
    device = _check_device(torch, config)
    torch.cuda.set_device(device)
    torch.cuda.init()
    dtype = getattr(torch, config.dtype)
    hidden = config.hidden_features
    # no usable-memory child here: it would compete with this process's own context
    env = _environment(config.device, config.device_index, usable_memory_figure=False, usable_memory_probe=None)
    model_info = synthetic_model(config)
    phases, state = [], {}

    def load_model():
        with torch.random.fork_rng(devices=[]):  # seed the CPU init without touching global RNG
            torch.manual_seed(config.seed)
            model = torch.nn.Sequential(torch.nn.Linear(config.width, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, config.width))
        # convert on the CPU, then copy: the device only ever holds the final tensors
        state["model"] = model.to(dtype=dtype).to(device).eval()

    def make_inputs():
        generator = torch.Generator(device=device).manual_seed(config.seed)
        state["x"] = torch.randn((config.batch, config.context, config.width),
                                 generator=generator, device=device, dtype=dtype)

    def forward():
        return state["model"](state["x"])

    def warmup():
        for _ in range(config.warmup):
            forward()  # each output is released before the next pass

    def run_phases():
        phases.append(_phase(torch, device, "model_load", load_model, history=history)[0])
        phases.append(_phase(torch, device, "inputs", make_inputs, history=history)[0])
        with torch.inference_mode():
            record, output = _phase(torch, device, "cold_forward", forward, passes=1, history=history)
            phases.append(record)
            del output  # alive when the end was recorded, released before the next pass
            phases.append(_phase(torch, device, "warmup", warmup, passes=config.warmup, history=history)[0])
            for repeat in range(config.repeats):
                record, output = _phase(torch, device, "warm_forward", forward, index=repeat, passes=1,
                                        history=history)
                del output
                record["achieved_tflops"] = model_info["forward_flops"] / record["device_seconds"] / 1e12
                record["host_to_device_time_ratio"] = record["seconds"] / record["device_seconds"]
                phases.append(record)

    if history is None:
        run_phases()
    else:
        history.start(torch)
        try:
            run_phases()
            history.finish(torch, device, state)
        finally:
            history.stop(torch)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab measurement",
        "environment": env,
        "configuration": config.record(),
        "synthetic_model": model_info,
        "phases": phases,
    }


# ----------------------------------------------------------------- tensor parallel
# One measuring process per GPU, started by torchrun (torch.distributed's launcher); the lab adds
# no launcher of its own. Names other measuring commands use: launch_info, LaunchInfo,
# TensorParallelRun.
MAX_TENSOR_PARALLEL = _MAX_RANKS
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Where torchrun's store lives; read to publish a failure to every rank.
STORE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
                   "TORCHELASTIC_RESTART_COUNT")
MAX_LAUNCHER_NUMBER = 2**31 - 1
# Every wait between ranks is bounded. A rank that dies is seen by torchrun at once, which stops the
# others; a rank that hangs holds the others at most this long in a collective or in gather.
COORDINATION_TIMEOUT_SECONDS = 300
MONITOR_INTERVAL_SECONDS = 0.1
FAILURE_ACK_SECONDS = 20  # a failing rank waits this long for every rank to print the line
ABORT_WAIT_SECONDS = 10  # aborting a communicator can itself block on a broken peer
STORE_LOST_SECONDS = 30  # the monitor gives up on a store it cannot reach for this long
ACK_POLL_SECONDS = 0.005
EXIT_TERMINATED = 128 + 15  # what a shell reports for a process SIGTERM ended


def launcher_environment() -> dict:
    """torchrun's variables (LAUNCHER_VARIABLES and STORE_VARIABLES) that are set, by name: the only
    environment variables the lab reads, and only for a tensor-parallel run."""
    return {name: os.environ[name] for name in (*LAUNCHER_VARIABLES, *STORE_VARIABLES) if name in os.environ}


def error_line(text: str) -> None:
    """Print one line on stderr in a single write. Python's stderr writes through, so print() sends the
    text and its newline separately; two ranks sharing torchrun's stderr would then interleave their
    lines (one pipe write up to 4096 bytes is atomic)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


_LAUNCHER_STOP = {"received": False}  # torchrun's SIGTERM, recorded by hold_launcher_stop


def _launched_by_torchrun() -> bool:
    return any(name in launcher_environment() for name in LAUNCHER_VARIABLES)


def hold_launcher_stop() -> None:
    """Under torchrun, from the start of a command: record torchrun's SIGTERM instead of ending at once.
    torchrun stops the ranks still running once one rank has ended. A rank that meets a bad input, as
    every rank does alike, still prints its own line and ends with 2 (keep_own_exit_code); a rank that
    reaches TensorParallelRun after the signal ends there in one line, since a peer is gone."""
    if _launched_by_torchrun():
        import signal
        try:
            signal.signal(signal.SIGTERM, lambda signum, frame: _LAUNCHER_STOP.update(received=True))
        except ValueError:  # not the main thread: signal handlers belong to it
            pass


def keep_own_exit_code() -> None:
    """In a process torchrun started, ignore torchrun's SIGTERM from now on: this rank is about to print
    its own line and end with its own code."""
    if _launched_by_torchrun():
        import signal
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:
            pass


USAGE_WAIT_SECONDS = 10.0


def wait_for_every_rank(name: str = "usage-error", timeout_seconds: float = USAGE_WAIT_SECONDS) -> None:
    """Under torchrun (its agent hosting the store), after this rank printed its line: count it in the
    store and wait, at most `timeout_seconds`, until every rank has. torchrun stops the ranks still
    running as soon as one has ended, so a rank that ended at once could cut a slower rank's line
    short; with this wait, every rank that meets the same bad input reports it."""
    env = launcher_environment()
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        import datetime

        import torch.distributed as dist
        world = parse_whole(env["WORLD_SIZE"], "WORLD_SIZE", 1, MAX_LAUNCHER_NUMBER)
        store = dist.TCPStore(env["MASTER_ADDR"], parse_whole(env["MASTER_PORT"], "MASTER_PORT", 1, 65535), None,
                              is_master=False, timeout=datetime.timedelta(seconds=timeout_seconds),
                              wait_for_workers=False)
        key = f"iteragpu-lab/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"
        deadline = time.monotonic() + timeout_seconds
        count = store.add(key, 1)
        while count < world and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(key, 0)
    except Exception:  # no store, a bad variable, a broken connection: end now, the line is printed
        pass


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place among the ranks, as torchrun set it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def device(self) -> str:
        """The GPU of this rank: cuda:LOCAL_RANK (torchrun starts one process per GPU of a machine)."""
        return f"cuda:{self.local_rank}"


def launcher_command(tensor_parallel: int, command) -> str:
    """The torchrun command line that runs `command` at `tensor_parallel` ranks on one machine.
    `command` is what follows torchrun's own flags (`-m lab_helpers.mesure_memoire measure ...`), as
    a string or as an argv list (quoted for a POSIX shell)."""
    import shlex
    tail = command if isinstance(command, str) else shlex.join(str(part) for part in command)
    return f"torchrun --nproc-per-node {tensor_parallel} {tail}"


def launch_info(tensor_parallel: int, command, environ=None) -> LaunchInfo:
    """Read this rank's place from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE) and check it against `tensor_parallel` and the GPUs torch sees. LabError (one
    line) when no launcher started this process (the message holds the torchrun command built from
    `command`, see launcher_command), when a variable is missing or not a whole number, when
    WORLD_SIZE differs from `tensor_parallel`, when a rank is out of range, or when this machine runs
    more ranks than it has visible GPUs. `environ` replaces launcher_environment() (for tests)."""
    parse_whole(tensor_parallel, "--tensor-parallel", 1, MAX_TENSOR_PARALLEL)
    env = launcher_environment() if environ is None else environ
    run_it = launcher_command(tensor_parallel, command)
    present = [name for name in LAUNCHER_VARIABLES if name in env]
    if not present:
        raise LabError(f"--tensor-parallel {tensor_parallel} runs one process per GPU, started by torchrun; "
                       f"run: {run_it}")
    values = {}
    for name in LAUNCHER_VARIABLES:
        if name not in env:
            raise LabError(f"the launcher's environment is incomplete: {name} is not set "
                           f"(start the command with torchrun: {run_it})")
        values[name] = parse_whole(env[name], f"the launcher's {name}", 0, MAX_LAUNCHER_NUMBER)
    info = LaunchInfo(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
    if info.world_size != tensor_parallel:
        raise LabError(f"--tensor-parallel {tensor_parallel} disagrees with the launcher's world size "
                       f"{info.world_size} (WORLD_SIZE): the degree is the number of ranks; run: {run_it}")
    if info.rank >= info.world_size:
        raise LabError(f"the launcher's RANK {info.rank} is not below its WORLD_SIZE {info.world_size}")
    if not 1 <= info.local_world_size <= info.world_size:
        raise LabError(f"the launcher's LOCAL_WORLD_SIZE {info.local_world_size} is not between 1 and "
                       f"its WORLD_SIZE {info.world_size}")
    if info.local_rank >= info.local_world_size:
        raise LabError(f"the launcher's LOCAL_RANK {info.local_rank} is not below its LOCAL_WORLD_SIZE "
                       f"{info.local_world_size}")
    torch = _import_torch()
    try:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken driver reads as no device, with its reason
        raise LabError(f"no CUDA device is usable by torch ({_safe_reason(exc)})") from None
    if visible == 0:
        raise LabError(f"no CUDA device is visible to torch; --tensor-parallel {tensor_parallel} needs one GPU "
                       "per rank and never falls back to the CPU")
    if info.local_world_size > visible:
        raise LabError(f"{info.local_world_size} ranks on this machine (LOCAL_WORLD_SIZE) but {visible} GPU(s) "
                       "visible: one GPU per rank; lower --nproc-per-node and --tensor-parallel")
    return info


class TensorParallelRun:
    """The distributed side of one measuring process among N (a context manager).

    On enter: reads the device's free memory and the allocator's reserved bytes, starts the NCCL
    process group (``init_process_group("nccl", device_id=device)``) and a gloo group that carries
    the lab's own messages (never NCCL, so the caching allocator sees none of them), makes the NCCL
    communicators connect with one all-reduce of a tiny tensor (then an all-gather, which makes the
    process group let go of it), releases them and empties the cache, checks that the allocator is
    back where it was (every phase starts from an empty allocator; a failure otherwise), then reads
    free memory again. ``outside_allocator``
    = {before_bytes, after_bytes, nccl_outside_allocator_bytes}: the drop in free memory less the
    growth of reserved, what NCCL holds outside PyTorch's allocator (None on a CPU device).

    A rank that fails calls ``fail(error)``: the failure {rank, phase, message} goes to torchrun's
    store; every rank's monitor thread sees it, aborts its communicator (a rank blocked in a
    collective must not hang), prints one line ``PROG: error: rank R failed in phase P: ...; no file
    written`` on stderr and ends with the same exit code. On exit the groups are destroyed.
    `backend` and `timeout_seconds` exist for tests on the CPU (gloo)."""

    def __init__(self, info: LaunchInfo, device, prog: str = "mesure_memoire", *, backend=None,
                 timeout_seconds: float = COORDINATION_TIMEOUT_SECONDS, environ=None):
        torch = _import_torch()
        self.info = info
        self.rank, self.world_size = info.rank, info.world_size
        self.device = torch.device(device)
        self.prog = prog
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout_seconds = timeout_seconds
        self.group = None
        self.outside_allocator = None
        self._environ = launcher_environment() if environ is None else environ
        self._gloo = None
        self._store = None
        self._store_lock = None
        self._stopped = None
        self._monitor = None
        self._ending = None

    # ---- the store: failures and acknowledgements
    def _connect(self, master: bool):
        import datetime
        import torch.distributed as dist
        host = self._environ.get("MASTER_ADDR")
        port = self._environ.get("MASTER_PORT")
        if not host or port is None:
            raise LabError("the launcher's environment lacks MASTER_ADDR or MASTER_PORT; start the command "
                           "with torchrun")
        port = parse_whole(port, "the launcher's MASTER_PORT", 1, 65535)
        return dist.TCPStore(host, port, self.world_size if master else None, is_master=master,
                             timeout=datetime.timedelta(seconds=self.timeout_seconds), wait_for_workers=False)

    def _key(self, name: str) -> str:
        run_id = self._environ.get("TORCHELASTIC_RUN_ID", "")
        restart = self._environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"iteragpu-lab/{run_id}/{restart}/{name}"

    def __enter__(self):
        import datetime
        import threading
        import torch
        import torch.distributed as dist
        # torchrun's agent hosts the store; launched otherwise (env:// by hand), rank 0 hosts it
        agent = self._environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self._store = self._connect(master=not agent and self.rank == 0)
        group_store = self._connect(master=False)  # its own connection: the monitor thread uses the first
        self._store_lock = threading.Lock()
        self._stopped = threading.Event()
        self._ending = threading.Lock()
        self._catch_termination()
        self._monitor = threading.Thread(target=self._watch, name="iteragpu-lab failure monitor", daemon=True)
        self._monitor.start()
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.set_device(self.device)
                torch.cuda.synchronize(self.device)
                free_before = int(torch.cuda.mem_get_info(self.device)[0])
                reserved_before = torch.cuda.memory_reserved(self.device)
                allocated_before = torch.cuda.memory_allocated(self.device)
            timeout = datetime.timedelta(seconds=self.timeout_seconds)
            dist.init_process_group(self.backend, store=dist.PrefixStore(self._key("group"), group_store),
                                    rank=self.rank, world_size=self.world_size, timeout=timeout,
                                    device_id=self.device if cuda else None)
            self.group = dist.group.WORLD
            self._gloo = self.group if self.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
            # NCCL connects at the first collective, not at init: one all-reduce of a tiny tensor
            # makes its buffers exist before any phase (measured: about 0.5 GB more per rank there)
            tiny = torch.ones(1, device=self.device)
            dist.all_reduce(tiny, group=self.group)
            if cuda:
                torch.cuda.synchronize(self.device)
                # the sequence measured (torch 2.11, NCCL 2.28) to leave the allocator empty once
                # released: an all-reduce, then an all-gather. Every wait on the gloo group goes through
                # a CPU tensor: barrier() on a group bound to a GPU puts its token tensor on that GPU,
                # where it stays (measured: 512 bytes and a 2 MiB segment in every phase)
                gathered = torch.empty(self.world_size, device=self.device)
                dist.all_gather_into_tensor(gathered, tiny, group=self.group)
                torch.cuda.synchronize(self.device)
                del gathered
            del tiny
            # not dist.barrier: on a group bound to a GPU it allocates its token tensor on that GPU
            # (measured: 512 bytes and a 2 MiB segment left in the caching allocator)
            dist.all_reduce(torch.zeros(1), group=self._gloo)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.synchronize(self.device)
                free_after = int(torch.cuda.mem_get_info(self.device)[0])
                reserved_after = torch.cuda.memory_reserved(self.device)
                allocated_after = torch.cuda.memory_allocated(self.device)
                if allocated_after != allocated_before or reserved_after != reserved_before:
                    raise RuntimeError(
                        f"the allocator is not back where it was after the process group's set-up: "
                        f"{allocated_after - allocated_before} bytes allocated and "
                        f"{reserved_after - reserved_before} reserved remain, so the phases would not start "
                        "from an empty allocator")
                self.outside_allocator = {
                    "label": "outside PyTorch's caching allocator: device free memory before and after the "
                             "process group and its communicators exist, less the allocator's reserved growth",
                    "before_bytes": free_before, "after_bytes": free_after,
                    "nccl_outside_allocator_bytes": (free_before - free_after) - (reserved_after - reserved_before),
                }
        except Exception as exc:  # every rank must hear of it, or the others wait in a collective
            self.fail(exc, phase="process group setup")
        return self

    def __exit__(self, exc_type, exc, tb):
        import torch.distributed as dist
        if exc is not None and isinstance(exc, Exception):
            self.fail(exc)  # does not return: every rank ends with the same line and code
        self._stopped.set()
        self._monitor.join(timeout=MONITOR_INTERVAL_SECONDS * 20)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._release_termination()
        return False

    # ---- termination by the launcher
    # torchrun sends SIGTERM to every rank still running once one has ended. A rank reporting a
    # failure must still end with the failure's code, so SIGTERM reaches the monitor thread (through
    # Python's wakeup fd) instead of ending the process at once; the monitor ends it.
    def _catch_termination(self):
        import signal
        import socket
        import threading
        self._termination = None
        self._sigterm = False
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread; torchrun's SIGTERM then ends the rank
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        self._termination = (reader, writer, previous_fd, previous_handler)
        self._sigterm = _LAUNCHER_STOP["received"]  # torchrun stopped this rank before the run began

    def _release_termination(self):
        import signal
        if self._termination is None:
            return
        reader, writer, previous_fd, previous_handler = self._termination
        signal.signal(signal.SIGTERM, previous_handler)
        signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()
        self._termination = None

    def _terminated(self) -> bool:
        """True once torchrun's SIGTERM has arrived (read by either thread, remembered for both)."""
        import signal
        if self._sigterm or self._termination is None:
            return self._sigterm
        try:
            received = self._termination[0].recv(256)
        except (BlockingIOError, OSError):
            return False
        self._sigterm = signal.SIGTERM in received
        return self._sigterm

    def gather(self, obj):
        """Every rank's picklable `obj`, in rank order, on rank 0 (None on the others), over gloo."""
        import torch.distributed as dist
        received = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, received, dst=0, group=self._gloo)
        return received

    def broadcast(self, obj):
        """Rank 0's picklable `obj` on every rank, over gloo (`obj` is ignored on the others)."""
        import torch.distributed as dist
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._gloo)
        return box[0]

    # ---- failure
    def fail(self, error, phase=None, rank=None):
        """Publish this rank's failure to every rank, print the one line and end the process with
        the failure's exit code (EXIT_USAGE for a LabError, EXIT_PHASE otherwise). Never returns.
        When another rank failed first, its failure is the one every rank reports. `rank` names
        the rank the failure happened on when every rank reports one rank's failure (default: this)."""
        phase = phase if phase is not None else getattr(error, "phase", None)
        if isinstance(error, PhaseError):
            message = error.message
        elif isinstance(error, LabError):
            message = str(error)
        else:
            message = _safe_reason(error)
        failure = {"rank": self.rank if rank is None else rank, "phase": phase, "message": message,
                   "exit_code": EXIT_USAGE if isinstance(error, LabError) else EXIT_PHASE}
        try:
            with self._store_lock:
                # the first failure published wins: every rank then prints the same line
                stored = self._store.compare_set(self._key("failure"), "", json.dumps(failure))
            failure = json.loads(stored)
        except Exception:  # the store is gone: report this rank's own failure
            pass
        self._end(failure)

    def failure_line(self, failure: dict) -> str:
        """The one line every rank prints for a published failure."""
        where = f"in phase {failure['phase']}" if failure.get("phase") else "outside the measured phases"
        return f"{self.prog}: error: rank {failure['rank']} failed {where}: {failure['message']}; no file written"

    def _end(self, failure: dict):
        import threading
        self._ending.acquire()  # once per process: a second caller waits for the exit below
        try:
            sys.stdout.flush()
        except Exception:
            pass
        error_line(self.failure_line(failure))
        # the main thread may be blocked in a collective whose peer will never come: abort the
        # communicator (bounded: an abort can itself wait on a broken peer)
        aborting = threading.Thread(target=self._abort, daemon=True)
        aborting.start()
        aborting.join(ABORT_WAIT_SECONDS)
        try:  # every rank has printed before any exits, and they exit together
            with self._store_lock:
                self._store.add(self._key("failure-ack"), 1)
            deadline = time.monotonic() + FAILURE_ACK_SECONDS
            while time.monotonic() < deadline:
                with self._store_lock:
                    if self._store.add(self._key("failure-ack"), 0) >= self.world_size:
                        break
                # torchrun stops the survivors once a rank has ended: every rank that acknowledges
                # ends after all have, so this one is the last or a rank vanished without a word
                if self._terminated():
                    break
                time.sleep(ACK_POLL_SECONDS)
        except Exception:
            pass
        os._exit(failure.get("exit_code", EXIT_PHASE))

    def _abort(self):
        try:
            if self.group is not None and hasattr(self.group, "abort"):
                self.group.abort()
        except Exception:  # gloo or an older torch cannot abort: the exit below ends the process
            pass

    def _watch(self):
        key = self._key("failure")
        lost_since = None
        while not self._stopped.is_set():
            try:
                with self._store_lock:
                    found = self._store.check([key])
                    stored = self._store.get(key) if found else None
                lost_since = None
            except Exception:
                if self._stopped.is_set():
                    return
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > STORE_LOST_SECONDS:
                    self._end({"rank": self.rank, "phase": None, "exit_code": EXIT_PHASE,
                               "message": "lost contact with the launcher's store"})
                stored = None
            if stored:
                self._end(json.loads(stored))
            if self._terminated() and not self._ending.locked():
                # stopped by torchrun with no failure published: a rank vanished
                error_line(f"{self.prog}: error: rank {self.rank} stopped by torchrun (another rank ended without "
                           "reporting); no file written")
                os._exit(EXIT_TERMINATED)
            self._stopped.wait(MONITOR_INTERVAL_SECONDS)


def measure_tensor_parallel(config: MeasureConfig, info: LaunchInfo, write=None, prog: str = "mesure_memoire"):
    """Measure this rank's phases of the synthetic network split over `config.tensor_parallel` ranks
    (one process per GPU, started by torchrun) and return the measurement document on rank 0, None
    on the others, once every rank has finished. Rank r holds 0.weight and 0.bias rows
    [r * hidden / N, (r + 1) * hidden / N), the same columns of 2.weight, and 2.bias whole; the
    forward is addmm, GELU, mm, an in-place all-reduce, then the bias added in place, so TP=N
    computes the same function as one GPU. A failure on any rank ends every rank (TensorParallelRun).
    `write(document)` runs on rank 0 while every rank waits: a LabError it raises ends every rank
    with exit 2 and the same line."""
    torch = _import_torch()
    device = _check_device(torch, config)
    torch.cuda.set_device(device)
    torch.cuda.init()
    dtype = getattr(torch, config.dtype)
    shard = config.shard_hidden
    first, last = info.rank * shard, (info.rank + 1) * shard
    # before the run: this creates the CUDA context, which the NCCL figure must not count
    env = _environment(config.device, config.device_index, usable_memory_figure=False, usable_memory_probe=None)
    model_info = synthetic_model(config)
    rank_flops = model_info["tensor_parallel"]["rank_forward_flops"]
    state = {}
    with TensorParallelRun(info, device, prog) as run:
        import torch.distributed as dist
        from torch.nn import functional

        def load_model():
            with torch.random.fork_rng(devices=[]):  # the full network from the seed, as on one GPU
                torch.manual_seed(config.seed)
                model = torch.nn.Sequential(torch.nn.Linear(config.width, config.hidden_features),
                                            torch.nn.GELU(), torch.nn.Linear(config.hidden_features, config.width))
            model = model.to(dtype=dtype)
            with torch.no_grad():
                shards = (model[0].weight[first:last], model[0].bias[first:last], model[2].weight[:, first:last],
                          model[2].bias)
                # sliced and made contiguous on the CPU: the device only receives this rank's tensors
                state["parameters"] = [t.detach().contiguous().to(device) for t in shards]

        def make_inputs():
            generator = torch.Generator(device=device).manual_seed(config.seed)
            state["x"] = torch.randn((config.batch, config.context, config.width),
                                     generator=generator, device=device, dtype=dtype)

        def forward():
            weight_in, bias_in, weight_out, bias_out = state["parameters"]
            activated = functional.gelu(functional.linear(state["x"], weight_in, bias_in))
            output = functional.linear(activated, weight_out)  # a plain mm: the bias comes after the sum
            del activated
            dist.all_reduce(output, group=run.group)  # in place
            return output.add_(bias_out)

        def warmup():
            for _ in range(config.warmup):
                forward()

        phases = []
        try:
            phases.append(_phase(torch, device, "model_load", load_model)[0])
            phases.append(_phase(torch, device, "inputs", make_inputs)[0])
            with torch.inference_mode():
                record, output = _phase(torch, device, "cold_forward", forward, passes=1)
                phases.append(record)
                del output
                phases.append(_phase(torch, device, "warmup", warmup, passes=config.warmup)[0])
                for repeat in range(config.repeats):
                    record, output = _phase(torch, device, "warm_forward", forward, index=repeat, passes=1)
                    del output
                    record["achieved_tflops"] = rank_flops / record["device_seconds"] / 1e12
                    record["host_to_device_time_ratio"] = record["seconds"] / record["device_seconds"]
                    phases.append(record)
        except PhaseError as error:
            run.fail(error)
        ranks = run.gather({"rank": info.rank, "device": config.device, "device_name": env["device_name"],
                            "outside_allocator": run.outside_allocator, "phases": phases})
        document = None if ranks is None else {
            "schema_version": SCHEMA_VERSION,
            "kind": "iteragpu-lab measurement",
            "environment": env,
            "configuration": config.record(),
            "synthetic_model": model_info,
            "ranks": ranks,
        }
        if write is not None:
            problem = None
            if document is not None:
                try:
                    write(document)
                except LabError as exc:
                    problem = str(exc)
            problem = run.broadcast(problem)
            if problem is not None:
                run.fail(LabError(problem), rank=0)
    return document


def new_file_name(folder, stem: str, suffix: str = ".json") -> Path:
    """Return a path in `folder` named after `stem` and the time that no file takes yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        candidate = Path(folder) / f"{stem}-{stamp}{'' if n == 0 else f'-{n}'}{suffix}"
        if not candidate.exists():
            return candidate
    raise LabError(f"no free file name for {stem} in {folder}")


# ----------------------------------------------------------------- allocator timeline
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
    ``frames``). lab_helpers.timeline.check_timeline validates the result.
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
            error.oom_snapshot_problem = _safe_reason(exc)

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


# ----------------------------------------------------------------- predict
@dataclass(eq=False)
class _Block:
    size: int
    address: int
    segment: list  # the blocks of its segment, in address order
    small: bool
    free: bool = True


class AllocatorModel:
    """Replays PyTorch's CUDA caching allocator (default settings) on request sizes alone."""

    def __init__(self):
        self.free_blocks = {True: [], False: []}  # per pool (small?), the cached free blocks
        self.next_address = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    @staticmethod
    def round_size(request_bytes: int) -> int:
        """Bytes the allocator hands out for a request: a multiple of 512, at least 512."""
        return max(MIN_BLOCK_BYTES, -(-request_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)

    @staticmethod
    def segment_size(rounded: int) -> int:
        """Bytes a new segment for a rounded request reserves from the device."""
        if rounded <= SMALL_REQUEST_MAX_BYTES:
            return SMALL_SEGMENT_BYTES
        if rounded < MIN_LARGE_ALLOC_BYTES:
            return LARGE_SEGMENT_BYTES
        return -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES

    def malloc(self, request_bytes: int) -> _Block:
        """Allocate; return the block to pass to free()."""
        size = self.round_size(request_bytes)
        small = size <= SMALL_REQUEST_MAX_BYTES
        pool = self.free_blocks[small]
        fits = [b for b in pool if b.size >= size]
        if fits:  # best fit: the smallest block, then the lowest address
            block = min(fits, key=lambda b: (b.size, b.address))
            pool.remove(block)
        else:  # a new segment (cudaMalloc)
            total = self.segment_size(size)
            block = _Block(total, self.next_address, [], small)
            block.segment.append(block)
            self.next_address += total
            self.reserved += total
        remaining = block.size - size
        # a small block splits if 512 bytes remain; a large one only if over 1 MiB remains
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_MAX_BYTES:
            rest = _Block(remaining, block.address + size, block.segment, small)
            block.segment.insert(block.segment.index(block) + 1, rest)
            pool.append(rest)
            block.size = size
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: _Block) -> None:
        """Return a block to its pool, merged with its free neighbours in the segment."""
        self.allocated -= block.size
        block.free = True
        pool, segment = self.free_blocks[block.small], block.segment
        i = segment.index(block)
        for j in (i + 1, i - 1):  # the next one first, so index i stays valid
            if 0 <= j < len(segment) and segment[j].free:
                neighbour = segment.pop(j)
                pool.remove(neighbour)
                block.size += neighbour.size
                block.address = min(block.address, neighbour.address)
        pool.append(block)

    def reset_peaks(self) -> None:
        """Restart the peaks from the current values, as reset_peak_memory_stats does."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


ALLOCATION_KINDS = ("weights", "inputs", "workspace", "activations")


RESERVED_ASSUMPTIONS = (
    "a fresh process, default allocator settings (no PYTORCH_CUDA_ALLOC_CONF: no "
    "expandable_segments, no max_split_size_mb), enough free memory (no cache flush and "
    "retry), and free blocks of equal size taken in the order their segments were made")
OUTSIDE_ALLOCATOR_NOT_PREDICTED = (
    "not predicted: what NCCL holds outside PyTorch's allocator (its buffers and communicators) is "
    "measured per rank by measure, from the device's free memory")


def predict(config: MeasureConfig, workspace_bytes=DEFAULT_WORKSPACE_BYTES,
            workspace_source: str = DEFAULT_WORKSPACE_SOURCE) -> dict:
    """Predict allocated and reserved bytes per phase, from the allocator's rules alone. Each phase
    also has ``end_allocated_bytes_by_kind``: its end allocated bytes split into ALLOCATION_KINDS.
    At tensor parallel N the document holds ``ranks`` (each rank's phases) instead of ``phases``."""
    workspace_bytes = tuple(workspace_bytes)
    _check_workspace(workspace_bytes)
    document = {
        "schema_version": SCHEMA_VERSION,
        "kind": "iteragpu-lab prediction",
        "configuration": config.record(),
        "synthetic_model": synthetic_model(config),
        "workspace": {"bytes": list(workspace_bytes), "source": workspace_source},
        "reserved_assumptions": RESERVED_ASSUMPTIONS,
    }
    if config.tensor_parallel is None:
        document["phases"] = _replay_phases(config, workspace_bytes, config.hidden_features)
        return document
    # Every rank runs the same requests in the same order: its shard of hidden / N features (N
    # divides hidden, checked when the config was built), the whole input, output and second bias.
    # The all-reduce is in place and allocates nothing in the caching allocator, so each rank's
    # replay is computed, not copied, with the same sizes.
    document["outside_allocator"] = OUTSIDE_ALLOCATOR_NOT_PREDICTED
    document["ranks"] = [{"rank": rank, "phases": _replay_phases(config, workspace_bytes, config.shard_hidden)}
                         for rank in range(config.tensor_parallel)]
    return document


def _replay_phases(config: MeasureConfig, workspace_bytes: tuple, hidden: int) -> list:
    """The phases of one process holding `hidden` features of the first Linear (all of them on one
    GPU, hidden / N on each of N ranks), replayed on AllocatorModel."""
    c = config
    element = DTYPE_BYTES[c.dtype]
    tokens = c.batch * c.context
    alloc = AllocatorModel()
    live = {}
    phases = []
    held = dict.fromkeys(ALLOCATION_KINDS, 0)  # allocated bytes per kind, as the allocator counts them
    kind_of = {}

    def malloc(size, kind):
        block = alloc.malloc(size)
        kind_of[block] = kind
        held[kind] += block.size
        return block

    def free(block):
        held[kind_of.pop(block)] -= block.size  # before free(): merging grows the block
        alloc.free(block)

    def phase(name, action, index=None, passes=0):
        base_allocated, base_reserved = alloc.allocated, alloc.reserved
        alloc.reset_peaks()
        action()
        phases.append({
            "phase": name, "index": index, "passes": passes,
            "baseline_allocated_bytes": base_allocated, "baseline_reserved_bytes": base_reserved,
            "end_allocated_bytes": alloc.allocated, "end_reserved_bytes": alloc.reserved,
            "peak_allocated_bytes": alloc.peak_allocated, "peak_reserved_bytes": alloc.peak_reserved,
            "end_allocated_bytes_by_kind": dict(held),
        })

    def load_model():
        for shape in parameter_shapes(c.width, hidden).values():
            malloc(math.prod(shape) * element, "weights")

    def forward():
        # nn.Linear on a contiguous 3-D input is one addmm: its output comes first,
        # then the math library's workspace on the very first product
        first = malloc(tokens * hidden * element, "activations")
        if not live.get("workspace"):
            live["workspace"] = [malloc(size, "workspace") for size in workspace_bytes]
        activated = malloc(tokens * hidden * element, "activations")  # GELU output
        free(first)  # Sequential drops the first output once GELU has returned
        output = malloc(tokens * c.width * element, "activations")
        free(activated)
        return output  # at tensor parallel N, all-reduced and biased in place: no new block

    def measured_forward():
        live["output"] = forward()

    def warmup():
        for _ in range(c.warmup):
            free(forward())

    phase("model_load", load_model)
    phase("inputs", lambda: malloc(tokens * c.width * element, "inputs"))
    phase("cold_forward", measured_forward, passes=1)
    free(live.pop("output"))
    phase("warmup", warmup, passes=c.warmup)
    for repeat in range(c.repeats):
        phase("warm_forward", measured_forward, index=repeat, passes=1)
        free(live.pop("output"))
    return phases


# What compare needs of a document: a synthetic configuration and phases with their counters (a
# measurement file, or a prediction laid out like one).
COMPARABLE_SCHEMA = {
    "type": "object",
    "required": ["configuration", "phases"],
    "properties": {
        "configuration": {"$ref": "#/$defs/synthetic_configuration"},
        "phases": {"type": "array", "minItems": 5, "maxItems": 4 + MAX_PASSES, "items": {
            "type": "object",
            "required": ["phase", "index", *(f"{when}_{counter}_bytes" for when in ("baseline", "end", "peak")
                                             for counter in COUNTERS)],
            "properties": {**MEASUREMENT_SCHEMA["$defs"]["phase"]["properties"], "phase": {"enum": list(PHASES)}},
        }},
    },
}


COMPARABLE_RANKS_SCHEMA = {
    "type": "object",
    "required": ["configuration", "ranks"],
    "properties": {
        "configuration": {"$ref": "#/$defs/synthetic_configuration"},
        "ranks": {"type": "array", "minItems": 1, "maxItems": MAX_TENSOR_PARALLEL, "items": {
            "type": "object", "required": ["rank", "phases"],
            "properties": {"rank": {"type": "integer", "minimum": 0, "maximum": MAX_TENSOR_PARALLEL - 1},
                           "phases": COMPARABLE_SCHEMA["properties"]["phases"]},
        }},
    },
}


def compare(measurement: dict, workspace_bytes=None) -> dict:
    """Set a measurement of the synthetic network beside its prediction; differences are measured
    minus predicted. The document is checked against the schema and the phases predict would give.
    A tensor-parallel file is compared rank by rank (``ranks``: each rank's rows)."""
    configuration = measurement.get("configuration") if isinstance(measurement, dict) else None
    if isinstance(configuration, dict) and configuration.get("kind", "synthetic") != "synthetic":
        hint = ("; compare it with python -m lab_helpers.real_model compare FILE"
                if configuration.get("kind") == "transformers" else "")
        raise LabError("compare predicts the synthetic network only; this file measured a "
                       f"{str(configuration['kind'])[:40]} model{hint}")
    parallel = isinstance(configuration, dict) and "tensor_parallel" in configuration
    problem = next(_schema_errors(measurement, COMPARABLE_RANKS_SCHEMA if parallel else COMPARABLE_SCHEMA,
                                  "$", MEASUREMENT_SCHEMA), None)
    if problem:
        raise LabError(f"not a measurement: {problem[0]}: {problem[1]}")
    settings = {k: v for k, v in measurement["configuration"].items() if k != "kind"}
    config = MeasureConfig(**settings)
    if workspace_bytes is None:
        workspace = {"bytes": list(DEFAULT_WORKSPACE_BYTES), "source": DEFAULT_WORKSPACE_SOURCE}
    else:
        workspace = {"bytes": list(workspace_bytes), "source": "given on the command line"}
    _check_workspace(workspace["bytes"])
    if not parallel:
        return {"workspace": workspace,
                **_compare_phases(config, measurement["phases"], tuple(workspace["bytes"]),
                                  config.hidden_features, "$.phases")}
    ranks = measurement["ranks"]
    if len(ranks) != config.tensor_parallel:
        raise LabError(f"$.ranks: {len(ranks)} ranks, but tensor_parallel is {config.tensor_parallel}")
    results = []
    for i, rank in enumerate(ranks):
        if rank["rank"] != i:
            raise LabError(f"$.ranks[{i}].rank: {rank['rank']}, but ranks are listed in order from 0")
        compared = _compare_phases(config, rank["phases"], tuple(workspace["bytes"]), config.shard_hidden,
                                   f"$.ranks[{i}].phases")
        results.append({"rank": i, "device": rank.get("device"), "outside_allocator": rank.get("outside_allocator"),
                        **compared})
    return {"tensor_parallel": config.tensor_parallel, "workspace": workspace,
            "allocated_exact": all(r["allocated_exact"] for r in results), "ranks": results}


def _check_workspace(workspace_bytes) -> None:
    if len(workspace_bytes) > MAX_WORKSPACE_BLOCKS:
        raise LabError(f"at most {MAX_WORKSPACE_BLOCKS} workspace blocks, got {len(workspace_bytes)}")
    for size in workspace_bytes:
        parse_whole(size, "--workspace-bytes", 0, MAX_WORKSPACE_BYTES)


def _compare_phases(config: MeasureConfig, measured: list, workspace_bytes: tuple, hidden: int, where: str) -> dict:
    """One process's measured phases beside their replay (`hidden` features of the first Linear)."""
    bare = _replay_phases(config, (), hidden)
    predicted = _replay_phases(config, workspace_bytes, hidden)
    expected = [(p["phase"], p["index"]) for p in bare]
    if len(measured) != len(expected):
        raise LabError(f"{where}: {len(measured)} records, but measure writes {len(expected)} for "
                       f"warmup {config.warmup} and repeats {config.repeats}")
    for i, (got, want) in enumerate(zip(measured, expected)):
        if (got["phase"], got["index"]) != want:
            raise LabError(f"{where}[{i}]: phase {got['phase']!r} index {got['index']!r}, but measure "
                           f"writes phase {want[0]!r} index {want[1]!r} there")
    cold = PHASES.index("cold_forward")
    detected = measured[cold]["end_allocated_bytes"] - bare[cold]["end_allocated_bytes"]
    rows = []
    for got, want in zip(measured, predicted):
        row = {"phase": got["phase"], "index": got["index"]}
        for key in want:
            if key.endswith("_bytes"):
                row[f"measured_{key}"] = got[key]
                row[f"predicted_{key}"] = want[key]
                row[f"difference_{key}"] = got[key] - want[key]
        rows.append(row)
    allocated_keys = [k for k in rows[0] if k.startswith("difference_") and "allocated" in k]
    return {
        "workspace_detected_bytes": detected,
        "allocated_exact": all(row[k] == 0 for row in rows for k in allocated_keys),
        "rows": rows,
    }


# ------------------------------------------------------------------ tables
MIB = 2**20


def format_bytes(count: int) -> str:
    """'33.16 MiB (34772480 B)': MiB under 1 GiB, GiB from there, with the exact bytes."""
    if count >= GIB:
        return f"{count / GIB:.2f} GiB ({count} B)"
    return f"{count / MIB:.2f} MiB ({count} B)"


def text_table(header, rows) -> str:
    """Columns aligned with two spaces: the first to the left, the others to the right."""
    cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _label(record) -> str:
    return record["phase"] if record.get("index") is None else f"{record['phase']} #{record['index']}"


def _sizes_line(configuration) -> str:
    c = configuration
    return (f"batch {c['batch']}, context {c['context']}, width {c['width']}, hidden {c['hidden']}, "
            f"{c['dtype']}, warmup {c['warmup']}, repeats {c['repeats']}")


def estimate_table(result: dict) -> str:
    """The estimate as lines for people."""
    rows = [
        ("parameters", f"{result['parameters']}"),
        ("bits per parameter", f"{result['bits']} ({result['bytes_per_parameter']} bytes, rounded up)"),
        ("weights", f"{result['weight_gib']:.2f} GiB ({result['weight_bytes']} B; {result['weight_gb']:.2f} GB)"),
        ("reserve (your assumption)", f"{result['reserve_gib']:.2f} GiB"),
        ("total", f"{result['total_gib']:.2f} GiB"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines.append("not counted: " + ", ".join(result["excludes"]))
    return "\n".join(lines)


def _rank_groups(ranks: list) -> list:
    """[(rank numbers, phases)]: consecutive ranks with identical phases shown once."""
    groups = []
    for rank in ranks:
        if groups and groups[-1][1] == rank["phases"]:
            groups[-1][0].append(rank["rank"])
        else:
            groups.append(([rank["rank"]], rank["phases"]))
    return groups


def _ranks_label(numbers: list) -> str:
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {numbers[0]} to {numbers[-1]} (each)"


def predict_table(result: dict) -> str:
    """Predicted end and peak of allocated and reserved per phase (per rank at tensor parallel N),
    for people."""
    counters = ("end_allocated_bytes", "peak_allocated_bytes", "end_reserved_bytes", "peak_reserved_bytes")
    header = ("phase", "end allocated", "peak allocated", "end reserved", "peak reserved")
    workspace = " + ".join(str(b) for b in result["workspace"]["bytes"]) or "0"
    lines = [f"prediction: {_sizes_line(result['configuration'])}"]
    if "ranks" in result:
        for numbers, phases in _rank_groups(result["ranks"]):
            lines.append(f"{_ranks_label(numbers)}:")
            lines.append(text_table(header, [(_label(p), *(format_bytes(p[k]) for k in counters)) for p in phases]))
    else:
        lines.append(text_table(header, [(_label(p), *(format_bytes(p[k]) for k in counters))
                                         for p in result["phases"]]))
    lines += ["each phase starts from the previous one's end",
              f"workspace: {workspace} bytes ({result['workspace']['source']})",
              f"reserved assumes: {result['reserved_assumptions']}"]
    if "outside_allocator" in result:
        lines.append(f"NCCL outside the allocator: {result['outside_allocator']}")
    return "\n".join(lines)


def compare_table(result: dict) -> str:
    """Measured beside predicted peaks per phase, differences in bytes, for people; one table per
    rank at tensor parallel N, with what NCCL holds outside the allocator on that rank."""
    if "ranks" not in result:
        return _compare_rows_table(result)
    parts = [f"tensor parallel {result['tensor_parallel']}: allocated exact on every rank: "
             f"{'yes' if result['allocated_exact'] else 'no'}"]
    for rank in result["ranks"]:
        outside = rank.get("outside_allocator") or {}
        nccl = outside.get("nccl_outside_allocator_bytes")
        parts.append(f"rank {rank['rank']} ({rank.get('device')}): NCCL outside the allocator "
                     f"{'not measured' if nccl is None else format_bytes(nccl) if nccl >= 0 else f'{nccl} B'}")
        parts.append(_compare_rows_table({**rank, "workspace": result["workspace"]}))
    return "\n".join(parts)


def _compare_rows_table(result: dict) -> str:
    header = ("phase", "measured peak allocated", "predicted", "difference B",
              "measured peak reserved", "predicted", "difference B")
    rows = []
    for r in result["rows"]:
        rows.append((_label(r),
                     format_bytes(r["measured_peak_allocated_bytes"]), format_bytes(r["predicted_peak_allocated_bytes"]),
                     f"{r['difference_peak_allocated_bytes']:+d}",
                     format_bytes(r["measured_peak_reserved_bytes"]), format_bytes(r["predicted_peak_reserved_bytes"]),
                     f"{r['difference_peak_reserved_bytes']:+d}"))
    workspace = " + ".join(str(b) for b in result["workspace"]["bytes"]) or "0"
    return "\n".join([
        text_table(header, rows),
        f"allocated exact (baseline, end and peak of every phase): {'yes' if result['allocated_exact'] else 'no'}",
        f"workspace predicted: {workspace} bytes ({result['workspace']['source']}); "
        f"detected from the cold forward: {result['workspace_detected_bytes']} bytes",
    ])


def environment_table(result: dict) -> str:
    """The environment report as 'key  value' lines, then one row per visible GPU, for people."""
    fields = {key: value for key, value in result.items() if key != "devices"}
    width = max(map(len, fields))
    lines = [f"{key.ljust(width)}  {'' if value is None else value}".rstrip() for key, value in fields.items()]
    if "devices" not in result:
        return "\n".join(lines)
    if not result["devices"]:
        return "\n".join([*lines, "visible GPUs: none"])

    def usable(entry):
        value = entry.get("usable_memory_bytes")
        return format_bytes(value) if isinstance(value, int) else f"unavailable: {entry.get('usable_memory_unavailable_reason')}"
    rows = []
    for entry in result["devices"]:
        if "unavailable_reason" in entry:
            rows.append((f"cuda:{entry['index']}", f"unavailable: {entry['unavailable_reason']}", "", "", ""))
        else:
            rows.append((f"cuda:{entry['index']}", entry["name"], format_bytes(entry["total_memory_bytes"]),
                         format_bytes(entry["free_memory_bytes"]), usable(entry)))
    return "\n".join([*lines, "visible GPUs:", text_table(("device", "name", "total", "free", "usable"), rows)])


# --------------------------------------------------------------------- CLI
MAX_WORKSPACE_BLOCKS = 16
MAX_WORKSPACE_BYTES = 2**40
COMMANDS = {
    "estimate": "weight bytes from a parameter count and a bit width (no GPU, no torch)",
    "environment": "Python, torch, the device, and the memory a fresh process can use",
    "measure": "measure memory and time per phase on the GPU (never on the CPU)",
    "predict": "predict allocated/reserved bytes per phase from the allocator's rules (no GPU)",
    "compare": "a measurement file beside its prediction, per phase",
}
EXAMPLES = {
    "estimate": "python mesure_memoire.py estimate --parameters 7000000000 --bits 16 --reserve-gib 4",
    "environment": "python mesure_memoire.py environment --device cuda:0",
    "measure": ("python mesure_memoire.py measure --device cuda:0 --batch 1 --context 16 --width 64 \\\n"
                "      --dtype float32 --warmup 1 --repeats 2 --output mesures-petit-essai.json"),
    "predict": "python mesure_memoire.py predict --batch 2 --context 128 --width 1024 --dtype bfloat16 --format table",
    "compare": "python mesure_memoire.py compare mesures-petit-essai.json --format table --fail-on-difference",
}
DEFAULT_WORKSPACE_HELP = (f"default: {' then '.join(map(str, DEFAULT_WORKSPACE_BYTES))} bytes, "
                          f"{DEFAULT_WORKSPACE_SOURCE}")


def add_size_flags(parser) -> None:
    """The flags of the network's sizes and passes, shared by measure, predict and the sweep."""
    parser.add_argument("--batch", type=whole_number(1, MAX_BATCH), default=1,
                        help=f"sequences per forward pass, 1 to {MAX_BATCH} (default 1)")
    parser.add_argument("--context", type=whole_number(1, MAX_CONTEXT), default=16,
                        help=f"tokens per sequence, 1 to {MAX_CONTEXT} (default 16)")
    parser.add_argument("--width", type=whole_number(1, MAX_WIDTH), default=64,
                        help=f"model width: Linear input/output features, 1 to {MAX_WIDTH} (default 64)")
    parser.add_argument("--hidden", type=whole_number(1, MAX_HIDDEN), default=None,
                        help=f"hidden features of the first Linear, 1 to {MAX_HIDDEN} (default 4 x width)")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="float32",
                        help="parameter and input dtype (default float32)")
    parser.add_argument("--warmup", type=whole_number(0, MAX_PASSES), default=1,
                        help=f"warm-up passes, recorded as one phase, 0 to {MAX_PASSES} (default 1)")
    parser.add_argument("--repeats", type=whole_number(1, MAX_PASSES), default=2,
                        help=f"measured warm passes, one record each, 1 to {MAX_PASSES} (default 2)")


def _format_flag(parser) -> None:
    parser.add_argument("--format", choices=("json", "table"), default="json",
                        help="json for programs (default), table for people")


def _tensor_parallel_flag(parser, text: str) -> None:
    parser.add_argument("--tensor-parallel", type=whole_number(1, MAX_TENSOR_PARALLEL), default=None, metavar="N",
                        help=text)


def _workspace_flag(parser, text: str) -> None:
    parser.add_argument("--workspace-bytes", type=whole_number(0, MAX_WORKSPACE_BYTES), nargs="*", default=None,
                        metavar="N", help=text)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser with its five subcommands."""
    parser = CommandParser(prog="mesure_memoire", description=(
        "Estimate weight bytes, describe the environment, and measure or predict PyTorch "
        "allocator counters per phase of a tiny Linear -> GELU -> Linear network."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser, metavar="COMMAND")

    def command(name):
        return sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name],
                              epilog=f"example:\n  {EXAMPLES[name]}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = command("estimate")
    p.add_argument("--parameters", type=whole_number(1, MAX_PARAMETERS), required=True,
                   help=f"number of model parameters, 1 to {MAX_PARAMETERS}")
    p.add_argument("--bits", type=whole_number(1, MAX_BITS), required=True,
                   help=f"bits per parameter, 1 to {MAX_BITS}, rounded up to whole bytes")
    p.add_argument("--reserve-gib", type=decimal_number(0, MAX_RESERVE_GIB), default=0.0,
                   help=f"extra GiB you choose to add, stated as an assumption, 0 to {MAX_RESERVE_GIB} (default 0)")
    _format_flag(p)
    p = command("environment")
    p.add_argument("--device", default="cuda:0", help="device to describe, cuda:N (default cuda:0)")
    p.add_argument("--no-usable-memory", dest="usable_memory", action="store_false",
                   help="skip the child process that measures usable_memory_bytes")
    _format_flag(p)
    p = command("measure")
    p.add_argument("--device", default=None,
                   help="device to measure on, an explicit cuda:N (default cuda:0); with --tensor-parallel N > 1 "
                        "leave it out: rank r measures on cuda:LOCAL_RANK")
    add_size_flags(p)
    _tensor_parallel_flag(p, "split the network over N GPUs, one process each, started by torchrun "
                             "(torchrun --nproc-per-node N -m lab_helpers.mesure_memoire measure ... "
                             f"--tensor-parallel N), 1 to {MAX_TENSOR_PARALLEL}; N must divide --hidden")
    p.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0,
                   help="seed of the weights and inputs (default 0)")
    p.add_argument("--output", required=True, help="new JSON file to create; an existing file is never overwritten")
    p.add_argument("--failure-report", metavar="PATH",
                   help="on exit 3, write {kind, phase, reason: out_of_memory|cuda_error, message} "
                        "as JSON to this new file")
    add_timeline_flags(p)
    p = command("predict")
    add_size_flags(p)
    _tensor_parallel_flag(p, "predict every rank of the network split over N GPUs (no GPU needed), 1 to "
                             f"{MAX_TENSOR_PARALLEL}; N must divide --hidden")
    _workspace_flag(p, "math-library workspace blocks allocated at the first matrix product, each 0 to "
                       f"{MAX_WORKSPACE_BYTES}, at most {MAX_WORKSPACE_BLOCKS} ({DEFAULT_WORKSPACE_HELP})")
    _format_flag(p)
    p = command("compare")
    p.add_argument("measurement", help="JSON file written by measure")
    _workspace_flag(p, f"override the workspace blocks ({DEFAULT_WORKSPACE_HELP})")
    p.add_argument("--fail-on-difference", action="store_true",
                   help="exit 1 if any predicted allocated count differs from the measured one")
    _format_flag(p)
    return parser


def _config_from(args) -> MeasureConfig:
    settings = {k: getattr(args, k) for k in MeasureConfig.__dataclass_fields__ if hasattr(args, k)}
    if "device" in settings and settings["device"] is None:
        del settings["device"]  # cuda:0 on one GPU; cuda:LOCAL_RANK per rank at tensor parallel N
    elif "device" in settings and (settings.get("tensor_parallel") or 1) > 1:
        raise LabError(f"--device is not used with --tensor-parallel {settings['tensor_parallel']}: each rank "
                       "measures on cuda:LOCAL_RANK (torchrun starts one process per GPU); leave --device out")
    return MeasureConfig(**settings)


def own_command(argv) -> list:
    """How this file was started, then `argv`: `-m lab_helpers.mesure_memoire ...` for the module
    (python -m, or the iteragpu-memory command), the script as typed for a copy run as a file."""
    if globals().get("__spec__") is None and sys.argv and sys.argv[0].endswith(".py"):
        return [display_path(sys.argv[0]), *argv]
    return ["-m", "lab_helpers.mesure_memoire", *argv]


def measure_tensor_parallel_command(args, config: MeasureConfig):
    """measure --tensor-parallel N in one of torchrun's processes: the result for rank 0, None for
    the others (they print nothing)."""
    if (args.failure_report is not None or args.timeline is not None or args.timeline_stacks
            or args.timeline_max_entries != DEFAULT_MAX_ENTRIES):
        raise LabError("--failure-report and the --timeline flags record one GPU; leave them out with "
                       "--tensor-parallel (a failure on any rank is reported on every rank's stderr)")
    info = launch_info(config.tensor_parallel, own_command(getattr(args, "command_argv", None) or []))
    if args.device is None:
        config = replace(config, device=info.device)
    document = measure_tensor_parallel(config, info, write=lambda d: write_new_json(args.output, d))
    if document is None:
        return None
    return {"output": display_path(args.output), "tensor_parallel": config.tensor_parallel,
            "ranks": len(document["ranks"]), "phases": len(document["ranks"][0]["phases"])}


def _workspace_from(args):
    if args.workspace_bytes is None:
        return None
    if len(args.workspace_bytes) > MAX_WORKSPACE_BLOCKS:
        raise LabError(f"--workspace-bytes takes at most {MAX_WORKSPACE_BLOCKS} blocks, got {len(args.workspace_bytes)}")
    return tuple(args.workspace_bytes)


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


def check_new_output(path) -> None:
    """Raise LabError now for an output path that write_new_text would refuse at the end (it exists,
    its folder is missing or not a folder, its name is too long, no permission): check before long work."""
    shown = display_path(path)
    folder, name = os.path.split(os.fspath(path))
    folder = folder or os.curdir
    if not name:
        raise LabError(f"cannot write {shown}: it is a folder")
    try:
        os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a name too long, a parent that is a file, a loop of links
        raise _output_error(shown, exc) from None
    else:
        raise LabError(f"{shown} already exists; choose a new file name")
    if not os.path.isdir(folder):
        raise LabError(f"cannot write {shown}: its folder does not exist")
    if not os.access(folder, os.W_OK):
        raise LabError(f"cannot write {shown}: permission denied")


def run_command(args) -> dict:
    """Execute one parsed command and return its JSON-ready result."""
    if args.command == "estimate":
        return estimate(args.parameters, args.bits, args.reserve_gib)
    if args.command == "environment":
        return environment(args.device, usable_memory_figure=args.usable_memory)
    if args.command == "predict":
        workspace = _workspace_from(args)
        if workspace is None:
            return predict(_config_from(args))
        return predict(_config_from(args), workspace, "given on the command line")
    if args.command == "compare":
        workspace = _workspace_from(args)
        document = read_measurement(args.measurement)
        return compare(document, workspace)
    config = _config_from(args)
    check_new_output(args.output)
    if config.tensor_parallel is not None:
        return measure_tensor_parallel_command(args, config)
    if args.failure_report is not None:
        check_new_output(args.failure_report)
    history = timeline_recorder(args, {"--output": args.output, "--failure-report": args.failure_report})
    document = measure(config) if history is None else measure(config, history)
    write_new_json(args.output, document)
    result = {"output": display_path(args.output), "phases": len(document["phases"])}
    if history is not None:
        result.update(write_timeline(args.timeline, history))
    return result


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
        return f"; out-of-memory snapshot not written: {_safe_reason(exc)}"
    try:
        write_new_text(path, text)
    except LabError as write_error:
        return f"; out-of-memory snapshot not written: {write_error}"
    return f"; out-of-memory snapshot: {display_path(path)}"


TABLES = {"estimate": estimate_table, "environment": environment_table, "predict": predict_table,
          "compare": compare_table}


def _command_list() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(["usage: mesure_memoire COMMAND [--help]", "commands:", *lines])


@quiet_broken_pipe
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    hold_launcher_stop()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(_command_list(), file=sys.stderr)
        return EXIT_USAGE
    args = build_parser().parse_args(argv)
    args.command_argv = argv  # the torchrun command a tensor-parallel measure asks for repeats it
    try:
        result = run_command(args)
    except LabError as exc:
        keep_own_exit_code()
        error_line(f"mesure_memoire: error: {exc}")
        wait_for_every_rank()
        return EXIT_USAGE
    except PhaseError as exc:
        note = "no file written"
        if args.failure_report is not None:
            try:
                write_new_json(args.failure_report, exc.report())
                note += f"; failure report: {display_path(args.failure_report)}"
            except LabError as write_error:
                note += f"; failure report not written: {write_error}"
        if getattr(args, "timeline", None) is not None:
            note += save_oom_snapshot(args.timeline, exc)
        error_line(f"mesure_memoire: error: {exc}; {note}")
        return EXIT_PHASE
    if result is None:  # a tensor-parallel rank other than 0: rank 0 reports for all
        return EXIT_OK
    if getattr(args, "format", "json") == "table":
        print(TABLES[args.command](result))
    else:
        print(json.dumps(result, indent=2))
    if args.command == "compare" and args.fail_on_difference and not result["allocated_exact"]:
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
