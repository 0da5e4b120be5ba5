"""The out-of-memory file on a real failure, taken in PyTorch's out-of-memory observer (marker `gpu`;
skipped without a CUDA device). Run on the GPU machine:

    ITERAGPU_TEST_DEVICE=cuda:0 python3 -m pytest -o addopts= -m gpu tests/test_gpu_oom.py

Each test makes one run fail quickly (a few large allocations, no slow filling of the device) in a
fresh process, then checks that the file says "observer", that the failed pass's intermediate is in
its snapshot, and that `timeline explain` gives the figures of PyTorch's own message to the precision
it prints them and the allocator's counters taken in the observer to the byte. The last holds the
device from another process, so that the run's CUDA context itself cannot be created (run it alone)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from conftest import gpu_child_environment  # noqa: E402
from lab_helpers.allocator.history import parse_oom_message, torch_format_size  # noqa: E402
from lab_helpers.core.numbers import parse_device  # noqa: E402

TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")
CHILD_ENV, CHILD_DEVICE = gpu_child_environment(TEST_DEVICE)
CHILD_ENV = {k: v for k, v in CHILD_ENV.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}


def total_bytes() -> int:
    # the device's total as CUDA reports it, read without creating a context in this process
    return torch.cuda.get_device_properties(parse_device(TEST_DEVICE)).total_memory


def child(*argv, cwd):
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env={**CHILD_ENV, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)


def explain_agrees_with_the_message_and_the_observer(path) -> dict:
    document = json.loads(Path(path).read_text())
    assert document["snapshot_source"] == "observer", document.get("observer_problem")
    observer, stats = document["observer"], document["observer"]["stats"]
    proc = child("-m", "lab_helpers.timeline", "explain", path, "--format", "json", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    printed = parse_oom_message(document["error_message"])
    assert printed is not None, document["error_message"]
    allocated, reserved = stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]
    # the explainer's figures, from the snapshot's segments, equal the observer's to the byte...
    assert r["segment_bytes_needed"] == observer["alloc_bytes"]
    assert r["device_free_bytes"] == observer["device_free_bytes"]
    assert r["allocated_bytes"] == allocated
    assert r["reserved_bytes"] == reserved
    assert r["reserved_unallocated_bytes"] == reserved - allocated
    assert r["reserved_free_bytes"] == stats["inactive_split_bytes.all.current"]
    # ...and PyTorch's message to the precision it prints
    assert printed["tried_to_allocate"] == torch_format_size(r["segment_bytes_needed"])
    assert printed["free"] == torch_format_size(r["device_free_bytes"])
    assert printed["allocated_by_pytorch"] == torch_format_size(r["allocated_bytes"])
    assert printed["reserved_unallocated"] == torch_format_size(r["reserved_unallocated_bytes"])
    assert printed["total_capacity"] == torch_format_size(document["device_total_bytes"])
    assert r["figures_agree"] is True and r["verdict"] in ("fragmentation", "exhaustion", "segment_size")
    assert r["verdict"] == r["message_verdict"] or r["verdict"] == "segment_size"
    return {"document": document, "explained": r}


def test_synthetic_out_of_memory_in_the_forward_keeps_the_first_layers_output(tmp_path):
    # the first Linear's output (1 x 65536 x hidden float32) takes 55 % of the device: it fits, and
    # the GELU's output of the same size then cannot; at the failure the first output is allocated
    tokens = 65536
    hidden = int(0.55 * total_bytes()) // (tokens * 4) // 512 * 512
    first_output = tokens * hidden * 4
    proc = child(ROOT / "lab_helpers" / "mesure_memoire.py", "measure", "--device", CHILD_DEVICE, "--batch", "1",
                 "--context", str(tokens), "--width", "64", "--hidden", str(hidden), "--dtype", "float32",
                 "--warmup", "0", "--repeats", "1", "--output", "m.json", "--timeline", "t.json", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "phase cold_forward failed" in proc.stderr and proc.stderr.endswith("out-of-memory snapshot: t.oom.json\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.oom.json"]
    checked = explain_agrees_with_the_message_and_the_observer(tmp_path / "t.oom.json")
    document, r = checked["document"], checked["explained"]
    assert document["phase"] == "cold_forward" and document["failed_request_bytes"] == first_output
    # before unwinding: the first Linear's output is still an allocated block of the snapshot
    blocks = [b["size"] for s in document["snapshot"]["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert first_output in blocks
    assert document["observer"]["stats"]["allocated_bytes.all.current"] >= first_output
    assert r["verdict"] == "exhaustion"


def test_real_model_out_of_memory_in_prefill_keeps_the_embeddings(tmp_path):
    # qwen1.5-0.5b (hidden 1024, bfloat16): the prompt's embeddings take 40 % of the device, and the
    # first layer's float32 norm of them (twice as large) cannot be allocated
    context, hidden = 512, 1024
    # an even batch: the embeddings (batch MiB) fill whole 2 MiB pages, so their block is exactly their size
    batch = min(65536, int(0.4 * total_bytes()) // (context * hidden * 2)) // 2 * 2
    embeddings = batch * context * hidden * 2
    proc = child("-m", "lab_helpers.real_model", "measure", "--config", "qwen1.5-0.5b", "--dtype", "bfloat16",
                 "--batch", batch, "--context", context, "--new-tokens", 1, "--device", CHILD_DEVICE,
                 "--output", tmp_path / "m.json", "--timeline", tmp_path / "t.json", cwd=ROOT)
    assert proc.returncode == 3, proc.stderr
    assert "phase prefill failed" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.oom.json"]
    checked = explain_agrees_with_the_message_and_the_observer(tmp_path / "t.oom.json")
    document = checked["document"]
    assert document["phase"] == "prefill"
    assert document["run"]["configuration"]["batch"] == batch
    assert document["run"]["model_config"]["hidden_size"] == hidden
    # before unwinding: the embeddings, a local of the model's forward, are still allocated
    assert document["observer"]["stats"]["allocated_bytes.all.current"] >= embeddings
    blocks = [b["size"] for s in document["snapshot"]["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert embeddings in blocks


HOLDER = r"""
import sys, torch
held = []
for chunk in (2**30, 2**20 // 2):  # 1 GiB blocks, then 512 KiB ones (2 MiB segments): a few MiB left at most
    while True:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda:0"))
        except torch.OutOfMemoryError:
            break
print(torch.cuda.mem_get_info(0)[0], flush=True)
sys.stdin.read()
"""


def test_a_device_another_process_fills_ends_measure_at_the_context_in_one_line(tmp_path):
    """Another process holds all but a few MiB of the device (the driver keeps some it will not hand out:
    3276800 bytes on the H200), far below the hundreds of MiB a CUDA context takes: creating this run's
    context fails, and each measuring command says so in one line, exit 3, no file written (run this test
    alone)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=CHILD_ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        free = int(holder.stdout.readline())
        assert free < 64 * 2**20, free
        commands = {
            "real_model": ["-m", "lab_helpers.real_model", "measure", "--config", "qwen1.5-0.5b", "--batch", 1,
                           "--context", 8, "--new-tokens", 1, "--device", CHILD_DEVICE, "--output",
                           tmp_path / "real" / "m.json"],
            "mesure_memoire": [ROOT / "lab_helpers" / "mesure_memoire.py", "measure", "--device", CHILD_DEVICE,
                               "--batch", 1, "--context", 8, "--width", 16, "--hidden", 32,
                               "--output", tmp_path / "mm" / "m.json", "--failure-report", tmp_path / "mm" / "f.json"],
        }
        (tmp_path / "real").mkdir()
        (tmp_path / "mm").mkdir()
        for argv in commands.values():
            proc = child(*argv, cwd=ROOT)
            assert proc.returncode == 3, proc.stderr
            assert proc.stderr.count("\n") == 1 and "phase cuda_context failed: " in proc.stderr, proc.stderr
            assert "out of memory" in proc.stderr and "no file written" in proc.stderr, proc.stderr
        assert list((tmp_path / "real").iterdir()) == []
        assert sorted(p.name for p in (tmp_path / "mm").iterdir()) == ["f.json"]
        report = json.loads((tmp_path / "mm" / "f.json").read_text())
        assert (report["phase"], report["reason"]) == ("cuda_context", "cuda_error"), report
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
