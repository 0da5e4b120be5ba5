"""real_model: memory of transformers inference, phase by phase: predicted on any machine, measured on a GPU.

    python -m lab_helpers.real_model predict --config llama-3.1-8b --dtype bfloat16 --batch 1 --context 4096 --new-tokens 64
    python -m lab_helpers.real_model measure --config llama-3.1-8b ... --device cuda:0 --output m.json
    python -m lab_helpers.real_model compare m.json
    python -m lab_helpers.real_model fit --config llama-3.1-8b --gpu h200-sxm --dtype bfloat16 --batch 1 --new-tokens 64

`predict` and `measure` run the same code (lab_helpers.real.protocol.run_protocol): on the GPU it is
measured with the allocator's own counters, on PyTorch's meta device it is traced op by op
(lab_helpers.real.tracer) and every allocation is replayed through the model of the caching allocator
(lab_helpers.allocator.model).
"""
import argparse
import json
import sys
import textwrap
from pathlib import Path

from lab_helpers.allocator.budget import MAX_MEMORY_BUDGET_BYTES
from lab_helpers.allocator.settings import (ALLOCATOR_CONF_HELP, allocator_settings, default_allocator_only,
                                            put_in_force, recorded_settings)
from lab_helpers.core.collector import before_exit, for_this_process
from lab_helpers.core.cli import Command, Program, error_line, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_OK, EXIT_PHASE, LabError
from lab_helpers.core.files import check_new_output, display_path, write_new_json
from lab_helpers.core.numbers import DTYPE_BYTES, whole_number
from lab_helpers.launch.torchrun import hold_launcher_stop, keep_own_exit_code, launcher_place, wait_for_every_rank
from lab_helpers.measurement.schema import MAX_TENSOR_PARALLEL, read_measurement
from lab_helpers.measurement.protocol import PhaseError
from lab_helpers.measurement.recording import save_oom_snapshot, write_timeline
from lab_helpers.measurement.timeline_commands import add_timeline_flags, timeline_recorder_of
from lab_helpers.pricing.card import DURATIONS_DAYS, MAX_ACCEPTED_RESULTS
from lab_helpers.real.card_fit import cheapest_forfaits, read_card
from lab_helpers.real.config import bundled_names, check_tensor_parallel
from lab_helpers.real.early_commands import (check_card_flags, check_positions, check_quantize_flags, checked_config,
                                             model_shape, refuse_budget_without_gpu, refuse_card_allocator,
                                             refuse_without_gpu)
from lab_helpers.real.budget import MEASURED, budget_source_text, nccl_outside, with_memory_source
from lab_helpers.real.fit import fit_model, gpu_budget, gpu_budget_entry, usable_memory_bytes
from lab_helpers.real.predict import compare_model, predict_model
from lab_helpers.real.parallel import measure_model_parallel
from lab_helpers.real.protocol import measure_model
from lab_helpers.real.quantized import QUANTIZATIONS
from lab_helpers.real.spec import MAX_MODEL_BATCH, MAX_MODEL_CONTEXT, MAX_MODEL_NEW_TOKENS, RunSpec
from lab_helpers.real.tables import model_comparison_table, model_fit_table, model_prediction_table
from lab_helpers.real.train_commands import (add_model_train_flags, compare_train_model_command,
                                             fit_train_command, measure_train_model_command,
                                             predict_train_model_command, refuse_model_train_flags)

# int8 is accepted by the parser so that check_quantization refuses it with its reason, not argparse
QUANTIZE_CHOICES = (*QUANTIZATIONS, "int8")


COMMANDS = {
    "predict": "per-phase allocated and reserved bytes, no GPU needed",
    "measure": "measure every phase on a CUDA GPU (never the CPU)",
    "compare": "a measurement file beside its prediction, phase by phase",
    "fit": "does it fit a GPU, and the largest batch and context that do",
}
EXAMPLES = {
    "predict": ("python -m lab_helpers.real_model predict --config llama-3.1-8b --dtype bfloat16 --batch 1 "
                "--context 4096 --new-tokens 64"),
    "measure": ("python -m lab_helpers.real_model measure --config llama-3.1-8b --batch 1 --context 4096 "
                "--new-tokens 64 --device cuda:0 --output m.json"),
    "compare": "python -m lab_helpers.real_model compare m.json",
    "fit": ("python -m lab_helpers.real_model fit --config llama-3.1-8b --gpu h200-sxm --dtype bfloat16 --batch 1 "
            "--new-tokens 64"),
}
EVERY_HELP = "record every K-th decode step and the last (default 1: every step)"


