"""Committed notebooks: no outputs, a parameters cell, no project import, no drift from lab_helpers.

Cells are numbered from 1, every cell counted (markdown too), as JupyterLab shows them: "cell N"
means the same cell here, in the kit's refusals and in make sync's messages."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from lab_helpers import notebook_strip, notebook_sync

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["forfaits.ipynb", "mesure-memoire.ipynb", "pic-vs-reserve.ipynb"]


def committed_forms(path: Path) -> dict:
    """Return what the repository holds for `path`: the HEAD and staged blobs in a git checkout
    (the working copy may keep its outputs), else the file itself."""
    git = shutil.which("git")
    top = subprocess.run([git, "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True,
                         text=True) if git else None
    if top is None or top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT.resolve():
        return {"file": path.read_bytes()}
    rel = path.relative_to(ROOT).as_posix()
    forms = {}
    for label, spec in (("HEAD", f"HEAD:{rel}"), ("staged", f":{rel}")):
        proc = subprocess.run([git, "show", spec], cwd=ROOT, capture_output=True)
        if proc.returncode == 0:
            forms[label] = proc.stdout
    return forms or {"file": path.read_bytes()}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_or_execution_counts(path):
    for label, data in committed_forms(path).items():
        nb = nbformat.reads(data.decode("utf-8"), as_version=4)
        nbformat.validate(nb)
        dirty = [n for n, c in enumerate(nb.cells, start=1)
                 if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
        assert dirty == [], (f"{path.name} ({label}): cell {dirty[0]} has outputs or an execution count;"
                             " run `make test` once (it sets git's notebook filter), "
                             "then `git add` the notebook again")
        assert notebook_strip.strip_bytes(data) == data, (
            f"{path.name} ({label}): volatile metadata committed; `git add` it again with the filter set")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_is_tagged_parameters(path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "parameters" in first.metadata.get("tags", [])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_imports_no_project_module(path):
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not re.search(r"^\s*(from|import)\s+lab_helpers\b", code, re.MULTILINE)


def test_generated_cells_match_the_library():
    stale = notebook_sync.sync(check=True)
    assert stale == [], f"generated cells drifted from lab_helpers: {stale}; run `make sync`"


def test_sync_check_command_names_the_fix(tmp_path):
    for rel in ["notebooks", "lab_helpers"]:
        (tmp_path / rel).mkdir()
    for notebook, sources in notebook_sync.NOTEBOOK_SOURCES.items():
        (tmp_path / notebook).write_bytes((ROOT / notebook).read_bytes())
        for source in sources:
            (tmp_path / source).write_bytes((ROOT / source).read_bytes())
    edited = tmp_path / "lab_helpers" / "plots.py"
    edited.write_text(edited.read_text() + "\nEDITED_ONLY_IN_THE_LIBRARY = 1\n")
    assert notebook_sync.sync(tmp_path, check=True) == ["notebooks/mesure-memoire.ipynb <- lab_helpers/plots.py"]
    assert notebook_sync.sync(tmp_path) == ["notebooks/mesure-memoire.ipynb <- lab_helpers/plots.py"]
    assert notebook_sync.sync(tmp_path, check=True) == []
    code = notebook_sync.notebook_code("notebooks/mesure-memoire.ipynb", "lab_helpers/plots.py", tmp_path)
    assert "EDITED_ONLY_IN_THE_LIBRARY = 1" in code


def test_check_cli_exit_status():
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.notebook_sync", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generated_cells_drop_the_main_block_and_library_imports():
    for notebook, sources in notebook_sync.NOTEBOOK_SOURCES.items():
        for source in sources:
            code = notebook_sync.notebook_code(notebook, source)
            assert notebook_sync.MAIN_GUARD not in code
            assert notebook_sync.LIBRARY_ONLY_START not in code
