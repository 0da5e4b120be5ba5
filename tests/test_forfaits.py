"""The forfait calculator, its rate card and its notebook.

Behaviour tests take the `calc` / `calc_script` fixtures, so they run against the library
module and against the copy inlined in notebooks/forfaits.ipynb."""
import ast
import csv
import json
import re
import shutil
import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal, localcontext
from fractions import Fraction
from pathlib import Path

import nbformat
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab_helpers.build.sync import notebook_code_upto, sync

ROOT = Path(__file__).resolve().parent.parent
CARD = ROOT / "data" / "tarifs-forfaits.csv"
LIBRARY = ROOT / "lab_helpers" / "calcul_forfaits.py"
NOTEBOOK = "notebooks/forfaits.ipynb"
CARD_HEADER = ["model_id", "display_name", "gpus_per_lot", "memory_per_gpu_gib", "duration_days",
               "lot_price_cents", "currency", "snapshot_date", "provenance"]
JSON_FIELDS = {"gpu", "days", "lots", "gpus_per_lot", "gpus", "lot_price_cents",
               "total_price_cents", "currency", "snapshot_date", "accepted_results",
               "unit_cost_cents", "unit_cost_rounding", "notice"}
MAIN_TRAILER = 'if __name__ == "__main__":\n    sys.exit(main())\n'
FIXTURE_SETTINGS = settings(max_examples=150, deadline=None,
                            suppress_health_check=[HealthCheck.function_scoped_fixture])


def card_text_rows() -> list:
    """The shipped card parsed independently of the module: a list of str dicts."""
    with CARD.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


CARD_ROWS = card_text_rows()
CARD_LINES = CARD.read_text(encoding="utf-8").splitlines()


def run_cli(script: Path, *args, cwd=None) -> subprocess.CompletedProcess:
    """Run a calculator file with `args`; return the completed process."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def assert_one_line_error(proc, *needles):
    """Exit 2, nothing on stdout, exactly one stderr line holding every needle, no traceback."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("calcul_forfaits: error: ")
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def half_up(numerator: int, denominator: int) -> int:
    """Exact half-up rounding of a positive fraction to an integer."""
    return int(Fraction(numerator, denominator) + Fraction(1, 2))


# --- the shipped rate card -------------------------------------------------------------

def test_card_has_45_rows_15_models_3_durations():
    assert CARD_LINES[0].split(",") == CARD_HEADER
    assert len(CARD_ROWS) == 45
    models = {row["model_id"] for row in CARD_ROWS}
    assert len(models) == 15
    for model in models:
        assert sorted(int(r["duration_days"]) for r in CARD_ROWS if r["model_id"] == model) == [3, 7, 30]
    for row in CARD_ROWS:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", row["model_id"])
        assert row["gpus_per_lot"] == ("2" if row["model_id"] == "b200" else "1")
        assert int(row["lot_price_cents"]) > 0 and row["lot_price_cents"].isdigit()
        assert int(row["memory_per_gpu_gib"]) > 0
        assert row["currency"] == "USD"
        assert row["snapshot_date"] == "2026-09-24"
        assert "illustrative" in row["provenance"] and "not a quote" in row["provenance"]


def test_exact_cents_on_all_45_rows(calc):
    rows = calc.load_card(CARD)
    assert len(rows) == len(CARD_ROWS)
    for text in CARD_ROWS:
        price, per_lot = int(text["lot_price_cents"]), int(text["gpus_per_lot"])
        for lots in (1, 3):
            result = calc.compute_forfait(rows, text["model_id"], int(text["duration_days"]), lots)
            assert result["lot_price_cents"] == price
            assert result["total_price_cents"] == price * lots
            assert result["gpus"] == per_lot * lots
            assert result["memory_per_gpu_gib"] == int(text["memory_per_gpu_gib"])
            assert result["unit_cost_cents"] is None


def test_b200_two_lots_of_seven_days(calc):
    price = next(int(r["lot_price_cents"]) for r in CARD_ROWS
                 if r["model_id"] == "b200" and r["duration_days"] == "7")
    result = calc.compute_forfait(calc.load_card(CARD), "b200", 7, 2)
    assert (result["gpus_per_lot"], result["gpus"]) == (2, 4)
    assert result["total_price_cents"] == 2 * price
    assert result["total_price"] == f"{2 * price // 100}.{2 * price % 100:02d}"


