"""Architecture facts of a decoder-only transformers model, from a Hugging Face config.json.

The file is read and checked first without torch or transformers (lab_helpers.real.raw_config:
precheck_config); its keys are then read through transformers' own config class (AutoConfig),
whatever the family, and the lab keeps only what its figures need (shape_of). A config names its file or a bundled
one under data/models/ (architecture facts only, never weights).
"""
import dataclasses
import functools
import json
import re

from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.collector import loading_libraries
from lab_helpers.core.errors import safe_reason
from lab_helpers.core.text import printable
from lab_helpers.core.numbers import DTYPE_BYTES
from lab_helpers.measurement.schema import MAX_TENSOR_PARALLEL
from lab_helpers.real.progress import plain_tqdm_in_notebooks
from lab_helpers.real.raw_config import (CAUSAL_LM_MAPPING, MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_INTERMEDIATE,
                                         MAX_LAYERS, MAX_MODEL_HIDDEN, MAX_POSITIONS, MAX_VOCAB, ConfigError,
                                         ConfigParameterError,
                                         RawConfig, auto_mapping_names, bounded, bundled_names, precheck_config,
                                         precheck_raw)

# cache layer types of transformers' DynamicCache that hold keys and values per token; the
# window of a sliding (or chunked) one bounds what it keeps
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# keys of a config.json that transformers reads as the file's metadata, not as the model's
METADATA_KEYS = ("model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version")
# the bytes of the int64 scalar (the window) a sliding cache layer moves to the device, as the
# caching allocator rounds it
SLIDING_WINDOW_TENSOR_BYTES = 512


