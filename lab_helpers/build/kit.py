"""Builds and verifies the one-zip distribution kit (dist/iteragpu-lab-v1.zip).

    python -m lab_helpers.kit build [--output PATH] [--force]   # make kit
    python -m lab_helpers.kit verify PATH                        # make verify-kit KIT=PATH
"""
import hashlib
import io
import json
import os
import stat
import sys
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from lab_helpers.build.strip import committed_form
from lab_helpers.core.cli import Command, Program, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_FAILURE, EXIT_OK, LabError
from lab_helpers.core.files import open_regular_file, replace_bytes, write_new_bytes
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.core.text import printable

PROG = "kit"
ROOT = REPOSITORY
KIT_NAME = "iteragpu-lab-v1"
DEFAULT_OUTPUT = Path("dist") / f"{KIT_NAME}.zip"
MANIFEST = "MANIFEST.json"
NOTEBOOK = "mesure-memoire.ipynb"
# Kit member name -> the repo file it is copied from, byte for byte.
MEMBERS = {
    NOTEBOOK: "notebooks/mesure-memoire.ipynb",
    "mesure_memoire.py": "lab_helpers/mesure_memoire.py",
    "protocole-qualite.md": "data/protocole-qualite.md",
    "resultats-bruts.csv": "data/resultats-bruts.csv",
    "tarifs-forfaits.csv": "data/tarifs-forfaits.csv",
    "calcul_forfaits.py": "lab_helpers/calcul_forfaits.py",
    "LICENSE.txt": "LICENSE.txt",
    "README.md": "lab_helpers/kit_readme.md",
}
KIT_FILES = frozenset(MEMBERS) | {MANIFEST}
MANIFEST_NOTE = "MANIFEST.json carries no fingerprint of itself; it lists the eight other files."
FORMAT_VERSION = 1
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
FILE_MODE = stat.S_IFREG | 0o644
# verify never reads more than a file's declared size + 1 byte, in chunks of this size, so
# memory stays bounded whatever a member inflates to.
READ_CHUNK_BYTES = 1024 * 1024
MAX_MANIFEST_BYTES = 1024 * 1024  # the real one is ~1 KiB
MAX_MEMBER_BYTES = 64 * 1024 * 1024  # the largest kit file is well under 1 MiB
MAX_SOURCE_BYTES = MAX_MEMBER_BYTES
MAX_ZIP_MEMBERS = 1000  # a kit has nine
MAX_LISTED_PROBLEMS = 20  # per kind of problem; the rest is counted on one line
ZIP_ENCRYPTED_FLAG = 0x1
READABLE_COMPRESSION = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
NOTEBOOK_FORMAT = 4
CELL_TYPES = ("code", "markdown", "raw")
# what reading a damaged or hostile member can raise; zlib.error is a corrupt deflate stream
READ_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile, NotImplementedError,
               RuntimeError, zlib.error)


class KitError(LabError):
    """A refusal of the build or a usage error: the dispatcher prints it on one line, exit 2."""


def sha256_hex(data: bytes) -> str:
    """Return the SHA-256 of `data` in hex."""
    return hashlib.sha256(data).hexdigest()


def _notebook_fault(notebook) -> str:
    """Return why `notebook` (parsed JSON) is not an nbformat 4 notebook, or ''."""
    if not isinstance(notebook, dict):
        return f"the top level is a JSON {type(notebook).__name__}, not an object"
    if notebook.get("nbformat") != NOTEBOOK_FORMAT or type(notebook.get("nbformat")) is not int:
        return (f"nbformat is {printable(repr(notebook.get('nbformat')))[:40]}, "
                f"not {NOTEBOOK_FORMAT}")
    if type(notebook.get("nbformat_minor")) is not int:
        return "nbformat_minor is missing or not a whole number"
    if not isinstance(notebook.get("metadata"), dict):
        return "metadata is missing or not an object"
    cells = notebook.get("cells")
    if not isinstance(cells, list):
        return "cells is missing or not a list"
    for index, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict):
            return f"cell {index} is not an object"
        if cell.get("cell_type") not in CELL_TYPES:
            return f"cell {index} has no cell_type among {', '.join(CELL_TYPES)}"
        source = cell.get("source")
        if not (isinstance(source, str) or
                (isinstance(source, list) and all(isinstance(s, str) for s in source))):
            return f"cell {index} source is not text"
        if not isinstance(cell.get("metadata", {}), dict):
            return f"cell {index} metadata is not an object"
    return ""


