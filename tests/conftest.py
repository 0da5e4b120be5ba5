"""Shared fixtures: every behaviour test runs where users run the code. A module fixture runs
on the generated standalone file (what the kit ships) and on the notebook's generated cells (what
a notebook's kernel defines); a command-line fixture runs the standalone file and the package's
own entry, so the generated copy is tested, not only compared."""
import atexit
import importlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import json
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# One scratch folder per test session, made by the first process that loads this file (pytest's
# controller, before it starts its workers) and inherited by the workers and every command a test
# starts; that process removes it at exit.
# - Predictions keep their traces under the user's cache folder: the tests' go to this folder, never
#   to the user's, and both workers share them (the cache writes through a temporary file and a rename).
# - Bytecode: where the environment forbids writing it (PYTHONDONTWRITEBYTECODE), every Python a test
#   starts would compile torch's and transformers' sources again, about a second of CPU each. The
#   session compiles them once, into this folder (never beside the sources).
if "ITERAGPU_TEST_SCRATCH" not in os.environ:
    _scratch = Path(tempfile.mkdtemp(prefix="iteragpu-lab-test-"))
    atexit.register(shutil.rmtree, _scratch, True)
    os.environ.update(ITERAGPU_TEST_SCRATCH=str(_scratch), XDG_CACHE_HOME=str(_scratch / "cache"),
                      PYTHONPYCACHEPREFIX=str(_scratch / "bytecode"))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
sys.dont_write_bytecode = False
GENERATED_TAG = "generated-from:"
MODULE_KINDS = ("standalone", "notebook")
COMMAND_KINDS = ("standalone", "package")
# (standalone file, the notebook whose generated cells define the same functions, the package module
# whose main() the standalone file runs)
IMPLEMENTATIONS = {
    "mesure_memoire": ("lab_helpers/mesure_memoire.py", "notebooks/mesure-memoire.ipynb",
                       "lab_helpers.synthetic.commands"),
    "calcul_forfaits": ("lab_helpers/calcul_forfaits.py", "notebooks/forfaits.ipynb",
                        "lab_helpers.pricing.commands"),
}


def notebook_cells_code(notebook: str) -> str:
    """The code of every generated cell of `notebook`, in order: what its kernel has defined once
    those cells have run (read as JSON: the GPU tests run without nbformat)."""
    cells = json.loads((ROOT / notebook).read_text(encoding="utf-8"))["cells"]
    parts = []
    for cell in cells:
        if any(tag.startswith(GENERATED_TAG) for tag in cell.get("metadata", {}).get("tags", [])):
            source = cell["source"]
            parts.append(source if isinstance(source, str) else "".join(source))
    return "\n\n".join(parts)


def load_module(path: Path):
    """Import the file at `path` as a fresh module."""
    name = f"_impl_{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def implementation_module(kind: str, name: str, workdir: Path):
    """The module `name` as the standalone file or as the notebook's cells define it."""
    standalone, notebook, _ = IMPLEMENTATIONS[name]
    if kind == "standalone":
        return load_module(ROOT / standalone)
    path = workdir / f"{name}_notebook_cells.py"
    path.write_text(notebook_cells_code(notebook), encoding="utf-8")
    return load_module(path)


def command_script(kind: str, name: str, workdir: Path) -> Path:
    """A runnable .py file of program `name`: the standalone file, or a starter of the package's main()."""
    standalone, _, package_module = IMPLEMENTATIONS[name]
    if kind == "standalone":
        return ROOT / standalone
    path = workdir / f"{name}_package.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom {package_module} import main\n"
                    "sys.exit(main())\n", encoding="utf-8")
    return path


def command_module(kind: str, name: str):
    """A module with the program's main(), its globals patchable: the standalone file, or the package's
    commands module."""
    standalone, _, package_module = IMPLEMENTATIONS[name]
    return load_module(ROOT / standalone) if kind == "standalone" else importlib.import_module(package_module)


def _module_fixture(name: str):
    @pytest.fixture(scope="session", params=MODULE_KINDS)
    def fixture(request, tmp_path_factory):
        return implementation_module(request.param, name, tmp_path_factory.mktemp(f"impl-{request.param}"))
    return fixture


def _script_fixture(name: str):
    @pytest.fixture(scope="session", params=COMMAND_KINDS)
    def fixture(request, tmp_path_factory):
        return command_script(request.param, name, tmp_path_factory.mktemp(f"cli-{request.param}"))
    return fixture


def _program_fixture(name: str):
    @pytest.fixture(scope="session", params=COMMAND_KINDS)
    def fixture(request):
        return command_module(request.param, name)
    return fixture


mm = _module_fixture("mesure_memoire")
mm.__doc__ = "The mesure_memoire functions (standalone file or notebook cells)."
mm_script = _script_fixture("mesure_memoire")
mm_program = _program_fixture("mesure_memoire")
calc = _module_fixture("calcul_forfaits")
calc_script = _script_fixture("calcul_forfaits")
calc_program = _program_fixture("calcul_forfaits")


