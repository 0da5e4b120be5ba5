"""real_model fit --card --task train: for every GPU model of the rate card, does one GPU hold the
fine-tuning run, and at what price; exact to the byte and the cent on a small card around the run's peak."""
import json

import pytest

from conftest import run_main_in_process
from lab_helpers.allocator.budget import OutOfMemory
from lab_helpers.pricing.card import load_card
from lab_helpers.real.card_fit import UNCAPPED_BUDGET_BYTES
from lab_helpers.real.commands import main
from lab_helpers.real.config import load_config
from lab_helpers.real.train import TrainSpec, predict_training_model
from lab_helpers.real.train_card import NOT_ON_ONE_GPU, cheapest_training_forfaits, training_fits
from lab_helpers.real.train_tables import format_train_card

pytest.importorskip("transformers")

H200_USABLE = 149380136960  # lab_helpers.real.budget.MEASURED_USABLE["h200-sxm"]
# floor(GiB x H200_USABLE / 141), by hand: the budget of a GPU model with no known total
BUDGETS = {2: 2118867190, 3: 3178300786, 4: 4237734381}
CARD_HEADER = ("model_id,display_name,gpus_per_lot,memory_per_gpu_gib,duration_days,lot_price_cents,currency,"
               "snapshot_date,provenance")
# (model_id, gpus per lot, GiB, 7-day lot price in cents): 2 GiB is below the run's peak allocated, 3 GiB
# between it and its peak reserved with no cap, 4 GiB above that
MODELS = [("small", 1, 2, 1000), ("mid", 1, 3, 1500), ("pair", 2, 4, 1500), ("big", 1, 4, 2000)]
BATCH, CONTEXT = 2, 384


def write_card(folder, models=MODELS):
    lines = [CARD_HEADER]
    for gpu, per_lot, gib, price in models:
        for days, factor in ((3, 1), (7, 1), (30, 4)):
            lines.append(f"{gpu},GPU {gpu},{per_lot},{gib},{days},{price * factor},USD,2026-09-24,test card")
    path = folder / "card.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two layers of qwen1.5-0.5b as a config file, and the small card, in a folder of their own."""
    from pathlib import Path
    folder = tmp_path_factory.mktemp("train-card")
    raw = json.loads((Path(__file__).resolve().parent.parent / "data/models/qwen1.5-0.5b.json").read_text())
    raw["num_hidden_layers"] = 2
    config = folder / "qwen-2-layers.json"
    config.write_text(json.dumps(raw), encoding="utf-8")
    return config, write_card(folder)


@pytest.fixture(scope="module")
def run(files):
    """(shape, spec, the run's overall peaks with no cap, its peaks capped at 3 GiB's budget)."""
    shape = load_config(str(files[0]))
    spec = TrainSpec(shape.name, batch=BATCH, context=CONTEXT, steps=2)
    free = predict_training_model(shape, spec)["overall"]
    capped = predict_training_model(shape, spec, BUDGETS[3])["overall"]
    return shape, spec, free, capped


@pytest.fixture(scope="module")
def answer(files, run):
    shape, spec, _, _ = run
    return cheapest_training_forfaits(shape, spec, 7, load_card(files[1]), accepted_results=3,
                                      card_name=str(files[1]))