def check_notebook(data: bytes, source: str) -> None:
    """Raise KitError unless the notebook is nbformat 4 JSON without outputs or counts."""
    try:
        notebook = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        reason = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else "not JSON"
        raise KitError(f"refusing to package {source}: not a readable notebook ({reason})") from None
    fault = _notebook_fault(notebook)
    if fault:
        raise KitError(f"refusing to package {source}: not an nbformat {NOTEBOOK_FORMAT} "
                       f"notebook ({fault})")
    for index, cell in enumerate(notebook["cells"], start=1):
        if cell.get("outputs") or cell.get("execution_count") is not None:
            raise KitError(
                f"refusing to package {source}: cell {index} has outputs or an execution count;"
                " clear them (jupyter nbconvert --clear-output --inplace) and build again")


def read_sources(root: Path) -> dict:
    """Return member name -> bytes of the eight content files taken from the repo at `root`."""
    contents = {}
    for member, source in MEMBERS.items():
        path = Path(root) / source
        if not path.is_file():  # also refuses a folder or a pipe in the file's place
            raise KitError(f"cannot build the kit: {source} is missing or not a regular file")
        if path.stat().st_size > MAX_SOURCE_BYTES:
            raise KitError(f"cannot build the kit: {source} is over {MAX_SOURCE_BYTES} bytes")
        try:
            contents[member] = path.read_bytes()
        except OSError as exc:
            raise KitError(f"cannot build the kit: cannot read {source} "
                           f"({exc.strerror or exc})") from None
    contents[NOTEBOOK] = committed_form(contents[NOTEBOOK])  # outputs stay in the working copy
    check_notebook(contents[NOTEBOOK], MEMBERS[NOTEBOOK])
    return contents


def manifest_bytes(contents: dict) -> bytes:
    """Return the deterministic MANIFEST.json for the member name -> bytes mapping."""
    files = {name: {"sha256": sha256_hex(data), "size_bytes": len(data)}
             for name, data in contents.items()}
    files[MANIFEST] = {"note": MANIFEST_NOTE}
    manifest = {"format_version": FORMAT_VERSION, "kit": KIT_NAME, "files": files}
    text = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return text.encode("utf-8")


def kit_bytes(root: Path = ROOT) -> bytes:
    """Return the kit zip as bytes: nine files under KIT_NAME/, fixed dates, modes and order."""
    contents = read_sources(root)
    contents[MANIFEST] = manifest_bytes(contents)
    buffer = io.BytesIO()
    # Stored, not deflated: the bytes then depend on no zlib build, so any host rebuilds them.
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(contents):
            info = zipfile.ZipInfo(f"{KIT_NAME}/{name}", date_time=ZIP_DATE)
            info.create_system = 3  # Unix, so the mode below is honoured
            info.external_attr = FILE_MODE << 16
            archive.writestr(info, contents[name])
    return buffer.getvalue()


def _same_bytes(path: Path, data: bytes) -> bool:
    """True when the regular file at `path` holds exactly `data` (read at most len + 1 bytes)."""
    with path.open("rb") as handle:
        return handle.read(len(data) + 1) == data


def _relative_to_cwd(path) -> str:
    """Return `path` relative to the current folder, or as is where that is impossible."""
    try:
        return os.path.relpath(path)
    except (ValueError, OSError):  # another drive, or the current folder was deleted
        return os.fspath(path)


