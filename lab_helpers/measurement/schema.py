"""The measurement file: its JSON Schema, applied with the standard library alone, and its reader."""
import json
import re

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import SCHEMA_VERSION, display_path, read_json_file
from lab_helpers.core.numbers import DTYPE_BYTES


PHASES = ("model_load", "inputs", "cold_forward", "warmup", "warm_forward")


# --task train: after model_load and inputs, each optimizer step records these four phases
TRAIN_STEP_PHASES = ("forward", "backward", "optimizer_step", "zero_grad")


TRAIN_OPTIMIZERS = ("adamw", "sgd")
# --quantize: bitsandbytes' 4-bit type, "-double" when the absmax is quantized again (QLoRA's base);
# or 8-bit weights, LLM.int8() with its outlier threshold at 0 (every column computed in 8 bits)
FOUR_BIT_KINDS = ("nf4", "nf4-double", "fp4", "fp4-double")
QUANTIZE_KINDS = FOUR_BIT_KINDS + ("int8-threshold-0",)


MAX_TRAIN_STEPS = 1000


COUNTERS = ("allocated", "reserved")


MAX_BATCH = 2**20


MAX_CONTEXT = 2**20


MAX_WIDTH = 2**20


MAX_HIDDEN = 2**22


MAX_PASSES = 10_000  # --warmup and --repeats: each pass is a record or a loop turn


MAX_SEED = 2**63 - 1


MAX_NEW_TOKENS = 2**20


MAX_COUNTER_BYTES = 2**60  # far above any device; keeps byte arithmetic within int64


MAX_PHASE_RECORDS = 2**20 + 16


_COUNT = {"type": "integer", "minimum": 1}


MAX_TENSOR_PARALLEL = 64  # ranks of one tensor-parallel run (torchrun, one process per GPU)


_BYTES = {"$ref": "#/$defs/bytes"}


