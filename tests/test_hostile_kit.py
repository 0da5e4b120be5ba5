"""Hostile kits for `kit verify` and hostile notebooks and paths for `kit build`.

`verify` on a bad kit: exit 1, one or more `FAIL` lines on stderr (one of them naming the
fault), nothing on stdout, no traceback, nothing extracted or changed in the folder, within
a time bound; the zip bomb within 10 s and with bounded memory. `build` on bad input: exit 2,
exactly one `kit: error: ...` line, no zip and no temporary file left."""
import errno
import io
import json
import os
import stat
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest

from lab_helpers.build.kit import (KIT_NAME, KitError, MANIFEST, MAX_MANIFEST_BYTES, MEMBERS, NOTEBOOK,
                                  READ_CHUNK_BYTES, ZIP_ENCRYPTED_FLAG, build_kit, verify_kit)
from conftest import run_main_in_process
from lab_helpers.build.kit import main as kit_main
from test_hostile_forfaits import snapshot  # every path under a folder, to show nothing changed

ROOT = Path(__file__).resolve().parent.parent
PREFIX = KIT_NAME + "/"
# A refusal takes well under a second on an idle machine; the bounds guard against a hang (a wait on a
# FIFO, a retry loop) and, for the bomb, against inflating its 2 GiB (the memory check below is the
# load-independent measure), not against slowness: generous, so a machine under load passes too.
TIME_LIMIT_SECONDS = 60.0
BOMB_TIME_LIMIT_SECONDS = 60.0
BOMB_BYTES = 2 * 1024**3
BOMB_MEMORY_LIMIT_KIB = 64 * 1024  # ru_maxrss is in KiB on Linux; verify needs ~25 MiB
CHUNK = bytes(1024 * 1024)
CLEAN_NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
               "source": "x = 1"}],
    "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
}
LOCAL_HEADER, CENTRAL_HEADER = b"PK\x03\x04", b"PK\x01\x02"


