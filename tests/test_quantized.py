"""bitsandbytes' 4-bit weights (--quantize): predicted on the CPU, pinned to the H200's counters.

The pinned figures are benchmarks/bnb_probe.py's runs on an NVIDIA H200 (torch 2.11.0+cu130,
transformers 5.17.0, bitsandbytes 0.50.2, 2026-12-01 and 2026-12-02; docs/validation/2026-12-01-late-one-h200.md,
docs/validation/2026-12-02-one-h200.md):
from_pretrained of a random bfloat16 checkpoint with a BitsAndBytesConfig, the prompt, the prefill
and three decode steps, each phase's (end allocated, end reserved, peak allocated, peak reserved)."""
import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

# in requirements.txt, wherever its wheel exists. Looked up, not imported: importing it
# (torch._dynamo with it) costs seconds of every pytest worker's collection, the lab imports it itself
# where a test needs it, and an installation that cannot be imported fails there instead of skipping
if importlib.util.find_spec("bitsandbytes") is None:
    pytest.skip("bitsandbytes is not installed", allow_module_level=True)
# its import, now in the first test that needs it, meets a deprecation of torch.jit that pytest would
# show once per scripted function (it was at collection, where none was shown)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

from conftest import training_measurement  # noqa: E402
from lab_helpers.core.errors import LabError  # noqa: E402
from lab_helpers.real.config import parse_config  # noqa: E402
from lab_helpers.real.predict import compare_model, predict_model  # noqa: E402
from lab_helpers.real.quantized import check_quantization  # noqa: E402
from lab_helpers.real.spec import COUNTER_KEYS, RunSpec  # noqa: E402
from lab_helpers.real.trace_cache import TraceCache  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PHASES = [("model_load", None), ("inputs", None), ("prefill", None), ("decode", 0), ("decode", 1), ("decode", 2)]
H200 = {
    ("llama-3.1-8b", 2, "nf4-double"): [
        (2326968320, 2478833664, 2431134720, 2478833664), (2326970368, 2478833664, 2326970368, 2478833664),
        (2362622464, 2598371328, 2510537728, 2598371328), (2362638848, 2598371328, 2363238400, 2598371328),
        (2362655232, 2598371328, 2363258880, 2598371328), (2362671616, 2598371328, 2363279360, 2598371328)],
    ("gemma-2-2b", 2, "fp4"): [
        (1269548032, 1317011456, 1302360576, 1317011456), (1269550080, 1317011456, 1269550080, 1317011456),
        (1305202688, 1390411776, 1361957376, 1390411776), (1305219072, 1390411776, 1307276288, 1390411776),
        (1305235456, 1390411776, 1307292672, 1390411776), (1305251840, 1390411776, 1307309056, 1390411776)],
    # Conv1D weights, quantized from the checkpoint's transposed (in, out) tensor (2026-12-02 probe)
    ("gpt2", 2, "nf4-double"): [
        (86533120, 167772160, 86533120, 167772160), (86535168, 167772160, 86535168, 167772160),
        (122711552, 174063616, 131854336, 174063616), (122723840, 174063616, 123137536, 174063616),
        (122736128, 174063616, 123152896, 174063616), (122748416, 174063616, 123168256, 174063616)],
}


def shape_of(name, layers, kind):
    raw = json.loads((ROOT / "data" / "models" / f"{name}.json").read_text())
    raw["num_hidden_layers"] = layers
    if "layer_types" in raw:
        raw["layer_types"] = raw["layer_types"][:layers]
    return replace(parse_config(raw, name), quantization=kind)


@pytest.mark.parametrize("case", sorted(H200), ids=lambda c: f"{c[0]}-{c[1]}L-{c[2]}")
def test_the_h200s_counters_are_predicted_to_the_byte(case):
    shape = shape_of(*case)
    prediction = predict_model(shape, RunSpec(shape.name, batch=2, context=128, new_tokens=3),
                               trace_cache=TraceCache(None))
    got = [(p["phase"], p["index"], p["end_allocated_bytes"], p["end_reserved_bytes"], p["peak_allocated_bytes"],
            p["peak_reserved_bytes"]) for p in prediction["phases"]]
    assert got == [(*phase, *counters) for phase, counters in zip(PHASES, H200[case])]
    assert prediction["model"]["quantization"] == case[2]


