"""Measuring the synthetic network split over N GPUs (one torchrun process per GPU)."""
from lab_helpers.core.errors import LabError
from lab_helpers.core.files import SCHEMA_VERSION
from lab_helpers.launch.tensor_parallel import TensorParallelRun
from lab_helpers.launch.torchrun import LaunchInfo
from lab_helpers.measurement.environment import environment_document
from lab_helpers.measurement.protocol import PhaseError, import_torch, run_phase
from lab_helpers.synthetic.measure import check_device
from lab_helpers.synthetic.network import MeasureConfig, synthetic_model


def measure_tensor_parallel(config: MeasureConfig, info: LaunchInfo, write=None, prog: str = "mesure_memoire"):
    """Measure this rank's phases of the synthetic network split over `config.tensor_parallel` ranks
    (one process per GPU, started by torchrun) and return the measurement document on rank 0, None
    on the others, once every rank has finished. Rank r holds 0.weight and 0.bias rows
    [r * hidden / N, (r + 1) * hidden / N), the same columns of 2.weight, and 2.bias whole; the
    forward is addmm, GELU, mm, an in-place all-reduce, then the bias added in place, so TP=N
    computes the same function as one GPU. A failure on any rank ends every rank (TensorParallelRun).
    `write(document)` runs on rank 0 while every rank waits: a LabError it raises ends every rank
    with exit 2 and the same line."""
    torch = import_torch()
    device = check_device(torch, config)
    dtype = getattr(torch, config.dtype)
    shard = config.shard_hidden
    first, last = info.rank * shard, (info.rank + 1) * shard
    # before the run: this creates the CUDA context, which the NCCL figure must not count
    env = environment_document(config.device, config.device_index, usable_memory_figure=False, usable_memory_probe=None)
    model_info = synthetic_model(config)
    rank_flops = model_info["tensor_parallel"]["rank_forward_flops"]
    state = {}
    with TensorParallelRun(info, device, prog) as run:
        import torch.distributed as dist
        from torch.nn import functional

        def load_model():
            with torch.random.fork_rng(devices=[]):  # the full network from the seed, as on one GPU
                torch.manual_seed(config.seed)
                model = torch.nn.Sequential(torch.nn.Linear(config.width, config.hidden_features),
                                            torch.nn.GELU(), torch.nn.Linear(config.hidden_features, config.width))
            model = model.to(dtype=dtype)
            with torch.no_grad():
                shards = (model[0].weight[first:last], model[0].bias[first:last], model[2].weight[:, first:last],
                          model[2].bias)
                # sliced and made contiguous on the CPU: the device only receives this rank's tensors
                state["parameters"] = [t.detach().contiguous().to(device) for t in shards]

        def make_inputs():
            generator = torch.Generator(device=device).manual_seed(config.seed)
            state["x"] = torch.randn((config.batch, config.context, config.width),
                                     generator=generator, device=device, dtype=dtype)

        def forward():
            weight_in, bias_in, weight_out, bias_out = state["parameters"]
            activated = functional.gelu(functional.linear(state["x"], weight_in, bias_in))
            output = functional.linear(activated, weight_out)  # a plain mm: the bias comes after the sum
            del activated
            dist.all_reduce(output, group=run.group)  # in place
            return output.add_(bias_out)

        def warmup():
            for _ in range(config.warmup):
                forward()

        phases = []
        try:
            phases.append(run_phase(torch, device, "model_load", load_model)[0])
            phases.append(run_phase(torch, device, "inputs", make_inputs)[0])
            with torch.inference_mode():
                record, output = run_phase(torch, device, "cold_forward", forward, passes=1)
                phases.append(record)
                del output
                phases.append(run_phase(torch, device, "warmup", warmup, passes=config.warmup)[0])
                for repeat in range(config.repeats):
                    record, output = run_phase(torch, device, "warm_forward", forward, index=repeat, passes=1)
                    del output
                    record["achieved_tflops"] = rank_flops / record["device_seconds"] / 1e12
                    record["host_to_device_time_ratio"] = record["seconds"] / record["device_seconds"]
                    phases.append(record)
        except PhaseError as error:
            run.fail(error)
        ranks = run.gather({"rank": info.rank, "device": config.device, "device_name": env["device_name"],
                            "outside_allocator": run.outside_allocator, "phases": phases})
        document = None if ranks is None else {
            "schema_version": SCHEMA_VERSION,
            "kind": "iteragpu-lab measurement",
            "environment": env,
            "configuration": config.record(),
            "synthetic_model": model_info,
            "ranks": ranks,
        }
        if write is not None:
            problem = None
            if document is not None:
                try:
                    write(document)
                except LabError as exc:
                    problem = str(exc)
            problem = run.broadcast(problem)
            if problem is not None:
                run.fail(LabError(problem), rank=0)
    return document