def fake_tree(root: Path) -> Path:
    """A minimal repo tree holding every file the kit packages."""
    for member, source in MEMBERS.items():
        path = root / source
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"contents of {member}\n", encoding="utf-8")
    (root / MEMBERS[NOTEBOOK]).write_text(json.dumps(CLEAN_NOTEBOOK), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def good_members(tmp_path_factory):
    """Member name -> bytes of a kit built from a fake tree."""
    folder = tmp_path_factory.mktemp("good")
    path, _ = build_kit(fake_tree(folder / "repo"), folder / "kit.zip")
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def zip_bytes(members: dict, compression=zipfile.ZIP_STORED) -> bytes:
    """A zip of `members` (name -> bytes), names taken literally."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = compression
            archive.writestr(info, data)
    return buffer.getvalue()


def patch_headers(data: bytes, name: str, flag_bits=0, method=None, new_name=None,
                  local_only=False) -> bytes:
    """Return the zip `data` with member `name`'s local and central headers changed: flag bits
    OR-ed in, compression method set, name bytes replaced (same length)."""
    raw = bytearray(data)
    encoded = name.encode("utf-8")
    headers = ((LOCAL_HEADER, 6, 30),) if local_only else ((LOCAL_HEADER, 6, 30),
                                                           (CENTRAL_HEADER, 8, 46))
    for signature, flags_at, name_at in headers:
        start = 0
        while (start := raw.find(signature, start)) >= 0:
            if raw[start + name_at:start + name_at + len(encoded)] == encoded:
                flags, = struct.unpack_from("<H", raw, start + flags_at)
                struct.pack_into("<H", raw, start + flags_at, flags | flag_bits)
                if method is not None:
                    struct.pack_into("<H", raw, start + flags_at + 2, method)
                if new_name is not None:
                    raw[start + name_at:start + name_at + len(encoded)] = new_name
            start += 4
    return bytes(raw)


def with_manifest(members: dict, **entries) -> dict:
    """A copy of `members` whose manifest has the given file entries replaced."""
    manifest = json.loads(members[PREFIX + MANIFEST])
    manifest["files"].update(entries)
    return {**members, PREFIX + MANIFEST: json.dumps(manifest).encode()}


def manifest_entry(members: dict, name: str, **changes) -> dict:
    """A copy of `members` with one manifest entry's fields changed."""
    manifest = json.loads(members[PREFIX + MANIFEST])
    manifest["files"][name].update(changes)
    return {**members, PREFIX + MANIFEST: json.dumps(manifest).encode()}


def raw_manifest(members: dict, data: bytes) -> dict:
    return {**members, PREFIX + MANIFEST: data}


SUBPROCESS_EVERY = 12  # one row in twelve of a table also runs as a fresh Python (the rest in-process)


def in_subprocess(table, case: str) -> bool:
    return sorted(table).index(case) % SUBPROCESS_EVERY == 0


def run_kit(args, cwd: Path, limit=TIME_LIMIT_SECONDS, in_process=False):
    """Run `python -m lab_helpers.kit ARGS` in `cwd` (in a fresh Python, or with `in_process` in this
    one, unless the folder holds a FIFO: its timeout guards a hang); check time and folder; return it."""
    before = snapshot(cwd)
    in_process = in_process and not any(stat.S_ISFIFO(mode) for mode, *_ in before.values())
    if in_process:
        proc = run_main_in_process(kit_main, list(map(str, args)), cwd)
    else:
        proc = subprocess.run([sys.executable, "-m", "lab_helpers.kit", *map(str, args)], cwd=cwd,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(cwd) == before, "the command created or changed a file"
    return proc


def assert_fails(proc, *needles):
    """Exit 1, no stdout, every stderr line a FAIL line, one holding every needle."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("FAIL ") for line in lines), proc.stderr
    assert any(all(needle in line for needle in needles) for line in lines), (needles, lines)


def assert_usage_error(proc, *needles):
    """Exit 2, no stdout, exactly one `kit: error:` line holding every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kit: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# --- hostile zips --------------------------------------------------------------------

def _encrypted(m):
    return patch_headers(zip_bytes(m), PREFIX + "README.md", flag_bits=ZIP_ENCRYPTED_FLAG)


def _unknown_method(m):
    return patch_headers(zip_bytes(m), PREFIX + "README.md", method=77)


def _nul_name(m):
    placeholder = PREFIX + "README.mdXevil"
    data = zip_bytes({**m, placeholder: b"x"})
    return patch_headers(data, placeholder, new_name=(PREFIX + "README.md\x00evil").encode())


def _other_local_name(m):
    return patch_headers(zip_bytes(m), PREFIX + "LICENSE.txt",
                         new_name=(PREFIX + "LICENSE.txx").encode(), local_only=True)


def _truncated(m):
    data = zip_bytes(m)
    return data[: len(data) // 2]


def _deep_manifest(m):
    return zip_bytes(raw_manifest(m, b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))


def _many_members(m):
    return zip_bytes({**m, **{f"{PREFIX}extra-{n}.txt": b"" for n in range(1001)}})


def _symlink_member(m):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in m.items():
            archive.writestr(name, data)
        info = zipfile.ZipInfo(PREFIX + "lien")
        info.create_system = 3
        info.external_attr = (0o120777) << 16
        archive.writestr(info, b"/etc/hostname")
    return buffer.getvalue()


def _duplicate(m):
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate it is told to write
        with zipfile.ZipFile(buffer, "w") as archive:
            for name, data in m.items():
                archive.writestr(name, data)
            archive.writestr(PREFIX + "README.md", b"a second README\n")
    return buffer.getvalue()


def _bad_crc_deflated(m):
    data = zip_bytes(m, compression=zipfile.ZIP_DEFLATED)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(PREFIX + "README.md")
    return patch_crc(data, PREFIX + "README.md", info.CRC ^ 0xFFFF)


def _corrupt_deflate(m):
    members = {**m, PREFIX + "README.md": b"hello world " * 100}
    data = bytearray(zip_bytes(members, compression=zipfile.ZIP_DEFLATED))
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo(PREFIX + "README.md")
    start = info.header_offset + 30 + len(info.orig_filename.encode())
    data[start:start + 2] = b"\xff\xff"  # an invalid deflate block type
    return bytes(data)


def patch_crc(data: bytes, name: str, crc: int) -> bytes:
    """Return `data` with member `name`'s CRC-32 set to `crc` in both headers."""
    raw = bytearray(data)
    encoded = name.encode()
    for signature, crc_at, name_at in ((LOCAL_HEADER, 14, 30), (CENTRAL_HEADER, 16, 46)):
        start = 0
        while (start := raw.find(signature, start)) >= 0:
            if raw[start + name_at:start + name_at + len(encoded)] == encoded:
                struct.pack_into("<I", raw, start + crc_at, crc)
            start += 4
    return bytes(raw)


# id -> (zip bytes from the good members, words a FAIL line must hold)
HOSTILE_ZIPS = {
    "encrypted member": (_encrypted, ["README.md", "encrypted"]),
    "unknown compression method": (_unknown_method, ["README.md", "compression method 77"]),
    "bzip2 member": (lambda m: zip_bytes(m, compression=zipfile.ZIP_BZIP2),
                     ["compression method 12"]),
    "manifest claims 10^20 bytes": (
        lambda m: zip_bytes(manifest_entry(m, "README.md", size_bytes=10**20)),
        ["README.md", "100000000000000000000 bytes", "limit", "not read"]),
    "manifest claims 2 GiB": (
        lambda m: zip_bytes(manifest_entry(m, "README.md", size_bytes=BOMB_BYTES)),
        ["README.md", "over the", "not read"]),
    "manifest size negative": (lambda m: zip_bytes(manifest_entry(m, "README.md", size_bytes=-1)),
                               ["MANIFEST.json", "malformed"]),
    "manifest size is text": (lambda m: zip_bytes(manifest_entry(m, "README.md", size_bytes="12")),
                              ["MANIFEST.json", "malformed"]),
    "manifest size is true": (lambda m: zip_bytes(manifest_entry(m, "README.md", size_bytes=True)),
                              ["MANIFEST.json", "malformed"]),
    "manifest size 5000 digits": (
        lambda m: zip_bytes(raw_manifest(m, b'{"files": {"README.md": {"size_bytes": '
                                         + b"9" * 5000 + b', "sha256": "0"}}}')),
        ["MANIFEST.json", "does not parse"]),
    "manifest nested 100000 deep": (_deep_manifest, ["MANIFEST.json", "does not parse"]),
    "manifest over 1 MiB": (
        lambda m: zip_bytes(raw_manifest(m, b" " * (MAX_MANIFEST_BYTES + 1) + b"{}")),
        ["MANIFEST.json", "over 1048576 bytes"]),
    "manifest binary": (lambda m: zip_bytes(raw_manifest(m, b"\xff\xfe\x00\x01")),
                        ["MANIFEST.json", "does not parse"]),
    "manifest files is a list": (lambda m: zip_bytes(raw_manifest(m, b'{"files": []}')),
                                 ["MANIFEST.json", "malformed"]),
    "manifest lists 5000 strangers": (
        lambda m: zip_bytes(with_manifest(m, **{f"x{n}": {} for n in range(5000)})),
        ["and 4980 more names listed"]),
    "truncated zip": (_truncated, ["not a readable zip"]),
    "empty file": (lambda m: b"", ["not a readable zip"]),
    "text file": (lambda m: b"not a zip at all\n" * 10, ["not a readable zip"]),
    "duplicate names": (_duplicate, ["README.md", "appears twice"]),
    "NUL in a name": (_nul_name, ["\\x00evil", "NUL"]),
    "newline in a name": (lambda m: zip_bytes({**m, PREFIX + "a\nFAKE OK": b"x"}),
                          ["a\\nFAKE OK", "control characters"]),
    "backslash in a name": (lambda m: zip_bytes({**m, "iteragpu-lab-v1\\README.md": b"x"}),
                            ["backslash"]),
    "absolute name": (lambda m: zip_bytes({**m, "/etc/cron.d/evil": b"x"}),
                      ["/etc/cron.d/evil", "absolute"]),
    "drive letter name": (lambda m: zip_bytes({**m, "C:/evil.txt": b"x"}), ["C:/evil.txt", "absolute"]),
    "dotdot name": (lambda m: zip_bytes({**m, PREFIX + "../../evil.txt": b"x"}), ["'..'"]),
    "symlink member": (_symlink_member, ["lien", "link"]),
    "over 1000 members": (_many_members, ["1010 members", "not read"]),
    "local name differs from central": (_other_local_name, ["LICENSE.txt", "unreadable"]),
    "bad CRC in a deflated member": (_bad_crc_deflated, ["README.md"]),
    "corrupt deflate stream": (_corrupt_deflate, ["README.md", "unreadable", "decompressing"]),
}


@pytest.mark.parametrize("case", list(HOSTILE_ZIPS))
def test_verify_fails_on_hostile_zip(good_members, tmp_path, case):
    build, needles = HOSTILE_ZIPS[case]
    (tmp_path / "hostile.zip").write_bytes(build(good_members))
    assert_fails(run_kit(["verify", "hostile.zip"], tmp_path, in_process=not in_subprocess(HOSTILE_ZIPS, case)),
                 *needles)


def test_good_kit_passes_the_same_harness(good_members, tmp_path):
    (tmp_path / "good.zip").write_bytes(zip_bytes(good_members))
    proc = run_kit(["verify", "good.zip"], tmp_path)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == "OK: 9 files match MANIFEST.json (good.zip)\n"


def test_deflated_kit_passes(good_members, tmp_path):
    (tmp_path / "good.zip").write_bytes(zip_bytes(good_members, zipfile.ZIP_DEFLATED))
    assert run_kit(["verify", "good.zip"], tmp_path).returncode == 0


def test_verify_of_a_fifo_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "kit.zip")
    assert_fails(run_kit(["verify", "kit.zip"], tmp_path), "kit.zip", "not a readable zip")


def test_verify_of_a_folder_holding_a_fifo_does_not_hang(good_members, tmp_path):
    folder = tmp_path / KIT_NAME
    folder.mkdir()
    for name, data in good_members.items():
        (tmp_path / name).write_bytes(data)
    (folder / "README.md").unlink()
    os.mkfifo(folder / "README.md")
    assert_fails(run_kit(["verify", KIT_NAME], tmp_path), "README.md", "not a regular file")


def test_verify_of_a_folder_with_a_link_loop(good_members, tmp_path):
    folder = tmp_path / KIT_NAME
    folder.mkdir()
    for name, data in good_members.items():
        (tmp_path / name).write_bytes(data)
    (folder / "boucle").symlink_to(".")
    assert_fails(run_kit(["verify", KIT_NAME], tmp_path), "boucle", "link")


# --- the zip bomb --------------------------------------------------------------------

def deflated_zeros(size_bytes: int) -> tuple:
    """Return (raw deflate stream, CRC-32) of `size_bytes` zeros, a whole number of CHUNKs.

    After a full flush the compressor starts afresh, so every further chunk of zeros
    compresses to the same bytes: the stream is one block repeated, built in milliseconds
    instead of deflating 2 GiB."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(CHUNK) + compressor.flush(zlib.Z_FULL_FLUSH)
    assert compressor.compress(CHUNK) + compressor.flush(zlib.Z_FULL_FLUSH) == block
    chunks = size_bytes // len(CHUNK)
    crc = 0
    for _ in range(chunks):
        crc = zlib.crc32(CHUNK, crc)
    return block * chunks + compressor.flush(), crc


def one_member_zip(name: str, stream: bytes, crc: int, size_bytes: int) -> bytes:
    """A zip holding one deflated member, written field by field (sizes under 4 GiB)."""
    encoded = name.encode()
    dos_date = (0 << 9) | (1 << 5) | 1  # 1980-01-01
    local = struct.pack("<4sHHHHHIIIHH", LOCAL_HEADER, 20, 0, zipfile.ZIP_DEFLATED, 0, dos_date,
                        crc, len(stream), size_bytes, len(encoded), 0) + encoded
    central = struct.pack("<4sHHHHHHIIIHHHHHII", CENTRAL_HEADER, 20, 20, 0,
                          zipfile.ZIP_DEFLATED, 0, dos_date, crc, len(stream), size_bytes,
                          len(encoded), 0, 0, 0, 0, 0o100644 << 16, 0) + encoded
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(central),
                      len(local) + len(stream), 0)
    return local + stream + central + end


@pytest.fixture(scope="module")
def bomb_base(good_members, tmp_path_factory):
    """A kit zip whose README.md inflates to 2 GiB of zeros (~2 MB on disk), no manifest yet."""
    path = tmp_path_factory.mktemp("bomb") / "base.zip"
    stream, crc = deflated_zeros(BOMB_BYTES)
    path.write_bytes(one_member_zip(PREFIX + "README.md", stream, crc, BOMB_BYTES))
    with zipfile.ZipFile(path, "a") as archive:
        for name, data in good_members.items():
            if name not in (PREFIX + "README.md", PREFIX + MANIFEST):
                archive.writestr(name, data)
    with zipfile.ZipFile(path) as archive:  # a real bomb: zipfile inflates it to zeros
        info = archive.getinfo(PREFIX + "README.md")
        assert (info.file_size, info.compress_type) == (BOMB_BYTES, zipfile.ZIP_DEFLATED)
        with archive.open(info) as handle:
            assert handle.read(3 * len(CHUNK)) == bytes(3 * len(CHUNK))
    assert path.stat().st_size < 4 * 1024 * 1024
    return path


def bomb_with_manifest(bomb_base: Path, good_members: dict, target: Path, **readme) -> Path:
    """The bomb, with a manifest whose README.md entry has `readme`'s fields changed."""
    members = manifest_entry(good_members, "README.md", **readme) if readme else good_members
    target.write_bytes(bomb_base.read_bytes())
    with zipfile.ZipFile(target, "a") as archive:
        archive.writestr(PREFIX + MANIFEST, members[PREFIX + MANIFEST])
    return target


def run_measured(args, cwd: Path) -> tuple:
    """Run the kit command in a child of a fresh Python; return (process, child's max RSS KiB)."""
    code = ("import resource, subprocess, sys\n"
            "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stdout.write(proc.stdout); sys.stderr.write(proc.stderr)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(proc.returncode)\n")
    before = snapshot(cwd)
    proc = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "lab_helpers.kit",
                           *map(str, args)], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=180)
    assert snapshot(cwd) == before
    *lines, rss = proc.stderr.splitlines()
    proc.stderr = "".join(line + "\n" for line in lines)
    assert "Traceback" not in proc.stderr
    return proc, int(rss)


