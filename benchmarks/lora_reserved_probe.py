"""On a CUDA GPU: the segments a fine-tuning run makes, phase by phase, beside the segments the
prediction's replay makes; for each measured segment the replay lacks, the Python stack of the
allocation that made it.

    python benchmarks/lora_reserved_probe.py OUT.json [--config qwen1.5-0.5b] [--layers 2] [--batch 2]
        [--context 64] [--steps 2] [--train lora|full] [--gradient-checkpointing]   (from the repository root)

Written for LoRA's reserved difference of 2026-12-01 (77594624 bytes from backward 1 on, two layers of
qwen1.5-0.5b, batch 2, context 64, rank 8): its defaults are that run. The run is the one
`real_model measure --task train` makes (lab_helpers.real.train.run_training_protocol, each phase
through lab_helpers.measurement.protocol.run_phase), in this fresh process, with
torch.cuda.memory._record_memory_history on; after each phase the snapshot's new segment_alloc events
(size, address, top Python frames) are kept. The prediction is the same run traced on meta; each
segment the replayed allocator makes is logged with its request, and given to the phase whose peak
reserved first covers it (no segment is released without a budget). Output: JSON with, per phase, the
measured and predicted counters and segments, and the measured segments of each phase that the
replay did not make (matched by size), with their stacks. About 20 s on an H200."""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab_helpers.measurement.protocol import run_phase  # noqa: E402
from lab_helpers.real.config import parse_config  # noqa: E402
from lab_helpers.real.train import TrainSpec, predict_training_model, run_training_protocol  # noqa: E402

COUNTERS = ("baseline_allocated_bytes", "baseline_reserved_bytes", "end_allocated_bytes", "end_reserved_bytes",
            "peak_allocated_bytes", "peak_reserved_bytes")


def arguments():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("--config", default="qwen1.5-0.5b", help="a bundled config of data/models")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--train", choices=("full", "lora"), default="lora")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--gradient-checkpointing", action="store_true")
    return p.parse_args()


def measured_run(shape, spec):
    import torch
    device = torch.device(spec.device)
    torch.cuda.set_device(device)
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1000000)
    phases, seen = [], [0]

    def phase(name, action, index, state):
        record, result = run_phase(torch, device, name, action, index, 1 if name in ("forward", "backward") else 0)
        trace = torch.cuda.memory._snapshot(device)["device_traces"][device.index or 0]
        made = [{"size": e["size"], "address": e["addr"],
                 "frames": [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
                            for f in e.get("frames", [])[:12]]}
                for e in trace[seen[0]:] if e["action"] == "segment_alloc"]
        freed = [e["size"] for e in trace[seen[0]:] if e["action"] == "segment_free"]
        seen[0] = len(trace)
        phases.append({"phase": name, "index": index, **{k: record[k] for k in COUNTERS},
                       "segments_made": made, "segments_released": freed})
        return result

    run_training_protocol(shape, spec, device, phase, torch.cuda.empty_cache)
    torch.cuda.memory._record_memory_history(enabled=None)
    return phases


def predicted_run(shape, spec):
    from lab_helpers.allocator.addressed import AddressedAllocator
    made = []
    original = AddressedAllocator.segment_address

    def logged(self, segment_bytes, request_bytes):
        address = original(self, segment_bytes, request_bytes)
        made.append({"size": segment_bytes, "request": request_bytes, "address": address})
        return address

    # small segments are addressed by AllocatorModel.segment_address, through the same method name
    AddressedAllocator.segment_address = logged
    try:
        document = predict_training_model(shape, spec)
    finally:
        AddressedAllocator.segment_address = original
    phases, total, queue = [], 0, list(made)
    for p in document["phases"]:
        mine = []
        while queue and total + queue[0]["size"] <= p["peak_reserved_bytes"]:
            total += queue[0]["size"]
            mine.append(queue.pop(0))
        phases.append({"phase": p["phase"], "index": p["index"], **{k: p[k] for k in COUNTERS},
                       "segments_made": mine})
    return phases


def unmatched(segments: list, missing: dict) -> list:
    """The measured segments of the sizes the replay made fewer of, the first ones of each size."""
    left, found = dict(missing), []
    for segment in segments:
        if left.get(segment["size"], 0) > 0:
            left[segment["size"]] -= 1
            found.append(segment)
    return found


def main():
    args = arguments()
    raw = json.loads((ROOT / "data" / "models" / f"{args.config}.json").read_text())
    raw["num_hidden_layers"] = args.layers
    if raw.get("layer_types"):
        raw["layer_types"] = raw["layer_types"][:args.layers]
    shape = parse_config(raw, f"{args.config}-{args.layers}-layers")
    lora = {"train": "lora", "lora_rank": args.lora_rank} if args.train == "lora" else {}
    spec = TrainSpec(shape.name, batch=args.batch, context=args.context, steps=args.steps,
                     gradient_checkpointing=args.gradient_checkpointing, **lora)
    measured = measured_run(shape, spec)
    predicted = predicted_run(shape, spec)
    rows = []
    for got, want in zip(measured, predicted):
        extra = Counter(s["size"] for s in got["segments_made"])
        extra.subtract(Counter(s["size"] for s in want["segments_made"]))
        missing = {size: n for size, n in extra.items() if n > 0}
        surplus = {size: -n for size, n in extra.items() if n < 0}
        rows.append({
            "phase": got["phase"], "index": got["index"],
            "difference": {k: got[k] - want[k] for k in COUNTERS},
            "measured_segments": [s["size"] for s in got["segments_made"]],
            "predicted_segments": [(s["size"], s["request"]) for s in want["segments_made"]],
            "measured_only": unmatched(got["segments_made"], missing),
            "predicted_only_sizes": surplus,
            "measured_released": got["segments_released"],
        })
    out = {"configuration": spec.record(), "phases": rows, "measured": measured, "predicted": predicted}
    Path(args.output).write_text(json.dumps(out, indent=1))
    for r in rows:
        d = r["difference"]
        print(f"{r['phase']:>15} {str(r['index']):>4}  end alloc {d['end_allocated_bytes']:+d}  end reserved "
              f"{d['end_reserved_bytes']:+d}  peak reserved {d['peak_reserved_bytes']:+d}  segments measured "
              f"{r['measured_segments']} predicted {[s for s, _ in r['predicted_segments']]}")
        for s in r["measured_only"]:
            print(f"{'':>22}measured only: {s['size']} bytes, made at {s['frames'][:4]}")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
