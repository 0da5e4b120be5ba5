"""The results grid: the shipped header-only file, `check` and `report`."""
import csv
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from lab_helpers.pricing.card import load_card
from lab_helpers.pricing.grid import GRID_COLUMNS, GridError, grid_report, load_grid, model_costs, row_costs
from lab_helpers.pricing.grid_commands import main

ROOT = Path(__file__).resolve().parent.parent
GRID = ROOT / "data" / "resultats-bruts.csv"
CARD = ROOT / "data" / "tarifs-forfaits.csv"
PROTOCOL = ROOT / "data" / "protocole-qualite.md"
EXPECTED_HEADER = ["date", "gpu_model", "forfait_days", "forfait_lots", "device", "torch_version",
                   "measurement_file", "task", "acceptance_threshold", "units_produced",
                   "units_accepted", "wall_seconds", "notes"]
HEADER = ",".join(EXPECTED_HEADER)
THRESHOLD = "all fields exact"
# One pass per line, as a user would fill them; the expected cents are computed below
# from the card parsed independently.
PASSES = [
    "2026-10-01,b200,7,2,NVIDIA B200,2.9.0,mesures-b200.json,invoices,all fields exact,1200,1000,5400.5,",
    "2026-10-02,h100-sxm,7,1,NVIDIA H100 80GB HBM3,2.9.0,,invoices,all fields exact,700,600,7200,",
    "2026-10-03,h100-sxm,3,1,NVIDIA H100 80GB HBM3,2.9.0,,invoices,all fields exact,10,0,100,stopped",
    "2026-10-04,b200,3,1,NVIDIA B200,2.9.0,,invoices,all fields exact,40,32,900,",
]


def lot_price(model: str, days: int) -> int:
    """The card's lot price, read with the csv module only."""
    with CARD.open(newline="", encoding="utf-8") as handle:
        return next(int(r["lot_price_cents"]) for r in csv.DictReader(handle)
                    if r["model_id"] == model and int(r["duration_days"]) == days)


def half_up(numerator: int, denominator: int) -> int:
    return int(Fraction(numerator, denominator) + Fraction(1, 2))


def write_grid(tmp_path: Path, lines, name="grid.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_main(capsys, *args):
    status = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return status, out, err


# --- the shipped grid ------------------------------------------------------------------

def test_shipped_grid_is_the_header_only():
    lines = GRID.read_text(encoding="utf-8").splitlines()
    assert lines == [HEADER]
    assert list(GRID_COLUMNS) == EXPECTED_HEADER


def test_protocol_documents_every_grid_column():
    text = PROTOCOL.read_text(encoding="utf-8")
    for column in EXPECTED_HEADER:
        assert f"`{column}`" in text, column
    assert "--accepted-results" in text


def test_check_and_report_on_the_shipped_grid(capsys):
    status, out, err = run_main(capsys, "check", GRID)
    assert (status, err) == (0, "")
    assert "0 rows" in out
    status, out, err = run_main(capsys, "report", GRID)
    assert (status, err) == (0, "")
    assert "nothing to report" in out


# --- a filled grid ---------------------------------------------------------------------

def test_row_and_model_costs_to_the_cent(tmp_path):
    card = load_card(CARD)
    rows = load_grid(write_grid(tmp_path, [HEADER, *PASSES]), card)
    assert [row["line"] for row in rows] == [2, 3, 4, 5]
    costs = row_costs(rows, card)
    b200_7, h100_7, h100_3, b200_3 = (lot_price("b200", 7), lot_price("h100-sxm", 7),
                                      lot_price("h100-sxm", 3), lot_price("b200", 3))
    assert [c["total_price_cents"] for c in costs] == [2 * b200_7, h100_7, h100_3, b200_3]
    assert [c["gpus"] for c in costs] == [4, 1, 1, 2]
    assert [c["unit_cost_cents"] for c in costs] == [
        half_up(2 * b200_7, 1000), half_up(h100_7, 600), None, half_up(b200_3, 32)]
    assert costs[3]["unit_cost_cents"] == 2471  # 79056 / 32 = 2470.5: half up
    summary = {s["gpu_model"]: s for s in model_costs(costs)}
    assert summary["h100-sxm"]["passes"] == 2
    assert summary["h100-sxm"]["total_price_cents"] == h100_7 + h100_3
    assert summary["h100-sxm"]["unit_cost_cents"] == half_up(h100_7 + h100_3, 600)
    assert summary["b200"]["unit_cost_cents"] == half_up(2 * b200_7 + b200_3, 1032)
    assert summary["h100-sxm"]["seconds_per_accepted_unit"] == round(7300 / 600, 2)


def test_check_then_report_from_the_command_line(tmp_path):
    path = write_grid(tmp_path, [HEADER, *PASSES])
    # main(argv) in this process; `python -m lab_helpers.grid` check and report as fresh processes are
    # test_commands' closed-pipe rows
    from conftest import run_main_in_process
    checked = run_main_in_process(main, ["check", str(path)], ROOT)
    assert checked.returncode == 0 and "Traceback" not in checked.stderr, checked.stderr
    assert "4 rows" in checked.stdout
    reported = run_main_in_process(main, ["report", str(path), "--tariffs", str(CARD)], ROOT)
    assert reported.returncode == 0 and "Traceback" not in reported.stderr, reported.stderr
    out = reported.stdout
    for needle in (str(2 * lot_price("b200", 7)), str(half_up(2 * lot_price("b200", 7), 1000)),
                   "2471", "24.71", "n/a", "ROUND_HALF_UP", "illustrative, not a quote"):
        assert needle in out, needle


def test_report_uses_the_card_given(tmp_path, capsys):
    text = CARD.read_text(encoding="utf-8")
    cheaper = text.replace(f",3,{lot_price('b200', 3)},", ",3,64000,")
    assert cheaper != text
    card = tmp_path / "quoted.csv"
    card.write_text(cheaper, encoding="utf-8")
    path = write_grid(tmp_path, [HEADER, PASSES[3]])
    status, out, err = run_main(capsys, "report", path, "--tariffs", card)
    assert (status, err) == (0, "")
    assert "64000" in out and " 2000 " in out and "20.00" in out  # 64000 / 32


# --- faults ----------------------------------------------------------------------------

def _pass(**changes) -> str:
    """The first pass with some columns changed."""
    fields = dict(zip(EXPECTED_HEADER, PASSES[0].split(",")))
    fields.update(changes)
    return ",".join(fields[column] for column in EXPECTED_HEADER)


BAD_GRIDS = {
    "accepted above produced": ([HEADER, _pass(units_accepted="1201")], 2, "exceeds units_produced"),
    "unknown model": ([HEADER, PASSES[1], _pass(gpu_model="x100")], 3, "unknown GPU model"),
    "unknown duration": ([HEADER, _pass(forfait_days="14")], 2, "valid durations"),
    "threshold missing": ([HEADER, _pass(acceptance_threshold="")], 2, "acceptance_threshold is empty"),
    "two thresholds for one task": ([HEADER, PASSES[0], _pass(acceptance_threshold="most fields")],
                                    3, "threshold"),
    "units not whole": ([HEADER, _pass(units_produced="12.5")], 2, "units_produced"),
    "accepted negative": ([HEADER, _pass(units_accepted="-1")], 2, "units_accepted"),
    "lots zero": ([HEADER, _pass(forfait_lots="0")], 2, "forfait_lots"),
    "bad date": ([HEADER, _pass(date="01/10/2026")], 2, "date"),
    "wall seconds negative": ([HEADER, _pass(wall_seconds="-3")], 2, "wall_seconds"),
    "wall seconds text": ([HEADER, _pass(wall_seconds="long")], 2, "wall_seconds"),
    "device missing": ([HEADER, _pass(device="")], 2, "device is empty"),
    "missing field": ([HEADER, PASSES[0].rsplit(",", 1)[0]], 2, "expected 13 fields"),
    "wrong header": ([HEADER.replace("wall_seconds", "wall_time"), PASSES[0]], 1, "wrong header"),
    "empty file": ([""], 1, "empty"),
}


@pytest.mark.parametrize("lines,line,needle", BAD_GRIDS.values(), ids=BAD_GRIDS.keys())
@pytest.mark.parametrize("command", ["check", "report"])
def test_grid_faults_exit_2_naming_file_and_line(tmp_path, capsys, command, lines, line, needle):
    path = write_grid(tmp_path, lines, name="bad-grid.csv")
    status, out, err = run_main(capsys, command, path)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("grid: error: ") and f"bad-grid.csv, line {line}: " in err
    assert needle in err


def test_grid_fault_from_the_command_line_has_no_traceback(tmp_path):
    path = write_grid(tmp_path, [HEADER, _pass(units_accepted="5000")], name="bad-grid.csv")
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.grid", "check", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "bad-grid.csv, line 2" in proc.stderr


def test_grid_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["summarise", str(GRID)])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