@pytest.mark.parametrize("declared", ["manifest size", "48 MiB"])
def test_zip_bomb_is_refused_fast_with_bounded_memory(bomb_base, good_members, tmp_path, declared):
    readme = {} if declared == "manifest size" else {"size_bytes": 48 * 1024 * 1024}
    bomb_with_manifest(bomb_base, good_members, tmp_path / "bomb.zip", **readme)
    proc, rss_kib = run_measured(["verify", "bomb.zip"], tmp_path)
    assert_fails(proc, "README.md", "size differs")
    assert rss_kib < BOMB_MEMORY_LIMIT_KIB, rss_kib


def test_zip_bomb_reads_no_more_than_the_declared_size_plus_one(bomb_base, good_members,
                                                                 tmp_path, monkeypatch):
    path = bomb_with_manifest(bomb_base, good_members, tmp_path / "bomb.zip")
    declared = len(good_members[PREFIX + "README.md"])
    read_bytes = {}
    original = zipfile.ZipExtFile.read

    def counting_read(self, n=-1):
        assert n is not None and 0 <= n <= READ_CHUNK_BYTES  # never "read everything"
        data = original(self, n)
        read_bytes[self.name] = read_bytes.get(self.name, 0) + len(data)
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "read", counting_read)
    problems = verify_kit(path)
    assert problems == [f"README.md: size differs: over the {declared} bytes MANIFEST.json gives"]
    assert read_bytes[PREFIX + "README.md"] == declared + 1
    for name, data in good_members.items():
        if name != PREFIX + "README.md":
            assert read_bytes[name] <= len(data) + 1


