"""The tracer's requests for a 4-bit model, beside the GPU's alloc/free events of benchmarks/bnb_probe.py.

    python benchmarks/bnb_requests.py PROBE.json [PROBE.json ...] [--show N]

Each PROBE.json is a file of the bitsandbytes probe (one fresh process: the load, the prompt, the
prefill and the decode steps under torch.cuda.memory._record_memory_history). The same run is
predicted here on the meta device with every malloc and free of the replayed allocator recorded,
and the two sequences of request sizes are compared as benchmarks/tracer_requests.py compares
them (allocations in order, the frees between two allocations as one set). Exit 1 if any differs."""
import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import tracer_requests as requests  # noqa: E402
import lab_helpers.real.predict as predict  # noqa: E402
import lab_helpers.real.replay as replay  # noqa: E402
from lab_helpers.real.config import parse_config  # noqa: E402
from lab_helpers.real.spec import RunSpec  # noqa: E402


def traced_events(probe: dict) -> list:
    raw = json.loads((ROOT / "data" / "models" / f"{probe['config']}.json").read_text())
    changes = {"num_hidden_layers": probe["layers"]}
    if "layer_types" in raw:
        changes["layer_types"] = raw["layer_types"][:probe["layers"]]
    shape = replace(parse_config({**raw, **changes}, probe["config"]), quantization=probe["quant"])
    requests.RecordingAllocator.log, requests.RecordingAllocator.requested = [], {}
    original = replay.replay_allocator_for
    replay.replay_allocator_for = lambda settings, capacity_bytes=None: requests.RecordingAllocator()
    try:
        predict.predict_model(shape, RunSpec(shape.name, batch=probe["batch"], context=probe["context"],
                                             new_tokens=probe["new_tokens"]), trace_cache=None,
                              expand_decode_steps=False)
    finally:
        replay.replay_allocator_for = original
    return requests.RecordingAllocator.log


def compare(path: Path, show: int) -> bool:
    probe = json.loads(path.read_text())
    # the probe keeps (action, address, bytes, frames); tracer_requests reads (action, bytes, _, frames)
    gpu, frames = requests.gpu_events({"events": [[a, size, addr, f] for a, addr, size, f in probe["events"]]})
    gpu_c, traced_c = requests.canonical(gpu), requests.canonical(traced_events(probe))
    print(f"{probe['config']} {probe['layers']} layers {probe['quant']} ({probe['batch']}, {probe['context']}):")
    return requests.same_requests(gpu_c, traced_c, show)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probes", nargs="+", type=Path, help="files (JSON) of benchmarks/bnb_probe.py")
    parser.add_argument("--show", type=int, default=10, help="items shown after the first difference")
    args = parser.parse_args(argv)
    results = [compare(path, args.show) for path in args.probes]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
