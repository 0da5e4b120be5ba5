"""Real-model prediction on the CPU: configs, the tracer's bookkeeping, exact pinned
predictions, the commands' errors, and a 70B-shaped prediction's memory bound."""
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import run_main_in_process
from lab_helpers.allocator.addressed import AddressedAllocator, CappedAllocator
from lab_helpers.allocator.budget import OutOfMemory
from lab_helpers.allocator.history import OOM_SNAPSHOT_KIND, HistoryRecorder, timeline_from_snapshot
from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core import files
from lab_helpers.core.tables import format_bytes
from lab_helpers.measurement.protocol import PhaseError
from lab_helpers.measurement.schema import read_measurement
from lab_helpers.real import commands, early_commands
from lab_helpers.real.commands import main
from lab_helpers.real.config import ConfigError, bundled_names, load_config
from lab_helpers.real.fit import fit_model
from lab_helpers.real.predict import predict_model
from lab_helpers.real.protocol import timeline_labels, transformers_config
from lab_helpers.real.spec import COUNTER_KEYS, RunSpec, model_description, recorded_steps
from lab_helpers.real.tracer import (DEFAULT_BEHAVIOUR, AllocationTracer, argmax_staging_bytes,
                                     reduction_staging_bytes)

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096}


def run_main(capsys, *argv):
    """Run the command in-process; return (exit code, stdout, stderr lines)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


# ------------------------------------------------------------------ configs
def test_bundled_configs_give_the_published_parameter_counts():
    # counts of the real models whose config.json each file copies
    expected = {"llama-3.1-8b": 8030261248, "llama-3.1-70b": 70553706496,
                "qwen2.5-7b": 7615616512, "qwen1.5-0.5b": 463987712}
    assert set(expected) <= set(bundled_names())  # the other families: tests/test_families.py
    for name, count in expected.items():
        shape = load_config(name)
        assert shape.parameter_count() == count
        assert shape.parameter_bytes("bfloat16") == 2 * count
    tied = load_config("qwen1.5-0.5b")
    assert tied.tied_embeddings and tied.heads == tied.kv_heads == 16 and tied.head_dim == 64
    assert load_config("llama-3.1-70b").kv_heads == 8 and not load_config("llama-3.1-8b").attention_bias
    assert load_config("qwen2.5-7b").attention_bias


def _with(**changes):
    config = dict(TINY)
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key)
        else:
            config[key] = value
    return json.dumps(config)


_DROP = object()
BAD_CONFIGS = [
    ("not-json.json", "{\"model_type\": \"llama\",", "not JSON"),
    ("array.json", "[1, 2]", "JSON object"),
    ("empty.json", "", "not JSON"),
    ("no-type.json", _with(model_type=_DROP), "'model_type'"),
    ("no-hidden.json", _with(hidden_size=_DROP), "'hidden_size'"),
    ("no-layers.json", _with(num_hidden_layers=_DROP), "'num_hidden_layers'"),
    ("no-heads.json", _with(num_attention_heads=_DROP), "'num_attention_heads'"),
    ("no-vocab.json", _with(vocab_size=_DROP), "'vocab_size'"),
    ("no-mlp.json", _with(intermediate_size=_DROP), "'intermediate_size'"),
    ("unknown-type.json", _with(model_type="no-such-family"), "'model_type'"),
    ("remote-code.json", _with(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}), "'auto_map'"),
    ("heads-not-dividing.json", _with(num_attention_heads=5), "'num_attention_heads'"),
    ("kv-not-dividing.json", _with(num_key_value_heads=3), "'num_key_value_heads'"),
    ("hidden-string.json", _with(hidden_size="64"), "'hidden_size'"),
    ("hidden-float.json", _with(hidden_size=64.0), "'hidden_size'"),
    ("hidden-bool.json", _with(hidden_size=True), "'hidden_size'"),
    ("hidden-zero.json", _with(hidden_size=0), "'hidden_size'"),
    ("hidden-negative.json", _with(hidden_size=-64), "'hidden_size'"),
    ("hidden-absurd.json", _with(hidden_size=2**40), "'hidden_size'"),
    ("layers-absurd.json", _with(num_hidden_layers=10**9), "'num_hidden_layers'"),
    ("vocab-absurd.json", _with(vocab_size=10**12), "'vocab_size'"),
    ("quantised.json", _with(quantization_config={"bits": 4}), "'quantization_config'"),
    ("tied-string.json", _with(tie_word_embeddings="yes"), "'tie_word_embeddings'"),
    ("unknown-act.json", _with(hidden_act="no-such-activation"), "'hidden_act'"),
]


@pytest.mark.parametrize("name,text,needle", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_a_bad_config_exits_2_with_one_line_naming_the_key(tmp_path, capsys, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    code, out, err = run_main(capsys, "predict", "--config", path, "--batch", 1, "--context", 8, "--new-tokens", 1)
    assert code == 2 and out == ""
    assert len(err) == 1 and err[0].startswith("real_model: error: ") and needle in err[0]


def test_a_missing_config_or_unknown_name_is_refused(tmp_path, capsys):
    for config in (tmp_path / "absent.json", "llama-9"):
        code, _, err = run_main(capsys, "predict", "--config", config, "--batch", 1, "--context", 8, "--new-tokens", 1)
        assert code == 2 and len(err) == 1


@pytest.mark.parametrize("flag,value", [("--batch", "0"), ("--batch", "-1"), ("--batch", "1.5"), ("--batch", "١"),
                                        ("--batch", "99999999"), ("--context", "x"), ("--context", str(2**40)),
                                        ("--new-tokens", "0"), ("--new-tokens", "100000"), ("--dtype", "int8"),
                                        ("--decode-record-every", "0")])
def test_bad_numbers_exit_2_with_one_line(capsys, flag, value):
    argv = {"--config": "qwen1.5-0.5b", "--batch": "1", "--context": "8", "--new-tokens": "1", flag: value}
    code, out, err = run_main(capsys, "predict", *[x for kv in argv.items() for x in kv])
    assert code == 2 and out == "" and len(err) == 1 and flag in err[0]


def test_too_many_tokens_in_all_is_refused_before_any_work(capsys):
    code, _, err = run_main(capsys, "predict", "--config", "qwen1.5-0.5b", "--batch", 65536, "--context", 4096,
                            "--new-tokens", 1)
    assert code == 2 and len(err) == 1 and "batch x (context + new tokens)" in err[0]


def test_recorded_steps_are_every_kth_and_the_last():
    assert recorded_steps(1, 1) == [0]
    assert recorded_steps(5, 1) == [0, 1, 2, 3, 4]
    assert recorded_steps(10, 4) == [0, 4, 8, 9]
    assert recorded_steps(9, 4) == [0, 4, 8]


# ------------------------------------------------------------------- tracer
def test_tracer_counts_new_storages_only_and_applies_releases_before_the_next_allocation():
    alloc = AllocatorModel()
    tracer = AllocationTracer(alloc)
    with tracer:
        a = torch.empty(1000, device="meta")  # 4000 bytes -> a 4096 block of a 2 MiB small segment
        b = a + 1  # a new 4096 block
        view = b.view(10, 100)  # a view: no memory
        b.add_(1)  # in place: no memory
        del a  # released at the next allocation, before it
        c = torch.empty(3 * MIB, dtype=torch.uint8, device="meta")  # large pool: a 20 MiB segment
    tracer.collect()
    assert (alloc.allocated, alloc.reserved) == (4096 + 3 * MIB, 2 * MIB + 20 * MIB)
    assert alloc.peak_allocated == 4096 + 3 * MIB  # not 8192 + 3 MiB: `a` went first
    del b, view, c
    tracer.collect()
    assert (alloc.allocated, alloc.reserved) == (0, 22 * MIB)


@pytest.mark.parametrize("config", [TINY, {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                            "vocab_size": 1000, "n_positions": 256}], ids=["llama", "gpt2"])
def test_weight_initialisation_skips_the_meta_kernel_of_normal_and_traces_the_same_load(config, monkeypatch):
    from lab_helpers.real import tracer as tracer_module
    from lab_helpers.real.config import parse_config
    from lab_helpers.real.replay import trace_load
    shape = parse_config(dict(config), "tiny")
    calls = []
    original = tracer_module.AllocationTracer._run

    def counted(self, func, args, kwargs):
        calls.append(func)
        return original(self, func, args, kwargs)
    monkeypatch.setattr(tracer_module.AllocationTracer, "_run", counted)
    fast, _, _ = trace_load(shape, "bfloat16", 1, None)
    assert torch.ops.aten.normal_.default in calls  # the initialisation did reach the shortcut
    monkeypatch.setattr(tracer_module, "DATA_ONLY_IN_PLACE", frozenset())  # every meta kernel run
    slow, _, _ = trace_load(shape, "bfloat16", 1, None)
    assert (fast.events, fast.weights, fast.requests) == (slow.events, slow.weights, slow.requests)
    assert fast.requests > 0


def test_normal_on_a_cpu_tensor_under_the_tracer_still_draws():
    values = torch.zeros(4096)
    with AllocationTracer(AllocatorModel()):
        values.normal_()
    assert values.std().item() > 0.5  # drawn, not left as it was


def test_tracer_adds_the_math_libraries_workspaces_once_after_the_first_products():
    alloc = AllocatorModel()
    tracer = AllocationTracer(alloc)
    x = torch.empty(4, 8, device="meta")
    w = torch.empty(8, 8, device="meta")
    bias = torch.empty(8, device="meta")
    with tracer:
        y = torch.mm(x, w)  # 128 bytes -> 512, then cuBLAS's 32 MiB workspace
        assert alloc.allocated == 512 + 32 * MIB
        z = torch.addmm(bias, x, w)  # a biased product: cuBLASLt's 1 MiB workspace, once
        assert alloc.allocated == 2 * 512 + 33 * MIB
        u = torch.addmm(bias, x, w)
        v = torch.mm(x, w)
    assert alloc.allocated == 4 * 512 + 33 * MIB
    assert tracer.workspace_bytes == 33 * MIB
    del y, z, u, v


def test_a_sum_over_the_tokens_stages_what_the_h200_staged():
    """RMSNorm's weight gradient, (grad * x).sum over batch and tokens, measured on the H200
    (2026-12-02) by benchmarks/train_requests.py: (staging bytes, semaphore bytes)."""
    def staging(shape, reduced):
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return reduction_staging_bytes(shape, strides, reduced, 2, 4, DEFAULT_BEHAVIOUR)
    assert staging((1, 3072, 4096), {0, 1}) == (100663296, 128)  # llama-3.1-8b's hidden norms
    assert staging((8, 256, 4096), {0, 1}) == (67108864, 128)  # qwen3-8b's, batch 8
    assert staging((8, 256, 32, 128), {0, 1, 2}) == (67108864, 4)  # qwen3-8b's q_norm over heads
    assert staging((8, 256, 8, 128), {0, 1, 2}) == (16777216, 4)  # its k_norm
    assert staging((1, 128, 4096), {0, 1}) == (0, 0)  # 128 rows: one block per output column
    assert staging((1, 3072, 4096), {2}) == (0, 0)  # a row's mean: within a block
    # a whole-tensor mean of float32 (bitsandbytes' absmax offset), measured in 2026-11: one output
    assert reduction_staging_bytes((917504,), (1,), {0}, 4, 4, DEFAULT_BEHAVIOUR) == (448, 4)
    assert reduction_staging_bytes((65536,), (1,), {0}, 4, 4, DEFAULT_BEHAVIOUR) == (0, 0)


def test_argmax_over_a_large_vocabulary_stages_partial_results():
    # setReduceConfig by hand: 151936 values/row, 2 rows -> 19 blocks per row of 16-byte pairs
    assert argmax_staging_bytes(2, 151936, 2, DEFAULT_BEHAVIOUR) == (608, 8)
    assert argmax_staging_bytes(3, 151936, 4, DEFAULT_BEHAVIOUR) == (912, 12)
    assert argmax_staging_bytes(2, 128256, 2, DEFAULT_BEHAVIOUR) == (0, 0)  # 251 values per thread
    assert argmax_staging_bytes(16, 128256, 2, DEFAULT_BEHAVIOUR) == (0, 0)
    alloc = AllocatorModel()
    tracer = AllocationTracer(alloc)
    logits = torch.empty(2, 151936, dtype=torch.bfloat16, device="meta")
    with tracer:
        token = logits.argmax(dim=-1)
    assert alloc.allocated == 512  # the 16-byte result; staging 1024 + 512 came and went
    assert alloc.peak_allocated == 512 + 1024 + 512
    del token


def test_attention_allocates_as_cudnn_does_in_half_precision():
    alloc = AllocatorModel()
    tracer = AllocationTracer(alloc)
    q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta")
    with tracer, torch.inference_mode():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    # the output takes q's layout (MHA.cpp's alloc_with_matching_layout): a contiguous q, a
    # contiguous output, as Phi-3's prefill measured on the H200 (benchmarks/sdpa_probe.py)
    assert out.shape == (2, 4, 16, 64) and out.is_contiguous()
    tracer.collect()
    assert alloc.allocated == 16384  # seed, offset and the 256-byte workspace were freed
    assert alloc.peak_allocated == 512 + 512 + 16384 + 512


def test_capped_allocator_releases_whole_free_segments_before_running_out():
    alloc = CappedAllocator(100 * MIB)
    first = alloc.malloc(60 * MIB)
    alloc.free(first)  # cached: reserved stays
    assert alloc.reserved == 60 * MIB
    alloc.malloc(70 * MIB)  # 60 + 70 > 100: the free 60 MiB segment goes back first
    assert (alloc.allocated, alloc.reserved) == (70 * MIB, 70 * MIB)
    with pytest.raises(OutOfMemory):
        alloc.malloc(40 * MIB)


def test_equal_free_blocks_go_to_the_segment_above_20_mib_first():
    alloc = AddressedAllocator()
    small_segment = alloc.malloc(2 * MIB)  # a 20 MiB segment: 2 MiB used, 18 MiB free
    big = alloc.malloc(38 * MIB)  # a segment of its own, mapped below every 20 MiB segment
    assert big.address + big.size <= small_segment.address
    alloc.free(big)
    alloc.malloc(20 * MIB)  # 18 MiB free does not fit: the 38 MiB block splits, 18 MiB stay free
    free_18 = sorted((b.address, sum(m.size for m in b.segment)) for b in alloc.free_blocks[False] if b.size == 18 * MIB)
    assert [segment for _, segment in free_18] == [38 * MIB, 20 * MIB]
    taken = alloc.malloc(18 * MIB)  # a tie of sizes: the lowest address, the 38 MiB segment's
    assert (taken.address, sum(m.size for m in taken.segment)) == free_18[0]


def test_decode_across_one_mib_per_cache_tensor_matches_the_h200():
    # measured on an H200 (torch 2.11.0+cu130, transformers 5.17.0): each key/value tensor grows
    # from 1 MiB (small pool) to 1050624 bytes (large pool) in the first decode step
    shape = load_config("qwen1.5-0.5b")
    prediction = predict_model(shape, RunSpec("qwen1.5-0.5b", batch=1, context=512, new_tokens=4))
    got = [(r["phase"], r["index"], r["baseline_allocated_bytes"], r["end_allocated_bytes"],
            r["peak_allocated_bytes"], r["end_reserved_bytes"], r["peak_reserved_bytes"]) for r in prediction["phases"]]
    assert got[2:] == [
        ("prefill", None, 950000640, 1034935808, 1048177664, 1358954496, 1358954496),
        ("decode", 0, 1034935808, 1041534464, 1042596864, 1358954496, 1358954496),
        ("decode", 1, 1041534464, 1058381312, 1059445760, 1358954496, 1358954496),
        ("decode", 2, 1058381312, 1063652864, 1064719360, 1358954496, 1358954496),
        ("decode", 3, 1063652864, 1052743168, 1065778176, 1358954496, 1358954496),
    ]


# -------------------------------------------------------------- predictions
def test_qwen_prediction_is_pinned_to_the_byte():
    shape = load_config("qwen1.5-0.5b")
    prediction = predict_model(shape, RunSpec("qwen1.5-0.5b", batch=2, context=64, new_tokens=3))
    got = [(r["phase"], r["index"], r["baseline_allocated_bytes"], r["end_allocated_bytes"],
            r["peak_allocated_bytes"], r["end_reserved_bytes"], r["peak_reserved_bytes"]) for r in prediction["phases"]]
    assert got == [
        ("model_load", None, 0, 949996544, 1261161472, 1298137088, 1298137088),
        ("inputs", None, 949996544, 949997568, 949997568, 1298137088, 1298137088),
        ("prefill", None, 949997568, 997184000, 1000411648, 1314914304, 1314914304),
        ("decode", 0, 997184000, 997380608, 997992448, 1314914304, 1314914304),
        ("decode", 1, 997380608, 997577216, 998189056, 1314914304, 1314914304),
        ("decode", 2, 997577216, 997773824, 998385664, 1314914304, 1314914304),
    ]
    prefill = prediction["phases"][2]["bytes_at_end"]
    # tied embeddings: one 311164928-byte table; 24 layers x 2 x (2 x 16 x 64 x 64 x 2) bytes of cache
    assert prefill["weights_bytes"] == 949996544 and prefill["kv_cache_bytes"] == 12582912
    assert prefill["workspace_bytes"] == 33 * MIB
    assert prediction["model"]["transformers_version"] == "5.17.0"


# A 70B predicted without weights at tensor parallel 1 and 2, in one fresh process:
# tests/test_real_model_tp.py::test_a_70b_is_predicted_on_the_cpu_without_weights_at_tp1_and_tp2


# ----------------------------------------------------------------- commands
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def test_predict_prints_json_and_a_table(tmp_path, capsys):
    config = tiny_config(tmp_path)
    code, out, _ = run_main(capsys, "predict", "--config", config, "--batch", 2, "--context", 16, "--new-tokens", 5,
                            "--decode-record-every", 2)
    assert code == 0
    document = json.loads(out)
    assert [(p["phase"], p["index"]) for p in document["phases"]] == [
        ("model_load", None), ("inputs", None), ("prefill", None), ("decode", 0), ("decode", 2), ("decode", 4)]
    assert document["configuration"] == {"kind": "transformers", "config_name": "tiny", "dtype": "bfloat16",
                                         "batch": 2, "context": 16, "new_tokens": 5, "device": "cuda:0",
                                         "seed": 0, "decode_record_every": 2}
    for p in document["phases"]:
        assert p["end_allocated_bytes"] <= p["end_reserved_bytes"] and p["peak_allocated_bytes"] <= p["peak_reserved_bytes"]
    code, out, _ = run_main(capsys, "predict", "--config", config, "--batch", 2, "--context", 16, "--new-tokens", 1,
                            "--format", "table")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("tiny (LlamaForCausalLM, " f"{document['model']['parameter_count']} parameters), "
                        "transformers 5.17.0: bfloat16, batch 2, context 16, 1 new tokens")
    prefill = json.loads(run_main(capsys, "predict", "--config", config, "--batch", 2, "--context", 16,
                                  "--new-tokens", 1)[1])["phases"][2]
    # sizes for people, the exact bytes beside them: "1.50 MiB (1572864 B)"
    assert lines[4].split() == ["prefill", *" ".join(format_bytes(prefill[k]) for k in (
        "end_allocated_bytes", "peak_allocated_bytes", "end_reserved_bytes", "peak_reserved_bytes")).split()], lines
    assert lines[6] == "end allocated, by kind (they add up to it), and the largest transient above it:"
    # within 120 columns: the kinds split into two tables, each led by the phase
    assert max(map(len, lines)) <= 120
    second = next(i for i, line in enumerate(lines) if i > 7 and line.startswith("phase"))
    assert lines[7].split() + lines[second].split()[1:] == ["phase", "weights", "inputs", "kv", "cache", "workspace",
                                                           "activations", "transient", "peak"]
    kinds = prefill["end_allocated_bytes_by_kind"]
    assert sum(kinds.values()) == prefill["end_allocated_bytes"]
    assert lines[10].split() + lines[second + 3].split()[1:] == ["prefill", *" ".join(format_bytes(n) for n in (
        *kinds.values(), prefill["transient_peak_bytes"])).split()], lines


def test_measure_without_a_gpu_exits_2_and_writes_nothing(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = tmp_path / "m.json"
    code, _, err = run_main(capsys, "measure", "--config", tiny_config(tmp_path), "--batch", 1, "--context", 8,
                            "--new-tokens", 1, "--output", out)
    assert code == 2 and len(err) == 1 and "no CUDA or ROCm device" in err[0]
    assert not out.exists()


def test_compare_sets_a_measurement_beside_its_prediction(tmp_path, capsys):
    shape = load_config(str(tiny_config(tmp_path)))
    spec = RunSpec("tiny", batch=2, context=16, new_tokens=2)
    prediction = predict_model(shape, spec)
    # shaped as `measure` writes it (compare checks the schema first): the prediction's counters
    phases = [{"phase": r["phase"], "index": r["index"], "passes": int(r["phase"] in ("prefill", "decode")),
               "seconds": 0.25, "device_seconds": 0.125, **{k: r[k] for k in COUNTER_KEYS}}
              for r in prediction["phases"]]
    measured = {"schema_version": 1, "kind": "iteragpu-lab measurement", "environment": H200_ENVIRONMENT,
                "configuration": {"kind": "transformers", **asdict(spec)},
                "model": model_description(shape, "bfloat16"), "phases": phases}
    measured["phases"][2]["peak_allocated_bytes"] += 512
    path = tmp_path / "m.json"
    path.write_text(json.dumps(measured))
    code, out, _ = run_main(capsys, "compare", path)
    result = json.loads(out)
    assert code == 0 and result["allocated_exact"] is True
    assert [r["difference_peak_allocated_bytes"] for r in result["rows"]] == [0, 0, 512, 0, 0]
    for bad in ("{", "[]", json.dumps({"configuration": {"kind": "synthetic"}})):
        path.write_text(bad)
        code, _, err = run_main(capsys, "compare", path)
        assert code == 2 and len(err) == 1


def test_fit_reports_the_largest_sizes_and_refuses_without_a_budget(tmp_path, capsys):
    config = tiny_config(tmp_path)
    shape = load_config(str(config))
    one = predict_model(shape, RunSpec("tiny", batch=1, context=64, new_tokens=1))
    budget = one["overall"]["peak_reserved_bytes"]  # exactly what batch 1 x context 64 needs
    result = fit_model(shape, "bfloat16", 1, budget, "test", batch=1, context=64)
    assert result["fits"] and result["headroom_bytes"] == 0
    assert result["largest_context_at_batch"] >= 64 and result["largest_batch_at_context"] >= 1
    bigger = fit_model(shape, "bfloat16", 1, 10 * budget, "test", batch=1)
    assert bigger["largest_context_at_batch"] == 4095  # the config's 4096 positions minus the new token
    assert fit_model(shape, "bfloat16", 1, 1024, "test", batch=1)["largest_context_at_batch"] == 0
    code, _, err = run_main(capsys, "fit", "--config", config, "--new-tokens", 1, "--memory-bytes", 10**9)
    assert code == 2 and "--batch, --context" in err[0]
    if not torch.cuda.is_available():
        code, _, err = run_main(capsys, "fit", "--config", config, "--batch", 1, "--new-tokens", 1)
        assert code == 2 and len(err) == 1 and "--gpu or --memory-bytes" in err[0]
    code, _, err = run_main(capsys, "fit", "--config", config, "--batch", 1, "--new-tokens", 1, "--gpu", "nope")
    assert code == 2 and "valid choices" in err[0]


# ------------------------------------------------- a measurement file across the lab
H200_ENVIRONMENT = {  # as `measure` records it on the GPU machine (usable memory not probed mid-run)
    "python_version": "3.12.3", "torch_version": "2.11.0+cu130", "torch_unavailable_reason": None,
    "cuda_build_version": "13.0", "hip_build_version": None,
    "runtime_note": "cuda_build_version / hip_build_version is the runtime built into torch",
    "device": "cuda:0", "device_count": 1, "device_visible": True, "device_unavailable_reason": None,
    "device_name": "NVIDIA H200", "compute_capability": "9.0", "total_memory_bytes": 150754820096,
    "free_memory_bytes": 150000000000, "usable_memory_bytes": None, "usable_memory_unavailable_reason": None,
    "os": "Linux", "machine": "x86_64"}


@pytest.fixture(scope="module")
def transformers_measurement(tmp_path_factory):
    """A hand-made measurement file shaped as `measure` writes it: the prediction's counters, plus 4 KiB
    of peak reserved at the prefill."""
    shape = load_config("qwen1.5-0.5b")
    spec = RunSpec("qwen1.5-0.5b", batch=1, context=16, new_tokens=2)
    prediction = predict_model(shape, spec)
    phases = [{"phase": r["phase"], "index": r["index"], "passes": int(r["phase"] in ("prefill", "decode")),
               "seconds": 0.25, "device_seconds": 0.125, **{k: r[k] for k in COUNTER_KEYS}}
              for r in prediction["phases"]]
    phases[2]["peak_reserved_bytes"] += 4096
    document = {"schema_version": 1, "kind": "iteragpu-lab measurement", "environment": H200_ENVIRONMENT,
                "configuration": {"kind": "transformers", **asdict(spec)},
                "model": model_description(shape, "bfloat16"), "phases": phases}
    path = tmp_path_factory.mktemp("measured") / "mesures-qwen.json"
    path.write_text(json.dumps(document))
    return path


def test_a_transformers_measurement_passes_the_schema_and_compares_exactly(transformers_measurement, capsys):
    read_measurement(transformers_measurement)
    code, out, err = run_main(capsys, "compare", transformers_measurement)
    rows = json.loads(out)["rows"]
    assert code == 0 and err == []
    assert [r["difference_peak_reserved_bytes"] for r in rows] == [0, 0, 4096, 0, 0]
    assert all(r[f"difference_{k}"] == 0 for r in rows for k in COUNTER_KEYS if k != "peak_reserved_bytes")


def test_runs_and_plots_read_a_transformers_measurement(transformers_measurement, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.runs", str(transformers_measurement),
                           "--csv", str(tmp_path / "runs.csv")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "runs.csv").read_text().splitlines()
    assert len(lines) == 1 + 5 and "qwen1.5-0.5b" in lines[1]
    from lab_helpers.views.plots import phase_table
    table = phase_table(str(transformers_measurement))
    assert list(table.index) == ["model_load", "inputs", "prefill", "decode #0", "decode #1"]


def test_mesure_memoire_compare_points_to_real_model_compare(transformers_measurement):
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.mesure_memoire", "compare", str(transformers_measurement)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1
    assert "python -m lab_helpers.real_model compare" in lines[0]


# ------------------------------------------------------------------ hostile input
def _config_file(folder, name, content):
    path = folder / name
    if content == "FIFO":
        os.mkfifo(path)
    elif content == "DIR":
        path.mkdir()
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


BAD_CONFIGS = [  # (file name, content, words of the one-line error)
    ("not-json.json", "{model_type: llama", "not JSON"),
    ("list.json", "[1, 2, 3]", "JSON object"),
    ("string.json", '"llama"', "JSON object"),
    ("empty.json", "", "not JSON"),
    ("nested.json", "[" * 100000 + "]" * 100000, "nests too deeply"),
    ("no-hidden.json", {k: v for k, v in TINY.items() if k != "hidden_size"}, "hidden_size"),
    ("no-type.json", {k: v for k, v in TINY.items() if k != "model_type"}, "model_type"),
    ("unknown-type.json", dict(TINY, model_type="no-such-family"), "does not know"),
    ("heads.json", dict(TINY, num_attention_heads=3, num_key_value_heads=3), "not a multiple of the number of attention heads"),
    ("kv-heads.json", dict(TINY, num_key_value_heads=3), "must divide 'num_attention_heads'"),
    ("layers.json", dict(TINY, num_hidden_layers=10**12), "num_hidden_layers"),
    ("hidden.json", dict(TINY, hidden_size=2**40), "hidden_size"),
    ("vocab-text.json", dict(TINY, vocab_size="1000"), "vocab_size"),
    ("vocab-float.json", dict(TINY, vocab_size=1000.0), "vocab_size"),
    ("negative.json", dict(TINY, intermediate_size=-1), "intermediate_size"),
    ("bool.json", dict(TINY, num_hidden_layers=True), "num_hidden_layers"),
    ("quantized.json", dict(TINY, quantization_config={"bits": 4}), "quantization_config"),
    ("unknown-act.json", dict(TINY, hidden_act="no-such-activation"), "hidden_act"),
    ("nan.json", '{"model_type": "llama", "rope_theta": NaN}', "finite"),
    ("big.json", " " * (2**20 + 1), "larger than"),
    ("fifo.json", "FIFO", "not a regular file"),
    ("folder.json", "DIR", "not a regular file"),
]
SIZES = ["--batch", "1", "--context", "16", "--new-tokens", "1"]
BAD_FLAGS = [  # (argv after the command, words of the one-line error)
    (["predict", "--config", "no-such-model", *SIZES], "neither a file nor a bundled config"),
    (["predict", "--config", "tiny.json", "--batch", "\u0661", "--context", "16", "--new-tokens", "1"], "--batch"),
    (["predict", "--config", "tiny.json", "--batch", "\uff11\uff12", "--context", "16", "--new-tokens", "1"], "--batch"),
    (["predict", "--config", "tiny.json", "--batch", "1", "--context", "9" * 4300, "--new-tokens", "1"], "--context"),
    (["predict", "--config", "tiny.json", "--batch", "-1", "--context", "16", "--new-tokens", "1"], "--batch"),
    (["predict", "--config", "tiny.json", "--batch", "1_0", "--context", "16", "--new-tokens", "1"], "--batch"),
    (["predict", "--config", "tiny.json", "--batch", "0", "--context", "16", "--new-tokens", "1"], "--batch"),
    (["predict", "--config", "tiny.json", "--batch", "65536", "--context", "4194304", "--new-tokens", "1"],
     "at most"),
    (["predict", "--config", "tiny.json", *SIZES, "--dtype", "int8"], "--dtype"),
    (["predict", "--config", "tiny.json", *SIZES, "--format", "xml"], "--format"),
    (["measure", "--config", "tiny.json", *SIZES, "--device", "cpu", "--output", "new.json"], "cuda:N"),
    (["measure", "--config", "tiny.json", *SIZES, "--device", "cuda:\u0661", "--output", "new.json"], "cuda:N"),
    (["measure", "--config", "tiny.json", *SIZES, "--output", "taken.json"], "already exists"),
    (["measure", "--config", "tiny.json", *SIZES, "--output", "taken.json/new.json"], "taken.json"),
    (["measure", "--config", "tiny.json", *SIZES, "--output", "missing/new.json"], "new.json"),
    (["measure", "--config", "tiny.json", *SIZES, "--seed", "9" * 5000, "--output", "new.json"], "--seed"),
    (["fit", "--config", "tiny.json", "--new-tokens", "1", "--memory-bytes", "1"], "--batch, --context"),
    (["fit", "--config", "tiny.json", "--batch", "1", "--new-tokens", "1", "--gpu", "no-such-gpu"], "no-such-gpu"),
    (["fit", "--config", "tiny.json", "--batch", "1", "--new-tokens", "1", "--memory-bytes", "0"], "--memory-bytes"),
    (["compare", "taken.json"], "taken.json"),
    (["compare", "fifo.json"], "fifo.json"),
    (["compare", "missing.json"], "missing.json"),
    (["frobnicate"], "invalid choice"),
]


def _refused(folder, argv, words, sample=False):
    """The refusal checks, in this process, or as a fresh `python -m` for each table's first row (a
    `sample`: the exit code and stderr the shell sees; a fresh Python pays some 9 s of CPU importing
    torch and transformers, so one row per table) and for every row naming the FIFO (its subprocess
    timeout guards a hang)."""
    before = sorted(p.name for p in folder.iterdir())
    fresh = "fifo.json" in argv or sample
    if fresh:
        proc = subprocess.run([sys.executable, "-m", "lab_helpers.real_model", *argv], cwd=folder, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdin=subprocess.DEVNULL)
    else:
        proc = run_main_in_process(main, [str(a) for a in argv], folder)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (argv[:4], proc.stderr[-500:])
    assert len(lines) == 1 and lines[0].startswith("real_model") and "error:" in lines[0], proc.stderr[-500:]
    assert words in lines[0] and "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in folder.iterdir()) == before, "nothing created"


@pytest.fixture()
def hostile_folder(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    (tmp_path / "taken.json").write_text("keep")
    os.mkfifo(tmp_path / "fifo.json")
    return tmp_path


@pytest.mark.parametrize("name,content,words", BAD_CONFIGS, ids=[row[0] for row in BAD_CONFIGS])
@pytest.mark.parametrize("command", ["predict", "fit"])
def test_a_bad_config_is_refused_in_one_line_before_any_work(hostile_folder, name, content, words, command):
    folder = hostile_folder / "configs"
    folder.mkdir()
    config = _config_file(folder, name, content)
    argv = [command, "--config", str(config), "--batch", "1", "--new-tokens", "1"]
    _refused(hostile_folder, argv + (["--context", "16"] if command == "predict" else ["--memory-bytes", "1000"]),
             words, sample=name == BAD_CONFIGS[0][0])


@pytest.mark.parametrize("argv,words", BAD_FLAGS, ids=[f"{i}-{row[0][0]}" for i, row in enumerate(BAD_FLAGS)])
def test_a_bad_flag_is_refused_in_one_line_and_creates_nothing(hostile_folder, argv, words):
    _refused(hostile_folder, argv, words, sample=argv == BAD_FLAGS[0][0])
    assert (hostile_folder / "taken.json").read_text() == "keep"


def test_a_config_path_is_named_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "bad.json").write_text("not json")
    with pytest.raises(ConfigError, match=r"^config sub/bad\.json is not JSON"):
        load_config("sub/bad.json")


# ------------------------------------------------------------------ measure --timeline
TIMELINE_REFUSED = [  # (flags after the sizes, words of the one-line error)
    (["--output", "new.json", "--timeline", "taken.json"], "taken.json already exists"),
    (["--output", "new.json", "--timeline", "new.json"], "--output, --timeline and its .oom.json must be different"),
    (["--output", "new.oom.json", "--timeline", "new.json"], "--output, --timeline and its .oom.json must be different"),
    (["--output", "new.json", "--timeline", "missing/t.json"], "its folder does not exist"),
    (["--output", "new.json", "--timeline", "taken.json/t.json"], "taken.json"),
    (["--output", "new.json", "--timeline-stacks"], "--timeline-stacks and --timeline-max-entries need --timeline"),
    (["--output", "new.json", "--timeline-max-entries", "10"], "need --timeline FILE"),
    *[(["--output", "new.json", "--timeline", "t.json", "--timeline-max-entries", bad], "--timeline-max-entries")
      for bad in ("0", "-1", "1.5", "x", "\u0661", str(2**31))],
]


@pytest.mark.parametrize("flags,words", TIMELINE_REFUSED, ids=[f"{i}" for i in range(len(TIMELINE_REFUSED))])
def test_measure_timeline_flags_are_refused_in_one_line_before_any_work(hostile_folder, flags, words):
    _refused(hostile_folder, ["measure", "--config", "tiny.json", *SIZES, *flags], words,
             sample=flags == TIMELINE_REFUSED[0][0])
    assert (hostile_folder / "taken.json").read_text() == "keep"


def test_measure_timeline_refuses_a_taken_oom_snapshot_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(commands, "measure_model", lambda *a: pytest.fail("measured despite a taken path"))
    (tmp_path / "t.oom.json").write_text("keep")
    code, out, err = run_main(capsys, "measure", "--config", tiny_config(tmp_path), *SIZES,
                              "--output", tmp_path / "m.json", "--timeline", tmp_path / "t.json")
    assert code == 2 and out == "" and err == [f"real_model: error: {tmp_path / 't.oom.json'} already exists; "
                                              "choose a new file name"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.oom.json", "tiny.json"]
    assert (tmp_path / "t.oom.json").read_text() == "keep"


def test_measure_timeline_without_a_gpu_says_so_and_writes_nothing(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    config = tiny_config(tmp_path)
    code, out, err = run_main(capsys, "measure", "--config", config, *SIZES, "--output", tmp_path / "m.json",
                              "--timeline", tmp_path / "t.json", "--timeline-stacks")
    assert code == 2 and out == "" and len(err) == 1 and "no CUDA or ROCm device" in err[0] and "CPU" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.json"]


def _fake_timeline():
    snapshot = {"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 2 * MIB, "stream": 0, "time_us": 100},
        {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 110}]]}
    return timeline_from_snapshot(snapshot, [("model_load", None, 100, 120)], device=0)


def test_measure_timeline_is_written_after_the_measurement(tmp_path, monkeypatch, capsys):
    from lab_helpers.measurement import recording
    order = []

    def fake_measure(shape, spec, history):
        assert isinstance(history, HistoryRecorder) and history.stacks and history.max_entries == 5000
        history.timeline = _fake_timeline()
        return {"phases": [{}, {}, {}]}
    real_text = files.write_new_text  # write_new_json writes through it too; write_timeline names it itself
    monkeypatch.setattr(commands, "measure_model", fake_measure)
    monkeypatch.setattr(early_commands, "no_gpu_reason", lambda: None)  # as on a GPU machine
    monkeypatch.setattr(files, "write_new_text", lambda p, t: (order.append(Path(p).name), real_text(p, t)))
    monkeypatch.setattr(recording, "write_new_text", lambda p, t: (order.append(Path(p).name), real_text(p, t)))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "measure", "--config", tiny_config(tmp_path), *SIZES, "--output", "m.json",
                              "--timeline", "t.json", "--timeline-stacks", "--timeline-max-entries", 5000)
    assert code == 0, err
    assert json.loads(out) == {"output": "m.json", "phases": 3, "timeline": "t.json", "timeline_events": 2}
    assert order == ["m.json", "t.json"]
    assert json.loads((tmp_path / "t.json").read_text()) == _fake_timeline()


def test_measure_out_of_memory_with_timeline_writes_only_the_snapshot(tmp_path, monkeypatch, capsys):
    def failing_measure(shape, spec, history):
        error = PhaseError("decode 3", RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB"))
        error.oom_snapshot = {"kind": OOM_SNAPSHOT_KIND, "phase": error.phase, "failed_request_bytes": 2 * MIB}
        raise error
    monkeypatch.setattr(commands, "measure_model", failing_measure)
    monkeypatch.setattr(early_commands, "no_gpu_reason", lambda: None)  # as on a GPU machine
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "measure", "--config", tiny_config(tmp_path), *SIZES, "--output", "m.json",
                              "--timeline", "t.json")
    assert code == 3 and out == ""
    assert err == ["real_model: error: phase decode 3 failed: RuntimeError: CUDA out of memory. Tried to allocate "
                   "2.00 MiB; no file written; out-of-memory snapshot: t.oom.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.oom.json", "tiny.json"]
    assert json.loads((tmp_path / "t.oom.json").read_text())["failed_request_bytes"] == 2 * MIB
    # a CUDA error that is not out of memory leaves no snapshot and says nothing about one
    monkeypatch.setattr(commands, "measure_model", lambda *a: (_ for _ in ()).throw(
        PhaseError("prefill", RuntimeError("CUDA error: an illegal memory access was encountered"))))
    code, _, err = run_main(capsys, "measure", "--config", "tiny.json", *SIZES, "--output", "m.json",
                            "--timeline", "u.json")
    assert code == 3 and err[0].endswith("illegal memory access was encountered; no file written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.oom.json", "tiny.json"]


def test_timeline_labels_name_the_parameters_inputs_and_the_cache_tensors(tmp_path):
    from transformers import AutoModelForCausalLM, DynamicCache
    hf_config = transformers_config(load_config(str(tiny_config(tmp_path))))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, TINY["vocab_size"], (1, 8))
    cache = DynamicCache(config=hf_config)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    labels = timeline_labels({"model_load": model, "inputs": ids, "prefill": cache})
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kv = [t.untyped_storage().data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(set(kv)) == 2 * TINY["num_hidden_layers"]
    assert all(layer.keys.shape[-2] == 9 for layer in cache.layers)  # the prompt's 8 tokens and one decoded
    assert {a: labels[a] for a in kv} == dict.fromkeys(kv, "kv_cache")
    assert {a: labels[a] for a in weights} == dict.fromkeys(weights, "weights")
    assert labels[ids.untyped_storage().data_ptr()] == "inputs"
    assert len(labels) == len(weights) + len(kv) + 1
