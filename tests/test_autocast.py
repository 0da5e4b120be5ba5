"""bfloat16 autocast reproduced on meta (lab_helpers.real.autocast): the casts CUDA's autocast made
on the H200, op for op (tests/h200_autocast_calls.json, recorded by tests/test_gpu_autocast.py),
the cache of trained weights' copies, the regions transformers and checkpointing open, and the
patches undone afterwards."""
import contextlib
import gc
import json
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from autocast_cases import CASES, aten_calls  # noqa: E402
from lab_helpers.core.tables import format_bytes  # noqa: E402
from lab_helpers.real.autocast import MetaAutocast, installed, policy_of  # noqa: E402
from lab_helpers.real.train_tables import train_fit_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H200 = json.loads((ROOT / "tests" / "h200_autocast_calls.json").read_text())


def meta_region(mode=None):
    mode = mode or MetaAutocast()
    stack = contextlib.ExitStack()
    stack.enter_context(installed(mode))
    stack.enter_context(mode.region(True))
    return stack


def test_every_case_was_measured():
    assert set(H200["cases"]) == set(CASES)
    assert "torch 2.11.0+cu130" in H200["measured"]


@pytest.mark.parametrize("case", list(CASES))
def test_meta_autocast_dispatches_what_the_h200_dispatched(case):
    assert aten_calls(case, "meta", meta_region()) == H200["cases"][case]


def test_the_pinned_calls_say_what_the_policy_is():
    """What the H200 showed, in words: a linear casts bias, weight, then input; a frozen weight is
    cast at each use; cat mixes dtypes without a cast; softmax of bfloat16 gives float32."""
    cases = H200["cases"]
    assert cases["linear"][:3] == ["_to_copy -> bfloat16"] * 3
    assert cases["linear weight used twice"].count("_to_copy -> bfloat16") == 3  # input twice, weight once
    assert cases["cat mixed"] == ["cat -> float32", "result -> float32"]
    assert cases["softmax"][-1] == "result -> float32"
    assert cases["silu"] == ["silu -> bfloat16", "result -> bfloat16"]


def test_a_trained_weight_is_cast_once_and_its_copy_dropped_when_the_region_exits():
    mode = MetaAutocast()
    weight = torch.nn.Parameter(torch.empty(16, 8, device="meta"))
    frozen = torch.empty(16, 8, device="meta")
    x = torch.empty(4, 8, device="meta")
    with installed(mode), mode.region(True):
        first = torch.nn.functional.linear(x, weight)
        torch.nn.functional.linear(x, weight)
        torch.nn.functional.linear(x, frozen)
        assert list(mode.cache) == [id(weight)]  # the frozen weight is never cached
        copy = weakref.ref(mode.cache[id(weight)][1])
        assert first.dtype is torch.bfloat16 and copy().dtype is torch.bfloat16
    assert mode.cache == {} and mode.nesting == 0 and not mode.enabled
    del first
    gc.collect()
    assert copy() is None  # nothing else held it: no product saved it (no grad was needed)


def test_a_nested_region_keeps_the_cache_until_the_outermost_exits():
    mode = MetaAutocast()
    weight = torch.nn.Parameter(torch.empty(16, 8, device="meta"))
    with installed(mode), mode.region(True):
        with mode.region(True):
            torch.nn.functional.linear(torch.empty(4, 8, device="meta"), weight)
        assert id(weight) in mode.cache
    assert mode.cache == {}


def test_transformers_maybe_autocast_disabled_region_runs_in_float32():
    from transformers.models.llama import modeling_llama
    original = modeling_llama.maybe_autocast
    x, w = torch.empty(4, 8, device="meta"), torch.empty(16, 8, device="meta")
    mode = MetaAutocast()
    with installed(mode), mode.region(True):
        assert modeling_llama.maybe_autocast is not original
        with modeling_llama.maybe_autocast(device_type="meta", enabled=False):
            assert torch.nn.functional.linear(x, w).dtype is torch.float32
        assert torch.nn.functional.linear(x, w).dtype is torch.bfloat16
    assert modeling_llama.maybe_autocast is original


def test_patches_are_undone_even_when_the_region_raises():
    import torch.utils.checkpoint as checkpoint
    before = (torch.amp.autocast, torch.amp.is_autocast_available, checkpoint._get_autocast_kwargs)
    mode = MetaAutocast()
    with pytest.raises(RuntimeError, match="inside"):
        with installed(mode), mode.region(True):
            raise RuntimeError("inside")
    assert (torch.amp.autocast, torch.amp.is_autocast_available, checkpoint._get_autocast_kwargs) == before
    assert not torch.amp.is_autocast_available("meta")
    assert torch.nn.functional.linear(torch.empty(2, 2, device="meta"),
                                      torch.empty(2, 2, device="meta")).dtype is torch.float32


def test_checkpointing_recomputes_under_the_forwards_autocast():
    """The recomputation in backward casts as the forward did (else checkpoint finds saved tensors of
    another dtype and raises); loss.backward() is called with no region open, as users do."""
    from torch.utils.checkpoint import checkpoint
    weight = torch.nn.Parameter(torch.empty(8, 8, device="meta"))
    x = torch.empty(2, 8, device="meta", requires_grad=True)
    seen = []

    def layer(h):
        out = torch.nn.functional.linear(h, weight)
        seen.append(out.dtype)
        return out.float().pow(2).sum()

    forward = MetaAutocast()
    with installed(forward), forward.region(True):
        loss = checkpoint(layer, x, use_reentrant=False)  # transformers' default
    with installed(MetaAutocast()):
        loss.backward()
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert weight.grad.dtype is torch.float32 and x.grad.dtype is torch.float32


