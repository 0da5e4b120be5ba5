"""Hostile inputs against what every program shares (core.cli, core.files) and the git clean filter:
a mistyped flag, paths holding a newline or an escape sequence, a Python without the lab's packages,
notebooks the filter cannot clean. Each row: an id, the argv (or the filter's input), what the working
folder holds first, and a fragment of the one line expected on stderr.

Every case must end in exactly one line `prog: error: ...` on stderr, exit 2, nothing on stdout, no
traceback, no file created or changed in the working folder. The subprocess timeout (120 s) is the
only time bound: it stops a hang (a read of a FIFO or of /dev/zero), and it is generous so a machine
running other jobs passes too.
"""
import importlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import full_measurement, run_main_in_process
from lab_helpers.synthetic import predict as synthetic_predict
from lab_helpers.synthetic.network import MeasureConfig

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_SECONDS = 120

# a newline and a terminal escape sequence (red text) in a file name, and the way a message spells it
ODD = "a\nb\x1b[31m.json"
ODD_SHOWN = r"a\nb\x1b[31m.json"
ODD_CSV = "a\nb\x1b[31m.csv"
ODD_CSV_SHOWN = r"a\nb\x1b[31m.csv"

MEASUREMENT = full_measurement(synthetic_predict, MeasureConfig(batch=2, context=8, width=16, repeats=2))
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 128,
               "max_position_embeddings": 256}