def _shown_path(path, given: bool) -> str:
    """Return `path` as the user typed it, or (a default) relative to the current folder."""
    return printable(os.fspath(path) if given else _relative_to_cwd(path))


def build_kit(root: Path = ROOT, output: Path = None, force: bool = False) -> tuple:
    """Write the kit to `output` atomically; return (path, changed). Raise KitError on refusal."""
    given = output is not None
    output = Path(output) if given else Path(root) / DEFAULT_OUTPUT
    shown = _shown_path(output, given)
    data = kit_bytes(root)
    if output.is_dir():
        raise KitError(f"{shown} is a folder; give the zip's file name")
    if os.path.lexists(output):
        if not output.is_file() or output.is_symlink():
            raise KitError(f"{shown} exists and is not a regular file; refusing to replace it")
        if _same_bytes(output, data):
            return output, False
        if not force:
            raise KitError(f"{shown} exists and differs from this build; --force replaces it")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KitError(f"cannot write {shown} ({exc.strerror or exc})") from None
    # the lab's writers; a default output goes relative, as their errors show it
    target = output if given else Path(_relative_to_cwd(output))
    try:
        if os.path.lexists(output):  # only with --force, checked above
            replace_bytes(target, data)
        else:
            write_new_bytes(target, data)
    except LabError as exc:  # the path in the writer's message is the user's: made printable here
        raise KitError(printable(str(exc))) from None
    return output, True


def unsafe_reason(name: str):
    """Return why a zip member name is unsafe, or None."""
    if "\x00" in name:
        return "name holds a NUL character"
    if not name.isprintable():
        return "name holds control characters"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if "\\" in name:
        return "unsafe path (backslash in the name)"
    if ".." in PurePosixPath(name).parts:
        return "unsafe path ('..' in the path)"
    if not name.startswith(f"{KIT_NAME}/"):
        return f"outside the single folder {KIT_NAME}/"
    return None


def _member_fault(info: zipfile.ZipInfo):
    """Return why a zip member cannot be a kit file (unsafe name, link, encrypted...), or None."""
    reason = unsafe_reason(info.orig_filename)  # orig_filename keeps what follows a NUL
    if reason:
        return f"member {reason}"
    if stat.S_ISLNK(info.external_attr >> 16):
        return "member is a link, not a file"
    if info.flag_bits & ZIP_ENCRYPTED_FLAG:
        return "member is encrypted; a kit is never encrypted"
    if info.compress_type not in READABLE_COMPRESSION:
        return (f"member uses compression method {info.compress_type}; "
                f"only {' or '.join(READABLE_COMPRESSION.values())} is read")
    return None


def zip_files(archive: zipfile.ZipFile, problems: list) -> dict:
    """Map each safe file of the open zip to an opener of its bytes; unsafe members are problems."""
    files = {}
    infos = archive.infolist()
    if len(infos) > MAX_ZIP_MEMBERS:
        problems.append(f"the zip holds {len(infos)} members; a kit holds {len(KIT_FILES)} "
                        f"(over {MAX_ZIP_MEMBERS}: not read)")
        return files
    for info in infos:
        name = info.filename[len(KIT_NAME) + 1:]
        fault = _member_fault(info)
        if fault:
            problems.append(f"{printable(info.orig_filename)}: {fault}")
        elif name in files:
            problems.append(f"{printable(info.filename)}: member appears twice")
        elif not info.is_dir():
            files[name] = lambda info=info: archive.open(info)
    return files


def folder_files(path: Path, problems: list) -> dict:
    """Map each file under the extracted folder to an opener of its bytes; links are problems."""
    files = {}
    for folder, dirs, names in os.walk(path):  # never follows links
        for entry_name in sorted(dirs + names):
            entry = Path(folder) / entry_name
            name = printable(entry.relative_to(path).as_posix())
            if entry.is_symlink():
                problems.append(f"{name}: is a link, not a file")
            elif entry_name in names:
                if entry.is_file():
                    files[name] = lambda entry=entry: open_regular_file(entry)
                else:
                    problems.append(f"{name}: is not a regular file (a pipe, socket or device)")
        dirs[:] = sorted(d for d in dirs if not (Path(folder) / d).is_symlink())
    return files