# The JSON Schema of a measurement file, written out as measurement.schema.json; read_measurement
# applies it with the standard library alone (this file ships without jsonschema).
MEASUREMENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "iteragpu-lab/measurement.schema.json",
    "title": "IteraGPU Lab measurement (synthetic network or transformers model)",
    "type": "object",
    "required": ["schema_version", "kind", "environment", "configuration"],
    "additionalProperties": False,
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "kind": {"const": "iteragpu-lab measurement"},
        "environment": {"$ref": "#/$defs/environment"},
        "configuration": {"type": "object"},
        "synthetic_model": {"type": "object"},
        "model": {"type": "object"},
        "phases": {"type": "array", "minItems": 1, "maxItems": MAX_PHASE_RECORDS,
                   "items": {"$ref": "#/$defs/phase"}},
        # a tensor-parallel file: every rank's phases instead of top-level phases
        "ranks": {"type": "array", "minItems": 1, "maxItems": MAX_TENSOR_PARALLEL, "items": {"$ref": "#/$defs/rank"}},
    },
    "allOf": [
        {"if": {"required": ["configuration"],
                "properties": {"configuration": {"type": "object", "required": ["tensor_parallel"],
                                                 "properties": {"tensor_parallel": {"minimum": 2}}}}},
         "then": {"required": ["ranks"]}, "else": {"properties": {"ranks": False}}},
        {"if": {"required": ["ranks"]}, "then": {"properties": {"phases": False}}, "else": {"required": ["phases"]}},
    ],
    "if": {"required": ["configuration"],
           "properties": {"configuration": {"type": "object", "required": ["kind"],
                                            "properties": {"kind": {"const": "transformers"}}}}},
    "then": {"required": ["model"], "properties": {
        "configuration": {"$ref": "#/$defs/transformers_configuration"},
        "synthetic_model": False,
        "phases": {"items": {"properties": {"phase": {"enum": ["model_load", "inputs", "prefill", "decode",
                                                                *TRAIN_STEP_PHASES]}}}},
        "ranks": {"items": {"properties": {"phases": {"items": {"properties": {
            "phase": {"enum": ["model_load", "inputs", "prefill", "decode"]}}}}}}},
    }},
    "else": {"required": ["synthetic_model"], "properties": {
        "configuration": {"$ref": "#/$defs/synthetic_configuration"},
        "synthetic_model": {"$ref": "#/$defs/synthetic_model"},
        "model": False,
        "phases": {"minItems": 5, "maxItems": 4 + MAX_PASSES,
                   "items": {"properties": {"phase": {"enum": [*PHASES, *TRAIN_STEP_PHASES]}}}},
        "ranks": {"items": {"properties": {"phases": {"minItems": 5, "maxItems": 4 + MAX_PASSES,
                                                      "items": {"properties": {"phase": {"enum": list(PHASES)}}}}}}},
    }},
    "$defs": {
        "bytes": {"type": "integer", "minimum": 0, "maximum": MAX_COUNTER_BYTES},
        "device": {"type": "string", "pattern": "^cuda:[0-9]{1,6}$"},
        "dtype": {"enum": list(DTYPE_BYTES)},
        "environment": {
            "type": "object",
            "required": ["python_version", "torch_version", "cuda_build_version", "hip_build_version",
                         "runtime_note", "device", "device_count", "device_visible", "device_name",
                         "compute_capability", "total_memory_bytes", "free_memory_bytes"],
            "properties": {
                "python_version": {"type": "string"},
                "torch_version": {"type": "string"},
                "cuda_build_version": {"type": ["string", "null"]},
                "hip_build_version": {"type": ["string", "null"]},
                "runtime_note": {"type": "string"},
                "device": {"$ref": "#/$defs/device"},
                "device_count": _COUNT,
                "device_visible": {"const": True},
                "device_name": {"type": "string"},
                "compute_capability": {"type": "string", "pattern": "^[0-9]{1,4}\\.[0-9]{1,4}$"},
                "total_memory_bytes": {"type": "integer", "minimum": 1, "maximum": MAX_COUNTER_BYTES},
                "free_memory_bytes": _BYTES,
                "usable_memory_bytes": {"type": ["integer", "string", "null"]},
            },
        },
        "synthetic_configuration": {
            "type": "object",
            "required": ["device", "batch", "context", "width", "hidden", "dtype", "warmup", "repeats", "seed"],
            "additionalProperties": False,
            "properties": {
                "kind": {"const": "synthetic"},
                "device": {"$ref": "#/$defs/device"},
                "batch": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH},
                "context": {"type": "integer", "minimum": 1, "maximum": MAX_CONTEXT},
                "width": {"type": "integer", "minimum": 1, "maximum": MAX_WIDTH},
                "hidden": {"type": "integer", "minimum": 1, "maximum": MAX_HIDDEN},
                "dtype": {"$ref": "#/$defs/dtype"},
                "warmup": {"type": "integer", "minimum": 0, "maximum": MAX_PASSES},
                "repeats": {"type": "integer", "minimum": 1, "maximum": MAX_PASSES},
                "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
                "tensor_parallel": {"type": "integer", "minimum": 1, "maximum": MAX_TENSOR_PARALLEL},
                # --task train only (an inference file has none of these keys)
                "task": {"const": "train"},
                "steps": {"type": "integer", "minimum": 2, "maximum": MAX_TRAIN_STEPS},
                "optimizer": {"enum": list(TRAIN_OPTIMIZERS)},
                "fused": {"type": "boolean"},
            },
        },
        "rank": {
            "type": "object",
            "required": ["rank", "device", "phases"],
            "properties": {
                "rank": {"type": "integer", "minimum": 0, "maximum": MAX_TENSOR_PARALLEL - 1},
                "device": {"$ref": "#/$defs/device"},
                "device_name": {"type": "string"},
                # what NCCL holds outside PyTorch's allocator on this rank's device
                "outside_allocator": {"type": ["object", "null"], "properties": {
                    "before_bytes": _BYTES, "after_bytes": _BYTES,
                    "nccl_outside_allocator_bytes": {"type": "integer", "minimum": -MAX_COUNTER_BYTES,
                                                     "maximum": MAX_COUNTER_BYTES}}},
                "phases": {"type": "array", "minItems": 1, "maxItems": MAX_PHASE_RECORDS,
                           "items": {"$ref": "#/$defs/phase"}},
            },
        },
        "transformers_configuration": {
            "type": "object",
            "required": ["kind", "config_name", "dtype", "batch", "context", "device", "seed"],
            # inference: new_tokens and decode_record_every; --task train: the training keys instead
            "if": {"required": ["task"]},
            "then": {"required": ["steps", "optimizer", "fused", "train", "gradient_checkpointing"]},
            "else": {"required": ["new_tokens", "decode_record_every"]},
            "properties": {
                "task": {"const": "train"},
                "steps": {"type": "integer", "minimum": 2, "maximum": MAX_TRAIN_STEPS},
                "optimizer": {"enum": list(TRAIN_OPTIMIZERS)},
                "fused": {"type": "boolean"},
                "train": {"enum": ["full", "lora", "qlora"]},
                "quantize": {"enum": list(FOUR_BIT_KINDS)},  # --train qlora's 4-bit base
                "autocast": {"enum": ["bfloat16"]},  # float32 weights, the forward under bfloat16 autocast
                "lora_rank": {"type": "integer", "minimum": 1},
                "lora_targets": {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "string"}},
                "gradient_checkpointing": {"type": "boolean"},
                "kind": {"const": "transformers"},
                "config_name": {"type": "string", "minLength": 1},
                "dtype": {"$ref": "#/$defs/dtype"},
                "batch": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH},
                "context": {"type": "integer", "minimum": 1, "maximum": MAX_CONTEXT},
                "new_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_NEW_TOKENS},
                "device": {"$ref": "#/$defs/device"},
                "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
                "decode_record_every": {"type": "integer", "minimum": 1, "maximum": MAX_NEW_TOKENS},
            },
        },
        "synthetic_model": {
            "type": "object",
            "required": ["layers", "width", "hidden", "parameter_shapes", "parameter_count", "parameter_bytes",
                         "forward_flops"],
            "properties": {
                "layers": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3},
                "width": {"type": "integer", "minimum": 1, "maximum": MAX_WIDTH},
                "hidden": {"type": "integer", "minimum": 1, "maximum": MAX_HIDDEN},
                "parameter_shapes": {"type": "object"},
                "parameter_count": {"type": "integer", "minimum": 1},
                "parameter_bytes": {"type": "integer", "minimum": 1},
                "forward_flops": {"type": "integer", "minimum": 1},
            },
        },
        "phase": {
            "type": "object",
            "required": ["phase", "index", "passes", "seconds", "device_seconds",
                         "baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes",
                         "end_reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes"],
            "additionalProperties": False,
            "properties": {
                "phase": {"type": "string"},
                "index": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_PHASE_RECORDS},
                "passes": {"type": "integer", "minimum": 0, "maximum": MAX_NEW_TOKENS},
                "seconds": {"type": "number", "minimum": 0},
                "device_seconds": {"type": "number", "minimum": 0},
                "baseline_allocated_bytes": _BYTES,
                "baseline_reserved_bytes": _BYTES,
                "end_allocated_bytes": _BYTES,
                "end_reserved_bytes": _BYTES,
                "peak_allocated_bytes": _BYTES,
                "peak_reserved_bytes": _BYTES,
                "achieved_tflops": {"type": "number", "exclusiveMinimum": 0},
                "host_to_device_time_ratio": {"type": "number", "exclusiveMinimum": 0},
                # the device's free bytes (torch.cuda.mem_get_info) before and after the phase: with
                # reserved, the budget compare replays the allocator under (absent in older files)
                "baseline_device_free_bytes": _BYTES,
                "end_device_free_bytes": _BYTES,
                # kind -> bytes (weights, inputs, workspace, activations, kv_cache...): a prediction's split
                "end_allocated_bytes_by_kind": {"type": "object"},
            },
        },
    },
}