# --- grid_report: the checked path the notebook takes ----------------------------------

def test_grid_report_checks_then_returns_rows_and_models(tmp_path):
    path = write_grid(tmp_path, [HEADER, *PASSES])
    report = grid_report(path, CARD)
    card = load_card(CARD)
    costs = row_costs(load_grid(path, card), card)
    assert report["rows"] == costs
    assert report["models"] == model_costs(costs)
    assert (report["grid"], report["tariffs"], report["currency"]) == (str(path), str(CARD), "USD")
    assert "ROUND_HALF_UP" in report["rounding"] and "illustrative" in report["notice"]


def test_grid_report_refuses_a_bad_grid(tmp_path):
    path = write_grid(tmp_path, [HEADER, _pass(units_accepted="1_000")], name="bad-grid.csv")
    with pytest.raises(GridError, match=r"bad-grid.csv, line 2: units_accepted"):
        grid_report(path, CARD)


def test_grid_report_default_card_is_shown_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_grid(tmp_path, [HEADER, PASSES[1]])
    report = grid_report("grid.csv")
    assert not Path(report["tariffs"]).is_absolute()
    assert (tmp_path / report["tariffs"]).resolve() == CARD


def test_report_json_for_programs(tmp_path, capsys):
    path = write_grid(tmp_path, [HEADER, *PASSES])
    status, out, err = run_main(capsys, "report", path, "--tariffs", CARD, "--format", "json")
    assert (status, err) == (0, "")
    report = json.loads(out)
    assert [row["line"] for row in report["rows"]] == [2, 3, 4, 5]
    assert report["rows"][3]["unit_cost_cents"] == 2471
    assert report["rows"][0]["wall_seconds"] == 5400.5
    assert report["rows"][2]["unit_cost_cents"] is None
    h100 = next(m for m in report["models"] if m["gpu_model"] == "h100-sxm")
    assert h100["total_price_cents"] == lot_price("h100-sxm", 7) + lot_price("h100-sxm", 3)


def test_check_line_names_the_card_as_given(tmp_path, capsys):
    path = write_grid(tmp_path, [HEADER, *PASSES])
    status, out, _ = run_main(capsys, "check", path, "--tariffs", CARD)
    assert status == 0
    assert out == f"{path}: 4 rows (all valid; rate card {CARD})\n"
