"""GPU memory lab: estimate weight bytes, describe the environment, measure and
predict PyTorch caching-allocator counters per phase of a tiny synthetic network.

Self-contained: the standard library at import time, torch only inside the
functions that need a GPU. Run it as a script (``python mesure_memoire.py
estimate|environment|measure|predict|compare ...``) or as
``python -m lab_helpers.mesure_memoire ...``.
"""
import argparse
import json
import sys
import textwrap
from dataclasses import replace

from lab_helpers.allocator.budget import MAX_MEMORY_BUDGET_BYTES
from lab_helpers.allocator.history import DEFAULT_MAX_ENTRIES
from lab_helpers.allocator.model import DEFAULT_WORKSPACE_BYTES, DEFAULT_WORKSPACE_SOURCE
from lab_helpers.allocator.settings import (ALLOCATOR_CONF_HELP, allocator_settings, default_allocator_only,
                                            put_in_force, recorded_settings)
from lab_helpers.core.cli import Command, Program, error_line, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_FAILURE, EXIT_OK, EXIT_PHASE, LabError
from lab_helpers.core.files import check_new_output, display_path, write_new_json
from lab_helpers.core.numbers import DTYPE_BYTES, MAX_BITS, decimal_number, parse_device, whole_number
from lab_helpers.launch.torchrun import (hold_launcher_stop, keep_own_exit_code, launch_info,
                                         wait_for_every_rank)
from lab_helpers.measurement.schema import (MAX_BATCH, MAX_CONTEXT, MAX_HIDDEN, MAX_PASSES, MAX_SEED,
                                            MAX_TENSOR_PARALLEL, MAX_WIDTH, read_measurement)
from lab_helpers.measurement.environment import environment, environment_table, usable_memory
from lab_helpers.measurement.protocol import PhaseError, import_torch
from lab_helpers.measurement.recording import save_oom_snapshot, write_timeline
from lab_helpers.measurement.timeline_commands import add_timeline_flags, timeline_recorder_of
from lab_helpers.synthetic.estimate import MAX_PARAMETERS, MAX_RESERVE_GIB, estimate, estimate_table
from lab_helpers.synthetic.measure import measure
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.predict import MAX_WORKSPACE_BLOCKS, MAX_WORKSPACE_BYTES, compare, predict
from lab_helpers.synthetic.tables import compare_table, predict_table
from lab_helpers.synthetic.tensor_parallel import measure_tensor_parallel
from lab_helpers.synthetic.train_commands import (add_train_flags, compare_train_command, measure_train_command,
                                                  predict_train_command, refuse_train_flags)


COMMANDS = {
    "estimate": "weight bytes from a parameter count and a bit width (no GPU, no torch)",
    "environment": "Python, torch, the device, and the memory a fresh process can use",
    "measure": "measure memory and time per phase on the GPU (never on the CPU)",
    "predict": "predict allocated/reserved bytes per phase from the allocator's rules (no GPU)",
    "compare": "a measurement file beside its prediction, per phase",
}


EXAMPLES = {
    "estimate": "python mesure_memoire.py estimate --parameters 7000000000 --bits 16 --reserve-gib 4",
    "environment": "python mesure_memoire.py environment --device cuda:0",
    "measure": ("python mesure_memoire.py measure --device cuda:0 --batch 1 --context 16 --width 64 \\\n"
                "      --dtype float32 --warmup 1 --repeats 2 --output mesures-petit-essai.json"),
    "predict": "python mesure_memoire.py predict --batch 2 --context 128 --width 1024 --dtype bfloat16 --format table",
    "compare": "python mesure_memoire.py compare mesures-petit-essai.json --format table --fail-on-difference",
}


DEFAULT_WORKSPACE_HELP = (f"default: {' then '.join(map(str, DEFAULT_WORKSPACE_BYTES))} bytes, "
                          f"{DEFAULT_WORKSPACE_SOURCE}")


