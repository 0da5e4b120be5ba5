"""Every command of README.md's ```bash blocks, run as printed from the top of the repository, in a
Python that has what `make lab` installs and nothing of the test tools: a command that needs a package
only `make test` brings fails here, as it would for a reader of the README.

The commands run through bash in a scratch folder whose entries are links to the repository's, so an
output file lands there, never in the repository; their trace cache is one scratch XDG_CACHE_HOME
shared by the module. `.venv/bin/...` is run literally when the repository has its .venv; without one
(a checkout whose tests run with another Python) the same program of this Python is run instead.
A command that needs a GPU is listed in GPU_ONLY with the one line it ends with where there is none."""
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cuda_available

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
# set up the environment, not commands of the tour: `make lab` starts JupyterLab, `make test` is CI
NOT_RUN = {"make lab", "make test"}
# (a pattern matching exactly one README command, the line on stderr it ends with, exit 2, where no
# GPU is visible). `environment --device cuda:0` is not here: it reports the missing device and exits 0.
GPU_ONLY = [
    (r"lab_helpers\.real_model measure ",
     "real_model: error: measure runs on a CUDA or ROCm GPU, never on the CPU, and this machine has no CUDA or ROCm "
     "device (no /dev/nvidia* and no /dev/kfd); `real_model predict` with the same run's flags predicts it with no GPU"),
    (r"lab_helpers\.real_model compare mesures-llama\.json",
     "real_model: error: cannot read mesures-llama.json: no such file"),
    (r"iteragpu-memory measure ",
     "mesure_memoire: error: no CUDA/ROCm device is available to torch; measure never falls back to the CPU"),
    (r"iteragpu-memory compare mesures-petit-essai\.json",
     "mesure_memoire: error: cannot read mesures-petit-essai.json: no such file"),
]
TIMEOUT_S = 300


def readme_commands() -> list:
    """Each command line of README.md's ```bash blocks, `\\` continuations joined, as bash reads it."""
    commands, block, pending = [], False, ""
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            block = line.strip() == "```bash" and not block
            continue
        if not block:
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1].rstrip() + " "
            continue
        pending = ""
        text = re.sub(r"(^|\s)#.*$", "", text).strip()  # a comment, as bash drops it
        if text:
            commands.append(text)
    assert not pending, "a bash block of README.md ends in a `\\` continuation"
    return commands


COMMANDS = readme_commands()
RUN = [command for command in COMMANDS if command not in NOT_RUN]


def gpu_line(command: str):
    """The refusal line `command` ends with without a GPU, or None for a command that needs none."""
    lines = [line for pattern, line in GPU_ONLY if re.search(pattern, command)]
    assert len(lines) <= 1, command
    return lines[0] if lines else None


CPU_COMMANDS = [command for command in RUN if gpu_line(command) is None]
GPU_COMMANDS = [command for command in RUN if gpu_line(command) is not None]


def test_the_lists_name_the_readme_commands():
    """Every GPU_ONLY pattern matches exactly one README command, and only `make` is left unrun: a
    command added to the README runs here, or is listed with its reason."""
    for pattern, _ in GPU_ONLY:
        assert len([command for command in COMMANDS if re.search(pattern, command)]) == 1, pattern
    assert {command for command in COMMANDS if command.split()[0] == "make"} == NOT_RUN
    assert len(CPU_COMMANDS) >= 8


def test_the_readme_bash_blocks_have_no_placeholders():
    """Copy-pasteable: no `[--option]`, no `<value>`, no `path/to/...`, no N or CARD left for the
    reader to fill in, no `...`."""
    for command in COMMANDS:
        words = shlex.split(command)
        assert not re.search(r"\[[^\]]*\]|<[^>]*>|\.\.\.|path/to/", command), command
        for flag, value in zip(words, words[1:]):
            if flag.startswith("--"):
                assert not re.fullmatch(r"[A-Z][A-Z_]*", value), f"{flag} {value}: a placeholder in {command}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path: Path) -> list:
    names = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.append(canonical(re.match(r"[A-Za-z0-9._-]+", line).group()))
    return names


def lab_distributions() -> set:
    """requirements.txt's distributions and everything they require, as installed here: what
    `make lab` brings (a dependency behind an extra or an unmet marker is counted too: blocked less)."""
    seen, todo = set(), requirement_names(ROOT / "requirements.txt")
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" not in requirement.partition(";")[2]:
                todo.append(canonical(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group()))
    return seen


def modules_only_make_test_brings() -> set:
    """The top-level modules of the distributions that `make test` adds and `make lab` does not bring."""
    test_only = set(requirement_names(ROOT / ".ci" / "requirements-test.txt")) - lab_distributions()
    modules = set()
    for module, distributions in importlib.metadata.packages_distributions().items():
        if any(canonical(distribution) in test_only for distribution in distributions):
            modules.add(module)
    return modules


