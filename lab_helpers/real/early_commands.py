"""What every real_model command checks before torch and transformers are imported (seconds of a small
machine's CPU): the packages a flag needs, whether this machine can have a GPU, the config's file and
raw keys, and the model's positions. A refusal among them answers at once; then the config is read
through transformers, with a line on a terminal meanwhile."""
from dataclasses import replace

from lab_helpers.core.devices import no_gpu_reason
from lab_helpers.core.errors import LabError
from lab_helpers.core.numbers import parse_device
from lab_helpers.core.packages import require
from lab_helpers.real.config import shape_of
from lab_helpers.real.raw_config import precheck_config
from lab_helpers.real.progress import stage
from lab_helpers.real.quantized import check_quantization

# the training modes that put peft's adapters on the model
ADAPTER_MODES = ("lora", "qlora")


def check_packages(args) -> None:
    """The optional packages the flags need are installed (looked up, not imported)."""
    if getattr(args, "quantize", None) is not None:
        require("bitsandbytes", f"--quantize {args.quantize}")
    if getattr(args, "task", "inference") == "train" and getattr(args, "train", None) in ADAPTER_MODES:
        require("peft", f"--train {args.train}")


def check_card_flags(args) -> None:
    """The one home of the --card rules: LabError when real_model fit's flags mix --card with a single
    budget or lack a size, or give --card's own flags without it (--tariffs also goes with --gpu)."""
    if args.card:
        if args.gpu is not None or args.memory_bytes is not None:
            raise LabError("--card compares every GPU model of the rate card: give neither --gpu nor --memory-bytes")
        if getattr(args, "device", None) is not None:
            raise LabError("--card reads each GPU's memory from the lab's measurements or the rate card: "
                           "leave out --device")
        missing = [flag for flag, value in (("--batch", args.batch), ("--context", args.context),
                                            ("--days", args.days)) if value is None]
        if missing:
            raise LabError(f"--card needs {' and '.join(missing)}")
        if getattr(args, "tensor_parallel", 1) != 1:
            raise LabError("--card finds the tensor-parallel degree itself: leave out --tensor-parallel")
        if args.tariffs == "":
            raise LabError("--tariffs: the path is empty")
        return
    extra = [flag for flag, value in (("--days", args.days), ("--accepted-results", args.accepted_results))
             if value is not None]
    if args.tariffs is not None and args.gpu is None:
        extra.append("--tariffs")
    if extra:
        raise LabError(f"{', '.join(extra)} only go with --card" + (" (--tariffs also with --gpu)"
                                                                    if "--tariffs" in extra else ""))
    if args.tariffs == "":
        raise LabError("--tariffs: the path is empty")


def check_train_card_flags(args) -> None:
    """Raise LabError when fit --card --task train's flags cannot be answered (before the config is read)."""
    if getattr(args, "tensor_parallel", 1) != 1:
        raise LabError("tensor-parallel training is out of scope: fit --card --task train asks one GPU of each "
                       "model; leave out --tensor-parallel")
    check_card_flags(args)


def refuse_card_allocator(settings) -> None:
    """--card predicts PyTorch's default allocator only."""
    if settings.expandable_segments:
        raise LabError("--card predicts PyTorch's default allocator only; leave out expandable_segments:True "
                       "(--allocator-conf or PYTORCH_CUDA_ALLOC_CONF), or ask one GPU model with --gpu")


def check_quantize_flags(args) -> None:
    """--quantize against --dtype, --tensor-parallel and --card, then its package."""
    if args.quantize is None:
        return
    if getattr(args, "card", False):
        raise LabError("--quantize with fit --card is not modelled (the card's search splits models across GPUs); "
                       "ask one GPU model with --gpu")
    check_quantization(args.quantize, args.dtype, args.tensor_parallel)
    check_packages(args)


def refuse_without_gpu(what: str, instead: str) -> None:
    """On a machine that cannot have a GPU, `what` is refused at once, pointing to `instead`."""
    reason = no_gpu_reason()
    if reason is not None:
        raise LabError(f"{what}, and {reason}; {instead}")


def refuse_budget_without_gpu(device: str) -> None:
    """A budget measured on `device` (an explicit cuda:N) is refused at once where no GPU can be."""
    parse_device(device)
    reason = no_gpu_reason()
    if reason is not None:
        raise LabError(f"no GPU visible as {device} ({reason}): give --gpu or --memory-bytes (a rate card GPU model, "
                       f"or the budget in bytes)")


def checked_config(args):
    """The config of --config, its file and raw keys checked (lab_helpers.real.raw_config.precheck_config)."""
    return precheck_config(args.config)


def model_shape(raw_config, shape_cache=None, quantization=None):
    """The shape of a checked config, read through transformers' config class, with `quantization`'s
    weights (a --quantize value of inference); one line on a terminal while torch and transformers load."""
    with stage(f"reading {raw_config.name} with torch and transformers (seconds on a first question)"):
        shape = shape_of(raw_config, shape_cache)
    return shape if quantization is None else replace(shape, quantization=quantization)


def positions_problem(max_positions, context: int, new_tokens: int) -> "str | None":
    """What is beyond the model's positions in a run of `context` plus `new_tokens`, or None."""
    if not max_positions or context + new_tokens <= max_positions:
        return None
    return (f"--context {context} plus --new-tokens {new_tokens} is beyond the model's {max_positions} positions "
            f"(config key 'max_position_embeddings')")


def check_positions(max_positions, args) -> "str | None":
    """Refuse a run past the model's positions unless --beyond-positions; the note to print then."""
    what = positions_problem(max_positions, args.context, args.new_tokens)
    if what is None:
        return None
    if not args.beyond_positions:
        raise LabError(f"{what}; give --beyond-positions to run it anyway")
    return f"{what}: run with --beyond-positions, the model was not trained at these positions"