@dataclasses.dataclass(frozen=True)
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
            except Exception as exc:  # noqa: BLE001 - whatever the modeling code raises on this config
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
    except Exception as exc:  # noqa: BLE001 - a config's __post_init__ may raise anything (ZeroDivisionError)
        # transformers validates its fields (types, rope keys, layer_types) as the config is built
        raise ConfigError(f"{key_named(exc, kwargs)}refused by transformers: {one_line_reason(exc)}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    config._attn_implementation = "sdpa"
    return config


@functools.lru_cache(maxsize=None)
def causal_lm_architectures() -> dict:
    """transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (model type -> causal language model class), read
    from the literal in its source file: importing its module imports transformers' generation and
    distributed code (about 3.5 s of CPU on a 2-core machine, nearly the import of torch and transformers
    again), which a prediction from a kept trace never needs. Where the literal cannot be read, the
    module is imported (tests/test_replay.py checks that both give the same names)."""
    found = auto_mapping_names("models/auto/modeling_auto.py").get(CAUSAL_LM_MAPPING)
    if found:
        return dict(found)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def parse_config(raw, name: str, shape_cache=None) -> ModelShape:
    """Check a config dict, read it through transformers' config class and return its shape;
    raise ConfigError naming the key. With `shape_cache` (a lab_helpers.real.trace_cache.TraceCache) the
    shape read before from the same config under the same torch, transformers and lab code is taken
    from it (reading a config class imports most of transformers: about 3 s of CPU), and a new one kept."""
    return shape_of(precheck_raw(raw, name), shape_cache)


def shape_of(raw_config: RawConfig, shape_cache=None) -> ModelShape:
    """The shape of a config precheck_config (or precheck_raw) has checked, read through
    transformers' config class; ConfigError naming the key where transformers refuses it."""
    with loading_libraries():  # most of torch and transformers is imported here (core.collector)
        return _shape_of(raw_config.raw, raw_config.name, raw_config.model_type, shape_cache)


def _shape_of(raw: dict, name: str, model_type: str, shape_cache) -> ModelShape:
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
    # torch before transformers: a Python without torch then ends in the lab's one line naming it
    # (core.cli.run), not after transformers' own "PyTorch was not found" warning on stderr; a shape
    # kept in the cache imports neither
    import torch
    del torch  # only its presence matters here
    plain_tqdm_in_notebooks()
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
    # transformers keeps a key its config class does not declare as a plain attribute, which the
    # family's modeling code never reads (GPT-2 given intermediate_size or num_key_value_heads):
    # only declared fields, or their aliases, make the shape
    declared = {f.name for f in dataclasses.fields(type(text))} if dataclasses.is_dataclass(text) else None

    def used(attribute) -> bool:
        return declared is None or attribute in declared or aliases.get(attribute, attribute) in declared

    def read(attribute, low, high, default=None, undeclared=False):
        key = aliases.get(attribute, attribute)
        value = getattr(text, attribute, None) if undeclared or used(attribute) else None
        if value is None:
            if default is None:
                raise ConfigError(f"config lacks the key {key!r} that {type(text).__name__} needs")
            return default
        return bounded(value, key, low, high)

    # a config class's defaults for the sizes are those of one published model: a file that does
    # not name them is no model's config
    given = raw.get("text_config") if isinstance(raw.get("text_config"), dict) and text is not config else raw
    for attribute in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        key = aliases.get(attribute, attribute)
        if attribute == "intermediate_size" and (not used(attribute) or getattr(text, attribute, None) is None):
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
    # head_dim undeclared: the attention of a class with key/value heads reads it (getattr(config,
    # "head_dim", hidden // heads)); one without (GPT-2, GPT-NeoX) splits the width by its heads
    head_dim_read = used("head_dim") or used("num_key_value_heads")
    if (not head_dim_read or getattr(text, "head_dim", None) is None) and hidden % heads:
        raise ConfigError(f"config key {aliases.get('num_attention_heads', 'num_attention_heads')!r} ({heads}) "
                          f"must divide {aliases.get('hidden_size', 'hidden_size')!r} ({hidden})")
    head_dim = read("head_dim", 1, MAX_HEAD_DIM, default=hidden // heads, undeclared=True) if head_dim_read \
        else hidden // heads
    if heads % kv_heads:
        raise ConfigError(f"config key 'num_key_value_heads' ({kv_heads}) must divide "
                          f"'num_attention_heads' ({heads})")
    key_dim = value_dim = head_dim
    if used("kv_lora_rank") and getattr(text, "kv_lora_rank", None) is not None and \
            getattr(text, "qk_rope_head_dim", None) is not None:
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
        max_positions = bounded(max_positions, aliases.get("max_position_embeddings", "max_position_embeddings"),
                                 1, MAX_POSITIONS)
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
        window = bounded(window, "sliding_window", 1, MAX_POSITIONS)
    windows = tuple(None if t == "full_attention" else window for t in layer_types)
    experts = 0
    for attribute in ("num_local_experts", "num_experts", "n_routed_experts"):
        if used(attribute) and isinstance(getattr(text, attribute, None), int) and getattr(text, attribute) > 0:
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


def load_config(path_or_name: str, shape_cache=None) -> ModelShape:
    """Read a config.json path, a Hugging Face model folder holding one, or a bundled config NAME,
    and check it (precheck_config, then shape_of: the shape kept in `shape_cache` when given)."""
    return shape_of(precheck_config(path_or_name), shape_cache)


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
        raise ConfigParameterError("tensor_parallel", f"must be a whole number from 1 to {MAX_TENSOR_PARALLEL}, "
                                                       f"got {degree!r}")
    if degree == 1:
        return
    if not shape.tensor_parallel_plan:
        raise ConfigParameterError("tensor_parallel", f"{degree}: transformers has no tensor-parallel plan "
                                                   f"(base_model_tp_plan) for model_type {shape.model_type!r}; it "
                                                   f"runs on one GPU only")
    for key, value in (("num_attention_heads", shape.heads), ("num_key_value_heads", shape.kv_heads),
                       ("hidden_size", shape.hidden), ("intermediate_size", shape.intermediate),
                       ("vocab_size", shape.vocab)):
        if value % degree:
            raise ConfigParameterError("tensor_parallel", f"{degree} does not divide config key {key!r} ({value}), "
                                                           f"which the tensor-parallel plan splits across the GPUs")
    if shape.tied_embeddings:
        raise ConfigError("config key 'tie_word_embeddings': tied embeddings at tensor parallel > 1 are not "
                          "covered (the plan splits lm_head but not the embedding it shares)")
