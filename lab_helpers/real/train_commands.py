"""real_model's --task train: the flags of predict and measure, and what they run (the tables for people:
lab_helpers.real.train_tables)."""
import json
from pathlib import Path

from lab_helpers.core.cli import error_line
from lab_helpers.core.errors import EXIT_OK, EXIT_PHASE, LabError
from lab_helpers.core.files import check_new_output, write_new_json
from lab_helpers.core.numbers import whole_number
from lab_helpers.measurement.protocol import PhaseError
from lab_helpers.measurement.schema import MAX_TRAIN_STEPS, TRAIN_OPTIMIZERS
from lab_helpers.real.early_commands import (check_card_flags, check_packages, check_train_card_flags, checked_config,
                                             model_shape, refuse_budget_without_gpu, refuse_without_gpu)
from lab_helpers.real.fit import gpu_budget, usable_memory_bytes
from lab_helpers.real.train import (MAX_LORA_RANK, TRAIN_MODES, TrainSpec, check_lora_targets,
                                    compare_training_model, measure_training_model, predict_training_model)
from lab_helpers.real.train_tables import (format_train_card, train_comparison_table, train_fit_table,
                                           train_prediction_table)


def add_model_train_flags(parser) -> None:
    """--task and the training flags of predict and measure."""
    parser.add_argument("--task", choices=("inference", "train"), default="inference",
                        help="inference (default: prefill and decode, needs --new-tokens) or train: forward with "
                             "the causal-LM loss, backward, optimizer_step and zero_grad per step")
    parser.add_argument("--train", choices=TRAIN_MODES, default=None,
                        help="with --task train: what is trained; full (default: every parameter), lora (peft's "
                             "adapters on a frozen base, needs --lora-rank), qlora (the same adapters on a 4-bit "
                             "base, needs --lora-rank and --quantize)")
    parser.add_argument("--steps", type=whole_number(2, MAX_TRAIN_STEPS), default=None,
                        help=f"with --task train: optimizer steps, 2 to {MAX_TRAIN_STEPS} (default 3)")
    parser.add_argument("--optimizer", choices=TRAIN_OPTIMIZERS, default=None,
                        help="with --task train: adamw (default) or sgd (momentum 0.9), torch's default "
                             "implementation on CUDA (foreach)")
    parser.add_argument("--fused", action="store_true", help="with --task train --optimizer adamw: AdamW(fused=True)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="with --task train: transformers' gradient checkpointing (backward recomputes each "
                             "layer's forward instead of keeping its activations)")
    parser.add_argument("--lora-rank", type=whole_number(1, MAX_LORA_RANK), default=None, metavar="R",
                        help=f"with --train lora or qlora: the adapters' rank, 1 to {MAX_LORA_RANK} (lora_alpha 2R, "
                             "no dropout)")
    parser.add_argument("--lora-targets", nargs="+", default=None, metavar="MODULE",
                        help="with --train lora or qlora: the linear layers that get adapters, by name (default: "
                             "peft's defaults for the model type, q_proj v_proj for Llama and Qwen2)")
    parser.add_argument("--autocast", choices=("bfloat16",), default=None,
                        help="with --task train and --dtype float32: the forward and its loss under "
                             "torch.autocast('cuda', dtype=torch.bfloat16), float32 master weights (not with --train "
                             "qlora)")


TRAIN_ONLY_FLAGS = (("--train", "train"), ("--steps", "steps"), ("--optimizer", "optimizer"),
                    ("--fused", "fused"), ("--gradient-checkpointing", "gradient_checkpointing"),
                    ("--autocast", "autocast"), ("--lora-rank", "lora_rank"), ("--lora-targets", "lora_targets"))


def refuse_model_train_flags(args) -> None:
    """Inference: the training flags are refused, and --new-tokens is needed."""
    given = [flag for flag, key in TRAIN_ONLY_FLAGS if getattr(args, key, None) not in (None, False)]
    if given:
        raise LabError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --task train")
    if args.new_tokens is None:
        raise LabError("the following arguments are required: --new-tokens (or give --task train)")


def train_spec_from_args(args, config_name: str, device="cuda:0", seed=0, sizes=None) -> TrainSpec:
    """The run the flags describe (checked before the config is read: pass a placeholder name)."""
    if args.new_tokens is not None:
        raise LabError("--new-tokens is for inference; --task train runs --steps optimizer steps instead")
    if getattr(args, "tensor_parallel", 1) != 1:
        raise LabError("tensor-parallel training is out of scope: leave --tensor-parallel out with --task train")
    batch, context = sizes or (args.batch, args.context)
    return TrainSpec(config_name, dtype=args.dtype, batch=batch, context=context,
                     steps=3 if args.steps is None else args.steps, optimizer=args.optimizer or "adamw",
                     fused=args.fused, train=args.train or "full", gradient_checkpointing=args.gradient_checkpointing,
                     device=device, seed=seed, lora_rank=args.lora_rank,
                     lora_targets=None if args.lora_targets is None else tuple(args.lora_targets),
                     quantize=args.quantize, autocast=args.autocast)


