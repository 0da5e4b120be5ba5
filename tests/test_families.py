"""Every family transformers builds, predicted on the meta device: tiny odd-sized configs (uneven
heads, head_dim unlike hidden / heads, odd vocabularies, windows shorter than the context), the
bundled shapes, the refusals of what cannot be traced or known, and mixtures of experts whose
allocations must not depend on the routing."""
import json

import pytest

from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.real.commands import main
from lab_helpers.real.config import (SLIDING_WINDOW_TENSOR_BYTES, ConfigError, bundled_names, load_config,
                                     parse_config)
from lab_helpers.real.predict import load_for_prediction, predict_model
from lab_helpers.real.protocol import run_protocol
from lab_helpers.real.spec import RunSpec

torch = pytest.importorskip("torch")

# ids out of these tiny vocabularies are dropped: transformers' defaults name a real model's
NO_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
BASE = dict(hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2,
            num_hidden_layers=3, vocab_size=1001, head_dim=20, **NO_IDS)
WINDOW = 7
FAMILIES = {
    "qwen3": dict(BASE, model_type="qwen3"),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=40),
    "qwen2_moe": dict(BASE, model_type="qwen2_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=40,
                      shared_expert_intermediate_size=56),
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(BASE, model_type="gemma2", sliding_window=WINDOW, query_pre_attn_scalar=20),
    "gemma3_text": dict(BASE, model_type="gemma3_text", sliding_window=WINDOW, sliding_window_pattern=3,
                        query_pre_attn_scalar=20, num_hidden_layers=4),
    "phi3": dict({k: v for k, v in BASE.items() if k != "head_dim"}, model_type="phi3", num_key_value_heads=3,
                 sliding_window=WINDOW),
    "gpt2": dict(model_type="gpt2", n_embd=90, n_layer=3, n_head=6, vocab_size=1001, n_positions=64, **NO_IDS),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=96, intermediate_size=136, num_attention_heads=6,
                     num_hidden_layers=3, vocab_size=1001, rotary_pct=0.25, **NO_IDS),
    "olmo2": dict(BASE, model_type="olmo2"),
    "mistral-sliding": dict(BASE, model_type="mistral", sliding_window=WINDOW),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=96, intermediate_size=136, moe_intermediate_size=40,
                        num_attention_heads=6, num_key_value_heads=6, num_hidden_layers=3, vocab_size=1001,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=14,
                        **NO_IDS),
}
# GPT-2 ignores the Llama-style keys: its MLP is n_inner (4 x n_embd) wide, its cache holds every head
FAMILIES["gpt2-llama-keys"] = dict(FAMILIES["gpt2"], intermediate_size=128, num_key_value_heads=2)
# past every tiny window: the sliding layers crop during the prefill and every decode step
SPEC = dict(batch=2, context=11, new_tokens=3)