def add_run_flags(parser, sizes_required=True) -> None:
    """The model and sizes of one run, shared by predict, measure and fit."""
    parser.add_argument("--config", required=True, metavar="PATH|NAME",
                        help=f"a Hugging Face config.json, or a bundled config: {', '.join(bundled_names())}")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16",
                        help="weights and activations dtype (default bfloat16)")
    parser.add_argument("--batch", type=whole_number(1, MAX_MODEL_BATCH), required=sizes_required, default=None,
                        help="sequences decoded together")
    parser.add_argument("--context", type=whole_number(1, MAX_MODEL_CONTEXT), required=sizes_required, default=None,
                        help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=whole_number(1, MAX_MODEL_NEW_TOKENS), default=None,
                        help="decode steps after the prefill, one greedy token each (required for inference)")
    parser.add_argument("--tensor-parallel", type=whole_number(1, MAX_TENSOR_PARALLEL), default=1, metavar="N",
                        help="split the model across N GPUs with transformers' tensor-parallel plan; figures are "
                             "per rank (default 1: one GPU)")
    parser.add_argument("--allocator-conf", metavar="SETTINGS", help=ALLOCATOR_CONF_HELP)
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None, metavar="KIND",
                        help="load the weights as bitsandbytes quantizes them while loading: from_pretrained with "
                             "a BitsAndBytesConfig computing in --dtype, one GPU. nf4 and fp4: 4 bits (QLoRA's "
                             "base; -double also quantizes the absmax; with --task train, --train qlora trains "
                             "LoRA adapters on it). int8-threshold-0: 8 bits, LLM.int8() with "
                             "llm_int8_threshold=0.0 (int8 is refused: at its default threshold the bytes depend "
                             "on the activations' values). One of: " + ", ".join(QUANTIZE_CHOICES))


def _format_flag(parser) -> None:
    parser.add_argument("--format", choices=("json", "table"), default="json", help="json (default) or table for people")


BEYOND_HELP = ("predict even when --context plus --new-tokens exceeds the config's max_position_embeddings "
               "(the output then says so); refused without it")


PREDICT_BUDGET_HELP = (
    "the budget the run faces, what one GPU's (one rank's) reserved may reach: --memory-bytes N, --gpu MODEL_ID "
    "(the rate card GPU's budget, as fit uses it) or --device cuda:N (its usable memory, measured now in a child "
    "process). Under a budget the caching allocator's release of its free cached segments and retry is "
    "replayed, and a predicted out-of-memory error ends the prediction at its phase: the output names the "
    "phase, the request, reserved and allocated then and the budget, and predict exits 3 (as measure does on "
    "a GPU out-of-memory). Without one, reserved is predicted for an unbounded device")


def add_budget_flags(p) -> None:
    group = p.add_argument_group("budget", textwrap.fill(PREDICT_BUDGET_HELP, 76, break_on_hyphens=False))
    budget = group.add_mutually_exclusive_group()
    budget.add_argument("--memory-bytes", type=whole_number(1, MAX_MEMORY_BUDGET_BYTES), metavar="N",
                        help="the budget in bytes, 1 to 2^50")
    budget.add_argument("--gpu", metavar="MODEL_ID", help="a model_id of the rate card data/tarifs-forfaits.csv")
    budget.add_argument("--device", default=None, metavar="cuda:N",
                        help="the GPU whose usable memory is measured now and is the budget")
    group.add_argument("--tariffs", metavar="PATH",
                       help="with --gpu: the rate card CSV the GPU model is read from (default "
                            "data/tarifs-forfaits.csv)")


NO_CACHE_HELP = ("trace the run again: neither read nor write the traces kept in the user's cache folder "
                 "(XDG_CACHE_HOME, else ~/.cache, then iteragpu-lab/traces)")


def trace_cache_of(args):
    """The traces a command reads and keeps: the user's cache folder, or with --no-cache memory only."""
    from lab_helpers.real.trace_cache import TraceCache, default_cache
    return TraceCache(None) if getattr(args, "no_cache", False) else default_cache()


def add_predict_arguments(p) -> None:
    p.add_argument("--no-cache", action="store_true", help=NO_CACHE_HELP)
    add_run_flags(p)
    add_model_train_flags(p)
    p.add_argument("--beyond-positions", action="store_true", help=BEYOND_HELP)
    p.add_argument("--decode-record-every", type=whole_number(1, MAX_MODEL_NEW_TOKENS), default=1, metavar="K",
                   help=EVERY_HELP)
    add_budget_flags(p)
    _format_flag(p)


