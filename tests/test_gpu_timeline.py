"""measure --timeline and the out-of-memory snapshot on a real CUDA/ROCm GPU (marker `gpu`;
skipped without one). Run on the GPU machine with `pytest -m gpu tests/test_gpu_timeline.py`."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from lab_helpers.allocator.history import OOM_SNAPSHOT_KIND
from lab_helpers.views.timeline import load_timeline, phase_peaks

pytestmark = pytest.mark.gpu
SCRIPT = ROOT / "lab_helpers" / "mesure_memoire.py"
SMALL = ["--batch", "1", "--context", "16", "--width", "64", "--dtype", "float32", "--warmup", "1", "--repeats", "2"]
# inputs of 2**20 x 4096 x 64 float32 = 2**40 bytes (1 TiB): more than any GPU, refused at once
HUGE = ["--batch", str(2**20), "--context", "4096", "--width", "64", "--dtype", "float32"]
HUGE_INPUT_BYTES = 2**20 * 4096 * 64 * 4


@pytest.fixture(autouse=True)
def _needs_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm device (none visible)")


def run(*argv, cwd):
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_timeline_peaks_equal_the_measurement_in_every_phase(tmp_path):
    proc = run(SCRIPT, "measure", "--device", "cuda:0", *SMALL, "--output", "m.json", "--timeline", "t.json",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "t.json"]
    measurement = json.loads((tmp_path / "m.json").read_text())
    timeline = load_timeline(tmp_path / "t.json")
    peaks = phase_peaks(timeline)
    assert [(p["phase"], p["index"]) for p in peaks] == [(p["phase"], p["index"]) for p in measurement["phases"]]
    for got, want in zip(peaks, measurement["phases"]):
        assert got["peak_allocated_bytes"] == want["peak_allocated_bytes"], (got, want)
        assert got["end_allocated_bytes"] == want["end_allocated_bytes"], (got, want)
    labels = [label for label in timeline["events"]["label"] if label]
    assert labels.count("weights") == 4 and labels.count("inputs") == 1
    # the math libraries' workspaces: allocated in the cold pass, never released
    workspace = [size for size, label in zip(timeline["events"]["size_bytes"], timeline["events"]["label"])
                 if label == "workspace"]
    cold = next(p for p in measurement["phases"] if p["phase"] == "cold_forward")
    assert sum(workspace) > 0 and sum(workspace) <= cold["end_allocated_bytes"]
    proc = run("-m", "lab_helpers.timeline", "plot", tmp_path / "t.json", "--output", tmp_path / "t.png", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_out_of_memory_with_timeline_saves_the_snapshot_and_explain_names_the_request(tmp_path):
    proc = run(SCRIPT, "measure", "--device", "cuda:0", *HUGE, "--output", "m.json", "--timeline", "t.json",
               cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("\n") == 1 and "phase inputs failed" in proc.stderr
    assert proc.stderr.endswith("no file written; out-of-memory snapshot: t.oom.json\n"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.oom.json"]
    document = json.loads((tmp_path / "t.oom.json").read_text())
    assert document["kind"] == OOM_SNAPSHOT_KIND and document["phase"] == "inputs"
    assert document["snapshot_source"] == "observer", document.get("observer_problem")
    assert document["failed_request_bytes"] == HUGE_INPUT_BYTES
    assert document["device_free_bytes"] < HUGE_INPUT_BYTES
    proc = run("-m", "lab_helpers.timeline", "explain", tmp_path / "t.oom.json", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"{HUGE_INPUT_BYTES} bytes" in proc.stdout and "EXHAUSTION" in proc.stdout
    proc = run("-m", "lab_helpers.timeline", "explain", tmp_path / "t.oom.json", "--format", "json", cwd=ROOT)
    assert proc.returncode == 0 and json.loads(proc.stdout)["request_bytes"] == HUGE_INPUT_BYTES
