"""bitsandbytes' 4-bit weights (--quantize): predicted on the CPU, pinned to the H200's counters.

The pinned figures are benchmarks/bnb_probe.py's runs on an NVIDIA H200 (torch 2.11.0+cu130,
transformers 5.17.0, bitsandbytes 0.50.2, 2026-12-01; docs/validation/2026-12-01-late-one-h200.md):
from_pretrained of a random bfloat16 checkpoint with a BitsAndBytesConfig, the prompt, the prefill
and three decode steps, each phase's (end allocated, end reserved, peak allocated, peak reserved)."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")  # in .ci/requirements-test.txt: present wherever the suite runs

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


def test_the_quantized_weights_are_smaller_and_double_quantization_smaller_still():
    spec = RunSpec("qwen", batch=1, context=16, new_tokens=1)
    loads = {}
    for kind in ("", "nf4", "nf4-double"):
        document = predict_model(shape_of("qwen1.5-0.5b", 2, kind), spec, trace_cache=TraceCache(None))
        loads[kind] = document["phases"][0]["end_allocated_bytes"]
    assert loads[""] > loads["nf4"] > loads["nf4-double"]


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
    bad = {**measurement, "model": {**measurement["model"], "quantization": "int8"}}
    with pytest.raises(LabError, match="--quantize must be one of"):
        compare_model(bad)


@pytest.mark.parametrize("kind, dtype, degree, message", [
    ("int8", "bfloat16", 1, "--quantize must be one of"),
    ("nf4", "bfloat16", 2, "--tensor-parallel must be 1"),
    ("nf4", "float64", 1, "must be one of bfloat16, float16, float32"),
])
def test_what_cannot_be_quantized_is_refused(kind, dtype, degree, message):
    with pytest.raises(LabError, match=message):
        check_quantization(kind, dtype, degree)


@pytest.mark.parametrize("extra, message", [
    (["--quantize", "nf4", "--tensor-parallel", "2"], "--tensor-parallel must be 1"),
    (["--quantize", "int8"], "invalid choice"),
    (["--quantize", "nf4", "--task", "train", "--train", "full"], "not predicted"),
])
def test_the_command_line_refuses_in_one_line(extra, message, tmp_path):
    run = subprocess.run([sys.executable, "-m", "lab_helpers.real_model", "predict", "--config", "qwen1.5-0.5b",
                          "--batch", "1", "--context", "8", "--new-tokens", "1", *extra],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # a hang guard
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and message in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == "" and list(tmp_path.iterdir()) == []
