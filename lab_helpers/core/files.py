"""Files: paths as the user gave them, exclusive whole-or-nothing writers, the one bounded reader (JSON or text), CSV text."""
import csv
import io
import json
import math
import numbers
import os
import re
import stat
import tempfile
import time
from pathlib import Path

from lab_helpers.core.errors import LabError
from lab_helpers.core.text import printable


MAX_MEASUREMENT_FILE_BYTES = 64 * 2**20  # a real measurement file is a few KiB


MAX_JSON_DEPTH = 32  # a measurement nests 4 levels deep; more is not a measurement


SCHEMA_VERSION = 1  # of every document the lab writes: a measurement, a timeline, an out-of-memory file


def display_path(path) -> str:
    """The path as the user gave it if relative, relative to the cwd when it lies under it; a newline,
    an escape sequence or an undecodable byte in it spelled out (\\n, \\x1b, \\udcff), so a message
    naming it stays one line and writes nothing raw to a terminal. Ordinary paths are unchanged."""
    return printable(_shown_path(os.fspath(path)))


def _shown_path(text: str) -> str:
    if not os.path.isabs(text):
        return text
    try:
        relative = os.path.relpath(text)
    except (ValueError, OSError):  # another drive on Windows; a cwd that was removed
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


def _read_bounded(path, max_bytes: int, refuse) -> bytes:
    """Return the bytes of the regular file at `path`, at most `max_bytes`: opened without blocking (so a
    FIFO or a device is refused, never read), its size checked before reading, never more than
    max_bytes + 1 bytes read even if the file grows. Each fault raises `refuse(fault, detail)`, the
    caller's error: fault "open" (detail: the OSError, or the ValueError of a path holding NUL),
    "folder", "special" (a FIFO, socket or device), "size" (st_size), "read" (the OSError) or
    "grown" (the bytes read, over the bound)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except (OSError, ValueError) as exc:
        raise refuse("open", exc) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise refuse("folder", None)
        if not stat.S_ISREG(info.st_mode):
            raise refuse("special", None)
        if info.st_size > max_bytes:
            raise refuse("size", info.st_size)
        # ask the OS for what the file holds, not for the bound: a bound of 1 TiB must not allocate it
        wanted = min(info.st_size, max_bytes) + 1
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(wanted, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise refuse("read", exc) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:  # the file grew after fstat
        raise refuse("grown", len(data))
    return data


def open_regular_file(path):
    """Open the regular file at `path` for reading in binary (for a reader that streams it in chunks);
    OSError if it is anything else. Opened without blocking, so a FIFO is refused, never waited on."""
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError("not a regular file")
    return os.fdopen(fd, "rb")


def read_bounded_bytes(path, max_bytes: int, what: str, shown=None) -> bytes:
    """Return the bytes of the regular file at `path`, at most `max_bytes` long.

    Faults raise LabError naming the file as `shown` (default: `path` as given) and the file as a
    `what` ("rate card"): a missing or unreadable path, a folder, a pipe or device (opened without
    blocking, never read), a file over `max_bytes` (checked before reading)."""
    shown = printable(path if shown is None else shown)

    def refuse(fault, detail):
        if fault == "open" and isinstance(detail, ValueError):
            return LabError(f"{shown}: cannot read the {what} (the path holds a NUL character)")
        if fault in ("open", "read"):
            return LabError(f"{shown}: cannot read the {what} ({detail.strerror or detail})")
        if fault == "folder":
            return LabError(f"{shown}: is a folder, not a {what} file")
        if fault == "special":
            return LabError(f"{shown}: is not a regular file (a pipe, socket or device); give the {what} as a file")
        if fault == "size":
            return LabError(f"{shown}: is {detail} bytes, over the {max_bytes}-byte limit for a {what}")
        return LabError(f"{shown}: is over the {max_bytes}-byte limit for a {what}")

    return _read_bounded(path, max_bytes, refuse)


def read_bounded_text(path, max_bytes: int, what: str, shown=None) -> str:
    """Return the UTF-8 text (a BOM allowed) of the regular file at `path`, at most `max_bytes` long:
    read_bounded_bytes, then UTF-16, binary (a NUL byte) and non-UTF-8 data refused, naming the line.
    Faults raise LabError naming the file as `shown` (default: `path` as given)."""
    shown = printable(path if shown is None else shown)
    return _utf8_text(read_bounded_bytes(path, max_bytes, what, shown), shown, what)


def _utf8_text(data: bytes, shown: str, what: str) -> str:
    """Return `data` decoded as UTF-8 (BOM allowed); refuse UTF-16 and binary data."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise LabError(f"{shown}, line 1: the {what} is UTF-16 text; save it as UTF-8")
    if b"\x00" in data:
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise LabError(f"{shown}, line {line}: binary data (a NUL byte), not a CSV {what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise LabError(f"{shown}, line {line}: not UTF-8 text (byte {exc.start})") from None


def read_json_file(path, max_bytes: int = MAX_MEASUREMENT_FILE_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """Parse the JSON file at `path` with bounds: a regular file (a FIFO or device is refused without
    blocking), at most `max_bytes`, UTF-8, nesting at most `max_depth`, no NaN or infinities.
    Raise LabError naming `path` as given."""
    shown = display_path(path)

    def refuse(fault, detail):
        if fault == "open" and isinstance(detail, ValueError):
            return LabError(f"cannot read {shown}: the path holds a NUL character")
        if fault == "open":
            return LabError(f"cannot read {shown}: {'no such file' if detail.errno == 2 else _os_problem(detail)}")
        if fault == "read":
            return LabError(f"cannot read {shown}: {_os_problem(detail)}")
        if fault == "folder":
            return LabError(f"cannot read {shown}: it is a folder")
        if fault == "special":
            return LabError(f"cannot read {shown}: not a regular file")
        if fault == "size":
            return LabError(f"{shown}: {detail} bytes; a measurement file holds at most {max_bytes} bytes")
        return LabError(f"{shown}: more than {max_bytes} bytes; a measurement file holds at most that")

    data = _read_bounded(path, max_bytes, refuse)
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


def new_file_name(folder, stem: str, suffix: str = ".json") -> Path:
    """Return a path in `folder` named after `stem` and the time that no file takes yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        candidate = Path(folder) / f"{stem}-{stamp}{'' if n == 0 else f'-{n}'}{suffix}"
        if not candidate.exists():
            return candidate
    raise LabError(f"no free file name for {stem} in {folder}")


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
