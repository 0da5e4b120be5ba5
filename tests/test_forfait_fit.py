"""real_model fit --card: the cheapest forfait of the rate card that fits, exact to the cent."""
import json
import os

import pytest

from conftest import ROOT, load_module
from lab_helpers.pricing.card import load_card
from lab_helpers.real.card_fit import UNCAPPED_BUDGET_BYTES, cheapest_forfaits
from lab_helpers.real.card_tables import format_card_fit
from lab_helpers.real.commands import main
from lab_helpers.real.config import load_config
from lab_helpers.real.budget import MEASURED_NCCL_OUTSIDE
from lab_helpers.real.predict import predict_model
from lab_helpers.real.spec import RunSpec

CARD = ROOT / "data" / "tarifs-forfaits.csv"
H200_USABLE = 149380136960  # lab_helpers.real.budget.MEASURED_USABLE["h200-sxm"], measured on the GPU
QWEN = ["fit", "--card", "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "128", "--new-tokens", "4"]

# qwen1.5-0.5b fits one GPU of every model of the card: degree 1, one lot each; the 7-day lot
# prices of data/tarifs-forfaits.csv, and per accepted result with 2 accepted results, half up.
# (gpu, lot price = total cents, unit cost cents, vendor GB)
QWEN_7_DAYS = [
    ("l4", 6028, 3014, 24), ("a10", 6955, 3478, 24), ("a40", 7573, 3787, 48),
    ("rtx-a6000", 9119, 4560, 48), ("rtx-6000-ada", 13756, 6878, 48), ("l40", 15301, 7651, 48),
    ("l40s", 16847, 8424, 48), ("a100-pcie-40gb", 19938, 9969, 40), ("a100-sxm-80gb", 27666, 13833, 80),
    ("h100-pcie", 38485, 19243, 80), ("mi300x", 41577, 20789, 192), ("h100-nvl", 43122, 21561, 94),
    ("h100-sxm", 46213, 23107, 80), ("h200-sxm", 58578, 29289, 141), ("b200", 169707, 84854, 180),
]
# floor(GB x H200_USABLE / 141), by hand: the budget of a GPU model with no known total (the small cards'
# made-up ids, and the card's rows that data/gpu-memory.json lists under not_found)
DERIVED_BUDGETS = {24: 25426406291, 40: 42377343818, 48: 50852812582, 80: 84754687636,
                   94: 99586757973, 180: 190698047182, 192: 203411250328}
# the device's total (data/gpu-memory.json) less 1374683136 bytes (the H200's 143771 MiB less its
# measured usable memory), by hand
CONTEXT_BYTES = 143771 * 2**20 - H200_USABLE
TOTAL_BUDGETS = {"b200": 190891163648, "h100-sxm": 84146126848, "h100-nvl": 99110354944,
                 "mi300x": 204766969856, "a100-sxm-80gb": 84524662784, "l40s": 46931116032,
                 "a10": 22771924992, "l4": 22778216448}


def run(argv, capsys):
    """(exit status, stdout, stderr) of real_model's main, in this process."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def qwen_result():
    from io import StringIO
    from contextlib import redirect_stdout
    buffer = StringIO()
    with redirect_stdout(buffer):
        status = main(QWEN + ["--days", "7", "--accepted-results", "2"])
    assert status == 0
    return json.loads(buffer.getvalue())


def test_qwen_table_exact_to_the_cent(qwen_result):
    rows = qwen_result["rows"]
    assert [(r["gpu"], r["total_price_cents"], r["unit_cost_cents"], r["memory_per_gpu_gb"]) for r in rows] \
        == QWEN_7_DAYS
    assert qwen_result["cheapest"] == "l4"
    assert all(r["fits"] and r["tensor_parallel"] == 1 and r["lots"] == 1 for r in rows)
    assert [(r["gpu"], r["gpus"], r["idle_gpus"]) for r in rows if r["gpus"] != 1] == [("b200", 2, 1)]
    assert [r["total_price"] for r in rows][:2] == ["60.28", "69.55"]
    assert [r["unit_cost"] for r in rows][:3] == ["30.14", "34.78", "37.87"]
    assert qwen_result["days"] == 7 and qwen_result["accepted_results"] == 2
    assert qwen_result["configuration"] == {"config_name": "qwen1.5-0.5b", "dtype": "bfloat16", "batch": 1,
                                            "context": 128, "new_tokens": 4}


def test_qwen_budgets_measured_or_derived_by_the_stated_rule(qwen_result):
    for row in qwen_result["rows"]:
        if row["gpu"] == "h200-sxm":
            assert (row["memory_source"], row["budget_bytes"]) == ("measured", H200_USABLE)
        else:
            assert row["memory_source"] == "derived, not measured"
            assert row["budget_bytes"] == TOTAL_BUDGETS.get(row["gpu"], DERIVED_BUDGETS[row["memory_per_gpu_gb"]])
            assert f"= {row['budget_bytes']} bytes" in row["memory_basis"]
            if row["gpu"] in TOTAL_BUDGETS:
                assert row["budget_bytes"] == row["cuda_total_bytes"] - CONTEXT_BYTES
            else:
                assert row["cuda_total_bytes"] is None and "no total" in row["memory_basis"]
    # one prediction with no cap: its peak is below every budget, so it answers all 15 GPU models
    assert qwen_result["predictions_run"] == 1


def test_qwen_peaks_are_the_one_gpu_prediction(qwen_result):
    shape = load_config("qwen1.5-0.5b")
    spec = RunSpec("qwen1.5-0.5b", batch=1, context=128, new_tokens=4, decode_record_every=4)
    overall = predict_model(shape, spec)["overall"]
    for row in qwen_result["rows"]:
        assert row["peak_reserved_bytes"] == overall["peak_reserved_bytes"]
        assert row["peak_allocated_bytes"] == overall["peak_allocated_bytes"]
        assert row["headroom_bytes"] == row["budget_bytes"] - overall["peak_reserved_bytes"]


def test_qwen_table_for_people(qwen_result):
    text = format_card_fit(qwen_result)
    lines = text.splitlines()
    assert lines[0] == ("qwen1.5-0.5b bfloat16, batch 1, context 128, 4 new tokens: 7-day forfaits of "
                        "tarifs-forfaits.csv (snapshot 2026-09-24)")
    # within 120 columns: the prices, then (led by rank and gpu again) the memory
    assert max(map(len, lines)) <= 120
    second = next(i for i, line in enumerate(lines) if i > 1 and line.startswith("rank"))
    assert lines[1].split() == ["rank", "gpu", "tensor_parallel", "lots", "gpus", "total_price", "unit_cost"]
    assert lines[second].split() == ["rank", "gpu", "budget", "memory", "peak_reserved"]
    assert lines[2].startswith("1     l4              1                1     1     60.28 USD (6028 cents)")
    # sizes for people: GiB with the exact bytes beside them (the JSON keeps the bytes alone)
    peak = qwen_result["rows"][0]["peak_reserved_bytes"]
    assert "21.21 GiB (22778216448 B)" in lines[second + 1]
    assert lines[second + 1].endswith(f"derived, not measured  {peak / 2**30:.2f} GiB ({peak} B)")
    assert "30.14 USD (3014 cents)" in lines[2]
    assert "Its figures are illustrative, not a quote." in text


CARD_HEADER = ("model_id,display_name,gpus_per_lot,memory_per_gpu_gib,duration_days,lot_price_cents,currency,"
               "snapshot_date,provenance")


def small_card(tmp_path, models):
    """A card with (model_id, gpus_per_lot, GB, 7-day lot price cents) rows; 3 and 30 days priced too."""
    lines = [CARD_HEADER]
    for gpu, per_lot, gb, price in models:
        for days, factor in ((3, 1), (7, 1), (30, 4)):
            lines.append(f"{gpu},GPU {gpu},{per_lot},{gb},{days},{price * factor},USD,2026-09-24,test card")
    path = tmp_path / "card.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return load_card(path)


NCCL = 977272832  # per rank, measured on two H200s at tensor parallel 2 (lab_helpers.real.fit.MEASURED_NCCL_OUTSIDE)


class Predictor:
    """A stand-in for fits_at_degree: fits when degree x rank budget reaches `need` bytes; records
    its calls (the selection logic is tested here; the predictor itself in test_real_model*)."""

    def __init__(self, need):
        self.need, self.calls = need, []

    def __call__(self, degree, budget):
        self.calls.append((degree, budget))
        if degree * budget >= self.need:
            return {"fits": True, "peak_reserved_bytes": -(-self.need // degree), "peak_allocated_bytes": 1}
        return {"fits": False, "reason": f"needs {self.need} bytes"}


def cheapest(rows, predictor, **kwargs):
    # llama-3.1-8b: 32 heads, 8 key/value heads, untied embeddings: degrees 1, 2, 4 and 8 allowed
    shape = load_config("llama-3.1-8b")
    spec = RunSpec("llama-3.1-8b", batch=1, context=8, new_tokens=1)
    return cheapest_forfaits(shape, spec, 7, rows, fits=predictor, **kwargs)


def test_sorted_by_price_then_fewer_gpus_then_model_id(tmp_path):
    # need 1.5 budgets of a 48 GB GPU: degree 2 there (each rank's budget less NCCL's bytes)
    rows = small_card(tmp_path, [("zz", 1, 48, 500), ("aa", 1, 48, 500), ("pair", 2, 48, 1000),
                                 ("mm", 1, 48, 500), ("big", 1, 96, 999), ("cheap", 1, 8, 1)])
    need = DERIVED_BUDGETS[48] * 3 // 2
    result = cheapest(rows, Predictor(need), max_degree=4)
    assert result["allowed_degrees"] == [1, 2, 4] and list(result["refused_degrees"]) == ["3"]
    assert "'num_attention_heads' (32)" in result["refused_degrees"]["3"]
    order = [(r["gpu"], r["tensor_parallel"], r["lots"], r["gpus"], r["total_price_cents"])
             for r in result["rows"] if r["fits"]]
    # aa, mm, zz: 2 lots of 500; pair: 1 lot of 2 GPUs at 1000 (same price, same GPUs: by id);
    # big: one 96 GB GPU at 999; cheap (8 GB) needs 9 GPUs: beyond degree 4
    assert order == [("big", 1, 1, 1, 999), ("aa", 2, 2, 2, 1000), ("mm", 2, 2, 2, 1000),
                     ("pair", 2, 1, 2, 1000), ("zz", 2, 2, 2, 1000)]
    aa = result["rows"][1]
    assert (aa["budget_bytes"], aa["nccl_outside_allocator_bytes"], aa["rank_budget_bytes"]) == (
        DERIVED_BUDGETS[48], NCCL, DERIVED_BUDGETS[48] - NCCL)
    assert aa["headroom_bytes"] == DERIVED_BUDGETS[48] - NCCL - (-(-need // 2))
    assert aa["nccl_source"] == "derived, not measured"
    assert (result["rows"][0]["nccl_outside_allocator_bytes"], result["rows"][0]["idle_gpus"]) == (0, 0)
    last = result["rows"][-1]
    assert (last["gpu"], last["fits"]) == ("cheap", False)
    assert last["reason"] == f"does not fit at any allowed degree (1, 2, 4); at 4: needs {need} bytes"
    assert "total_price_cents" not in last and "tensor_parallel" not in last
    assert result["cheapest"] == "big"


def test_a_lot_of_two_gpus_at_degree_three_or_more(tmp_path):
    # degree 4 on lots of 2 GPUs: 2 lots; on lots of 1: 4 lots
    rows = small_card(tmp_path, [("pair", 2, 48, 300), ("one", 1, 48, 200)])
    result = cheapest(rows, Predictor(DERIVED_BUDGETS[48] * 3))
    assert [(r["gpu"], r["tensor_parallel"], r["lots"], r["gpus"], r["total_price_cents"])
            for r in result["rows"]] == [("pair", 4, 2, 4, 600), ("one", 4, 4, 4, 800)]


def test_ties_prefer_fewer_gpus(tmp_path):
    rows = small_card(tmp_path, [("a-pair", 2, 96, 700), ("b-one", 1, 192, 700)])
    need = DERIVED_BUDGETS[192] // 2 + 1  # one 192 GB GPU, or both 96 GB GPUs of a lot
    result = cheapest(rows, Predictor(need))
    assert [(r["gpu"], r["tensor_parallel"], r["gpus"], r["total_price_cents"]) for r in result["rows"]] == [
        ("b-one", 1, 1, 700), ("a-pair", 2, 2, 700)]


def test_one_prediction_per_degree_and_budget(tmp_path):
    rows = small_card(tmp_path, [("x", 1, 48, 5), ("y", 1, 48, 6), ("z", 2, 48, 7), ("w", 1, 24, 8)])
    predictor = Predictor(2 * (DERIVED_BUDGETS[48] - NCCL))
    result = cheapest(rows, predictor, max_degree=8)
    assert sorted(predictor.calls) == sorted(set(predictor.calls))
    # each degree tried once with no cap; a budget below that run's peak once more. 48 GB (x, y, z):
    # degree 1 below the peak, 2 at or above it; 24 GB (w): 1, 2 and 4 below, 8 at or above
    uncapped = UNCAPPED_BUDGET_BYTES
    assert predictor.calls == [(1, uncapped), (1, DERIVED_BUDGETS[48]), (2, uncapped),
                               (1, DERIVED_BUDGETS[24]), (2, DERIVED_BUDGETS[24] - NCCL),
                               (4, uncapped), (4, DERIVED_BUDGETS[24] - NCCL), (8, uncapped)]
    assert result["predictions_run"] == 8
    assert [(r["gpu"], r["tensor_parallel"], r["lots"]) for r in result["rows"]] == [
        ("z", 2, 1), ("x", 2, 2), ("y", 2, 2), ("w", 8, 8)]  # 7, 10, 12 and 64 cents


def test_nothing_fits(tmp_path):
    rows = small_card(tmp_path, [("x", 1, 48, 5)])
    result = cheapest(rows, Predictor(10**18))
    assert result["cheapest"] is None
    assert [(r["gpu"], r["fits"]) for r in result["rows"]] == [("x", False)]
    assert "does not fit" in format_card_fit(result)


def test_half_up_where_half_even_and_truncation_differ(tmp_path):
    # 7573 / 2 = 3786.5: half up gives 3787 (half-even and truncation would give 3786)
    rows = small_card(tmp_path, [("x", 1, 48, 7573)])
    result = cheapest(rows, Predictor(1), accepted_results=2)
    assert (result["rows"][0]["unit_cost_cents"], result["rows"][0]["unit_cost"]) == (3787, "37.87")
    result = cheapest(rows, Predictor(1), accepted_results=10**15)
    assert result["rows"][0]["unit_cost_cents"] == 0
    result = cheapest(rows, Predictor(1), accepted_results=15146)  # 7573 / 15146 = 0.5 -> 1
    assert result["rows"][0]["unit_cost_cents"] == 1


# --- hostile input: one line on stderr, exit 2, before any prediction --------------------------
HOSTILE = [
    (["--days", "5"], "invalid choice: 5"),
    (["--days", "0"], "invalid choice: 0"),
    (["--days", "31"], "--days"),
    (["--days", "-7"], "--days"),
    (["--days", "seven"], "--days"),
    (["--days", "7", "--accepted-results", "0"], "--accepted-results"),
    (["--days", "7", "--accepted-results", "-1"], "--accepted-results"),
    (["--days", "7", "--accepted-results", "1000000000000001"], "--accepted-results"),
    (["--days", "7", "--accepted-results", "9" * 5000], "--accepted-results"),
    (["--days", "7", "--accepted-results", "1e3"], "--accepted-results"),
    (["--days", "7", "--accepted-results", "٣"], "--accepted-results"),
    (["--days", "7", "--gpu", "h200-sxm"], "give neither --gpu nor --memory-bytes"),
    (["--days", "7", "--memory-bytes", "1000"], "give neither --gpu nor --memory-bytes"),
    (["--days", "7", "--device", "cuda:1"], "leave out --device"),
    ([], "--card needs --days"),
    (["--days", "7", "--tensor-parallel", "2"], "--card finds the tensor-parallel degree itself"),
    (["--days", "7", "--tariffs", ""], "--tariffs: the path is empty"),
    (["--days", "7", "--tariffs", "no-such-card.csv"], "no-such-card.csv: cannot read the rate card"),
]


@pytest.mark.parametrize("extra,message", HOSTILE, ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else None)
def test_hostile_flags(extra, message, capsys):
    status, out, err = run(QWEN + extra, capsys)
    assert status == 2 and out == ""
    assert err.startswith("real_model") and ": error: " in err and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["fit", "--card", "--config", "qwen1.5-0.5b", "--context", "8", "--new-tokens", "1", "--days", "7"],
     "--card needs --batch"),
    (["fit", "--card", "--config", "qwen1.5-0.5b", "--batch", "1", "--new-tokens", "1", "--days", "7"],
     "--card needs --context"),
    (["fit", "--card", "--config", "qwen1.5-0.5b", "--new-tokens", "1"], "--card needs --batch and --context and --days"),
    (["fit", "--config", "qwen1.5-0.5b", "--batch", "1", "--new-tokens", "1", "--days", "7"],
     "--days only go with --card"),
    (["fit", "--config", "qwen1.5-0.5b", "--batch", "1", "--new-tokens", "1", "--accepted-results", "3",
      "--tariffs", "x.csv"], "--accepted-results, --tariffs only go with --card (--tariffs also with --gpu)"),
    (["fit", "--card", "--config", "no-such-model", "--batch", "1", "--context", "8", "--new-tokens", "1",
      "--days", "7"], "neither a file nor a bundled config"),
    (["fit", "--card", "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "8", "--days", "7"],
     "--new-tokens"),
])
def test_hostile_combinations(argv, message, capsys):
    status, out, err = run(argv, capsys)
    assert status == 2 and out == "", err
    assert ": error: " in err and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("content,message", [
    ("", "line 1: file is empty"),
    (CARD_HEADER + "\n", "no price rows"),
    (CARD_HEADER + "\nx,X,1,48,7,100,USD,2026-09-24,p\n", "lacks the 3, 30-day forfait"),
    (CARD_HEADER + "\nx,X,1,48,7,-100,USD,2026-09-24,p\n", "lot_price_cents"),
    ("\x00\x01binary", "binary data"),
])
def test_broken_rate_card(tmp_path, content, message, capsys):
    path = tmp_path / "card.csv"
    path.write_text(content, encoding="utf-8")
    status, out, err = run(QWEN + ["--days", "7", "--tariffs", str(path)], capsys)
    assert status == 2 and out == ""
    assert err.startswith("real_model: error: ") and message in err, err
    assert err.count("\n") == 1


def test_a_folder_is_no_rate_card(tmp_path, capsys):
    status, out, err = run(QWEN + ["--days", "7", "--tariffs", str(tmp_path)], capsys)
    assert status == 2 and out == "" and "is a folder" in err and err.count("\n") == 1


def test_help_names_the_card_flags(capsys):
    status, out, _ = run(["fit", "--help"], capsys)
    assert status == 0
    for flag in ("--card", "--days", "--accepted-results", "--tariffs"):
        assert flag in out


def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "card.csv"
    os.mkfifo(fifo)
    status, out, err = run(QWEN + ["--days", "7", "--tariffs", str(fifo)], capsys)
    assert status == 2 and out == "" and "not a regular file" in err and err.count("\n") == 1


def test_the_notebook_copy_gives_the_same_answer(tmp_path, monkeypatch):
    # the forfaits notebook's generated cells, up to card_tables', run as one module
    from lab_helpers.build.sync import notebook_code_upto
    code = notebook_code_upto("notebooks/forfaits.ipynb", "lab_helpers/real/card_tables.py")
    path = tmp_path / "forfaits_cells.py"
    path.write_text(code, encoding="utf-8")
    monkeypatch.chdir(ROOT / "notebooks")  # where the kernel runs: the copy reads ../data/gpu-memory.json
    cells = load_module(path)
    rows = small_card(tmp_path, [("pair", 2, 48, 300), ("one", 1, 48, 200), ("tiny", 1, 8, 1)])
    shape = load_config("llama-3.1-8b")
    spec = RunSpec("llama-3.1-8b", batch=1, context=8, new_tokens=1)
    library = cheapest_forfaits(shape, spec, 7, rows, 3, fits=Predictor(DERIVED_BUDGETS[48] * 3))
    # (the copy's bundled configs are looked up next to its file: the shape is the library's; the run is
    # the copy's own RunSpec, built from the same values)
    copy_spec = cells.RunSpec("llama-3.1-8b", batch=1, context=8, new_tokens=1)
    notebook = cells.cheapest_forfaits(shape, copy_spec, 7, rows, 3, fits=Predictor(DERIVED_BUDGETS[48] * 3))
    assert notebook == library
    assert cells.format_card_fit(notebook) == format_card_fit(library)


def test_nccl_bytes_measured_on_the_h200_at_two(tmp_path):
    assert MEASURED_NCCL_OUTSIDE[("h200-sxm", 2)][0] == NCCL
    rows = small_card(tmp_path, [("h200-sxm", 1, 141, 900), ("h100-sxm", 1, 80, 400)])
    # more than one H200 holds: both need 2 GPUs
    result = cheapest(rows, Predictor(H200_USABLE + 1))
    by_gpu = {r["gpu"]: r for r in result["rows"]}
    assert (by_gpu["h200-sxm"]["tensor_parallel"], by_gpu["h200-sxm"]["nccl_source"],
            by_gpu["h200-sxm"]["rank_budget_bytes"]) == (2, "measured", H200_USABLE - NCCL)
    assert (by_gpu["h100-sxm"]["tensor_parallel"], by_gpu["h100-sxm"]["nccl_source"],
            by_gpu["h100-sxm"]["rank_budget_bytes"]) == (2, "derived, not measured",
                                                         TOTAL_BUDGETS["h100-sxm"] - NCCL)


def test_the_old_forfait_fit_command_runs_the_card_fit_and_says_where_it_lives(capsys, qwen_result):
    from lab_helpers.real.card_commands import MOVED_NOTE, main as forfait_fit_main
    status = forfait_fit_main(QWEN[2:] + ["--days", "7", "--accepted-results", "2"])
    out, err = capsys.readouterr()
    assert status == 0 and json.loads(out) == qwen_result
    assert err == MOVED_NOTE + "\n"


def test_the_old_forfait_fit_command_refuses_in_one_line(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.forfait_fit", "--config", "gpt2", "--batch", "1",
                           "--context", "8", "--new-tokens", "2", "--days", "9"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "real_model: error: argument --days: invalid choice: 9 (choose from 3, 7, 30)\n"