def test_unit_cost_rounds_half_up_to_the_cent(calc):
    assert calc.unit_cost_cents(5, 2) == 3
    assert calc.unit_cost_cents(79056, 32) == 2471  # 2470.5 exactly: half up, not half even
    assert calc.unit_cost_cents(339414, 1000) == 339
    assert calc.unit_cost_cents(7, 3) == 2
    result = calc.compute_forfait(calc.load_card(CARD), "b200", 3, 1, 32)
    assert (result["accepted_results"], result["unit_cost_cents"]) == (32, 2471)
    assert "ROUND_HALF_UP" in result["unit_cost_rounding"]


@pytest.mark.parametrize("kwargs", [
    {"lots": 0}, {"lots": -1}, {"lots": 1.5}, {"lots": True},
    {"accepted_results": 0}, {"accepted_results": -4}, {"accepted_results": 2.5},
    {"accepted_results": "3"},
])
def test_compute_refuses_bad_counts(calc, kwargs):
    with pytest.raises(calc.ForfaitError):
        calc.compute_forfait(calc.load_card(CARD), "b200", 7, **{"lots": 1, **kwargs})


def test_notice_says_illustrative_only_when_the_provenance_does(calc):
    rows = calc.load_card(CARD)
    notice = calc.compute_forfait(rows, "l4", 3)["notice"]
    assert "availability" in notice and "reservation" in notice and "illustrative" in notice
    quoted = CARD.read_text(encoding="utf-8").replace(CARD_ROWS[0]["provenance"], "quote 42 from a provider")
    notice = calc.compute_forfait(calc.parse_card(quoted), "l4", 3)["notice"]
    assert "availability" in notice and "illustrative" not in notice


# --- properties ------------------------------------------------------------------------

@FIXTURE_SETTINGS
@given(index=st.integers(0, 44), lots=st.integers(1, 10**4))
def test_total_is_lots_times_lot_price(calc, index, lots):
    text = CARD_ROWS[index]
    result = calc.compute_forfait(calc.load_card(CARD), text["model_id"], int(text["duration_days"]), lots)
    assert result["total_price_cents"] == lots * int(text["lot_price_cents"])
    assert result["gpus"] == lots * int(text["gpus_per_lot"])


@FIXTURE_SETTINGS
@given(total=st.integers(1, 10**15), accepted=st.integers(1, 10**9))
def test_unit_cost_times_accepted_reproduces_the_total(calc, total, accepted):
    unit = calc.unit_cost_cents(total, accepted)
    assert abs(unit * accepted - total) * 2 <= accepted
    assert unit == half_up(total, accepted)
    with localcontext() as context:
        context.prec = 60
        exact = (Decimal(total) / Decimal(accepted)).quantize(Decimal(1), rounding=ROUND_HALF_UP)
    assert unit == int(exact)


@FIXTURE_SETTINGS
@given(index=st.integers(0, 44), lots=st.integers(1, 50), accepted=st.integers(1, 10**7))
def test_forfait_unit_cost_within_the_stated_rounding(calc, index, lots, accepted):
    text = CARD_ROWS[index]
    result = calc.compute_forfait(calc.load_card(CARD), text["model_id"],
                                  int(text["duration_days"]), lots, accepted)
    total = lots * int(text["lot_price_cents"])
    assert result["total_price_cents"] == total
    assert abs(result["unit_cost_cents"] * accepted - total) * 2 <= accepted
    assert result["unit_cost_cents"] == half_up(total, accepted)


# --- command line ----------------------------------------------------------------------

def test_cli_prints_the_json_fields(calc_script):
    proc = run_cli(calc_script, "--gpu", "b200", "--days", "7", "--lots", "2", "--tariffs", CARD)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert JSON_FIELDS <= set(result)
    assert (result["gpu"], result["days"], result["lots"], result["gpus"]) == ("b200", 7, 2, 4)
    assert result["accepted_results"] is None and result["unit_cost_cents"] is None
    assert "illustrative" in result["notice"] and "reservation" in result["notice"]
    assert proc.stderr == ""


def test_cli_accepted_results_gives_the_unit_cost(calc_script):
    proc = run_cli(calc_script, "--gpu", "B200", "--days", "3", "--accepted-results", "32",
                   "--tariffs", CARD)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["gpu"], result["lots"], result["unit_cost_cents"]) == ("b200", 1, 2471)