def shape_of(family):
    return parse_config(FAMILIES[family], family)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`, each as the caching allocator rounds it."""
    seen = {}
    for t in tensors:
        if t is not None and t.device.type == "meta" and t.untyped_storage().nbytes():
            seen[t.untyped_storage()._cdata] = AllocatorModel.round_size(t.untyped_storage().nbytes())
    return sum(seen.values())


def cache_bytes(cache) -> int:
    """What transformers' DynamicCache holds on the device: every layer's key and value storage,
    and each sliding layer's window scalar once moved to the device."""
    tensors = []
    for layer in cache.layers:
        tensors += [layer.keys, layer.values, getattr(layer, "_sliding_window_tensor", None)]
    return storage_bytes(tensors)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_predicts_and_its_cache_is_the_shape_figure(family):
    shape = shape_of(family)
    spec = RunSpec(family, **SPEC)
    prediction = predict_model(shape, spec)
    assert [r["phase"] for r in prediction["phases"]] == ["model_load", "inputs", "prefill", "decode", "decode",
                                                          "decode"]
    for record in prediction["phases"]:
        kinds = record["end_allocated_bytes_by_kind"]
        assert sum(kinds.values()) == record["end_allocated_bytes"] and kinds["activations"] >= 0, record
    # the cache traced on meta (transformers' own layers, the sliding ones cropping) is the figure
    # the shape gives, phase by phase
    seen = []

    def phase(name, action, index, recorded):
        result = action()
        if name == "prefill":
            seen.append(result)
        if seen:
            tokens = spec.context + (0 if name == "prefill" else index + 1)
            last = spec.context if name == "prefill" else 1
            assert cache_bytes(seen[0]) == shape.kv_cache_bytes(spec.batch, tokens, spec.dtype, last_update=last,
                                                                rounded=True), (name, index)
        return result

    run_protocol(shape, spec, torch.device("meta"), phase)
    kv = [r["end_allocated_bytes_by_kind"]["kv_cache"] for r in prediction["phases"]]
    assert kv[:2] == [0, 0] and all(k > 0 for k in kv[2:])


def built_attention_and_mlp(shape):
    """(heads, kv_heads, head_dim, MLP width or None) of the model transformers builds on meta, read
    from its first attention module and its first dense MLP."""
    from transformers import AutoModelForCausalLM

    from lab_helpers.real.protocol import transformers_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(shape), attn_implementation="sdpa")
    attention = next(m for _, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    head_dim = getattr(attention, "head_dim", None) or getattr(attention, "head_size", None)
    heads = shape.heads
    kv_heads = heads // getattr(attention, "num_key_value_groups", 1)
    width = None
    for name, module in model.named_modules():
        if name.endswith(".mlp"):
            for child, read in (("up_proj", lambda m: m.out_features), ("c_fc", lambda m: m.nf),
                                ("dense_h_to_4h", lambda m: m.out_features)):
                if hasattr(module, child):
                    width = read(getattr(module, child))
                    break
        if width is not None:
            break
    return heads, kv_heads, head_dim, width


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shape_is_what_the_built_model_reads_and_its_cache_what_the_trace_holds(family):
    shape = shape_of(family)
    heads, kv_heads, head_dim, width = built_attention_and_mlp(shape)
    if family != "deepseek_v3":  # latent attention: one cached head of other widths (its own test)
        assert (shape.heads, shape.kv_heads, shape.head_dim) == (heads, kv_heads, head_dim)
    if width is not None:
        assert shape.intermediate == width
    spec = RunSpec(family, **SPEC)
    prediction = predict_model(shape, spec)
    traced = []

    def phase(name, action, index, recorded):
        result = action()
        if name == "prefill":
            traced.append(result)
        if name in ("prefill", "decode"):
            traced.append(cache_bytes(traced[0]))
        return result

    run_protocol(shape, spec, torch.device("meta"), phase)
    reported = [r["end_allocated_bytes_by_kind"]["kv_cache"] for r in prediction["phases"]
                if r["phase"] in ("prefill", "decode")]
    assert reported == traced[1:]


def test_gpt2_given_llama_keys_is_described_with_its_own():
    plain, given = shape_of("gpt2"), shape_of("gpt2-llama-keys")
    assert (given.intermediate, given.kv_heads) == (4 * 90, 6) == (plain.intermediate, plain.kv_heads)
    assert given.kv_cache_bytes(2, 11, "bfloat16", rounded=True) == plain.kv_cache_bytes(2, 11, "bfloat16",
                                                                                         rounded=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_the_parameters_and_buffers_as_the_allocator_rounds_them(family):
    from transformers import AutoModelForCausalLM

    from lab_helpers.real.protocol import transformers_config
    shape = shape_of(family)
    loaded = load_for_prediction(shape, "bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(shape), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    assert loaded["weights_bytes"] == storage_bytes([*model.parameters(), *model.buffers()])
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3", "gpt2", "gpt_neox", "olmo2", "mixtral"])
def test_key_value_bytes_per_token_follow_the_architecture(family):
    shape = shape_of(family)
    raw = FAMILIES[family]
    heads = raw.get("num_attention_heads", raw.get("n_head"))
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or raw.get("hidden_size", raw.get("n_embd")) // heads
    layers = raw.get("num_hidden_layers", raw.get("n_layer"))
    per_token = 2 * layers * kv_heads * head_dim * 2  # keys and values, bf16
    assert shape.kv_cache_bytes(1, 1, "bfloat16") == per_token
    # past the window a sliding layer holds window - 1 kept positions and the new one
    tokens = 100
    full = sum(w is None for w in shape.layer_windows)
    expected = 2 * kv_heads * head_dim * 2 * (full * tokens + (layers - full) * WINDOW)
    assert shape.kv_cache_bytes(1, tokens, "bfloat16") == expected


def test_deepseek_latent_attention_caches_the_compressed_latents():
    shape = shape_of("deepseek_v3")
    # one head: the kv_lora_rank latent as keys, the rope part (qk_rope_head_dim) as values
    assert (shape.kv_heads, shape.key_dim, shape.value_dim) == (1, 16, 8)
    assert shape.kv_cache_bytes(1, 1, "bfloat16") == 3 * (16 + 8) * 2


@pytest.mark.parametrize("family", ["mixtral", "gemma3_text", "gpt2"])
def test_a_trace_is_identical_to_a_second_trace(family):
    spec = RunSpec(family, **SPEC)
    first = predict_model(shape_of(family), spec)
    second = predict_model(shape_of(family), spec)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


GEMMA3 = json.loads((REPOSITORY / "data" / "models" / "gemma-3-4b-text.json").read_text())


def test_the_bundled_shapes_read_through_transformers_give_the_published_sizes():
    facts = {name: load_config(name) for name in bundled_names()}
    published = {"qwen3-8b": 8190735360, "qwen3-30b-a3b": 30532122624, "mixtral-8x7b": 46702792704,
                 "gemma-2-2b": 2614341888, "phi-3-mini-4k": 3821079552, "gpt2": 124439808,
                 "pythia-1.4b": 1414647808, "mistral-7b-v0.1": 7241732096}
    for name, count in published.items():
        assert facts[name].parameter_count() == count, name
    gemma = facts["gemma-3-4b-text"]
    assert gemma.layer_windows.count(None) == 5 and gemma.layer_windows.count(1024) == 29
    assert facts["gemma-2-2b"].layer_windows[:2] == (4096, None)
    assert set(facts["mistral-7b-v0.1"].layer_windows) == {4096}
    assert set(facts["phi-3-mini-4k"].layer_windows) == {2047}
    assert set(facts["qwen2.5-7b"].layer_windows) == {None}  # use_sliding_window false
    assert (facts["qwen3-30b-a3b"].experts, facts["qwen3-30b-a3b"].experts_per_token) == (128, 8)
    assert facts["gpt2"].hidden == 768 and facts["gpt2"].tied_embeddings  # n_embd, through GPT2Config
    assert facts["phi-3-mini-4k"].head_dim == 96


def test_a_reduced_bundled_shape_predicts_past_its_window():
    raw = dict(GEMMA3, num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
               sliding_window=16)
    shape = parse_config(raw, "gemma-3-3-layers")
    prediction = predict_model(shape, RunSpec("gemma-3-3-layers", batch=1, context=40, new_tokens=2))
    last = prediction["phases"][-1]
    # two sliding layers of 16 positions, one full of 42, 4 kv heads x 256, bf16, each rounded
    one = lambda n: AllocatorModel.round_size(4 * n * 256 * 2)  # noqa: E731
    assert last["end_allocated_bytes_by_kind"]["kv_cache"] == 2 * (2 * one(16) + SLIDING_WINDOW_TENSOR_BYTES) \
        + 2 * one(42)


REFUSED = [
    ({"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "'auto_map' names remote code"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "'quantization_config' (quant_method bitsandbytes): quantized weights are not predicted"),
    ({"model_type": "no-such-family"}, "a model type transformers"),
    ({"model_type": "vit"}, "has no causal language model"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not covered"),
    ({"num_key_value_heads": 4}, "'num_key_value_heads' (4) must divide 'num_attention_heads' (6)"),
    ({"hidden_act": "no-such-activation"}, "'hidden_act'"),
]


@pytest.mark.parametrize("extra,words", REFUSED, ids=[w[:24] for _, w in REFUSED])
def test_what_cannot_be_traced_or_known_is_refused_in_one_line(tmp_path, capsys, extra, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(FAMILIES["qwen3"], **extra)))
    code = main(["predict", "--config", str(path), "--batch", "1", "--context", "8", "--new-tokens", "1"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("real_model: error: ") and words in lines[0], lines[0]


def test_remote_code_is_refused_before_transformers_reads_anything(monkeypatch):
    import transformers
    monkeypatch.setattr(transformers.AutoConfig, "for_model", lambda *a, **k: pytest.fail("asked transformers"))
    with pytest.raises(ConfigError, match="auto_map"):
        parse_config(dict(FAMILIES["qwen3"], auto_map={"AutoConfig": "configuration_x.XConfig"}), "remote")


def test_tensor_parallel_needs_the_family_s_plan():
    from lab_helpers.real.config import check_tensor_parallel
    with pytest.raises(ConfigError, match="no tensor-parallel plan"):
        check_tensor_parallel(shape_of("gpt2"), 2)


# ---- mixtures of experts: the routing must not change what is allocated
def _dispatch_log(family, route_all_to_first: bool):
    """(op, output shapes and dtypes) of a CPU forward of the tiny model, in order."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers import AutoModelForCausalLM

    from lab_helpers.real.protocol import transformers_config
    config = transformers_config(shape_of(family))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    assert routers, "no router found"
    chosen, logging = [], [True]

    def skew(module, args, output):
        logging[0] = False  # the check's own ops are not the model's
        indices = output[-1]
        if route_all_to_first:
            indices.zero_()  # in place: every token to expert 0
        chosen.append(indices.clone())
        logging[0] = True

    for router in routers:
        router.register_forward_hook(skew)
    log = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if logging[0]:
                    log.append((str(func), [(tuple(t.shape), t.dtype) for t in tree_leaves(out)
                                        if isinstance(t, torch.Tensor)]))
            return out

    ids = torch.randint(0, 1001, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), Log():
        model(input_ids=ids, use_cache=False)
    return log, torch.cat([c.flatten() for c in chosen])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_no_allocation_of_the_experts_depends_on_the_routing(family):
    even, even_choice = _dispatch_log(family, route_all_to_first=False)
    skewed, skewed_choice = _dispatch_log(family, route_all_to_first=True)
    assert len(set(even_choice.tolist())) > 1 and set(skewed_choice.tolist()) == {0}
    assert even == skewed
