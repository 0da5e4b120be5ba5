"""lab_helpers.build.bytecode: the bytecode of what an answer imports, written once at the venv's set-up
(.ci/venv.sh installs with --no-compile, and where PYTHONDONTWRITEBYTECODE is set Python never writes
what it compiles): a file Python then reads instead of compiling, and a module that cannot be written
left to be compiled on import."""
import os
import subprocess
import sys
import types
from importlib.machinery import ModuleSpec
from pathlib import Path

from lab_helpers.build import bytecode

ROOT = Path(__file__).resolve().parents[1]


def module_at(path: Path, cached: Path) -> types.ModuleType:
    module = types.ModuleType(path.stem)
    module.__spec__ = ModuleSpec(path.stem, None, origin=str(path))
    module.__spec__.cached = str(cached)
    return module


def test_the_bytecode_written_is_what_python_reads_instead_of_compiling(tmp_path):
    source = tmp_path / "answer_module.py"
    source.write_text("VALUE = 6 * 7\n")
    cached = tmp_path / "__pycache__" / f"answer_module.{sys.implementation.cache_tag}.pyc"
    builtin = types.ModuleType("no_source")  # a module with no .py origin is passed over
    assert bytecode.write_bytecode([module_at(source, cached), builtin]) == 1 and cached.is_file()
    # a fresh Python that may not write bytecode loads the module from the file written (-v says so)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import answer_module; print(answer_module.VALUE)"
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPYCACHEPREFIX"}  # the tests'
    proc = subprocess.run([sys.executable, "-B", "-v", "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**environment, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.stdout.split() == ["42"], proc.stderr[-500:]
    assert f"# {cached} matches {source}" in proc.stderr, [line for line in proc.stderr.splitlines()
                                                           if "answer_module" in line]
    cached.write_bytes(b"not bytecode")  # a damaged file is written again
    assert bytecode.write_bytecode([module_at(source, cached)]) == 1 and cached.read_bytes() != b"not bytecode"


def test_a_file_that_cannot_be_written_or_compiled_is_left(tmp_path):
    source = tmp_path / "broken.py"
    source.write_text("def (:\n")  # not Python
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    good = tmp_path / "good.py"
    good.write_text("X = 1\n")
    assert bytecode.write_bytecode([module_at(source, tmp_path / "broken.pyc"),
                                    module_at(good, blocked / "good.pyc")]) == 0  # a folder that is a file
    assert not (tmp_path / "broken.pyc").exists()


def test_every_module_named_is_one_an_answer_can_import():
    """Each name is found where it is installed (find_spec imports its parent packages only: transformers'
    are lazy), so that no family's modeling code goes uncompiled behind a wrong name."""
    import importlib.util
    names = bytecode.answer_module_names()
    assert {"llama", "qwen2", "mistral", "gemma2", "gpt2", "gemma3_text"} <= set(bytecode.bundled_model_types())
    assert "transformers.models.gemma3.modeling_gemma3" in names  # gemma3_text's folder
    # peft's submodule is left out: finding it imports peft, which imports bitsandbytes (seconds)
    missing = [name for name in names if name != "peft.tuners.lora" and importlib.util.find_spec(name) is None]
    assert missing == [] and "peft.tuners.lora" in names


def test_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.build.bytecode", "extra"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "bytecode: error: no arguments, got 'extra'"
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.build.bytecode", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "PYTHONDONTWRITEBYTECODE" in proc.stdout
