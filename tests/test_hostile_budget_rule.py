"""The one budget rule (lab_helpers.real.budget) and the bad budgets every command refuses.

`fit --gpu X` and the X row of `fit --card` give the same bytes for every card row and degree; no budget
exceeds the device's total memory; a bad data/gpu-memory.json, a --memory-bytes that is not a whole
number of bytes or is above 2^50, and a sweep --budget-gib that is not whole bytes or above 2^50 all end
in one line and exit 2, with nothing created."""
import json
import os

import pytest

from conftest import ROOT, run_main_in_process
from lab_helpers.pricing.card import RATE_CARD_PATH, load_card
from lab_helpers.real import budget as budget_rule
from lab_helpers.real.budget import (DERIVED, MEASURED, MEASURED_USABLE, GpuMemoryError, device_budget,
                                     nccl_outside, read_gpu_memory)
from lab_helpers.real.card_fit import cheapest_forfaits
from lab_helpers.real.commands import main as real_main
from lab_helpers.real.config import load_config
from lab_helpers.real.fit import gpu_budget
from lab_helpers.real.spec import RunSpec
from lab_helpers.views.sweep_commands import main as sweep_main

H200_USABLE = 149380136960
CONTEXT_BYTES = 143771 * 2**20 - H200_USABLE  # 1374683136: the H200's total less its measured usable
NCCL = 977272832
# every card GPU model's one-GPU budget, by hand: the measured H200; total - CONTEXT_BYTES where
# data/gpu-memory.json has a cited total; floor(G x H200_USABLE / 141) where it has none
EXPECTED = {
    "h200-sxm": (149380136960, MEASURED, 150754820096),
    "b200": (183359 * 2**20 - CONTEXT_BYTES, DERIVED, 183359 * 2**20),
    "h100-sxm": (81559 * 2**20 - CONTEXT_BYTES, DERIVED, 81559 * 2**20),
    "h100-nvl": (95830 * 2**20 - CONTEXT_BYTES, DERIVED, 95830 * 2**20),
    "mi300x": (201310208 * 1024 - CONTEXT_BYTES, DERIVED, 201310208 * 1024),
    "a100-sxm-80gb": (81920 * 2**20 - CONTEXT_BYTES, DERIVED, 81920 * 2**20),
    "l40s": (46068 * 2**20 - CONTEXT_BYTES, DERIVED, 46068 * 2**20),
    "a10": (23028 * 2**20 - CONTEXT_BYTES, DERIVED, 23028 * 2**20),
    "l4": (23034 * 2**20 - CONTEXT_BYTES, DERIVED, 23034 * 2**20),
    "h100-pcie": (80 * H200_USABLE // 141, DERIVED, None),
    "a100-pcie-40gb": (40 * H200_USABLE // 141, DERIVED, None),
    "l40": (48 * H200_USABLE // 141, DERIVED, None),
    "rtx-6000-ada": (48 * H200_USABLE // 141, DERIVED, None),
    "rtx-a6000": (48 * H200_USABLE // 141, DERIVED, None),
    "a40": (48 * H200_USABLE // 141, DERIVED, None),
}
# a config every degree 1..8 splits evenly (840 = lcm(1..8)): the card allows them all
EVERY_DEGREE = {"model_type": "llama", "hidden_size": 6720, "intermediate_size": 1680, "num_attention_heads": 840,
                "num_key_value_heads": 840, "num_hidden_layers": 1, "vocab_size": 1680,
                "max_position_embeddings": 4096, "tie_word_embeddings": False}
TINY_TP = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 4096,
           "tie_word_embeddings": False}


def card_models():
    rows = load_card(RATE_CARD_PATH)
    return {row["model_id"]: row for row in rows if row["duration_days"] == 7}


def test_every_card_model_has_its_budget_by_hand():
    models = card_models()
    assert sorted(models) == sorted(EXPECTED)
    for gpu, row in models.items():
        entry = device_budget(gpu, row["memory_per_gpu_gib"])
        assert (entry["budget_bytes"], entry["memory_source"], entry["cuda_total_bytes"]) == EXPECTED[gpu], gpu
    # the two figures issue 18 named: the L4 and the B200 are now below what their runtime reports
    assert EXPECTED["l4"][0] == 22778216448 < 23034 * 2**20
    assert EXPECTED["b200"][0] == 190891163648


class OnlyAt:
    """fits_at_degree's stand-in: fits at `degree` only (peak 1 byte), recording the budgets asked."""

    def __init__(self, degree):
        self.degree, self.calls = degree, []

    def __call__(self, degree, budget):
        self.calls.append((degree, budget))
        if degree == self.degree:
            return {"fits": True, "peak_reserved_bytes": 1, "peak_allocated_bytes": 1}
        return {"fits": False, "reason": "not this degree"}


def test_fit_gpu_and_the_card_row_agree_for_every_model_and_degree(tmp_path):
    config = tmp_path / "every-degree.json"
    config.write_text(json.dumps(EVERY_DEGREE), encoding="utf-8")
    shape = load_config(str(config))
    spec = RunSpec(shape.name, batch=1, context=8, new_tokens=1)
    rows = load_card(RATE_CARD_PATH)
    seen = 0
    for degree in range(1, 9):
        result = cheapest_forfaits(shape, spec, 7, rows, fits=OnlyAt(degree))
        assert result["allowed_degrees"] == list(range(1, 9))
        for row in result["rows"]:
            assert row["tensor_parallel"] == degree
            by_gpu, source = gpu_budget(row["gpu"], tensor_parallel=degree)
            assert by_gpu == row["rank_budget_bytes"], (row["gpu"], degree)
            assert row["budget_bytes"] == EXPECTED[row["gpu"]][0]
            nccl = 0 if degree == 1 else NCCL  # measured on the H200 at 2, derived elsewhere: the same bytes
            assert row["rank_budget_bytes"] == EXPECTED[row["gpu"]][0] - nccl
            label = MEASURED if (row["gpu"], degree) == ("h200-sxm", 2) else DERIVED
            assert degree == 1 or (row["nccl_source"] == label and label in source)
            total = EXPECTED[row["gpu"]][2]
            assert total is None or row["rank_budget_bytes"] <= row["budget_bytes"] < total
            seen += 1
    assert seen == 8 * 15


def test_fit_gpu_on_the_command_line_reports_the_card_rows_bytes(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_TP), encoding="utf-8")
    for gpu, degree in (("b200", 2), ("l4", 1), ("h200-sxm", 2), ("a40", 4)):
        proc = run_main_in_process(real_main, ["fit", "--config", str(config), "--batch", "1", "--context", "8",
                                               "--new-tokens", "1", "--gpu", gpu, "--tensor-parallel", str(degree)],
                                   cwd)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout)
        assert result["budget_bytes"] == EXPECTED[gpu][0] - (NCCL if degree > 1 else 0)
        assert result["memory_source"] == EXPECTED[gpu][1]
        assert result["budget_source"].startswith(EXPECTED[gpu][1])
    assert os.listdir(cwd) == []


def test_nccl_is_measured_where_measured_and_derived_elsewhere():
    assert nccl_outside("h200-sxm", 2)["nccl_source"] == MEASURED
    for gpu, degree in (("h200-sxm", 4), ("l4", 2), (None, 8)):
        entry = nccl_outside(gpu, degree)
        assert (entry["nccl_outside_allocator_bytes"], entry["nccl_source"]) == (NCCL, DERIVED)
        assert entry["nccl_basis"].startswith(DERIVED)
    assert nccl_outside("l4", 1)["nccl_outside_allocator_bytes"] == 0


def test_the_shipped_file_cites_every_total_and_names_the_models_it_could_not():
    document = json.loads((ROOT / "data" / "gpu-memory.json").read_text(encoding="utf-8"))
    models = card_models()
    assert sorted([*document["totals"], *document["not_found"]]) == sorted(models)
    for gpu, record in document["totals"].items():
        assert record["url"].startswith("https://") or gpu in MEASURED_USABLE
        assert str(record["total"]) in record["source_says"]
    assert read_gpu_memory() is read_gpu_memory()  # validated once


# ---------------------------------------------------------------- a bad data/gpu-memory.json
GOOD = json.loads((ROOT / "data" / "gpu-memory.json").read_text(encoding="utf-8"))


def edited(edit):
    document = json.loads(json.dumps(GOOD))
    edit(document)
    return json.dumps(document)


def set_total(gpu, **fields):
    return lambda d: d["totals"][gpu].update(fields)


BAD_FILES = [
    # (id, content, fragment of the one line)
    ("not-json", "{", "not valid JSON"),
    ("a-list", "[]", "not a JSON object"),
    ("empty", "", "not valid JSON"),
    ("nan", edited(set_total("l4", total=1)).replace('"total": 1,', '"total": NaN,'), "NaN"),
    ("not-utf8", b"\xff\xfe{}", "not UTF-8"),
    ("deep", "[" * 200 + "]" * 200, "nested deeper"),
    ("no-totals", edited(lambda d: d.pop("totals")), "missing totals"),
    ("unknown-key", edited(lambda d: d.update(extra=1)), "unknown key 'extra'"),
    ("totals-a-list", edited(lambda d: d.update(totals=[])), "totals must be an object"),
    ("no-h200", edited(lambda d: d["totals"].pop("h200-sxm")), "totals has no h200-sxm"),
    ("total-text", edited(set_total("l4", total="23034")), "totals.l4.total must be a whole number"),
    ("total-decimal", edited(set_total("l4", total=23034.5)), "totals.l4.total must be a whole number"),
    ("total-bool", edited(set_total("l4", total=True)), "totals.l4.total must be a whole number"),
    ("total-zero", edited(set_total("l4", total=0)), "totals.l4.total must be a whole number"),
    ("total-negative", edited(set_total("l4", total=-1)), "totals.l4.total must be a whole number"),
    ("total-above-2-50", edited(set_total("l4", total=2**30 + 1)), "totals.l4.total must be a whole number"),
    ("total-4300-digits", edited(set_total("l4", total=1)).replace('"total": 1,', '"total": ' + "9" * 4300 + ","),
     "totals.l4.total"),
    ("unit-gb", edited(set_total("l4", unit="GB")), "totals.l4.unit must be one of MiB, KiB"),
    ("no-url", edited(lambda d: d["totals"]["l4"].pop("url")), "totals.l4: missing url"),
    ("empty-citation", edited(set_total("l4", source_says=" ")), "totals.l4.source_says must be a non-empty"),
    ("extra-field", edited(set_total("l4", guess=1)), "totals.l4: unknown 'guess'"),
    ("key-not-a-model-id", edited(lambda d: d["totals"].update({"H100 SXM": d["totals"]["l4"]})),
     "not a rate-card model_id"),
    ("both-lists", edited(lambda d: d["not_found"].update({"l4": "twice"})), "l4 is both in totals and in not_found"),
    ("below-the-context", edited(set_total("l4", total=1)), "totals.l4 (1048576 bytes) is not above the 1374683136"),
    ("h200-below-its-usable", edited(set_total("h200-sxm", total=142000)), "below the 149380136960 bytes measured"),
    ("too-large", "{" + " " * (300 * 1024) + "}", "bytes"),
]


@pytest.mark.parametrize("content, expected", [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_a_bad_gpu_memory_file_is_one_line_and_exit_2(tmp_path, monkeypatch, content, expected):
    path = tmp_path / "gpu-memory.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(GpuMemoryError) as caught:
        read_gpu_memory(path)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    # the commands read the default file: put the bad one there, the cache emptied
    monkeypatch.setattr(budget_rule, "GPU_MEMORY_PATH", path)
    monkeypatch.setattr(budget_rule, "_READ", {})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for argv in (["fit", "--config", "qwen1.5-0.5b", "--batch", "1", "--new-tokens", "1", "--gpu", "l4"],
                 ["fit", "--card", "--config", "qwen1.5-0.5b", "--batch", "1", "--context", "8", "--new-tokens", "1",
                  "--days", "7"]):
        proc = run_main_in_process(real_main, argv, cwd)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-2000:]
        assert lines[0].startswith("real_model: error: data/gpu-memory.json") and expected in lines[0]
        assert str(tmp_path) not in lines[0] and "Traceback" not in proc.stderr
    assert os.listdir(cwd) == []


def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, expected in ((fifo, "not a regular file"), (tmp_path, "it is a folder"),
                           (tmp_path / "absent.json", "no such file")):
        with pytest.raises(GpuMemoryError, match=expected):
            read_gpu_memory(path)


# ---------------------------------------------------------------- --memory-bytes and --budget-gib
BAD_MEMORY_BYTES = [
    ("decimal", "1.5", "not an integer"), ("exponent", "1e9", "not an integer"), ("zero", "0", "must be > 0"),
    ("negative", "-1", "must be > 0, got -1"), ("above-2-50", str(2**50 + 1), f"must be at most {2**50}"),
    ("far-above", "9" * 60, "must be at most"), ("4300-digits", "9" * 4300, "at most 1000 digits"),
    ("empty", "", "not an integer"), ("space", " 1", "not an integer"), ("underscore", "1_000", "not an integer"),
    ("hex", "0x10", "not an integer"), ("arabic-indic", "\u0661\u0662", "not an integer"),
    ("fullwidth", "\uff11", "not an integer"), ("unit", "80GB", "not an integer"),
]


@pytest.mark.parametrize("value, expected", [c[1:] for c in BAD_MEMORY_BYTES], ids=[c[0] for c in BAD_MEMORY_BYTES])
def test_fit_refuses_a_budget_that_is_not_whole_bytes_up_to_2_50(tmp_path, value, expected):
    proc = run_main_in_process(real_main, ["fit", "--config", "qwen1.5-0.5b", "--batch", "1", "--new-tokens", "1",
                                           "--memory-bytes", value], tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-2000:]
    assert lines[0].startswith("real_model: error: argument --memory-bytes") and expected in lines[0]
    assert os.listdir(tmp_path) == []


BAD_BUDGET_GIB = [
    ("a-tenth", "0.1", "budget must be a whole number of bytes, got 0.1 GiB = 107374182.4 bytes"),
    ("a-thousandth", "0.001", "whole number of bytes"),
    ("above-2-50", "1048576.5", "budget must be at most 1125899906842624 bytes"),
    ("far-above", "9" * 60, "budget must be at most 1125899906842624 bytes"),
]


@pytest.mark.parametrize("value, expected", [c[1:] for c in BAD_BUDGET_GIB], ids=[c[0] for c in BAD_BUDGET_GIB])
def test_sweep_refuses_a_budget_that_is_not_whole_bytes_up_to_2_50(tmp_path, value, expected):
    out = tmp_path / "out"
    proc = run_main_in_process(sweep_main, ["--dimension", "batch", "--values", "1", "--budget-gib", value,
                                            "--output-dir", str(out)], tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-2000:]
    assert lines[0].startswith("sweep: error: ") and expected in lines[0]
    assert os.listdir(tmp_path) == []


def test_sweep_takes_2_50_bytes_and_whole_fractions_of_a_gib():
    from lab_helpers.views.sweep import MAX_BUDGET_BYTES
    assert MAX_BUDGET_BYTES == 2**50
    # 1048576 GiB = 2^50 bytes and 2^-30 GiB = one byte pass the request's checks (refused only later, for
    # want of a GPU: the request is checked first)
    from lab_helpers.core.errors import LabError
    from lab_helpers.views import sweep
    for gib in (1048576, 0.5, 2.0**-30):
        try:
            sweep.run_sweep("batch", "/nonexistent/out", values=[1], budget_gib=gib, progress=False,
                            measure_command=["false"])
        except LabError as exc:
            assert "budget" not in str(exc), (gib, str(exc))
