"""real_model's answers say why: a negative size is out of range (not a typing error), a GPU not on the
card points to the flags that answer it anyway."""
import json

import pytest

from lab_helpers.core.errors import LabError
from test_real_model import run_main
from lab_helpers.real.fit import gpu_budget_entry




@pytest.mark.parametrize("flag,value,said", [
    ("--context", "-5", "argument --context: must be > 0, got -5"),
    ("--batch", "-1", "argument --batch: must be > 0, got -1"),
    ("--new-tokens", "-64", "argument --new-tokens: must be > 0, got -64"),
    ("--tensor-parallel", "-2", "argument --tensor-parallel: must be > 0, got -2"),
    ("--memory-bytes", "-8", "argument --memory-bytes: must be > 0, got -8"),
    ("--context", "-0", "argument --context: not an integer: '-0'"),  # no sign is accepted, and -0 is 0
    ("--context", "-", "argument --context: not an integer: '-'"),
])
def test_a_negative_size_is_out_of_range(capsys, flag, value, said):
    argv = {"--config": "qwen1.5-0.5b", "--batch": "1", "--context": "8", "--new-tokens": "1",
            "--memory-bytes": "1000000000", flag: value}
    code, out, err = run_main(capsys, "fit", *[x for kv in argv.items() for x in kv])
    assert code == 2 and out == "" and len(err) == 1
    assert said in err[0], err[0]


def test_an_unknown_gpu_names_the_choices_then_the_other_ways():
    with pytest.raises(LabError) as caught:
        gpu_budget_entry("h9000")
    text = str(caught.value)
    # a library caller reads the parameters' names; the command line their flags (below)
    assert text.startswith("unknown gpu 'h9000'; valid choices: a10, a100-pcie-40gb, ")
    assert text.endswith("; or give the budget with memory_bytes N, or a rate card that has it with tariffs PATH")


OWN_CARD = ("model_id,display_name,gpus_per_lot,memory_per_gpu_gib,duration_days,lot_price_cents,currency,"
            "snapshot_date,provenance\n" + "".join(
                f"my-gpu,My GPU,1,48,{days},1000,USD,2026-12-01,quoted to me\n" for days in (3, 7, 30)))


@pytest.mark.parametrize("command", ["fit", "predict"])
def test_a_gpu_model_of_ones_own_card_is_read_with_tariffs(tmp_path, capsys, command):
    card = tmp_path / "card.csv"
    card.write_text(OWN_CARD)
    run = ["--config", "qwen1.5-0.5b", "--batch", "1", "--context", "64", "--new-tokens", "2", "--gpu", "my-gpu"]
    code, out, err = run_main(capsys, command, *run, "--tariffs", card)
    assert code == 0, err
    # a GPU model the lab never measured: floor(48 x 149380136960 / 141), derived, not measured
    answer = json.loads(out)
    assert (answer["budget_bytes"] if command == "fit" else answer["budget"]["bytes"]) == 50852812582
    code, out, err = run_main(capsys, command, *run)
    assert code == 2 and out == "" and err[0].startswith("real_model: error: unknown --gpu 'my-gpu'"), err
    code, out, err = run_main(capsys, command, *run[:-2], "--tariffs", card)
    assert code == 2 and "--tariffs" in err[0] and "--gpu" in err[0], err


def table_of(capsys, *argv):
    code, out, err = run_main(capsys, *argv, "--format", "table")
    assert code in (0, 3), err
    return out.splitlines()


def test_fit_names_the_bound_of_each_largest_size(capsys):
    code, out, err = run_main(capsys, "fit", "--config", "qwen1.5-0.5b", "--gpu", "h100-sxm", "--batch", 1,
                              "--context", 128, "--new-tokens", 4)
    import json
    result = json.loads(out)
    # qwen1.5-0.5b has 32768 positions: at batch 1 its context is theirs, not the memory's
    assert (result["largest_context_at_batch"], result["largest_context_bound"], result["context_bound"]) == (
        32764, "positions", 32764)
    assert result["largest_batch_bound"] in ("memory", "size limit") and result["weights_fit"] is True
    lines = table_of(capsys, "fit", "--config", "qwen1.5-0.5b", "--gpu", "h100-sxm", "--batch", 1, "--context", 128,
                     "--new-tokens", 4)
    assert max(map(len, lines)) <= 120
    assert ("largest context at batch 1: 32764 (bound: positions: 32764 = the model's positions less 4 new "
            "tokens, not memory)") in lines
    assert "weights fit: yes" in lines


def test_weights_beyond_the_budget_are_said_with_their_bytes(capsys):
    import json
    code, out, _ = run_main(capsys, "fit", "--config", "qwen1.5-0.5b", "--memory-bytes", 2**20, "--batch", 1,
                            "--context", 128, "--new-tokens", 4)
    result = json.loads(out)
    assert result["weights_fit"] is False and result["fits"] is False
    assert (result["largest_context_at_batch"], result["largest_context_bound"]) == (0, "weights")
    assert (result["largest_batch_at_context"], result["largest_batch_bound"]) == (0, "weights")
    weights = result["weights_bytes"]
    assert result["reason"] == f"the weights alone, {weights} bytes, exceed the budget of {2**20} bytes"
    lines = table_of(capsys, "fit", "--config", "qwen1.5-0.5b", "--memory-bytes", 2**20, "--batch", 1,
                     "--context", 128, "--new-tokens", 4)
    assert f"the weights alone, {weights / 2**20:.2f} MiB ({weights} B), exceed the budget" in lines
    assert "largest context at batch 1: 0 (bound: the weights alone exceed the budget)" in lines


