"""The caching allocator at the edge of the card, on the CPU: release-and-retry and out of memory
replayed under a budget (lab_helpers.allocator.budget), predict's budget flags, and compare under
the budget a measurement recorded.

The H200 figures cited come from docs/validation/2026-12-01-one-h200.md: usable memory 149380136960
bytes; qwen1.5-0.5b at context 4096 ran at batch 192 (peak reserved 149115895808) and ran out of
memory at 193 ("Tried to allocate 1.51 GiB ... 1.04 GiB is free ... 73.32 GiB is allocated by
PyTorch, and 64.76 GiB is reserved by PyTorch but unallocated"); llama-3.1-8b with 4 layers at
context 8192 ran at batch 100 (148209926144) and ran out at 101 ("Tried to allocate 22.09 GiB ...
21.85 GiB is free ... 82.53 GiB is allocated by PyTorch, and 34.75 GiB is reserved by PyTorch but
unallocated")."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_main_in_process
from lab_helpers.allocator.budget import BudgetedAllocatorModel, OutOfMemory, measured_budgets
from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.real.config import load_config, parse_config
from lab_helpers.real.predict import compare_model, predict_model
from lab_helpers.real.spec import COUNTER_KEYS, RunSpec
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.predict import compare, predict

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 2**20, 2**30
H200_USABLE = 149380136960
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096}


# ---- 1. the replay of a request sequence built by hand
def test_release_then_retry_succeeds():
    alloc = BudgetedAllocatorModel(100 * MIB)
    kept = alloc.malloc(30 * MIB)
    alloc.free(alloc.malloc(50 * MIB))  # cached: reserved stays at 80 MiB
    assert (alloc.reserved, alloc.releases) == (80 * MIB, ())
    alloc.malloc(60 * MIB)  # 80 + 60 > 100: the wholly free 50 MiB segment goes back, then 30 + 60 fit
    assert (alloc.allocated, alloc.reserved, alloc.peak_reserved) == (90 * MIB, 90 * MIB, 90 * MIB)
    assert alloc.releases == [(50 * MIB, 30 * MIB)]
    assert kept.size == 30 * MIB


def test_release_then_still_too_big_is_out_of_memory_with_the_allocator_state():
    alloc = BudgetedAllocatorModel(100 * MIB)
    alloc.malloc(30 * MIB)
    alloc.free(alloc.malloc(50 * MIB))
    with pytest.raises(OutOfMemory) as caught:
        alloc.malloc(80 * MIB - 100)  # rounded to 512 bytes, its segment to 2 MiB: 80 MiB
    report = caught.value.report()
    assert report == {"phase": None, "index": None, "request_bytes": 80 * MIB - 100, "block_bytes": 80 * MIB,
                      "segment_bytes": 80 * MIB, "reserved_bytes": 30 * MIB, "allocated_bytes": 30 * MIB,
                      "reserved_but_unallocated_bytes": 0, "budget_bytes": 100 * MIB,
                      "free_under_budget_bytes": 70 * MIB, "released_before_failing_bytes": 50 * MIB}
    assert alloc.releases == ()  # the failed release is the error, not a logged release-and-retry


def test_a_split_segment_is_not_released_and_a_cached_block_needs_no_device_memory():
    alloc = BudgetedAllocatorModel(44 * MIB)
    small = alloc.malloc(MIB)  # a 2 MiB small-pool segment, half used
    first = alloc.malloc(21 * MIB)  # a 22 MiB segment
    alloc.free(first)
    assert alloc.reserved == 24 * MIB
    alloc.malloc(15 * MIB)  # served by the cached 22 MiB block: no device memory, no release
    assert (alloc.reserved, alloc.releases) == (24 * MIB, ())
    with pytest.raises(OutOfMemory) as caught:
        alloc.malloc(21 * MIB)  # 24 + 22 > 44; nothing is wholly free (the 22 MiB one is split, the 2 MiB used)
    assert caught.value.released_bytes == 0 and caught.value.reserved_bytes == 24 * MIB
    assert small.size == MIB


def test_without_a_budget_or_with_room_the_replay_is_the_unbounded_one_byte_for_byte():
    rng = random.Random(7)
    for budget in (None, 2**50):
        plain, bounded = AllocatorModel(), BudgetedAllocatorModel(budget)
        live = []
        for _ in range(3000):
            if live and rng.random() < 0.45:
                i = rng.randrange(len(live))
                a, b = live.pop(i)
                plain.free(a)
                bounded.free(b)
            else:
                size = rng.choice((rng.randrange(1, 2 * MIB), rng.randrange(1, 64 * MIB)))
                live.append((plain.malloc(size), bounded.malloc(size)))
            assert (plain.allocated, plain.reserved, plain.peak_allocated, plain.peak_reserved) == (
                bounded.allocated, bounded.reserved, bounded.peak_allocated, bounded.peak_reserved)
        assert bounded.releases == ()


def test_the_real_model_allocator_keeps_its_addresses_through_the_same_replay():
    from lab_helpers.allocator.addressed import CappedAllocator
    alloc = CappedAllocator(100 * MIB)
    first = alloc.malloc(60 * MIB)
    alloc.free(first)
    # the 60 MiB segment (two 32 MiB granules of addresses) is given back; the 70 MiB one needs three
    alloc.malloc(70 * MIB)
    assert (alloc.allocated, alloc.reserved, alloc.capacity_bytes) == (70 * MIB, 70 * MIB, 100 * MIB)
    assert alloc.addresses.holes == [(first.address, 64 * MIB)] and alloc.releases == [(60 * MIB, 0)]


def test_measured_budgets_take_the_smaller_of_free_plus_reserved_at_each_end():
    records = [{"baseline_device_free_bytes": 1000, "baseline_reserved_bytes": 0,
                "end_device_free_bytes": 400, "end_reserved_bytes": 600},
               {"baseline_device_free_bytes": 400, "baseline_reserved_bytes": 600,
                "end_device_free_bytes": 100, "end_reserved_bytes": 800}]  # 100 bytes appeared outside
    assert measured_budgets(records) == [1000, 900]
    assert measured_budgets([{**records[0], "end_device_free_bytes": None}]) is None
    assert measured_budgets([{k: v for k, v in records[0].items() if "free" not in k}]) is None


# ---- 2. the synthetic network
SYNTHETIC = MeasureConfig(batch=8, context=4096, width=4096, hidden=16384, dtype="float32", warmup=1, repeats=2)


def test_synthetic_predict_under_a_budget_that_holds_it_is_the_unbounded_prediction():
    free = predict(SYNTHETIC)
    assert free["budget"]["bytes"] is None and "unbounded device" in free["budget"]["note"]
    peak = max(p["peak_reserved_bytes"] for p in free["phases"])
    held = predict(SYNTHETIC, budget_bytes=peak, budget_source="test")
    assert held["phases"] == free["phases"] and "out_of_memory" not in held
    assert held["budget"] == {"bytes": peak, "source": "test"}


def test_synthetic_predict_one_segment_short_runs_out_in_the_cold_forward():
    # model_load 538968064 reserved, inputs 1075838976; the cold forward's first output is
    # 8 x 4096 x 16384 float32 = 2 GiB, its own segment
    result = predict(SYNTHETIC, budget_bytes=1075838976 + 2 * GIB - 1)
    assert [p["phase"] for p in result["phases"]] == ["model_load", "inputs"]
    assert result["out_of_memory"] == {
        "phase": "cold_forward", "index": None, "request_bytes": 2 * GIB, "block_bytes": 2 * GIB,
        "segment_bytes": 2 * GIB, "reserved_bytes": 1075838976, "allocated_bytes": 1073823744,
        "reserved_but_unallocated_bytes": 2015232, "budget_bytes": 1075838976 + 2 * GIB - 1,
        "free_under_budget_bytes": 2 * GIB - 1, "released_before_failing_bytes": 0}


def synthetic_measurement(prediction: dict, budgets=None) -> dict:
    """A document laid out as measure writes it, its counters a prediction's; with `budgets`, the
    device's free bytes each phase saw (budget - reserved)."""
    phases = []
    for i, p in enumerate(prediction["phases"]):
        record = {k: p[k] for k in ("phase", "index", "passes", *(f"{w}_{c}_bytes" for w in ("baseline", "end", "peak")
                                                                  for c in ("allocated", "reserved")))}
        record.update(seconds=0.1, device_seconds=0.1)
        if budgets is not None:
            record["baseline_device_free_bytes"] = budgets[i] - p["baseline_reserved_bytes"]
            record["end_device_free_bytes"] = budgets[i] - p["end_reserved_bytes"]
        phases.append(record)
    return {"configuration": prediction["configuration"], "phases": phases}


