"""Real models at tensor parallel 2, measured and compared per rank; prints JSON to stdout.

Run on a machine with 2 GPUs, from the repository root:  python3 gpu/probe-tp-real.py [--70b]
Measures a 4-layer Llama 3.1 8B shape (batch 2, context 1024) with
`torchrun --nproc-per-node 2 -m lab_helpers.real_model measure --tensor-parallel 2`, then with
--70b llama-3.1-70b at batch 1, contexts 32768 and 65536; prints, per point, the worst
differences (measured - predicted) of every counter over every rank and record, NCCL's bytes
outside the allocator per rank, and the times."""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lab_helpers import real_model  # noqa: E402

points = [("llama-4-layers", 2, 1024)]
if "--70b" in sys.argv:
    points += [("llama-3.1-70b", 1, 32768), ("llama-3.1-70b", 1, 65536)]
results = []
with tempfile.TemporaryDirectory() as folder:
    small = Path(folder) / "llama-4-layers.json"
    small.write_text(json.dumps(dict(json.loads((ROOT / "data/models/llama-3.1-8b.json").read_text()),
                                     num_hidden_layers=4)))
    for config, batch, context in points:
        out = Path(folder) / f"{config}-{context}.json"
        started = time.perf_counter()
        proc = subprocess.run(["torchrun", "--nproc-per-node", "2", "-m", "lab_helpers.real_model", "measure",
                               "--config", str(small) if config == "llama-4-layers" else config,
                               "--batch", str(batch), "--context", str(context), "--new-tokens", "4",
                               "--tensor-parallel", "2", "--output", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=900)
        row = {"config": config, "batch": batch, "context": context, "exit": proc.returncode,
               "measure_seconds": round(time.perf_counter() - started, 1)}
        if proc.returncode != 0 or not out.exists():
            row["stderr"] = proc.stderr[-4000:]
            results.append(row)
            continue
        document = json.loads(out.read_text())
        started = time.perf_counter()
        try:
            compared = real_model.compare_model(document)
        except Exception as exc:  # a probe reports, it does not stop
            row["compare_error"] = f"{type(exc).__name__}: {exc}"
            row["document"] = document
            results.append(row)
            continue
        row["predict_seconds"] = round(time.perf_counter() - started, 1)
        row["nccl_outside_allocator_bytes"] = compared["nccl_outside_allocator_bytes"]
        row["allocated_exact"] = compared["allocated_exact"]
        row["peak_allocated_worst_relative"] = compared["peak_allocated_worst_relative"]
        row["peak_reserved_worst_relative"] = compared["peak_reserved_worst_relative"]
        row["worst_difference"] = {key: max((r[f"difference_{key}"] for r in compared["rows"]), key=abs)
                                   for key in real_model.COUNTER_KEYS}
        row["rows_not_exact"] = [r for r in compared["rows"]
                                 if any(r[f"difference_{k}"] for k in real_model.COUNTER_KEYS)][:20]
        results.append(row)
print(json.dumps(results, indent=1))