def add_size_flags(parser) -> None:
    """The flags of the network's sizes and passes, shared by measure, predict and the sweep."""
    parser.add_argument("--batch", type=whole_number(1, MAX_BATCH), default=1,
                        help=f"sequences per forward pass, 1 to {MAX_BATCH} (default 1)")
    parser.add_argument("--context", type=whole_number(1, MAX_CONTEXT), default=16,
                        help=f"tokens per sequence, 1 to {MAX_CONTEXT} (default 16)")
    parser.add_argument("--width", type=whole_number(1, MAX_WIDTH), default=64,
                        help=f"model width: Linear input/output features, 1 to {MAX_WIDTH} (default 64)")
    parser.add_argument("--hidden", type=whole_number(1, MAX_HIDDEN), default=None,
                        help=f"hidden features of the first Linear, 1 to {MAX_HIDDEN} (default 4 x width)")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="float32",
                        help="parameter and input dtype (default float32)")
    parser.add_argument("--warmup", type=whole_number(0, MAX_PASSES), default=1,
                        help=f"warm-up passes, recorded as one phase, 0 to {MAX_PASSES} (default 1)")
    parser.add_argument("--repeats", type=whole_number(1, MAX_PASSES), default=2,
                        help=f"measured warm passes, one record each, 1 to {MAX_PASSES} (default 2)")


def _format_flag(parser) -> None:
    parser.add_argument("--format", choices=("json", "table"), default="json",
                        help="json for programs (default), table for people")


def _tensor_parallel_flag(parser, text: str) -> None:
    parser.add_argument("--tensor-parallel", type=whole_number(1, MAX_TENSOR_PARALLEL), default=None, metavar="N",
                        help=text)


def _workspace_flag(parser, text: str) -> None:
    parser.add_argument("--workspace-bytes", type=whole_number(0, MAX_WORKSPACE_BYTES), nargs="*", default=None,
                        metavar="N", help=text)


def add_estimate_arguments(p) -> None:
    p.add_argument("--parameters", type=whole_number(1, MAX_PARAMETERS), required=True,
                   help=f"number of model parameters, 1 to {MAX_PARAMETERS}")
    p.add_argument("--bits", type=whole_number(1, MAX_BITS), required=True,
                   help=f"bits per parameter, 1 to {MAX_BITS}, rounded up to whole bytes")
    p.add_argument("--reserve-gib", type=decimal_number(0, MAX_RESERVE_GIB), default=0.0,
                   help=f"extra GiB you choose to add, stated as an assumption, 0 to {MAX_RESERVE_GIB} (default 0)")
    _format_flag(p)


def add_environment_arguments(p) -> None:
    p.add_argument("--device", default="cuda:0", help="device to describe, cuda:N (default cuda:0)")
    p.add_argument("--no-usable-memory", dest="usable_memory", action="store_false",
                   help="skip the child process that measures usable_memory_bytes")
    _format_flag(p)


def add_measure_arguments(p) -> None:
    p.add_argument("--device", default=None,
                   help="device to measure on, an explicit cuda:N (default cuda:0); with --tensor-parallel N > 1 "
                        "leave it out: rank r measures on cuda:LOCAL_RANK")
    add_size_flags(p)
    _tensor_parallel_flag(p, "split the network over N GPUs, one process each, started by torchrun "
                             "(torchrun --nproc-per-node N -m lab_helpers.mesure_memoire measure ... "
                             f"--tensor-parallel N), 1 to {MAX_TENSOR_PARALLEL}; N must divide --hidden")
    p.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0,
                   help="seed of the weights and inputs (default 0)")
    p.add_argument("--output", required=True, help="new JSON file to create; an existing file is never overwritten")
    p.add_argument("--allocator-conf", metavar="SETTINGS", help=ALLOCATOR_CONF_HELP + "; set before CUDA starts")
    p.add_argument("--failure-report", metavar="PATH",
                   help="on exit 3, write {kind, phase, reason: out_of_memory|cuda_error, message} "
                        "as JSON to this new file")
    add_timeline_flags(p)
    add_train_flags(p)


SYNTHETIC_BUDGET_HELP = (
    "the budget the run faces, what one GPU's reserved may reach: --memory-bytes N, or --device cuda:N (its "
    "usable memory, measured now in a child process). Under a budget the caching allocator's release of its "
    "free cached segments and retry is replayed, and a predicted out-of-memory error ends the prediction at "
    "its phase: the output names the phase, the request, reserved and allocated then and the budget, and "
    "predict exits 3 (as measure does on a GPU out-of-memory). Without one, reserved is predicted for an "
    "unbounded device. (A rate card GPU's budget, --gpu, is real_model's: this file ships without the card.)")


