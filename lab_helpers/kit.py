"""Builds and verifies the one-zip distribution kit (dist/iteragpu-lab-v1.zip).

    python -m lab_helpers.kit build [--output PATH] [--force]   # make kit
    python -m lab_helpers.kit verify PATH                        # make verify-kit KIT=PATH
"""
import argparse
import hashlib
import io
import json
import os
import stat
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from lab_helpers.notebook_strip import committed_form

ROOT = Path(__file__).resolve().parent.parent
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
MAX_MANIFEST_BYTES = 1024 * 1024  # verify reads at most this much of a manifest


class KitError(Exception):
    """A refusal of the build or a usage error: main prints it on one line, exit 2."""


def sha256_hex(data: bytes) -> str:
    """Return the SHA-256 of `data` in hex."""
    return hashlib.sha256(data).hexdigest()


def check_notebook(data: bytes, source: str) -> None:
    """Raise KitError if the notebook does not parse or has outputs or execution counts."""
    try:
        cells = json.loads(data.decode("utf-8"))["cells"]
    except (ValueError, KeyError, TypeError) as exc:
        raise KitError(f"refusing to package {source}: not a readable notebook ({exc})") from None
    for index, cell in enumerate(cells, start=1):
        if cell.get("outputs") or cell.get("execution_count") is not None:
            raise KitError(
                f"refusing to package {source}: cell {index} has outputs or an execution count;"
                " clear them (jupyter nbconvert --clear-output --inplace) and build again")


def read_sources(root: Path) -> dict:
    """Return member name -> bytes of the eight content files taken from the repo at `root`."""
    contents = {}
    for member, source in MEMBERS.items():
        path = Path(root) / source
        if not path.is_file():
            raise KitError(f"cannot build the kit: {source} is missing")
        contents[member] = path.read_bytes()
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


def build_kit(root: Path = ROOT, output: Path = None, force: bool = False) -> tuple:
    """Write the kit to `output` atomically; return (path, changed). Raise KitError on refusal."""
    output = Path(output) if output is not None else Path(root) / DEFAULT_OUTPUT
    data = kit_bytes(root)
    if output.exists():
        if output.is_file() and output.read_bytes() == data:
            return output, False
        if not force:
            raise KitError(f"{output} exists and differs from this build; --force replaces it")
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return output, True


def unsafe_reason(name: str):
    """Return why a zip member name is unsafe (absolute, '..', outside KIT_NAME/), or None."""
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if "\\" in name or ".." in PurePosixPath(name).parts:
        return "unsafe path ('..' or backslash)"
    if not name.startswith(f"{KIT_NAME}/"):
        return f"outside the single folder {KIT_NAME}/"
    return None


def zip_files(archive: zipfile.ZipFile, problems: list) -> dict:
    """Map each safe file of the open zip to a loader of its bytes; unsafe members are problems."""
    files = {}
    for info in archive.infolist():
        name = info.filename[len(KIT_NAME) + 1:]
        reason = unsafe_reason(info.filename)
        if reason:
            problems.append(f"{info.filename}: member {reason}")
        elif stat.S_ISLNK(info.external_attr >> 16):
            problems.append(f"{info.filename}: member is a link, not a file")
        elif name in files:
            problems.append(f"{info.filename}: member appears twice")
        elif not info.is_dir():
            files[name] = lambda limit, info=info: read_limited(archive.open(info), limit)
    return files


def read_limited(handle, limit: int) -> bytes:
    """Return at most `limit` bytes from the open binary `handle`, then close it."""
    with handle:
        return handle.read(limit)


def folder_files(path: Path, problems: list) -> dict:
    """Map each file under the extracted folder to a loader of its bytes; links are problems."""
    files = {}
    for entry in sorted(path.rglob("*")):
        name = entry.relative_to(path).as_posix()
        if entry.is_symlink():
            problems.append(f"{name}: is a link, not a file")
        elif entry.is_file():
            files[name] = lambda limit, entry=entry: read_limited(entry.open("rb"), limit)
    return files


