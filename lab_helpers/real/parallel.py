"""One rank of a real model's tensor-parallel measurement, started by torchrun: every rank measures its
own phases; rank 0 gathers them and writes the one file."""
from dataclasses import replace
from pathlib import Path

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import SCHEMA_VERSION, check_new_output, write_new_json
from lab_helpers.launch.tensor_parallel import TensorParallelRun
from lab_helpers.launch.torchrun import launch_info
from lab_helpers.measurement.environment import environment
from lab_helpers.measurement.protocol import PhaseError, run_phase
from lab_helpers.real.config import ModelShape, check_tensor_parallel
from lab_helpers.real.protocol import check_cuda, run_protocol
from lab_helpers.real.spec import RunSpec, model_description, run_configuration


def measure_model_parallel(shape: ModelShape, spec: RunSpec, command, output: "Path | None" = None) -> "dict | None":
    """Measure one rank of a tensor-parallel run started by torchrun (spec.tensor_parallel ranks).

    Every rank measures its phases on cuda:LOCAL_RANK exactly as one GPU does; rank 0 gathers
    every rank's records (over gloo, after every rank finished) and, with `output`, creates the one
    result file. Returns the document on rank 0, None on the others. A failure on any rank ends
    every rank with the same exit code and one line (lab_helpers.launch.tensor_parallel.TensorParallelRun); no file is
    written. `command` is the argv given, to say how to launch it when no launcher did."""
    check_tensor_parallel(shape, spec.tensor_parallel)
    info = launch_info(spec.tensor_parallel, command)  # LabError before torch touches a GPU
    try:
        import torch
        import transformers
        from torch.distributed.device_mesh import DeviceMesh
    except ModuleNotFoundError:
        raise  # not installed: core.cli.run names the package and `make lab`
    except Exception as exc:
        raise LabError(f"torch and transformers must import to measure: {type(exc).__name__}") from None
    del transformers  # imported only to fail here, before the GPU is touched, if it cannot
    spec = replace(spec, device=info.device)
    device = check_cuda(torch, spec)
    with TensorParallelRun(info, device, prog="real_model") as run:
        if run.rank == 0 and output is not None:
            try:
                check_new_output(output)  # before minutes of loading, on every rank's behalf
            except LabError as exc:
                run.fail(exc)
        env = environment(spec.device, usable_memory_figure=False)
        phases = []

        def phase(name, action, index, recorded):
            failed_as = name if index is None else f"{name} {index}"
            try:
                if not recorded:
                    action()
                    return
                record, _ = run_phase(torch, device, name, action, index,
                                      1 if name in ("prefill", "decode") else 0, None, failed_as)
            except RuntimeError as exc:
                raise PhaseError(failed_as, exc) from None
            phases.append(record)

        try:
            run_protocol(shape, spec, device, phase, mesh=DeviceMesh.from_group(run.group, "cuda"))
        except (PhaseError, LabError) as exc:
            run.fail(exc)
        mine = {"rank": run.rank, "device": spec.device, "device_name": env.get("device_name"),
                "outside_allocator": run.outside_allocator, "phases": phases}
        ranks = run.gather((mine, env))
        document = None
        if run.rank == 0:
            document = {
                "schema_version": SCHEMA_VERSION,
                "kind": "iteragpu-lab measurement",
                "environment": env,
                "configuration": run_configuration(spec),  # rank 0's device
                "model": model_description(shape, spec.dtype),
                "ranks": [record for record, _ in ranks],
            }
            if output is not None:
                try:
                    write_new_json(output, document)
                except LabError as exc:
                    run.fail(exc)
        run.broadcast(None)  # every rank ends after the file exists
    return document
