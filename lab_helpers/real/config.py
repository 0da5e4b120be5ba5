"""Architecture facts of a decoder-only transformers model, from a Hugging Face config.json.

The file is read and its JSON checked here with the standard library (depth, size, finite
numbers); its keys are then read through transformers' own config class (AutoConfig), whatever
the family, and the lab keeps only what its figures need. A config names its file or a bundled
one under data/models/ (architecture facts only, never weights).
"""
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.collector import loading_libraries
from lab_helpers.core.errors import LabError, safe_reason
from lab_helpers.core.files import read_bounded_text
from lab_helpers.core.text import printable
from lab_helpers.core.numbers import DTYPE_BYTES
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.measurement.schema import MAX_TENSOR_PARALLEL
from lab_helpers.real.progress import plain_tqdm_in_notebooks

MODELS_DIR = REPOSITORY / "data" / "models"
# Refused before any work: far beyond any published decoder (Llama 3.1 405B: hidden
# 16384, 126 layers, 128 heads; the largest vocabularies are about 260k).
MAX_MODEL_HIDDEN = 65536
MAX_INTERMEDIATE = 262144
MAX_LAYERS = 512
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB = 2**20
MAX_EXPERTS = 1024
MAX_CONFIG_BYTES = 2**20  # a config.json is a few KiB
MAX_CONFIG_DEPTH = 32  # published configs nest 3 levels (rope_scaling, quantization_config); more is no config
MAX_CONFIG_INTEGER = 2**63  # transformers turns some whole numbers into floats or C integers: bound them
# rope types whose frequencies are chosen from the positions' values during the forward pass (a
# tensor read back to Python with .item()): on the meta device there are no values to read
DATA_DEPENDENT_ROPES = {"dynamic": "dynamic NTK scaling recomputes its frequencies from the largest position seen",
                        "longrope": "longrope picks its short or long factors from the largest position seen"}
# cache layer types of transformers' DynamicCache that hold keys and values per token; the
# window of a sliding (or chunked) one bounds what it keeps
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# keys of a config.json that transformers reads as the file's metadata, not as the model's
METADATA_KEYS = ("model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version")
# the bytes of the int64 scalar (the window) a sliding cache layer moves to the device, as the
# caching allocator rounds it
SLIDING_WINDOW_TENSOR_BYTES = 512


class ConfigError(LabError, ValueError):
    """A config that cannot be used: one line naming the key. A ValueError too, so that a document
    holding a bad config reads as a malformed document where documents are checked."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory of inference depends on, read from transformers' own config class
    (AutoConfig) and checked once where it is built.

    `layer_windows` holds one entry per cache layer: None for a layer that keeps every
    position, the window for a sliding (or chunked) one, as transformers' DynamicCache lays
    them out. `key_dim` and `value_dim` are the widths of one head's cached key and value."""

    name: str
    architecture: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    max_positions: "int | None"
    raw: dict  # the config as given, passed to transformers unchanged
    key_dim: int = 0
    value_dim: int = 0
    layer_windows: tuple = ()
    experts: int = 0  # routed experts of a mixture of experts (0: a dense model)
    experts_per_token: int = 0
    tensor_parallel_plan: bool = True  # whether the config class has transformers' base_model_tp_plan
    # bitsandbytes' 4-bit weights, as from_pretrained quantizes them while loading (a --quantize value,
    # lab_helpers.real.quantized); "" for the config's own dtype
    quantization: str = ""

    def __post_init__(self):
        if not self.key_dim:
            object.__setattr__(self, "key_dim", self.head_dim)
        if not self.value_dim:
            object.__setattr__(self, "value_dim", self.head_dim)
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.layers)

    @property
    def sliding_window(self) -> "int | None":
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    def built_facts(self) -> dict:
        """Facts of the model transformers builds (on the meta device: no memory)."""
        return built_model_facts(self.raw)

    @property
    def attention_bias(self) -> bool:
        return self.built_facts()["attention_bias"]

    def parameter_count(self) -> int:
        """Parameters of the model transformers builds from this config (tied ones once)."""
        return self.built_facts()["parameter_count"]

    def parameter_bytes(self, dtype: str) -> int:
        return self.parameter_count() * DTYPE_BYTES[dtype]

    def layer_positions(self, window, positions: int, last_update: int = 1) -> int:
        """Positions one cache layer's key (or value) storage holds after `positions` tokens, the
        last `last_update` of them added by the latest forward pass.

        A full layer concatenates every position. A sliding layer (DynamicSlidingWindowLayer)
        concatenates what it kept with the new tokens and keeps a view of the last window - 1:
        the storage of that concatenation, at most window - 1 + last_update positions, stays
        alive until the next pass."""
        if window is None or positions <= 0:
            return max(positions, 0)
        return min(positions - last_update, window - 1) + last_update

    def kv_cache_bytes(self, batch: int, tokens: int, dtype: str, last_update: int = 1,
                       rounded: bool = False) -> int:
        """Keys and values of every cache layer after `tokens` positions (see layer_positions);
        with `rounded`, each tensor as the caching allocator rounds it, and each sliding
        layer's window scalar on the device."""
        total = 0
        for window in self.layer_windows:
            kept = self.layer_positions(window, tokens, last_update)
            if not kept:
                continue
            per_position = batch * self.kv_heads * DTYPE_BYTES[dtype]
            keys, values = per_position * kept * self.key_dim, per_position * kept * self.value_dim
            if rounded:
                keys, values = AllocatorModel.round_size(keys), AllocatorModel.round_size(values)
                if window is not None:
                    total += SLIDING_WINDOW_TENSOR_BYTES
            total += keys + values
        return total

    def describe(self) -> dict:
        return {
            "config_name": self.name, "architecture": self.architecture, "model_type": self.model_type,
            "layers": self.layers, "hidden": self.hidden, "intermediate": self.intermediate,
            "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
            "vocab": self.vocab, "tied_embeddings": self.tied_embeddings,
            "attention_bias": self.attention_bias, "max_positions": self.max_positions,
            "sliding_window": self.sliding_window,
            "sliding_layers": sum(w is not None for w in self.layer_windows),
            "experts": self.experts, "experts_per_token": self.experts_per_token,
            "parameter_count": self.parameter_count(),
            **({"quantization": self.quantization} if self.quantization else {}),
        }


