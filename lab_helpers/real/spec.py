"""One inference run of a real model (config, dtype, sizes, decode recording), checked once where it is
built, and the blocks of a document that describe it."""
from dataclasses import asdict, dataclass

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.numbers import DTYPE_BYTES, parse_device
from lab_helpers.measurement.schema import MAX_TENSOR_PARALLEL
from lab_helpers.real.config import ModelShape

REAL_PHASE_NAMES = ("model_load", "inputs", "prefill", "decode")
COUNTER_KEYS = ("baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes",
                "end_reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes")
# Absurd requests are refused before any work.
MAX_MODEL_BATCH = 65536
MAX_MODEL_CONTEXT = 2**22
MAX_MODEL_NEW_TOKENS = 4096
MAX_TOKENS = 2**26  # batch x (context + new tokens)


@dataclass(frozen=True)
class RunSpec:
    """One inference run: a model config, dtype, sizes and the decode recording. A bad value raises
    ParameterError (a LabError naming the field) when the spec is built (dataclasses.replace builds a new one, checked the same way)."""

    config_name: str
    dtype: str = "bfloat16"
    batch: int = 1
    context: int = 128
    new_tokens: int = 8
    device: str = "cuda:0"
    seed: int = 0
    decode_record_every: int = 1
    tensor_parallel: int = 1  # GPUs the model is split across with transformers' plan

    def __post_init__(self):
        parse_device(self.device)  # an explicit cuda:N, checked before torch is imported
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TENSOR_PARALLEL:
            raise ParameterError("tensor_parallel", f"must be a whole number from 1 to {MAX_TENSOR_PARALLEL}, got {tp!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ParameterError("dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        for name, high in (("batch", MAX_MODEL_BATCH), ("context", MAX_MODEL_CONTEXT),
                           ("new_tokens", MAX_MODEL_NEW_TOKENS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ParameterError(name, f"must be a whole number from 1 to {high}, got {value!r}")
        if self.batch * (self.context + self.new_tokens) > MAX_TOKENS:
            raise LabError(f"batch x (context + new tokens) must be at most {MAX_TOKENS}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ParameterError("seed", f"must be a whole number >= 0, got {self.seed!r}")
        if not isinstance(self.decode_record_every, int) or self.decode_record_every < 1:
            raise ParameterError("decode_record_every", f"must be a whole number >= 1, got {self.decode_record_every!r}")


def recorded_steps(new_tokens: int, every: int) -> list:
    """Decode steps (0-based) that get a record: every `every`-th one, and the last.

    `new_tokens` N is N decode steps after the prefill (whose greedy token feeds step 0)."""
    steps = [s for s in range(new_tokens) if s % every == 0]
    if new_tokens - 1 not in steps:
        steps.append(new_tokens - 1)
    return steps


def run_configuration(spec: RunSpec) -> dict:
    """The configuration block of a document; a one-GPU document keeps its format (no tensor_parallel)."""
    configuration = {"kind": "transformers", **asdict(spec)}
    if spec.tensor_parallel == 1:
        del configuration["tensor_parallel"]
    return configuration


def model_description(shape: ModelShape, dtype: str) -> dict:
    """The model block of a document: the shape's facts, the weights' bytes and the config itself."""
    from lab_helpers.core.packages import installed_version
    info = shape.describe()
    info["parameter_bytes"] = shape.parameter_bytes(dtype)
    info["transformers_version"] = installed_version("transformers")
    info["config"] = shape.raw  # so that a measurement file can be predicted again on its own
    return info
