"""Every family measured on a CUDA GPU against its prediction (marker `gpu`): a reduced-layer
version of each bundled shape (the hidden sizes, heads and vocabulary kept), four (batch, context)
points each, one of them long, bf16, every counter of every record compared exactly.

    python3 -m pytest -o addopts= -m gpu tests/test_gpu_families.py -k "not boundary"
    python3 -m pytest -o addopts= -m gpu tests/test_gpu_families.py -k boundary


Each point is measured in a fresh process with `real_model measure` and compared with
`real_model compare` in another; the points run eight at a time (each process has its own caching
allocator, so its counters are its own; the models are small; the comparisons, run on the CPU, overlap
the other points' measurements). Sliding-window shapes run a context
longer than the window and a context that crosses it during the decode steps. One mixture of
experts (Qwen3-MoE) is also measured with every token routed to expert 0, beside its even
routing: the prediction must equal both. ITERAGPU_REPORT_DIR, when set, receives
families.jsonl (every record: the six counters measured, predicted and their difference)."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from conftest import gpu_child_environment  # noqa: E402
from lab_helpers.real.spec import COUNTER_KEYS  # noqa: E402

TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
# the measuring processes see only the test's GPU
CHILD_ENV, CHILD_DEVICE = gpu_child_environment(TEST_DEVICE)
CHILD_ENV["PYTHONPATH"] = str(ROOT)
NEW_TOKENS = 4
AT_ONCE = 8
DENSE_POINTS = [(1, 512), (4, 2048), (8, 1000), (1, 16384)]
# family: (bundled config, changes that reduce its layers, points)
FAMILIES = {
    "qwen3": ("qwen3-8b", {"num_hidden_layers": 2}, DENSE_POINTS),
    "qwen3_moe": ("qwen3-30b-a3b", {"num_hidden_layers": 2}, DENSE_POINTS),
    "qwen2_moe": ("qwen1.5-moe-a2.7b", {"num_hidden_layers": 2}, [(1, 512), (4, 2048), (8, 1000), (1, 8000)]),
    "mixtral": ("mixtral-8x7b", {"num_hidden_layers": 2}, DENSE_POINTS),
    # Gemma 2 alternates sliding (4096) and global layers; 8192 positions
    "gemma2": ("gemma-2-2b", {"num_hidden_layers": 4}, [(1, 512), (4, 2048), (2, 4094), (1, 8000)]),
    # Gemma 3: three sliding layers (1024) and one global, its 262k vocabulary
    "gemma3_text": ("gemma-3-4b-text", {"num_hidden_layers": 4, "layer_types": [
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
        [(1, 512), (4, 2048), (4, 1022), (1, 8192)]),
    # Phi-3: a 2047 window on every layer, 4096 positions
    "phi3": ("phi-3-mini-4k", {"num_hidden_layers": 2}, [(1, 512), (2, 2045), (8, 1000), (1, 4000)]),
    # GPT-2: 1024 learned positions, so its long point is 1016 + 4 new tokens
    "gpt2": ("gpt2", {"n_layer": 4}, [(1, 256), (4, 512), (8, 1000), (16, 1016)]),
    "gpt_neox": ("pythia-1.4b", {"num_hidden_layers": 2}, [(1, 512), (4, 1024), (8, 1000), (1, 2040)]),
    "olmo2": ("olmo-2-7b", {"num_hidden_layers": 2}, [(1, 512), (4, 2048), (8, 1000), (1, 4090)]),
    # Mistral v0.1: a 4096 window on every layer, shorter than the long context
    "mistral_sliding": ("mistral-7b-v0.1", {"num_hidden_layers": 2}, [(1, 512), (2, 4094), (8, 1000), (1, 8192)]),
}
# measured on the H200, not yet explained by the model: (family, batch, context): why. (Mixtral at
# (1, 512) was 58720256 bytes of reserved above the GPU from 2026-12-01 until the model mapped 20 MiB
# segments in the driver's address order, top-down: lab_helpers.allocator.addresses.)
KNOWN_DIFFERENCES = {}
POINTS = [(family, batch, context) for family, (_, _, points) in FAMILIES.items() for batch, context in points]
POINT_PARAMS = [pytest.param(*point, marks=pytest.mark.xfail(strict=True, reason=KNOWN_DIFFERENCES[point]))
                if point in KNOWN_DIFFERENCES else point for point in POINTS]
ROUTING_POINT = ("qwen3_moe", 4, 2048)

# measure_model with every router's chosen experts set to 0 in place (allocating nothing) after the
# router runs: every token goes to expert 0
SKEWED_MEASURE = r"""
import json, sys
import transformers
from lab_helpers.real.config import load_config
from lab_helpers.real.protocol import measure_model
from lab_helpers.real.spec import RunSpec
config, out = sys.argv[1], sys.argv[2]
batch, context, new_tokens = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
build = transformers.AutoModelForCausalLM.from_config

def to_expert_0(module, args, output):
    output[-1].zero_()

def skewed(*args, **kwargs):
    model = build(*args, **kwargs)
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(to_expert_0)
    return model

transformers.AutoModelForCausalLM.from_config = skewed
shape = load_config(config)
device = sys.argv[6]
document = measure_model(shape, RunSpec(shape.name, batch=batch, context=context, new_tokens=new_tokens, device=device))
with open(out, "x", encoding="utf-8") as handle:
    json.dump(document, handle)