_BUILT = {}  # config text -> facts of the model built from it on meta


def built_model_facts(raw: dict) -> dict:
    """Parameter count (tied ones once) and whether the attention projections carry a bias, of the
    model AutoModelForCausalLM.from_config builds, built on the meta device."""
    key = json.dumps(raw, sort_keys=True)
    if key not in _BUILT:
        import torch
        plain_tqdm_in_notebooks()
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        config = transformers_config_of(raw)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None
        if model_class is not None and not getattr(model_class, "_supports_sdpa", False):
            # the lab measures and predicts SDPA attention alone; this class would run another (eager)
            raise ConfigError(f"config key 'model_type': {printable(str(raw.get('model_type')))!r} builds "
                              f"{model_class.__name__}, which has no SDPA attention in transformers "
                              f"{_transformers_version()}; the lab measures and predicts SDPA attention only, "
                              f"so it cannot predict the attention this model would run")
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            except (TypeError, ValueError, KeyError, AssertionError, OverflowError, ZeroDivisionError,
                    AttributeError, IndexError, RuntimeError, NotImplementedError) as exc:
                raise ConfigError(f"{key_named(exc, raw)}refused by transformers as the model is built: "
                                  f"{one_line_reason(exc)}") from None
        names = [n for n, _ in model.named_parameters()]
        _BUILT[key] = {
            "parameter_count": sum(p.numel() for p in model.parameters()),
            "attention_bias": any(n.endswith(("q_proj.bias", "k_proj.bias", "qkv_proj.bias", "c_attn.bias",
                                              "query_key_value.bias", "q_a_proj.bias", "q_b_proj.bias"))
                                  for n in names),
        }
        del model
    return _BUILT[key]


def one_line_reason(exc: BaseException) -> str:
    """transformers' validation messages span lines ("Validation error for field 'x':" then why):
    joined into one, with file paths blanked."""
    joined = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return safe_reason(RuntimeError(joined)).split(": ", 1)[-1].replace("RuntimeError: ", "", 1)