def test_cli_list_prints_the_card(calc_script):
    proc = run_cli(calc_script, "--list", "--tariffs", CARD)
    assert proc.returncode == 0, proc.stderr
    for row in CARD_ROWS:
        assert row["model_id"] in proc.stdout
    assert "illustrative, not a quote" in proc.stdout
    assert "1697.07" in proc.stdout  # b200, 7 days


BAD_INVOCATIONS = {
    "unknown model": (["--gpu", "x100", "--days", "7"], ["'x100'", "valid choices", "b200", "h100-sxm"]),
    "unknown duration": (["--gpu", "b200", "--days", "14"], ["14", "expected one of 3, 7, 30"]),
    "non-numeric days": (["--gpu", "b200", "--days", "seven"], ["--days"]),
    "accepted zero": (["--gpu", "b200", "--days", "7", "--accepted-results", "0"], ["--accepted-results", "0 is out of range (1 to"]),
    "accepted negative": (["--gpu", "b200", "--days", "7", "--accepted-results", "-3"], ["--accepted-results"]),
    "accepted non-integer": (["--gpu", "b200", "--days", "7", "--accepted-results", "2.5"], ["--accepted-results", "'2.5'"]),
    "lots zero": (["--gpu", "b200", "--days", "7", "--lots", "0"], ["--lots"]),
    "lots non-integer": (["--gpu", "b200", "--days", "7", "--lots", "1.5"], ["--lots"]),
    "missing days": (["--gpu", "b200"], ["--days", "required"]),
    "unknown flag": (["--gpu", "b200", "--days", "7", "--hours", "5"], ["unrecognized arguments"]),
    "missing card": (["--gpu", "b200", "--days", "7", "--tariffs", "no-such-card.csv"], ["no-such-card.csv"]),
}


@pytest.mark.parametrize("args,needles", BAD_INVOCATIONS.values(), ids=BAD_INVOCATIONS.keys())
def test_bad_invocations_exit_2_on_one_line(calc_script, tmp_path, args, needles):
    if "--tariffs" not in args:
        args = [*args, "--tariffs", CARD]
    assert_one_line_error(run_cli(calc_script, *args, cwd=tmp_path), *needles)


def edited_card(line_number: int, column: str, value: str) -> str:
    """The shipped card with one field of one line (1-based) replaced."""
    lines = list(CARD_LINES)
    fields = lines[line_number - 1].split(",")
    fields[CARD_HEADER.index(column)] = value
    lines[line_number - 1] = ",".join(fields)
    return "\n".join(lines) + "\n"


def _without(line_number: int) -> str:
    return "\n".join(line for n, line in enumerate(CARD_LINES, 1) if n != line_number) + "\n"


BAD_CARDS = {
    "empty file": ("", 1, "empty"),
    "blank lines only": ("\n\n", 1, "empty"),
    "wrong header": ("\n".join([CARD_LINES[0].replace("lot_price_cents", "price"), *CARD_LINES[1:]]),
                     1, "wrong header"),
    "missing header": ("\n".join(CARD_LINES[1:]), 1, "wrong header"),
    "header only": (CARD_LINES[0] + "\n", 1, "no price rows"),
    "duplicate model and days": ("\n".join([*CARD_LINES, CARD_LINES[5]]), 47, "duplicate"),
    "model lacks a duration": (_without(4), 2, "lacks the 30-day"),
    "price with decimals": (edited_card(3, "lot_price_cents", "1697.07"), 3, "lot_price_cents"),
    "price zero": (edited_card(3, "lot_price_cents", "0"), 3, "lot_price_cents"),
    "price negative": (edited_card(10, "lot_price_cents", "-5"), 10, "lot_price_cents"),
    "price empty": (edited_card(10, "lot_price_cents", ""), 10, "lot_price_cents"),
    "gpu count zero": (edited_card(2, "gpus_per_lot", "0"), 2, "gpus_per_lot"),
    "gpu count words": (edited_card(2, "gpus_per_lot", "two"), 2, "gpus_per_lot"),
    "gpu count differs within a model": (edited_card(3, "gpus_per_lot", "4"), 3, "gpus_per_lot"),
    "currency EUR": (edited_card(20, "currency", "EUR"), 20, "currency"),
    "duration not offered": (edited_card(4, "duration_days", "14"), 4, "duration_days"),
    "bad snapshot date": (edited_card(4, "snapshot_date", "24/09/2026"), 4, "snapshot_date"),
    "model id not a slug": (edited_card(5, "model_id", "H200 SXM"), 5, "model_id"),
    "missing field": ("\n".join([*CARD_LINES[:6], CARD_LINES[6].rsplit(",", 1)[0], *CARD_LINES[7:]]),
                      7, "expected 9 fields"),
}


