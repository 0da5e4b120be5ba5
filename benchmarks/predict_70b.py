"""How long a 70B prediction takes on this machine, as a ratio to importing torch and transformers.

    python benchmarks/predict_70b.py [--repeats 3] [--context 4096] [--new-tokens 2]

Each figure is taken in a fresh process: first `python -c "import torch, transformers"` (the floor of
any prediction), then the llama-3.1-70b prediction of batch 1 (the test suite's case, which checks
that no weight is materialised). A seconds bound would hold only on an idle machine; the ratio to the
import time, measured in the same run, says how much of the time is the prediction itself on a
machine that is busy or slow. Prints one JSON object; not a test.
"""
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lab_helpers.core.cli import CommandParser  # noqa: E402
from lab_helpers.core.numbers import whole_number  # noqa: E402
from lab_helpers.real.spec import MAX_MODEL_CONTEXT, MAX_MODEL_NEW_TOKENS  # noqa: E402

IMPORT_ONLY = "import torch, transformers"
PREDICT = ("import json, resource, sys, time; t = time.perf_counter();"
           "from lab_helpers.real.config import load_config; from lab_helpers.real.predict import predict_model;"
           "from lab_helpers.real.spec import RunSpec;"
           "p = predict_model(load_config('llama-3.1-70b'), RunSpec('llama-3.1-70b', batch=1, "
           "context=int(sys.argv[1]), new_tokens=int(sys.argv[2])));"
           "print(json.dumps({'in_process_seconds': time.perf_counter() - t,"
           "'rss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
           "'peak_reserved_bytes': p['overall']['peak_reserved_bytes']}))")


def timed(argv: list) -> tuple:
    """(wall seconds, stdout) of a fresh Python process running `argv`."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"predict_70b: error: {argv[:2]} exited {proc.returncode}: "
                         f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
    return seconds, proc.stdout


def main(argv=None) -> int:
    parser = CommandParser(prog="predict_70b", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=whole_number(1, 100), default=3, help="runs of each side (default 3)")
    parser.add_argument("--context", type=whole_number(1, MAX_MODEL_CONTEXT), default=4096,
                        help="prompt tokens (default 4096)")
    parser.add_argument("--new-tokens", type=whole_number(1, MAX_MODEL_NEW_TOKENS), default=2,
                        help="decode steps (default 2)")
    args = parser.parse_args(argv)
    imports, predictions, last = [], [], None
    for _ in range(args.repeats):  # interleaved, so that a change in the machine's load hits both sides
        imports.append(timed(["-c", IMPORT_ONLY])[0])
        seconds, out = timed(["-c", PREDICT, str(args.context), str(args.new_tokens)])
        predictions.append(seconds)
        last = json.loads(out)
    import_seconds, predict_seconds = statistics.median(imports), statistics.median(predictions)
    print(json.dumps({
        "case": {"config": "llama-3.1-70b", "batch": 1, "context": args.context, "new_tokens": args.new_tokens},
        "repeats": args.repeats,
        "import_torch_transformers_seconds": round(import_seconds, 3),
        "prediction_process_seconds": round(predict_seconds, 3),
        "ratio_to_import": round(predict_seconds / import_seconds, 2),
        "last_run": last,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