def key_named(exc: BaseException, raw: dict) -> str:
    """'config key K ' (or 'config keys K and L ') for the keys of `raw` the library's message names:
    quoted, through the validator's name ("validate_layer_type": layer_types) or in words ("the
    number of attention heads"); else 'config '."""
    text = str(exc)
    lowered = text.lower()
    found = {}
    for key in raw:
        at = min((i for i in (text.find(f"'{key}'"), text.find(f"`{key}`")) if i >= 0), default=-1)
        if at >= 0:
            found[key] = at
    validator = re.search(r"validator 'validate_(\w+)'", text)
    if validator:
        found.update({k: -1 for k in raw if k.startswith(validator.group(1))})
    if not found:
        found = {k: lowered.find(k.removeprefix("num_").replace("_", " ")) for k in raw
                 if "_" in k and k.removeprefix("num_").replace("_", " ") in lowered}
    if not found:  # a value the message quotes (an activation's name)
        found = {k: text.find(raw[k]) for k in raw
                 if k != "model_type" and isinstance(raw[k], str) and len(raw[k]) > 2 and raw[k] in text}
    if found:
        keys = [k for k, _ in sorted(found.items(), key=lambda item: item[1])][:3]
        return f"config key {keys[0]!r} " if len(keys) == 1 else \
            f"config keys {' and '.join(map(repr, keys))} "
    if "rope" in text:
        return "config key 'rope_parameters' "
    return "config "


