"""Hostile input for the calculator and the results grid: bad numbers, bad files, bad paths.

Every case runs the real command in a fresh process, in a folder of its own, and checks: exit
status 2, nothing on stdout, exactly one `prog: error: ...` line on stderr naming what is wrong,
no traceback, no file created or changed in the folder, and a time bound. The calculator runs
both from the repository and as a standalone copy alone in an empty folder."""
import importlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_module, run_main_in_process
from test_forfaits import edited_card  # the shipped card with one field replaced

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "lab_helpers" / "calcul_forfaits.py"
CARD = ROOT / "data" / "tarifs-forfaits.csv"
CARD_LINES = CARD.read_text(encoding="utf-8").splitlines()
CARD_HEADER = CARD_LINES[0].split(",")
GRID_HEADER = ("date,gpu_model,forfait_days,forfait_lots,device,torch_version,measurement_file,"
               "task,acceptance_threshold,units_produced,units_accepted,wall_seconds,notes")
GRID_FIELDS = GRID_HEADER.split(",")
GOOD_PASS = "2026-10-01,b200,7,2,NVIDIA B200,2.9.0,,invoices,all fields exact,1200,1000,5400.5,"
# A refusal takes well under a second on an idle machine; the bound guards against a hang (a wait on a
# FIFO, a retry loop, a quadratic parse of a 100,000-digit value), not slowness, so a machine under
# load passes too; the subprocess timeout stops a real hang.
TIME_LIMIT_SECONDS = 60.0
HUGE_NUMBER = "9" * 4300
HUGER_NUMBER = "9" * 100_000


def snapshot(folder: Path) -> dict:
    """Every path under `folder` with its type, size, mode and modification time."""
    state = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        state[path.relative_to(folder).as_posix()] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return state


SUBPROCESS_EVERY = 12  # one row in twelve of a table also runs as a fresh Python (the rest in-process)
MODULE_MAINS = {"lab_helpers.grid": "lab_helpers.pricing.grid_commands"}


def in_subprocess(request) -> bool:
    """Whether this row (its position among the test's rows, in id order) runs as a fresh Python."""
    rows = sorted(item.name for item in request.session.items
                  if getattr(item, "originalname", None) == request.node.originalname and item.path == request.node.path)
    return rows.index(request.node.name) % SUBPROCESS_EVERY == 0


def in_process_main(args):
    """The main() that `python ARGS` runs: the script file's own (a copy loaded from where it lies, so
    it looks for its card beside itself), or the module's."""
    if args[0] == "-m":
        return importlib.import_module(MODULE_MAINS[args[1]]).main, list(map(str, args[2:]))
    return load_module(Path(args[0])).main, list(map(str, args[1:]))


def run_refused(args, cwd: Path, prog: str, *needles, request=None):
    """Run `args` in `cwd`; assert a one-line usage error holding `needles`; return the line.

    The folder `cwd` and, for a standalone copy, the script's own folder stay unchanged. With the
    test's `request`, most rows run in this process (a FIFO's stay subprocesses, guarded by the
    timeout); without it, a fresh Python."""
    script = Path(args[0])
    watched = [cwd] + ([script.parent] if script.parent not in (cwd, LIBRARY.parent) and
                       script.suffix == ".py" else [])
    before = [snapshot(folder) for folder in watched]
    could_hang = any(stat.S_ISFIFO(mode) for state in before for mode, *_ in state.values())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if request is not None and not could_hang and not in_subprocess(request):
        main, argv = in_process_main(args)
        proc = run_main_in_process(main, argv, cwd)
    else:
        proc = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert len(lines[0]) < 600, lines[0]  # a refused 100 000-digit value is not echoed back
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert [snapshot(folder) for folder in watched] == before
    return lines[0]


@pytest.fixture(params=["repository", "standalone"])
def calculator(request, tmp_path):
    """(script, work folder): the library file, or a copy alone in an empty folder."""
    work = tmp_path / "work"
    work.mkdir()
    if request.param == "repository":
        return LIBRARY, work
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(LIBRARY, alone / "calcul_forfaits.py")
    shutil.copy(CARD, work / "tarifs-forfaits.csv")  # the user's copy, given with --tariffs
    return alone / "calcul_forfaits.py", work


def _card_arg(script: Path, work: Path) -> list:
    card = work / "tarifs-forfaits.csv"
    return ["--tariffs", "tarifs-forfaits.csv"] if card.exists() else []


# --- numbers on the command line -----------------------------------------------------

