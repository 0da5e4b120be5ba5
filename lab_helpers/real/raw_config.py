"""A config.json checked with the standard library alone, before torch or transformers is imported.

Everything that can refuse a config from its text does so here (reading the file, the JSON, the
bounds of the size keys, remote code, quantized weights, rope types, encoder families), so that a
bad config ends in one line in well under a second. What transformers' own source says (its
causal-LM mapping, a config class's defaults) is read from its files by path with ast, never by
importing it: the import alone costs seconds of CPU.
"""
import ast
import difflib
import functools
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.files import read_bounded_text
from lab_helpers.core.paths import REPOSITORY
from lab_helpers.core.text import printable

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
MAX_POSITIONS = 2**31 - 1  # positions are int32 indices in the attention masks
MAX_CONFIG_BYTES = 2**20  # a config.json is a few KiB
MAX_CONFIG_DEPTH = 32  # published configs nest 3 levels (rope_scaling, quantization_config); more is no config
MAX_CONFIG_INTEGER = 2**63  # transformers turns some whole numbers into floats or C integers: bound them
# rope types whose frequencies are chosen from the positions' values during the forward pass (a
# tensor read back to Python with .item()): on the meta device there are no values to read
DATA_DEPENDENT_ROPES = {"dynamic": "dynamic NTK scaling recomputes its frequencies from the largest position seen",
                        "longrope": "longrope picks its short or long factors from the largest position seen"}
# The whole-number keys the supported families' config classes and modeling code read, with the
# lab's bounds. Checked on the raw JSON: transformers divides by some of them (heads, the sliding
# pattern, the sparse step) while it builds the config, before any bound of the lab could run.
SIZE_KEYS = {
    **dict.fromkeys(("hidden_size", "n_embd", "kv_lora_rank", "q_lora_rank"), MAX_MODEL_HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "decoder_sparse_step", "sliding_window_pattern"), MAX_LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads"), MAX_HEADS),
    **dict.fromkeys(("intermediate_size", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size"),
                    MAX_INTERMEDIATE),
    **dict.fromkeys(("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), MAX_HEAD_DIM),
    "vocab_size": MAX_VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "sliding_window"), MAX_POSITIONS),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok"), MAX_EXPERTS),
}
# keys some family's config class takes as null for "not used" or "the default" (GPT-2's width of
# four times n_embd, no sliding window, head_dim of hidden / heads, as many key/value heads as
# heads, DeepSeek's q_lora_rank for no compressed queries), as transformers 5.17 builds them; a
# family that refuses the null then does so through transformers, in one line naming the key
NULLABLE_SIZE_KEYS = frozenset(("n_inner", "sliding_window", "head_dim", "num_key_value_heads", "q_lora_rank"))
# families of transformers' auto mappings that are not decoder-only: an encoder (masked LM) or an
# encoder-decoder, even where the causal-LM mapping lists a decoder head for them (BertLMHeadModel)
NOT_DECODER_MAPPINGS = ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")
CAUSAL_LM_MAPPING = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


class ConfigError(LabError, ValueError):
    """A config that cannot be used: one line naming the key. A ValueError too, so that a document
    holding a bad config reads as a malformed document where documents are checked."""


class ConfigParameterError(ConfigError, ParameterError):
    """A ConfigError about one parameter's value, named as the caller gave it (lab_helpers.core.errors'
    ParameterError: the command line names its flag)."""


@dataclass(frozen=True)
class RawConfig:
    """A config.json as read and checked before transformers: `raw` as given, `name` (its bundled
    name or its file's stem), `shown` (as the user typed it), and the positions transformers will
    read (max_position_embeddings or its family's alias, else the class default; None where the
    family has none or its default cannot be read from the source)."""

    raw: dict
    name: str
    shown: str
    model_type: str
    max_positions: "int | None"


def bundled_names() -> list:
    """Names of the configs shipped under data/models/."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def check_values(value, key: str, depth: int = 0) -> None:
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
            check_values(item, inner, depth + 1)
    elif isinstance(value, list):
        for item in value:
            check_values(item, key, depth + 1)


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


def bounded(value, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key {key!r} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"config key {key!r} must be from {low} to {high}, got {value}")
    return value


def check_size_keys(raw: dict, prefix: str = "") -> None:
    """The bounds of SIZE_KEYS on the raw JSON, at the top level and inside text_config."""
    for key, high in SIZE_KEYS.items():
        if key not in raw:
            continue
        value = raw[key]
        if value is None:
            if key in NULLABLE_SIZE_KEYS:
                continue
            raise ConfigError(f"config key {prefix + key!r} must be a whole number from 1 to {high}, got null")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {prefix + key!r} must be a whole number from 1 to {high}, "
                              f"got {printable(json.dumps(value))[:40]}")
        bounded(value, prefix + key, 1, high)
    if not prefix and isinstance(raw.get("text_config"), dict):
        check_size_keys(raw["text_config"], "text_config.")


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
    check_size_keys(raw)
    _refuse_what_is_not_a_decoder(raw, model_type)
    return model_type


def transformers_source(relative: str) -> "Path | None":
    """A file of the installed transformers package, found on sys.path as the import system finds a
    regular package, without importing it; None where it is not there."""
    for entry in sys.path:
        package = Path(entry or ".") / "transformers"
        if (package / "__init__.py").is_file():
            return package / relative if (package / relative).is_file() else None
    return None


@functools.lru_cache(maxsize=None)
def transformers_source_version() -> "str | None":
    """transformers' __version__ as its __init__.py spells it."""
    path = transformers_source("__init__.py")
    try:
        found = re.search(r'^__version__\s*=\s*"([^"]+)"', path.read_text(encoding="utf-8"), re.M) if path else None
    except (OSError, UnicodeDecodeError):
        return None
    return found.group(1) if found else None


@functools.lru_cache(maxsize=None)
def auto_mapping_names(relative: str) -> dict:
    """The OrderedDict literals (name -> dict) at the top level of a transformers source file; empty
    where the file cannot be found or read."""
    path = transformers_source(relative)
    found = {}
    if path is None:
        return found
    try:
        body = ast.parse(path.read_text(encoding="utf-8")).body
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return found
    for node in body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "OrderedDict"
                and len(node.value.args) == 1 and not node.value.keywords):
            try:
                found[node.targets[0].id] = dict(ast.literal_eval(node.value.args[0]))
            except (ValueError, TypeError, SyntaxError):
                continue
    return found