def parse_manifest(data: bytes) -> dict:
    """Return the manifest's files table; raise ValueError if it does not parse or is malformed."""
    files = json.loads(data.decode("utf-8"))["files"]
    for name in set(files) & set(MEMBERS):  # names that are no kit file are reported, not read
        entry = files[name]
        if not isinstance(entry.get("sha256"), str) or type(entry.get("size_bytes")) is not int:
            raise ValueError(f"entry {name!r} lacks sha256 or size_bytes")
    return files


def verify_kit(path: Path) -> list:
    """Return the problems found checking a kit zip or extracted folder against its manifest."""
    path = Path(path)
    if not path.exists():
        raise KitError(f"{path}: no such file or folder")
    if path.is_dir() and not (path / MANIFEST).exists() and (path / KIT_NAME).is_dir():
        path = path / KIT_NAME
    problems = []
    if path.is_dir():
        return check_files(folder_files(path, problems), problems)
    try:
        with zipfile.ZipFile(path) as archive:
            return check_files(zip_files(archive, problems), problems)
    except (zipfile.BadZipFile, OSError) as exc:
        return [f"{path}: not a readable zip archive ({exc})"]


def check_files(files: dict, problems: list) -> list:
    """Return `problems` plus every difference between the loaders in `files` and the manifest."""
    if MANIFEST not in files:
        return problems + [f"{MANIFEST}: missing"]
    try:
        manifest = parse_manifest(files[MANIFEST](MAX_MANIFEST_BYTES))
    except (ValueError, KeyError, TypeError, AttributeError, OSError, zipfile.BadZipFile) as exc:
        return problems + [f"{MANIFEST}: does not parse or is malformed ({exc})"]
    for name in sorted(KIT_FILES - set(manifest)):
        problems.append(f"{name}: not listed in {MANIFEST}, which must list all {len(KIT_FILES)}")
    for name in sorted(set(manifest) - KIT_FILES):
        problems.append(f"{name}: listed in {MANIFEST} but not a file of {KIT_NAME}")
    for name in sorted(set(files) - set(manifest)):
        problems.append(f"{name}: extra file, not listed in {MANIFEST}")
    for name in sorted(set(manifest) & set(MEMBERS)):
        entry = manifest[name]
        if name not in files:
            problems.append(f"{name}: missing")
            continue
        expected = entry["size_bytes"]
        try:  # one byte past the manifest's size is enough to see a file is longer
            data = files[name](max(expected, 0) + 1)
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            problems.append(f"{name}: unreadable ({exc})")
            continue
        if len(data) < expected:
            problems.append(f"{name}: truncated: {len(data)} bytes, {MANIFEST} says {expected}")
        elif len(data) > expected:
            problems.append(f"{name}: size differs: over the {expected} bytes {MANIFEST} gives")
        elif sha256_hex(data) != entry["sha256"]:
            problems.append(f"{name}: changed: its sha256 differs from {MANIFEST}")
    return problems


def main(argv=None) -> int:
    """Run the `build` or `verify` subcommand; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lab_helpers.kit",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write the kit zip from the repo's own files")
    build.add_argument("--output", type=Path,
                       help=f"where to write the zip (default: <root>/{DEFAULT_OUTPUT})")
    build.add_argument("--force", action="store_true",
                       help="replace an existing output whose bytes differ from this build")
    build.add_argument("--root", type=Path, default=ROOT,
                       help="repo root the files are taken from (default: this repo)")
    verify = commands.add_parser("verify", help=f"check a kit against its {MANIFEST}")
    verify.add_argument("path", type=Path,
                        help=f"the kit zip, or the extracted folder .../{KIT_NAME}")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            output, changed = build_kit(args.root, args.output, args.force)
            data = output.read_bytes()
            state = "wrote" if changed else "unchanged (identical bytes):"
            print(f"{state} {output} ({len(KIT_FILES)} files, {len(data)} bytes,"
                  f" sha256 {sha256_hex(data)})")
            return 0
        problems = verify_kit(args.path)
    except (KitError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"OK: {len(KIT_FILES)} files match {MANIFEST} ({args.path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
