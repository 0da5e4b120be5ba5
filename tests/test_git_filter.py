"""Notebooks run and saved with outputs leave the repository clean: the strip function, its
command, and git's clean filter in a scratch repository configured as `make` configures it."""
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from lab_helpers.build.strip import FILTER_COMMAND, committed_form, strip_bytes

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
GIT = shutil.which("git")
MAKE = shutil.which("make")
# What the scratch repository needs: the kit's sources, the notebooks and their test.
REPO_ITEMS = ("Makefile", ".gitattributes", "LICENSE.txt", "pyproject.toml", "lab_helpers", "notebooks",
              "data", "tests/conftest.py", "tests/test_notebooks.py")
GIT_ENV = {"GIT_AUTHOR_NAME": "lab", "GIT_AUTHOR_EMAIL": "lab@example.invalid",
           "GIT_COMMITTER_NAME": "lab", "GIT_COMMITTER_EMAIL": "lab@example.invalid",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

DIRTY = {
    "cells": [
        {"cell_type": "markdown", "id": "m1", "metadata": {"jupyter": {"source_hidden": True}},
         "source": ["# Titre é\n"]},
        {"cell_type": "code", "execution_count": 7, "id": "c1",
         "metadata": {"tags": ["parameters"], "collapsed": True, "scrolled": "auto",
                      "execution": {"iopub.status.busy": "2026-11-29T22:01:30.005048Z"},
                      "ExecuteTime": {"end_time": "2026-11-29T22:01:30Z"},
                      "jupyter": {"outputs_hidden": True}},
         "outputs": [{"output_type": "stream", "name": "stdout", "text": ["1\n"]}],
         "source": ["x = 1\n", "print(x)"]},
        {"cell_type": "code", "execution_count": 8, "id": "c2",
         "metadata": {"tags": ["generated-from:lab_helpers/grid.py"], "jupyter": {"source_hidden": False}},
         "outputs": [{"output_type": "error", "ename": "E", "evalue": "", "traceback": []}],
         "source": "def f():\n    pass"},
    ],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                 "language_info": {"name": "python", "version": "3.11.7", "pygments_lexer": "ipython3"},
                 "widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}}},
    "nbformat": 4, "nbformat_minor": 5,
}
DIRTY_STRIPPED = {
    "cells": [
        {"cell_type": "markdown", "id": "m1", "metadata": {}, "source": ["# Titre é\n"]},
        {"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {"tags": ["parameters"]},
         "outputs": [], "source": ["x = 1\n", "print(x)"]},
        {"cell_type": "code", "execution_count": None, "id": "c2",
         "metadata": {"tags": ["generated-from:lab_helpers/grid.py"], "jupyter": {"source_hidden": True}},
         "outputs": [], "source": "def f():\n    pass"},
    ],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                 "language_info": {"name": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}


def strip_cli(*args, stdin=b"", python=(sys.executable,)):
    """Run the strip command from the repository root; return the completed process."""
    return subprocess.run([*python, "-m", "lab_helpers.notebook_strip", *map(str, args)], cwd=ROOT,
                          input=stdin, capture_output=True, timeout=60)


# --- the strip function and command ----------------------------------------------------

def test_strip_removes_outputs_counts_and_volatile_metadata_exactly():
    expected = (json.dumps(DIRTY_STRIPPED, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()
    data = json.dumps(DIRTY).encode()
    assert strip_bytes(data) == expected
    assert strip_bytes(expected) == expected  # a clean notebook is a fixed point
    assert "é".encode() in expected and b"\\u00e9" not in expected


def test_strip_leaves_its_argument_for_the_caller():
    original = copy.deepcopy(DIRTY)
    strip_bytes(json.dumps(DIRTY).encode())
    assert DIRTY == original


def test_command_reads_stdin_or_a_file_and_never_writes_the_file(tmp_path):
    data = json.dumps(DIRTY).encode()
    expected = strip_bytes(data)
    proc = strip_cli(stdin=data)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, expected, b"")
    path = tmp_path / "run.ipynb"
    path.write_bytes(data)
    proc = strip_cli(path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, expected, b"")
    assert path.read_bytes() == data


def test_command_needs_only_the_standard_library():
    # -S: no site-packages at all, as with a bare system python3
    proc = strip_cli(stdin=json.dumps(DIRTY).encode(), python=(sys.executable, "-S"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == DIRTY_STRIPPED


BAD_INPUTS = {
    "empty": b"",
    "not-json": b'{"cells": [',
    "not-utf8": b'{"cells": [], "x": "\xff"}',
    "a-list": b"[1, 2]",
    "no-cells": b'{"metadata": {}}',
    "cells-not-a-list": b'{"cells": {}}',
    "cell-not-an-object": b'{"cells": [1]}',
    "cell-metadata-not-an-object": b'{"cells": [{"cell_type": "code", "metadata": []}]}',
    "deeply-nested": b'{"cells": [], "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
}


@pytest.mark.parametrize("data", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_command_refuses_bad_input_with_one_line_and_exit_2(data):
    proc = strip_cli(stdin=data)
    assert proc.returncode == 2 and proc.stdout == b""
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("notebook_strip: error: standard input: ")
    assert committed_form(data) == data  # the kit then reports it itself


@pytest.mark.parametrize("path", ["missing.ipynb", "."], ids=["missing", "a-folder"])
def test_command_refuses_an_unreadable_path(path):
    proc = strip_cli(path)
    assert proc.returncode == 2 and proc.stdout == b""
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"notebook_strip: error: {path}: ")


# --- git's clean filter in a scratch repository -------------------------------------------

def git(repo: Path, *args, check=True) -> str:
    proc = subprocess.run([GIT, *args], cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **GIT_ENV}, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc.stdout


def build_kit(repo: Path, output: Path) -> bytes:
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.kit", "build", "--output", str(output)],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return output.read_bytes()


# A 1x1 PNG, as a figure output carries it (base64)
PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGBgAAAABQABpfZFQAAAAABJRU5ErkJggg=="


def run_in_place(path: Path) -> None:
    """Save the notebook at `path` as a run leaves it: every code cell numbered, with outputs of each
    kind a run writes (text on stdout and stderr, a result, a figure, an error) and nbclient's timing
    metadata. The cells are not executed here (that costs a kernel and seconds of CPU per notebook):
    tests/test_browser.py runs every notebook in JupyterLab, saves it and checks the same clean add;
    this test is about what git stores and what the kit holds afterwards."""
    from nbformat.v4 import new_output
    nb = nbformat.read(path, as_version=4)
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        cell.metadata["execution"] = {"iopub.execute_input": "2026-12-01T10:00:00.000001Z",
                                      "iopub.status.busy": "2026-12-01T10:00:00.000000Z",
                                      "iopub.status.idle": "2026-12-01T10:00:01.000000Z",
                                      "shell.execute_reply": "2026-12-01T10:00:01.000000Z"}
        cell.outputs = [
            new_output("stream", name="stdout", text=f"cell {count} printed this\n"),
            new_output("stream", name="stderr", text="a warning\n"),
            new_output("execute_result", execution_count=count,
                       data={"text/plain": f"{count}", "text/html": f"<b>{count}</b>"}),
            new_output("display_data", data={"image/png": PIXEL_PNG, "text/plain": "<Figure size 640x480>"},
                       metadata={"image/png": {"width": 1, "height": 1}}),
        ]
        if count == 1:
            cell.metadata["scrolled"] = True
            cell.outputs.append(new_output("error", ename="ValueError", evalue="raised on purpose",
                                           traceback=["ValueError: raised on purpose"]))
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python",
                                    "file_extension": ".py", "codemirror_mode": {"name": "ipython", "version": 3},
                                    "nbconvert_exporter": "python", "pygments_lexer": "ipython3"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2,
                                                                           "version_minor": 0}}
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def scratch_repo(tmp_path_factory):
    """A git repository holding this tree's notebooks and library, committed, filter configured."""
    if not (GIT and MAKE):
        pytest.fail("git and make are needed to test the notebook filter")
    repo = tmp_path_factory.mktemp("repo")
    ignore = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints", "*.pyc")
    for item in REPO_ITEMS:
        source, target = ROOT / item, repo / item
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=ignore)
        else:
            shutil.copy2(source, target)
    for path in (repo / "notebooks").glob("*.ipynb"):  # as stored, whatever this working copy holds
        path.write_bytes(strip_bytes(path.read_bytes()))
    git(repo, "init", "-q")
    proc = subprocess.run([MAKE, "-s", "git-filter"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert git(repo, "config", "filter.notebook-strip.clean").strip() == FILTER_COMMAND
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "scratch")
    assert git(repo, "status", "--porcelain") == ""
    return repo


def test_make_configures_nothing_outside_a_checkout_of_its_own(tmp_path):
    outer = tmp_path / "outer"
    inner = outer / "unpacked"
    inner.mkdir(parents=True)
    shutil.copy2(ROOT / "Makefile", inner / "Makefile")
    git(outer, "init", "-q")
    proc = subprocess.run([MAKE, "-s", "git-filter"], cwd=inner, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert git(outer, "config", "--get", "filter.notebook-strip.clean", check=False) == ""
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy2(ROOT / "Makefile", plain / "Makefile")
    proc = subprocess.run([MAKE, "-s", "git-filter"], cwd=plain, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_notebooks_run_and_saved_with_outputs_leave_the_repository_clean(scratch_repo, tmp_path):
    repo = scratch_repo
    kit_before = build_kit(repo, tmp_path / "before.zip")
    committed = {name: (repo / "notebooks" / name).read_bytes()
                 for name in ("forfaits.ipynb", "mesure-memoire.ipynb")}
    for name in committed:
        run_in_place(repo / "notebooks" / name)
        saved = json.loads((repo / "notebooks" / name).read_text(encoding="utf-8"))
        assert any(cell.get("outputs") for cell in saved["cells"]), f"{name} ran without outputs"
        assert (repo / "notebooks" / name).read_bytes() != committed[name]

    assert git(repo, "diff") == ""
    assert git(repo, "-C", "notebooks", "diff") == ""  # git runs filters from the top
    # git lists a file whose size changed as modified without reading it, until its index entry
    # is refreshed; `git add` does that and stages nothing
    assert set(git(repo, "status", "--porcelain").splitlines()) <= {
        " M notebooks/forfaits.ipynb", " M notebooks/mesure-memoire.ipynb"}
    git(repo, "add", "notebooks")
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "diff", "--cached") == ""
    assert build_kit(repo, tmp_path / "after.zip") == kit_before
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "tests/test_notebooks.py", "-k", "committed_without_outputs"],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"{len(list((repo / 'notebooks').glob('*.ipynb')))} passed" in proc.stdout  # one per notebook

    # the outputs are still in the working copy; without the filter git would see them
    assert '"outputs": [\n' in (repo / "notebooks" / "forfaits.ipynb").read_text(encoding="utf-8")
    paths = [f"notebooks/{name}" for name in committed]
    committed_ids = git(repo, "rev-parse", *[f"HEAD:{path}" for path in paths]).split()
    assert git(repo, "hash-object", *paths).split() == committed_ids  # what git stores, filtered
    git(repo, "config", "--unset", "filter.notebook-strip.clean")
    git(repo, "config", "--unset", "filter.notebook-strip.required")  # a required filter must have a command
    try:
        unfiltered = git(repo, "hash-object", *paths).split()
        assert all(a != b for a, b in zip(unfiltered, committed_ids))
    finally:
        git(repo, "config", "filter.notebook-strip.clean", FILTER_COMMAND)
        git(repo, "config", "filter.notebook-strip.required", "true")


BROKEN_NOTEBOOKS = {
    "not-json": b'{"cells": [',
    "nan": b'{"cells": [], "metadata": {"x": NaN}}',
    "surrogate-in-source": b'{"cells": [{"cell_type": "code", "source": "\\ud800", "metadata": {}, "outputs": []}]}',
    "surrogate-in-key": b'{"cells": [], "metadata": {"\\udfff": 1}}',
}


@pytest.mark.parametrize("data", BROKEN_NOTEBOOKS.values(), ids=BROKEN_NOTEBOOKS.keys())
def test_a_notebook_the_filter_cannot_clean_is_refused_by_git_add(scratch_repo, data):
    # the filter is `required`: its one-line refusal makes git refuse the add, so nothing that is
    # not a clean notebook is stored, and the working copy is left as the user wrote it
    repo = scratch_repo
    assert git(repo, "config", "filter.notebook-strip.required").strip() == "true"
    path = repo / "notebooks" / "broken.ipynb"
    path.write_bytes(data)
    try:
        proc = subprocess.run([GIT, "add", "notebooks/broken.ipynb"], cwd=repo, capture_output=True, text=True,
                              timeout=120, env={**os.environ, **GIT_ENV})
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.splitlines() if line.startswith("notebook_strip:")]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "broken.ipynb" not in git(repo, "ls-files", "--stage", "notebooks")
        assert path.read_bytes() == data
    finally:
        path.unlink()


def test_checkouts_and_merges_that_write_notebooks_succeed_with_the_filter_set(scratch_repo):
    # a required filter with no smudge command fails every checkout that writes a notebook
    # ("smudge filter notebook-strip failed"): a `git pull` after `make lab` would stop there
    repo = scratch_repo
    assert git(repo, "config", "filter.notebook-strip.smudge").strip() == "cat"
    stored = sorted((repo / "notebooks").glob("*.ipynb"))[0]
    name = f"notebooks/{stored.name}"
    working = stored.read_bytes()  # another test may have left it run (with outputs)
    branch, start = git(repo, "rev-parse", "--abbrev-ref", "HEAD").strip(), git(repo, "rev-parse", "HEAD").strip()
    before = subprocess.run([GIT, "show", f"HEAD:{name}"], cwd=repo, capture_output=True, check=True).stdout
    try:
        git(repo, "checkout", "-q", "-b", "edited")
        notebook = json.loads(before)
        notebook["cells"][0]["source"] = "edited"
        stored.write_bytes(strip_bytes(json.dumps(notebook).encode()))  # as the filter stores it
        edited = stored.read_bytes()
        git(repo, "commit", "-q", "-am", "edit a notebook")
        git(repo, "checkout", "-q", branch)  # writes the notebook back as the first commit stores it
        assert stored.read_bytes() == before
        git(repo, "merge", "-q", "edited")  # a fast-forward that writes the edited notebook
        assert stored.read_bytes() == edited and git(repo, "status", "--porcelain") == ""
    finally:
        git(repo, "checkout", "-q", "-f", branch)
        git(repo, "reset", "-q", "--hard", start)
        git(repo, "branch", "-q", "-D", "edited", check=False)
        stored.write_bytes(working)
