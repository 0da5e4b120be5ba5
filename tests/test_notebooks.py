"""Committed notebooks: no outputs, a parameters cell, no project import, no drift from lab_helpers."""
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from lab_helpers import notebook_sync

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["forfaits.ipynb", "mesure-memoire.ipynb", "pic-vs-reserve.ipynb",
                                           "real-model.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_or_execution_counts(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert dirty == [], f"{path.name}: cells {dirty} carry outputs; clear them (Kernel > Restart and Clear Outputs)"


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
