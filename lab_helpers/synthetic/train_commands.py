"""The --task train flags of mesure_memoire's measure, predict and compare, what they run and their tables for people."""
import json

from lab_helpers.allocator.history import DEFAULT_MAX_ENTRIES
from lab_helpers.core.cli import error_line
from lab_helpers.core.errors import EXIT_FAILURE, EXIT_OK, EXIT_PHASE, LabError
from lab_helpers.core.files import display_path, write_new_json
from lab_helpers.core.numbers import whole_number
from lab_helpers.core.tables import format_bytes, text_table
from lab_helpers.measurement.protocol import PhaseError
from lab_helpers.measurement.schema import MAX_TRAIN_STEPS, TRAIN_OPTIMIZERS
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.training import (DEFAULT_TRAIN_STEPS, TrainSettings, compare_training, measure_training,
                                            predict_training)


def add_train_flags(parser) -> None:
    """--task, --steps, --optimizer and --fused."""
    parser.add_argument("--task", choices=("inference", "train"), default="inference",
                        help="inference (default: cold, warm-up and warm forward passes) or train: forward with "
                             "a loss, backward, optimizer_step and zero_grad per optimizer step")
    parser.add_argument("--steps", type=whole_number(2, MAX_TRAIN_STEPS), default=None,
                        help=f"with --task train: optimizer steps, 2 to {MAX_TRAIN_STEPS} (default "
                             f"{DEFAULT_TRAIN_STEPS}); the first creates the optimizer's states, the second "
                             "shows the steady state")
    parser.add_argument("--optimizer", choices=TRAIN_OPTIMIZERS, default=None,
                        help="with --task train: adamw (torch.optim.AdamW, default) or sgd (momentum 0.9), "
                             "with torch's default implementation on CUDA (foreach)")
    parser.add_argument("--fused", action="store_true",
                        help="with --task train --optimizer adamw: AdamW(fused=True), one fused kernel per step")


def _settings_from(args) -> TrainSettings:
    return TrainSettings(steps=DEFAULT_TRAIN_STEPS if args.steps is None else args.steps,
                         optimizer=args.optimizer or "adamw", fused=args.fused)


def refuse_train_flags(args) -> None:
    """--steps, --optimizer and --fused mean something with --task train only."""
    given = [flag for flag, value in (("--steps", args.steps), ("--optimizer", args.optimizer),
                                      ("--fused", args.fused or None)) if value is not None]
    if given:
        raise LabError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --task train")


def check_train_arguments(args, config: MeasureConfig) -> TrainSettings:
    """The training settings; inference-only flags given with --task train are refused."""
    settings = _settings_from(args)
    if config.tensor_parallel is not None:
        raise LabError("tensor-parallel training is out of scope: leave --tensor-parallel out with --task train")
    if (getattr(args, "timeline", None) is not None or getattr(args, "timeline_stacks", False)
            or getattr(args, "timeline_max_entries", DEFAULT_MAX_ENTRIES) != DEFAULT_MAX_ENTRIES):
        raise LabError("the --timeline flags record inference runs only; leave them out with --task train")
    return settings


def predict_train_command(args, config: MeasureConfig, workspace) -> int:
    settings = check_train_arguments(args, config)
    if workspace is None:
        document = predict_training(config, settings)
    else:
        document = predict_training(config, settings, workspace, "given on the command line")
    if args.format == "table":
        print(train_predict_table(document))
    else:
        print(json.dumps(document, indent=2))
    return EXIT_OK


def measure_train_command(args, config: MeasureConfig) -> int:
    settings = check_train_arguments(args, config)
    try:
        document = measure_training(config, settings)
    except PhaseError as exc:
        note = "no file written"
        if args.failure_report is not None:
            try:
                write_new_json(args.failure_report, exc.report())
                note += f"; failure report: {display_path(args.failure_report)}"
            except LabError as write_error:
                note += f"; failure report not written: {write_error}"
        error_line(f"mesure_memoire: error: {exc}; {note}")
        return EXIT_PHASE
    write_new_json(args.output, document)
    print(json.dumps({"output": display_path(args.output), "phases": len(document["phases"])}, indent=2))
    return EXIT_OK


def compare_train_command(args, document: dict, workspace) -> int:
    result = compare_training(document, workspace)
    if args.format == "table":
        print(train_compare_table(result))
    else:
        print(json.dumps(result, indent=2))
    return EXIT_FAILURE if args.fail_on_difference and not result["allocated_exact"] else EXIT_OK


def _train_label(record) -> str:
    return record["phase"] if record.get("index") is None else f"{record['phase']} #{record['index']}"


def train_predict_table(document: dict) -> str:
    """Predicted end and peak per training phase, with the gradients' and the optimizer's bytes."""
    c = document["configuration"]
    header = ("phase", "end allocated", "peak allocated", "end reserved", "peak reserved", "gradients",
              "optimizer states")
    rows = [(_train_label(p), *(format_bytes(p[k]) for k in ("end_allocated_bytes", "peak_allocated_bytes",
                                                         "end_reserved_bytes", "peak_reserved_bytes")),
             format_bytes(p["end_allocated_bytes_by_kind"]["gradients"]),
             format_bytes(p["end_allocated_bytes_by_kind"]["optimizer_states"])) for p in document["phases"]]
    return "\n".join([
        f"training prediction: batch {c['batch']}, context {c['context']}, width {c['width']}, hidden {c['hidden']}, "
        f"{c['dtype']}, {c['steps']} steps, optimizer {c['optimizer']}",
        text_table(header, rows),
        f"optimizer: {document['optimizer']['note']}",
        *(f"note: {n}" for n in document["notes"]),
        f"workspace: {' + '.join(map(str, document['workspace']['bytes']))} bytes at the first forward product "
        f"({document['workspace']['source']}), then {' + '.join(map(str, document['workspace']['backward_bytes']))} "
        f"at the first backward product: {document['workspace']['backward_note']}",
        f"reserved assumes: {document['reserved_assumptions']}",
    ])


def train_compare_table(result: dict) -> str:
    header = ("phase", "measured peak allocated", "predicted", "difference B", "measured peak reserved",
              "predicted", "difference B")
    rows = [(_train_label(r), format_bytes(r["measured_peak_allocated_bytes"]),
             format_bytes(r["predicted_peak_allocated_bytes"]), f"{r['difference_peak_allocated_bytes']:+d}",
             format_bytes(r["measured_peak_reserved_bytes"]), format_bytes(r["predicted_peak_reserved_bytes"]),
             f"{r['difference_peak_reserved_bytes']:+d}") for r in result["rows"]]
    return "\n".join([
        text_table(header, rows),
        f"optimizer: {result['optimizer']['name']} ({result['optimizer']['implementation']})",
        f"allocated exact (baseline, end and peak of every phase): {'yes' if result['allocated_exact'] else 'no'}",
        f"every counter exact (reserved too): {'yes' if result['exact'] else 'no'}",
    ])