def snapshot(folder: Path) -> dict:
    """Every path under `folder` with its size and modification time, to show nothing changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            info = os.lstat(path)
            out[path] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return out


def write(name: str, content) -> callable:
    def setup(folder: Path) -> None:
        data = content if isinstance(content, bytes) else (
            content if isinstance(content, str) else json.dumps(content)).encode("utf-8")
        (folder / name).write_bytes(data)
    return setup


def fifo(name: str) -> callable:
    def setup(folder: Path) -> None:
        os.mkfifo(folder / name)
    return setup


def config(folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG), encoding="utf-8")


def run(argv, folder: Path, *, env=None, stdin=None, input_bytes=None):
    kwargs = {"input": input_bytes} if input_bytes is not None else {"stdin": stdin or subprocess.DEVNULL}
    return subprocess.run([sys.executable, *argv], cwd=folder, capture_output=True, timeout=TIMEOUT_SECONDS,
                          env=env or {**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


SUBPROCESS_EVERY = 12  # one row in twelve of a table also runs as a fresh `python -m` (the rest in-process)
# The main() that `python -m lab_helpers.NAME` runs, for the rows run in-process
MAINS = {"real_model": "lab_helpers.real.commands", "mesure_memoire": "lab_helpers.mesure_memoire",
         "calcul_forfaits": "lab_helpers.calcul_forfaits", "grid": "lab_helpers.pricing.grid_commands",
         "runs": "lab_helpers.views.runs_commands", "sweep": "lab_helpers.views.sweep_commands",
         "timeline": "lab_helpers.views.timeline_commands", "kit": "lab_helpers.build.kit",
         "notebook_strip": "lab_helpers.build.strip"}


def in_subprocess(table, case: str) -> bool:
    """Whether the row `case` of `table` (its ids, in order) runs as a fresh `python -m`."""
    return sorted(table).index(case) % SUBPROCESS_EVERY == 0


def run_program(program: str, args, folder: Path, *, subprocess_row: bool, input_bytes=None, stdin_file=None):
    """`python -m lab_helpers.PROGRAM ARGS` in `folder`, in a fresh Python or in this one; bytes out.
    A row that could hang (a FIFO, a device) stays a subprocess: its timeout guards it."""
    if subprocess_row:
        if stdin_file is not None:
            with open(stdin_file, "rb") as stream:
                return run(["-m", f"lab_helpers.{program}", *args], folder, stdin=stream)
        return run(["-m", f"lab_helpers.{program}", *args], folder, input_bytes=input_bytes)
    main = importlib.import_module(MAINS[program]).main
    return run_main_in_process(main, args, folder, stdin_bytes=input_bytes, stdin_file=stdin_file, text=False)


def check_one_line(proc, prog: str, expected: str) -> str:
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, (proc.returncode, stderr)
    assert "Traceback" not in stderr, stderr
    assert proc.stdout == b"", proc.stdout[:300]
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert "\x1b" not in stderr, stderr  # no raw escape sequence reaches the terminal
    assert stderr.startswith(f"{prog}: error: "), stderr
    assert expected in stderr, (expected, stderr)
    return stderr


# ------------------------------------------------------------------ 1. a mistyped flag
TYPO_CASES = [
    ("model-predict-confg", ["real_model", "predict", "--confg", "config.json", "--batch", "1", "--context", "8",
                             "--new-tokens", "1"], "unrecognized arguments: --confg (did you mean --config?)"),
    ("model-predict-bach", ["real_model", "predict", "--config", "config.json", "--bach", "1", "--context", "8",
                            "--new-tokens", "1"], "unrecognized arguments: --bach (did you mean --batch?)"),
    ("model-predict-equals", ["real_model", "predict", "--confg=config.json"], "unrecognized arguments: --confg "),
    ("model-fit-new-token", ["real_model", "fit", "--config", "config.json", "--new-tokns", "4"],
     "unrecognized arguments: --new-tokns (did you mean --new-tokens?)"),
    ("model-measure-contxt", ["real_model", "measure", "--config", "config.json", "--batch", "1", "--contxt", "8",
                              "--new-tokens", "1"], "did you mean --context?"),
    ("model-compare-frmat", ["real_model", "compare", "--frmat", "json", "x.json"], "did you mean --format?"),
    ("model-before-command", ["real_model", "--confg", "config.json"], "unrecognized arguments: --confg"),
    ("memory-estimate-bit", ["mesure_memoire", "estimate", "--parameters", "7000000000", "--bitz", "16"],
     "unrecognized arguments: --bitz (did you mean --bits?)"),
    ("memory-compare-fail", ["mesure_memoire", "compare", "--fail-on-diference", "x.json"],
     "did you mean --fail-on-difference?"),
    ("forfaits-dayz", ["calcul_forfaits", "--gpu", "h100", "--dayz", "3"],
     "unrecognized arguments: --dayz (did you mean --days?)"),
    ("forfaits-tarifs", ["calcul_forfaits", "--tarifs", "x.csv"], "did you mean --tariffs?"),
    ("grid-tarifs", ["grid", "check", "--tarifs", "x.csv", "g.csv"], "did you mean --tariffs?"),
    ("grid-report-cvs", ["grid", "report", "--cvs", "o.csv", "g.csv"], "did you mean --csv?"),
    ("runs-countr", ["runs", "--countr", "peak_reserved_bytes", "x.json"], "did you mean --counter?"),
    ("sweep-dimenson", ["sweep", "--dimenson", "batch", "--values", "1", "--output-dir", "out"],
     "unrecognized arguments: --dimenson (did you mean --dimension?)"),
    ("timeline-plot-outptu", ["timeline", "plot", "--outptu", "o.png", "x.json"], "did you mean --output?"),
    ("timeline-convert-ouput", ["timeline", "convert", "--ouput", "o.json", "x.pickle"], "did you mean --output?"),
    ("kit-build-outptu", ["kit", "build", "--outptu", "k.zip"], "did you mean --output?"),
    ("kit-before-command", ["kit", "--outptu", "k.zip"], "unrecognized arguments: --outptu"),
    ("strip-typo", ["notebook_strip", "--outptu", "x.ipynb"], "unrecognized arguments: --outptu"),
]


@pytest.mark.parametrize("case, argv, expected", [pytest.param(*row, id=row[0]) for row in TYPO_CASES])
def test_a_mistyped_flag_is_named_with_the_closest_one(tmp_path, case, argv, expected):
    work = tmp_path / "work"
    work.mkdir()
    config(work)
    before = snapshot(work)
    proc = run_program(argv[0], argv[1:], work,
                       subprocess_row=in_subprocess([row[0] for row in TYPO_CASES], case))
    check_one_line(proc, argv[0], expected)
    assert "the following arguments are required" not in proc.stderr.decode()
    assert snapshot(work) == before


# ------------------------------------------------------------------ 2. paths holding a newline or an escape
PATH_CASES = [
    ("model-predict-missing", ["real_model", "predict", "--config", ODD, "--batch", "1", "--context", "8",
                               "--new-tokens", "1"], None, ODD_SHOWN),
    ("model-predict-bad-json", ["real_model", "predict", "--config", ODD, "--batch", "1", "--context", "8",
                                "--new-tokens", "1"], write(ODD, "{"), ODD_SHOWN),
    ("model-fit-missing", ["real_model", "fit", "--config", ODD, "--new-tokens", "1", "--memory-bytes", "1000000000"],
     None, ODD_SHOWN),
    ("model-compare-missing", ["real_model", "compare", ODD], None, ODD_SHOWN),
    ("model-compare-fifo", ["real_model", "compare", ODD], fifo(ODD), ODD_SHOWN),
    ("memory-compare-missing", ["mesure_memoire", "compare", ODD], None, ODD_SHOWN),
    ("memory-compare-bad-json", ["mesure_memoire", "compare", ODD], write(ODD, "[1,"), ODD_SHOWN),
    ("memory-compare-nan", ["mesure_memoire", "compare", ODD], write(ODD, '{"x": NaN}'), ODD_SHOWN),
    ("forfaits-tariffs-missing", ["calcul_forfaits", "--tariffs", ODD_CSV, "--list"], None, ODD_CSV_SHOWN),
    ("forfaits-tariffs-binary", ["calcul_forfaits", "--tariffs", ODD_CSV, "--list"], write(ODD_CSV, b"\x00\x01"),
     ODD_CSV_SHOWN),
    ("grid-check-missing", ["grid", "check", ODD_CSV], None, ODD_CSV_SHOWN),
    ("grid-check-empty", ["grid", "check", ODD_CSV], write(ODD_CSV, b""), ODD_CSV_SHOWN),
    ("grid-report-tariffs", ["grid", "report", "--tariffs", ODD_CSV, "g.csv"], write("g.csv", "x\n"), None),
    ("runs-missing", ["runs", ODD], None, ODD_SHOWN),
    ("runs-bad-json", ["runs", ODD], write(ODD, "not json"), ODD_SHOWN),
    ("timeline-summary-missing", ["timeline", "summary", ODD], None, ODD_SHOWN),
    ("timeline-plot-missing", ["timeline", "plot", ODD, "--output", "o.png"], None, ODD_SHOWN),
    ("timeline-explain-missing", ["timeline", "explain", ODD], None, ODD_SHOWN),
    ("timeline-convert-missing", ["timeline", "convert", ODD, "--output", "o.json"], None, ODD_SHOWN),
    ("kit-verify-missing", ["kit", "verify", ODD], None, ODD_SHOWN),
    ("kit-build-output-under-a-file", ["kit", "build", "--output", ODD + "/k.zip"], write(ODD, "x"), ODD_SHOWN),
    ("sweep-output-is-a-file", ["sweep", "--dimension", "batch", "--values", "1", "--output-dir", ODD],
     write(ODD, "x"), ODD_SHOWN),
    ("strip-missing", ["notebook_strip", ODD], None, ODD_SHOWN),
    ("stray-argument", ["grid", "check", "g.csv", ODD], None, ODD_SHOWN),
    ("bad-choice", ["real_model", "compare", "--format", "x\x1b[2J", "m.json"], None, r"x\x1b[2J"),
]


@pytest.mark.parametrize("case, argv, setup, expected", [pytest.param(*row, id=row[0]) for row in PATH_CASES])
def test_a_path_with_a_newline_or_an_escape_is_spelled_out_in_one_line(tmp_path, case, argv, setup, expected):
    work = tmp_path / "work"
    work.mkdir()
    config(work)
    if setup:
        setup(work)
    before = snapshot(work)
    could_hang = any(stat.S_ISFIFO(os.lstat(path).st_mode) for path in before)
    proc = run_program(argv[0], argv[1:], work,
                       subprocess_row=could_hang or in_subprocess([row[0] for row in PATH_CASES], case))
    check_one_line(proc, argv[0], expected or ": error: ")
    assert snapshot(work) == before


# ------------------------------------------------------------------ 3. a Python without the lab's packages
BLOCKER = ("import sys\n"
           "for name in {names!r}:\n"
           "    sys.modules[name] = None  # `import name` then raises ModuleNotFoundError, as if not installed\n")

MISSING_CASES = [
    ("model-predict-no-torch", ("torch",), ["real_model", "predict", "--config", "config.json", "--batch", "1",
                                            "--context", "8", "--new-tokens", "1"], "'torch'"),
    ("model-predict-no-transformers", ("transformers",), ["real_model", "predict", "--config", "config.json",
                                                          "--batch", "1", "--context", "8", "--new-tokens", "1"],
     "'transformers'"),
    ("model-fit-no-torch", ("torch", "transformers"), ["real_model", "fit", "--config", "config.json", "--batch", "1",
                                                        "--new-tokens", "1", "--memory-bytes", "1000000000"], "'t"),
    ("timeline-summary-no-numpy", ("numpy", "matplotlib"), ["timeline", "summary", "t.json"], "package"),
    ("timeline-plot-no-matplotlib", ("matplotlib",), ["timeline", "plot", "t.json", "--output", "o.png"],
     "'matplotlib'"),
    ("runs-no-pandas", ("pandas",), ["runs", "m.json"], "pandas"),
    ("memory-measure-no-torch", ("torch",), ["mesure_memoire", "measure", "--output", "o.json"], "'torch'"),
]


@pytest.mark.parametrize("names, argv, expected",
                         [pytest.param(n, a, e, id=case) for case, n, a, e in MISSING_CASES])
def test_a_python_without_a_package_names_it_and_make_lab(tmp_path, names, argv, expected):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER.format(names=names), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    config(work)
    (work / "t.json").write_text(json.dumps({"device": "cuda:0", "events": {}}), encoding="utf-8")
    (work / "m.json").write_text(json.dumps(MEASUREMENT), encoding="utf-8")
    before = snapshot(work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(blocker)])}
    proc = run(["-m", f"lab_helpers.{argv[0]}", *argv[1:]], work, env=env)
    stderr = check_one_line(proc, argv[0], expected)
    assert "make lab" in stderr  # also shows the command reached its import, not an input check
    assert snapshot(work) == before


# ------------------------------------------------------------------ 4. the git clean filter
def notebook(cells=None, metadata=None) -> str:
    return json.dumps({"cells": cells if cells is not None else [], "metadata": metadata or {},
                       "nbformat": 4, "nbformat_minor": 5})


CODE_CELL = '{"cell_type": "code", "source": %s, "metadata": {}, "outputs": [], "execution_count": 1}'
STRIP_CASES = [
    ("surrogate-in-source", '{"cells": [%s], "metadata": {}}' % (CODE_CELL % '"x = \\ud800"'), "lone surrogate"),
    ("surrogate-in-key", '{"cells": [], "metadata": {"\\udfff": 1}}', "lone surrogate"),
    ("surrogate-in-markdown", '{"cells": [{"cell_type": "markdown", "source": ["\\ud83d"], "metadata": {}}], '
                              '"metadata": {}}', "lone surrogate"),
    ("nan-in-metadata", '{"cells": [], "metadata": {"x": NaN}}', "NaN"),
    ("infinity-in-cell-metadata", '{"cells": [{"cell_type": "code", "source": "", "metadata": {"x": -Infinity}, '
                                  '"outputs": []}], "metadata": {}}', "NaN or Infinity"),
    ("not-json", "{", "not valid JSON"),
    ("not-utf8", b"\xff\xfe{}", "not UTF-8"),
    ("not-a-notebook", "[1, 2]", "not a notebook"),
    ("deeply-nested", '{"cells": [], "metadata": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}", "nested"),
    ("cell-not-object", '{"cells": [1], "metadata": {}}', "cell 1"),
]


@pytest.mark.parametrize("case, content, expected", [pytest.param(*row, id=row[0]) for row in STRIP_CASES])
@pytest.mark.parametrize("how", ["file", "stdin"])
def test_the_filter_refuses_what_it_cannot_clean_in_one_line(tmp_path, case, content, expected, how):
    work = tmp_path / "work"
    work.mkdir()
    data = content if isinstance(content, bytes) else content.encode("utf-8")
    (work / "n.ipynb").write_bytes(data)
    before = snapshot(work)
    subprocess_row = in_subprocess([f"{row[0]}-{way}" for row in STRIP_CASES for way in ("file", "stdin")],
                                   f"{case}-{how}")
    if how == "file":
        proc = run_program("notebook_strip", ["n.ipynb"], work, subprocess_row=subprocess_row)
    else:
        proc = run_program("notebook_strip", [], work, subprocess_row=subprocess_row, input_bytes=data)
    check_one_line(proc, "notebook_strip", expected)
    assert snapshot(work) == before  # the working copy is never touched


@pytest.mark.parametrize("argv, setup, expected", [
    pytest.param(["fifo.ipynb"], fifo("fifo.ipynb"), "not a regular file", id="fifo-argument"),
    pytest.param(["/dev/zero"], None, "not a regular file", id="dev-zero-argument"),
    pytest.param(["."], None, "folder", id="folder-argument"),
    pytest.param(["missing.ipynb"], None, "missing.ipynb", id="missing-argument"),
])
def test_the_filter_never_waits_on_a_fifo_or_a_device(tmp_path, argv, setup, expected):
    work = tmp_path / "work"
    work.mkdir()
    if setup:
        setup(work)
    before = snapshot(work)
    check_one_line(run(["-m", "lab_helpers.notebook_strip", *argv], work), "notebook_strip", expected)
    assert snapshot(work) == before


def test_the_filter_reads_a_bounded_part_of_an_endless_stdin(tmp_path):
    with open("/dev/zero", "rb") as zero:
        proc = run(["-m", "lab_helpers.notebook_strip"], tmp_path, stdin=zero)
    check_one_line(proc, "notebook_strip", "more than")


def test_the_filter_drops_nan_and_surrogates_that_only_outputs_hold(tmp_path):
    cell = ('{"cell_type": "code", "source": "x", "metadata": {}, "execution_count": 3, '
            '"outputs": [{"output_type": "execute_result", "data": {"text/plain": "\\ud800"}, "x": NaN}]}')
    proc = run(["-m", "lab_helpers.notebook_strip"], tmp_path,
               input_bytes=('{"cells": [%s], "metadata": {}}' % cell).encode())
    assert proc.returncode == 0, proc.stderr
    clean = json.loads(proc.stdout, parse_constant=lambda name: pytest.fail(name))
    assert clean["cells"][0]["outputs"] == [] and clean["cells"][0]["execution_count"] is None