def test_the_card_straddles_the_run(run):
    _, _, free, capped = run
    assert BUDGETS == {g: g * H200_USABLE // 141 for g in BUDGETS}
    # 2 GiB cannot hold what is allocated; 3 GiB is below the peak reserved with no cap, yet the capped
    # replay fits by releasing cached segments; 4 GiB holds the run as it runs with no cap
    assert BUDGETS[2] < free["peak_allocated_bytes"] < BUDGETS[3] < free["peak_reserved_bytes"] <= BUDGETS[4]
    assert capped["peak_reserved_bytes"] <= BUDGETS[3] < free["peak_reserved_bytes"]
    assert capped["peak_allocated_bytes"] == free["peak_allocated_bytes"]


def test_rows_exact_to_the_byte_and_cent(answer, run):
    _, _, free, capped = run
    rows = answer["rows"]
    # mid and pair cost 1500 cents: fewer GPUs first; small fits no GPU: last
    assert [(r["gpu"], r["fits"], r.get("tensor_parallel"), r.get("lots"), r.get("gpus"), r.get("idle_gpus"),
             r.get("total_price_cents"), r.get("unit_cost_cents")) for r in rows] == [
        ("mid", True, 1, 1, 1, 0, 1500, 500), ("pair", True, 1, 1, 2, 1, 1500, 500),
        ("big", True, 1, 1, 1, 0, 2000, 667), ("small", False, None, None, None, None, None, None)]
    assert [(r["gpu"], r["budget_bytes"], r["memory_source"], r["memory_per_gpu_gb"]) for r in rows] == [
        ("mid", BUDGETS[3], "derived, not measured", 3), ("pair", BUDGETS[4], "derived, not measured", 4),
        ("big", BUDGETS[4], "derived, not measured", 4), ("small", BUDGETS[2], "derived, not measured", 2)]
    mid, pair, big, small = rows
    assert (mid["peak_reserved_bytes"], mid["peak_allocated_bytes"]) == (capped["peak_reserved_bytes"],
                                                                         capped["peak_allocated_bytes"])
    for row in (pair, big):
        assert (row["peak_reserved_bytes"], row["peak_allocated_bytes"]) == (free["peak_reserved_bytes"],
                                                                             free["peak_allocated_bytes"])
    for row in (mid, pair, big):
        assert (row["nccl_outside_allocator_bytes"], row["rank_budget_bytes"]) == (0, row["budget_bytes"])
        assert row["headroom_bytes"] == row["budget_bytes"] - row["peak_reserved_bytes"]
    assert [r["total_price"] for r in rows[:3]] == ["15.00", "15.00", "20.00"]
    assert [r["unit_cost"] for r in rows[:3]] == ["5.00", "5.00", "6.67"]  # 2000 / 3 = 666.67: half up
    assert small["reason"].startswith(NOT_ON_ONE_GPU + "; out of memory in ")
    assert "total_price_cents" not in small and "peak_reserved_bytes" not in small
    assert answer["cheapest"] == "mid" and answer["allowed_degrees"] == [1]
    assert "tensor-parallel training is out of scope" in answer["degree_rule"]
    # one run with no cap, then one capped run for each budget below its peak reserved (small, mid); then
    # small, cheaper than the cheapest fit, asked with gradient checkpointing (no cap, then capped): no fit
    assert answer["predictions_run"] == 5 and "with_gradient_checkpointing" not in answer
    assert answer["configuration"] == {"config_name": "qwen-2-layers", "task": "train", "dtype": "bfloat16",
                                       "batch": BATCH, "context": CONTEXT, "steps": 2, "optimizer": "adamw",
                                       "fused": False, "train": "full", "gradient_checkpointing": False}
    assert (answer["days"], answer["accepted_results"], answer["currency"]) == (7, 3, "USD")
    assert "illustrative" not in answer["notice"]


def test_the_shortcut_gives_the_rows_of_every_row_capped(files, run, answer):
    shape, spec, _, _ = run
    capped_runs = []
    real = training_fits(shape, spec)

    def every_row_capped(degree, budget):
        if budget == UNCAPPED_BUDGET_BYTES:  # no run with no cap to answer from: each budget runs capped
            return {"fits": False, "reason": "not run"}
        capped_runs.append(budget)
        return real(degree, budget)
    slow = cheapest_training_forfaits(shape, spec, 7, load_card(files[1]), accepted_results=3,
                                      fits=every_row_capped, card_name=str(files[1]))
    assert sorted(capped_runs) == sorted(BUDGETS.values())  # 4 GiB once: pair and big share the budget
    assert slow["rows"] == answer["rows"]
    assert {k: v for k, v in slow.items() if k != "predictions_run"} == {
        k: v for k, v in answer.items() if k != "predictions_run"}
    # and each row against predict_training_model capped at its budget, outside the card code
    for row in answer["rows"]:
        try:
            overall = predict_training_model(shape, spec, row["budget_bytes"])["overall"]
        except OutOfMemory:
            assert not row["fits"], row["gpu"]
            continue
        assert (row["fits"], row["peak_reserved_bytes"], row["peak_allocated_bytes"]) == (
            True, overall["peak_reserved_bytes"], overall["peak_allocated_bytes"])


def card_argv(files, *extra):
    return ["fit", "--card", "--task", "train", "--config", str(files[0]), "--batch", str(BATCH), "--context",
            str(CONTEXT), "--days", "7", "--tariffs", str(files[1]), *extra]


def test_json_output_is_the_library_answer(files, answer, tmp_path):
    done = run_main_in_process(main, card_argv(files, "--accepted-results", "3"), tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(done.stdout) == answer
    assert list(tmp_path.iterdir()) == []


def test_table_output(files, answer, tmp_path):
    done = run_main_in_process(main, card_argv(files, "--format", "table"), tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == format_train_card({**answer, "accepted_results": None}) + "\n"
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= 120  # one screen: the title folds, the columns split in two tables
    header = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    title = " ".join(line.strip() for line in lines[:header])
    assert title == (f"qwen-2-layers bfloat16, batch {BATCH}, context {CONTEXT}, full fine-tuning, adamw: "
                     f"7-day forfaits of {files[1]} (snapshot 2026-09-24)")
    second = next(i for i, line in enumerate(lines) if i > header and line.startswith("rank"))
    assert lines[header].split() + lines[second].split()[2:] == [
        "rank", "gpu", "tensor_parallel", "lots", "gpus", "total_price", "budget", "memory", "peak_reserved"]
    fitting = answer["rows"][0]
    first, later = lines[header + 1], lines[second + 1]
    assert f"GiB ({fitting['budget_bytes']} B)" in later  # the memory table: budget, memory, peak reserved
    assert later.endswith(f"GiB ({fitting['peak_reserved_bytes']} B)") and later.split()[:2] == ["1", "mid"]
    assert first.split()[:6] == ["1", "mid", "1", "1", "1", "15.00"]
    assert lines[header + 3].split()[:2] == ["3", "big"]
    assert lines[header + 4].split()[:3] == ["-", "small", "-"] and "does not fit" in lines[header + 4]
    assert any(line.startswith("Degrees: degree 1 only: tensor-parallel training is out of scope")
               for line in lines)
    assert lines[-2].startswith("Notice: This rate card proves neither availability nor a reservation")
    with_unit = format_train_card(answer).splitlines()
    assert "unit_cost" in next(line for line in with_unit if line.startswith("rank")).split() and any(line.startswith("Per accepted result (3)")
                                                       for line in with_unit)


def test_qlora_is_priced_on_one_gpu_as_fit_task_train_predicts_it(files, tmp_path):
    pytest.importorskip("peft")
    shape = load_config(str(files[0]))
    spec = TrainSpec(shape.name, batch=1, context=16, steps=2, train="qlora", quantize="nf4", lora_rank=4)
    overall = predict_training_model(shape, spec)["overall"]
    done = run_main_in_process(main, ["fit", "--card", "--task", "train", "--config", str(files[0]), "--batch", "1",
                                      "--context", "16", "--train", "qlora", "--quantize", "nf4", "--lora-rank", "4",
                                      "--days", "3", "--tariffs", str(files[1])], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["configuration"]["quantize"] == "nf4" and result["configuration"]["lora_rank"] == 4
    assert [(r["gpu"], r["total_price_cents"], r["peak_reserved_bytes"]) for r in result["rows"]] == [
        ("small", 1000, overall["peak_reserved_bytes"]), ("mid", 1500, overall["peak_reserved_bytes"]),
        ("pair", 1500, overall["peak_reserved_bytes"]), ("big", 2000, overall["peak_reserved_bytes"])]
    assert result["predictions_run"] == 1
    assert "qlora fine-tuning on the nf4 base" in format_train_card(result).splitlines()[0]


# --- what the card cannot answer: one line on stderr, exit 2, nothing on stdout or on disk ---------
REFUSED = [
    (["--tensor-parallel", "2"], "tensor-parallel training is out of scope"),
    (["--gpu", "l4"], "give neither --gpu nor --memory-bytes"),
    (["--memory-bytes", "1000000000"], "give neither --gpu nor --memory-bytes"),
    (["--device", "cuda:0"], "leave out --device"),
    (["--days", "5"], "invalid choice: 5"),
    (["--accepted-results", "0"], "--accepted-results"),
    (["--tariffs", ""], "--tariffs: the path is empty"),
    (["--tariffs", "no-such-card.csv"], "no-such-card.csv: cannot read the rate card"),
    (["--new-tokens", "4"], "--new-tokens is for inference"),
    (["--autocast", "bfloat16"], "--autocast bfloat16 keeps float32 master weights: give --dtype float32"),
    (["--train", "qlora", "--lora-rank", "4"], "--train qlora needs --quantize"),
    (["--train", "lora"], "--lora-rank must be a whole number"),
    (["--train", "lora", "--lora-rank", "4", "--lora-targets", "nope"], "--lora-targets nope: no such linear layer"),
    (["--quantize", "nf4"], "--quantize with --train full"),
    (["--allocator-conf", "expandable_segments:True"], "under the default allocator only"),
]


@pytest.mark.parametrize("extra,message", REFUSED, ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else None)
def test_refused_in_one_line(files, tmp_path, extra, message):
    argv = card_argv(files)
    for flag in ("--days", "--tariffs"):  # a flag given in `extra` replaces the default one
        if flag in extra:
            at = argv.index(flag)
            del argv[at:at + 2]
    done = run_main_in_process(main, argv + extra, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("real_model: error: ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("drop,message", [
    ("--batch", "--card needs --batch"), ("--context", "--card needs --context"), ("--days", "--card needs --days"),
])
def test_the_card_needs_a_point_and_a_duration(files, tmp_path, drop, message):
    argv = card_argv(files)
    at = argv.index(drop)
    del argv[at:at + 2]
    done = run_main_in_process(main, argv, tmp_path)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done
    assert done.stderr.startswith("real_model: error: ") and message in done.stderr, done.stderr


def test_card_flags_without_card_are_refused(files, tmp_path):
    done = run_main_in_process(main, ["fit", "--task", "train", "--config", str(files[0]), "--batch", "1",
                                      "--context", "8", "--memory-bytes", "1000000000", "--days", "7"], tmp_path)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done
    assert "--days only go with --card" in done.stderr