def test_synthetic_compare_replays_under_the_recorded_budget_and_says_so():
    free = predict(SYNTHETIC)
    peak = max(p["peak_reserved_bytes"] for p in free["phases"])
    recorded = synthetic_measurement(free, [peak] * len(free["phases"]))
    result = compare(recorded)
    assert result["budget"]["replayed_under"] == "the measured budget of each phase"
    assert [r["budget_bytes"] for r in result["rows"]] == [peak] * 6 and result["outcomes_agree"]
    assert all(r[k] == 0 for r in result["rows"] for k in r if k.startswith("difference_"))
    old = compare(synthetic_measurement(free))  # a file written before the free bytes were recorded
    assert old["budget"]["replayed_under"] == "an unbounded device"
    assert "did not record the device's free bytes" in old["budget"]["rule"]
    # the budget of each phase is read from its own record: here the cold forward's is exactly its peak
    tight = [peak + 2 * GIB] * 6
    tight[2] = peak
    assert [r["budget_bytes"] for r in compare(synthetic_measurement(free, tight))["rows"]] == tight


# ---- 3. predict's budget flags, as a user runs them
def mesure(argv, cwd):
    return subprocess.run([sys.executable, str(ROOT / "lab_helpers" / "mesure_memoire.py"), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


SIZES = ["--batch", "8", "--context", "4096", "--width", "4096", "--dtype", "float32"]


def test_mesure_memoire_predict_with_and_without_a_budget(tmp_path):
    plain = mesure(["predict", *SIZES], tmp_path)
    assert plain.returncode == 0, plain.stderr
    document = json.loads(plain.stdout)
    assert document["budget"]["bytes"] is None and "unbounded device" in document["budget"]["note"]
    table = mesure(["predict", *SIZES, "--format", "table"], tmp_path)
    assert "budget: none: reserved is predicted for an unbounded device" in table.stdout
    peak = max(p["peak_reserved_bytes"] for p in document["phases"])
    held = mesure(["predict", *SIZES, "--memory-bytes", str(peak)], tmp_path)
    assert held.returncode == 0 and json.loads(held.stdout)["phases"] == document["phases"]
    short = mesure(["predict", *SIZES, "--memory-bytes", str(peak - 1)], tmp_path)
    assert short.returncode == 3, short.stderr  # a predicted out-of-memory, as measure's exit 3
    oom = json.loads(short.stdout)["out_of_memory"]
    assert (oom["phase"], oom["budget_bytes"], oom["free_under_budget_bytes"] < oom["segment_bytes"]) == (
        "cold_forward", peak - 1, True)
    table = mesure(["predict", *SIZES, "--memory-bytes", str(peak - 1), "--format", "table"], tmp_path)
    assert table.returncode == 3 and "OUT OF MEMORY predicted in phase cold_forward" in table.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_mesure_memoire_predict_device_budget_is_the_measured_usable_memory(tmp_path, monkeypatch):
    from lab_helpers.synthetic import commands
    monkeypatch.setattr(commands, "import_torch", lambda: FakeTorch)
    monkeypatch.setattr(commands, "usable_memory", lambda index: {"usable_memory_bytes": 1075838976 + GIB,
                                                                  "usable_memory_unavailable_reason": None})
    proc = run_main_in_process(commands.main, ["predict", *SIZES, "--device", "cuda:0"], tmp_path)
    assert proc.returncode == 3, proc.stderr
    document = json.loads(proc.stdout)
    assert document["budget"] == {"bytes": 1075838976 + GIB,
                                  "source": "usable memory of cuda:0, measured now in a fresh child process"}
    assert document["out_of_memory"]["phase"] == "cold_forward"


class FakeTorch:
    class cuda:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def device_count():
            return 1


def real_predict(argv, cwd):
    from lab_helpers.real.commands import main
    return run_main_in_process(main, ["predict", *argv], cwd)


def test_real_model_predict_with_and_without_each_budget_flag(tmp_path, monkeypatch):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    run = ["--config", str(config), "--batch", "1", "--context", "8", "--new-tokens", "2"]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    plain = real_predict(run, cwd)
    assert plain.returncode == 0, plain.stderr
    document = json.loads(plain.stdout)
    assert document["budget"]["bytes"] is None and "unbounded device" in document["budget"]["note"]
    # the tiny model reserves 2 MiB for its weights, then the cuBLAS workspace (32 MiB) in prefill
    assert max(p["peak_reserved_bytes"] for p in document["phases"]) == 35651584
    held = real_predict([*run, "--memory-bytes", "35651584"], cwd)
    assert held.returncode == 0 and json.loads(held.stdout)["phases"] == document["phases"]
    short = real_predict([*run, "--memory-bytes", "35651583"], cwd)
    assert short.returncode == 3, short.stderr
    failed = json.loads(short.stdout)
    assert [p["phase"] for p in failed["phases"]] == ["model_load", "inputs"]
    assert failed["out_of_memory"] == {
        "phase": "prefill", "index": None, "request_bytes": 33554432, "block_bytes": 33554432,
        "segment_bytes": 33554432, "reserved_bytes": 2097152, "allocated_bytes": 410112,
        "reserved_but_unallocated_bytes": 1687040, "budget_bytes": 35651583,
        "free_under_budget_bytes": 33554431, "released_before_failing_bytes": 0}
    table = real_predict([*run, "--memory-bytes", "35651583", "--format", "table"], cwd)
    assert "OUT OF MEMORY predicted in phase prefill: tried to allocate 32.00 MiB (33554432 B)" in table.stdout
    from lab_helpers.real.fit import gpu_budget
    by_gpu = json.loads(real_predict([*run, "--gpu", "h200-sxm"], cwd).stdout)
    assert by_gpu["budget"] == dict(zip(("bytes", "source"), gpu_budget("h200-sxm")))
    assert by_gpu["phases"] == document["phases"]
    from lab_helpers.real import commands, early_commands
    monkeypatch.setattr(commands, "usable_memory_bytes", lambda device: 35651583)
    monkeypatch.setattr(early_commands, "no_gpu_reason", lambda: None)  # --device, as on a GPU machine
    by_device = real_predict([*run, "--device", "cuda:0"], cwd)
    assert by_device.returncode == 3
    assert json.loads(by_device.stdout)["budget"] == {
        "bytes": 35651583, "source": "measured: usable memory of cuda:0, measured now in a fresh child process"}
    assert sorted(p.name for p in cwd.iterdir()) == []


def real_measurement(prediction: dict, budgets=None) -> dict:
    """A transformers document laid out as measure writes it, its counters a prediction's; with
    `budgets`, the device's free bytes each phase saw (budget - reserved)."""
    document = synthetic_measurement(prediction, budgets)
    return {"schema_version": 1, "kind": "iteragpu-lab measurement", "environment": {},
            "configuration": prediction["configuration"], "model": prediction["model"],
            "phases": document["phases"]}


def test_real_compare_is_exact_under_the_recorded_budget_where_the_unbounded_replay_is_not():
    # the tiny model with a prompt large enough that prefill caches segments it no longer uses
    shape = parse_config(TINY, "tiny")
    spec = RunSpec("tiny", batch=64, context=2048, new_tokens=2)
    free = predict_model(shape, spec)
    assert free["overall"]["peak_reserved_bytes"] == 293601280 and "cache_releases" not in free
    bounded = predict_model(shape, spec, capacity_bytes=292000000, report_out_of_memory=True)
    assert bounded["overall"]["peak_reserved_bytes"] == 291504128
    assert [p["end_reserved_bytes"] for p in bounded["phases"]] == [2097152, 2097152] + [209715200] * 3
    # prefill's next segment would pass the budget: the cached 2 MiB segment goes back, then the 80 MiB one
    assert [(r["phase"], r["released_bytes"]) for r in bounded["cache_releases"]] == [("prefill", 2097152),
                                                                                     ("prefill", 83886080)]
    assert predict_model(shape, spec, capacity_bytes=291504127, report_out_of_memory=True)[
        "out_of_memory"]["phase"] == "prefill"
    recorded = real_measurement(bounded, [292000000] * len(bounded["phases"]))
    result = compare_model(recorded)
    assert result["budget"]["replayed_under"] == "the measured budget of each phase" and result["outcomes_agree"]
    assert [r["budget_bytes"] for r in result["rows"]] == [292000000] * 5
    assert all(r[f"difference_{k}"] == 0 for r in result["rows"] for k in COUNTER_KEYS)
    unbounded = compare_model(real_measurement(bounded))  # the same file without the free bytes
    assert unbounded["budget"]["replayed_under"] == "an unbounded device"
    # replayed without a budget, nothing is released: the 80 MiB segment stays (the peak of prefill is
    # its own before the release, 2 MiB above the measured one)
    assert [r["difference_peak_reserved_bytes"] for r in unbounded["rows"]] == [0, 0, -2097152, -83886080, -83886080]


# ---- 4. the H200's boundaries, replayed on the CPU
LLAMA_4_LAYERS = dict(json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text()), num_hidden_layers=4)


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"  # as PyTorch's message prints it


def test_llama_4_layers_at_the_h200_boundary_reserves_what_the_gpu_reserved():
    shape = parse_config(LLAMA_4_LAYERS, "llama-3.1-8b-4-layers")
    spec = RunSpec(shape.name, batch=100, context=8192, new_tokens=4, decode_record_every=4)
    unbounded = predict_model(shape, spec)["overall"]["peak_reserved_bytes"]
    assert unbounded == 158276255744 > H200_USABLE  # the unbounded replay says it cannot fit
    fits = predict_model(shape, spec, capacity_bytes=H200_USABLE, report_out_of_memory=True)
    assert "out_of_memory" not in fits
    assert fits["overall"]["peak_reserved_bytes"] == 148209926144  # measured on the H200
    assert [r["phase"] for r in fits["cache_releases"]] == ["prefill", "prefill"]
    past = predict_model(shape, RunSpec(shape.name, batch=101, context=8192, new_tokens=4, decode_record_every=4),
                         capacity_bytes=H200_USABLE, report_out_of_memory=True)["out_of_memory"]
    assert past["phase"] == "prefill"
    assert (gib(past["segment_bytes"]), gib(past["free_under_budget_bytes"]), gib(past["allocated_bytes"]),
            gib(past["reserved_but_unallocated_bytes"])) == ("22.09", "21.85", "82.53", "34.75")


def test_qwen_at_the_h200_boundary_reserves_what_the_gpu_reserved():
    shape = load_config("qwen1.5-0.5b")
    spec = RunSpec(shape.name, batch=192, context=4096, new_tokens=4, decode_record_every=4)
    assert predict_model(shape, spec)["overall"]["peak_reserved_bytes"] == 157974265856
    fits = predict_model(shape, spec, capacity_bytes=H200_USABLE, report_out_of_memory=True)
    assert fits["overall"]["peak_reserved_bytes"] == 149115895808  # measured on the H200
    past = predict_model(shape, RunSpec(shape.name, batch=193, context=4096, new_tokens=4, decode_record_every=4),
                         capacity_bytes=H200_USABLE, report_out_of_memory=True)["out_of_memory"]
    assert (past["phase"], past["index"]) == ("decode", 0)
    assert (gib(past["segment_bytes"]), gib(past["free_under_budget_bytes"]), gib(past["allocated_bytes"]),
            gib(past["reserved_but_unallocated_bytes"])) == ("1.51", "1.04", "73.32", "64.76")