def add_predict_arguments(p) -> None:
    add_size_flags(p)
    _tensor_parallel_flag(p, "predict every rank of the network split over N GPUs (no GPU needed), 1 to "
                             f"{MAX_TENSOR_PARALLEL}; N must divide --hidden")
    _workspace_flag(p, "math-library workspace blocks allocated at the first matrix product, each 0 to "
                       f"{MAX_WORKSPACE_BYTES}, at most {MAX_WORKSPACE_BLOCKS} ({DEFAULT_WORKSPACE_HELP})")
    p.add_argument("--allocator-conf", metavar="SETTINGS", help=ALLOCATOR_CONF_HELP)
    group = p.add_argument_group("budget", textwrap.fill(SYNTHETIC_BUDGET_HELP, 76, break_on_hyphens=False))
    budget = group.add_mutually_exclusive_group()
    budget.add_argument("--memory-bytes", type=whole_number(1, MAX_MEMORY_BUDGET_BYTES), metavar="N",
                        help="the budget in bytes, 1 to 2^50")
    # not `device`: the network's configuration has a device of its own (measure's)
    budget.add_argument("--device", dest="budget_device", default=None, metavar="cuda:N",
                        help="the GPU whose usable memory is measured now and is the budget")
    add_train_flags(p)
    _format_flag(p)


def synthetic_budget(args) -> tuple:
    """(bytes, source) of predict's budget flags, (None, None) without one."""
    if args.memory_bytes:
        return args.memory_bytes, "given with --memory-bytes"
    device = args.budget_device
    if device is None:
        return None, None
    index = parse_device(device)
    torch = import_torch()
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        # the probe's own failure would name torch internals (a build without CUDA has no _cuda_setDevice)
        raise LabError(f"no GPU visible as {device}: give --memory-bytes")
    answer = usable_memory(index)
    if not isinstance(answer["usable_memory_bytes"], int):
        raise LabError(f"cannot measure the usable memory of {device} "
                       f"({answer['usable_memory_unavailable_reason']}); give --memory-bytes")
    return answer["usable_memory_bytes"], f"usable memory of {device}, measured now in a fresh child process"


def add_compare_arguments(p) -> None:
    p.add_argument("measurement", help="JSON file written by measure")
    _workspace_flag(p, f"override the workspace blocks ({DEFAULT_WORKSPACE_HELP})")
    p.add_argument("--fail-on-difference", action="store_true",
                   help="exit 1 if any predicted allocated count differs from the measured one")
    _format_flag(p)


def _config_from(args) -> MeasureConfig:
    settings = {k: getattr(args, k) for k in MeasureConfig.__dataclass_fields__ if hasattr(args, k)}
    if "device" in settings and settings["device"] is None:
        del settings["device"]  # cuda:0 on one GPU; cuda:LOCAL_RANK per rank at tensor parallel N
    elif "device" in settings and (settings.get("tensor_parallel") or 1) > 1:
        raise LabError(f"--device is not used with --tensor-parallel {settings['tensor_parallel']}: each rank "
                       "measures on cuda:LOCAL_RANK (torchrun starts one process per GPU); leave --device out")
    return MeasureConfig(**settings)


def own_command(argv) -> list:
    """How this file was started, then `argv`: `-m lab_helpers.mesure_memoire ...` for the module
    (python -m, or the iteragpu-memory command), the script as typed for a copy run as a file."""
    if __spec__ is None and sys.argv and sys.argv[0].endswith(".py"):  # a file run as a script has no spec
        return [display_path(sys.argv[0]), *argv]
    return ["-m", "lab_helpers.mesure_memoire", *argv]


def measure_tensor_parallel_command(args, config: MeasureConfig):
    """measure --tensor-parallel N in one of torchrun's processes: the result for rank 0, None for
    the others (they print nothing)."""
    if (args.failure_report is not None or args.timeline is not None or args.timeline_stacks
            or args.timeline_max_entries != DEFAULT_MAX_ENTRIES):
        raise LabError("--failure-report and the --timeline flags record one GPU; leave them out with "
                       "--tensor-parallel (a failure on any rank is reported on every rank's stderr)")
    info = launch_info(config.tensor_parallel, own_command(getattr(args, "command_argv", None) or []))
    if args.device is None:
        config = replace(config, device=info.device)
    document = measure_tensor_parallel(config, info, write=lambda d: write_new_json(args.output, d))
    if document is None:
        return None
    return {"output": display_path(args.output), "tensor_parallel": config.tensor_parallel,
            "ranks": len(document["ranks"]), "phases": len(document["ranks"][0]["phases"])}


def _workspace_from(args):
    if args.workspace_bytes is None:
        return None
    if len(args.workspace_bytes) > MAX_WORKSPACE_BLOCKS:
        raise LabError(f"--workspace-bytes takes at most {MAX_WORKSPACE_BLOCKS} blocks, got {len(args.workspace_bytes)}")
    return tuple(args.workspace_bytes)