def gpu_child_environment(device: str, base: dict = None) -> tuple:
    """(environment, device) for a GPU test's child processes, from `base` (default: this process's
    environment): the test's GPU made the only one they see, as cuda:0, unless CUDA_VISIBLE_DEVICES
    already chose the GPUs."""
    base = dict(os.environ if base is None else base)
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return base, device
    from lab_helpers.core.numbers import parse_device
    return {**base, "CUDA_VISIBLE_DEVICES": str(parse_device(device))}, "cuda:0"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A measurement's environment as an H200 records it (the fixtures below: no GPU made them).
H200_ENVIRONMENT = {
    "python_version": "3.12.3", "torch_version": "2.11.0+cu130", "cuda_build_version": "13.0",
    "hip_build_version": None, "runtime_note": "note", "device": "cuda:0", "device_count": 1,
    "device_visible": True, "device_name": "NVIDIA H200", "compute_capability": "9.0",
    "total_memory_bytes": 150754820096, "free_memory_bytes": 150000000000}


def training_measurement(prediction, model_key="model", shift=0):
    """A schema-valid training measurement whose counters are `prediction`'s (a fixture: no GPU
    made it); `shift` bytes are added to the last record's peak allocated. `model_key`: "model" for
    a transformers model, "synthetic_model" for the synthetic network."""
    document = {k: prediction[k] for k in ("schema_version", "configuration", model_key)}
    document["kind"] = "iteragpu-lab measurement"
    document["environment"] = dict(H200_ENVIRONMENT)
    document["phases"] = [{**{k: v for k, v in p.items() if k != "end_allocated_bytes_by_kind"},
                           "seconds": 0.002, "device_seconds": 0.001} for p in prediction["phases"]]
    document["phases"][-1]["peak_allocated_bytes"] += shift
    return document


def full_measurement(mm, config, shift=0):
    """A schema-valid measurement document whose counters are `config`'s prediction (a fixture:
    no GPU made it). `shift` bytes are added to the last record's peak allocated."""
    document = mm.predict(config)
    for key in ("workspace", "reserved_assumptions", "budget", "cache_releases"):  # a prediction's own
        document.pop(key, None)
    document["kind"] = "iteragpu-lab measurement"
    document["environment"] = dict(H200_ENVIRONMENT)
    for phase in document["phases"]:
        phase.update(seconds=0.002, device_seconds=0.001)
        if phase["phase"] == "warm_forward":
            phase.update(achieved_tflops=1.5, host_to_device_time_ratio=2.0)
    document["phases"][-1]["peak_allocated_bytes"] += shift
    return document


# What a fresh Python shows of warnings (its default filters, non-debug build): an in-process row
# then sees the same warning lines on stderr that a subprocess row would, whatever pytest filters.
FRESH_PYTHON_WARNING_FILTERS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                                ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                                ("ignore", ResourceWarning, ""))


def run_main_in_process(main, argv, cwd, *, stdin_bytes=None, stdin_file=None,
                        text=True) -> subprocess.CompletedProcess:
    """`main(argv)` run in this process from the folder `cwd`, answered as a subprocess run would be:
    exit code, stdout and stderr (text, or bytes with `text=False`; an uncaught exception becomes its
    traceback on stderr, so a test that refuses tracebacks fails on it; a warning becomes the lines a
    fresh Python prints). stdin is empty, `stdin_bytes`, or the file at `stdin_file` (e.g. /dev/zero).
    The hostile tables run most rows this way and a sample as real subprocesses: the same program and
    checks, without a fresh interpreter per row. Rows that could hang (a FIFO, a device) stay
    subprocesses, whose timeout guards them."""
    import contextlib
    import io
    import os
    import traceback
    import warnings
    os.environ.setdefault("MPLBACKEND", "Agg")
    # utf-8 like the subprocess's streams; stderr's errors as Python's own stderr
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", write_through=True)
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace", write_through=True)
    stdin_source = open(stdin_file, "rb") if stdin_file is not None else io.BytesIO(stdin_bytes or b"")
    stdin = io.TextIOWrapper(stdin_source, encoding="utf-8")
    here, old_stdin = os.getcwd(), sys.stdin
    os.chdir(cwd)
    sys.stdin = stdin
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            for action, category, module in reversed(FRESH_PYTHON_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            try:
                try:
                    code = main(list(argv))
                except SystemExit as exc:  # argparse's --help and usage errors
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                except Exception:
                    err.write(traceback.format_exc())
                    code = 1
            finally:
                for warning in caught:
                    err.write(warnings.formatwarning(warning.message, warning.category, warning.filename,
                                                     warning.lineno, warning.line))
        out.flush()
        err.flush()
    finally:
        sys.stdin = old_stdin
        stdin.close()
        os.chdir(here)
    stdout, stderr = out_bytes.getvalue(), err_bytes.getvalue()
    if text:
        stdout, stderr = stdout.decode("utf-8", "surrogateescape"), stderr.decode("utf-8", "surrogateescape")
    return subprocess.CompletedProcess(list(argv), code, stdout, stderr)