def add_measure_arguments(p) -> None:
    add_run_flags(p)
    add_model_train_flags(p)
    p.add_argument("--beyond-positions", action="store_true", help=BEYOND_HELP)
    p.add_argument("--decode-record-every", type=whole_number(1, MAX_MODEL_NEW_TOKENS), default=1, metavar="K",
                   help=EVERY_HELP)
    p.add_argument("--device", default=None,
                   help="an explicit cuda:N (default cuda:0); at --tensor-parallel N > 1 each rank uses "
                        "cuda:LOCAL_RANK, set by torchrun")
    p.add_argument("--seed", type=whole_number(0, 2**63 - 1), default=0, help="seed of the weights and tokens (default 0)")
    p.add_argument("--output", required=True, help="new JSON file, created after the last phase; never overwritten")
    add_timeline_flags(p)


def add_compare_arguments(p) -> None:
    p.add_argument("measurement", help="a JSON file written by measure")
    _format_flag(p)


def add_fit_arguments(p) -> None:
    add_run_flags(p, sizes_required=False)
    p.add_argument("--no-cache", action="store_true", help=NO_CACHE_HELP)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--gpu", metavar="MODEL_ID",
                        help="a model_id of the rate card data/tarifs-forfaits.csv: its budget by the rule fit --card "
                             "uses (measured on that GPU, else derived, not measured, from data/gpu-memory.json)")
    budget.add_argument("--memory-bytes", type=whole_number(1, MAX_MEMORY_BUDGET_BYTES), metavar="N",
                        help="the budget in bytes: a whole number from 1 to 2^50")
    p.add_argument("--device", default=None, help="without --gpu, --memory-bytes or --card: the GPU whose usable memory "
                   "is measured (default cuda:0)")
    # --tensor-parallel N: --gpu and --memory-bytes are one GPU's budget, what one rank may reserve
    p.add_argument("--card", action="store_true",
                   help="the buyer's question: for every GPU model of the rate card, the smallest tensor-parallel "
                        "degree that fits, the lots it needs and their price for --days, sorted by price; needs "
                        "--batch, --context and --days, not --gpu or --memory-bytes; with --task train, whether "
                        "one GPU of each model holds the fine-tuning run (degree 1 only: tensor-parallel "
                        "training is out of scope)")
    p.add_argument("--days", type=whole_number(0), choices=DURATIONS_DAYS, metavar="D",
                   help=f"with --card: the forfait's duration in days, one of {', '.join(map(str, DURATIONS_DAYS))}")
    p.add_argument("--accepted-results", type=whole_number(1, MAX_ACCEPTED_RESULTS), metavar="N",
                   help=f"with --card: results accepted over the whole forfait, 1 to {MAX_ACCEPTED_RESULTS}; adds "
                        "the cost per accepted result (rounded half up to the cent, as calcul_forfaits does)")
    p.add_argument("--tariffs", metavar="PATH",
                   help="with --card, or with --gpu (the GPU model read from it): a rate card CSV (default "
                        "data/tarifs-forfaits.csv)")
    add_model_train_flags(p)
    _format_flag(p)


def print_model_result(args, result: dict, table) -> None:
    """JSON for programs, or with --format table the text for people."""
    if getattr(args, "format", "json") == "table":
        print(table(result))
    else:
        print(json.dumps(result, indent=2))


def handle_predict(args) -> int:
    if args.task == "train":
        default_allocator_only(allocator_settings(args.allocator_conf), "--task train")
        if args.memory_bytes is not None or args.gpu is not None or args.device is not None:
            raise LabError("--memory-bytes, --gpu and --device (a budget) are not modelled with predict --task "
                           "train: a training prediction is for an unbounded device (fit --task train takes one)")
        return predict_train_model_command(args)
    refuse_model_train_flags(args)
    check_quantize_flags(args)
    settings = allocator_settings(args.allocator_conf)
    # the rate card's budget, and whether a GPU can be measured, before the config is read
    if args.tariffs is not None and args.gpu is None:
        raise LabError("--tariffs only goes with --gpu (the rate card the GPU model is read from)")
    if args.tariffs == "":
        raise LabError("--tariffs: the path is empty")
    card_budget = gpu_budget(args.gpu, args.tariffs, tensor_parallel=args.tensor_parallel) if args.gpu else None
    if args.device is not None:
        refuse_budget_without_gpu(args.device)
    raw_config = checked_config(args)
    spec = RunSpec(raw_config.name, dtype=args.dtype, batch=args.batch, context=args.context,
                   new_tokens=args.new_tokens, decode_record_every=args.decode_record_every,
                   tensor_parallel=args.tensor_parallel)
    note = check_positions(raw_config.max_positions, args)
    shape = model_shape(raw_config, trace_cache_of(args), args.quantize)
    check_tensor_parallel(shape, spec.tensor_parallel)  # before a budget is measured
    budget, source = card_budget or predict_budget(args, spec.tensor_parallel)
    # predict_model checks that the plan splits the model this many ways, before torch is imported
    result = predict_model(shape, spec, allocator=settings, capacity_bytes=budget, budget_source=source,
                           report_out_of_memory=True, trace_cache=trace_cache_of(args))
    if note:
        result["beyond_positions"] = note
    print_model_result(args, result, model_prediction_table)
    if note and args.format == "table":
        print(f"note: {note}")
    return EXIT_PHASE if "out_of_memory" in result else EXIT_OK


