"""Architecture facts of a decoder-only transformers model, from a Hugging Face config.json.

Only the standard library: a config is read and checked here once, before torch or
transformers are imported, so that a bad file or an absurd size is refused at once.
A config names its file or a bundled one under data/models/ (architecture facts only,
never weights).
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import read_bounded_text
from lab_helpers.core.text import printable
from lab_helpers.core.numbers import DTYPE_BYTES
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.measurement.schema import MAX_TENSOR_PARALLEL

MODELS_DIR = REPOSITORY / "data" / "models"
# model_type -> the transformers class the lab builds; the three families validated on a GPU
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
REQUIRED_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_hidden_layers", "vocab_size")
# Refused before any work: far beyond any published decoder (Llama 3.1 405B: hidden
# 16384, 126 layers, 128 heads; the largest vocabularies are about 260k).
MAX_MODEL_HIDDEN = 65536
MAX_INTERMEDIATE = 262144
MAX_LAYERS = 512
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB = 2**20
MAX_CONFIG_BYTES = 2**20  # a config.json is a few KiB
MAX_CONFIG_DEPTH = 32  # published configs nest 3 levels (rope_scaling, quantization_config); more is no config
MAX_CONFIG_INTEGER = 2**63  # transformers turns some whole numbers into floats or C integers: bound them
# rope types whose frequencies are chosen from the positions' values during the forward pass (a
# tensor read back to Python with .item()): on the meta device there are no values to read
DATA_DEPENDENT_ROPES = {"dynamic": "dynamic NTK scaling recomputes its frequencies from the largest position seen",
                        "longrope": "longrope picks its short or long factors from the largest position seen"}


class ConfigError(LabError, ValueError):
    """A config that cannot be used: one line naming the key. A ValueError too, so that a document
    holding a bad config reads as a malformed document where documents are checked."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory of inference depends on, checked once where it is built."""

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
    attention_bias: bool
    max_positions: int | None
    raw: dict  # the config as given, passed to transformers unchanged

    def parameter_count(self) -> int:
        """Parameters of the model transformers builds from this config (tied ones once)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.attention_bias else 0
        if self.model_type == "llama" and self.attention_bias:
            bias += self.hidden  # llama's attention_bias also puts a bias on o_proj
        mlp = 3 * self.hidden * self.intermediate
        per_layer = q + kv + o + bias + mlp + 2 * self.hidden  # two RMSNorm weights
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden  # final norm

    def parameter_bytes(self, dtype: str) -> int:
        return self.parameter_count() * DTYPE_BYTES[dtype]

    def kv_cache_bytes(self, batch: int, tokens: int, dtype: str) -> int:
        """Keys and values of every layer for `tokens` positions."""
        return 2 * self.layers * batch * self.kv_heads * tokens * self.head_dim * DTYPE_BYTES[dtype]

    def describe(self) -> dict:
        return {
            "config_name": self.name, "architecture": self.architecture, "model_type": self.model_type,
            "layers": self.layers, "hidden": self.hidden, "intermediate": self.intermediate,
            "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
            "vocab": self.vocab, "tied_embeddings": self.tied_embeddings,
            "attention_bias": self.attention_bias, "max_positions": self.max_positions,
            "parameter_count": self.parameter_count(),
        }


def bundled_names() -> list:
    """Names of the configs shipped under data/models/."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def _whole(raw: dict, key: str, low: int, high: int, default=None) -> int:
    if key not in raw:
        if default is None:
            raise ConfigError(f"config lacks the required key {key!r}")
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key {key!r} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"config key {key!r} must be from {low} to {high}, got {value}")
    return value