def test_predict_and_compare_tables_fit_120_columns(capsys, tmp_path):
    lines = table_of(capsys, "predict", "--config", "qwen1.5-0.5b", "--batch", 2, "--context", 64, "--new-tokens", 2,
                     "--gpu", "h100-sxm")
    assert max(map(len, lines)) <= 120 and any("GiB (" in line or "MiB (" in line for line in lines)


def test_bitsandbytes_leaves_the_3d_experts_in_the_compute_dtype(tmp_path):
    """transformers 5.17.0's replace_with_bnb_linear swaps `type(module) is nn.Linear` only: a Mixtral's
    experts (3-D parameters of MixtralExperts), its router, embeddings, norms and output head stay in
    bfloat16, counted by hand for a tiny Mixtral (2 layers, 4 experts, hidden 64, intermediate 128)."""
    pytest.importorskip("bitsandbytes")
    import json
    from dataclasses import replace

    from lab_helpers.real.config import load_config
    from lab_helpers.real.kept_weights import kept_parameters
    raw = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    path = tmp_path / "mixtral-tiny.json"
    path.write_text(json.dumps(raw))
    kept = kept_parameters(replace(load_config(str(path)), quantization="nf4"), "bfloat16")
    experts = 2 * 4 * (2 * 128 * 64 + 64 * 128) * 2  # layers x experts x (gate_up + down) x 2 bytes
    assert kept == {"quantized_parameters": 8,  # q, k, v and o of 2 layers
                    "kept_bytes": experts + 2 * 1000 * 64 * 2 + 2 * 4 * 64 * 2 + 5 * 64 * 2,
                    "kept": [{"module_class": "MixtralExperts", "tensor_dims": 3, "tensors": 4, "bytes": experts},
                             {"module_class": "Embedding", "tensor_dims": 2, "tensors": 1, "bytes": 128000},
                             {"module_class": "Linear", "tensor_dims": 2, "tensors": 1, "bytes": 128000},
                             {"module_class": "MixtralTopKRouter", "tensor_dims": 2, "tensors": 2, "bytes": 1024},
                             {"module_class": "MixtralRMSNorm", "tensor_dims": 1, "tensors": 5, "bytes": 640}]}
    assert kept["kept_bytes"] == 650880


TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096}


def test_training_tables_fit_120_columns(capsys, tmp_path):
    import json
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    for argv in (["predict", "--task", "train", "--config", config, "--batch", 2, "--context", 16],
                 ["fit", "--task", "train", "--config", config, "--batch", 2, "--context", 16,
                  "--memory-bytes", 2**30]):
        lines = table_of(capsys, *argv)
        assert max(map(len, lines)) <= 120, [line for line in lines if len(line) > 120]


def test_fit_task_train_names_its_bounds(capsys, tmp_path):
    import json
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    code, out, _ = run_main(capsys, "fit", "--task", "train", "--config", config, "--batch", 2, "--context", 16,
                            "--memory-bytes", 2**30)
    result = json.loads(out)
    assert (result["largest_context_at_batch"], result["largest_context_bound"]) == (2442, "memory")
    # the batch search reaches its 24 predictions first: a lower bound, said so
    assert (result["largest_batch_at_context"], result["largest_batch_bound"]) == (2551, "search bound")
    lines = table_of(capsys, "fit", "--task", "train", "--config", config, "--batch", 2, "--context", 16,
                     "--memory-bytes", 2**30)
    assert "largest context at batch 2: 2442 (bound: memory)" in lines
    assert "largest batch at context 16: 2551 (bound: search bound)" in lines


def test_the_card_table_says_what_bounds_each_gpu_model_that_does_not_fit():
    from conftest import ROOT
    from lab_helpers.pricing.card import load_card
    from lab_helpers.real.card_fit import cheapest_forfaits
    from lab_helpers.real.card_tables import format_card_fit
    from lab_helpers.real.config import parse_config
    from lab_helpers.real.spec import RunSpec
    tiny = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128}
    rows = load_card(ROOT / "data" / "tarifs-forfaits.csv")
    small = 30 * 2**30  # the card's 24 GB models are below it

    def fits(degree, budget):
        if budget < small:
            return {"fits": False, "reason": "out of memory in the replayed allocator: 7 more bytes needed"}
        return {"fits": True, "peak_reserved_bytes": small, "peak_allocated_bytes": small // 2}
    result = cheapest_forfaits(parse_config(tiny, "tiny"), RunSpec("tiny", batch=1, context=8, new_tokens=2), 7,
                               rows, fits=fits, max_degree=1)
    table = format_card_fit(result)
    lines, words = table.splitlines(), " ".join(table.split())  # a long line wraps at 120 columns
    refused = sorted(row["gpu"] for row in result["rows"] if not row["fits"])
    assert refused == ["a10", "l4"]
    for gpu in refused:
        assert (f"Not fitting, {gpu}: does not fit at any allowed degree (1); at 1: out of memory in the replayed "
                f"allocator: 7 more bytes needed.") in words
    assert max(map(len, lines)) <= 120