def bundled_model_types() -> list:
    """The model types of the bundled configs (data/models), sorted; a file that cannot be read is passed over."""
    families = set()
    for name in bundled_names():
        try:
            families.add(json.loads((MODELS_DIR / f"{name}.json").read_text(encoding="utf-8"))["model_type"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(families)


def supported_families_text() -> str:
    return ("the lab predicts decoder-only causal language models (transformers' AutoModelForCausalLM), "
            f"such as the bundled configs' families {', '.join(bundled_model_types())}")


def _refuse_what_is_not_a_decoder(raw: dict, model_type: str) -> None:
    """An encoder or encoder-decoder family (BERT, RoBERTa, T5, BART), or a config whose
    `architectures` names no causal-LM class, is refused before any tracing."""
    mappings = auto_mapping_names("models/auto/modeling_auto.py")
    causal = mappings.get(CAUSAL_LM_MAPPING)
    if not causal:
        return  # the source could not be read: transformers itself decides once imported
    supported = supported_families_text()
    for mapping in NOT_DECODER_MAPPINGS:
        if model_type in mappings.get(mapping, {}):
            what = "an encoder" if mapping == NOT_DECODER_MAPPINGS[0] else "an encoder-decoder"
            raise ConfigError(f"config key 'model_type': {printable(model_type)!r} is {what} family, not a "
                              f"decoder-only causal language model; {supported}")
    known = auto_mapping_names("models/auto/auto_mappings.py").get("CONFIG_MAPPING_NAMES") or {}
    version = transformers_source_version() or "installed"
    if model_type not in causal and known and model_type not in known:
        raise ConfigError(f"config key 'model_type' names {printable(model_type)!r}, a model type transformers "
                          f"{version} does not know (and remote code is never run)")
    if model_type not in causal and known:
        raise ConfigError(f"config key 'model_type': {printable(model_type)!r} has no causal language model in "
                          f"transformers {version} (AutoModelForCausalLM cannot build it); {supported}")
    architectures = raw.get("architectures")
    if architectures is None:
        return
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError("config key 'architectures' must be a list of class names")
    classes = {c for value in causal.values() for c in ((value,) if isinstance(value, str) else value)}
    if architectures and not any(a in classes for a in architectures):
        named = ", ".join(printable(a) for a in architectures[:3])
        raise ConfigError(f"config key 'architectures' names {named}, no causal language model class of "
                          f"transformers; {supported}")


def _class_field(model_type: str, attribute: str) -> tuple:
    """(read, field, default) of `attribute` in the source of model_type's config class: the field
    it is stored in through the class's attribute_map (GPT-2's max_position_embeddings is
    n_positions) and its default; field None where the class has no such attribute, read False
    where the source cannot say."""
    names = auto_mapping_names("models/auto/auto_mappings.py")
    class_name = (names.get("CONFIG_MAPPING_NAMES") or {}).get(model_type)
    module = (names.get("SPECIAL_MODEL_TYPE_TO_MODULE_NAME") or {}).get(model_type, model_type.replace("-", "_"))
    path = transformers_source(f"models/{module}/configuration_{module}.py") if class_name else None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8")) if path else None
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        tree = None
    for node in tree.body if tree else ():
        if not (isinstance(node, ast.ClassDef) and node.name == class_name):
            continue
        fields, aliases = {}, {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                fields[item.target.id] = item.value
            elif isinstance(item, ast.Assign) and getattr(item.targets[0], "id", None) == "attribute_map":
                try:
                    aliases = dict(ast.literal_eval(item.value))
                except (ValueError, TypeError, SyntaxError):
                    return False, None, None
        field = aliases.get(attribute, attribute)
        if field not in fields:
            # a class of another file's base may declare it: only a class whose bases are
            # transformers' own base config is known to lack it
            plain = all(getattr(base, "id", None) in ("PreTrainedConfig", "PretrainedConfig") for base in node.bases)
            return plain, None, None
        default = _whole_number(fields[field])
        return default is not None or fields[field] is None, field, default
    return False, None, None


def _whole_number(node) -> "int | None":
    """The value of a default written as whole numbers, + - * // and ** (Mistral's 4096 * 32)."""
    operators = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                 ast.FloorDiv: lambda a, b: a // b if b else None, ast.Pow: lambda a, b: a ** b if 0 <= b < 64 else None}
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, int) and not isinstance(node.value, bool) else None
    if isinstance(node, ast.BinOp) and type(node.op) in operators:
        left, right = _whole_number(node.left), _whole_number(node.right)
        return None if left is None or right is None else operators[type(node.op)](left, right)
    return None


def _max_positions(raw: dict, model_type: str) -> "int | None":
    """The positions transformers will read: the key as given (or the field its family stores it
    in), else its config class's default; of text_config where the config holds one."""
    if isinstance(raw.get("text_config"), dict) and isinstance(raw["text_config"].get("model_type"), str):
        raw, model_type = raw["text_config"], raw["text_config"]["model_type"]
    read, field, default = _class_field(model_type, "max_position_embeddings")
    if read and field is None:
        return None  # the family has no positions bound
    for key in (field or "max_position_embeddings", "max_position_embeddings"):
        if isinstance(raw.get(key), int) and not isinstance(raw[key], bool):
            return raw[key]
    return default if isinstance(default, int) and not isinstance(default, bool) else None


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


def _not_found(text: str) -> ConfigError:
    """A --config that names nothing here: the closest bundled name (a Hugging Face id's last part,
    case-insensitive), and how to pass a downloaded config.json."""
    names = bundled_names()
    typed = text.rstrip("/").rsplit("/", 1)[-1].lower()
    close = difflib.get_close_matches(typed, [n.lower() for n in names], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return ConfigParameterError("config", f"{printable(text)} is neither a file nor a bundled config "
                                         f"({', '.join(names)}), nor a model folder holding a config.json; {hint}"
                                         f"for a Hugging Face model, download its config.json and pass its path "
                                         f"(or the folder holding it)")


def read_config_file(path_or_name) -> tuple:
    """(data, name, shown) of a config.json path, a Hugging Face model folder holding one, or a
    bundled config NAME: the file read within MAX_CONFIG_BYTES and its JSON checked."""
    text = str(path_or_name)
    path = Path(text)
    if not text.endswith(".json") and not path.exists():
        if text not in bundled_names():
            raise _not_found(text)
        path, name = MODELS_DIR / f"{text}.json", text
        shown = path.name  # a bundled config: its file name, not where the lab is installed
    elif path.is_dir():
        # a Hugging Face model folder (as from_pretrained reads it): its config.json
        if not (path / "config.json").is_file():
            raise ConfigParameterError("config", f"{printable(text)} is a folder without a config.json, not a regular "
                                                 f"file; give a config.json, a model folder holding one, or a "
                                                 f"bundled config ({', '.join(bundled_names())})")
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
    return data, name, shown


def precheck_raw(raw, name: str, shown: "str | None" = None) -> RawConfig:
    """Every check of a config dict that needs neither torch nor transformers; ConfigError naming
    the key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: a config.json must hold a JSON object")
    for key, value in raw.items():
        check_values(value, key)
    model_type = _refuse_before_transformers(raw)
    return RawConfig(raw=raw, name=name, shown=shown if shown is not None else name, model_type=model_type,
                     max_positions=_max_positions(raw, model_type))


def precheck_config(path_or_name) -> RawConfig:
    """Read a config.json path, a model folder holding one, or a bundled config NAME, and check it
    without importing torch, transformers or huggingface_hub; ConfigError (one line) otherwise."""
    data, name, shown = read_config_file(path_or_name)
    return precheck_raw(data, name, shown)
