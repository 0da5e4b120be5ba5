"""The packages `make lab` installs that a command may need, looked up without being imported.

`require("peft", "--train lora")` raises a LabError (one line, exit 2) when this Python cannot import
peft, naming the exact command that installs the version the lab is checked with into this Python:

    --train lora needs peft 0.21.2, not installed in this Python: .venv/bin/python -m pip install 'peft==0.21.2'

Standard library only: a lookup with importlib.util.find_spec never runs the package's code (peft and
bitsandbytes import torch, seconds of CPU), so a command can check before it starts any work.
"""
import functools
import importlib.util
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from lab_helpers.core.errors import LabError
from lab_helpers.core.paths import REPOSITORY


@dataclass(frozen=True)
class Package:
    name: str         # the top-level module, as imported; also the name pip installs
    requirement: str  # what requirements.txt asks for: "==0.21.2" or ">=4.60"

    @property
    def version(self) -> str:
        """The version as a sentence says it: "0.21.2", "4.60 or newer"."""
        if self.requirement.startswith("=="):
            return self.requirement[2:]
        return f"{self.requirement[2:]} or newer"

    @property
    def pip_requirement(self) -> str:
        return f"{self.name}{self.requirement}"


# requirements.txt's packages a command may need (tests/test_packages.py checks they agree). torch is
# not here on purpose: `pip install torch` brings a multi-GB CUDA build, or replaces a GPU box's own.
PACKAGES = {package.name: package for package in (
    Package("transformers", "==5.17.0"),
    Package("peft", "==0.21.2"),
    Package("bitsandbytes", "==0.50.2"),
    Package("tqdm", ">=4.60"),
    Package("pandas", ">=2"),
    Package("matplotlib", ">=3.7"),
    Package("nbformat", ">=5.9"),
)}


def package_installed(name: str) -> bool:
    """Whether this Python can find the top-level module `name`, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # already imported, with no __spec__
        return True


def python_command() -> str:
    """This Python as a shell command: relative (.venv/bin/python) when it is the repository's .venv
    and the current folder is the repository's top, else its absolute path."""
    executable = sys.executable or "python3"
    try:
        in_venv = Path(sys.prefix).resolve() == (REPOSITORY / ".venv").resolve()
        at_top = Path.cwd().resolve() == REPOSITORY
    except OSError:  # the current folder was removed
        in_venv = at_top = False
    if in_venv and at_top and os.path.isabs(executable):
        relative = os.path.relpath(executable, REPOSITORY)
        if not relative.startswith(os.pardir):
            return shlex.quote(relative)
    return shlex.quote(os.path.abspath(executable))


def install_command(name: str) -> str:
    """The command that installs package `name`, at the lab's version, into this Python."""
    return f"{python_command()} -m pip install '{PACKAGES[name].pip_requirement}'"


def missing_message(name: str, purpose: str) -> str:
    package = PACKAGES[name]
    return f"{purpose} needs {name} {package.version}, not installed in this Python: {install_command(name)}"


def require(name: str, purpose: str) -> None:
    """Nothing when this Python can import package `name` (one of PACKAGES); else a LabError naming
    `purpose` (what needs it: "--train lora", "--quantize") and the exact command that installs it."""
    if name not in PACKAGES:
        raise KeyError(f"{name!r} is not one of the lab's packages: {', '.join(PACKAGES)}")
    if not package_installed(name):
        raise LabError(missing_message(name, purpose))


# a version written as a literal in the package's own files (torch/version.py, transformers/__init__.py)
_LITERAL_VERSION = re.compile(r"""^__version__\s*=\s*['"]([^'"\\]+)['"]\s*$""", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def installed_version(name: str) -> str:
    """The __version__ of package `name`, the one `import name` would load, read without running its
    code: from the literal assignment in its version.py, else its __init__.py (torch, transformers: a
    warm answer, its traces kept, needs neither); where there is none, imported (an absent package
    then raises ImportError, which the command line turns into its one line)."""
    try:
        spec = importlib.util.find_spec(name)
    except ValueError:  # already imported, with no __spec__
        spec = None
    if spec is not None and spec.origin and spec.submodule_search_locations:
        folder = Path(spec.origin).parent
        for file in ("version.py", "__init__.py"):
            try:
                found = _LITERAL_VERSION.search((folder / file).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
            if found:
                return found.group(1)
    return __import__(name).__version__