def predict_budget(args, degree: int) -> tuple:
    """(bytes, source) of predict's --memory-bytes or --device, (None, None) without one."""
    if args.memory_bytes:
        return args.memory_bytes, "given with --memory-bytes"
    if args.device is not None:
        return measured_budget(args.device, degree)
    return None, None


def measured_budget(device: str, degree: int) -> tuple:
    """(bytes, source) of one rank's budget on `device`: its usable memory measured now, less at degree
    > 1 what NCCL holds outside the allocator (the device's model is not known here, so NCCL's figure
    is a derived one)."""
    budget = usable_memory_bytes(device)
    source = f"{MEASURED}: usable memory of {device}, measured now in a fresh child process"
    if degree > 1:
        nccl = nccl_outside(None, degree)
        budget -= nccl["nccl_outside_allocator_bytes"]
        source += (f"; less {nccl['nccl_outside_allocator_bytes']} bytes NCCL holds outside the allocator "
                   f"per rank at tensor parallel {degree}, {nccl['nccl_basis']}")
    return budget, source


def handle_compare(args) -> int:
    # bounded size and depth, a FIFO or folder refused, then every rule of the schema: a phase
    # without its name or a counter that is a string is refused before any of it is read
    document = read_measurement(args.measurement)
    if not isinstance(document, dict):
        raise LabError(f"{display_path(args.measurement)} is not a measurement document")
    if document["configuration"].get("task") == "train":
        default_allocator_only(recorded_settings(document.get("environment")), "--task train")
        return compare_train_model_command(args, document)
    print_model_result(args, compare_model(document), model_comparison_table)
    return EXIT_OK


def handle_fit(args) -> int:
    if args.task == "train":
        default_allocator_only(allocator_settings(args.allocator_conf), "--task train")
        return fit_train_command(args)
    refuse_model_train_flags(args)
    check_card_flags(args)  # before the config is read
    settings = allocator_settings(args.allocator_conf)
    if args.card:
        refuse_card_allocator(settings)
    check_quantize_flags(args)
    degree = args.tensor_parallel
    # the rate card (or the one GPU model asked of it), and whether a GPU can be measured, before the
    # config is read
    card = read_card(args.tariffs) if args.card else None
    entry = gpu_budget_entry(args.gpu, args.tariffs, tensor_parallel=degree) if args.gpu else None
    if not args.card and args.gpu is None and args.memory_bytes is None:
        refuse_budget_without_gpu(args.device or "cuda:0")
    raw_config = checked_config(args)
    # the sizes given, checked as the search's runs are (MAX_TOKENS), and the positions they reach
    RunSpec(raw_config.name, dtype=args.dtype, batch=args.batch or 1, context=args.context or 1,
            new_tokens=args.new_tokens, tensor_parallel=degree)
    check_fit_positions(raw_config.max_positions, args)
    shape = model_shape(raw_config, trace_cache_of(args), args.quantize)
    if args.card:
        spec = RunSpec(shape.name, dtype=args.dtype, batch=args.batch, context=args.context,
                       new_tokens=args.new_tokens, decode_record_every=args.new_tokens)
        rows, shown = card
        result = cheapest_forfaits(shape, spec, args.days, rows, args.accepted_results, card_name=shown,
                                   trace_cache=trace_cache_of(args))
    else:
        check_tensor_parallel(shape, degree)
        if entry is not None:
            budget, label = entry["rank_budget_bytes"], entry["memory_source"]
            source = budget_source_text(entry, degree)
        elif args.memory_bytes:
            budget, source, label = args.memory_bytes, "given with --memory-bytes", "given"
        else:
            budget, source = measured_budget(args.device or "cuda:0", degree)
            label = MEASURED
        result = with_memory_source(fit_model(shape, args.dtype, args.new_tokens, budget, source, args.batch,
                                              args.context, tensor_parallel=degree, allocator=settings,
                                              trace_cache=trace_cache_of(args)), label)
    print_model_result(args, result, model_fit_table)
    return EXIT_OK