def _bounded_chunks(opener, limit: int):
    """Yield the chunks (at most READ_CHUNK_BYTES each) of the first `limit` bytes of `opener()`."""
    size = 0
    with opener() as handle:
        while size < limit:
            chunk = handle.read(min(READ_CHUNK_BYTES, limit - size))
            if not chunk:
                return
            size += len(chunk)
            yield chunk


def read_bounded(opener, limit: int) -> bytes:
    """Return at most `limit` bytes read through `opener()`, in chunks of READ_CHUNK_BYTES."""
    return b"".join(_bounded_chunks(opener, limit))


def digest_bounded(opener, limit: int) -> tuple:
    """Return (bytes read, sha256 hex) of at most `limit` bytes, never holding more than a chunk."""
    digest, size = hashlib.sha256(), 0
    for chunk in _bounded_chunks(opener, limit):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def parse_manifest(data: bytes) -> dict:
    """Return the manifest's files table; raise ValueError if it does not parse or is malformed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"over {MAX_MANIFEST_BYTES} bytes")
    try:
        files = json.loads(data.decode("utf-8"))["files"]
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(files, dict):
        raise ValueError("files is not an object")
    for name in set(files) & set(MEMBERS):  # names that are no kit file are reported, not read
        entry = files[name]
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or type(entry.get("size_bytes")) is not int or entry["size_bytes"] < 0:
            raise ValueError(f"entry {name!r} lacks sha256 or a size_bytes >= 0")
    return files


def verify_kit(path: Path) -> list:
    """Return the problems found checking a kit zip or extracted folder against its manifest."""
    path = Path(path)
    shown = printable(os.fspath(path))
    if not os.path.lexists(path):
        raise KitError(f"{shown}: no such file or folder")
    if path.is_dir() and not (path / MANIFEST).exists() and (path / KIT_NAME).is_dir():
        path = path / KIT_NAME
    problems = []
    if path.is_dir():
        return check_files(folder_files(path, problems), problems)
    try:
        handle = open_regular_file(path)
    except OSError as exc:
        return [f"{shown}: not a readable zip archive ({exc.strerror or exc})"]
    try:
        with handle, zipfile.ZipFile(handle) as archive:
            return check_files(zip_files(archive, problems), problems)
    except (zipfile.LargeZipFile,) + READ_ERRORS as exc:
        return problems + [f"{shown}: not a readable zip archive ({printable(exc)[:200]})"]


def _capped(lines: list, what: str) -> list:
    """Return at most MAX_LISTED_PROBLEMS of `lines`, then one line counting the rest."""
    if len(lines) <= MAX_LISTED_PROBLEMS:
        return lines
    rest = len(lines) - MAX_LISTED_PROBLEMS
    return lines[:MAX_LISTED_PROBLEMS] + [f"... and {rest} more {what}"]


def check_files(files: dict, problems: list) -> list:
    """Return `problems` plus every difference between the openers in `files` and the manifest."""
    if MANIFEST not in files:
        return problems + [f"{MANIFEST}: missing"]
    try:
        manifest = parse_manifest(read_bounded(files[MANIFEST], MAX_MANIFEST_BYTES + 1))
    except (KeyError, TypeError, AttributeError) + READ_ERRORS as exc:
        reason = printable(str(exc))[:200]
        return problems + [f"{MANIFEST}: does not parse or is malformed ({reason})"]
    for name in sorted(KIT_FILES - set(manifest)):
        problems.append(f"{name}: not listed in {MANIFEST}, which must list all {len(KIT_FILES)}")
    problems += _capped([f"{printable(name)}: listed in {MANIFEST} but not a file of {KIT_NAME}"
                         for name in sorted(set(manifest) - KIT_FILES)], "names listed")
    problems += _capped([f"{name}: extra file, not listed in {MANIFEST}"
                         for name in sorted(set(files) - set(manifest))], "extra files")
    for name in sorted(set(manifest) & set(MEMBERS)):
        expected = manifest[name]["size_bytes"]
        if name not in files:
            problems.append(f"{name}: missing")
            continue
        if expected > MAX_MEMBER_BYTES:
            problems.append(f"{name}: {MANIFEST} gives {expected} bytes, over the "
                            f"{MAX_MEMBER_BYTES}-byte limit for a kit file; not read")
            continue
        try:  # one byte past the manifest's size is enough to see a file is longer
            size, digest = digest_bounded(files[name], expected + 1)
        except READ_ERRORS as exc:
            problems.append(f"{name}: unreadable ({printable(str(exc))[:200]})")
            continue
        if size < expected:
            problems.append(f"{name}: truncated: {size} bytes, {MANIFEST} says {expected}")
        elif size > expected:
            problems.append(f"{name}: size differs: over the {expected} bytes {MANIFEST} gives")
        elif digest != manifest[name]["sha256"]:
            problems.append(f"{name}: changed: its sha256 differs from {MANIFEST}")
    return problems


def add_build_arguments(parser) -> None:
    parser.add_argument("--output", metavar="PATH",
                        help=f"where to write the zip, folders created (default: "
                             f"{DEFAULT_OUTPUT} in the repo)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output whose bytes differ from this build")
    parser.add_argument("--root", metavar="FOLDER", default=None,
                        help="repo root the files are taken from (default: this repo)")


def add_verify_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH",
                        help=f"the kit zip, or the extracted folder .../{KIT_NAME}")


def refuse_empty_paths(args, flags) -> None:
    """An empty path is a usage error, worded as argparse words its own."""
    for flag, attribute in flags:
        if getattr(args, attribute) == "":
            raise KitError(f"argument {flag}: the path is empty")


def handle_build(args) -> int:
    refuse_empty_paths(args, (("--output", "output"), ("--root", "root")))
    given = args.output is not None
    try:
        output, changed = build_kit(Path(args.root) if args.root else ROOT,
                                    Path(args.output) if given else None, args.force)
        data = output.read_bytes()
    except OSError as exc:
        raise KitError(exc.strerror or printable(exc)) from None
    # printed once the kit is written: a closed stdout is no kit error
    state = "wrote" if changed else "unchanged (identical bytes):"
    print(f"{state} {_shown_path(output, given)} ({len(KIT_FILES)} files, "
          f"{len(data)} bytes, sha256 {sha256_hex(data)})")
    return EXIT_OK


def handle_verify(args) -> int:
    refuse_empty_paths(args, (("PATH", "path"),))
    try:
        problems = verify_kit(args.path)
    except OSError as exc:
        raise KitError(exc.strerror or printable(exc)) from None
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if problems:
        return EXIT_FAILURE
    print(f"OK: {len(KIT_FILES)} files match {MANIFEST} ({printable(args.path)})")
    return EXIT_OK


PROGRAM = Program(
    prog=PROG,
    description=__doc__.splitlines()[0],
    commands=(
        Command("build", "write the kit zip from the repo's own files (whole or not at all)", add_build_arguments, handle_build,
                "python -m lab_helpers.kit build --output dist/iteragpu-lab-v1.zip"),
        Command("verify", f"check a kit zip or extracted folder against its {MANIFEST} (FAIL lines, exit 1)", add_verify_arguments, handle_verify,
                "python -m lab_helpers.kit verify dist/iteragpu-lab-v1.zip"),
    ),
)


def build_parser():
    """Return the command-line parser."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Run the `build` or `verify` subcommand; return the exit status."""
    return run(PROGRAM, argv)


if __name__ == "__main__":
    sys.exit(main())