def print_result(args, result: dict, table) -> None:
    """JSON for programs, or with --format table the table for people."""
    if getattr(args, "format", "json") == "table":
        print(table(result))
    else:
        print(json.dumps(result, indent=2))


def handle_estimate(args) -> int:
    print_result(args, estimate(args.parameters, args.bits, args.reserve_gib), estimate_table)
    return EXIT_OK


def handle_environment(args) -> int:
    print_result(args, environment(args.device, usable_memory_figure=args.usable_memory), environment_table)
    return EXIT_OK


def handle_predict(args) -> int:
    workspace = _workspace_from(args)
    config = _config_from(args)  # checked before a budget is measured
    settings = allocator_settings(args.allocator_conf)
    if args.task == "train":
        default_allocator_only(settings, "--task train")
        if args.memory_bytes is not None or args.budget_device is not None:
            raise LabError("--memory-bytes and --device (a budget) are not modelled with --task train: "
                           "a training prediction is for an unbounded device")
        return predict_train_command(args, _config_from(args), workspace)
    refuse_train_flags(args)
    budget, source = synthetic_budget(args)
    if workspace is None:
        result = predict(config, allocator=settings, budget_bytes=budget, budget_source=source)
    else:
        result = predict(config, workspace, "given on the command line", allocator=settings, budget_bytes=budget,
                         budget_source=source)
    print_result(args, result, predict_table)
    return EXIT_PHASE if "out_of_memory" in result else EXIT_OK


def handle_compare(args) -> int:
    workspace = _workspace_from(args)
    document = read_measurement(args.measurement)
    if document["configuration"].get("task") == "train":
        default_allocator_only(recorded_settings(document.get("environment")), "--task train")
        return compare_train_command(args, document, workspace)
    result = compare(document, workspace)
    print_result(args, result, compare_table)
    return EXIT_FAILURE if args.fail_on_difference and not result["allocated_exact"] else EXIT_OK


def handle_measure(args) -> int:
    config = _config_from(args)
    settings = allocator_settings(args.allocator_conf)  # the environment's is refused here if not modelled
    check_new_output(args.output)
    if args.task == "train":
        default_allocator_only(settings, "--task train")
        return measure_train_command(args, config)
    refuse_train_flags(args)
    if args.allocator_conf is not None:
        put_in_force(settings)  # before torch starts CUDA; the file's environment block records it
    try:
        if config.tensor_parallel is not None:
            result = measure_tensor_parallel_command(args, config)
            if result is None:  # a tensor-parallel rank other than 0: rank 0 reports for all
                return EXIT_OK
        else:
            result = measure_one_gpu(args, config)
    except PhaseError as exc:
        note = "no file written"
        if args.failure_report is not None:
            try:
                write_new_json(args.failure_report, exc.report())
                note += f"; failure report: {display_path(args.failure_report)}"
            except LabError as write_error:
                note += f"; failure report not written: {write_error}"
        if args.timeline is not None:
            note += save_oom_snapshot(args.timeline, exc)
        error_line(f"mesure_memoire: error: {exc}; {note}")
        return EXIT_PHASE
    print(json.dumps(result, indent=2))
    return EXIT_OK


def measure_one_gpu(args, config: MeasureConfig) -> dict:
    if args.failure_report is not None:
        check_new_output(args.failure_report)
    history = timeline_recorder_of(args, {"--output": args.output, "--failure-report": args.failure_report})
    document = measure(config) if history is None else measure(config, history)
    write_new_json(args.output, document)
    result = {"output": display_path(args.output), "phases": len(document["phases"])}
    if history is not None:
        result.update(write_timeline(args.timeline, history))
    return result


def _on_usage_error() -> None:
    keep_own_exit_code()
    wait_for_every_rank()


PROGRAM = Program(
    prog="mesure_memoire",
    description=("Estimate weight bytes, describe the environment, and measure or predict PyTorch "
                 "allocator counters per phase of a tiny Linear -> GELU -> Linear network."),
    commands=tuple(Command(name, COMMANDS[name], add, handle, EXAMPLES[name]) for name, add, handle in (
        ("estimate", add_estimate_arguments, handle_estimate),
        ("environment", add_environment_arguments, handle_environment),
        ("measure", add_measure_arguments, handle_measure),
        ("predict", add_predict_arguments, handle_predict),
        ("compare", add_compare_arguments, handle_compare),
    )),
    on_start=hold_launcher_stop,
    on_usage_error=_on_usage_error,
)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser with its five subcommands."""
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    return run(PROGRAM, argv)


if __name__ == "__main__":
    sys.exit(main())
