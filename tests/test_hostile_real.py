"""Hostile inputs to the real-model program, each run as a user would run it: a subprocess of
`python -m lab_helpers.real_model` in an empty working folder. Every row must end in exit 2, one
line on stderr naming the fault, no traceback, empty stdout, no path the user did not type and
nothing created in the working folder. Timeouts are generous: the suite runs on busy machines."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_main_in_process

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096}
RUN = ["--batch", "1", "--context", "8", "--new-tokens", "2"]


def raw_text(text):
    """A config file holding `text` exactly."""
    return lambda: text


def with_keys(**extra):
    return raw_text(json.dumps({**TINY, **extra}))


def with_tail(tail: str):
    """TINY with `tail` (JSON text for one more key) spliced in before the closing brace."""
    return raw_text(json.dumps(TINY)[:-1] + ", " + tail + "}")


def predict(config_maker, expected, *more):
    return ("predict", config_maker, [*RUN, *more], expected)


def fit(config_maker, expected, *more):
    return ("fit", config_maker, ["--batch", "1", "--new-tokens", "2", "--memory-bytes", str(10**9), *more],
            expected)


DEEP_LIST = "[" * 500 + "]" * 500
DEEP_DICT = '{"a": ' * 300 + "1" + "}" * 300
CASES = {
    # ---- 1. deeply nested or oversized JSON, non-JSON constants
    "deep-list-500": predict(with_tail(f'"extra": {DEEP_LIST}'), "nests too deeply (more than 32 levels)"),
    "deep-dict-300": predict(with_tail(f'"extra": {DEEP_DICT}'), "nests too deeply (more than 32 levels)"),
    "deep-33": predict(with_tail('"extra": ' + "[" * 33 + "]" * 33), "nests too deeply (more than 32 levels)"),
    "deep-100000": predict(with_tail('"extra": ' + "[" * 100000 + "]" * 100000), "nests too deeply"),
    "deep-in-rope": predict(with_tail('"rope_scaling": {"x": ' + "[" * 400 + "]" * 400 + "}"), "nests too deeply"),
    "deep-unclosed": predict(with_tail('"extra": ' + "[" * 5000), "nests too deeply"),
    "deep-fit": fit(with_tail(f'"extra": {DEEP_LIST}'), "nests too deeply (more than 32 levels)"),
    "oversized": predict(with_tail('"extra": "' + "x" * (2**20 + 10) + '"'), "larger than 1048576 bytes"),
    "nan-top": predict(with_tail('"rope_theta": NaN'), "holds NaN: not a finite number"),
    "infinity": predict(with_tail('"rope_theta": Infinity'), "holds Infinity"),
    "minus-infinity": predict(with_tail('"initializer_range": -Infinity'), "holds -Infinity"),
    "nan-nested": predict(with_tail('"extra": {"a": [1, NaN]}'), "holds NaN: not a finite number"),
    "1e400-nested": predict(with_tail('"extra": {"a": [1e400]}'), "not a finite number"),
    "1e400-theta": predict(with_tail('"rope_theta": 1e400'), "'rope_theta' is not a finite number"),
    "top-array": predict(raw_text("[1, 2]"), "must hold a JSON object"),
    "top-string": predict(raw_text('"llama"'), "must hold a JSON object"),
    "not-json": predict(raw_text("{model_type: llama"), "is not JSON"),
    "empty-file": predict(raw_text(""), "is not JSON"),
    "trailing-comma": predict(raw_text('{"model_type": "llama",}'), "is not JSON"),
    "not-utf8": predict(raw_text(b'{"model_type": "ll\xff"}'), "UTF-8"),
    "utf16": predict(raw_text(json.dumps(TINY).encode("utf-16")), "UTF-16"),
    # ---- 2. wrongly typed or inconsistent fields
    "bos-string": predict(with_keys(bos_token_id="x"), "'bos_token_id'"),
    "bos-list-of-strings": predict(with_keys(bos_token_id=["a"]), "'bos_token_id'"),
    "eos-object": predict(with_keys(eos_token_id={"a": 1}), "'eos_token_id'"),
    "eps-string": predict(with_keys(rms_norm_eps="small"), "'rms_norm_eps'"),
    "eps-list": predict(with_keys(rms_norm_eps=[1e-5]), "'rms_norm_eps'"),
    "init-range-string": predict(with_keys(initializer_range="x"), "'initializer_range'"),
    "rope-params-string": predict(with_keys(rope_parameters="x"), "'rope_parameters' must be an object"),
    "rope-params-list": predict(with_keys(rope_parameters=[1]), "'rope_parameters' must be an object"),
    "rope-params-int": predict(with_keys(rope_parameters=3), "'rope_parameters' must be an object"),
    "rope-scaling-string": predict(with_keys(rope_scaling="linear"), "'rope_scaling' must be an object"),
    "rope-type-int": predict(with_keys(rope_scaling={"rope_type": 3}), "'rope_type' must be a string"),
    "rope-type-unknown": predict(with_keys(rope_parameters={"rope_type": "zzz", "rope_theta": 1e4}),
                                 "unknown rope_type 'zzz'"),
    "rope-type-unknown-old": predict(with_keys(rope_scaling={"type": "zzz", "factor": 2.0}), "unknown rope_type"),
    "rope-linear-no-factor": predict(with_keys(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
                                     "'rope_parameters'"),
    "rope-llama3-no-keys": predict(with_keys(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                                   "'rope_parameters'"),
    "rope-yarn-no-factor": predict(with_keys(rope_scaling={"rope_type": "yarn"}), "'rope_parameters'"),
    "rope-nan-factor": predict(with_tail('"rope_scaling": {"rope_type": "linear", "factor": NaN}'), "holds NaN: not a finite number"),
    "layer-types-short": predict(with_keys(layer_types=["full_attention"]), "'layer_types'"),
    "layer-types-long": predict(with_keys(layer_types=["full_attention"] * 3), "'layer_types'"),
    "layer-types-int": predict(with_keys(layer_types=3), "'layer_types'"),
    "layer-types-ints": predict(with_keys(layer_types=[1, 2]), "'layer_types'"),
    "layer-types-string": predict(with_keys(layer_types="full_attention"), "'layer_types'"),
    "model-type-list": predict(with_keys(model_type=["llama"]), "'model_type' must be a string"),
    "model-type-object": predict(with_keys(model_type={"a": 1}), "'model_type' must be a string"),
    "model-type-int": predict(with_keys(model_type=3), "'model_type' must be a string"),
    "model-type-null": predict(with_keys(model_type=None), "'model_type' must be a string"),
    "model-type-unknown": predict(with_keys(model_type="no-such-family"), "'model_type' names 'no-such-family'"),
    "model-type-not-causal": predict(with_keys(model_type="vit"), "has no causal language model"),
    "model-type-without-sdpa": predict(with_keys(model_type="bloom"), "builds BloomForCausalLM, which has no SDPA attention"),
    "model-type-without-sdpa-moe": predict(with_keys(model_type="gpt_oss", num_local_experts=4),
                                           "builds GptOssForCausalLM, which has no SDPA attention"),
    "remote-code": predict(with_keys(auto_map={"AutoModelForCausalLM": "x.XForCausalLM"}), "'auto_map' names remote code"),
    "quantized-bitsandbytes": predict(with_keys(quantization_config={"quant_method": "bitsandbytes"}),
                                      "quantized weights are not predicted"),
    "theta-4301-digits": predict(with_tail('"rope_theta": 1' + "0" * 4300), "is not JSON"),
    "theta-4299-digits": predict(with_tail('"rope_theta": 1' + "0" * 4298), "'rope_theta' is a whole number beyond"),
    "theta-nested-big-int": predict(with_tail('"rope_scaling": {"factor": 1' + "0" * 40 + "}"),
                                    "'factor' is a whole number beyond"),
    "theta-string": predict(with_keys(rope_theta="big"), "'rope_theta'"),
    "pad-past-vocab": predict(with_keys(pad_token_id=5000), "'pad_token_id'"),
    "pad-below-vocab": predict(with_keys(pad_token_id=-5000), "'pad_token_id'"),
    "pad-bool": predict(with_keys(pad_token_id=True), "'pad_token_id'"),
    "pad-string": predict(with_keys(pad_token_id="0"), "'pad_token_id'"),
    "hidden-string": predict(with_keys(hidden_size="64"), "'hidden_size'"),
    "hidden-huge": predict(with_keys(hidden_size=10**9), "'hidden_size'"),
    "vocab-float": predict(with_keys(vocab_size=1000.0), "'vocab_size'"),
    "heads-not-dividing": predict(with_keys(num_attention_heads=3), "'num_attention_heads'"),
    "kv-heads-zero": predict(with_keys(num_key_value_heads=0), "'num_key_value_heads'"),
    "tie-string": predict(with_keys(tie_word_embeddings="yes"), "'tie_word_embeddings'"),
    "positions-string": predict(with_keys(max_position_embeddings="4096"), "'max_position_embeddings'"),
    "fit-bad-field": fit(with_keys(rms_norm_eps="small"), "'rms_norm_eps'"),
    "heads-zero": predict(with_keys(num_attention_heads=0), "'num_attention_heads' must be from 1 to 1024, got 0"),
    "hidden-1e6": predict(with_keys(hidden_size=1000000), "'hidden_size' must be from 1 to 65536, got 1000000"),
    "text-config-heads-zero": predict(with_keys(text_config={"model_type": "llama", "num_attention_heads": 0}),
                                      "'text_config.num_attention_heads'"),
    "encoder-bert": predict(with_keys(model_type="bert", architectures=["BertForMaskedLM"]),
                            "'bert' is an encoder family, not a decoder-only causal language model"),
    "encoder-decoder-t5": predict(with_keys(model_type="t5"), "'t5' is an encoder-decoder family"),
    "architectures-no-causal-lm": predict(with_keys(architectures=["LlamaForSequenceClassification"]),
                                          "'architectures' names LlamaForSequenceClassification"),
    "hugging-face-id": ("predict", "meta-llama/Llama-3.1-8B", RUN, "did you mean llama-3.1-8b? for a Hugging Face "
                        "model, download its config.json and pass its path (or the folder holding it)"),
    # ---- 3. rope types whose frequencies depend on the positions' values
    "rope-dynamic": predict(with_keys(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic' is not covered"),
    "rope-dynamic-old-key": predict(with_keys(rope_scaling={"type": "dynamic", "factor": 2.0}), "'dynamic'"),
    "rope-dynamic-params": predict(with_keys(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                              "rope_theta": 1e4}), "'dynamic' is not covered"),
    "rope-longrope": predict(with_keys(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                     "long_factor": [2.0] * 8,
                                                     "original_max_position_embeddings": 1024}),
                             "'longrope' is not covered"),
    "rope-longrope-fit": fit(with_keys(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                     "long_factor": [2.0] * 8}), "'longrope'"),
    # ---- 5. a context beyond the model's positions
    "context-beyond-8b": ("predict", "llama-3.1-8b", ["--batch", "1", "--context", "200000", "--new-tokens", "2"],
                          "beyond the model's 131072 positions"),
    "context-plus-new-beyond": predict(with_keys(max_position_embeddings=9), "--beyond-positions"),
    "measure-context-beyond": ("measure", "llama-3.1-8b", ["--batch", "1", "--context", "200000", "--new-tokens",
                                                           "2", "--output", "m.json"], "--beyond-positions"),
    "fit-context-beyond": ("fit", "llama-3.1-8b", ["--context", "200000", "--new-tokens", "2", "--memory-bytes",
                                                   str(10**12)], "beyond the model's 131072 positions"),
}


def measurement(tmp, change):
    """A schema-valid transformers measurement, shaped as `measure` writes it, changed by `change`."""
    from dataclasses import asdict

    from lab_helpers.real.config import parse_config
    from lab_helpers.real.predict import predict_model
    from lab_helpers.real.spec import COUNTER_KEYS, RunSpec, model_description
    shape, spec = parse_config(TINY, "tiny"), RunSpec("tiny", batch=1, context=8, new_tokens=2)
    prediction = predict_model(shape, spec)
    phases = [{"phase": r["phase"], "index": r["index"], "passes": int(r["phase"] in ("prefill", "decode")),
               "seconds": 0.25, "device_seconds": 0.125, **{k: r[k] for k in COUNTER_KEYS}}
              for r in prediction["phases"]]
    document = {"schema_version": 1, "kind": "iteragpu-lab measurement", "environment": ENVIRONMENT,
                "configuration": {"kind": "transformers", **asdict(spec)},
                "model": model_description(shape, "bfloat16"), "phases": phases}
    change(document)
    return document


ENVIRONMENT = {
    "python_version": "3.12.3", "torch_version": "2.11.0+cu130", "torch_unavailable_reason": None,
    "cuda_build_version": "13.0", "hip_build_version": None,
    "runtime_note": "cuda_build_version / hip_build_version is the runtime built into torch",
    "device": "cuda:0", "device_count": 1, "device_visible": True, "device_unavailable_reason": None,
    "device_name": "NVIDIA H200", "compute_capability": "9.0", "total_memory_bytes": 150754820096,
    "free_memory_bytes": 150000000000, "usable_memory_bytes": None, "usable_memory_unavailable_reason": None,
    "os": "Linux", "machine": "x86_64"}


def drop_phase_name(d):
    del d["phases"][1]["phase"]


def counter_string(d):
    d["phases"][1]["peak_allocated_bytes"] = "12"


def env(value):
    def change(d):
        d["environment"] = value
    return change


COMPARE_CASES = {
    "valid-control-then-string-kind": (lambda d: d.update(kind=3), "kind"),
    "phase-without-name": (drop_phase_name, "phase"),
    "counter-string": (counter_string, "peak_allocated_bytes"),
    "environment-list": (env([1, 2]), "environment"),
    "environment-string": (env("h200"), "environment"),
    "environment-null": (env(None), "environment"),
}


SUBPROCESS_EVERY = 12  # one row in twelve of a table also runs as a fresh `python -m` (the rest in-process)


def run_program(argv, cwd, timeout=300, in_process=False):
    if in_process:
        from lab_helpers.real.commands import main
        return run_main_in_process(main, argv, cwd)
    env_vars = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lab_helpers.real_model", *argv], cwd=cwd, env=env_vars,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_refusal(proc, cwd, expected, typed):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("real_model: error: "), lines
    assert expected in lines[0], lines
    assert proc.stdout == ""
    assert sorted(os.listdir(cwd)) == [], "nothing is created in the working folder"
    shown = lines[0]
    for path in typed:
        shown = shown.replace(path, "<typed>")
    assert str(ROOT) not in shown and os.path.expanduser("~") + "/" not in shown, lines
    assert "site-packages" not in shown and "/tmp" not in shown, lines


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_input_ends_in_one_line(tmp_path, case):
    command, config, argv, expected = CASES[case]
    cwd, files = tmp_path / "cwd", tmp_path / "files"
    cwd.mkdir()
    files.mkdir()
    if callable(config):
        body = config()
        path = files / "config.json"
        (path.write_bytes if isinstance(body, bytes) else path.write_text)(body)
        config = str(path)
    in_process = sorted(CASES).index(case) % SUBPROCESS_EVERY != 0
    proc = run_program([command, "--config", config, *argv], cwd, in_process=in_process)
    assert_one_line_refusal(proc, cwd, expected, [config])


@pytest.mark.parametrize("case", sorted(COMPARE_CASES))
def test_compare_refuses_a_malformed_measurement_against_the_schema(tmp_path, case):
    change, expected = COMPARE_CASES[case]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = tmp_path / "m.json"
    path.write_text(json.dumps(measurement(tmp_path, change)))
    in_process = sorted(COMPARE_CASES).index(case) % SUBPROCESS_EVERY != 0
    proc = run_program(["compare", str(path)], cwd, in_process=in_process)
    assert_one_line_refusal(proc, cwd, expected, [str(path)])


SPECIAL_CASES = {
    # ---- 6. what --config may name on disk
    "folder-without-config": ("folder", "a folder without a config.json"),
    "folder-with-a-folder-config": ("folder-folder", "folder"),
    "folder-with-deep-config": ("folder-deep", "nests too deeply"),
    "fifo": ("fifo", "not a regular file"),
    "dev-zero": ("/dev/zero", "not a regular file"),
    "missing-json": ("missing.json", "cannot read"),
    "missing-name": ("llama-9", "neither a file nor a bundled config"),
    "newline-in-name": ("bad\nname", "neither a file"),
    "escape-in-name": ("bad\x1b[31mname", "neither a file"),
    # ---- 4. compare's file itself
    "compare-list": ("compare:[1]", "must be object"),
    "compare-deep": ("compare:" + "[" * 400 + "]" * 400, "nested"),
    "compare-nan": ('compare:{"a": NaN}', "m.json"),
}


@pytest.mark.parametrize("case", sorted(SPECIAL_CASES))
def test_a_hostile_path_ends_in_one_line(tmp_path, case):
    what, expected = SPECIAL_CASES[case]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    if what.startswith("compare:"):
        path = tmp_path / "m.json"
        path.write_text(what[len("compare:"):])
        proc = run_program(["compare", str(path)], cwd,
                           in_process=sorted(SPECIAL_CASES).index(case) % SUBPROCESS_EVERY != 0)
        assert_one_line_refusal(proc, cwd, expected, [str(path)])
        return
    if what.startswith("folder"):
        config = tmp_path / "model"
        config.mkdir()
        if what == "folder-folder":
            (config / "config.json").mkdir()
        elif what == "folder-deep":
            (config / "config.json").write_text(json.dumps(TINY)[:-1] + ', "x": ' + DEEP_LIST + "}")
        config = str(config)
    elif what == "fifo":
        config = str(tmp_path / "pipe.json")
        os.mkfifo(config)
    else:
        config = what if what.startswith("/") or "." not in what else str(tmp_path / what)
    # a FIFO or a device path could hang a reader: those rows run as a fresh Python under its timeout
    fresh = what == "fifo" or what.startswith("/") or sorted(SPECIAL_CASES).index(case) % SUBPROCESS_EVERY == 0
    proc = run_program(["predict", "--config", config, *RUN], cwd, in_process=not fresh)
    assert_one_line_refusal(proc, cwd, expected, [str(tmp_path)])
    assert "\x1b" not in proc.stderr and proc.stderr.count("\n") == 1


def test_a_model_folder_is_read_through_its_config_json(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    # in-process: what a folder reads is the property here; the table's fresh rows cover the process
    by_folder = run_program(["predict", "--config", str(folder), *RUN], cwd, in_process=True)
    assert "Traceback" not in by_folder.stderr, by_folder.stderr
    by_file = run_program(["predict", "--config", str(folder / "config.json"), *RUN], cwd, in_process=True)
    assert by_folder.returncode == 0 and by_file.returncode == 0, by_folder.stderr
    assert json.loads(by_folder.stdout)["phases"] == json.loads(by_file.stdout)["phases"]
    assert json.loads(by_folder.stdout)["configuration"]["config_name"] == "tiny"


def test_beyond_positions_is_predicted_only_with_the_flag_and_says_so(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = tmp_path / "short.json"
    path.write_text(json.dumps({**TINY, "max_position_embeddings": 9}))
    proc = run_program(["predict", "--config", str(path), *RUN, "--beyond-positions"], cwd, in_process=True)
    assert proc.returncode == 0, proc.stderr
    assert "beyond the model's 9 positions" in json.loads(proc.stdout)["beyond_positions"]


def test_fit_with_no_budget_and_no_gpu_names_the_flags(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: fit measures it")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_program(["fit", "--config", "llama-3.1-8b", "--batch", "1", "--new-tokens", "2"], cwd, in_process=True)
    assert_one_line_refusal(proc, cwd, "no GPU visible as cuda:0 (this machine has no CUDA or ROCm device", [])
    assert "give --gpu or --memory-bytes" in proc.stderr and "_cuda" not in proc.stderr


# ---- 8. pathological sizes: the search is bounded by a number of predictions, counted here
def test_fit_stops_at_its_prediction_bound_and_says_so(tmp_path, monkeypatch):
    from lab_helpers.real import fit as fit_module
    from lab_helpers.real.config import parse_config
    calls = []

    def counted(shape, spec, budget, loaded):
        calls.append((spec.batch, spec.context))
        # every size fits, and no peaks are known: the search cannot aim at the bound, only double
        return {"fits": True}

    monkeypatch.setattr(fit_module, "_fits", counted)
    monkeypatch.setattr(fit_module, "load_for_prediction", lambda *a, **k: {"weights_bytes": 0})
    shape = parse_config({**TINY, "max_position_embeddings": 2**22}, "tiny")
    result = fit_module.fit_model(shape, "bfloat16", 4096, 2**50, "test", batch=None, context=1)
    limit = fit_module.prediction_limit(4096)
    assert limit == 8
    assert len(calls) == limit == result["predictions_run"]
    assert "bound was reached" in result["search_bound"] and "lower bound" in result["search_bound"]
    assert result["largest_batch_at_context"] >= 1
    # a search that needs few predictions is not cut short, and says what bounds it
    calls.clear()
    small = fit_module.fit_model(parse_config(TINY, "tiny"), "bfloat16", 1, 2**50, "test", batch=1)
    assert len(calls) <= fit_module.prediction_limit(1) and "reached" not in small["search_bound"]
    assert small["largest_context_at_batch"] == 4095


def test_the_card_search_stops_at_its_bound_and_says_so(tmp_path):
    from lab_helpers.real.card_fit import cheapest_forfaits, read_card
    from lab_helpers.real.config import load_config
    from lab_helpers.real.fit import MAX_FIT_DECODE_STEPS
    from lab_helpers.real.spec import MAX_MODEL_NEW_TOKENS, RunSpec
    calls = []

    def never_fits(degree, budget):
        calls.append(degree)
        return {"fits": False, "peak_reserved_bytes": None, "peak_allocated_bytes": None, "reason": "no"}

    rows, _ = read_card()
    shape = load_config("llama-3.1-70b")
    spec = RunSpec("llama-3.1-70b", batch=1, context=2**14, new_tokens=MAX_MODEL_NEW_TOKENS,
                   decode_record_every=MAX_MODEL_NEW_TOKENS)
    days = sorted({r["duration_days"] for r in rows})[0]
    result = cheapest_forfaits(shape, spec, days, rows, fits=never_fits)
    assert sum(calls) * spec.new_tokens <= max(MAX_FIT_DECODE_STEPS, calls[0] * spec.new_tokens)
    assert len(calls) == result["predictions_run"] < 8
    assert "bound was reached" in result["search_bound"]
    assert any(r["reason"].startswith("not searched") for r in result["rows"])


# every whole-number key the supported families read, at each value outside the lab's bounds
# (null only where no family takes it for its default); refused on the raw JSON, before torch
SIZE_VALUES = {"0": 0, "-1": -1, "1.5": 1.5, "string": "8", "null": None, "2**63": 2**63}


def size_cases():
    from lab_helpers.real.raw_config import NULLABLE_SIZE_KEYS, SIZE_KEYS
    return [(key, value) for key in sorted(SIZE_KEYS) for value in SIZE_VALUES
            if not (value == "null" and key in NULLABLE_SIZE_KEYS)]


@pytest.mark.parametrize("key, value", size_cases())
def test_a_size_key_out_of_bounds_ends_in_one_line_naming_it(tmp_path, key, value):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, key: SIZE_VALUES[value]}))
    proc = run_program(["predict", "--config", str(path), *RUN], cwd, in_process=True)
    assert_one_line_refusal(proc, cwd, f"config key {key!r} must be ", [str(path)])


@pytest.mark.parametrize("key, value", [("num_attention_heads", "0"), ("n_head", "string"), ("vocab_size", "2**63")])
def test_a_size_key_out_of_bounds_ends_a_fresh_program_in_one_line(tmp_path, key, value):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, key: SIZE_VALUES[value]}))
    proc = run_program(["predict", "--config", str(path), *RUN], cwd)
    assert_one_line_refusal(proc, cwd, f"config key {key!r} must be ", [str(path)])