def check_train_positions(max_positions, args) -> None:
    """A training sequence longer than the model's positions is refused unless --beyond-positions."""
    if (max_positions and args.context is not None and args.context > max_positions
            and not getattr(args, "beyond_positions", False)):
        raise LabError(f"--context {args.context} is beyond the model's {max_positions} positions (config key "
                       "'max_position_embeddings'); give --beyond-positions to run it anyway")


def _print(args, result, table) -> None:
    print(table(result) if getattr(args, "format", "json") == "table" else json.dumps(result, indent=2))


def predict_train_model_command(args) -> int:
    train_spec_from_args(args, "unread")  # every flag checked before the config is read
    check_packages(args)
    raw_config = checked_config(args)
    check_train_positions(raw_config.max_positions, args)
    shape = model_shape(raw_config)
    spec = train_spec_from_args(args, shape.name)
    check_lora_targets(shape, spec)
    _print(args, predict_training_model(shape, spec), train_prediction_table)
    return EXIT_OK


def measure_train_model_command(args) -> int:
    device = args.device or "cuda:0"
    train_spec_from_args(args, "unread", device, args.seed)
    if args.timeline is not None:
        raise LabError("--timeline records inference runs only; leave it out with --task train")
    check_packages(args)
    output = Path(args.output)
    check_new_output(output)
    raw_config = checked_config(args)
    check_train_positions(raw_config.max_positions, args)
    refuse_without_gpu("measure runs on a CUDA or ROCm GPU, never on the CPU",
                       "`real_model predict` with the same run's flags predicts it with no GPU")
    shape = model_shape(raw_config)
    spec = train_spec_from_args(args, shape.name, device, args.seed)
    check_lora_targets(shape, spec)
    try:
        document = measure_training_model(shape, spec)
    except PhaseError as exc:
        error_line(f"real_model: error: {exc}; no file written")
        return EXIT_PHASE
    write_new_json(output, document)
    print(json.dumps({"output": str(output), "phases": len(document["phases"])}, indent=2))
    return EXIT_OK


def fit_train_command(args) -> int:
    """fit --task train: the budget as inference's fit takes it, then the training search."""
    from lab_helpers.real.train_fit import fit_training
    if args.card:
        return train_card_command(args)
    check_card_flags(args)  # --days, --accepted-results and --tariffs only with --card
    # the search sets the sizes; a given --batch or --context is checked here first
    sizes = (args.batch or 1, args.context or 2)
    train_spec_from_args(args, "unread", sizes=sizes)
    check_packages(args)
    # the rate card's budget, and whether a GPU can be measured, before the config is read
    card_budget = gpu_budget(args.gpu, args.tariffs) if args.gpu else None
    device = args.device or "cuda:0"
    if card_budget is None and not args.memory_bytes:
        refuse_budget_without_gpu(device)
    shape = model_shape(checked_config(args))
    spec = train_spec_from_args(args, shape.name, sizes=sizes)
    check_lora_targets(shape, spec)
    if card_budget is not None:
        budget, source = card_budget
    elif args.memory_bytes:
        budget, source = args.memory_bytes, "given with --memory-bytes"
    else:
        budget = usable_memory_bytes(device)
        source = f"usable memory of {device}, measured now in a fresh child process"
    _print(args, fit_training(shape, spec, budget, source, args.batch, args.context), train_fit_table)
    return EXIT_OK


def train_card_command(args) -> int:
    """fit --card --task train: every GPU model of the rate card, one GPU each, priced."""
    from lab_helpers.real.card_fit import read_card
    from lab_helpers.real.train_card import cheapest_training_forfaits
    check_train_card_flags(args)
    train_spec_from_args(args, "unread")  # every flag checked before the config is read
    check_packages(args)
    rows, shown = read_card(args.tariffs)  # before the config is read
    shape = model_shape(checked_config(args))
    spec = train_spec_from_args(args, shape.name)
    check_lora_targets(shape, spec)
    _print(args, cheapest_training_forfaits(shape, spec, args.days, rows, args.accepted_results, card_name=shown),
           format_train_card)
    return EXIT_OK


def compare_train_model_command(args, document: dict) -> int:
    _print(args, compare_training_model(document), train_comparison_table)
    return EXIT_OK