_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    # JSON Schema counts 3.0 as an integer: a number with no fractional part
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
}


def _same_json(a, b) -> bool:
    """Equality as JSON Schema's const/enum mean it: true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def schema_errors(value, schema, where: str, root: dict):
    """Yield (json path, problem) for every rule of `schema` that `value` breaks (the keywords
    measurement.schema.json uses; its nesting is bounded by MAX_JSON_DEPTH)."""
    if schema is True:
        return
    if schema is False:
        yield where, "is not allowed here"
        return
    if "if" in schema:  # first: a kind's own bounds (phases of a synthetic file) fail before a long walk
        branch = "then" if next(schema_errors(value, schema["if"], where, root), None) is None else "else"
        if branch in schema:
            yield from schema_errors(value, schema[branch], where, root)
    for part in schema.get("allOf", ()):
        yield from schema_errors(value, part, where, root)
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        yield from schema_errors(value, target, where, root)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_JSON_TYPES[t](value) for t in types):
            yield where, f"must be {' or '.join(types)}, got {_json_type_name(value)}"
            return
    if "const" in schema and not _same_json(value, schema["const"]):
        yield where, f"must be {json.dumps(schema['const'])}, got {_short_json(value)}"
    if "enum" in schema and not any(_same_json(value, option) for option in schema["enum"]):
        yield where, f"must be one of {', '.join(json.dumps(o) for o in schema['enum'])}, got {_short_json(value)}"
    if _JSON_TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            yield where, f"must be at least {schema['minimum']}, got {_short_json(value)}"
        if "maximum" in schema and value > schema["maximum"]:
            yield where, f"must be at most {schema['maximum']}, got {_short_json(value)}"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            yield where, f"must be more than {schema['exclusiveMinimum']}, got {_short_json(value)}"
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            yield where, f"must have at least {schema['minLength']} character(s)"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield where, f"does not match {schema['pattern']}: {_short_json(value)}"
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            yield where, f"must hold at least {schema['minItems']} item(s), got {len(value)}"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield where, f"must hold at most {schema['maxItems']} items, got {len(value)}"
        if "items" in schema:
            for i, item in enumerate(value):
                yield from schema_errors(item, schema["items"], f"{where}[{i}]", root)
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                yield where, f"lacks the required key {key!r}"
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                yield from schema_errors(item, properties[key], _json_path(where, key), root)
            elif schema.get("additionalProperties", True) is False:
                yield where, f"has an unknown key {key[:60]!r}"


def _json_path(where: str, key: str) -> str:
    return f"{where}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{where}[{json.dumps(key[:60])}]"


def _json_type_name(value) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def _short_json(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else _json_type_name(value)
    return text if len(text) <= 40 else text[:40] + "..."


def measurement_problems(document) -> list:
    """Every (json path, problem) of `document` against MEASUREMENT_SCHEMA; empty when valid."""
    return list(schema_errors(document, MEASUREMENT_SCHEMA, "$", MEASUREMENT_SCHEMA))


def read_measurement(path) -> dict:
    """Read and validate a measurement file (synthetic or transformers) against every rule of
    measurement.schema.json; raise LabError '<path>: <json path>: <problem>' on the first fault."""
    document = read_json_file(path)
    problem = next(schema_errors(document, MEASUREMENT_SCHEMA, "$", MEASUREMENT_SCHEMA), None)
    if problem:
        raise LabError(f"{display_path(path)}: {problem[0]}: {problem[1]}")
    return document