def _flag(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    return value


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


def parse_config(raw, name: str) -> ModelShape:
    """Check a config dict and return its shape; raise ConfigError naming the key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: a config.json must hold a JSON object")
    for key, value in raw.items():
        _check_values(value, key)
    for key in REQUIRED_KEYS:
        if key not in raw:
            raise ConfigError(f"config lacks the required key {key!r}")
    model_type = raw["model_type"]
    if not isinstance(model_type, str):
        raise ConfigError(f"config key 'model_type' must be a string, got {type(model_type).__name__}")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"config key 'model_type' names an unsupported architecture {model_type!r}; "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("quantization_config") is not None:
        raise ConfigError("config key 'quantization_config': quantised weights are not covered")
    hidden = _whole(raw, "hidden_size", 1, MAX_MODEL_HIDDEN)
    intermediate = _whole(raw, "intermediate_size", 1, MAX_INTERMEDIATE)
    layers = _whole(raw, "num_hidden_layers", 1, MAX_LAYERS)
    heads = _whole(raw, "num_attention_heads", 1, MAX_HEADS)
    kv_heads = _whole(raw, "num_key_value_heads", 1, MAX_HEADS, default=heads)
    vocab = _whole(raw, "vocab_size", 1, MAX_VOCAB)
    if raw.get("head_dim") is None:
        if hidden % heads:
            raise ConfigError(f"config key 'num_attention_heads' ({heads}) must divide 'hidden_size' ({hidden})")
        head_dim = hidden // heads
    else:
        head_dim = _whole(raw, "head_dim", 1, MAX_HEAD_DIM)
    if heads % kv_heads:
        raise ConfigError(f"config key 'num_key_value_heads' ({kv_heads}) must divide "
                          f"'num_attention_heads' ({heads})")
    if head_dim % 2:
        raise ConfigError(f"config key 'head_dim' must be even for rotary embeddings, got {head_dim}")
    max_positions = raw.get("max_position_embeddings")
    if max_positions is not None:
        max_positions = _whole(raw, "max_position_embeddings", 1, 2**31 - 1)
    tied = _flag(raw, "tie_word_embeddings", False)  # the default of all three config classes
    if model_type == "qwen2":
        bias = True  # qwen2's q, k and v projections always carry a bias
        if _flag(raw, "use_sliding_window", False):
            raise ConfigError("config key 'use_sliding_window': sliding-window attention is not covered")
    else:
        bias = _flag(raw, "attention_bias", False)
    if _flag(raw, "mlp_bias", False):
        raise ConfigError("config key 'mlp_bias': biased MLP projections are not covered")
    if model_type == "mistral" and raw.get("sliding_window") is not None:
        raise ConfigError("config key 'sliding_window': sliding-window attention is not covered (set it to null)")
    for key in ("hidden_act",):
        if raw.get(key, "silu") != "silu":
            raise ConfigError(f"config key {key!r} must be 'silu', got {raw[key]!r}")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != layers
                                    or not all(isinstance(t, str) for t in layer_types)):
        raise ConfigError(f"config key 'layer_types' must be a list of {layers} strings (one per layer)")
    pad = raw.get("pad_token_id")
    # nn.Embedding's padding_idx: a token id, or counted from the end of the vocabulary when negative
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab):
        raise ConfigError(f"config key 'pad_token_id' must be null or a token id from {-vocab} to {vocab - 1}, "
                          f"got {pad!r}")
    if raw.get("rope_theta") is not None:
        _positive_number(raw["rope_theta"], "rope_theta")
    _rope_block(raw)
    return ModelShape(name=name, architecture=SUPPORTED_ARCHITECTURES[model_type], model_type=model_type,
                      hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                      kv_heads=kv_heads, head_dim=head_dim, vocab=vocab, tied_embeddings=tied,
                      attention_bias=bias, max_positions=max_positions, raw=dict(raw))


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


def load_config(path_or_name: str) -> ModelShape:
    """Read a config.json path, a Hugging Face model folder holding one, or a bundled config NAME,
    and check it."""
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
    return parse_config(data, name)


def check_tensor_parallel(shape: ModelShape, degree) -> None:
    """Raise ConfigError unless `degree` GPUs can split `shape` with transformers' plan.

    The plan of the three supported families shards q, k and v projections by output
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
    for key, value in (("num_attention_heads", shape.heads), ("num_key_value_heads", shape.kv_heads),
                       ("hidden_size", shape.hidden), ("intermediate_size", shape.intermediate),
                       ("vocab_size", shape.vocab)):
        if value % degree:
            raise ConfigError(f"--tensor-parallel {degree} does not divide config key {key!r} ({value}), "
                              f"which the tensor-parallel plan splits across the GPUs")
    if shape.tied_embeddings:
        raise ConfigError("config key 'tie_word_embeddings': tied embeddings at tensor parallel > 1 are not "
                          "covered (the plan splits lm_head but not the embedding it shares)")