@pytest.mark.parametrize("text,line,needle", BAD_CARDS.values(), ids=BAD_CARDS.keys())
def test_malformed_cards_name_file_and_line(calc, calc_script, tmp_path, text, line, needle):
    card = tmp_path / "bad-card.csv"
    card.write_text(text, encoding="utf-8")
    with pytest.raises(calc.CardError, match=re.escape(f"bad-card.csv, line {line}:")):
        calc.load_card(card)
    proc = run_cli(calc_script, "--gpu", "b200", "--days", "7", "--tariffs", card)
    assert_one_line_error(proc, f"bad-card.csv, line {line}: ", needle)


def test_card_in_another_column_order_and_with_a_bom_loads(calc, tmp_path):
    order = list(reversed(CARD_HEADER))
    card = tmp_path / "reordered.csv"
    with card.open("w", newline="", encoding="utf-8-sig") as handle:
        writer = csv.DictWriter(handle, fieldnames=order)
        writer.writeheader()
        writer.writerows(CARD_ROWS)
    assert calc.load_card(card) == calc.load_card(CARD)


# --- finding the card with no flag -----------------------------------------------------

def test_no_flag_repo_layout_finds_data_card(tmp_path):
    proc = run_cli(LIBRARY, "--gpu", "h100-sxm", "--days", "30", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert not Path(result["tariffs"]).is_absolute()  # shown relative to the current folder
    assert (tmp_path / result["tariffs"]).resolve() == CARD
    assert result["lot_price_cents"] == next(int(r["lot_price_cents"]) for r in CARD_ROWS
                                             if r["model_id"] == "h100-sxm" and r["duration_days"] == "30")


def test_no_flag_kit_layout_finds_card_next_to_script(tmp_path):
    kit, elsewhere = tmp_path / "kit", tmp_path / "elsewhere"
    kit.mkdir()
    elsewhere.mkdir()
    shutil.copy(LIBRARY, kit / "calcul_forfaits.py")
    shutil.copy(CARD, kit / "tarifs-forfaits.csv")
    proc = run_cli(kit / "calcul_forfaits.py", "--gpu", "b200", "--days", "7", "--lots", "2",
                   cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tariffs"] == "../kit/tarifs-forfaits.csv"
    assert result["gpus"] == 4
    assert run_cli(kit / "calcul_forfaits.py", "--list", cwd=elsewhere).returncode == 0


def test_no_flag_and_no_card_anywhere_exits_2(tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(LIBRARY, alone / "calcul_forfaits.py")
    proc = run_cli(alone / "calcul_forfaits.py", "--gpu", "b200", "--days", "7", cwd=tmp_path)
    assert_one_line_error(proc, "no rate card found", "--tariffs")


def test_without_file_the_card_is_found_from_the_notebook_folder(monkeypatch):
    code = notebook_code_upto(NOTEBOOK, "lab_helpers/pricing/card.py")
    namespace = {"__name__": "notebook_kernel"}  # a kernel defines no __file__
    monkeypatch.chdir(ROOT / "notebooks")  # where `make lab` starts the kernel
    exec(compile(code, "notebook-cell", "exec"), namespace)
    assert namespace["default_card_path"]().resolve() == CARD


# --- the module's shape ----------------------------------------------------------------

def test_module_uses_the_standard_library_only():
    tree = ast.parse(LIBRARY.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_module_ends_with_the_main_guard():
    assert LIBRARY.read_text(encoding="utf-8").endswith("\n\n" + MAIN_TRAILER)


def test_help_explains_every_flag(calc_program, capsys):
    with pytest.raises(SystemExit) as exit_info:
        calc_program.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("--gpu", "--days", "3, 7, 30", "--lots", "--accepted-results", "no default",
                   "--tariffs", "--list"):
        assert needle in text, needle


# --- the notebook ----------------------------------------------------------------------

def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(ROOT / NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_notebook_generated_cell_matches_the_module():
    assert sync(check=True, only=[NOTEBOOK]) == []


def test_notebook_parameters_and_labels():
    nb = nbformat.read(ROOT / NOTEBOOK, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    for name in ("GPU = ", "DAYS = ", "LOTS = ", "ACCEPTED_RESULTS = None"):
        assert name in tagged[0].source
    text = "\n".join(c.source for c in nb.cells)
    assert "illustrative, not a quote" in text
    assert "resultats-bruts.csv" in text
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not re.search(r"^\s*(import|from)\s+lab_helpers", code, re.MULTILINE)


# --- readable output and the card as rows ----------------------------------------------

def _price(model: str, days: str) -> int:
    return next(int(r["lot_price_cents"]) for r in CARD_ROWS
                if r["model_id"] == model and r["duration_days"] == days)


def _money(cents: int) -> str:
    return f"{cents // 100:,}.{cents % 100:02d} USD ({cents} cents)"


def test_format_table_is_aligned_money_with_cents(calc_script, tmp_path):
    shutil.copy(CARD, tmp_path / "card.csv")
    proc = run_cli(calc_script, "--gpu", "b200", "--days", "7", "--lots", "2",
                   "--accepted-results", "40", "--tariffs", "card.csv", "--format", "table",
                   cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    total = 2 * _price("b200", "7")
    unit = half_up(total, 40)
    assert proc.stdout.splitlines() == [
        "GPU model               b200 (NVIDIA B200)",
        "forfait                 7 days x 2 lots of 2 GPU = 4 GPUs",
        "memory/GPU (vendor GB)  180",
        f"lot price               {_money(_price('b200', '7'))}",
        f"total price             {_money(total)}",
        "accepted results        40",
        f"unit cost               {_money(unit)} per accepted result",
        "rate card               card.csv (snapshot 2026-09-24)",
        "Assumptions: the whole forfait is paid; no hourly proration; no currency conversion; "
        "unit cost rounded half up to the cent.",
        "Notice: This rate card proves neither availability nor a reservation: confirm both "
        "with the provider before relying on it. Its figures are illustrative, not a quote.",
    ]


def test_format_table_without_accepted_results_says_how_to_get_a_unit_cost(calc_script):
    proc = run_cli(calc_script, "--gpu", "l4", "--days", "30", "--tariffs", CARD,
                   "--format", "table")
    assert proc.returncode == 0, proc.stderr
    assert "unit cost               n/a (give --accepted-results N)" in proc.stdout.splitlines()
    assert "accepted results        n/a" in proc.stdout.splitlines()


def test_list_heads_the_memory_column_with_the_vendor_unit(calc_script):
    proc = run_cli(calc_script, "--list", "--tariffs", CARD)
    header = proc.stdout.splitlines()[1]
    assert header.split("  ")[0] == "model"
    assert "memory/GPU (vendor GB)" in header and "GiB" not in header
    assert CARD_LINES[0].split(",")[3] == "memory_per_gpu_gib"  # the CSV keeps its column name


def test_card_table_gives_every_row_with_its_exact_gpu_day_price(calc):
    table = calc.card_table(calc.load_card(CARD))
    assert len(table) == len(CARD_ROWS)
    for row, text in zip(table, CARD_ROWS):
        assert set(CARD_HEADER) | {"gpu_day_price_usd"} == set(row)
        assert row["model_id"] == text["model_id"]
        cents = Fraction(int(text["lot_price_cents"]),
                         int(text["gpus_per_lot"]) * int(text["duration_days"]))
        assert row["gpu_day_price_usd"] == Decimal(half_up(cents.numerator, cents.denominator)) / 100
    b200_7 = next(r for r in table if (r["model_id"], r["duration_days"]) == ("b200", 7))
    assert b200_7["gpu_day_price_usd"] == Decimal("121.22")  # 169707 / (2 x 7) = 12121.93 cents


def test_gpu_day_price_stays_exact_at_the_price_bound(calc):
    row = {"lot_price_cents": calc.MAX_LOT_PRICE_CENTS - 1, "gpus_per_lot": 1, "duration_days": 3}
    assert calc.gpu_day_price(row) == Decimal("3333333333333.33")


def test_compute_refuses_counts_over_the_bounds(calc):
    rows = calc.load_card(CARD)
    with pytest.raises(calc.ForfaitError, match="lots"):
        calc.compute_forfait(rows, "b200", 7, calc.MAX_LOTS + 1)
    with pytest.raises(calc.ForfaitError, match="accepted_results"):
        calc.compute_forfait(rows, "b200", 7, 1, calc.MAX_ACCEPTED_RESULTS + 1)
    assert calc.compute_forfait(rows, "b200", 7, calc.MAX_LOTS,
                                calc.MAX_ACCEPTED_RESULTS)["lots"] == calc.MAX_LOTS