BAD_FLAGS = {
    "days arabic-indic digits": (["--days", "١٢"], ["--days", "'١٢'", "0-9"]),
    "days fullwidth digit": (["--days", "７"], ["--days", "0-9"]),
    "days padded": (["--days", " 7 "], ["--days", "' 7 '"]),
    "days underscore": (["--days", "3_0"], ["--days", "'3_0'"]),
    "days decimal": (["--days", "7.0"], ["--days"]),
    "days plus sign": (["--days", "+7"], ["--days"]),
    "days hexadecimal": (["--days", "0x7"], ["--days"]),
    "days not offered": (["--days", "14"], ["--days", "3, 7, 30"]),
    "days 4300 digits": (["--days", HUGE_NUMBER], ["--days", "4300 digits"]),
    "days empty": (["--days", ""], ["--days", "empty"]),
    "lots arabic-indic digits": (["--lots", "١٢"], ["--lots", "0-9"]),
    "lots underscore": (["--lots", "1_000"], ["--lots", "'1_000'"]),
    "lots padded": (["--lots", " 12 "], ["--lots", "' 12 '"]),
    "lots negative": (["--lots", "-1"], ["--lots"]),
    "lots zero": (["--lots", "0"], ["--lots", "out of range"]),
    "lots over the bound": (["--lots", "10001"], ["--lots", "1 to 10000"]),
    "lots 4300 digits": (["--lots", HUGE_NUMBER], ["--lots", "4300 digits"]),
    "lots 100000 digits": (["--lots", HUGER_NUMBER], ["--lots", "100000 digits"]),
    "lots exponent": (["--lots", "1e3"], ["--lots"]),
    "accepted arabic-indic": (["--accepted-results", "٣"], ["--accepted-results", "0-9"]),
    "accepted over the bound": (["--accepted-results", str(10**15 + 1)],
                                ["--accepted-results", "out of range"]),
    "accepted 4300 digits": (["--accepted-results", HUGE_NUMBER], ["--accepted-results", "digits"]),
    "accepted superscript": (["--accepted-results", "²"], ["--accepted-results"]),
    "accepted infinity": (["--accepted-results", "inf"], ["--accepted-results"]),
    "gpu escape sequence": (["--gpu", "\x1b[31mb200"], ["unknown GPU model", "\\x1b"]),
    "gpu 100000 characters": (["--gpu", "x" * 100_000], ["unknown GPU model", "100000 characters"]),
    "tariffs empty path": (["--tariffs", ""], ["--tariffs", "empty"]),
    "format unknown": (["--format", "yaml"], ["--format"]),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_calculator_refuses_bad_flags(calculator, case, request):
    script, work = calculator
    flags, needles = BAD_FLAGS[case]
    args = {"--gpu": "b200", "--days": "7"}
    extra = []
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in args:
            args[flag] = value
        else:
            extra += [flag, value]
    argv = [script, *[x for pair in args.items() for x in pair], *extra]
    if "--tariffs" not in flags:
        argv += _card_arg(script, work)
    run_refused(argv, work, "calcul_forfaits", *needles, request=request)


def test_bounds_themselves_are_accepted(calculator):
    script, work = calculator
    proc = subprocess.run([sys.executable, str(script), "--gpu", "b200", "--days", "30",
                           "--lots", "10000", "--accepted-results", str(10**15),
                           *_card_arg(script, work)],
                          cwd=work, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"total_price_cents": 6324480000' in proc.stdout  # 632448 cents x 10000 lots
    assert '"unit_cost_cents": 0' in proc.stdout  # 6324480000 / 10^15, half up: 0 cents


# --- the rate card file --------------------------------------------------------------

BAD_CARD_CELLS = {
    "price arabic-indic digits": (3, "lot_price_cents", "١٦٩٧٠٧"),
    "price padded": (3, "lot_price_cents", " 169707 "),
    "price underscore": (3, "lot_price_cents", "169_707"),
    "price plus sign": (3, "lot_price_cents", "+169707"),
    "price exponent": (3, "lot_price_cents", "1e5"),
    "price 4300 digits": (3, "lot_price_cents", HUGE_NUMBER),
    "price over the bound": (3, "lot_price_cents", str(10**15 + 1)),
    "gpus fullwidth digit": (2, "gpus_per_lot", "２"),
    "memory padded": (5, "memory_per_gpu_gib", " 141"),
    "duration arabic-indic": (4, "duration_days", "٣٠"),
    "snapshot compact date": (4, "snapshot_date", "20260924"),
    "snapshot fullwidth date": (4, "snapshot_date", "２０２６-09-24"),
    "model id formula": (5, "model_id", "=cmd"),
}


@pytest.mark.parametrize("case", list(BAD_CARD_CELLS))
def test_calculator_refuses_bad_card_cells_naming_file_and_line(calculator, case, request):
    script, work = calculator
    line, column, value = BAD_CARD_CELLS[case]
    (work / "card.csv").write_text(edited_card(line, column, value), encoding="utf-8")
    run_refused([script, "--gpu", "b200", "--days", "7", "--tariffs", "card.csv"], work,
                "calcul_forfaits", f"card.csv, line {line}: ", column, request=request)


def _sparse(path: Path, size_bytes: int) -> None:
    """A file of `size_bytes` (a sparse hole: costs no disk)."""
    path.write_bytes(b"")
    os.truncate(path, size_bytes)


def _make_fifo(path: Path) -> None:
    os.mkfifo(path)


BAD_CARD_FILES = {
    "folder": (lambda p: p.mkdir(), "is a folder"),
    "fifo": (_make_fifo, "not a regular file"),
    "missing": (lambda p: None, "No such file"),
    "under a file": (None, "Not a directory"),
    "symlink loop": (lambda p: p.symlink_to(p.name), "symbolic links"),
    "binary": (lambda p: p.write_bytes(b"model_id\x00\x01\x02"), "binary"),
    "utf-16": (lambda p: p.write_text(",".join(CARD_HEADER), encoding="utf-16"), "UTF-16"),
    "latin-1": (lambda p: p.write_bytes(",".join(CARD_HEADER).encode() + b"\nZ\xe9ro\n"),
                "not UTF-8"),
    "huge": (lambda p: _sparse(p, 2 * 1024 * 1024), "over the 1048576-byte limit"),
    "empty": (lambda p: p.write_bytes(b""), "empty"),
    "blank lines": (lambda p: p.write_text("\n \n\t\n"), "empty"),
}


@pytest.mark.parametrize("case", list(BAD_CARD_FILES))
def test_calculator_refuses_bad_card_files(calculator, case, request):
    script, work = calculator
    make, needle = BAD_CARD_FILES[case]
    name = "card.csv"
    if make is None:  # a path through a regular file
        (work / "plain").write_text("x")
        name = "plain/card.csv"
    else:
        make(work / name)
    line = run_refused([script, "--list", "--tariffs", name], work, "calcul_forfaits", name, needle,
                       request=request)
    assert str(work) not in line  # the path as typed, never made absolute


def test_unreadable_card(calculator):
    if os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode; the under-a-file case covers EACCES-like faults")
    script, work = calculator
    card = work / "card.csv"
    shutil.copy(CARD, card)
    card.chmod(0)
    run_refused([script, "--list", "--tariffs", "card.csv"], work, "calcul_forfaits",
                "card.csv", "Permission denied")


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_card_whose_read_fails(calculator):
    script, work = calculator  # /proc/self/mem: a regular file whose first read fails (EIO)
    run_refused([script, "--list", "--tariffs", "/proc/self/mem"], work, "calcul_forfaits",
                "/proc/self/mem: cannot read the rate card (Input/output error)")


def test_standalone_copy_without_a_card_says_where_it_looked(tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(LIBRARY, alone / "calcul_forfaits.py")
    line = run_refused([alone / "calcul_forfaits.py", "--list"], alone, "calcul_forfaits",
                       "no rate card found at tarifs-forfaits.csv", "--tariffs")
    assert str(tmp_path) not in line


def test_standalone_copy_beside_its_card_shows_the_card_by_name(tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(LIBRARY, alone / "calcul_forfaits.py")
    shutil.copy(CARD, alone / "tarifs-forfaits.csv")
    proc = subprocess.run([sys.executable, "calcul_forfaits.py", "--gpu", "b200", "--days", "7",
                           "--format", "table"], cwd=alone, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rate card               tarifs-forfaits.csv (snapshot 2026-09-24)" in proc.stdout
    assert str(tmp_path) not in proc.stdout


# --- the results grid ----------------------------------------------------------------

def _grid_pass(**changes) -> str:
    fields = dict(zip(GRID_FIELDS, GOOD_PASS.split(",")))
    fields.update(changes)
    return ",".join(fields[column] for column in GRID_FIELDS)


BAD_GRID_CELLS = {
    "lots arabic-indic": ({"forfait_lots": "١"}, "forfait_lots"),
    "lots over the bound": ({"forfait_lots": "10001"}, "forfait_lots"),
    "days fullwidth": ({"forfait_days": "７"}, "forfait_days"),
    "produced padded": ({"units_produced": " 1200"}, "units_produced"),
    "accepted underscore": ({"units_accepted": "1_000"}, "units_accepted"),
    "accepted 4300 digits": ({"units_accepted": HUGE_NUMBER}, "units_accepted"),
    "accepted 100000 digits": ({"units_accepted": HUGER_NUMBER}, "units_accepted"),
    "seconds exponent": ({"wall_seconds": "1e3"}, "wall_seconds"),
    "seconds nan": ({"wall_seconds": "nan"}, "wall_seconds"),
    "seconds infinity": ({"wall_seconds": "Infinity"}, "wall_seconds"),
    "seconds arabic-indic": ({"wall_seconds": "١٢"}, "wall_seconds"),
    "seconds zero": ({"wall_seconds": "0.0"}, "wall_seconds"),
    "seconds negative": ({"wall_seconds": "-5"}, "wall_seconds"),
    "date compact": ({"date": "20261001"}, "date"),
    "date fullwidth": ({"date": "２０２６-10-01"}, "date"),
    "date impossible": ({"date": "2026-02-30"}, "date"),
}


@pytest.fixture
def grid_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    return work


@pytest.mark.parametrize("command", ["check", "report"])
@pytest.mark.parametrize("case", list(BAD_GRID_CELLS))
def test_grid_refuses_bad_cells_naming_file_and_line(grid_folder, case, command, request):
    changes, column = BAD_GRID_CELLS[case]
    (grid_folder / "g.csv").write_text(f"{GRID_HEADER}\n{GOOD_PASS}\n{_grid_pass(**changes)}\n",
                                       encoding="utf-8")
    run_refused(["-m", "lab_helpers.grid", command, "g.csv", "--tariffs", CARD], grid_folder,
                "grid", "g.csv, line 3: ", column, request=request)


@pytest.mark.parametrize("case", [c for c in BAD_CARD_FILES if c != "blank lines"])
def test_grid_refuses_bad_grid_files(grid_folder, case, request):
    make, needle = BAD_CARD_FILES[case]
    name = "g.csv"
    if make is None:
        (grid_folder / "plain").write_text("x")
        name = "plain/g.csv"
    else:
        make(grid_folder / name)
    if case == "huge":
        os.truncate(grid_folder / name, 17 * 1024 * 1024)
        needle = "over the 16777216-byte limit"
    line = run_refused(["-m", "lab_helpers.grid", "check", name, "--tariffs", CARD],
                       grid_folder, "grid", name, needle, request=request)
    assert str(grid_folder) not in line


def test_grid_refuses_a_bad_card_too(grid_folder):
    (grid_folder / "g.csv").write_text(f"{GRID_HEADER}\n", encoding="utf-8")
    (grid_folder / "card.csv").write_text(edited_card(3, "lot_price_cents", "١٢"), encoding="utf-8")
    run_refused(["-m", "lab_helpers.grid", "check", "g.csv", "--tariffs", "card.csv"],
                grid_folder, "grid", "card.csv, line 3: ", "lot_price_cents")


def test_report_csv_refuses_an_existing_file_and_leaves_it(grid_folder):
    (grid_folder / "g.csv").write_text(f"{GRID_HEADER}\n{GOOD_PASS}\n", encoding="utf-8")
    (grid_folder / "out.csv").write_text("mine\n", encoding="utf-8")
    run_refused(["-m", "lab_helpers.grid", "report", "g.csv", "--csv", "out.csv"], grid_folder,
                "grid", "out.csv", "already exists")
    assert (grid_folder / "out.csv").read_text(encoding="utf-8") == "mine\n"


def test_report_csv_into_a_missing_folder_writes_nothing(grid_folder):
    (grid_folder / "g.csv").write_text(f"{GRID_HEADER}\n{GOOD_PASS}\n", encoding="utf-8")
    run_refused(["-m", "lab_helpers.grid", "report", "g.csv", "--csv", "nowhere/out.csv"],
                grid_folder, "grid", "nowhere/out.csv")


def test_report_csv_neutralises_formulas(grid_folder):
    task = "=HYPERLINK(\"http://x\",\"y\")"
    row = _grid_pass(task=f'"{task.replace(chr(34), chr(34) * 2)}"')
    (grid_folder / "g.csv").write_text(f"{GRID_HEADER}\n{row}\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.grid", "report", "g.csv",
                           "--tariffs", str(CARD), "--csv", "out.csv"], cwd=grid_folder,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = (grid_folder / "out.csv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == ("line,date,task,gpu_model,days,lots,gpus,total_price_cents,"
                        "units_accepted,unit_cost_cents,wall_seconds,seconds_per_accepted_unit")
    assert lines[1] == ('2,2026-10-01,"\'=HYPERLINK(""http://x"",""y"")",b200,7,2,4,339414,1000,'
                        "339,5400.5,5.4")
    assert (grid_folder / "out.csv").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