BLOCKER = '''"""Made by tests/test_readme_commands.py: this Python as `make lab` sets it up, without the test tools."""
import importlib.machinery
import importlib.util
import os
import sys

BLOCKED = frozenset({blocked!r})


class TestToolsAbsent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, TestToolsAbsent())
_find_spec = importlib.util.find_spec


def find_spec(name, package=None):
    if name.partition(".")[0] in BLOCKED:
        return None  # what a lookup answers where the package is not installed
    return _find_spec(name, package)


importlib.util.find_spec = find_spec
# a sitecustomize of this Python's own, if any, still runs
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def entry_point_commands() -> dict:
    """iteragpu-X: the module and function pyproject.toml's [project.scripts] makes it run."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return {name: target.split(":") for name, target in re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, re.M)}


def as_run(command: str) -> str:
    """`command` as bash runs it here: as printed when the repository has its .venv, else with this
    Python in place of .venv/bin/python and of the .venv/bin/iteragpu-* scripts."""
    if VENV_PYTHON.exists():
        return command
    python = shlex.quote(sys.executable)
    for name, (module, function) in entry_point_commands().items():
        code = shlex.quote(f"import sys; from {module} import {function}; sys.exit({function}())")
        command = re.sub(rf"(^|\s)\.venv/bin/{re.escape(name)}(?=\s|$)", rf"\g<1>{python} -c {code}", command)
    return re.sub(r"(^|\s)\.venv/bin/python(?=\s|$)", rf"\g<1>{python}", command)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(folder, environment): a scratch top of the repository (links to its entries) and the
    environment of a `make lab` shell: the test tools unimportable, one trace cache for the module."""
    scratch = tmp_path_factory.mktemp("readme")
    top = scratch / "top"
    top.mkdir()
    for entry in ROOT.iterdir():
        (top / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    blocker = scratch / "blocker"
    blocker.mkdir()
    blocked = sorted(modules_only_make_test_brings())
    (blocker / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked), encoding="utf-8")
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("PYTEST_", "PYTHONPATH", "COV_"))}
    path = [str(blocker)] + ([] if VENV_PYTHON.exists() else [str(ROOT)])
    environment.update(PYTHONPATH=os.pathsep.join(path), XDG_CACHE_HOME=str(scratch / "cache"))
    yield top, environment, blocked
    for entry in top.iterdir():  # what the commands wrote; the links stay out of it
        if not entry.is_symlink():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def run_readme(command: str, lab):
    top, environment, _ = lab
    before = {entry.name for entry in top.iterdir()}
    started = time.monotonic()
    proc = subprocess.run(["bash", "-c", as_run(command)], cwd=top, env=environment, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    written = {entry.name for entry in top.iterdir()} - before
    print(f"{time.monotonic() - started:.1f} s, exit {proc.returncode}: {command}")
    return proc, written


def test_the_test_tools_are_absent_in_the_lab_environment(lab):
    top, environment, blocked = lab
    assert {"pytest", "hypothesis", "nbval", "xdist"} <= set(blocked), blocked
    assert "jsonschema" not in blocked  # JupyterLab brings it: `make lab` has it
    code = ("import importlib.util, sys\n"
            "for name in sys.argv[1:]:\n"
            "    assert importlib.util.find_spec(name) is None, name\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ModuleNotFoundError as exc:\n"
            "        assert exc.name == name\n"
            "    else:\n"
            "        raise AssertionError(name)\n"
            "import lab_helpers.core.packages as p; print(p.package_installed('peft'), p.package_installed('transformers'))\n")
    proc = subprocess.run([sys.executable, "-c", code, *blocked], cwd=top, env=environment,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def short(command: str) -> str:
    return re.sub(r"\.venv/bin/(python -m lab_helpers\.)?", "", command)[:70]


@pytest.mark.parametrize("command", CPU_COMMANDS, ids=short)
def test_a_readme_command_runs_as_printed(command, lab):
    proc, _ = run_readme(command, lab)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip()
    assert not re.search(r"Traceback|not installed|needs \w+ \d", proc.stderr), proc.stderr[-2000:]
    if "environment --device cuda:0" in command and not cuda_available():
        assert '"devices": []' in proc.stdout


@pytest.mark.parametrize("command", GPU_COMMANDS, ids=short)
def test_a_gpu_command_refuses_in_one_line_without_a_gpu(command, lab):
    if cuda_available():
        pytest.skip("a GPU is visible: test_the_gpu_commands_run_on_a_gpu runs this command")
    proc, written = run_readme(command, lab)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, gpu_line(command) + "\n", ""), proc.stderr
    assert not written


@pytest.mark.gpu
def test_the_gpu_commands_run_on_a_gpu(lab):
    """In README order: each measurement is written, then compared."""
    for command in GPU_COMMANDS:
        proc, _ = run_readme(command, lab)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