def test_policy_names():
    assert policy_of(torch.nn.functional.linear) == "lower"
    assert policy_of(torch.Tensor.__matmul__) == "lower"
    assert policy_of(torch.rsqrt) == "float32"
    assert policy_of(torch.Tensor.sum) == "float32_dtype"
    assert policy_of(torch.addcmul) == "promote"
    assert policy_of(torch.cat) is None and policy_of(torch.Tensor.pow_) is None  # in place: no list


def test_a_training_prediction_under_autocast_holds_the_weight_copies_after_forward():
    """Two layers of a tiny Llama, float32 weights: under autocast the forward ends holding more (the
    bfloat16 copies its products saved) and backward ends where it ends without autocast (float32
    gradients only); the prediction says it ran under autocast."""
    from lab_helpers.real.config import parse_config
    from lab_helpers.real.train import AUTOCAST_NOTE, TrainSpec, predict_training_model
    raw = json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text())
    raw.update(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000)
    raw.pop("head_dim", None)
    shape = parse_config(raw, "tiny-llama")
    runs = {}
    for autocast in (None, "bfloat16"):
        spec = TrainSpec(shape.name, dtype="float32", batch=1, context=16, steps=2, autocast=autocast)
        runs[autocast] = predict_training_model(shape, spec)
    plain, mixed = ({(p["phase"], p["index"]): p for p in runs[k]["phases"]} for k in (None, "bfloat16"))
    layer_weights = 2 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 512) + 1000 * 256  # q,o; k,v; mlp; lm_head
    copies = mixed[("forward", 0)]["end_allocated_bytes_by_kind"]["activations"]
    assert copies >= layer_weights * 2 > plain[("forward", 0)]["end_allocated_bytes_by_kind"]["activations"]
    assert mixed[("backward", 1)]["end_allocated_bytes"] == plain[("backward", 1)]["end_allocated_bytes"]
    assert runs["bfloat16"]["configuration"]["autocast"] == "bfloat16"
    assert "autocast" not in runs[None]["configuration"]
    assert AUTOCAST_NOTE in runs["bfloat16"]["notes"]
    from lab_helpers.real.train_tables import train_prediction_table
    # the title wraps at 120 columns: read as one line of words
    assert "full fine-tuning, adamw (foreach), bfloat16 autocast" in " ".join(train_prediction_table(runs["bfloat16"]).split())
    assert "autocast" not in train_prediction_table(runs[None]).splitlines()[0]


def _tiny_llama():
    from lab_helpers.real.config import parse_config
    raw = json.loads((ROOT / "data" / "models" / "llama-3.1-8b.json").read_text())
    raw.update(num_hidden_layers=1, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000)
    raw.pop("head_dim", None)
    return raw, parse_config(raw, "tiny-llama")


def test_fit_task_train_under_autocast_finds_a_batch_that_fits_whose_next_does_not(tmp_path, capsys):
    """The budget is the autocast run's own peak at batch 4: that batch fits, and the search's answer
    is a batch that fits whose next does not; the answer and its table name the autocast."""
    from dataclasses import replace

    from lab_helpers.allocator.budget import OutOfMemory
    from lab_helpers.real.train import TrainSpec, predict_training_model
    from lab_helpers.real.train_fit import fit_training
    from lab_helpers.real_model import main
    raw, shape = _tiny_llama()
    spec = TrainSpec(shape.name, dtype="float32", batch=4, context=16, steps=2, autocast="bfloat16")
    budget = predict_training_model(shape, spec)["overall"]["peak_reserved_bytes"]

    def fits(batch):
        try:
            predict_training_model(shape, replace(spec, batch=batch), budget)
        except OutOfMemory:
            return False
        return True

    result = fit_training(shape, spec, budget, "test", context=16)
    largest = result["largest_batch_at_context"]
    assert result["autocast"] == "bfloat16" and fits(4)
    assert largest >= 1 and fits(largest) and not fits(largest + 1)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(raw))
    code = main(["fit", "--task", "train", "--config", str(config), "--dtype", "float32", "--autocast", "bfloat16",
                 "--context", "16", "--memory-bytes", str(budget), "--format", "table"])
    out = capsys.readouterr().out
    assert code == 0 and "training: full fine-tuning, adamw, bfloat16 autocast" in out
    assert f"largest batch at context 16: {largest}" in out
    assert out.startswith(f"budget: {format_bytes(budget)} (given with --memory-bytes)\n"), out
    peak = budget - 2**21  # the formatter's own test: a point 2 MiB under the budget
    point = {**result, "batch": 4, "fits": True, "peak_reserved_bytes": peak, "headroom_bytes": budget - peak}
    assert (f"batch 4 x context 16: fits, peak reserved {format_bytes(peak)}, headroom {format_bytes(budget - peak)}"
            in train_fit_table(point).splitlines())
