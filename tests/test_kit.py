"""The distribution kit: build, determinism, refusals, verify, and an end-to-end run
from the extracted kit alone."""
import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lab_helpers.build.kit import (KIT_FILES, KIT_NAME, MANIFEST, MEMBERS, NOTEBOOK, ZIP_DATE, build_kit,
                                  main, sha256_hex, verify_kit)

ROOT = Path(__file__).resolve().parent.parent
PREFIX = KIT_NAME + "/"
CLEAN_NOTEBOOK = {
    "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# Mesure"},
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
         "source": "x = 1"},
    ],
    "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
}


def write_notebook(root: Path, notebook: dict) -> None:
    """Write `notebook` where the kit takes its notebook from."""
    path = root / MEMBERS[NOTEBOOK]
    path.write_text(json.dumps(notebook, indent=1) + "\n", encoding="utf-8")


@pytest.fixture
def fake_root(tmp_path):
    """A minimal repo tree holding every file the kit packages."""
    root = tmp_path / "repo"
    for member, source in MEMBERS.items():
        path = root / source
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"contents of {member}\nsecond line\n", encoding="utf-8")
    write_notebook(root, CLEAN_NOTEBOOK)
    return root


@pytest.fixture
def kit_zip(fake_root, tmp_path):
    """A kit built from the fake tree."""
    path, changed = build_kit(fake_root, tmp_path / "dist" / "kit.zip")
    assert changed
    return path


def zip_members(path: Path) -> dict:
    """Return member name -> bytes of the zip at `path`."""
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def write_zip(path: Path, members: dict) -> Path:
    """Write `members` (name -> bytes) as a zip at `path`, names taken literally."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(zipfile.ZipInfo(name), data)
    return path


def run_main(capsys, *argv):
    """Run main(argv); return (exit status, stdout, stderr)."""
    status = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return status, out, err


# --- build ---------------------------------------------------------------------------

def test_build_packs_exactly_nine_files_under_one_folder(fake_root, kit_zip):
    with zipfile.ZipFile(kit_zip) as archive:
        infos = archive.infolist()
    names = [info.filename for info in infos]
    assert names == sorted(PREFIX + name for name in KIT_FILES)
    assert len(names) == 9
    for info in infos:
        assert info.date_time == ZIP_DATE
        assert stat.S_IMODE(info.external_attr >> 16) == 0o644
        assert stat.S_ISREG(info.external_attr >> 16)
        assert not info.is_dir()
    members = zip_members(kit_zip)
    for member, source in MEMBERS.items():
        assert members[PREFIX + member] == (fake_root / source).read_bytes(), member


def test_manifest_lists_nine_members_with_size_and_sha256(fake_root, kit_zip):
    raw = zip_members(kit_zip)[PREFIX + MANIFEST]
    manifest = json.loads(raw)
    assert raw.decode("utf-8") == json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    assert set(manifest["files"]) == KIT_FILES
    assert manifest["kit"] == KIT_NAME
    assert "no fingerprint of itself" in manifest["files"][MANIFEST]["note"]
    assert "sha256" not in manifest["files"][MANIFEST]
    for member, source in MEMBERS.items():
        data = (fake_root / source).read_bytes()
        entry = manifest["files"][member]
        assert entry == {"size_bytes": len(data), "sha256": sha256_hex(data)}


def test_two_builds_are_byte_identical(fake_root, tmp_path):
    first, _ = build_kit(fake_root, tmp_path / "a" / "kit.zip")
    for path in fake_root.rglob("*"):  # new mtimes and modes must not leak in
        if path.is_file():
            os.utime(path, (1_900_000_000, 1_900_000_000))
            path.chmod(0o600)
    second, _ = build_kit(fake_root, tmp_path / "b" / "kit.zip")
    assert first.read_bytes() == second.read_bytes()


def test_default_output_is_dist_of_the_root(fake_root, capsys):
    status, out, _ = run_main(capsys, "build", "--root", fake_root)
    assert status == 0 and out.startswith("wrote ")
    assert (fake_root / "dist" / "iteragpu-lab-v1.zip").is_file()


def test_rebuild_with_identical_bytes_says_unchanged(fake_root, kit_zip, capsys):
    before = kit_zip.stat().st_mtime_ns
    status, out, err = run_main(capsys, "build", "--root", fake_root, "--output", kit_zip)
    assert status == 0 and err == ""
    assert out.startswith("unchanged")
    assert kit_zip.stat().st_mtime_ns == before


def test_readme_states_the_rule_the_estimate_follows():
    """The kit README's bytes-per-parameter rule is what `estimate` computes."""
    from lab_helpers import mesure_memoire
    text = (ROOT / MEMBERS["README.md"]).read_text(encoding="utf-8")
    assert "parameters × bits / 8" not in text
    for bits, per_parameter in ((16, 2), (12, 2), (4, 1), (3, 1)):
        assert f"{bits} → {per_parameter}" in text or f"{bits} bits → {per_parameter}" in text
        result = mesure_memoire.estimate(1000, bits)
        assert (result["bytes_per_parameter"], result["weight_bytes"]) == (per_parameter,
                                                                          1000 * per_parameter)