# --quantize int8-threshold-0 on the H200 (2026-12-02 night, docs/validation/2026-12-02-late-night-one-h200.md):
# `real_model measure --quantize int8-threshold-0 --new-tokens 4` in a fresh process, each phase's (end
# allocated, end reserved, peak allocated, peak reserved). ODD: widths not divisible by 4, where
# bitsandbytes' int8 product falls back to a float32 matmul.
ODD = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 262, "head_dim": 262,
       "intermediate_size": 690, "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 2,
       "vocab_size": 1001, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
       "tie_word_embeddings": False, "rope_theta": 10000.0}
INT8_PHASES = [("model_load", None), ("inputs", None), ("prefill", None)] + [("decode", i) for i in range(4)]
H200_INT8 = {
    ("llama-3.1-8b", 2, 1, 128): [
        (2537939968, 2776629248, 2730819584, 2776629248), (2537940992, 2776629248, 2537940992, 2776629248),
        (2572544512, 2785017856, 2597776896, 2785017856), (2572552704, 2785017856, 2572853248, 2785017856),
        (2572560896, 2785017856, 2572863488, 2785017856), (2572569088, 2785017856, 2572873728, 2785017856),
        (2572577280, 2785017856, 2572883968, 2785017856)],
    ("gpt2", 4, 2, 512): [
        (107672576, 190840832, 107672576, 190840832), (107680768, 190840832, 107680768, 190840832),
        (153818624, 192937984, 155592192, 192937984), (153843200, 192937984, 155436544, 192937984),
        (153867776, 192937984, 155464192, 192937984), (153892352, 192937984, 155491840, 192937984),
        (153916928, 192937984, 155519488, 192937984)],
    ("phi-3-mini-4k", 2, 4, 256): [
        (620780544, 931135488, 784295936, 931135488), (620788736, 931135488, 620788736, 931135488),
        (679510528, 931135488, 842143744, 931135488), (679608832, 931135488, 692389888, 931135488),
        (679707136, 931135488, 692537344, 931135488), (679805440, 931135488, 692684800, 931135488),
        (679903744, 931135488, 692832256, 931135488)],
    ("odd", 2, 1, 128): [
        (2724864, 25165824, 3162112, 25165824), (2725888, 25165824, 2725888, 25165824),
        (36549120, 60817408, 38727168, 60817408), (36553216, 60817408, 37293568, 60817408),
        (36555264, 60817408, 37295616, 60817408), (36557312, 60817408, 37297664, 60817408),
        (36559360, 60817408, 37299712, 60817408)],
}
# The one difference of the 8-bit points, reserved only: measured minus predicted from the prefill on. The
# requests are the GPU's one for one (benchmarks/bnb_requests.py); a 28 MiB request finds two free blocks of
# its size, one in the load's warm-up segment and one in a later 28 MiB segment. The driver mapped that
# segment above the warm-up segment, and the caching allocator took the lower address, in the warm-up
# segment; lab_helpers.allocator.addresses maps new granules below the last, so the prediction takes the
# later segment and maps one more 28 MiB segment afterwards.
H200_INT8_RESERVED_DIFFERENCE = {("llama-3.1-8b", 2, 2, 512): -29360128}
H200_INT8_MEASURED_RESERVED = {("llama-3.1-8b", 2, 2, 512): 2808086528}


def int8_shape(name, layers):
    if name == "odd":
        return replace(parse_config(dict(ODD), "odd"), quantization="int8-threshold-0")
    return shape_of(name, layers, "int8-threshold-0")


@pytest.mark.parametrize("case", sorted(H200_INT8), ids=lambda c: f"{c[0]}-{c[1]}L-{c[2]}x{c[3]}")
def test_the_h200s_8bit_counters_are_predicted_to_the_byte(case):
    name, layers, batch, context = case
    shape = int8_shape(name, layers)
    prediction = predict_model(shape, RunSpec(shape.name, batch=batch, context=context, new_tokens=4),
                               trace_cache=TraceCache(None))
    got = [(p["phase"], p["index"], p["end_allocated_bytes"], p["end_reserved_bytes"], p["peak_allocated_bytes"],
            p["peak_reserved_bytes"]) for p in prediction["phases"]]
    assert got == [(*phase, *counters) for phase, counters in zip(INT8_PHASES, H200_INT8[case])]
    assert prediction["model"]["quantization"] == "int8-threshold-0"