def check_fit_positions(max_positions, args) -> None:
    """fit's --context must leave room for --new-tokens within the model's positions (the search's
    own bound), refused before the config is read through transformers."""
    if args.context is None or not max_positions:
        return
    if args.context > max(max_positions - args.new_tokens, 1):
        raise LabError(f"--context {args.context} is beyond the model's {max_positions} positions "
                       f"minus {args.new_tokens} new tokens")


def measure_command_result(args) -> "dict | None":
    """Measure as the flags say and write the file; the result to print, or None on a tensor-parallel
    rank other than 0 (rank 0 reports for every rank)."""
    settings = allocator_settings(args.allocator_conf)  # the environment's is refused here if not modelled
    check_quantize_flags(args)
    degree = args.tensor_parallel
    if degree > 1:
        if args.device is not None:
            raise LabError("--device is set by the launcher at --tensor-parallel > 1: rank R uses cuda:LOCAL_RANK")
        if args.timeline is not None:
            raise LabError("--timeline records one GPU's allocator: not available at --tensor-parallel > 1")
    output = Path(args.output)
    history = None
    if degree == 1:
        check_new_output(output)  # before the model is built, not after minutes of work
        history = timeline_recorder_of(args, {"--output": args.output})
    raw_config = checked_config(args)
    spec = RunSpec(raw_config.name, dtype=args.dtype, batch=args.batch, context=args.context,
                   new_tokens=args.new_tokens, decode_record_every=args.decode_record_every, tensor_parallel=degree,
                   device=args.device or "cuda:0", seed=args.seed)
    note = check_positions(raw_config.max_positions, args)
    command = ["-m", "lab_helpers.real_model", *args.command_argv]  # how to launch it, if no launcher did
    if degree > 1:
        launcher_place(degree, command)  # started by torchrun at this degree, before torch is imported
    refuse_without_gpu("measure runs on a CUDA or ROCm GPU, never on the CPU",
                       "`real_model predict` with the same run's flags predicts it with no GPU")
    shape = model_shape(raw_config, quantization=args.quantize)
    check_tensor_parallel(shape, degree)
    if args.allocator_conf is not None:
        put_in_force(settings)  # before torch starts CUDA; the file's environment block records it
    if degree > 1:
        document = measure_model_parallel(shape, spec, command, output)
        if document is None:
            return None
        return {"output": str(output), "ranks": len(document["ranks"]),
                "phases": len(document["ranks"][0]["phases"])}
    document = measure_model(shape, spec, history)
    write_new_json(output, document)
    result = {"output": str(output), "phases": len(document["phases"])}
    if note:
        result["beyond_positions"] = note
    if history is not None:
        result.update(write_timeline(args.timeline, history))
    return result


def handle_measure(args) -> int:
    if args.task == "train":
        default_allocator_only(allocator_settings(args.allocator_conf), "--task train")
        return measure_train_model_command(args)
    refuse_model_train_flags(args)
    try:
        result = measure_command_result(args)
    except PhaseError as exc:
        note = save_oom_snapshot(args.timeline, exc) if args.timeline is not None else ""
        error_line(f"real_model: error: {exc}; no file written{note}")
        return EXIT_PHASE
    if result is not None:
        print(json.dumps(result, indent=2))
    return EXIT_OK


def _on_usage_error() -> None:
    keep_own_exit_code()
    wait_for_every_rank()


PROGRAM = Program(
    prog="real_model",
    description=("Allocator-exact memory of transformers inference from a config.json: predict on any machine, "
                 "measure on a GPU, compare, and find what fits."),
    commands=tuple(Command(name, COMMANDS[name], add, handle, EXAMPLES[name]) for name, add, handle in (
        ("predict", add_predict_arguments, handle_predict),
        ("measure", add_measure_arguments, handle_measure),
        ("compare", add_compare_arguments, handle_compare),
        ("fit", add_fit_arguments, handle_fit),
    )),
    on_start=hold_launcher_stop,
    on_usage_error=_on_usage_error,
)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: one sub-parser per command."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """The commands on `argv`; returns the exit code. With no `argv` they are the process's own command
    line (`iteragpu-model`, `python -m lab_helpers.real_model`), a process that ends with its command:
    the collector is set for one (lab_helpers.core.collector)."""
    if argv is None:
        for_this_process()
    code = run(PROGRAM, argv)
    if argv is None:
        before_exit()
    return code


if __name__ == "__main__":
    sys.exit(main())