def test_refuses_to_overwrite_a_different_file_and_leaves_it(fake_root, tmp_path, capsys):
    output = tmp_path / "dist" / "kit.zip"
    output.parent.mkdir()
    output.write_bytes(b"someone else's zip")
    status, out, err = run_main(capsys, "build", "--root", fake_root, "--output", output)
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--force" in err
    assert output.read_bytes() == b"someone else's zip"
    assert sorted(p.name for p in output.parent.iterdir()) == ["kit.zip"]  # no temp left
    status, _, _ = run_main(capsys, "build", "--root", fake_root, "--output", output, "--force")
    assert status == 0 and verify_kit(output) == []


@pytest.mark.parametrize("cell_change", [
    {"outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}]},
    {"execution_count": 3},
], ids=["outputs", "execution_count"])
def test_packages_the_notebook_without_outputs_or_counts(fake_root, tmp_path, capsys, cell_change):
    notebook = json.loads(json.dumps(CLEAN_NOTEBOOK))
    notebook["cells"][1].update(cell_change)
    write_notebook(fake_root, notebook)
    source = fake_root / MEMBERS[NOTEBOOK]
    before = source.read_bytes()
    output = tmp_path / "dist" / "kit.zip"
    status, _, err = run_main(capsys, "build", "--root", fake_root, "--output", output)
    assert status == 0 and err == ""
    packed = json.loads(zip_members(output)[PREFIX + NOTEBOOK])
    assert packed["cells"][1]["outputs"] == [] and packed["cells"][1]["execution_count"] is None
    assert source.read_bytes() == before  # the working copy keeps its outputs


def test_refuses_a_notebook_that_is_not_json(fake_root, tmp_path, capsys):
    (fake_root / MEMBERS[NOTEBOOK]).write_text('{"cells": [', encoding="utf-8")
    output = tmp_path / "dist" / "kit.zip"
    status, out, err = run_main(capsys, "build", "--root", fake_root, "--output", output)
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "mesure-memoire.ipynb" in err
    assert not output.exists()
    assert not output.parent.exists() or not any(output.parent.iterdir())


def test_refuses_when_a_source_file_is_missing(fake_root, tmp_path, capsys):
    (fake_root / MEMBERS["calcul_forfaits.py"]).unlink()
    status, _, err = run_main(capsys, "build", "--root", fake_root,
                              "--output", tmp_path / "kit.zip")
    assert status == 2 and "lab_helpers/calcul_forfaits.py" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "kit.zip").exists()


# --- verify --------------------------------------------------------------------------

def extract(zip_path: Path, into: Path) -> Path:
    """Extract the (trusted, freshly built) kit into `into`; return the kit folder."""
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(into)
    return into / KIT_NAME


def test_verify_passes_on_zip_folder_and_parent(kit_zip, tmp_path, capsys):
    folder = extract(kit_zip, tmp_path / "x")
    for target in (kit_zip, folder, folder.parent):
        status, out, err = run_main(capsys, "verify", target)
        assert (status, err) == (0, "")
        assert out.startswith("OK: 9 files match MANIFEST.json")


def replace(members, name, data):
    """Return a copy of `members` with kit member `name` set to `data`."""
    return {**members, PREFIX + name: data}


def without(members, name):
    """Return a copy of `members` without kit member `name`."""
    return {key: value for key, value in members.items() if key != PREFIX + name}