# --- hostile notebooks and paths for build -------------------------------------------

BAD_NOTEBOOKS = {
    "not JSON": (b"{ this is not json", "not JSON"),
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8"),
    "a JSON list": (b"[]", "not an object"),
    "nbformat 3": (json.dumps({**CLEAN_NOTEBOOK, "nbformat": 3}).encode(), "nbformat is 3"),
    "nbformat text": (json.dumps({**CLEAN_NOTEBOOK, "nbformat": "4"}).encode(), "nbformat"),
    "no nbformat_minor": (json.dumps({k: v for k, v in CLEAN_NOTEBOOK.items()
                                      if k != "nbformat_minor"}).encode(), "nbformat_minor"),
    "cells not a list": (json.dumps({**CLEAN_NOTEBOOK, "cells": {"0": {}}}).encode(),
                         "cells is missing or not a list"),
    "cells of strings": (json.dumps({**CLEAN_NOTEBOOK, "cells": ["x = 1"]}).encode(),
                         "cell 1 is not an object"),
    "unknown cell type": (json.dumps({**CLEAN_NOTEBOOK, "cells": [
        {"cell_type": "python", "metadata": {}, "source": ""}]}).encode(), "cell 1 has no cell_type"),
    "source a number": (json.dumps({**CLEAN_NOTEBOOK, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": 3}]}).encode(), "cell 1 source"),
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
}


@pytest.fixture
def repo(tmp_path):
    return fake_tree(tmp_path / "repo")


@pytest.mark.parametrize("case", list(BAD_NOTEBOOKS))
def test_build_refuses_a_notebook_that_is_not_nbformat_4(repo, tmp_path, case):
    data, needle = BAD_NOTEBOOKS[case]
    (repo / MEMBERS[NOTEBOOK]).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_kit(["build", "--root", repo, "--output", "out/kit.zip"], tmp_path,
                   in_process=not in_subprocess(BAD_NOTEBOOKS, case))
    assert_usage_error(proc, "notebooks/mesure-memoire.ipynb", needle)
    assert list(out.iterdir()) == []


def test_build_refuses_an_output_that_is_a_folder(repo, tmp_path):
    (tmp_path / "kit.zip").mkdir()
    assert_usage_error(run_kit(["build", "--root", repo, "--output", "kit.zip"], tmp_path),
                       "kit.zip", "is a folder")


def test_build_refuses_an_output_that_is_a_fifo_without_hanging(repo, tmp_path):
    os.mkfifo(tmp_path / "kit.zip")
    assert_usage_error(run_kit(["build", "--root", repo, "--output", "kit.zip", "--force"],
                               tmp_path), "kit.zip", "not a regular file")


def test_build_refuses_a_source_that_is_a_fifo_without_hanging(repo, tmp_path):
    source = repo / MEMBERS["LICENSE.txt"]
    source.unlink()
    os.mkfifo(source)
    assert_usage_error(run_kit(["build", "--root", repo, "--output", "kit.zip"], tmp_path),
                       "LICENSE.txt", "not a regular file")
    assert not (tmp_path / "kit.zip").exists()


def test_build_names_paths_as_typed_and_the_default_relative(repo, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.kit", "build", "--root", str(repo),
                           "--output", "kit.zip"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("wrote kit.zip (9 files, ")
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.kit", "build", "--root", "."],
                          cwd=repo, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("wrote dist/iteragpu-lab-v1.zip (9 files, ")
    assert str(tmp_path) not in proc.stdout


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_kit_file_gets_the_users_mode(repo, tmp_path, umask):
    code = (f"import os, sys; os.umask({umask}); "
            "from lab_helpers.build.kit import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "build", "--root", str(repo),
                           "--output", "kit.zip"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "kit.zip").stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kit.zip", "repo"]  # no temporary


def test_forced_replacement_gets_the_users_mode_too(repo, tmp_path):
    (tmp_path / "kit.zip").write_bytes(b"old")
    os.chmod(tmp_path / "kit.zip", 0o600)
    code = ("import os, sys; os.umask(0o022); "
            "from lab_helpers.build.kit import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "build", "--root", str(repo), "--output",
                           "kit.zip", "--force"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "kit.zip").stat().st_mode & 0o777 == 0o644
    assert verify_kit(tmp_path / "kit.zip") == []


def test_forced_replacement_that_fails_keeps_the_old_zip(repo, tmp_path, monkeypatch):
    (tmp_path / "kit.zip").write_bytes(b"old")
    monkeypatch.chdir(tmp_path)

    def full(source, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(KitError, match=r"^cannot write kit.zip: no space left on the device$"):
        build_kit(repo, Path("kit.zip"), force=True)
    assert (tmp_path / "kit.zip").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kit.zip", "repo"]  # no temporary left


@pytest.mark.parametrize("argv,needles", [
    (["verify", "absent.zip"], ["absent.zip", "no such file"]),
    (["verify", ""], ["PATH", "empty"]),
    (["build", "--output", ""], ["--output", "empty"]),
    (["frobnicate"], ["invalid choice"]),
], ids=["verify missing", "verify empty path", "build empty output", "unknown command"])
def test_usage_errors(tmp_path, argv, needles):
    assert_usage_error(run_kit(argv, tmp_path), *needles)