def transformers_config_of(raw: dict):
    """The transformers config (AutoConfig) of a config dict, with the attention the lab measures
    (SDPA); ConfigError naming the key when transformers refuses it."""
    plain_tqdm_in_notebooks()
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    import copy
    # a deep copy: building the config rewrites nested blocks (rope parameters) in place, and the raw
    # dict is what documents and trace keys show of the config
    kwargs = {k: copy.deepcopy(v) for k, v in raw.items() if k not in METADATA_KEYS}
    for key in ("rope_parameters", "rope_scaling"):  # checked before the library warns of it on stderr
        rope = kwargs.get(key) if isinstance(kwargs.get(key), dict) else {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ConfigError(f"config key {key!r}: unknown rope_type {rope_type!r}; transformers knows "
                              f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    from transformers.utils import logging as transformers_logging
    verbosity = transformers_logging.get_verbosity()
    # the library warns on stderr of what the lab then refuses in its own line (a token id past the
    # vocabulary): quiet while the config is built, as it was before after
    transformers_logging.set_verbosity_error()
    try:
        config = AutoConfig.for_model(raw["model_type"], **kwargs)
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError, IndexError,
            StrictDataclassError) as exc:
        # transformers validates its fields (types, rope keys, layer_types) as the config is built
        raise ConfigError(f"{key_named(exc, kwargs)}refused by transformers: {one_line_reason(exc)}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    config._attn_implementation = "sdpa"
    return config


def bundled_names() -> list:
    """Names of the configs shipped under data/models/."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def _check_values(value, key: str, depth: int = 0) -> None:
    """Refuse what no output may hold: nesting beyond MAX_CONFIG_DEPTH, NaN or infinities (JSON has
    none; Python's reader makes them of 1e400 or NaN), whole numbers beyond MAX_CONFIG_INTEGER."""
    if depth > MAX_CONFIG_DEPTH:
        raise ConfigError(f"config key {key!r} nests too deeply (more than {MAX_CONFIG_DEPTH} levels)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {key!r} is not a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CONFIG_INTEGER:
        raise ConfigError(f"config key {key!r} is a whole number beyond {MAX_CONFIG_INTEGER}")
    if isinstance(value, dict):
        for inner, item in value.items():
            _check_values(item, inner, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_values(item, key, depth + 1)


# numbers of a rope block the frequency computation raises to powers or divides by
ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "attention_factor", "beta_fast", "beta_slow")


def _positive_number(value, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"config key {key!r} must be a number > 0, got {value!r}")


def _rope_block(raw: dict) -> "dict | None":
    """The rope parameters as given (rope_parameters, or the older rope_scaling), checked to be an
    object; ConfigError naming the key otherwise."""
    for key in ("rope_parameters", "rope_scaling"):
        block = raw.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ConfigError(f"config key {key!r} must be an object or null, got {type(block).__name__}")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if not isinstance(rope_type, str):
            raise ConfigError(f"config key {key!r}: 'rope_type' must be a string, got {rope_type!r}")
        for inner in ROPE_NUMBERS:
            if inner in block:
                _positive_number(block[inner], f"{key}.{inner}")
        if rope_type in DATA_DEPENDENT_ROPES:
            raise ConfigError(f"config key {key!r}: rope_type {rope_type!r} is not covered: "
                              f"{DATA_DEPENDENT_ROPES[rope_type]} at run time, a value the meta-device "
                              f"prediction cannot read")
        return block
    return None


def _bounded(value, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key {key!r} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"config key {key!r} must be from {low} to {high}, got {value}")
    return value


def _refuse_before_transformers(raw: dict) -> str:
    """What is refused before transformers is asked: the model type's form, remote code,
    quantized weights, rope types chosen from the positions' values. Returns the model type."""
    if "model_type" not in raw:
        raise ConfigError("config lacks the required key 'model_type' (transformers chooses the config "
                          "class and the model by it)")
    model_type = raw["model_type"]
    if not isinstance(model_type, str):
        raise ConfigError(f"config key 'model_type' must be a string, got {type(model_type).__name__}")
    if raw.get("auto_map") is not None:
        raise ConfigError("config key 'auto_map' names remote code (the model's own Python files); the lab "
                          "never imports or downloads it, so it cannot build that model")
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ConfigError(f"config key 'quantization_config' (quant_method {printable(str(method))}): quantized "
                          f"weights are not predicted; from_config builds unquantized weights and the "
                          f"quantization runs its library's own CUDA kernels, which the meta-device trace cannot "
                          f"see (remove the key to predict the unquantized model)")
    if raw.get("rope_theta") is not None:
        _positive_number(raw["rope_theta"], "rope_theta")
    _rope_block(raw)
    return model_type


@functools.lru_cache(maxsize=None)
def causal_lm_architectures() -> dict:
    """transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (model type -> causal language model class), read
    from the literal in its source file: importing its module imports transformers' generation and
    distributed code (about 3.5 s of CPU on a 2-core machine, nearly the import of torch and transformers
    again), which a prediction from a kept trace never needs. Where the literal cannot be read, the
    module is imported (tests/test_replay.py checks that both give the same names)."""
    import ast

    import transformers
    path = Path(transformers.__file__).parent / "models" / "auto" / "modeling_auto.py"
    try:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                    and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "OrderedDict"
                    and len(node.value.args) == 1 and not node.value.keywords):
                return dict(ast.literal_eval(node.value.args[0]))
    except (OSError, SyntaxError, ValueError, TypeError, UnicodeDecodeError):
        pass
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def parse_config(raw, name: str, shape_cache=None) -> ModelShape:
    """Check a config dict, read it through transformers' config class and return its shape;
    raise ConfigError naming the key. With `shape_cache` (a lab_helpers.real.trace_cache.TraceCache) the
    shape read before from the same config under the same torch, transformers and lab code is taken
    from it (reading a config class imports most of transformers: about 3 s of CPU), and a new one kept."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: a config.json must hold a JSON object")
    for key, value in raw.items():
        _check_values(value, key)
    model_type = _refuse_before_transformers(raw)
    with loading_libraries():  # most of torch and transformers is imported here (core.collector)
        return _shape_of(raw, name, model_type, shape_cache)


def _shape_of(raw: dict, name: str, model_type: str, shape_cache) -> ModelShape:
    # torch before transformers: a Python without torch then ends in the lab's one line naming it
    # (core.cli.run), not after transformers' own "PyTorch was not found" warning on stderr
    import torch
    del torch  # only its presence matters here
    plain_tqdm_in_notebooks()
    if shape_cache is None:
        return _read_config(raw, name, model_type)
    key = shape_cache.shape_key(raw)
    kept = shape_cache.get(key)
    if isinstance(kept, dict):
        try:
            fields = {**kept["fields"], "layer_windows": tuple(kept["fields"]["layer_windows"])}
            shape = ModelShape(name=name, raw=dict(raw), **fields)
            facts = {"parameter_count": int(kept["facts"]["parameter_count"]),
                     "attention_bias": bool(kept["facts"]["attention_bias"])}
        except (TypeError, KeyError, ValueError):
            shape = None  # not a shape this code wrote: read again
        if shape is not None:
            _BUILT.setdefault(json.dumps(raw, sort_keys=True), facts)
            return shape
    shape = _read_config(raw, name, model_type)
    fields = {f: getattr(shape, f) for f in ModelShape.__dataclass_fields__ if f not in ("name", "raw")}
    shape_cache.put(key, {"fields": fields, "facts": built_model_facts(shape.raw)})
    return shape


def _read_config(raw: dict, name: str, model_type: str) -> ModelShape:
    from transformers.cache_utils import get_layer_types_and_kwargs
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ConfigError(f"config key 'model_type' names {printable(model_type)!r}, a model type transformers "
                          f"{_transformers_version()} does not know (and remote code is never run)")
    architecture = causal_lm_architectures().get(model_type)
    if architecture is None:
        raise ConfigError(f"config key 'model_type': {model_type!r} has no causal language model in transformers "
                          f"{_transformers_version()} (AutoModelForCausalLM cannot build it)")
    config = transformers_config_of(raw)
    text = config.get_text_config(decoder=True)
    aliases = getattr(text, "attribute_map", {}) or {}

    def read(attribute, low, high, default=None):
        key = aliases.get(attribute, attribute)
        value = getattr(text, attribute, None)
        if value is None:
            if default is None:
                raise ConfigError(f"config lacks the key {key!r} that {type(text).__name__} needs")
            return default
        return _bounded(value, key, low, high)

    # a config class's defaults for the sizes are those of one published model: a file that does
    # not name them is no model's config
    given = raw.get("text_config") if isinstance(raw.get("text_config"), dict) and text is not config else raw
    for attribute in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        key = aliases.get(attribute, attribute)
        if attribute == "intermediate_size" and getattr(text, attribute, None) is None:
            continue  # a class without the key (GPT-2: n_inner, four times the width by default)
        if key not in given and attribute not in given:
            raise ConfigError(f"config lacks the required key {key!r}")
    hidden = read("hidden_size", 1, MAX_MODEL_HIDDEN)
    layers = read("num_hidden_layers", 1, MAX_LAYERS)
    heads = read("num_attention_heads", 1, MAX_HEADS)
    kv_heads = read("num_key_value_heads", 1, MAX_HEADS, default=heads)
    vocab = read("vocab_size", 1, MAX_VOCAB)
    intermediate = read("intermediate_size", 1, MAX_INTERMEDIATE, default=0) or \
        read("n_inner", 1, MAX_INTERMEDIATE, default=4 * hidden)  # GPT-2's default: four times the width
    if getattr(text, "head_dim", None) is None and hidden % heads:
        raise ConfigError(f"config key {aliases.get('num_attention_heads', 'num_attention_heads')!r} ({heads}) "
                          f"must divide {aliases.get('hidden_size', 'hidden_size')!r} ({hidden})")
    head_dim = read("head_dim", 1, MAX_HEAD_DIM, default=hidden // heads)
    if heads % kv_heads:
        raise ConfigError(f"config key 'num_key_value_heads' ({kv_heads}) must divide "
                          f"'num_attention_heads' ({heads})")
    key_dim = value_dim = head_dim
    if getattr(text, "kv_lora_rank", None) is not None and getattr(text, "qk_rope_head_dim", None) is not None:
        # multi-head latent attention (DeepSeek-V3): transformers 5.17 caches the compressed
        # latents as one head, the normalised latent as "keys" and the rotated rope part as "values"
        key_dim = read("kv_lora_rank", 1, MAX_MODEL_HIDDEN)
        value_dim = read("qk_rope_head_dim", 1, MAX_HEAD_DIM)
        kv_heads = 1
    if getattr(text, "rope_parameters", None) is not None and "partial_rotary_factor" not in \
            (text.rope_parameters or {}) and key_dim % 2:
        raise ConfigError(f"config key 'head_dim' must be even for rotary embeddings, got {key_dim}")
    max_positions = getattr(text, "max_position_embeddings", None)
    if max_positions is not None:
        max_positions = _bounded(max_positions, aliases.get("max_position_embeddings", "max_position_embeddings"),
                                 1, 2**31 - 1)
    pad = getattr(text, "pad_token_id", None)
    # nn.Embedding's padding_idx: a token id, or counted from the end of the vocabulary when negative
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab):
        raise ConfigError(f"config key 'pad_token_id' must be null or a token id from {-vocab} to {vocab - 1}, "
                          f"got {pad!r}")
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    unknown = sorted({t for t in layer_types if t not in KV_LAYER_TYPES})
    if unknown:
        raise ConfigError(f"config key 'layer_types' holds {', '.join(map(repr, unknown))}: a cache layer of "
                          f"recurrent or compressed state, for which the lab has no key/value-cache figure")
    window = layer_kwargs.get("sliding_window")
    if any(t != "full_attention" for t in layer_types):
        window = _bounded(window, "sliding_window", 1, 2**31 - 1)
    windows = tuple(None if t == "full_attention" else window for t in layer_types)
    experts = 0
    for attribute in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(getattr(text, attribute, None), int) and getattr(text, attribute) > 0:
            experts = read(attribute, 1, MAX_EXPERTS)
            break
    per_token = read("num_experts_per_tok", 1, MAX_EXPERTS, default=0) if experts else 0
    return ModelShape(name=name, architecture=architecture, model_type=model_type,
                      hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                      kv_heads=kv_heads, head_dim=head_dim, vocab=vocab,
                      tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                      max_positions=max_positions, raw=dict(raw), key_dim=key_dim, value_dim=value_dim,
                      layer_windows=windows, experts=experts, experts_per_token=per_token,
                      tensor_parallel_plan=bool(getattr(type(text), "base_model_tp_plan", None)))


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def _config_too_deep(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest beyond `limit`: checked before parsing, so that the
    parser's recursion is never reached."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _refuse_constant(name):
    raise ConfigError(f"holds {name}: not a finite number, and not JSON")


def load_config(path_or_name: str, shape_cache=None) -> ModelShape:
    """Read a config.json path, a Hugging Face model folder holding one, or a bundled config NAME,
    and check it (parse_config: the shape kept in `shape_cache` when given)."""
    text = str(path_or_name)
    path = Path(text)
    if not text.endswith(".json") and not path.exists():
        if text not in bundled_names():
            raise ConfigError(f"--config {printable(text)} is neither a file nor a bundled config "
                              f"({', '.join(bundled_names())}), nor a model folder holding a config.json")
        path, name = MODELS_DIR / f"{text}.json", text
        shown = path.name  # a bundled config: its file name, not where the lab is installed
    elif path.is_dir():
        # a Hugging Face model folder (as from_pretrained reads it): its config.json
        if not (path / "config.json").is_file():
            raise ConfigError(f"--config {printable(text)} is a folder without a config.json, not a regular file; "
                              f"give a config.json, "
                              f"a model folder holding one, or a bundled config ({', '.join(bundled_names())})")
        name = path.resolve().name or "config"
        path, shown = path / "config.json", str(path / "config.json")
    else:
        name, shown = path.stem, text  # the path as the user typed it
    shown = printable(shown)
    try:
        if path.is_file() and path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{shown}: larger than {MAX_CONFIG_BYTES} bytes, not a config.json")
    except OSError:
        pass  # the reader below says why it cannot read it
    try:
        body = read_bounded_text(path, MAX_CONFIG_BYTES, "config.json", shown)
    except LabError as exc:
        raise ConfigError(str(exc)) from None
    if _config_too_deep(body, MAX_CONFIG_DEPTH):
        raise ConfigError(f"config {shown} nests too deeply (more than {MAX_CONFIG_DEPTH} levels): not a config.json")
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except ConfigError as exc:
        raise ConfigError(f"config {shown} {exc}") from None
    except RecursionError:  # unreachable after the depth check; kept so no traceback can leak
        raise ConfigError(f"config {shown} nests too deeply to be a config.json") from None
    except ValueError as exc:
        first = (str(exc).splitlines() or ["invalid"])[0][:160]
        raise ConfigError(f"config {shown} is not JSON: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {shown} must hold a JSON object")
    return parse_config(data, name, shape_cache)


def check_tensor_parallel(shape: ModelShape, degree) -> None:
    """Raise ConfigError unless `degree` GPUs can split `shape` with transformers' plan.

    The plan of the llama, mistral and qwen2 families (the ones measured at N > 1) shards q, k and v projections by output
    features (whole heads: num_attention_heads and num_key_value_heads), o_proj by input
    features (the heads again), gate and up projections by output features and down_proj
    by input features (intermediate_size), and lm_head by output features (vocab_size,
    gathered after the product). The embedding and the norms stay whole on every rank;
    hidden_size must divide too, as the heads' width split evenly (a config whose head_dim
    makes the heads' width differ from hidden_size is refused there rather than guessed)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= MAX_TENSOR_PARALLEL:
        raise ConfigError(f"--tensor-parallel must be a whole number from 1 to {MAX_TENSOR_PARALLEL}, got {degree!r}")
    if degree == 1:
        return
    if not shape.tensor_parallel_plan:
        raise ConfigError(f"--tensor-parallel {degree}: transformers has no tensor-parallel plan "
                          f"(base_model_tp_plan) for model_type {shape.model_type!r}; it runs on one GPU only")
    for key, value in (("num_attention_heads", shape.heads), ("num_key_value_heads", shape.kv_heads),
                       ("hidden_size", shape.hidden), ("intermediate_size", shape.intermediate),
                       ("vocab_size", shape.vocab)):
        if value % degree:
            raise ConfigError(f"--tensor-parallel {degree} does not divide config key {key!r} ({value}), "
                              f"which the tensor-parallel plan splits across the GPUs")
    if shape.tied_embeddings:
        raise ConfigError("config key 'tie_word_embeddings': tied embeddings at tensor parallel > 1 are not "
                          "covered (the plan splits lm_head but not the embedding it shares)")
