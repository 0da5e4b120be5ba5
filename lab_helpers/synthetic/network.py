"""The synthetic Linear -> GELU -> Linear network: its configuration, validated once when built, and its description."""
import math
from dataclasses import asdict, dataclass, replace

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.core.numbers import DTYPE_BYTES, parse_device, parse_whole
from lab_helpers.measurement.schema import (MAX_BATCH, MAX_CONTEXT, MAX_HIDDEN, MAX_PASSES, MAX_SEED,
                                            MAX_TENSOR_PARALLEL, MAX_WIDTH)


MAX_TENSOR_BYTES = 2**48  # 256 TiB: above any device, and byte arithmetic stays exact


_CONFIG_BOUNDS = {"batch": (1, MAX_BATCH), "context": (1, MAX_CONTEXT), "width": (1, MAX_WIDTH),
                  "hidden": (1, MAX_HIDDEN), "warmup": (0, MAX_PASSES), "repeats": (1, MAX_PASSES),
                  "seed": (0, MAX_SEED)}


@dataclass(frozen=True)
class MeasureConfig:
    """What to measure; sizes of the Linear -> GELU -> Linear network and its input. Validated once,
    when built: integer types and bounds, dtype, and the device string (parsed into device_index)."""

    device: str = "cuda:0"
    batch: int = 1
    context: int = 16
    width: int = 64
    hidden: int | None = None  # defaults to 4 * width
    dtype: str = "float32"
    warmup: int = 1
    repeats: int = 2
    seed: int = 0
    tensor_parallel: int | None = None  # None: one GPU, the one-GPU file format; N: N ranks under torchrun

    def __post_init__(self):
        for name, (low, high) in _CONFIG_BOUNDS.items():
            value = getattr(self, name)
            if name == "hidden" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ParameterError(name, f"must be an integer, got {type(value).__name__}")
            parse_whole(value, name, low, high)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            shown = repr(self.dtype[:40]) if isinstance(self.dtype, str) else type(self.dtype).__name__
            raise ParameterError("dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {shown}")
        object.__setattr__(self, "_device_index", parse_device(self.device))
        if self.tensor_parallel is not None:
            parse_whole(self.tensor_parallel, "tensor_parallel", 1, MAX_TENSOR_PARALLEL)
            if self.hidden_features % self.tensor_parallel:
                raise ParameterError("tensor_parallel", f"{self.tensor_parallel} does not divide the hidden size "
                                                        f"{self.hidden_features}: each rank holds hidden / N features "
                                                        "of the first Linear")
        largest = max(self.batch * self.context * max(self.hidden_features, self.width),
                      self.hidden_features * self.width) * DTYPE_BYTES[self.dtype]
        if largest > MAX_TENSOR_BYTES:
            raise LabError(f"the largest tensor would take {largest} bytes, more than {MAX_TENSOR_BYTES} "
                           "(256 TiB): lower batch, context, width or hidden")

    @property
    def device_index(self) -> int:
        """N of the device cuda:N, parsed once when the config was built."""
        return self._device_index

    @property
    def hidden_features(self) -> int:
        """`hidden`, or 4 x width when it was not given."""
        return 4 * self.width if self.hidden is None else self.hidden

    def checked(self) -> "MeasureConfig":
        """The same config with `hidden` filled in (validation already ran when it was built)."""
        return self if self.hidden is not None else replace(self, hidden=self.hidden_features)

    @property
    def shard_hidden(self) -> int:
        """Hidden features each rank holds: hidden / tensor_parallel (hidden on one GPU)."""
        return self.hidden_features // (self.tensor_parallel or 1)

    def record(self) -> dict:
        """The configuration as a measurement file stores it (`hidden` filled in; `tensor_parallel`
        only for a tensor-parallel run, so one-GPU files keep their format)."""
        record = {**asdict(self), "hidden": self.hidden_features}
        if self.tensor_parallel is None:
            del record["tensor_parallel"]
        return record


def parameter_shapes(width: int, hidden: int) -> dict:
    """The network's parameter shapes, in the order the model holds (and copies) them."""
    return {"0.weight": [hidden, width], "0.bias": [hidden], "2.weight": [width, hidden], "2.bias": [width]}


def synthetic_model(config: MeasureConfig) -> dict:
    """Describe the network: parameter tensors, counts, bytes and forward FLOPs. At tensor parallel
    N, `tensor_parallel` adds what each rank holds: the first Linear split by output features, the
    second by input features, its bias whole on every rank, and the all-reduce after it."""
    width, hidden = config.width, config.hidden_features
    shapes = parameter_shapes(width, hidden)
    counts = {name: math.prod(shape) for name, shape in shapes.items()}
    element_bytes = DTYPE_BYTES[config.dtype]
    # two matrix products of 2*N*width*hidden each; bias adds and GELU not counted
    flops = 4 * config.batch * config.context * width * hidden
    description = {
        "layers": ["Linear(width, hidden)", "GELU", "Linear(hidden, width)"],
        "width": width, "hidden": hidden,
        "parameter_shapes": shapes,
        "parameter_count": sum(counts.values()),
        "parameter_bytes": sum(counts.values()) * element_bytes,
        "forward_flops": flops,
    }
    if config.tensor_parallel is not None:
        rank_shapes = parameter_shapes(width, config.shard_hidden)
        rank_count = sum(math.prod(shape) for shape in rank_shapes.values())
        description["tensor_parallel"] = {
            "degree": config.tensor_parallel,
            "split": "0.weight and 0.bias by output features, 2.weight by input features; 2.bias whole on "
                     "every rank, added once after the all-reduce",
            "rank_parameter_shapes": rank_shapes,
            "rank_parameter_count": rank_count,
            "rank_parameter_bytes": rank_count * element_bytes,
            "rank_forward_flops": flops // config.tensor_parallel,
            "all_reduce_bytes": config.batch * config.context * width * element_bytes,
        }
    return description
