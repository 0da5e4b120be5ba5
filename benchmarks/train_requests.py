"""A fine-tuning run's allocation requests on a CUDA GPU beside the tracer's, phase by phase.

    python benchmarks/train_requests.py measure OUT.json [--config llama-3.1-8b] [--layers 2] [--batch 1]
        [--context 128] [--steps 2] [--train full|lora] [--gradient-checkpointing]     (on the GPU)
    python benchmarks/train_requests.py compare OUT.json [OUT.json ...] [--show N]   (anywhere)

`measure` runs the training protocol of `real_model measure --task train`
(lab_helpers.real.train.run_training_protocol, each phase through run_phase) in this fresh process
under torch.cuda.memory._record_memory_history, and writes every alloc, free and segment event with
its innermost Python frames, the phase each belongs to, and the phase's six counters. `compare`
traces the same run on meta with every request of the replayed allocator recorded and compares the
two per phase as benchmarks/tracer_requests.py does (allocations in order, the frees between two
allocations as one set), printing each phase's first difference with the frames of both sides, and
the counters' differences. Exit 1 if any phase differs."""
import argparse
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

COUNTERS = ("baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes", "end_reserved_bytes",
            "peak_allocated_bytes", "peak_reserved_bytes")
FRAMES = 6


def arguments(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run on the GPU and write OUT.json")
    m.add_argument("output", type=Path)
    m.add_argument("--config", default="llama-3.1-8b", help="a bundled config of data/models")
    m.add_argument("--layers", type=int, default=2, help="decoder layers kept")
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--context", type=int, default=128)
    m.add_argument("--steps", type=int, default=2, help="optimizer steps (2 or more)")
    m.add_argument("--train", choices=("full", "lora"), default="full")
    m.add_argument("--lora-rank", type=int, default=8)
    m.add_argument("--gradient-checkpointing", action="store_true")
    m.add_argument("--autocast", action="store_true", help="float32 weights, the forward under bfloat16 autocast")
    m.add_argument("--cpp", action="store_true", help="record C++ frames too (slow: symbolized)")
    pin = sub.add_parser("pin", help="write the measured runs' request sequences and counters, compactly")
    pin.add_argument("output", type=Path)
    pin.add_argument("files", nargs="+", type=Path)
    c = sub.add_parser("compare", help="trace the measured runs on meta and compare")
    c.add_argument("files", nargs="+", type=Path)
    c.add_argument("--show", type=int, default=6, help="items shown after a phase's first difference")
    return p.parse_args(argv)


def build(config: str, layers: int, batch: int, context: int, steps: int, train: str, rank: int,
          checkpointing: bool, device: str, autocast: bool = False):
    from lab_helpers.real.config import parse_config
    from lab_helpers.real.train import TrainSpec
    raw = json.loads((ROOT / "data" / "models" / f"{config}.json").read_text())
    raw["num_hidden_layers"] = layers
    if raw.get("layer_types"):
        raw["layer_types"] = raw["layer_types"][:layers]
    shape = parse_config(raw, f"{config}-{layers}-layers")
    lora = {"train": "lora", "lora_rank": rank} if train == "lora" else {}
    mixed = {"dtype": "float32", "autocast": "bfloat16"} if autocast else {}
    spec = TrainSpec(shape.name, batch=batch, context=context, steps=steps, gradient_checkpointing=checkpointing,
                     device=device, **lora, **mixed)
    return shape, spec


def gpu_frames(event) -> list:
    cpp = [f["name"][:90] for f in event.get("frames", []) if not f["filename"].endswith(".py")
           and ("at::" in f["name"] or "autograd" in f["name"]) and "Dispatch" not in f["name"]]
    if cpp:
        return cpp[:FRAMES + 4]
    return [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in event.get("frames", [])
            if f["filename"].endswith(".py") and "/torch/" not in f["filename"]
            and "lab_helpers" not in f["filename"]][:FRAMES]


def measure(args) -> int:
    import torch

    from lab_helpers.measurement.protocol import run_phase
    from lab_helpers.real.train import run_training_protocol
    shape, spec = build(args.config, args.layers, args.batch, args.context, args.steps, args.train,
                        args.lora_rank, args.gradient_checkpointing, "cuda:0", args.autocast)
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="all" if args.cpp else "python",
                                           max_entries=4_000_000)
    phases, seen = [], [0]

    def phase(name, action, index, state):
        record, result = run_phase(torch, device, name, action, index, 1 if name in ("forward", "backward") else 0)
        trace = torch.cuda.memory._snapshot(device)["device_traces"][0]
        events = [[e["action"], e["size"], e.get("addr", 0), gpu_frames(e)] for e in trace[seen[0]:]
                  if e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")]
        seen[0] = len(trace)
        phases.append({"phase": name, "index": index, **{k: record[k] for k in COUNTERS}, "events": events})
        return result

    run_training_protocol(shape, spec, device, phase, torch.cuda.empty_cache)
    torch.cuda.memory._record_memory_history(enabled=None)
    run = {"config": args.config, "layers": args.layers, "batch": args.batch, "context": args.context,
           "steps": args.steps, "train": args.train, "lora_rank": args.lora_rank,
           "gradient_checkpointing": args.gradient_checkpointing, "autocast": args.autocast,
           "torch": torch.__version__, "phases": phases}
    args.output.write_text(json.dumps(run))
    for p in phases:
        print(f"{p['phase']:>15} {str(p['index']):>4} {len(p['events']):7d} events  end allocated "
              f"{p['end_allocated_bytes']}  peak allocated {p['peak_allocated_bytes']}  peak reserved "
              f"{p['peak_reserved_bytes']}")
    return 0


def traced(run: dict):
    """The run traced on meta: per phase, its (action, bytes) log, its allocations' frames, its counters."""
    import lab_helpers.real.train as train
    import lab_helpers.real.train_trace as train_trace
    import tracer_requests as requests

    shape, spec = build(run["config"], run["layers"], run["batch"], run["context"], run["steps"], run["train"],
                        run["lora_rank"], run["gradient_checkpointing"], "cuda:0", run.get("autocast", False))
    requests.RecordingAllocator.log, requests.RecordingAllocator.requested = [], {}
    requests.RecordingAllocator.frames = []
    marks, ops = [], []

    class Recording(train_trace.TrainingTracer):
        def __init__(self, allocator=None):
            super().__init__(requests.RecordingAllocator())

        def _persistent(self, nbytes: int) -> None:
            requests.RecordingAllocator.log.append(("workspace", nbytes))
            super()._persistent(nbytes)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                ops.pop()

    original_protocol, original_tracer = train.run_training_protocol, train_trace.TrainingTracer

    def protocol(shape, spec, device, phase, empty_cache):
        def marked(name, action, index, state):
            result = phase(name, action, index, state)
            marks.append((len(requests.RecordingAllocator.log), len(requests.RecordingAllocator.frames)))
            return result
        return original_protocol(shape, spec, device, marked, empty_cache)

    original_malloc = requests.RecordingAllocator.malloc

    def malloc(self, request_bytes):
        block = original_malloc(self, request_bytes)
        requests.RecordingAllocator.frames[-1] = (ops[-1:] or ["-"]) + requests.RecordingAllocator.frames[-1]
        return block

    train.run_training_protocol, train_trace.TrainingTracer = protocol, Recording
    requests.RecordingAllocator.malloc = malloc
    try:
        document = train.predict_training_model(shape, spec)
    finally:
        train.run_training_protocol, train_trace.TrainingTracer = original_protocol, original_tracer
        requests.RecordingAllocator.malloc = original_malloc
    log = requests.RecordingAllocator.log
    frames = [[f for f in stack if not f.startswith(("tracer_requests.py", "train_requests.py"))]
              for stack in requests.RecordingAllocator.frames]
    out, start = [], (0, 0)
    for p, end in zip(document["phases"], marks):
        out.append({"phase": p["phase"], "index": p["index"], "log": log[start[0]:end[0]],
                    "frames": frames[start[1]:end[1]],
                    **{k: p[k] for k in COUNTERS}})
        start = end
    return out


def with_frames(items: list, frames: list) -> list:
    """tracer_requests.canonical's items, each allocation beside its frames (in order)."""
    it = iter(frames)
    return [(item, next(it, None) if item[0] == "alloc" else None) for item in items]


def jsonable(items: list) -> list:
    """Canonical items as JSON has them: ["alloc", bytes] or ["free", [bytes, ...]]."""
    return [[action, list(value) if action == "free" else value] for action, value in items]


RUN_KEYS = ("config", "layers", "batch", "context", "steps", "train", "lora_rank", "gradient_checkpointing", "torch")


def gpu_requests(phase: dict) -> list:
    """A measured phase's requests, canonical and as JSON has them."""
    import tracer_requests as requests
    return jsonable(requests.canonical(requests.gpu_events(phase)[0]))


def traced_requests(phase: dict) -> list:
    """A traced phase's requests, in gpu_requests' form."""
    import tracer_requests as requests
    return jsonable(requests.canonical(phase["log"]))


def pin(args) -> int:
    runs = []
    for path in args.files:
        run = json.loads(path.read_text())
        mixed = {"autocast": True} if run.get("autocast") else {}  # runs before --autocast have no key
        runs.append({**{k: run[k] for k in RUN_KEYS}, **mixed, "phases": [
            {"phase": p["phase"], "index": p["index"], **{k: p[k] for k in COUNTERS}, "requests": gpu_requests(p)}
            for p in run["phases"]]})
    args.output.write_text(json.dumps(runs, separators=(",", ":")) + "\n")
    print(f"written: {args.output} ({len(runs)} runs)")
    return 0


def compare_one(path: Path, show: int) -> bool:
    import tracer_requests as requests
    run = json.loads(path.read_text())
    mine = traced(run)
    print(f"{path.name}: {run['config']} {run['layers']} layers, ({run['batch']}, {run['context']}), {run['train']}"
          f"{', checkpointing' if run['gradient_checkpointing'] else ''}")
    same = True
    for gpu, t in zip(run["phases"], mine):
        events, gframes = requests.gpu_events(gpu)
        # the tracer's workspaces: the allocation after each mark is cuBLAS's, made by the GPU too
        g = with_frames(requests.canonical(events), [f for (a, _), f in zip(events, gframes) if a == "alloc"])
        tr = with_frames(requests.canonical(t["log"]), t["frames"])
        diff = {k: gpu[k] - t[k] for k in COUNTERS if gpu[k] != t[k]}
        segs = [s for a, s, _, _ in gpu["events"] if a == "segment_alloc"]
        label = f"  {gpu['phase']:>15} {str(gpu['index']):>4}"
        first = next((i for i, (a, b) in enumerate(zip(g, tr)) if a[0] != b[0]), None)
        if first is None and len(g) == len(tr):
            print(f"{label}: {len(g)} items equal; counters {diff or 'exact'}; GPU segments {segs}")
            continue
        same = False
        first = min(len(g), len(tr)) if first is None else first
        print(f"{label}: first difference at item {first} of {len(g)} (GPU) / {len(tr)} (traced); counters "
              f"{diff or 'exact'}; GPU segments {segs}")
        for j in range(max(0, first - 2), min(first + show, max(len(g), len(tr)))):
            a = g[j] if j < len(g) else (None, None)
            b = tr[j] if j < len(tr) else (None, None)
            print(f"      {j:5d} gpu {str(a[0]):44.44} {a[1] or ''}")
            print(f"            tr  {str(b[0]):44.44} {b[1] or ''}")
    return same


def main(argv=None) -> int:
    args = arguments(argv)
    if args.command == "measure":
        return measure(args)
    if args.command == "pin":
        return pin(args)
    results = [compare_one(path, args.show) for path in args.files]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
