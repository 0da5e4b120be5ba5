"""mesure_memoire --task train: the training phases of the synthetic network traced on meta, exact bytes
of the prediction, the optimizer's states and gradients, schema-valid documents and bad input."""
import json
import subprocess
import sys

import pytest

from conftest import training_measurement
from lab_helpers.measurement.schema import measurement_problems
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.training import (TrainSettings, compare_training, optimizer_state_bytes,
                                            predict_training)

pytest.importorskip("torch")

# (phase, index, end allocated, peak allocated, end reserved, peak reserved) of the first two steps,
# from the replay of the traced requests (torch's meta device, the allocator model).
DEFAULT_ADAMW = [
    ("model_load", None, 132608, 132608, 2097152, 2097152),
    ("inputs", None, 136704, 136704, 2097152, 2097152),
    ("forward", 0, 34777088, 34781184, 35651584, 35651584),
    ("backward", 0, 68426752, 68444160, 69206016, 69206016),
    ("optimizer_step", 0, 68691968, 68824576, 69206016, 69206016),
    ("zero_grad", 0, 68559360, 68691968, 69206016, 69206016),
    ("forward", 1, 68596736, 68600832, 69206016, 69206016),
    ("backward", 1, 68691968, 68709376, 69206016, 69206016),
    ("optimizer_step", 1, 68691968, 68824576, 69206016, 69206016),
    ("zero_grad", 1, 68559360, 68691968, 69206016, 69206016),
]
PINNED = [
    ({}, {}, DEFAULT_ADAMW),
    ({}, {"fused": True}, [
        *DEFAULT_ADAMW[:4],
        ("optimizer_step", 0, 68694016, 68694016, 69206016, 69206016),
        ("zero_grad", 0, 68561408, 68694016, 69206016, 69206016),
        ("forward", 1, 68598784, 68602880, 69206016, 69206016),
        ("backward", 1, 68694016, 68711424, 69206016, 69206016),
        ("optimizer_step", 1, 68694016, 68694016, 69206016, 69206016),
        ("zero_grad", 1, 68561408, 68694016, 69206016, 69206016),
    ]),
    ({}, {"optimizer": "sgd"}, [
        *DEFAULT_ADAMW[:4],
        ("optimizer_step", 0, 68559360, 68559360, 69206016, 69206016),
        ("zero_grad", 0, 68426752, 68559360, 69206016, 69206016),
        ("forward", 1, 68464128, 68468224, 69206016, 69206016),
        ("backward", 1, 68559360, 68576768, 69206016, 69206016),
        ("optimizer_step", 1, 68559360, 68559360, 69206016, 69206016),
        ("zero_grad", 1, 68426752, 68559360, 69206016, 69206016),
    ]),
    ({"batch": 2, "context": 128, "width": 1024, "dtype": "bfloat16"}, {}, [
        ("model_load", None, 16787456, 16787456, 23068672, 23068672),
        ("inputs", None, 17311744, 17311744, 23068672, 23068672),
        ("forward", 0, 56633856, 57158144, 58720256, 58720256),
        ("backward", 0, 102256640, 104354816, 115343360, 115343360),
        ("optimizer_step", 0, 135831552, 152619008, 178257920, 178257920),
        ("zero_grad", 0, 119044096, 135831552, 178257920, 178257920),
        ("forward", 1, 123763200, 124287488, 178257920, 178257920),
        ("backward", 1, 135831552, 137929728, 178257920, 178257920),
        ("optimizer_step", 1, 135831552, 152619008, 178257920, 178257920),
        ("zero_grad", 1, 119044096, 135831552, 178257920, 178257920),
    ]),
]
COUNTERS = ("end_allocated_bytes", "peak_allocated_bytes", "end_reserved_bytes", "peak_reserved_bytes")


def _rows(document, count=10):
    return [(p["phase"], p["index"], *(p[k] for k in COUNTERS)) for p in document["phases"][:count]]


@pytest.fixture(scope="module")
def predictions():
    return {i: predict_training(MeasureConfig(**sizes), TrainSettings(**settings))
            for i, (sizes, settings, _) in enumerate(PINNED)}


@pytest.mark.parametrize("case", range(len(PINNED)))
def test_the_prediction_is_exact_to_the_byte_and_deterministic(predictions, case):
    sizes, settings, expected = PINNED[case]
    assert _rows(predictions[case]) == expected
    again = predict_training(MeasureConfig(**sizes), TrainSettings(**settings))
    assert again["phases"] == predictions[case]["phases"]


@pytest.mark.parametrize("case", range(len(PINNED)))
def test_states_and_gradients_are_the_parameters_bytes(predictions, case):
    sizes, settings, _ = PINNED[case]
    config, train = MeasureConfig(**sizes), TrainSettings(**settings)
    phases = predictions[case]["phases"]
    weights = phases[0]["end_allocated_bytes"]
    states = optimizer_state_bytes(config, train)
    per_parameter = {"adamw": 2, "sgd": 1}[train.optimizer]
    fused_steps = 4 * 512 if train.fused else 0  # one float32 step counter per parameter, a 512-byte block each
    assert states == per_parameter * weights + fused_steps  # these parameters are whole 512-byte blocks
    by_phase = {(p["phase"], p["index"]): p for p in phases}
    first_step = by_phase[("optimizer_step", 0)]
    # the first step creates the states: allocated jumps by exactly their bytes
    assert first_step["end_allocated_bytes"] - first_step["baseline_allocated_bytes"] == states
    assert first_step["end_allocated_bytes_by_kind"]["optimizer_states"] == states
    for step in range(train.steps):
        backward = by_phase[("backward", step)]
        zero = by_phase[("zero_grad", step)]
        assert backward["end_allocated_bytes_by_kind"]["gradients"] == weights
        # zero_grad(set_to_none=True) frees the gradients' blocks, not the reserved segments
        assert zero["baseline_allocated_bytes"] - zero["end_allocated_bytes"] == weights
        assert zero["end_reserved_bytes"] == zero["baseline_reserved_bytes"]
        assert backward["peak_allocated_bytes"] > by_phase[("forward", step)]["peak_allocated_bytes"]
        assert sum(zero["end_allocated_bytes_by_kind"].values()) == zero["end_allocated_bytes"]
    # the second step is the steady state: the same requests as every later one
    steady = [(p["phase"], *(p[k] for k in COUNTERS)) for p in phases[6:10]]
    assert steady == [(p["phase"], *(p[k] for k in COUNTERS)) for p in phases[10:14]]