"""


def report(row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "families.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"device": TEST_DEVICE, **row}) + "\n")


def reduced_config(folder: Path, family: str) -> Path:
    name, changes, _ = FAMILIES[family]
    raw = json.loads((ROOT / "data" / "models" / f"{name}.json").read_text())
    path = folder / f"{name}-reduced.json"
    if not path.exists():
        path.write_text(json.dumps({**raw, **changes}))
    return path


def measure_point(folder: Path, family: str, batch: int, context: int, skewed: bool = False) -> dict:
    """Measure in a fresh process, then compare in another (the prediction runs on the CPU, in
    parallel with the other points)."""
    config = reduced_config(folder, family)
    out = folder / f"{family}-{batch}-{context}{'-skewed' if skewed else ''}.json"
    if skewed:
        argv = [sys.executable, "-c", SKEWED_MEASURE, str(config), str(out), str(batch), str(context), str(NEW_TOKENS),
                CHILD_DEVICE]
    else:
        argv = [sys.executable, "-m", "lab_helpers.real_model", "measure", "--config", str(config), "--dtype",
                "bfloat16", "--batch", str(batch), "--context", str(context), "--new-tokens", str(NEW_TOKENS),
                "--device", CHILD_DEVICE, "--output", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    result = {"family": family, "batch": batch, "context": context, "skewed": skewed, "exit": proc.returncode,
              "stderr": proc.stderr.strip()[-2000:], "document": json.loads(out.read_text()) if out.exists() else None,
              "comparison": None}
    if out.exists():
        compare = subprocess.run([sys.executable, "-m", "lab_helpers.real_model", "compare", str(out)], cwd=ROOT,
                                 env=CHILD_ENV, capture_output=True, text=True, timeout=600)
        if compare.returncode == 0:
            result["comparison"] = json.loads(compare.stdout)
        else:
            result["stderr"] += "\ncompare: " + compare.stderr.strip()[-1000:]
    return result


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Every point measured, AT_ONCE processes at a time."""
    folder = tmp_path_factory.mktemp("families")
    jobs = [(family, batch, context, False) for family, batch, context in POINTS]
    jobs.append((*ROUTING_POINT, True))
    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(lambda job: measure_point(folder, *job), jobs))
    return {(r["family"], r["batch"], r["context"], r["skewed"]): r for r in results}


def compared(result: dict) -> dict:
    assert result["exit"] == 0 and result["comparison"] is not None, result["stderr"]
    comparison = result["comparison"]
    for row in comparison["rows"]:
        report({k: result[k] for k in ("family", "batch", "context", "skewed")} | {"new_tokens": NEW_TOKENS, **row})
    return comparison


def assert_exact(comparison: dict) -> None:
    differing = [(row["phase"], row["index"], key, row[f"difference_{key}"]) for row in comparison["rows"]
                 for key in COUNTER_KEYS if row[f"difference_{key}"] != 0]
    assert not differing, differing


@pytest.mark.parametrize("family,batch,context", POINT_PARAMS)
def test_every_counter_of_every_record_is_predicted_exactly(measured, family, batch, context):
    assert_exact(compared(measured[(family, batch, context, False)]))


def test_the_experts_allocate_the_same_for_an_even_and_a_skewed_routing(measured):
    even = measured[(*ROUTING_POINT, False)]
    skewed = measured[(*ROUTING_POINT, True)]
    skewed_comparison = compared(skewed)
    assert_exact(skewed_comparison)
    counters = [[p[k] for k in COUNTER_KEYS] for p in even["document"]["phases"]]
    assert counters == [[p[k] for k in COUNTER_KEYS] for p in skewed["document"]["phases"]]


# ---- fit's boundary, for one sliding-window model and one mixture of experts (run apart from the
# points above: each probe fills the GPU): -k boundary
BOUNDARY_SWEEPS = [("mistral_sliding", "context", 8192, "batch"), ("qwen3_moe", "context", 4096, "batch")]


@pytest.fixture(scope="module")
def usable():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from lab_helpers.real.fit import usable_memory_bytes; "
         "print(usable_memory_bytes(sys.argv[1]))", CHILD_DEVICE],
        cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family,fixed,value,searched", BOUNDARY_SWEEPS)
def test_boundary_fit_finds_the_measured_out_of_memory_boundary(tmp_path, usable, family, fixed, value, searched):
    from lab_helpers.real.config import load_config
    from lab_helpers.real.fit import fit_model
    config = reduced_config(tmp_path, family)
    result = fit_model(load_config(str(config)), "bfloat16", NEW_TOKENS, usable, "usable memory, measured",
                       **{fixed: value})
    largest = result[f"largest_{searched}_at_{fixed}"]
    assert largest > 0
    outcomes = {}
    for probe in (largest, largest + 1):
        point = {fixed: value, searched: probe}
        out = tmp_path / f"{probe}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "lab_helpers.real_model", "measure", "--config", str(config), "--batch",
             str(point["batch"]), "--context", str(point["context"]), "--new-tokens", str(NEW_TOKENS),
             "--decode-record-every", str(NEW_TOKENS), "--device", CHILD_DEVICE, "--output", str(out)],
            cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
        outcomes[probe] = proc.returncode
        report({"family": family, "boundary": True, **point, "predicted_largest": largest, "exit": proc.returncode,
                "stderr": proc.stderr.strip()[-300:]})
    assert outcomes == {largest: 0, largest + 1: 3}