def flip_first_byte(data: bytes) -> bytes:
    """Return `data` with its first byte changed."""
    return bytes([data[0] ^ 0x01]) + data[1:]


# id -> (rewrite of the member table, words the problem line must contain)
TAMPERING = {
    "changed byte": (lambda m: replace(m, "README.md", flip_first_byte(m[PREFIX + "README.md"])),
                     ["README.md", "changed"]),
    "truncated": (lambda m: replace(m, "tarifs-forfaits.csv", m[PREFIX + "tarifs-forfaits.csv"][:-5]),
                  ["tarifs-forfaits.csv", "truncated"]),
    "missing file": (lambda m: without(m, "calcul_forfaits.py"), ["calcul_forfaits.py", "missing"]),
    "extra file": (lambda m: replace(m, "notes.txt", b"mine\n"), ["notes.txt", "extra file"]),
    "outside folder": (lambda m: {**m, "autre/notes.txt": b"x"},
                       ["autre/notes.txt", "outside the single folder"]),
    "dotdot member": (lambda m: {**m, PREFIX + "../evil.txt": b"x"}, ["../evil.txt", "'..'"]),
    "absolute member": (lambda m: {**m, "/tmp/evil.txt": b"x"}, ["/tmp/evil.txt", "absolute"]),
    "broken manifest": (lambda m: replace(m, MANIFEST, m[PREFIX + MANIFEST][:-20]),
                        ["MANIFEST.json", "does not parse"]),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_verify_fails_on_tampered_zip(kit_zip, tmp_path, capsys, case):
    rewrite, words = TAMPERING[case]
    tampered = write_zip(tmp_path / "tampered.zip", rewrite(zip_members(kit_zip)))
    cwd = Path.cwd()
    os.chdir(tmp_path / "dist")  # a careless extraction would land next to the zip
    try:
        status, out, err = run_main(capsys, "verify", tampered)
    finally:
        os.chdir(cwd)
    assert status == 1 and out == ""
    lines = err.strip().splitlines()
    assert any(all(word in line for word in words) for line in lines), err
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "dist" / "evil.txt").exists()
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == ["kit.zip"]


FOLDER_TAMPERING = {
    "changed byte": (lambda d: (d / "README.md").write_bytes(
        flip_first_byte((d / "README.md").read_bytes())), ["README.md", "changed"]),
    "truncated": (lambda d: (d / "LICENSE.txt").write_bytes((d / "LICENSE.txt").read_bytes()[:3]),
                  ["LICENSE.txt", "truncated"]),
    "missing file": (lambda d: (d / "mesure_memoire.py").unlink(), ["mesure_memoire.py", "missing"]),
    "extra file": (lambda d: (d / "mesures-petit-essai.json").write_text("{}"),
                   ["mesures-petit-essai.json", "extra file"]),
    "extra nested file": (lambda d: (d / "sous" / "x.txt").parent.mkdir() or
                          (d / "sous" / "x.txt").write_text("x"), ["sous/x.txt", "extra file"]),
    "link": (lambda d: (d / "lien").symlink_to("/etc/hostname"), ["lien", "link"]),
    "broken manifest": (lambda d: (d / MANIFEST).write_text("{", encoding="utf-8"),
                        ["MANIFEST.json", "does not parse"]),
}


@pytest.mark.parametrize("case", list(FOLDER_TAMPERING))
def test_verify_fails_on_tampered_folder(kit_zip, tmp_path, capsys, case):
    folder = extract(kit_zip, tmp_path / "x")
    tamper, words = FOLDER_TAMPERING[case]
    tamper(folder)
    status, out, err = run_main(capsys, "verify", folder)
    assert status == 1 and out == ""
    assert any(all(word in line for word in words) for line in err.strip().splitlines()), err


def test_verify_reports_corrupt_bytes_inside_the_zip(kit_zip, tmp_path):
    data = bytearray(kit_zip.read_bytes())
    index = data.index(b"contents of calcul_forfaits.py")  # stored, so readable in place
    data[index] ^= 0x01
    damaged = tmp_path / "damaged.zip"
    damaged.write_bytes(bytes(data))
    problems = verify_kit(damaged)
    assert problems and all("calcul_forfaits.py" in problem for problem in problems)


