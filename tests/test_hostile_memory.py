"""Hostile input for the memory commands (estimate, environment, measure, predict, compare) and runs.

Every case runs in its own folder through a subprocess and must answer with exit code 2, exactly one
line on stderr, no traceback, nothing created or changed in the folder, and in well under 2 seconds.
A representative subset runs again against a copy of mesure_memoire.py run alone (`python -I`) from
an empty folder. Then: concurrent writers, writers killed mid-write, the writer's file mode, and the
standard-library validator against jsonschema."""
import copy
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from conftest import ROOT, full_measurement, run_main_in_process
from lab_helpers.core.errors import LabError
from lab_helpers.core.files import (csv_text, display_path, replace_bytes, replace_text, write_new_json,
                                    write_new_text)
from lab_helpers.core.numbers import parse_decimal, parse_whole
from lab_helpers.measurement.schema import MEASUREMENT_SCHEMA, measurement_problems, read_measurement
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic import predict as synthetic_predict
from lab_helpers.synthetic.predict import predict

# A refusal takes well under a second on an idle machine; the bound guards against a hang (a wait on
# a FIFO or a terminal, a retry loop, a quadratic parse of a huge number), not against slowness, so it
# is generous enough for a machine running other jobs. The subprocess timeout stops a real hang.
TIME_LIMIT_SECONDS = 60.0
RUNS_TIME_LIMIT_SECONDS = 60.0  # runs imports pandas first: same bound, same reason
SUBPROCESS_TIMEOUT_SECONDS = 120
SYNTHETIC = full_measurement(synthetic_predict, MeasureConfig(batch=2, context=8, width=16, repeats=2))


def transformers_document() -> dict:
    document = copy.deepcopy(SYNTHETIC)
    del document["synthetic_model"]
    document["configuration"] = {"kind": "transformers", "config_name": "llama-3.1-8b", "dtype": "bfloat16",
                                 "batch": 1, "context": 64, "new_tokens": 2, "device": "cuda:0", "seed": 0,
                                 "decode_record_every": 1}
    document["model"] = {"architecture": "LlamaForCausalLM", "parameter_count": 8030261248}
    document["phases"] = document["phases"][:5]
    for phase, (name, index) in zip(document["phases"], [("model_load", None), ("inputs", None),
                                                         ("prefill", None), ("decode", 0), ("decode", 1)]):
        phase.update(phase=name, index=index)
        phase.pop("achieved_tflops", None)
        phase.pop("host_to_device_time_ratio", None)
    return document


# ------------------------------------------------------------ file makers
def with_change(change):
    """A setup writing m.json: the synthetic measurement after `change(document)`."""
    def setup(folder):
        document = copy.deepcopy(SYNTHETIC)
        change(document)
        (folder / "m.json").write_text(json.dumps(document), encoding="utf-8")
    return setup


def raw_file(data: bytes, name="m.json"):
    def setup(folder):
        (folder / name).write_bytes(data)
    return setup


def json_with(text_change):
    """A setup writing m.json: the measurement's JSON text after a textual replacement."""
    def setup(folder):
        (folder / "m.json").write_text(text_change(json.dumps(SYNTHETIC)), encoding="utf-8")
    return setup


def sparse_file(folder):
    with open(folder / "m.json", "wb") as handle:
        handle.truncate(100 * 10**6)  # 100 MB that take no disk


def fifo(folder):
    os.mkfifo(folder / "m.json")


def a_folder(folder):
    (folder / "m.json").mkdir()


def a_file_named(name, text="keep me"):
    def setup(folder):
        (folder / name).write_text(text)
    return setup


def link_loop(folder):
    os.symlink("m.json", folder / "m.json")


def two_measurements(folder):
    for name in ("a.json", "b.json"):
        (folder / name).write_text(json.dumps(SYNTHETIC), encoding="utf-8")
    (folder / "other").mkdir()
    (folder / "other" / "a.json").write_text(json.dumps(SYNTHETIC), encoding="utf-8")


def set_path(path, value):
    def change(document):
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def delete_path(path):
    def change(document):
        target = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return change


def replace_phases(value):
    return set_path(["phases"], value)


def swap_first_phases(document):
    document["phases"][0], document["phases"][1] = document["phases"][1], document["phases"][0]


def drop_last_phase(document):
    document["phases"].pop()


def become_transformers(document):
    document.clear()
    document.update(transformers_document())