def test_the_output_says_which_optimizer_implementation_runs(predictions):
    assert predictions[0]["optimizer"]["implementation"] == "foreach"
    assert "foreach" in predictions[0]["optimizer"]["note"] and "default" in predictions[0]["optimizer"]["note"]
    assert predictions[1]["optimizer"]["implementation"] == "fused"
    assert any("first optimizer_step" in note for note in predictions[0]["notes"])


def test_a_training_measurement_is_schema_valid_and_compares_exactly(predictions):
    document = training_measurement(predictions[0], "synthetic_model")
    assert measurement_problems(document) == []
    got = compare_training(document)
    assert got["allocated_exact"] is True and got["exact"] is True
    assert len(got["rows"]) == 2 + 4 * 3
    shifted = compare_training(training_measurement(predictions[0], "synthetic_model", shift=512))
    assert shifted["allocated_exact"] is False
    assert shifted["rows"][-1]["difference_peak_allocated_bytes"] == 512


def test_the_schema_refuses_an_unknown_phase_and_a_single_step(predictions):
    document = training_measurement(predictions[0], "synthetic_model")
    document["phases"][3]["phase"] = "backwards"
    assert measurement_problems(document)
    document = training_measurement(predictions[0], "synthetic_model")
    document["configuration"]["steps"] = 1
    assert measurement_problems(document)


def _run(script, *argv):
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=300)


def _run_main(mm_program, tmp_path, *argv):
    # main(argv) in this process (torch already imported, the traces shared); the fresh-process path of
    # the same two programs, and its exit code, is test_bad_input_is_one_line_and_exit_2's
    from conftest import run_main_in_process
    proc = run_main_in_process(mm_program.main, argv, tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_compare_on_the_command_line(mm_program, predictions, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(training_measurement(predictions[2], "synthetic_model", shift=512)))
    proc = _run_main(mm_program, tmp_path, "compare", str(path), "--fail-on-difference")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["allocated_exact"] is False
    proc = _run_main(mm_program, tmp_path, "compare", str(path), "--format", "table")
    assert proc.returncode == 0 and "+512" in proc.stdout


def test_predict_on_the_command_line(mm_program, tmp_path):
    proc = _run_main(mm_program, tmp_path, "predict", "--task", "train", "--steps", "2", "--optimizer", "sgd")
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert document["configuration"]["task"] == "train" and len(document["phases"]) == 10
    assert _rows(document, 4) == DEFAULT_ADAMW[:4]


@pytest.mark.parametrize("argv, message", [
    (("predict", "--task", "train", "--steps", "1"), "--steps: must be >= 2"),
    (("predict", "--steps", "3"), "--steps needs --task train"),
    (("predict", "--fused"), "--fused needs --task train"),
    (("predict", "--task", "train", "--optimizer", "sgd", "--fused"), "--fused is for --optimizer adamw only"),
    (("predict", "--task", "train", "--tensor-parallel", "2"), "tensor-parallel training is out of scope"),
    (("predict", "--task", "train", "--optimizer", "adam"), "invalid choice"),
    (("measure", "--task", "train", "--output", "OUT", "--timeline", "T"), "--timeline flags record inference"),
])
def test_bad_input_is_one_line_and_exit_2(mm_script, tmp_path, argv, message):
    argv = [str(tmp_path / "out.json") if a == "OUT" else str(tmp_path / "t.json") if a == "T" else a for a in argv]
    proc = _run(mm_script, *argv)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("mesure_memoire: error: ")
    assert message in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("program,argv", [
    ("synthetic", ["predict", "--task", "train", "--allocator-conf", "expandable_segments:True"]),
    ("synthetic", ["measure", "--task", "train", "--allocator-conf", "expandable_segments:True",
                   "--output", "never.json"]),
    ("real", ["predict", "--task", "train", "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "8",
              "--allocator-conf", "expandable_segments:True"]),
    ("real", ["fit", "--task", "train", "--config", "qwen1.5-0.5b", "--context", "8", "--memory-bytes", "1000000000",
              "--allocator-conf", "expandable_segments:True"]),
])
def test_training_under_expandable_segments_is_refused_not_predicted_as_default(tmp_path, program, argv):
    # training is modelled under the default allocator only: a run asked under expandable segments must
    # not get the default allocator's figures in silence
    from lab_helpers.real.commands import main as real_main
    from lab_helpers.synthetic.commands import main as synthetic_main
    from conftest import run_main_in_process
    proc = run_main_in_process(synthetic_main if program == "synthetic" else real_main, argv, tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(lines) == 1 and "--task train is modelled under the default allocator only" in lines[0]
    assert list(tmp_path.iterdir()) == []
