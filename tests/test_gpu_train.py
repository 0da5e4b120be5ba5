"""Training measured on a CUDA GPU against its prediction (marker `gpu`): the synthetic network
(AdamW foreach at four points, AdamW fused, SGD with momentum), two layers of qwen1.5-0.5b (full fine-tuning, AdamW,
bfloat16 weights, with and without gradient checkpointing, and LoRA), and the acceptance table of
three real families (Llama, Qwen3, GPT-NeoX), each cut to 2 layers (widths, heads and vocabulary
kept), at four (batch, context) points, for full AdamW, LoRA rank 8 and full AdamW with gradient
checkpointing: 36 runs of 3 optimizer steps, 14 records each; the same families with float32 weights under
bfloat16 autocast at (1, 128) and (2, 512), the same three modes (18 runs); and QLoRA on llama-3.1-8b cut to 2 layers
(nf4-double, rank 8) at three points, allocated asserted exact at every phase's start and end.

    ITERAGPU_TEST_DEVICE=cuda:0 python3 -m pytest -o addopts= -m gpu tests/test_gpu_train.py

Every run is measured in a fresh process of its own (`real_model measure --task train`), as a user
runs it: no CUDA context, workspace or cached segment of an earlier run. The acceptance table's runs
go ITERAGPU_TRAIN_WORKERS at a time (default 4): each process has its own caching allocator, whose
counters no other process changes (the largest run reserves about 24 GB, qwen3 at (1, 3072): four at
once stay under 80 GB of the device). Each is compared (the run traced on meta, in the test's own
process, which never opens CUDA) as soon as it ends, while the others run. ITERAGPU_TRAIN_WORKERS=1
measures one run at a time.

What is asserted (the acceptance bounds of issue 21): allocated at the start and end of every phase
exact (0 bytes); peak allocated within 0.1 % of the measured; reserved (start, end, peak) within 1 %.
With ITERAGPU_TRAIN_STRICT=1 every counter must be exact (0 bytes). With ITERAGPU_REPORT_DIR set,
every record's six counters (measured, predicted, difference) are appended to train-acceptance.jsonl
there, and one line per run (the largest difference of each counter) to train-acceptance-summary.jsonl."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from conftest import gpu_child_environment  # noqa: E402
from lab_helpers.real.train import compare_training_model  # noqa: E402
from lab_helpers.synthetic.training import compare_training  # noqa: E402

TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
CHILD_ENV, CHILD_DEVICE = gpu_child_environment(TEST_DEVICE)
COUNTERS = ("baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes", "end_reserved_bytes",
            "peak_allocated_bytes", "peak_reserved_bytes")


def report(row: dict, name: str = "train-acceptance.jsonl") -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / name, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"device": TEST_DEVICE, **row}) + "\n")


def run(*argv):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True,
                          timeout=600)


def test_torch_defaults_to_foreach_for_adamw_and_sgd_on_cuda():
    # what the prediction assumes: torch.optim's default on CUDA for float parameters is foreach, not fused
    code = ("import torch; from torch.optim.optimizer import _default_to_fused_or_foreach as d; "
            "p = [torch.zeros(4, device='cuda', dtype=t) for t in (torch.float32, torch.bfloat16)]; "
            "print(d(p, False, use_fused=False))")
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(False, True)"


SYNTHETIC = [
    ((), ("--batch", "1", "--context", "16", "--width", "64")),
    (("--fused",), ("--batch", "1", "--context", "16", "--width", "64")),
    (("--optimizer", "sgd"), ("--batch", "1", "--context", "16", "--width", "64")),
    ((), ("--batch", "2", "--context", "32", "--width", "256", "--dtype", "bfloat16")),
    # two more points of AdamW (four in all), the loss's mean over at most 65536 values: a CUDA
    # reduction splits across thread blocks, with a staging buffer the trace does not add, from about 131072
    ((), ("--batch", "4", "--context", "64", "--width", "256")),
    ((), ("--batch", "8", "--context", "16", "--width", "512", "--dtype", "bfloat16")),
]


@pytest.mark.parametrize("optimizer,sizes", SYNTHETIC)
def test_synthetic_training_is_exact_in_every_counter(tmp_path, optimizer, sizes):
    out = tmp_path / "train.json"
    proc = run("-m", "lab_helpers.mesure_memoire", "measure", "--task", "train", "--steps", "3", *optimizer, *sizes,
               "--device", CHILD_DEVICE, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    result = compare_training(json.loads(out.read_text()))
    for row in result["rows"]:
        report({"model": "synthetic", "flags": [*optimizer, *sizes], **row})
    differences = [(row["phase"], row["index"], key, row[f"difference_{key}"]) for row in result["rows"]
                   for key in COUNTERS if row[f"difference_{key}"]]
    assert differences == []


def _qwen_two_layers(tmp_path) -> Path:
    raw = json.loads((ROOT / "data/models/qwen1.5-0.5b.json").read_text())
    raw["num_hidden_layers"] = 2
    path = tmp_path / "qwen1.5-0.5b-2-layers.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("flags", [(), ("--gradient-checkpointing",)])
def test_two_layers_of_qwen_full_fine_tuning(tmp_path, flags):
    out = tmp_path / "train.json"
    proc = run("-m", "lab_helpers.real_model", "measure", "--task", "train", "--config", str(_qwen_two_layers(tmp_path)),
               "--dtype", "bfloat16", "--batch", "2", "--context", "64", "--steps", "2", *flags,
               "--device", CHILD_DEVICE, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    result = compare_training_model(json.loads(out.read_text()))
    for row in result["rows"]:
        report({"model": "qwen1.5-0.5b, 2 layers", "flags": list(flags), **row})
    for row in result["rows"]:
        where = f"{row['phase']} {row['index']}"
        # exact in all six counters on the H200 (2026-12-01), with and without checkpointing
        for key in COUNTERS:
            assert row[f"difference_{key}"] == 0, (where, key, row)


# Measured on the H200 (2026-12-01, commit 5e63d8a): allocated exact in every record, reserved 77594624
# bytes above the prediction of that commit from backward 1 on. The cause was the tracer's cache of
# output layouts: aten._unsafe_view (the view back to 3-D after each product of a 3-D input, which peft's
# adapters add) returns its input's storage without saying so in its schema, and the cache gave its
# repeated calls a fresh storage, an allocation the GPU never made. The blocks then lay elsewhere: the
# replay made a 2 MiB segment too many at forward 0 and, at backward 1, not the 76 MiB segment the GPU
# made for a float32 tensor of the logits' size (76 MiB - 2 MiB = 77594624 bytes). Since 3e0647e an
# output that shares an input's storage is never cached: that same run's records, replayed by today's
# tracer, are exact in all six counters (tests/test_train_real.py pins them), so this test asserts 0 bytes.
def test_two_layers_of_qwen_lora(tmp_path):
    # the GPU image has peft 0.21.0: install the wheel the lab pins (peft==0.21.2) first
    pytest.importorskip("peft", reason="peft is not installed (pip install peft==0.21.2): the LoRA run was NOT checked")
    out = tmp_path / "lora.json"
    proc = run("-m", "lab_helpers.real_model", "measure", "--task", "train", "--config", str(_qwen_two_layers(tmp_path)),
               "--dtype", "bfloat16", "--batch", "2", "--context", "64", "--steps", "2", "--train", "lora",
               "--lora-rank", "8", "--device", CHILD_DEVICE, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    result = compare_training_model(json.loads(out.read_text()))
    for row in result["rows"]:
        report({"model": "qwen1.5-0.5b, 2 layers", "flags": ["--train", "lora", "--lora-rank", "8"], **row})
    for row in result["rows"]:
        where = f"{row['phase']} {row['index']}"
        for key in COUNTERS:
            assert row[f"difference_{key}"] == 0, (where, key, row)


# ------------------------------------------------------------------------------- the acceptance table
# Each family's bundled shape cut to 2 layers, its widths, heads and vocabulary kept; bfloat16 weights.
FAMILIES = ("llama-3.1-8b", "qwen3-8b", "pythia-1.4b")  # llama, qwen3, gpt_neox
# (batch, context): batch x context stays at most 3072, the embedding backward's direct path on CUDA
# (above it, its sort-based path allocates temporaries the trace does not add: the prediction says so)
POINTS = ((1, 128), (2, 512), (8, 256), (1, 3072))
MODES = {"full": (), "lora": ("--train", "lora", "--lora-rank", "8"),
         "checkpointing": ("--gradient-checkpointing",)}
# mixed precision as users run it: float32 master weights, the forward under bfloat16 autocast
AUTOCAST = ("--dtype", "float32", "--autocast", "bfloat16")
AUTOCAST_MODES = {f"autocast {mode}": flags + AUTOCAST for mode, flags in MODES.items()}
AUTOCAST_POINTS = ((1, 128), (2, 512))
ACCEPTANCE_STEPS = 3
WORKERS = int(os.environ.get("ITERAGPU_TRAIN_WORKERS", "4"))
STRICT = os.environ.get("ITERAGPU_TRAIN_STRICT") == "1"
PEAK_ALLOCATED_BOUND = 0.001  # issue 21: peaks within 0.1 % allocated...
RESERVED_BOUND = 0.01  # ...and 1 % reserved; allocated at the start and end of each phase exact


def family_config(folder: Path, family: str) -> Path:
    path = folder / f"{family}-2-layers.json"
    if not path.exists():
        raw = json.loads((ROOT / "data" / "models" / f"{family}.json").read_text())
        raw["num_hidden_layers"] = 2
        path.write_text(json.dumps(raw))
    return path


def measure_one(folder: Path, family: str, point: tuple, mode: str) -> dict:
    """Measure one run in a fresh process: {"path": its measurement file} or {"error": why not}."""
    batch, context = point
    out = folder / f"{family}-{batch}x{context}-{mode}.json"
    config = family_config(folder, family)
    # pythia-1.4b has 2048 (rotary) positions in its config: the longest point runs past them
    # (rotary embeddings have no table to run out of), as a user would with --beyond-positions
    beyond = ["--beyond-positions"] if context > json.loads(config.read_text())["max_position_embeddings"] else []
    try:
        proc = run("-m", "lab_helpers.real_model", "measure", "--task", "train", "--config",
                   str(config), "--dtype", "bfloat16", "--batch", str(batch), "--context",
                   str(context), "--steps", str(ACCEPTANCE_STEPS), *{**MODES, **AUTOCAST_MODES}[mode], *beyond,
                   "--device", CHILD_DEVICE,
                   "--output", str(out))
    except subprocess.TimeoutExpired:
        return {"error": "measure did not end within 600 s"}
    if proc.returncode != 0:
        return {"error": f"measure exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    return {"path": out}


def _selected(request) -> list:
    """The (family, point, mode) runs this session selected (-k and friends): only those are measured."""
    wanted = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "originalname", None) in ("test_acceptance_table", "test_autocast_table") and params:
            key = (params["family"], params["point"], params["mode"])
            if key not in wanted:
                wanted.append(key)
    return wanted


@pytest.fixture(scope="module")
def acceptance(request, tmp_path_factory):
    """{(family, point, mode): {"compare": ...}, {"error": ...} or {"skip": ...}} of the selected runs:
    measured WORKERS at a time, each compared (traced on meta, in this process, which never opens
    CUDA) as soon as its measurement ends, while the others run."""
    runs = _selected(request)
    results = {}
    try:
        import peft
    except ImportError:
        peft = None
    if peft is None:
        for key in [key for key in runs if "lora" in key[2]]:
            runs.remove(key)
            results[key] = {"skip": "peft is not installed (pip install peft==0.21.2): LoRA was NOT checked"}
    folder = tmp_path_factory.mktemp("acceptance")
    for family in {family for family, _, _ in runs}:
        family_config(folder, family)  # written once, before the workers read them
    with ThreadPoolExecutor(max_workers=max(1, WORKERS)) as pool:
        futures = {pool.submit(measure_one, folder, *key): key for key in runs}
        for future in as_completed(futures):
            key, outcome = futures[future], future.result()
            if "path" in outcome:
                try:
                    outcome = {"compare": compare_training_model(json.loads(outcome["path"].read_text()))}
                except Exception as exc:  # reported for this run; the others are still compared
                    outcome = {"error": f"compare: {type(exc).__name__}: {exc}"}
            results[key] = outcome
    return results


def bound_problems(rows: list) -> list:
    """(record, counter, difference, bound) of every difference beyond what the test asserts."""
    problems = []
    for row in rows:
        where = f"{row['phase']} {row['index']}"
        for key in COUNTERS:
            difference, measured = row[f"difference_{key}"], row[f"measured_{key}"]
            if STRICT or key in ("baseline_allocated_bytes", "end_allocated_bytes"):
                bound = 0
            elif key == "peak_allocated_bytes":
                bound = PEAK_ALLOCATED_BOUND * measured
            else:
                bound = RESERVED_BOUND * measured
            if abs(difference) > bound:
                problems.append((where, key, difference, bound))
    return problems


# Measured on the H200 on 2026-12-02 (night; docs/validation/2026-12-02-night-one-h200.md), with
# ITERAGPU_TRAIN_STRICT=1: allocated exact in every record of the 36 runs; reserved off by one segment in
# these two, within the bounds above: the requests are the GPU's, the segment one the replay did (or
# did not) make, not explained yet. They are strict expected failures under ITERAGPU_TRAIN_STRICT=1
# only; every other run must be exact there. (Four runs differed in reserved on the evening of
# 2026-12-02, the autocast runs of the night in allocated too, until the model mapped segments in the
# driver's address order: lab_helpers.allocator.addresses.)
RESERVED_WITHIN_BOUNDS = {
    ("qwen3-8b", (2, 512), "lora"): "reserved -16777216 (0.31 %) from forward 0 on",
    ("qwen3-8b", (2, 512), "checkpointing"): "reserved +16777216 (0.32 %) from forward 0 on",
}


def check_run(acceptance, family: str, point: tuple, mode: str) -> None:
    """One run of the table: every record reported, then within the bounds (exact under STRICT)."""
    outcome = acceptance[(family, point, mode)]
    if "skip" in outcome:
        pytest.skip(outcome["skip"])
    assert "error" not in outcome, outcome.get("error")
    result = outcome["compare"]
    rows = result["rows"]
    assert len(rows) == 2 + 4 * ACCEPTANCE_STEPS
    label = {"model": f"{family}, 2 layers", "batch": point[0], "context": point[1], "mode": mode,
             "flags": list({**MODES, **AUTOCAST_MODES}[mode])}
    for row in rows:
        report(label | row)
    largest = {key: max((row[f"difference_{key}"] for row in rows), key=abs) for key in COUNTERS}
    report(label | {"summary": True, "records": len(rows), "largest_difference": largest,
                    "exact": all(v == 0 for v in largest.values()),
                    "peak_allocated_worst_relative": result["peak_allocated_worst_relative"],
                    "peak_reserved_worst_relative": result["peak_reserved_worst_relative"]},
           "train-acceptance-summary.jsonl")
    assert bound_problems(rows) == [], difference_table(rows)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("point", POINTS, ids=[f"{b}x{t}" for b, t in POINTS])
@pytest.mark.parametrize("family", FAMILIES)
def test_acceptance_table(acceptance, request, family, point, mode):
    known = RESERVED_WITHIN_BOUNDS.get((family, point, mode))
    if known and STRICT:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"measured on the H200: {known}"))
    check_run(acceptance, family, point, mode)


@pytest.mark.parametrize("mode", list(AUTOCAST_MODES))
@pytest.mark.parametrize("point", AUTOCAST_POINTS, ids=[f"{b}x{t}" for b, t in AUTOCAST_POINTS])
@pytest.mark.parametrize("family", FAMILIES)
def test_autocast_table(acceptance, family, point, mode):
    check_run(acceptance, family, point, mode)


# ------------------------------------------------------------------------------------- QLoRA
# llama-3.1-8b cut to 2 layers, its 4-bit base (nf4, double quantization) loaded by from_pretrained from a
# random bfloat16 checkpoint saved on the CPU first, peft's prepare_model_for_kbit_training, LoRA rank 8
# (peft's default targets, q_proj and v_proj), AdamW foreach, 3 steps. Measured on the H200 on 2026-12-02
# (evening; docs/validation/2026-12-02-evening-one-h200.md): (1, 128) and (2, 256) exact in every counter
# of all 14 records (the +1048576 bytes of the afternoon at (1, 128) was the out-of-place gradient
# accumulation); with checkpointing the trace then kept 4326400 bytes a step too many (its hooks kept the
# graph's nodes alive): fixed, and that run's 14 records are now predicted to the byte
# (tests/test_quantized.py pins the three runs' records).
QLORA_POINTS = ((1, 128, ()), (2, 256, ()), (1, 128, ("--gradient-checkpointing",)))
QLORA_KNOWN = {}


def difference_table(rows: list) -> str:
    """Every record's difference (measured - predicted) in each counter, for a failure's message."""
    lines = ["record: " + ", ".join(COUNTERS)]
    for row in rows:
        lines.append(f"{row['phase']} {row['index']}: " + ", ".join(f"{row[f'difference_{k}']:+d}" for k in COUNTERS))
    return "\n".join(lines)


@pytest.mark.parametrize("batch, context, flags", QLORA_POINTS,
                         ids=[f"{b}x{t}{'-checkpointing' if f else ''}" for b, t, f in QLORA_POINTS])
def test_two_layers_of_llama_qlora_allocated_is_exact_at_every_phase_end(tmp_path, request, batch, context, flags):
    known = QLORA_KNOWN.get((batch, context, flags))
    if known and not STRICT:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"measured on the H200: {known}"))
    pytest.importorskip("peft", reason="peft is not installed (pip install peft==0.21.2): QLoRA was NOT checked")
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pinned 0.50.2): QLoRA was NOT checked")
    out = tmp_path / "qlora.json"
    proc = run("-m", "lab_helpers.real_model", "measure", "--task", "train", "--config",
               str(family_config(tmp_path, "llama-3.1-8b")), "--dtype", "bfloat16", "--batch", str(batch),
               "--context", str(context), "--steps", str(ACCEPTANCE_STEPS), "--train", "qlora", "--quantize",
               "nf4-double", "--lora-rank", "8", *flags, "--device", CHILD_DEVICE, "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    measurement = json.loads(out.read_text())
    assert measurement["configuration"]["quantize"] == "nf4-double"
    assert measurement["model"]["quantization"] == "nf4-double"
    result = compare_training_model(measurement)
    rows = result["rows"]
    assert len(rows) == 2 + 4 * ACCEPTANCE_STEPS
    label = {"model": "llama-3.1-8b, 2 layers", "batch": batch, "context": context,
             "flags": ["--train", "qlora", "--quantize", "nf4-double", "--lora-rank", "8", *flags]}
    for row in rows:
        report(label | row, "qlora-acceptance.jsonl")
    table = difference_table(rows)
    print(table)  # shown with -s, and in the failure's captured output
    wrong = [(f"{r['phase']} {r['index']}", key, r[f"difference_{key}"]) for r in rows
             for key in ("baseline_allocated_bytes", "end_allocated_bytes") if r[f"difference_{key}"] != 0]
    assert wrong == [], "allocated differs at a phase's start or end:\n" + table
