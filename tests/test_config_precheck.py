"""The config pre-check: what refuses a config.json from its text alone, without torch,
transformers or huggingface_hub, and agrees with the shape transformers then builds."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from lab_helpers.real.raw_config import (NULLABLE_SIZE_KEYS, SIZE_KEYS, ConfigError, RawConfig, bundled_names,
                                         precheck_config, precheck_raw)

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096}
ENCODERS = {
    "bert": {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000, "type_vocab_size": 2},
    "roberta": {"architectures": ["RobertaForMaskedLM"], "model_type": "roberta", "hidden_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000},
    "t5": {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 64, "d_ff": 128,
           "num_layers": 2, "num_heads": 4, "vocab_size": 1000},
    "bart": {"architectures": ["BartForConditionalGeneration"], "model_type": "bart", "d_model": 64,
             "encoder_layers": 2, "decoder_layers": 2, "vocab_size": 1000},
}
VALUES = {"0": 0, "-1": -1, "1.5": 1.5, "string": "8", "null": None, "2**63": 2**63}
REFUSED = {
    "heads-zero": dict(TINY, num_attention_heads=0),
    "hidden-1e6": dict(TINY, hidden_size=1000000),
    "gpt2-heads-string": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": "8", "vocab_size": 100},
    "text-config-layers": dict(TINY, text_config={"model_type": "llama", "num_hidden_layers": -1}),
    "llama-masked-lm-class": dict(TINY, architectures=["BertForMaskedLM"]),
    **ENCODERS,
}
SUGGEST = "for a Hugging Face model, download its config.json and pass its path (or the folder holding it)"


def refusal(raw) -> str:
    with pytest.raises(ConfigError) as caught:
        precheck_raw(raw, "config")
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("key", sorted(SIZE_KEYS))
def test_every_size_key_out_of_bounds_is_refused_naming_it(key, value):
    given = VALUES[value]
    if given is None and key in NULLABLE_SIZE_KEYS:
        assert precheck_raw(dict(TINY, **{key: None}), "config").raw[key] is None
        return
    message = refusal(dict(TINY, **{key: given}))
    assert f"config key {key!r} must be " in message, message


def test_a_size_key_inside_text_config_is_checked_too():
    message = refusal(dict(TINY, text_config={"model_type": "llama", "num_attention_heads": 0}))
    assert message == "config key 'text_config.num_attention_heads' must be from 1 to 1024, got 0"


def test_the_messages_say_the_bounds_and_what_was_given():
    assert refusal(dict(TINY, hidden_size=1000000)) == "config key 'hidden_size' must be from 1 to 65536, got 1000000"
    assert refusal(dict(TINY, n_head="8")) == "config key 'n_head' must be a whole number from 1 to 1024, got \"8\""
    assert refusal(dict(TINY, vocab_size=None)) == "config key 'vocab_size' must be a whole number from 1 to " \
                                                   "1048576, got null"
    assert refusal(dict(TINY, num_hidden_layers=True)).startswith("config key 'num_hidden_layers' must be a whole")


@pytest.mark.parametrize("family", sorted(ENCODERS))
def test_encoder_and_encoder_decoder_families_are_refused_naming_the_supported_ones(family):
    message = refusal(ENCODERS[family])
    assert message.startswith(f"config key 'model_type': {family!r} is an encoder")
    assert "not a decoder-only causal language model" in message
    assert "decoder-only causal language models" in message and "llama" in message and "gpt2" in message


def test_a_config_naming_no_causal_lm_class_is_refused():
    message = refusal(dict(TINY, architectures=["BertForMaskedLM"]))
    assert message.startswith("config key 'architectures' names BertForMaskedLM, no causal language model class")
    assert refusal(dict(TINY, architectures="LlamaForCausalLM")) == \
        "config key 'architectures' must be a list of class names"
    assert precheck_raw(dict(TINY, architectures=["LlamaForCausalLM"]), "config").model_type == "llama"


def test_a_model_type_without_a_causal_lm_is_refused_before_transformers():
    assert "'vit' has no causal language model in transformers" in refusal(dict(TINY, model_type="vit"))
    assert "names 'no-such-family', a model type transformers" in refusal(dict(TINY, model_type="no-such-family"))


@pytest.mark.parametrize("typed, close", [("meta-llama/Llama-3.1-8B", "llama-3.1-8b"), ("Qwen/Qwen3-8B", "qwen3-8b"),
                                          ("openai-community/gpt2", "gpt2"), ("zzzz-unrelated", None)])
def test_a_hugging_face_id_gets_the_closest_bundled_name_and_how_to_pass_a_config(typed, close):
    with pytest.raises(ConfigError) as caught:
        precheck_config(typed)
    message = str(caught.value)
    # a library caller reads the parameter, config; the command line prints its flag, --config
    assert message.startswith(f"config {typed} is neither a file nor a bundled config (")
    assert message.endswith(SUGGEST)
    assert (f"did you mean {close}? " in message) if close else "did you mean" not in message


def test_the_bundled_configs_pass_and_say_what_they_are(tmp_path):
    for name in bundled_names():
        checked = precheck_config(name)
        assert isinstance(checked, RawConfig) and checked.name == name and checked.shown == f"{name}.json"
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    assert precheck_config(str(folder)).name == "Llama-3.1-8B"


def test_the_pre_check_imports_neither_torch_nor_transformers(tmp_path):
    paths = []
    for case, raw in REFUSED.items():
        path = tmp_path / f"{case}.json"
        path.write_text(json.dumps(raw))
        paths.append(str(path))
    script = (
        "import json, sys\n"
        "from lab_helpers.real.raw_config import ConfigError, bundled_names, precheck_config\n"
        "ok = [precheck_config(n).model_type for n in bundled_names()]\n"
        "refused = []\n"
        "for p in sys.argv[1:] + ['meta-llama/Llama-3.1-8B']:\n"
        "    try:\n"
        "        precheck_config(p)\n"
        "    except ConfigError as exc:\n"
        "        refused.append(str(exc))\n"
        "print(json.dumps({'ok': len(ok), 'refused': len(refused),\n"
        "                  'loaded': [m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules]}))\n")
    proc = subprocess.run([sys.executable, "-c", script, *paths], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"ok": len(bundled_names()), "refused": len(REFUSED) + 1, "loaded": []}


def test_the_positions_of_the_pre_check_are_those_of_the_built_shape():
    from lab_helpers.real.config import load_config, parse_config
    from test_families import FAMILIES
    for name in bundled_names():
        assert precheck_config(name).max_positions == load_config(name).max_positions, name
    for family, raw in FAMILIES.items():
        assert precheck_raw(raw, family).max_positions == parse_config(raw, family).max_positions, family


def test_load_config_is_the_pre_check_then_the_shape():
    from lab_helpers.real.config import load_config, shape_of
    assert shape_of(precheck_config("gpt2")) == load_config("gpt2")


def test_what_transformers_raises_while_building_the_config_or_the_model_is_one_line(monkeypatch):
    import transformers

    from lab_helpers.real.config import built_model_facts, transformers_config_of

    def divide(*args, **kwargs):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", divide)
    with pytest.raises(ConfigError, match=r"^config refused by transformers: integer division or modulo by zero$"):
        transformers_config_of(dict(TINY, vocab_size=1001))
    monkeypatch.undo()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", divide)
    with pytest.raises(ConfigError, match=r"^config refused by transformers as the model is built: integer "):
        built_model_facts(dict(TINY, vocab_size=1003))
