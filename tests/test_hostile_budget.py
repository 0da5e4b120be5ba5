"""Hostile budgets: predict's and fit's --memory-bytes, --gpu and --device, and a measurement file's
recorded free bytes, for real_model and mesure_memoire. Every row must end in exit 2, one line on
stderr naming the fault, no traceback, empty stdout and nothing created in the working folder. Most
rows run in-process; every fourth also as a fresh `python -m` (the same checks)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import full_measurement, run_main_in_process

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096}
SUBPROCESS_EVERY = 10
NOT_WHOLE = "(a whole number, digits 0-9 only)"
BAD_BYTES = {
    "fraction": ("1.5", NOT_WHOLE),
    "negative": ("-1", "must be > 0, got -1"),
    "zero": ("0", "must be > 0, got 0"),
    "above-2-50": (str(2**50 + 1), f"must be at most {2**50}, got {2**50 + 1}"),
    "far-above": ("9" * 40, "must be at most"),
    "exponent": ("1e9", NOT_WHOLE),
    "hex": ("0x10", NOT_WHOLE),
    "word": ("lots", NOT_WHOLE),
    "spaces": (" 12", NOT_WHOLE),
    "empty": ("", NOT_WHOLE),
    "unicode-digits": ("١٢٣", NOT_WHOLE),
    "underscore": ("1_000", NOT_WHOLE),
}
REAL_RUN = ["--batch", "1", "--context", "8", "--new-tokens", "2"]
CASES = {}
for name, (value, expected) in BAD_BYTES.items():
    CASES[f"real-predict-{name}"] = ("real_model", ["predict", "--config", "CONFIG", *REAL_RUN, "--memory-bytes", value],
                                     expected)
    CASES[f"mesure-predict-{name}"] = ("mesure_memoire", ["predict", "--memory-bytes", value], expected)
    CASES[f"real-fit-{name}"] = ("real_model", ["fit", "--config", "CONFIG", "--batch", "1", "--new-tokens", "2",
                                                "--memory-bytes", value], expected)
CASES.update({
    "real-predict-two-budgets": ("real_model", ["predict", "--config", "CONFIG", *REAL_RUN, "--memory-bytes", "5",
                                                "--gpu", "h200-sxm"], "not allowed with argument"),
    "real-predict-budget-and-device": ("real_model", ["predict", "--config", "CONFIG", *REAL_RUN, "--memory-bytes",
                                                      "5", "--device", "cuda:0"], "not allowed with argument"),
    "real-predict-unknown-gpu": ("real_model", ["predict", "--config", "CONFIG", *REAL_RUN, "--gpu", "h9000"],
                                 "unknown --gpu 'h9000'"),
    "real-predict-device-cpu": ("real_model", ["predict", "--config", "CONFIG", *REAL_RUN, "--device", "cpu"],
                                "explicit cuda:N"),
    "real-predict-device-huge": ("real_model", ["predict", "--config", "CONFIG", *REAL_RUN, "--device",
                                                "cuda:" + "9" * 30], "cuda:N"),
    "mesure-predict-two-budgets": ("mesure_memoire", ["predict", "--memory-bytes", "5", "--device", "cuda:0"],
                                   "not allowed with argument"),
    "mesure-predict-device-cpu": ("mesure_memoire", ["predict", "--device", "cpu"], "explicit cuda:N"),
    "mesure-predict-gpu-flag": ("mesure_memoire", ["predict", "--gpu", "h200-sxm"], "unrecognized arguments"),
})
try:
    import torch
    NO_GPU = not torch.cuda.is_available()
except ImportError:
    NO_GPU = True
if NO_GPU:  # without a GPU the usable memory cannot be measured: one line, not the probe's failure
    CASES["real-predict-device-no-gpu"] = ("real_model", ["predict", "--config", "CONFIG", *REAL_RUN, "--device",
                                                          "cuda:0"], "no GPU visible as cuda:0")
    CASES["mesure-predict-device-no-gpu"] = ("mesure_memoire", ["predict", "--device", "cuda:0"],
                                             "no GPU visible as cuda:0")


def run_program(program, argv, cwd, in_process):
    if in_process:
        if program == "real_model":
            from lab_helpers.real.commands import main
        else:
            from lab_helpers.synthetic.commands import main
        return run_main_in_process(main, argv, cwd)
    target = (["-m", "lab_helpers.real_model"] if program == "real_model"
              else [str(ROOT / "lab_helpers" / "mesure_memoire.py")])  # the standalone file the kit ships
    return subprocess.run([sys.executable, *target, *argv], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)


def assert_one_line_refusal(proc, program, cwd, expected):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith(f"{program}: error: "), lines
    assert expected in lines[0], lines
    assert proc.stdout == ""
    assert sorted(os.listdir(cwd)) == [], "nothing is created in the working folder"
    assert str(ROOT) not in lines[0] and "site-packages" not in lines[0], lines


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_budget_ends_in_one_line(tmp_path, case):
    program, argv, expected = CASES[case]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    argv = [str(config) if a == "CONFIG" else a for a in argv]
    in_process = sorted(CASES).index(case) % SUBPROCESS_EVERY != 0
    assert_one_line_refusal(run_program(program, argv, cwd, in_process), program, cwd, expected)


# A measurement's recorded free bytes: bytes as every counter is (a whole number, 0 to 2^60).
BAD_FREE = {
    "string": ("12", "must be integer, got string"),
    "negative": (-1, "must be at least 0"),
    "fraction": (1.5, "must be integer, got number"),
    "above-2-60": (2**60 + 1, "must be at most"),
    "null": (None, "must be integer, got null"),
    "boolean": (True, "must be integer, got boolean"),
}
COMPARE_CASES = {f"{program}-{key}-{name}": (program, key, value, expected)
                 for program in ("real_model", "mesure_memoire")
                 for key in ("baseline_device_free_bytes", "end_device_free_bytes")
                 for name, (value, expected) in BAD_FREE.items()}


def real_measurement() -> dict:
    from dataclasses import asdict

    from lab_helpers.real.config import parse_config
    from lab_helpers.real.predict import predict_model
    from lab_helpers.real.spec import COUNTER_KEYS, RunSpec, model_description
    shape, spec = parse_config(TINY, "tiny"), RunSpec("tiny", batch=1, context=8, new_tokens=2)
    prediction = predict_model(shape, spec)
    phases = [{"phase": r["phase"], "index": r["index"], "passes": int(r["phase"] in ("prefill", "decode")),
               "seconds": 0.25, "device_seconds": 0.125, **{k: r[k] for k in COUNTER_KEYS},
               "baseline_device_free_bytes": 10**11, "end_device_free_bytes": 10**11}
              for r in prediction["phases"]]
    environment = full_measurement_environment()
    return {"schema_version": 1, "kind": "iteragpu-lab measurement", "environment": environment,
            "configuration": {"kind": "transformers", **asdict(spec)},
            "model": model_description(shape, "bfloat16"), "phases": phases}


def full_measurement_environment() -> dict:
    from lab_helpers.synthetic.network import MeasureConfig
    from lab_helpers.synthetic import predict as synthetic
    return full_measurement(synthetic, MeasureConfig())["environment"]


def synthetic_measurement() -> dict:
    from lab_helpers.synthetic.network import MeasureConfig
    from lab_helpers.synthetic import predict as synthetic
    document = full_measurement(synthetic, MeasureConfig())
    for phase in document["phases"]:
        phase.update(baseline_device_free_bytes=10**11, end_device_free_bytes=10**11)
    return document


@pytest.mark.parametrize("case", sorted(COMPARE_CASES))
def test_compare_refuses_a_bad_recorded_free_figure(tmp_path, case):
    program, key, value, expected = COMPARE_CASES[case]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    document = real_measurement() if program == "real_model" else synthetic_measurement()
    document["phases"][2][key] = value
    path = tmp_path / "m.json"
    path.write_text(json.dumps(document))
    in_process = sorted(COMPARE_CASES).index(case) % SUBPROCESS_EVERY != 0
    proc = run_program(program, ["compare", str(path)], cwd, in_process)
    assert_one_line_refusal(proc, program, cwd, expected)
    assert f"phases[2].{key}" in proc.stderr


def test_the_valid_documents_compare(tmp_path):
    """The documents the table breaks are valid as they stand: each row's fault is the only one."""
    for program, document in (("real_model", real_measurement()), ("mesure_memoire", synthetic_measurement())):
        path = tmp_path / f"{program}.json"
        path.write_text(json.dumps(document))
        proc = run_program(program, ["compare", str(path)], tmp_path, True)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["budget"]["replayed_under"] == "the measured budget of each phase"
