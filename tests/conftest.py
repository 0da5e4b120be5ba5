"""Shared fixtures: every behaviour test runs against the library module AND the
copy inlined in the notebook (the adapter below turns a notebook cell back into a
module file), so the notebook copy is tested, not only compared."""
import importlib.util
import shutil
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = ("library", "notebook")
MAIN_TRAILER = '\n\nif __name__ == "__main__":\n    sys.exit(main())\n'


def _notebook_for(source: str) -> str:
    from lab_helpers import notebook_sync  # needs nbformat: imported here so the GPU tests run without it
    for notebook, sources in notebook_sync.NOTEBOOK_SOURCES.items():
        if source in sources:
            return notebook
    raise KeyError(source)


def implementation_file(kind: str, source: str, workdir: Path) -> Path:
    """Return a runnable .py file for `source` taken from the library or its notebook."""
    if kind == "library":
        return ROOT / source
    # what the notebook's kernel has defined once that cell has run
    from lab_helpers import notebook_sync
    code = notebook_sync.notebook_code_upto(_notebook_for(source), source)
    path = workdir / Path(source).name
    path.write_text(code + (MAIN_TRAILER if "def main(" in code else ""), encoding="utf-8")
    return path


def load_module(path: Path):
    """Import the file at `path` as a fresh module."""
    name = f"_impl_{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _impl_fixture(source: str):
    @pytest.fixture(scope="session", params=IMPLEMENTATIONS)
    def fixture(request, tmp_path_factory):
        workdir = tmp_path_factory.mktemp(f"impl-{request.param}")
        path = implementation_file(request.param, source, workdir)
        return path, load_module(path)
    return fixture


mm_impl = _impl_fixture("lab_helpers/mesure_memoire.py")
calc_impl = _impl_fixture("lab_helpers/calcul_forfaits.py")


@pytest.fixture(scope="session")
def mm(mm_impl):
    """The mesure_memoire module (library or notebook copy)."""
    return mm_impl[1]


@pytest.fixture(scope="session")
def mm_script(mm_impl):
    """Path of a runnable mesure_memoire.py (library or notebook copy)."""
    return mm_impl[0]


@pytest.fixture(scope="session")
def calc(calc_impl):
    """The calcul_forfaits module (library or notebook copy)."""
    return calc_impl[1]


@pytest.fixture(scope="session")
def calc_script(calc_impl):
    """Path of a runnable calcul_forfaits.py (library or notebook copy)."""
    return calc_impl[0]


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


plots_impl = _impl_fixture("lab_helpers/plots.py")


@pytest.fixture(scope="session")
def plots(plots_impl):
    """The plots module (library or notebook copy)."""
    return plots_impl[1]


def full_measurement(mm, config, shift=0):
    """A schema-valid measurement document whose counters are `config`'s prediction (a fixture:
    no GPU made it). `shift` bytes are added to the last record's peak allocated."""
    document = mm.predict(config)
    for key in ("workspace", "reserved_assumptions"):
        del document[key]
    document["kind"] = "iteragpu-lab measurement"
    document["environment"] = {
        "python_version": "3.12.3", "torch_version": "2.11.0+cu130", "cuda_build_version": "13.0",
        "hip_build_version": None, "runtime_note": "note", "device": "cuda:0", "device_count": 1,
        "device_visible": True, "device_name": "NVIDIA H200", "compute_capability": "9.0",
        "total_memory_bytes": 150754820096, "free_memory_bytes": 150000000000}
    for phase in document["phases"]:
        phase.update(seconds=0.002, device_seconds=0.001)
        if phase["phase"] == "warm_forward":
            phase.update(achieved_tflops=1.5, host_to_device_time_ratio=2.0)
    document["phases"][-1]["peak_allocated_bytes"] += shift
    return document
