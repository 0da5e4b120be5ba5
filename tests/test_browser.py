"""The lab as people use it: JupyterLab (started as `make lab` starts it) in headless Chromium,
each notebook run from the Run menu, checked for errors, photographed and saved; thanks to the
notebook clean filter, git then has nothing to commit.

Marked `browser`. Without Chromium, its driver or selenium these tests FAIL and say what to
install (a skip would read as a pass); deselect them explicitly with `-m "not browser"`.
Screenshots go to $BROWSER_SCREENSHOTS when set, else to the test's temporary folder.
"""
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import nbformat
import pytest

import lab_browser
from conftest import ROOT

NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
RUN_SECONDS = 120  # per notebook, on a 2-core machine without a GPU
NUMBERED = re.compile(r"\[\d+\]:")


def configure_notebook_filter(repo: Path) -> None:
    # The same command as `make lab` / `make test`, so the scratch copy stores notebooks
    # exactly as a user's checkout does.
    proc = subprocess.run(["make", "--no-print-directory", "-s", "git-filter"], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.fail(f"`make git-filter` failed in the scratch copy: {(proc.stderr or proc.stdout).strip()}")


@pytest.fixture(scope="module")
def browser_available():
    reason = lab_browser.missing_browser()
    if reason:
        pytest.fail(f"cannot run the browser test: {reason}", pytrace=False)


@pytest.fixture(scope="module")
def lab_repo(tmp_path_factory):
    """A git repository holding this checkout's working tree, notebook filter configured."""
    return lab_browser.copy_checkout(ROOT, tmp_path_factory.mktemp("browser") / "repo",
                                     configure=configure_notebook_filter)


@pytest.fixture(scope="module")
def lab_server(browser_available, lab_repo, tmp_path_factory):
    server = lab_browser.LabServer(lab_repo, tmp_path_factory.mktemp("jupyter"))
    try:
        yield server.start()
    finally:
        server.stop()
    assert server.kernel_pids() == [], "kernels left running after the server stopped"


@pytest.fixture(scope="module")
def chromium(browser_available, tmp_path_factory):
    driver = lab_browser.start_chromium(tmp_path_factory.mktemp("chromium") / "profile")
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory):
    chosen = os.environ.get("BROWSER_SCREENSHOTS")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def saved_errors(path: Path) -> list[str]:
    """`ename: evalue` of every error output in the notebook file as saved."""
    nb = nbformat.read(path, as_version=4)
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"]


def run_in_lab(page: lab_browser.NotebookPage, screenshot: Path) -> list[str]:
    """Open, Run All Cells, wait until finished; the screenshot is taken even on a timeout."""
    page.open()
    started = time.monotonic()
    try:
        page.run_all_cells()
        prompts = page.wait_until_finished(RUN_SECONDS)
    finally:
        page.show_first_output()
        page.screenshot(screenshot)
    print(f"{page.name}: ran in {time.monotonic() - started:.1f} s; screenshot {screenshot}")
    return prompts


@pytest.mark.browser
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab_and_saves_clean(name, lab_server, chromium, lab_repo, screenshot_dir):
    page = lab_browser.NotebookPage(chromium, lab_server, name)
    try:
        check_run_and_save(page, lab_repo, screenshot_dir)
    finally:
        page.shutdown_kernel()


def check_run_and_save(page, lab_repo, screenshot_dir):
    name = page.name
    prompts = run_in_lab(page, screenshot_dir / f"{Path(name).stem}.png")
    assert page.error_outputs() == [], f"{name}: a cell shows an error in JupyterLab"
    assert prompts and all(NUMBERED.fullmatch(p) for p in prompts), f"{name}: not every cell ran: {prompts}"

    path = lab_repo / "notebooks" / name
    before = path.read_bytes()
    page.save()
    saved = nbformat.read(path, as_version=4)
    assert path.read_bytes() != before, f"{name}: Ctrl+S did not write the run notebook"
    counts = [c.execution_count for c in saved.cells if c.cell_type == "code"]
    assert all(isinstance(n, int) for n in counts), f"{name}: saved without every execution count: {counts}"
    assert any(c.outputs for c in saved.cells if c.cell_type == "code"), f"{name}: saved without outputs"
    assert saved_errors(path) == []

    rel = f"notebooks/{name}"
    diff = lab_browser.git_diff(lab_repo, rel)
    assert not diff, (f"after running and saving {name} in JupyterLab, git sees a change that the notebook "
                      f"clean filter should have removed:\n" + "\n".join(diff.splitlines()[:30]))
    # git compares file sizes before it runs a clean filter: until `git add` records that the
    # clean form is unchanged, `git status` lists a run notebook (it grew by its outputs) as
    # modified even though `git diff` is empty.
    lab_browser.git_add(lab_repo, rel)
    status = lab_browser.git_status(lab_repo, rel)
    assert status == "", f"{name}: something to commit after running it:\n{status}"
    untracked = [line for line in lab_browser.git_status(lab_repo).splitlines() if line.startswith("??")]
    assert untracked == [], f"running {name} left files that git would offer to add: {untracked}"


@pytest.mark.browser
def test_a_failing_cell_is_detected(lab_server, chromium, lab_repo, screenshot_dir):
    """The error check itself can fail: a throw-away notebook with a cell that raises, after one
    that only writes to stderr (shown with the same mime type, but not an error)."""
    folder = lab_repo / "notebooks" / "failing-on-purpose"
    folder.mkdir()
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell("import sys\nprint('only a warning', file=sys.stderr)"),
                nbformat.v4.new_code_cell("raise ValueError('failing on purpose')"),
                nbformat.v4.new_code_cell("print('never runs')")]
    nbformat.write(nb, folder / "failing.ipynb")
    page = lab_browser.NotebookPage(chromium, lab_server, "failing-on-purpose/failing.ipynb")
    try:
        prompts = run_in_lab(page, screenshot_dir / "failing-on-purpose.png")
        assert prompts == ["[1]:", "[2]:", "[ ]:"]
        assert any("only a warning" in t for t in page.stderr_outputs())
        shown = page.error_outputs()
        assert len(shown) == 1 and "ValueError" in shown[0] and "failing on purpose" in shown[0], shown
        page.save()
        assert saved_errors(folder / "failing.ipynb") == ["ValueError: failing on purpose"]
    finally:
        page.shutdown_kernel()
        shutil.rmtree(folder)


@pytest.mark.parametrize("missing", ["CHROMIUM", "CHROMEDRIVER"])
def test_a_missing_browser_is_named_with_the_install_command(missing, monkeypatch, tmp_path):
    monkeypatch.setattr(lab_browser, missing, tmp_path / "absent")
    reason = lab_browser.missing_browser()
    assert str(tmp_path / "absent") in reason and lab_browser.INSTALL_HINT in reason