# ------------------------------------------------------------------ cases
UNICODE_AND_SPACES = [
    ("arabic-indic", "\u0661\u0662"), ("fullwidth", "\uff11\uff12"), ("superscript", "\u00b2"),
    ("underscore", "1_000"), ("spaces", " 12 "), ("plus", "+5"), ("minus", "-1"), ("exponent", "1e3"),
    ("nan", "nan"), ("inf", "inf"), ("empty", ""), ("fraction", "1.5"), ("hex", "0x10"),
    ("4300-digits", "9" * 4300),
]
NUMBER_FLAGS = [
    ("predict-batch", ["predict", "--batch"]), ("predict-repeats", ["predict", "--repeats"]), ("estimate-parameters", ["estimate", "--bits", "16", "--parameters"]),
    ("measure-seed", ["measure", "--output", "m.json", "--seed"]),
]
CASES = []  # (id, argv after the program, setup or None, a substring the error line must hold or None)
for flag_id, prefix in NUMBER_FLAGS:
    for value_id, value in UNICODE_AND_SPACES:
        CASES.append((f"{flag_id}-{value_id}", [*prefix, value], None, None))
CASES += [
    ("4300-digits-refused-by-count", ["predict", "--context", "9" * 4300], None, "at most 1000 digits"),
    ("400-digit-parameters", ["estimate", "--bits", "16", "--parameters", "9" * 400], None, "400-digit number"),
    ("zero-batch", ["predict", "--batch", "0"], None, "must be > 0"),
    ("zero-context", ["predict", "--context", "0"], None, "must be > 0"),
    ("zero-width", ["predict", "--width", "0"], None, "must be > 0"),
    ("zero-hidden", ["predict", "--hidden", "0"], None, "must be > 0"),
    ("zero-repeats", ["predict", "--repeats", "0"], None, "must be > 0"),
    ("zero-parameters", ["estimate", "--bits", "16", "--parameters", "0"], None, "must be > 0"),
    ("zero-bits", ["estimate", "--parameters", "10", "--bits", "0"], None, "must be > 0"),
    ("negative-warmup", ["predict", "--warmup", "-1"], None, None),
    ("huge-repeats", ["predict", "--repeats", "10001"], None, "at most 10000"),
    ("huge-warmup", ["predict", "--warmup", "10001"], None, "at most 10000"),
    ("huge-batch", ["predict", "--batch", str(2**20 + 1)], None, "at most 1048576"),
    ("huge-hidden", ["predict", "--hidden", str(2**22 + 1)], None, "at most 4194304"),
    ("huge-tensor", ["predict", "--batch", str(2**20), "--context", str(2**20), "--width", str(2**20)], None,
     "256 TiB"),
    ("bits-65", ["estimate", "--parameters", "10", "--bits", "65"], None, "at most 64"),
    ("parameters-over-bound", ["estimate", "--bits", "16", "--parameters", str(10**18 + 1)], None, "at most"),
    ("reserve-nan", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", "nan"], None, None),
    ("reserve-inf", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", "inf"], None, None),
    ("reserve-negative", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", "-1"], None, None),
    ("reserve-exponent", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", "1e3"], None, None),
    ("reserve-unicode", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", "\u0661"], None, None),
    ("reserve-empty", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", ""], None, None),
    ("reserve-huge", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", "1048577"], None,
     "at most"),
    ("reserve-long", ["estimate", "--parameters", "10", "--bits", "16", "--reserve-gib", "1" * 5000], None,
     "characters"),
    ("workspace-negative", ["predict", "--workspace-bytes", "-1"], None, None),
    ("workspace-huge", ["predict", "--workspace-bytes", str(2**40 + 1)], None, "at most"),
    ("workspace-17-blocks", ["predict", "--workspace-bytes", *["1"] * 17], None, "at most 16 blocks"),
    ("dtype-int8", ["predict", "--dtype", "int8"], None, "invalid choice"),
    ("unknown-command", ["fly"], None, "invalid choice"),
    ("unknown-flag", ["predict", "--bacth", "2"], None, "unrecognized"),
    ("estimate-missing-bits", ["estimate", "--parameters", "10"], None, "required"),
    ("measure-missing-output", ["measure"], None, "required"),
]
for device_id, device in [("cpu", "cpu"), ("bare-cuda", "cuda"), ("letter", "cuda:x"), ("negative", "cuda:-1"),
                          ("arabic-indic", "cuda:\u0661"), ("trailing-space", "cuda:0 "), ("uppercase", "CUDA:0"),
                          ("50-digits", "cuda:" + "9" * 50)]:
    CASES.append((f"environment-device-{device_id}", ["environment", "--device", device], None, "cuda:N"))
    CASES.append((f"measure-device-{device_id}", ["measure", "--output", "m.json", "--device", device], None,
                  "cuda:N"))
CASES += [
    # output paths of measure: refused before any measuring
    ("output-exists", ["measure", "--output", "m.json"], a_file_named("m.json"), "already exists"),
    ("output-missing-parent", ["measure", "--output", "absent/m.json"], None, "folder does not exist"),
    ("output-parent-is-a-file", ["measure", "--output", "f/m.json"], a_file_named("f"), "not a folder"),
    ("output-300-char-name", ["measure", "--output", "n" * 300 + ".json"], None, "file name too long"),
    ("output-is-a-folder", ["measure", "--output", "m.json"], a_folder, "already exists"),
    ("output-folder-syntax", ["measure", "--output", "d/"], lambda f: (f / "d").mkdir(), "it is a folder"),
    ("failure-report-exists", ["measure", "--output", "m.json", "--failure-report", "r.json"],
     a_file_named("r.json"), "r.json already exists"),
    # measurement files given to compare
    ("file-missing", ["compare", "m.json"], None, "no such file"),
    ("file-is-a-folder", ["compare", "m.json"], a_folder, "it is a folder"),
    ("file-is-a-fifo", ["compare", "m.json"], fifo, "not a regular file"),
    ("file-link-loop", ["compare", "m.json"], link_loop, "too many symbolic links"),
    ("file-100-MB", ["compare", "m.json"], sparse_file, "at most 67108864 bytes"),
    ("file-empty", ["compare", "m.json"], raw_file(b""), "not valid JSON"),
    ("file-not-json", ["compare", "m.json"], raw_file(b"hello"), "not valid JSON"),
    ("file-binary", ["compare", "m.json"], raw_file(bytes(range(256)) * 4), "not UTF-8"),
    ("file-utf16", ["compare", "m.json"], raw_file(json.dumps(SYNTHETIC).encode("utf-16")), "not UTF-8"),
    ("file-utf8-bom", ["compare", "m.json"], raw_file(b"\xef\xbb\xbf" + json.dumps(SYNTHETIC).encode()),
     "not valid JSON"),
    ("file-10000-deep", ["compare", "m.json"], raw_file(b"[" * 10000 + b"]" * 10000), "deeper than 32"),
    ("file-100000-open", ["compare", "m.json"], raw_file(b"[" * 100000), None),
    ("file-json-list", ["compare", "m.json"], raw_file(b"[1, 2]"), "$: must be object"),
    ("file-json-string", ["compare", "m.json"], raw_file(b'"measurement"'), "$: must be object"),
    ("file-json-null", ["compare", "m.json"], raw_file(b"null"), "$: must be object"),
    ("file-5000-digit-int", ["compare", "m.json"],
     json_with(lambda t: t.replace('"seed": 0', '"seed": ' + "9" * 5000)), "not valid JSON"),
    ("file-nan-counter", ["compare", "m.json"],
     json_with(lambda t: t.replace('"peak_reserved_bytes": 2097152', '"peak_reserved_bytes": NaN', 1)),
     "NaN is not a JSON number"),
    ("file-infinity-seconds", ["compare", "m.json"],
     json_with(lambda t: t.replace('"seconds": 0.002', '"seconds": Infinity', 1)), "Infinity"),
    ("file-minus-infinity", ["compare", "m.json"],
     json_with(lambda t: t.replace('"seconds": 0.002', '"seconds": -Infinity', 1)), "-Infinity"),
    ("file-lone-surrogate", ["compare", "m.json"],
     json_with(lambda t: t.replace('"NVIDIA H200"', '"\\ud800"')), "lone surrogate"),
    ("config-batch-string", ["compare", "m.json"], with_change(set_path(["configuration", "batch"], "2")),
     "$.configuration.batch: must be integer, got string"),
    ("config-batch-null", ["compare", "m.json"], with_change(set_path(["configuration", "batch"], None)),
     "$.configuration.batch: must be integer, got null"),
    ("config-batch-list", ["compare", "m.json"], with_change(set_path(["configuration", "batch"], [2])),
     "$.configuration.batch: must be integer, got array"),
    ("config-batch-true", ["compare", "m.json"], with_change(set_path(["configuration", "batch"], True)),
     "must be integer, got boolean"),
    ("config-batch-fraction", ["compare", "m.json"], with_change(set_path(["configuration", "batch"], 2.5)),
     "must be integer, got number"),
    ("config-batch-whole-float", ["compare", "m.json"], with_change(set_path(["configuration", "batch"], 2.0)),
     "--batch must be an integer, got float"),
    ("config-dtype-number", ["compare", "m.json"], with_change(set_path(["configuration", "dtype"], 16)),
     "$.configuration.dtype: must be one of"),
    ("config-device-cpu", ["compare", "m.json"], with_change(set_path(["configuration", "device"], "cpu")),
     "$.configuration.device: does not match"),
    ("config-device-newline", ["compare", "m.json"],
     with_change(set_path(["configuration", "device"], "cuda:0\n")), "cuda:N"),
    ("config-repeats-huge", ["compare", "m.json"], with_change(set_path(["configuration", "repeats"], 10**9)),
     "$.configuration.repeats: must be at most 10000"),
    ("config-warmup-huge", ["compare", "m.json"], with_change(set_path(["configuration", "warmup"], 10**6)),
     "$.configuration.warmup: must be at most 10000"),
    ("config-seed-negative", ["compare", "m.json"], with_change(set_path(["configuration", "seed"], -1)),
     "must be at least 0"),
    ("config-missing-hidden", ["compare", "m.json"], with_change(delete_path(["configuration", "hidden"])),
     "lacks the required key 'hidden'"),
    ("config-unknown-key", ["compare", "m.json"], with_change(set_path(["configuration", "foo"], 1)),
     "unknown key 'foo'"),
    ("config-not-object", ["compare", "m.json"], with_change(set_path(["configuration"], [])),
     "$.configuration: must be object"),
    ("config-huge-tensor", ["compare", "m.json"], with_change(lambda d: d["configuration"].update(
        batch=2**20, context=2**20, width=2**20, hidden=2**22)), "256 TiB"),
    ("phases-object", ["compare", "m.json"], with_change(replace_phases({"phase": "inputs"})),
     "$.phases: must be array"),
    ("phases-of-ints", ["compare", "m.json"], with_change(replace_phases([1, 2, 3, 4, 5])),
     "$.phases[0]: must be object"),
    ("phases-empty", ["compare", "m.json"], with_change(replace_phases([])), "at least 5 item"),
    ("phase-missing-counter", ["compare", "m.json"], with_change(delete_path(["phases", 3, "peak_reserved_bytes"])),
     "$.phases[3]: lacks the required key 'peak_reserved_bytes'"),
    ("phase-negative-bytes", ["compare", "m.json"], with_change(set_path(["phases", 2, "end_allocated_bytes"], -512)),
     "$.phases[2].end_allocated_bytes: must be at least 0"),
    ("phase-fraction-bytes", ["compare", "m.json"], with_change(set_path(["phases", 2, "end_allocated_bytes"], 12.5)),
     "$.phases[2].end_allocated_bytes: must be integer"),
    ("phase-string-bytes", ["compare", "m.json"], with_change(set_path(["phases", 0, "peak_allocated_bytes"], "12")),
     "must be integer, got string"),
    ("phase-huge-bytes", ["compare", "m.json"], with_change(set_path(["phases", 0, "peak_allocated_bytes"], 2**61)),
     "must be at most 1152921504606846976"),
    ("phase-unknown-name", ["compare", "m.json"], with_change(set_path(["phases", 0, "phase"], "warm")),
     "$.phases[0].phase: must be one of"),
    ("phase-negative-seconds", ["compare", "m.json"], with_change(set_path(["phases", 1, "seconds"], -1)),
     "$.phases[1].seconds: must be at least 0"),
    ("phase-unknown-key", ["compare", "m.json"], with_change(set_path(["phases", 1, "temperature"], 3)),
     "unknown key 'temperature'"),
    ("phases-too-few", ["compare", "m.json"], with_change(drop_last_phase), "measure writes 6"),
    ("phases-out-of-order", ["compare", "m.json"], with_change(swap_first_phases), "$.phases[0]"),
    ("phases-10001-records", ["compare", "m.json"],
     with_change(lambda d: d["phases"].extend([d["phases"][-1]] * 10000)), "at most 10004 items"),
    ("top-missing-environment", ["compare", "m.json"], with_change(delete_path(["environment"])),
     "lacks the required key 'environment'"),
    ("top-wrong-kind", ["compare", "m.json"], with_change(set_path(["kind"], "iteragpu-lab prediction")),
     "$.kind: must be"),
    ("top-schema-version-2", ["compare", "m.json"], with_change(set_path(["schema_version"], 2)),
     "$.schema_version: must be 1"),
    ("top-missing-model", ["compare", "m.json"], with_change(delete_path(["synthetic_model"])),
     "lacks the required key 'synthetic_model'"),
    ("compare-transformers-file", ["compare", "m.json"], with_change(become_transformers),
     "synthetic network only"),
    ("compare-workspace-17", ["compare", "m.json", "--workspace-bytes", *["1"] * 17],
     with_change(lambda d: None), "at most 16 blocks"),
]
assert len(CASES) >= 100 and len({case[0] for case in CASES}) == len(CASES)

RUNS_CASES = [
    ("runs-missing-file", ["absent.json"], None, "no such file"),
    ("runs-folder", ["m.json"], a_folder, "it is a folder"),
    ("runs-fifo", ["m.json"], fifo, "not a regular file"),
    ("runs-not-json", ["m.json"], raw_file(b"{"), "not valid JSON"),
    ("runs-prediction", ["m.json"], raw_file(json.dumps(predict(MeasureConfig())).encode()),
     "lacks the required key 'environment'"),
    ("runs-lone-surrogate", ["m.json"], json_with(lambda t: t.replace('"NVIDIA H200"', '"\\ud800"')),
     "lone surrogate"),
    ("runs-same-stem", ["a.json", "other/a.json"], two_measurements, "two files are named 'a'"),
    ("runs-bad-counter", ["a.json", "--counter", "peak"], two_measurements, "invalid choice"),
    ("runs-no-file", [], None, "required"),
    ("runs-csv-exists", ["a.json", "--csv", "b.json"], two_measurements, "b.json already exists"),
    ("runs-csv-missing-parent", ["a.json", "--csv", "absent/r.csv"], two_measurements,
     "cannot write absent/r.csv: its folder does not exist"),
    ("runs-csv-parent-is-a-file", ["a.json", "--csv", "b.json/r.csv"], two_measurements,
     "cannot write b.json/r.csv: a parent is not a folder"),
    ("runs-csv-300-char-name", ["a.json", "--csv", "r" * 300 + ".csv"], two_measurements, "file name too long"),
    ("runs-csv-folder", ["a.json", "--csv", "other"], two_measurements, "other already exists"),
    ("runs-csv-under-sys", ["a.json", "--csv", "/sys/iteragpu-lab-runs.csv"], two_measurements,
     "cannot write /sys/iteragpu-lab-runs.csv"),
    ("runs-plot-exists", ["a.json", "--plot", "b.json"], two_measurements, "b.json already exists"),
    ("runs-plot-missing-parent", ["a.json", "--plot", "absent/r.png"], two_measurements, "folder does not exist"),
]
ALONE_SUBSET = {"predict-batch-arabic-indic", "estimate-parameters-4300-digits", "400-digit-parameters",
                "reserve-nan", "measure-device-letter", "output-parent-is-a-file", "file-is-a-fifo",
                "file-10000-deep", "file-100-MB", "config-batch-string", "phase-missing-counter",
                "file-nan-counter"}


# ------------------------------------------------------------------ checks
def snapshot(folder: Path) -> dict:
    """Every entry under `folder`: kind, size, mtime and (small regular files) a digest. FIFOs are
    never opened."""
    state = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        digest = None
        if stat.S_ISREG(info.st_mode) and info.st_size <= 2**20:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        state[str(path.relative_to(folder))] = (stat.S_IFMT(info.st_mode), info.st_size, info.st_mtime_ns, digest)
    return state


def run_case(argv_prefix, argv, setup, expected, folder, limit, env=None, in_process_main=None):
    """One row: in a fresh Python (`argv_prefix`), or with `in_process_main` in this one, except a row
    whose folder holds a FIFO, which stays a subprocess (its timeout guards a hang)."""
    folder.mkdir(exist_ok=True)
    if setup:
        setup(folder)
    before = snapshot(folder)
    if any(kind == stat.S_IFIFO for kind, *_ in before.values()):
        in_process_main = None
    if in_process_main is not None:
        proc = run_main_in_process(in_process_main, argv, folder, text=False)
    else:
        proc = subprocess.run([*argv_prefix, *argv], cwd=folder, capture_output=True,
                              timeout=SUBPROCESS_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL, env=env)
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, (proc.returncode, stderr)
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr and proc.stdout == b""
    assert ": error: " in stderr
    if expected is not None:
        assert expected in stderr, stderr
    assert snapshot(folder) == before  # nothing created, changed or removed
    return stderr


MODULE = [sys.executable, "-m", "lab_helpers.mesure_memoire"]
SUBPROCESS_EVERY = 12  # one row in twelve of a table also runs as a fresh Python (the rest in-process)


def in_subprocess(table, case_id: str) -> bool:
    return sorted(case[0] for case in table).index(case_id) % SUBPROCESS_EVERY == 0


@pytest.mark.parametrize("case_id, argv, setup, expected", CASES, ids=[case[0] for case in CASES])
def test_hostile_memory_command(tmp_path, case_id, argv, setup, expected):
    env_root = str(ROOT)
    prefix = [sys.executable, "-c", f"import sys, runpy; sys.path.insert(0, {env_root!r}); "
              "runpy.run_module('lab_helpers.mesure_memoire', run_name='__main__')"]
    from lab_helpers.mesure_memoire import main
    stderr = run_case(prefix, argv, setup, expected, tmp_path / "work", TIME_LIMIT_SECONDS,
                      in_process_main=None if in_subprocess(CASES, case_id) else main)
    assert stderr.startswith("mesure_memoire") or stderr.startswith("usage")


@pytest.mark.parametrize("case_id, argv, setup, expected",
                         [case for case in CASES if case[0] in ALONE_SUBSET],
                         ids=[case[0] for case in CASES if case[0] in ALONE_SUBSET])
def test_hostile_memory_command_file_alone(tmp_path, case_id, argv, setup, expected):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ROOT / "lab_helpers" / "mesure_memoire.py", alone / "mesure_memoire.py")
    run_case([sys.executable, "-I", str(alone / "mesure_memoire.py")], argv, setup, expected,
             tmp_path / "empty", TIME_LIMIT_SECONDS)


@pytest.mark.parametrize("case_id, argv, setup, expected", RUNS_CASES, ids=[case[0] for case in RUNS_CASES])
def test_hostile_runs_command(tmp_path, case_id, argv, setup, expected):
    prefix = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
              "from lab_helpers import runs; sys.exit(runs.main())"]
    from lab_helpers.runs import main
    stderr = run_case(prefix, argv, setup, expected, tmp_path / "work", RUNS_TIME_LIMIT_SECONDS,
                      in_process_main=None if in_subprocess(RUNS_CASES, case_id) else main)
    assert stderr.startswith("runs: error: ")


def test_module_entry_point_answers_like_the_runner(tmp_path):
    """The table runs the module through runpy (so the tests need no install); `python -m` is the same."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run_case(MODULE, ["predict", "--batch", "\u0661"], None, "digits 0-9", tmp_path / "w", TIME_LIMIT_SECONDS, env)


def test_read_only_folder_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable here; the /sys and "
                        "name-too-long rows cover a refused output")
        with pytest.raises(LabError, match="permission denied"):
            write_new_text(folder / "x.txt", "x")
    finally:
        folder.chmod(0o755)


# ------------------------------------------------------------------ writers
WRITER = """
import sys
sys.path.insert(0, {root!r})
from lab_helpers.core.files import LabError, write_new_text
text = sys.argv[2] * int(sys.argv[3])
print("ready", flush=True)
try:
    write_new_text(sys.argv[1], text)
except LabError as exc:
    print(f"writer: error: {{exc}}", file=sys.stderr)
    sys.exit(2)
"""


def writer(path, fill, repeat, **kwargs):
    return subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT)), str(path), fill, str(repeat)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_eight_concurrent_writers_one_winner(tmp_path):
    target = tmp_path / "same.json"
    procs = [writer(target, str(n), 2_000_000) for n in range(8)]
    results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = [code for code, _ in results]
    assert sorted(codes) == [0] + [2] * 7
    for code, err in results:
        if code == 2:
            assert err.count("\n") == 1 and "same.json already exists" in err
    winner = codes.index(0)
    assert target.read_text() == str(winner) * 2_000_000  # whole, one writer's
    assert [p.name for p in tmp_path.iterdir()] == ["same.json"]  # no temporary left


def test_writer_killed_mid_write_leaves_nothing(tmp_path):
    size = 64 * 2**20
    absent = 0
    for attempt in range(10):
        folder = tmp_path / f"k{attempt}"
        folder.mkdir()
        target = folder / "big.json"
        proc = writer(target, "x", size)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.005 * attempt)  # from the first write to (rarely) after the link
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
        entries = [p.name for p in folder.iterdir()]
        if entries:
            assert entries == ["big.json"] and target.stat().st_size == size  # linked only once complete
        else:
            absent += 1
    assert absent >= 1  # at least one kill landed mid-write, and left no partial or hidden file


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
@pytest.mark.parametrize("unnamed", [True, False], ids=["unnamed-temporary", "named-temporary"])
def test_new_files_get_the_users_mode(tmp_path, umask, mode, unnamed):
    code = (f"import os, sys; sys.path.insert(0, {str(ROOT)!r}); os.umask({umask})\n"
            + ("" if unnamed else "del os.O_TMPFILE\n")
            + "from lab_helpers.core.files import LabError, replace_text, write_new_json, write_new_text\n"
            f"write_new_json({str(tmp_path / 'f.json')!r}, {{'a': 1}})\n"
            f"replace_text({str(tmp_path / 'g.csv')!r}, 'x')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    assert stat.S_IMODE((tmp_path / "f.json").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "g.csv").stat().st_mode) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "g.csv"]
    assert json.loads((tmp_path / "f.json").read_text()) == {"a": 1}


def test_named_temporary_fallback_is_exclusive_and_clean(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    target = tmp_path / "t.txt"
    write_new_text(target, "first")
    with pytest.raises(LabError, match="already exists"):
        write_new_text(target, "second")
    assert target.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["t.txt"]


def test_replace_text_rewrites_whole_and_names_the_path_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    replace_text("s.csv", "a\n")
    replace_text("s.csv", "b\n")
    assert Path("s.csv").read_text() == "b\n" and os.listdir(".") == ["s.csv"]
    with pytest.raises(LabError, match=r"^cannot write absent/s.csv: its folder does not exist$"):
        replace_text("absent/s.csv", "x")


def test_replace_bytes_rewrites_whole_with_the_users_mode_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("k.zip").write_bytes(b"old")
    os.chmod("k.zip", 0o600)
    umask = os.umask(0o027)
    try:
        replace_bytes("k.zip", b"\x00new\xff")
    finally:
        os.umask(umask)
    assert Path("k.zip").read_bytes() == b"\x00new\xff" and os.listdir(".") == ["k.zip"]
    assert Path("k.zip").stat().st_mode & 0o777 == 0o640
    os.mkdir("d")  # a folder in the file's place: os.replace refuses, the temporary goes
    with pytest.raises(LabError, match=r"^cannot write d: it is a folder$"):
        replace_bytes("d", b"x")
    assert sorted(os.listdir(".")) == ["d", "k.zip"] and os.listdir("d") == []


def test_json_writer_refuses_nan_and_writes_nothing(tmp_path):
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(LabError, match="not finite"):
            write_new_json(tmp_path / "n.json", {"seconds": value})
    assert list(tmp_path.iterdir()) == []


def test_errors_name_the_path_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("f").write_text("")
    cases = {"absent/x.json": "cannot write absent/x.json: its folder does not exist",
             "f/x.json": "cannot write f/x.json: a parent is not a folder",
             "x" * 300: f"cannot write {'x' * 300}: file name too long",
             str(tmp_path / "f"): "f already exists; choose a new file name"}
    for given, message in cases.items():
        with pytest.raises(LabError) as caught:
            write_new_json(given, {})
        assert str(caught.value) == message
    assert sorted(os.listdir(".")) == ["f"]


def test_display_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert display_path("a/b.json") == "a/b.json"
    assert display_path(tmp_path / "a" / "b.json") == os.path.join("a", "b.json")
    assert display_path("/elsewhere/b.json") == "/elsewhere/b.json"
    assert display_path(Path("../x.json")) == "../x.json"


# ------------------------------------------------------------------ numbers
# A refusal is microseconds; the bound guards against converting a 4,300-digit text to an int
# (quadratic, and Python's digit limit raising), which takes far longer than this on any machine.
PARSE_TIME_LIMIT_SECONDS = 60.0  # a hang guard only: the refusal takes microseconds (int() of 4300+ digits is what it guards)


@pytest.mark.parametrize("text, value", [("0", 0), ("7", 7), ("007", 7), ("9" * 1000, int("9" * 1000))])
def test_parse_whole_accepts_ascii_digits(text, value):
    assert parse_whole(text, "--n") == value


@pytest.mark.parametrize("text", ["", " 1", "1 ", "+1", "-1", "1_0", "\u0661", "\uff11", "1.0", "1e3", "0x1",
                                  "nan", "\u00b2", "1\n", "9" * 1001])
def test_parse_whole_refuses(text):
    started = time.monotonic()
    with pytest.raises(LabError, match="^--n "):
        parse_whole(text, "--n")
    assert time.monotonic() - started < PARSE_TIME_LIMIT_SECONDS


def test_parse_whole_bounds_and_4300_digits_fast():
    started = time.monotonic()
    with pytest.raises(LabError, match=r"^--n must be at most 10, got 11$"):
        parse_whole("11", "--n", 0, 10)
    with pytest.raises(LabError, match=r"^--n must be >= 3, got 2$"):
        parse_whole("2", "--n", 3)
    with pytest.raises(LabError, match="4300 characters; at most 1000 digits"):
        parse_whole("9" * 4300, "--n")
    assert time.monotonic() - started < PARSE_TIME_LIMIT_SECONDS


@pytest.mark.parametrize("text, value", [("0", 0.0), ("1.5", 1.5), (".5", 0.5), ("4.", 4.0)])
def test_parse_decimal(text, value):
    assert parse_decimal(text, "--g") == value


@pytest.mark.parametrize("text", ["", "nan", "inf", "-1", "1e3", "+1", "1,5", "\u0661", "1.2.3", " 1"])
def test_parse_decimal_refuses(text):
    with pytest.raises(LabError, match="^--g "):
        parse_decimal(text, "--g")


def test_csv_text_neutralises_formulas_and_keeps_numbers():
    text = csv_text(["name", "value"], [["=1+1", -3], ["+a", 2.5], ["-x", None], ["@y", 0], ["\tz", True],
                                           ["\rw", "ok"], ["plain, with comma", "-3"]])
    assert text == ("name,value\n'=1+1,-3\n'+a,2.5\n'-x,\n'@y,0\n'\tz,True\n\"'\rw\",ok\n"
                    "\"plain, with comma\",'-3\n")
    assert csv_text(["a"], [["x\ny"], ["x\ry"]]) == 'a\n"x\ny"\n"x\ry"\n'


# ------------------------------------------------------------ schema agreement
def mutated(change, base=None):
    document = copy.deepcopy(SYNTHETIC if base is None else base)
    change(document)
    return document


AGREEMENT = [
    ("synthetic", SYNTHETIC, True),
    ("transformers", transformers_document(), True),
    ("synthetic-kind-stated", mutated(set_path(["configuration", "kind"], "synthetic")), True),
    ("whole-float-counter", mutated(set_path(["phases", 0, "end_allocated_bytes"], 512.0)), True),
    ("no-tflops", mutated(lambda d: d["phases"][-1].pop("achieved_tflops")), True),
    ("extra-environment-key", mutated(set_path(["environment", "usable_memory_bytes"], 123)), True),
    ("transformers-extra-config-key", mutated(set_path(["configuration", "attention"], "sdpa"),
                                              transformers_document()), True),
    ("list", [], False),
    ("null", None, False),
    ("batch-string", mutated(set_path(["configuration", "batch"], "2")), False),
    ("batch-bool", mutated(set_path(["configuration", "batch"], True)), False),
    ("batch-zero", mutated(set_path(["configuration", "batch"], 0)), False),
    ("batch-huge", mutated(set_path(["configuration", "batch"], 2**20 + 1)), False),
    ("repeats-huge", mutated(set_path(["configuration", "repeats"], 10**9)), False),
    ("dtype-unknown", mutated(set_path(["configuration", "dtype"], "float64")), False),
    ("device-cpu", mutated(set_path(["configuration", "device"], "cpu")), False),
    ("config-unknown-key", mutated(set_path(["configuration", "x"], 1)), False),
    ("kind-other", mutated(set_path(["configuration", "kind"], "other")), False),
    ("counter-negative", mutated(set_path(["phases", 0, "end_allocated_bytes"], -1)), False),
    ("counter-fraction", mutated(set_path(["phases", 0, "end_allocated_bytes"], 0.5)), False),
    ("counter-huge", mutated(set_path(["phases", 0, "end_allocated_bytes"], 2**61)), False),
    ("counter-missing", mutated(delete_path(["phases", 0, "peak_reserved_bytes"])), False),
    ("phase-unknown", mutated(set_path(["phases", 0, "phase"], "decode")), False),
    ("phase-extra-key", mutated(set_path(["phases", 0, "x"], 1)), False),
    ("phases-not-list", mutated(set_path(["phases"], {})), False),
    ("phases-of-ints", mutated(set_path(["phases"], [1] * 6)), False),
    ("phases-four", mutated(lambda d: d.__setitem__("phases", d["phases"][:4])), False),
    ("index-negative", mutated(set_path(["phases", 4, "index"], -1)), False),
    ("tflops-zero", mutated(set_path(["phases", 4, "achieved_tflops"], 0)), False),
    ("environment-not-visible", mutated(set_path(["environment", "device_visible"], False)), False),
    ("environment-visible-one", mutated(set_path(["environment", "device_visible"], 1)), False),
    ("environment-missing-key", mutated(delete_path(["environment", "device_name"])), False),
    ("capability-bad", mutated(set_path(["environment", "compute_capability"], "9")), False),
    ("schema-version-true", mutated(set_path(["schema_version"], True)), False),
    ("top-extra-key", mutated(set_path(["notes"], "x")), False),
    ("synthetic-with-model", mutated(set_path(["model"], {})), False),
    ("synthetic-model-layers", mutated(set_path(["synthetic_model", "layers"], ["a", "b"])), False),
    ("transformers-missing-model", mutated(delete_path(["model"]), transformers_document()), False),
    ("transformers-with-synthetic-model", mutated(set_path(["synthetic_model"], {}), transformers_document()),
     False),
    ("transformers-synthetic-phase", mutated(set_path(["phases", 2, "phase"], "cold_forward"),
                                             transformers_document()), False),
    ("transformers-new-tokens-zero", mutated(set_path(["configuration", "new_tokens"], 0),
                                             transformers_document()), False),
    ("transformers-config-name-empty", mutated(set_path(["configuration", "config_name"], ""),
                                               transformers_document()), False),
    ("transformers-missing-record-every", mutated(delete_path(["configuration", "decode_record_every"]),
                                                  transformers_document()), False),
]


def test_schema_file_is_the_module_schema():
    on_disk = json.loads((ROOT / "lab_helpers" / "measurement.schema.json").read_text(encoding="utf-8"))
    assert on_disk == json.loads(json.dumps(MEASUREMENT_SCHEMA))
    jsonschema.Draft202012Validator.check_schema(on_disk)


@pytest.mark.parametrize("name, document, valid", AGREEMENT, ids=[case[0] for case in AGREEMENT])
def test_stdlib_validator_agrees_with_jsonschema(name, document, valid):
    validator = jsonschema.Draft202012Validator(json.loads(json.dumps(MEASUREMENT_SCHEMA)))
    assert validator.is_valid(document) is valid
    assert (measurement_problems(document) == []) is valid


def test_read_measurement_names_file_and_json_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()
    Path("d/m.json").write_text(json.dumps(mutated(set_path(["phases", 3, "peak_reserved_bytes"], -1))))
    with pytest.raises(LabError) as caught:
        read_measurement("d/m.json")
    assert str(caught.value) == "d/m.json: $.phases[3].peak_reserved_bytes: must be at least 0, got -1"
    Path("d/t.json").write_text(json.dumps(transformers_document()))
    assert read_measurement(tmp_path / "d" / "t.json")["configuration"]["kind"] == "transformers"
