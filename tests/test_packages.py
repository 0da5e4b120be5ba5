"""lab_helpers.core.packages: the lab's packages looked up without being imported, and the one line a
command gives when one is missing, with the exact command that installs it into the Python in use."""
import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab_helpers.core import packages
from lab_helpers.core.errors import LabError

ROOT = Path(__file__).resolve().parents[1]


def test_a_present_package_is_required_without_a_word():
    assert packages.require("transformers", "predict") is None
    assert packages.package_installed("transformers")


def absent(monkeypatch, *names):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def test_an_absent_package_is_one_line_naming_the_version_and_the_command(monkeypatch):
    absent(monkeypatch, "peft")
    with pytest.raises(LabError) as caught:
        packages.require("peft", "--train lora")
    message = str(caught.value)
    assert "\n" not in message
    python = packages.python_command()
    assert message == (f"--train lora needs peft 0.21.2, not installed in this Python: "
                       f"{python} -m pip install 'peft==0.21.2'")


def test_a_lower_bound_reads_as_or_newer(monkeypatch):
    absent(monkeypatch, "tqdm")
    with pytest.raises(LabError, match=r"^sweep needs tqdm 4\.60 or newer, not installed in this Python: "
                                       r".* -m pip install 'tqdm>=4\.60'$"):
        packages.require("tqdm", "sweep")


def test_an_unknown_package_is_a_programming_error():
    with pytest.raises(KeyError, match="not one of the lab's packages"):
        packages.require("torch", "measure")  # never offered: pip's torch is a multi-GB CUDA build


@pytest.mark.parametrize("cwd_is_top, prefix_is_venv, expected", [
    (True, True, ".venv/bin/python"),
    (False, True, "{exe}"),
    (True, False, "{exe}"),
])
def test_the_python_is_relative_only_at_the_top_in_the_repositorys_venv(monkeypatch, tmp_path, cwd_is_top,
                                                                         prefix_is_venv, expected):
    venv = ROOT / ".venv"
    exe = str(venv / "bin" / "python") if prefix_is_venv else "/opt/other python/bin/python3"
    monkeypatch.setattr(sys, "executable", exe)
    monkeypatch.setattr(sys, "prefix", str(venv) if prefix_is_venv else "/opt/other python")
    monkeypatch.chdir(ROOT if cwd_is_top else tmp_path)
    command = packages.install_command("bitsandbytes")
    quoted = f"'{exe}'" if " " in exe else exe
    assert command == f"{expected.format(exe=quoted)} -m pip install 'bitsandbytes==0.50.2'"


def test_the_real_message_in_a_python_that_cannot_import_peft(tmp_path):
    """A child whose meta path refuses peft and bitsandbytes: the lab's messages, run from the
    repository's top with this Python, name this very Python; the command is runnable as printed."""
    code = ("import sys\n"
            "class Refuse:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('peft', 'bitsandbytes'): raise ModuleNotFoundError(name=name)\n"
            "sys.meta_path.insert(0, Refuse())\n"
            "from lab_helpers.real.train import import_peft\n"
            "from lab_helpers.real.quantized import _import_bitsandbytes\n"
            "for lookup in (import_peft, _import_bitsandbytes):\n"
            "    try:\n"
            "        lookup()\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line, quantize = proc.stdout.strip().splitlines()
    assert line.startswith("LabError --train lora needs peft 0.21.2, not installed in this Python: "), line
    assert quantize == line.replace("--train lora", "--quantize").replace("peft", "bitsandbytes").replace(
        "0.21.2", "0.50.2")
    command = line.split(": ", 1)[1]
    assert command.endswith(" -m pip install 'peft==0.21.2'")
    python = command.split(" -m pip")[0]
    here = Path(sys.executable)
    shown = Path(python) if Path(python).is_absolute() else ROOT / python
    assert shown == here or shown.resolve() == here.resolve()


def test_the_table_agrees_with_requirements_txt():
    wanted = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            match = re.match(r"([A-Za-z0-9_.-]+)\s*([=<>!~]=?[^;\s]*)?", line)
            wanted[match.group(1).lower()] = match.group(2) or ""
    for name, package in packages.PACKAGES.items():
        assert wanted.get(name) == package.requirement, name


def test_the_module_imports_only_the_standard_library():
    tree = ast.parse(Path(packages.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - {"lab_helpers"} <= set(sys.stdlib_module_names)
    # and lab_helpers.core.errors, its one lab module, imports only the standard library itself
    code = ("import sys; before = set(sys.modules); import lab_helpers.core.packages; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new - set(sys.stdlib_module_names) - {'lab_helpers'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONSAFEPATH": ""})
    assert proc.stdout.strip() == "[]", proc.stderr


def test_the_versions_in_a_traces_key_are_the_imported_ones_read_without_importing():
    """installed_version reads torch's and transformers' __version__ from their own files: the same
    strings the imported packages give, while neither is imported."""
    code = ("import sys; from lab_helpers.core.packages import installed_version as v; "
            "versions = (v('torch'), v('transformers')); "
            "before = [n for n in ('torch', 'transformers') if n in sys.modules]; "
            "import torch, transformers; print(before, versions == (torch.__version__, transformers.__version__))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.split("\n")[-2] == "[] True", proc.stderr[-500:]


@pytest.mark.parametrize("files, expected, imported", [
    ({"version.py": "__version__ = '1.2.3+cpu'\n", "__init__.py": "raise ImportError('never run')\n"}, "1.2.3+cpu",
     False),
    ({"__init__.py": '"""doc"""\n__version__ = "4.5.6"\nraise ImportError("never run")\n'}, "4.5.6", False),
    ({"__init__.py": "__version__ = '.'.join(['7', '8'])\n"}, "7.8", True),  # not a literal: imported
])
def test_a_version_is_read_from_the_package_files_and_only_computed_one_imported(tmp_path, monkeypatch, files,
                                                                                    expected, imported):
    name = f"fake_package_{len(files)}_{int(imported)}"
    (tmp_path / name).mkdir()
    for file, text in files.items():
        (tmp_path / name / file).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    packages.installed_version.cache_clear()
    assert packages.installed_version(name) == expected
    assert (name in sys.modules) == imported
    sys.modules.pop(name, None)
