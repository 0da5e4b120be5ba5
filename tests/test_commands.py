"""What every command of the lab shares: one error prefix, and a quiet end when its reader leaves."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_main_in_process
from test_runs import measurement

ROOT = Path(__file__).resolve().parent.parent
EXIT_BROKEN_PIPE = 141
GRID = str(ROOT / "data" / "resultats-bruts.csv")
NOTEBOOK = str(ROOT / "notebooks" / "forfaits.ipynb")


def run(module, *args, cwd, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", f"lab_helpers.{module}", *map(str, args)], cwd=cwd,
                          stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


# (module, prefix, a usage error argparse reports, another error the command reports itself)
ERRORS = [
    ("mesure_memoire", "mesure_memoire", ["estimate", "--bits", "x", "--parameters", "1"],
     ["compare", "absent.json"]),
    ("mesure_memoire", "mesure_memoire", ["--bogus"], ["measure", "--output", "absent/m.json"]),
    ("sweep", "sweep", ["--bogus"], ["--dimension", "batch", "--values", "2", "1", "--output-dir", "s"]),
    ("runs", "runs", ["--counter", "bogus", "a.json"], ["absent.json"]),
    ("grid", "grid", ["check"], ["check", "absent.csv"]),
    ("grid", "grid", ["report", "--format", "xml", GRID], ["report", GRID, "--tariffs", "absent.csv"]),
    ("kit", "kit", ["verify"], ["verify", "absent.zip"]),
    ("kit", "kit", ["--bogus"], ["build", "--root", "absent"]),
    ("calcul_forfaits", "calcul_forfaits", ["--days", "5"], ["--gpu", "nope", "--days", "7"]),
    ("timeline", "timeline", ["summary"], ["summary", "absent.json"]),
    ("timeline", "timeline", ["--bogus"], ["explain", "absent.pickle"]),
    ("notebook_strip", "notebook_strip", ["a", "b"], ["absent.ipynb"]),
    ("notebook_sync", "notebook_sync", ["--bogus"], ["absent.ipynb"]),
]


@pytest.mark.parametrize("module, prefix, usage, other", ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_usage_errors_and_other_errors_share_one_prefix(tmp_path, module, prefix, usage, other):
    for args in (usage, other):
        result = run(module, *args, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith(f"{prefix}: error: "), (args, result.stderr)
        assert result.stderr.count("\n") == 1, (args, result.stderr)
    assert sorted(os.listdir(tmp_path)) == []


def program_main(module):
    """The main(argv) that `python -m lab_helpers.<module>` runs."""
    import importlib
    return importlib.import_module(f"lab_helpers.{module}").main


def closed_pipe_run(module, *args, cwd):
    """Run with stdout a pipe whose reader has already gone, as after `| head -1`."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return run(module, *args, cwd=cwd, stdout=writer)
    finally:
        os.close(writer)


HELP = ["mesure_memoire", "sweep", "runs", "grid", "kit", "calcul_forfaits", "notebook_strip", "notebook_sync"]


@pytest.mark.parametrize("module", HELP)
def test_help_into_a_closed_pipe_ends_quietly(tmp_path, module):
    result = closed_pipe_run(module, "--help", cwd=tmp_path)
    # argparse itself drops an OSError while printing help on recent Pythons (then exit 0)
    assert result.returncode in (0, EXIT_BROKEN_PIPE) and result.stderr == ""


OUTPUTS = [
    ("mesure_memoire", ["predict", "--batch", "2", "--context", "128", "--width", "1024", "--dtype", "bfloat16"]),
    ("mesure_memoire", ["estimate", "--parameters", "7000000000", "--bits", "16", "--format", "table"]),
    ("mesure_memoire", ["environment", "--no-usable-memory"]),
    ("calcul_forfaits", ["--list"]),
    ("calcul_forfaits", ["--gpu", "b200", "--days", "7", "--format", "table"]),
    ("grid", ["check", GRID]),
    ("grid", ["report", GRID, "--format", "json"]),
    ("notebook_strip", [NOTEBOOK]),
]


@pytest.mark.parametrize("module, args", OUTPUTS, ids=[f"{m}-{a[0]}" for m, a in OUTPUTS])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, module, args):
    result = closed_pipe_run(module, *args, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (EXIT_BROKEN_PIPE, "")
    # the same command, read whole: its main(argv) in this process (the closed pipe above needs the
    # fresh process; a whole read does not)
    whole = run_main_in_process(program_main(module), [str(a) for a in args], tmp_path)
    assert whole.returncode == 0 and "Traceback" not in whole.stderr, whole.stderr


def test_runs_into_a_closed_pipe_ends_quietly(tmp_path):
    path = tmp_path / "mesures-h100.json"
    path.write_text(json.dumps(measurement("mesures-h100")), encoding="utf-8")
    result = closed_pipe_run("runs", path.name, "--csv", "runs.csv", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (EXIT_BROKEN_PIPE, "")
    assert (tmp_path / "runs.csv").read_text(encoding="utf-8").startswith("run,")  # written before printing


def test_kit_build_into_a_closed_pipe_keeps_the_whole_zip(tmp_path):
    result = closed_pipe_run("kit", "build", "--output", "kit.zip", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (EXIT_BROKEN_PIPE, "")
    assert run("kit", "verify", "kit.zip", cwd=tmp_path).returncode == 0


def test_sweep_without_gpu_says_so_on_stderr_even_with_stdout_closed(tmp_path):
    result = closed_pipe_run("sweep", "--dimension", "batch", "--values", "1", "2", "--output-dir", "s",
                             cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("sweep: error: ")
    assert "Traceback" not in result.stderr and not (tmp_path / "s").exists()


def test_in_process_main_returns_141_when_stdout_is_gone(mm_program, monkeypatch):
    class Gone:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    assert mm_program.main(["estimate", "--parameters", "10", "--bits", "8"]) == EXIT_BROKEN_PIPE


def test_make_lab_starts_every_notebook_python_without_the_working_folder_on_its_path():
    # -n prints the recipe without running it: JupyterLab and so every kernel it starts inherit
    # PYTHONSAFEPATH=1, so a json.py beside a notebook is never imported in place of the real one
    proc = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if "-m jupyterlab" in line)
    assert line.startswith("PYTHONSAFEPATH=1 "), line


def test_safe_path_keeps_a_json_py_of_the_working_folder_from_being_imported(tmp_path):
    # what PYTHONSAFEPATH=1 (make lab) and -P (the sweep's children) buy: with either, a hostile
    # json.py in the folder is not run; without, `python -m` would import it first
    (tmp_path / "json.py").write_text("raise SystemExit('the folder json.py ran')\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "-m", "lab_helpers.grid", "--help"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert "the folder json.py ran" in plain.stderr  # the hazard is real
    for argv, extra in (([sys.executable, "-P"], {}), ([sys.executable], {"PYTHONSAFEPATH": "1"})):
        proc = subprocess.run([*argv, "-m", "lab_helpers.grid", "--help"], cwd=tmp_path, env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage: grid" in proc.stdout, proc.stderr