def test_the_8bit_difference_left_is_the_one_reported():
    case = ("llama-3.1-8b", 2, 2, 512)
    shape = int8_shape(*case[:2])
    prediction = predict_model(shape, RunSpec(shape.name, batch=2, context=512, new_tokens=4),
                               trace_cache=TraceCache(None))
    prefill = prediction["phases"][2]
    assert H200_INT8_MEASURED_RESERVED[case] - prefill["peak_reserved_bytes"] == H200_INT8_RESERVED_DIFFERENCE[case]
    assert prefill["end_allocated_bytes"] == 2579891712 and prefill["peak_allocated_bytes"] == 2764710912


def test_8bit_weights_are_int8_values_and_a_float32_scale_per_row():
    """The load's end: every linear layer of the decoder as out x in int8 and out float32 scales, the
    embedding, the head and the norms in bfloat16, the rotary frequencies (inv_freq and the
    original_inv_freq copy, float32), each block rounded to 512 bytes by the allocator."""
    def block(nbytes):
        return -(-nbytes // 512) * 512
    shape = int8_shape("odd", 2)
    prediction = predict_model(shape, RunSpec(shape.name, batch=1, context=8, new_tokens=1),
                               trace_cache=TraceCache(None))
    hidden, inner, vocab, head = ODD["hidden_size"], ODD["intermediate_size"], ODD["vocab_size"], ODD["head_dim"]
    linears = [(head, hidden)] * 4 + [(inner, hidden)] * 2 + [(hidden, inner)]  # q k v o, gate up, down
    per_layer = sum(block(out * inp) + block(out * 4) for out, inp in linears) + 2 * block(hidden * 2)
    expected = 2 * per_layer + 2 * block(vocab * hidden * 2) + block(hidden * 2) + 2 * block(head // 2 * 4)
    assert prediction["phases"][0]["end_allocated_bytes"] == expected


def test_the_quantized_weights_are_smaller_and_double_quantization_smaller_still():
    spec = RunSpec("qwen", batch=1, context=16, new_tokens=1)
    loads = {}
    for kind in ("", "int8-threshold-0", "nf4", "nf4-double"):
        document = predict_model(shape_of("qwen1.5-0.5b", 2, kind), spec, trace_cache=TraceCache(None))
        loads[kind] = document["phases"][0]["end_allocated_bytes"]
    assert loads[""] > loads["int8-threshold-0"] > loads["nf4"] > loads["nf4-double"]


def test_decode_steps_extended_from_traced_ones_equal_every_step_traced():
    shape = shape_of("qwen1.5-0.5b", 2, "nf4-double")
    spec = RunSpec(shape.name, batch=3, context=40, new_tokens=12)
    fast = predict_model(shape, spec, trace_cache=TraceCache(None))
    slow = predict_model(shape, spec, trace_cache=TraceCache(None), expand_decode_steps=False)
    assert json.dumps(fast, sort_keys=True) == json.dumps(slow, sort_keys=True)


def test_a_measurement_names_its_quantization_and_compare_predicts_that_one():
    shape = shape_of("qwen1.5-0.5b", 2, "fp4")
    spec = RunSpec(shape.name, batch=1, context=16, new_tokens=1)
    prediction = predict_model(shape, spec, trace_cache=TraceCache(None))
    # a measurement document holding exactly the predicted counters (its figures are the prediction's)
    phases = [{**p, "wall_seconds": 0.0} for p in prediction["phases"]]
    measurement = {"configuration": prediction["configuration"], "model": prediction["model"], "phases": phases}
    rows = compare_model(measurement)["rows"]
    assert len(rows) == 4 and all(row[f"difference_{key}"] == 0 for row in rows for key in COUNTER_KEYS)
    bad = {**measurement, "model": {**measurement["model"], "quantization": "q3"}}
    with pytest.raises(LabError, match="^quantize must be one of"):
        compare_model(bad)
    at_threshold = {**measurement, "model": {**measurement["model"], "quantization": "int8"}}
    with pytest.raises(LabError, match="outlier threshold 6.0\\) is not predicted"):
        compare_model(at_threshold)


@pytest.mark.parametrize("kind, dtype, degree, message", [
    ("q3", "bfloat16", 1, "quantize must be one of"),
    ("int8", "bfloat16", 1, "so its bytes depend on the values; --quantize int8-threshold-0"),
    ("nf4", "bfloat16", 2, "tensor_parallel must be 1"),
    ("int8-threshold-0", "bfloat16", 2, "tensor_parallel must be 1"),
    ("int8-threshold-0", "float64", 1, "must be one of bfloat16, float16, float32"),
    ("nf4", "float64", 1, "must be one of bfloat16, float16, float32"),
])
def test_what_cannot_be_quantized_is_refused(kind, dtype, degree, message):
    with pytest.raises(LabError, match=message):
        check_quantization(kind, dtype, degree)


@pytest.mark.parametrize("extra, message", [
    (["--quantize", "nf4", "--tensor-parallel", "2"], "--tensor-parallel must be 1"),
    (["--quantize", "int8"], "default outlier threshold 6.0) is not predicted"),
    (["--quantize", "q3"], "invalid choice"),
])
def test_the_command_line_refuses_in_one_line(extra, message, tmp_path):
    run = subprocess.run([sys.executable, "-m", "lab_helpers.real_model", "predict", "--config", "qwen1.5-0.5b",
                          "--batch", "1", "--context", "8", "--new-tokens", "1", *extra],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # a hang guard
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and message in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == "" and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ --train qlora
# QLoRA: the 4-bit base loaded as at inference, peft's prepare_model_for_kbit_training (frozen base, its
# 16-bit parameters cast to float32, empty_cache), then LoRA adapters (get_peft_model, q_proj and v_proj by
# default for these families). One layer of each bundled shape, its widths and vocabulary kept.
from lab_helpers.allocator.model import AllocatorModel  # noqa: E402
from lab_helpers.real.commands import main  # noqa: E402
from lab_helpers.real.train import TrainSpec, compare_training_model, predict_training_model  # noqa: E402

MIB = 2**20


def fresh_block_bytes(nbytes: int) -> int:
    """Allocated bytes of a request that opens a segment of its own (CUDACachingAllocator): from 10 MiB on
    the segment is the request rounded up to 2 MiB, and its rest is split off only when above 1 MiB;
    below, the block is the request rounded to 512 bytes."""
    rounded = AllocatorModel.round_size(nbytes)
    if rounded < 10 * MIB:
        return rounded
    segment = -(-rounded // (2 * MIB)) * (2 * MIB)
    return segment if segment - rounded <= MIB else rounded


def base_parameters(shape):
    """(name, elements) of every parameter of the unquantized model, built on meta by transformers."""
    import torch
    from transformers import AutoModelForCausalLM
    from lab_helpers.real.protocol import transformers_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(shape), dtype=torch.bfloat16)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return [(n, p.numel(), n.rsplit(".", 1)[0] in linear) for n, p in model.named_parameters()]


QLORA_CASES = [("llama-3.1-8b", "nf4-double"), ("llama-3.1-8b", "fp4"), ("qwen3-8b", "nf4-double"),
               ("qwen3-8b", "fp4"), ("qwen2.5-7b", "nf4-double")]  # qwen2.5: q/k/v biases, cast too
RANK = 8


@pytest.fixture(scope="module")
def qlora_runs():
    return {}


def qlora_prediction(runs, name, kind):
    if (name, kind) not in runs:
        pytest.importorskip("peft")
        shape = shape_of(name, 1, "")
        runs[(name, kind)] = shape, predict_training_model(
            shape, TrainSpec(name, batch=1, context=16, steps=2, train="qlora", lora_rank=RANK, quantize=kind))
    return runs[(name, kind)]


@pytest.mark.parametrize("name, kind", QLORA_CASES)
def test_qlora_trains_float32_adapters_of_rank_times_in_plus_out(qlora_runs, name, kind):
    shape, document = qlora_prediction(qlora_runs, name, kind)
    q_out, v_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # prepare_model_for_kbit_training leaves the adapters to peft, which makes them float32 (4 bytes): A is
    # rank x in, B out x rank, per target and layer
    adapters = [RANK * shape.hidden, q_out * RANK, RANK * shape.hidden, v_out * RANK] * shape.layers
    trainable = sum(AllocatorModel.round_size(4 * n) for n in adapters)
    assert trainable == shape.layers * RANK * (shape.hidden + q_out + shape.hidden + v_out) * 4
    phases = {(p["phase"], p["index"]): p for p in document["phases"]}
    for step in (0, 1):
        assert phases[("backward", step)]["end_allocated_bytes_by_kind"]["gradients"] == trainable
        zero = phases[("zero_grad", step)]
        assert zero["baseline_allocated_bytes"] - zero["end_allocated_bytes"] == trainable
    first, second = phases[("optimizer_step", 0)], phases[("optimizer_step", 1)]
    # AdamW's exp_avg and exp_avg_sq appear at the first step only
    assert first["end_allocated_bytes"] - first["baseline_allocated_bytes"] == 2 * trainable
    assert first["end_allocated_bytes_by_kind"]["optimizer_states"] == 2 * trainable
    assert second["end_allocated_bytes"] == second["baseline_allocated_bytes"]
    assert document["configuration"]["train"] == "qlora" and document["configuration"]["quantize"] == kind
    assert document["model"]["quantization"] == kind
    for p in document["phases"]:
        assert sum(p["end_allocated_bytes_by_kind"].values()) == p["end_allocated_bytes"]


@pytest.mark.parametrize("name, kind", QLORA_CASES)
def test_qlora_model_load_is_the_inference_load_plus_the_float32_casts_and_the_adapters(qlora_runs, name, kind):
    shape, document = qlora_prediction(qlora_runs, name, kind)
    inference = predict_model(replace(shape, quantization=kind), RunSpec(name, batch=1, context=16, new_tokens=1),
                              trace_cache=TraceCache(None))
    inference_load = inference["phases"][0]["end_allocated_bytes"]
    # every parameter that is not a linear layer's weight (embeddings, norms), the output head (never
    # quantized) and the biases stay bfloat16 in the 4-bit model: prepare_model_for_kbit_training casts each
    # to float32, the copy made before the bfloat16 block is freed
    parameters = base_parameters(shape)
    cast = [n for name_, n, in_linear in parameters
            if not in_linear or name_.startswith("lm_head") or name_.endswith(".bias")]
    kinds = {name_.rsplit(".", 1)[-1] for name_, _, in_linear in parameters if not in_linear}
    assert kinds <= {"weight"} and len(cast) >= 3 + 2 * shape.layers
    casts = sum(fresh_block_bytes(4 * n) - AllocatorModel.round_size(2 * n) for n in cast)
    q_out, v_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    adapters = shape.layers * RANK * (shape.hidden + q_out + shape.hidden + v_out) * 4
    load = document["phases"][0]
    assert load["end_allocated_bytes"] == inference_load + casts + adapters
    note = document["notes"][-1]
    assert note.startswith(f"qlora: the {kind} base") and f"cast {len(cast)} bfloat16 parameters" in note
    assert f"({sum(cast)} elements" in note


def test_a_qlora_measurement_compares_exactly_and_names_its_quantization(qlora_runs, tmp_path, capsys):
    _, document = qlora_prediction(qlora_runs, "qwen3-8b", "fp4")
    measurement = training_measurement(document)
    from lab_helpers.measurement.schema import measurement_problems
    assert measurement_problems(measurement) == []
    got = compare_training_model(measurement)
    assert got["allocated_exact"] is True and got["peak_reserved_worst_relative"] == 0.0
    # the model block and the configuration must name the same 4-bit base
    other = json.loads(json.dumps(measurement))
    other["model"]["quantization"] = "nf4"
    with pytest.raises(LabError, match="quantization 'nf4' is not the configuration's quantize 'fp4'"):
        compare_training_model(other)
    path = tmp_path / "qlora.json"
    path.write_text(json.dumps(measurement))
    assert main(["compare", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["allocated_exact"] is True


TINY_ODD = {"model_type": "llama", "hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 3,
            "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 1003, "max_position_embeddings": 512}


def test_qlora_with_gradient_checkpointing_keeps_fewer_activations():
    pytest.importorskip("peft")
    shape = parse_config(TINY_ODD, "tiny-odd")
    runs = [predict_training_model(shape, TrainSpec("tiny-odd", batch=3, context=96, steps=2, train="qlora",
                                                    lora_rank=5, quantize="nf4-double", gradient_checkpointing=c))
            for c in (False, True)]
    forward = [next(p for p in d["phases"] if p["phase"] == "forward") for d in runs]
    assert (forward[1]["end_allocated_bytes_by_kind"]["activations"]
            < forward[0]["end_allocated_bytes_by_kind"]["activations"])
    backward = [next(p for p in d["phases"] if p["phase"] == "backward") for d in runs]
    # float32 adapters of rank 5 on q_proj (192 -> 192) and v_proj (192 -> 64), each tensor rounded to 512 bytes
    adapters = 2 * sum(AllocatorModel.round_size(4 * 5 * n) for n in (192, 192, 192, 64))
    assert adapters == 27648
    assert backward[0]["end_allocated_bytes_by_kind"]["gradients"] == adapters
    assert backward[1]["end_allocated_bytes_by_kind"]["gradients"] == adapters
    assert "reentrant" in runs[1]["notes"][-1] and "reentrant" not in runs[0]["notes"][-1]


@pytest.mark.parametrize("command, extra, message", [
    ("predict", ["--train", "qlora", "--lora-rank", "8"], "--train qlora needs --quantize"),
    ("measure", ["--train", "qlora", "--lora-rank", "8"], "--train qlora needs --quantize"),
    ("fit", ["--train", "qlora", "--lora-rank", "8", "--memory-bytes", "1000000000"], "--train qlora needs --quantize"),
    ("predict", ["--quantize", "nf4"], "--quantize with --train full: 4-bit weights are frozen"),
    ("predict", ["--quantize", "nf4", "--train", "full"], "use --train qlora"),
    ("measure", ["--quantize", "nf4-double", "--train", "lora", "--lora-rank", "8"],
     "--quantize with --train lora: 4-bit weights are frozen"),
    ("fit", ["--quantize", "fp4", "--train", "lora", "--lora-rank", "8", "--memory-bytes", "1000000000"],
     "use --train qlora"),
    ("predict", ["--train", "qlora", "--quantize", "nf4"],
     "--lora-rank must be a whole number from 1 to 65536 with --train qlora"),
    ("predict", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "0"], "--lora-rank: must be > 0"),
    ("predict", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "4", "--lora-targets", "q_proj", "nope"],
     "--lora-targets nope: no such linear layer"),
    ("predict", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "4", "--tensor-parallel", "2"],
     "tensor-parallel training is out of scope"),
    ("measure", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "4", "--tensor-parallel", "2"],
     "tensor-parallel training is out of scope"),
    ("predict", ["--train", "qlora", "--quantize", "int8", "--lora-rank", "4"], "default outlier threshold 6.0"),
    ("predict", ["--train", "qlora", "--quantize", "int8-threshold-0", "--lora-rank", "4"],
     "QLoRA's base is one of the 4-bit kinds"),
    ("predict", ["--train", "qlora", "--quantize", "q3", "--lora-rank", "4"], "invalid choice: 'q3'"),
    ("predict", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "4", "--lora-targets", "q_proj",
                 "--dtype", "float16", "--autocast", "bfloat16"], "--autocast bfloat16 keeps float32 master weights"),
    ("predict", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "4", "--dtype", "float32", "--autocast",
                 "bfloat16"], "--autocast with --train qlora is not predicted"),
    ("fit", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "4", "--card"], "--card needs --days"),
    ("fit", ["--train", "qlora", "--quantize", "nf4", "--lora-rank", "4", "--card", "--days", "7",
             "--tensor-parallel", "2"], "tensor-parallel training is out of scope"),
])
def test_qlora_refusals_are_one_line_exit_2_and_write_nothing(capsys, tmp_path, monkeypatch, command, extra, message):
    pytest.importorskip("peft")
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "m.json"
    argv = [command, "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "8", "--task", "train", *extra]
    if command == "measure":
        argv += ["--output", str(output)]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert code == 2 and captured.out == "", captured
    assert len(err) == 1 and err[0].startswith("real_model: error: ") and message in err[0], err
    assert "Traceback" not in captured.err and list(tmp_path.iterdir()) == []


def test_fit_task_train_qlora_names_its_base_and_its_boundary_holds():
    pytest.importorskip("peft")
    from lab_helpers.allocator.budget import OutOfMemory
    from lab_helpers.real.train_fit import fit_training
    shape = parse_config(TINY_ODD, "tiny-odd")
    base = TrainSpec("tiny-odd", batch=1, context=64, train="qlora", lora_rank=4, quantize="fp4")
    budget = 140_000_000
    result = fit_training(shape, base, budget, "given", context=64)
    assert result["train"] == "qlora" and result["quantize"] == "fp4"
    largest = result["largest_batch_at_context"]
    fitting = predict_training_model(shape, replace(base, batch=largest, steps=2), budget)
    assert fitting["overall"]["peak_reserved_bytes"] <= budget
    with pytest.raises(OutOfMemory):
        predict_training_model(shape, replace(base, batch=largest + 1, steps=2), budget)


def test_the_traced_empty_cache_gives_back_wholly_free_segments_only():
    # prepare_model_for_kbit_training's torch.cuda.empty_cache(), as the meta trace replays it
    import torch
    from lab_helpers.real.train_trace import TrainingTracer
    tracer = TrainingTracer()
    alloc = tracer.allocator
    with tracer:
        large = torch.empty(30 * MIB, dtype=torch.uint8, device="meta")  # a 30 MiB segment of its own
        kept = torch.empty(100, dtype=torch.uint8, device="meta")  # a 512-byte block of a 2 MiB segment
        del large
        tracer.empty_cache()
    assert (alloc.allocated, alloc.reserved) == (512, 2 * MIB)
    del kept
    tracer.empty_cache()
    assert (alloc.allocated, alloc.reserved) == (0, 0)


def test_importing_peft_or_bitsandbytes_prints_nothing():
    """bitsandbytes' CPU backend warns, on a CPU with AVX512-BF16, of an optional kernel package the lab
    never uses (it runs bitsandbytes on meta and CUDA only): a fresh process importing them through the
    lab prints nothing."""
    import subprocess
    import sys
    code = ("from lab_helpers.real.train import import_peft; import_peft(); "
            "from lab_helpers.real.quantized import _import_bitsandbytes; _import_bitsandbytes()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout == ""


# Measured on the H200 on 2026-12-02 (evening; docs/validation/2026-12-02-evening-one-h200.md) by
# tests/test_gpu_train.py's QLoRA runs: llama-3.1-8b cut to 2 layers, nf4 with double quantization,
# LoRA rank 8 on peft's default targets, AdamW, 3 steps. With checkpointing (peft's reentrant
# checkpoint), a traced backward that kept its graph's nodes alive kept each checkpoint's
# ctx.run_function, and the layer's keyword tensors in it: 4326400 bytes a step above the GPU.
H200_QLORA = {  # (batch x context[-checkpointing]) -> (phase, index, *COUNTERS) of each record
    "1x128": [
        ('model_load', None, 0, 0, 4429207552, 6561988608, 5479028736, 6681526272),
        ('inputs', None, 4429207552, 6561988608, 4429208576, 6561988608, 4429208576, 6561988608),
        ('forward', 0, 4429208576, 6561988608, 4600933888, 6568280064, 4674201088, 6568280064),
        ('backward', 0, 4600933888, 6568280064, 4497169408, 6568280064, 4732266496, 6568280064),
        ('optimizer_step', 0, 4497169408, 6568280064, 4498873344, 6568280064, 4499725312, 6568280064),
        ('zero_grad', 0, 4498873344, 6568280064, 4498021376, 6568280064, 4498873344, 6568280064),
        ('forward', 1, 4498021376, 6568280064, 4637240832, 6570377216, 4710508032, 6570377216),
        ('backward', 1, 4637240832, 6570377216, 4498873344, 6570377216, 4768573440, 6570377216),
        ('optimizer_step', 1, 4498873344, 6570377216, 4498873344, 6570377216, 4499725312, 6570377216),
        ('zero_grad', 1, 4498873344, 6570377216, 4498021376, 6570377216, 4498873344, 6570377216),
        ('forward', 2, 4498021376, 6570377216, 4637240832, 6570377216, 4710508032, 6570377216),
        ('backward', 2, 4637240832, 6570377216, 4498873344, 6570377216, 4768573440, 6570377216),
        ('optimizer_step', 2, 4498873344, 6570377216, 4498873344, 6570377216, 4499725312, 6570377216),
        ('zero_grad', 2, 4498873344, 6570377216, 4498021376, 6570377216, 4498873344, 6570377216),
    ],
    "2x256": [
        ('model_load', None, 0, 0, 4429207552, 6561988608, 5479028736, 6681526272),
        ('inputs', None, 4429207552, 6561988608, 4429211648, 6561988608, 4429211648, 6561988608),
        ('forward', 0, 4429211648, 6561988608, 5027765248, 6566182912, 5298826752, 6566182912),
        ('backward', 0, 5027765248, 6566182912, 4497172480, 6566182912, 5553097728, 6566182912),
        ('optimizer_step', 0, 4497172480, 6566182912, 4498876416, 6566182912, 4499728384, 6566182912),
        ('zero_grad', 0, 4498876416, 6566182912, 4498024448, 6566182912, 4498876416, 6566182912),
        ('forward', 1, 4498024448, 6566182912, 5063023616, 6566182912, 5334085120, 6566182912),
        ('backward', 1, 5063023616, 6566182912, 4498876416, 6566182912, 5588356096, 6566182912),
        ('optimizer_step', 1, 4498876416, 6566182912, 4498876416, 6566182912, 4499728384, 6566182912),
        ('zero_grad', 1, 4498876416, 6566182912, 4498024448, 6566182912, 4498876416, 6566182912),
        ('forward', 2, 4498024448, 6566182912, 5063023616, 6566182912, 5334085120, 6566182912),
        ('backward', 2, 5063023616, 6566182912, 4498876416, 6566182912, 5588356096, 6566182912),
        ('optimizer_step', 2, 4498876416, 6566182912, 4498876416, 6566182912, 4499728384, 6566182912),
        ('zero_grad', 2, 4498876416, 6566182912, 4498024448, 6566182912, 4498876416, 6566182912),
    ],
    "1x128-checkpointing": [
        ('model_load', None, 0, 0, 4429207552, 6561988608, 5479028736, 6681526272),
        ('inputs', None, 4429207552, 6561988608, 4429208576, 6561988608, 4429208576, 6561988608),
        ('forward', 0, 4429208576, 6561988608, 4534856704, 6568280064, 4608647168, 6568280064),
        ('backward', 0, 4534856704, 6568280064, 4497169408, 6568280064, 4676290560, 6568280064),
        ('optimizer_step', 0, 4497169408, 6568280064, 4498873344, 6568280064, 4499725312, 6568280064),
        ('zero_grad', 0, 4498873344, 6568280064, 4498021376, 6568280064, 4498873344, 6568280064),
        ('forward', 1, 4498021376, 6568280064, 4570115072, 6570377216, 4643905536, 6570377216),
        ('backward', 1, 4570115072, 6570377216, 4498873344, 6570377216, 4701447680, 6570377216),
        ('optimizer_step', 1, 4498873344, 6570377216, 4498873344, 6570377216, 4499725312, 6570377216),
        ('zero_grad', 1, 4498873344, 6570377216, 4498021376, 6570377216, 4498873344, 6570377216),
        ('forward', 2, 4498021376, 6570377216, 4570115072, 6570377216, 4643905536, 6570377216),
        ('backward', 2, 4570115072, 6570377216, 4498873344, 6570377216, 4701447680, 6570377216),
        ('optimizer_step', 2, 4498873344, 6570377216, 4498873344, 6570377216, 4499725312, 6570377216),
        ('zero_grad', 2, 4498873344, 6570377216, 4498021376, 6570377216, 4498873344, 6570377216),
    ],
}


@pytest.mark.parametrize("point", sorted(H200_QLORA))
def test_qlora_runs_measured_on_the_h200_are_predicted_to_the_byte(point):
    pytest.importorskip("peft")
    batch, context = (int(v) for v in point.split("-")[0].split("x"))
    raw = json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text())
    shape = parse_config(dict(raw, num_hidden_layers=2), "llama-3.1-8b")
    spec = TrainSpec(shape.name, batch=batch, context=context, steps=3, train="qlora", quantize="nf4-double",
                     lora_rank=8, gradient_checkpointing=point.endswith("checkpointing"))
    document = predict_training_model(shape, spec)
    got = [(p["phase"], p["index"], *(p[k] for k in COUNTER_KEYS)) for p in document["phases"]]
    assert got == H200_QLORA[point]


def test_fit_names_its_8bit_weights_and_its_boundary_holds(tmp_path, capsys):
    """fit --quantize int8-threshold-0: the answer and its table name the weights; the largest batch
    it gives fits the budget and one more does not, each predicted on its own."""
    from lab_helpers.allocator.budget import OutOfMemory
    config = tmp_path / "odd.json"
    config.write_text(json.dumps(ODD))
    budget = 80_000_000
    argv = ["fit", "--config", str(config), "--quantize", "int8-threshold-0", "--memory-bytes", str(budget),
            "--batch", "1", "--context", "64", "--new-tokens", "2", "--no-cache"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quantization"] == "int8-threshold-0" and result["config_name"] == "odd"
    assert main([*argv, "--format", "table"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("odd, bfloat16, int8-threshold-0 weights, 2 new tokens\nbudget: 76.29 MiB (80000000 B)")
    shape = int8_shape("odd", 2)
    largest = result["largest_batch_at_context"]
    assert largest >= 1
    fitting = predict_model(shape, RunSpec("odd", batch=largest, context=64, new_tokens=2),
                            trace_cache=TraceCache(None), capacity_bytes=budget)
    assert max(p["peak_reserved_bytes"] for p in fitting["phases"]) <= budget
    with pytest.raises(OutOfMemory):
        predict_model(shape, RunSpec("odd", batch=largest + 1, context=64, new_tokens=2),
                      trace_cache=TraceCache(None), capacity_bytes=budget)