def test_verify_reports_a_cut_download(kit_zip, tmp_path):
    cut = tmp_path / "cut.zip"
    cut.write_bytes(kit_zip.read_bytes()[:1000])
    problems = verify_kit(cut)
    assert len(problems) == 1 and "not a readable zip" in problems[0]


def test_verify_reports_a_manifest_that_drops_a_member(kit_zip, tmp_path):
    members = zip_members(kit_zip)
    manifest = json.loads(members[PREFIX + MANIFEST])
    del manifest["files"]["README.md"]
    members = without(replace(members, MANIFEST, json.dumps(manifest).encode()), "README.md")
    problems = verify_kit(write_zip(tmp_path / "short.zip", members))
    assert problems == ["README.md: not listed in MANIFEST.json, which must list all 9"]


def test_verify_usage_errors_exit_2(tmp_path, capsys):
    status, out, err = run_main(capsys, "verify", tmp_path / "absent.zip")
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["verify"])
    assert exit_info.value.code == 2


# --- the kit README ------------------------------------------------------------------

def test_kit_readme_covers_the_walkthrough():
    text = " ".join((ROOT / MEMBERS["README.md"]).read_text(encoding="utf-8").split())
    for needle in ("mesure_memoire.py estimate", "mesure_memoire.py environment",
                   "mesure_memoire.py measure", "mesure_memoire.py predict",
                   "mesure_memoire.py compare", "calcul_forfaits.py --gpu",
                   "illustrative, not quotes", "`allocated` is part of `reserved`",
                   "two separate maxima", "jupyter lab mesure-memoire.ipynb", "MANIFEST.json",
                   "--allow-root", "rounded **up** to whole bytes", "4 → 1",
                   "--format table", "memory/GPU (vendor GB)"):
        assert needle in text, needle


# --- end to end, on the real repo files ----------------------------------------------

def run(args, cwd):
    """Run a command; return the completed process (text, captured)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def cuda_available() -> bool:
    """True when this Python sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_end_to_end_from_the_extracted_kit_alone(tmp_path):
    zips = [tmp_path / "a" / "kit.zip", tmp_path / "b" / "kit.zip"]
    for path in zips:
        built = run([sys.executable, "-m", "lab_helpers.kit", "build", "--output", str(path)],
                    cwd=ROOT)
        assert built.returncode == 0, built.stderr
    assert zips[0].read_bytes() == zips[1].read_bytes()
    members = zip_members(zips[0])
    for member in ("mesure_memoire.py", "calcul_forfaits.py"):
        assert members[PREFIX + member] == (ROOT / MEMBERS[member]).read_bytes()

    workdir = tmp_path / "vide"
    workdir.mkdir()
    folder = extract(zips[0], workdir)
    assert sorted(p.name for p in workdir.iterdir()) == [KIT_NAME]
    for target in (zips[0], folder):
        checked = run([sys.executable, "-m", "lab_helpers.kit", "verify", str(target)], cwd=ROOT)
        assert checked.returncode == 0, checked.stderr
        assert checked.stdout.startswith("OK: 9 files match MANIFEST.json")

    estimate = run([sys.executable, "mesure_memoire.py", "estimate", "--parameters",
                    "7000000000", "--bits", "16", "--reserve-gib", "4"], cwd=folder)
    assert estimate.returncode == 0, estimate.stderr
    assert json.loads(estimate.stdout)["weight_bytes"] == 14_000_000_000

    environment = run([sys.executable, "mesure_memoire.py", "environment",
                       "--device", "cuda:0"], cwd=folder)
    assert environment.returncode == 0, environment.stderr

    measure = run([sys.executable, "mesure_memoire.py", "measure", "--device", "cuda:0",
                   "--batch", "1", "--context", "16", "--width", "64", "--dtype", "float32",
                   "--warmup", "1", "--repeats", "2", "--output", "m.json"], cwd=folder)
    if cuda_available():
        assert measure.returncode == 0, measure.stderr
        assert (folder / "m.json").is_file()
    else:
        assert measure.returncode == 2, measure.stderr
        assert measure.stderr.strip()
        assert not (folder / "m.json").exists()

    forfait = run([sys.executable, "calcul_forfaits.py", "--gpu", "b200", "--days", "7",
                   "--lots", "2"], cwd=folder)
    assert forfait.returncode == 0, forfait.stderr
    assert json.loads(forfait.stdout)["gpus"] == 4
