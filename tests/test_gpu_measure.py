"""Real measurements on a CUDA/ROCm GPU (marker `gpu`; skipped without one).

Run on the H200 with `pytest -m gpu`. Set ITERAGPU_REPORT_DIR to also write the
predicted-vs-measured table of the twelve acceptance configurations there."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from conftest import ROOT

pytestmark = pytest.mark.gpu
LIBRARY_SCRIPT = ROOT / "lab_helpers" / "mesure_memoire.py"
SCHEMA = json.loads((ROOT / "lab_helpers" / "measurement.schema.json").read_text())
SMALL = ["--batch", "1", "--context", "16", "--width", "64", "--dtype", "float32", "--warmup", "1", "--repeats", "2"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# (batch, context, width, hidden): the seed's small and larger commands, an odd size and a
# multi-GiB one; each in three dtypes, with the larger command's --warmup 3 --repeats 5.
SEED_INPUTS = {(1, 16, 64), (2, 128, 1024)}
SIZES = [(1, 16, 64, 256), (2, 128, 1024, 4096), (5, 999, 1234, 4321), (8, 4096, 4096, 16384)]
DTYPES = ["float32", "float16", "bfloat16"]
CONFIGS = [(s, d) for s in SIZES for d in DTYPES]


MIB = 2**20


def round512(n):
    return -(-n // 512) * 512


def first_block_bytes(n):
    """Bytes allocated for a request that opens a new segment: the request rounded up to 512,
    or the whole segment when 1 MiB or less would remain (the allocator splits a large
    block only when more than 1 MiB remains; requests from 10 MiB get a segment of their
    size rounded up to 2 MiB)."""
    rounded = round512(n)
    if rounded >= 10 * MIB:
        segment = -(-rounded // (2 * MIB)) * (2 * MIB)
        if segment - rounded <= MIB:
            return segment
    return rounded


def measure(script, out, *args):
    proc = subprocess.run([sys.executable, str(script), "measure", "--device", "cuda:0", *map(str, args), "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    return proc


def check_invariants(doc):
    jsonschema.validate(doc, SCHEMA)
    for p in doc["phases"]:
        for point in ("baseline", "end", "peak"):
            assert p[f"{point}_allocated_bytes"] <= p[f"{point}_reserved_bytes"], p
        for counter in ("allocated", "reserved"):
            assert p[f"end_{counter}_bytes"] <= p[f"peak_{counter}_bytes"], p
            assert p[f"baseline_{counter}_bytes"] <= p[f"peak_{counter}_bytes"], p
        assert p["seconds"] > 0 and p["device_seconds"] >= 0


def expected_parameter_bytes(doc):
    element = DTYPE_BYTES[doc["configuration"]["dtype"]]
    shapes = doc["synthetic_model"]["parameter_shapes"].values()
    total = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        total += round512(numel * element)
    return total


def check_load_and_inputs(doc):
    load, inputs = doc["phases"][0], doc["phases"][1]
    c = doc["configuration"]
    assert load["end_allocated_bytes"] - load["baseline_allocated_bytes"] == expected_parameter_bytes(doc)
    x_bytes = c["batch"] * c["context"] * c["width"] * DTYPE_BYTES[c["dtype"]]
    assert inputs["end_allocated_bytes"] - inputs["baseline_allocated_bytes"] == first_block_bytes(x_bytes)
    if (c["batch"], c["context"], c["width"]) in SEED_INPUTS:  # the seed's commands: exactly rounded
        assert inputs["end_allocated_bytes"] - inputs["baseline_allocated_bytes"] == round512(x_bytes)


def test_small_command_gives_six_records(mm_script, mm, tmp_path):
    out = tmp_path / "mesures-petit-essai.json"
    proc = measure(mm_script, out, *SMALL)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [p["phase"] for p in doc["phases"]] == ["model_load", "inputs", "cold_forward", "warmup", "warm_forward", "warm_forward"]
    check_invariants(doc)
    check_load_and_inputs(doc)
    assert doc["environment"]["device_visible"] is True
    assert mm.compare(doc)["allocated_exact"] is True
    again = measure(mm_script, out, *SMALL)  # never overwrites a result
    assert again.returncode == 2 and json.loads(out.read_text()) == doc


@pytest.fixture(scope="session")
def acceptance(tmp_path_factory):
    """Measure the twelve configurations, each in a fresh process."""
    folder = tmp_path_factory.mktemp("acceptance")
    docs = {}
    for (b, t, w, h), dtype in CONFIGS:
        out = folder / f"m-{b}-{t}-{w}-{h}-{dtype}.json"
        proc = measure(LIBRARY_SCRIPT, out, "--batch", b, "--context", t, "--width", w, "--hidden", h,
                       "--dtype", dtype, "--warmup", "3", "--repeats", "5")
        assert proc.returncode == 0, proc.stderr
        docs[((b, t, w, h), dtype)] = json.loads(out.read_text())
    return docs


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_measurement_invariants(acceptance, config):
    doc = acceptance[config]
    assert len(doc["phases"]) == 4 + 5
    check_invariants(doc)
    check_load_and_inputs(doc)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_prediction_equals_measurement(mm, acceptance, config):
    comparison = mm.compare(acceptance[config])
    wrong = [(r["phase"], r["index"], k, v) for r in comparison["rows"] for k, v in r.items()
             if k.startswith("difference_") and "allocated" in k and v != 0]
    assert wrong == [] and comparison["allocated_exact"] is True


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_reserved_prediction_equals_measurement(mm, acceptance, config):
    """Reserved is byte-exact too on the H200 (README, Validation): every baseline, end and peak."""
    comparison = mm.compare(acceptance[config])
    wrong = [(r["phase"], r["index"], k, v) for r in comparison["rows"] for k, v in r.items()
             if k.startswith("difference_") and "reserved" in k and v != 0]
    assert wrong == []


def test_write_acceptance_report(mm, acceptance):
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    rows = []
    for config, doc in acceptance.items():
        comparison = mm.compare(doc)
        diffs = [v for r in comparison["rows"] for k, v in r.items() if k.startswith("difference_")]
        exact_records = sum(all(v == 0 for k, v in r.items() if k.startswith("difference_") and "allocated" in k)
                            for r in comparison["rows"])
        rows.append({"size": "x".join(map(str, config[0])), "dtype": config[1],
                     "max_peak_allocated_bytes": max(p["peak_allocated_bytes"] for p in doc["phases"]),
                     "max_peak_reserved_bytes": max(p["peak_reserved_bytes"] for p in doc["phases"]),
                     "allocated_records_exact": f"{exact_records}/{len(doc['phases'])}",
                     "reserved_exact": all(d == 0 for d in diffs),
                     "workspace_detected_bytes": comparison["workspace_detected_bytes"]})
    assert len(rows) == 12
    assert [row["allocated_records_exact"] for row in rows] == ["9/9"] * 12
    assert [row["reserved_exact"] for row in rows] == [True] * 12
    if folder:
        with open(Path(folder) / "prediction-acceptance.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def test_impossible_size_exits_3_without_file(tmp_path):
    out = tmp_path / "m.json"
    # the input alone would be 2**20 * 2**16 * 64 * 4 bytes = 16 TiB on the device
    report = tmp_path / "failure.json"
    proc = measure(LIBRARY_SCRIPT, out, "--batch", str(2**20), "--context", str(2**16), "--width", "64",
                   "--failure-report", report)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "phase inputs failed" in lines[0] and "Traceback" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["failure.json"]  # no measurement file
    failure = json.loads(report.read_text())
    assert failure["kind"] == "iteragpu-lab measure failure" and failure["phase"] == "inputs"
    assert failure["reason"] == "out_of_memory" and "OutOfMemoryError" in failure["message"]


HANDLES_THEN_ALLOCATE = """
import sys
import torch
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
a = torch.ones((64, 64), device=device)
keep = [a @ a]
b = torch.ones((64, 64), device=device, dtype=torch.bfloat16)
keep.append(torch.addmm(b[0], b, b.t()))
torch.cuda.synchronize(device)
extra = int(sys.argv[1]) - torch.cuda.memory_reserved(device)
block = torch.empty(extra, dtype=torch.uint8, device=device)
torch.cuda.synchronize(device)
print(torch.cuda.memory_reserved(device))
"""


def test_usable_memory_is_reachable_by_a_fresh_process(mm_script):
    proc = subprocess.run([sys.executable, str(mm_script), "environment", "--device", "cuda:0"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    usable = env["usable_memory_bytes"]
    assert isinstance(usable, int), env["usable_memory_unavailable_reason"]
    assert env["usable_memory_unavailable_reason"] is None
    assert 0 < usable <= env["total_memory_bytes"] and usable % (2 * MIB) == 0
    target = usable - 2 * MIB
    child = subprocess.run([sys.executable, "-c", HANDLES_THEN_ALLOCATE, str(target)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    assert int(child.stdout.strip()) >= target


def test_measurement_file_leaves_usable_memory_unmeasured(mm_script, tmp_path):
    out = tmp_path / "m.json"
    assert measure(mm_script, out, *SMALL).returncode == 0
    environment = json.loads(out.read_text())["environment"]
    assert environment["usable_memory_bytes"] is None  # a child beside a measuring process would see less
