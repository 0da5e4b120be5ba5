"""Load and plot a synthetic one-million-event timeline: seconds and peak memory, PASS or FAIL.

    python benchmarks/timeline_plot.py [--events 1000000] [--seed 0] [--png timeline-1m.png]

The timeline (weights that stay, then activations that rotate through 64 addresses, one segment,
five phases) is written to a temporary file; a fresh Python process then loads it with
``load_timeline`` and draws it with ``render_png``, and reports its wall-clock seconds for both and
its own peak resident memory (``resource.getrusage``, imports included). Targets: under 5 seconds
and under 1 GiB. Exit 0 when both hold, 1 when one fails, 2 with one line for a bad argument.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BEGAN = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lab_helpers.allocator.history import TIMELINE_ACTIONS, TIMELINE_KIND  # noqa: E402
from lab_helpers.core.cli import CommandParser  # noqa: E402
from lab_helpers.core.files import SCHEMA_VERSION, write_new_bytes  # noqa: E402
from lab_helpers.core.numbers import MIB  # noqa: E402
from lab_helpers.views.timeline import ALLOC, FREE, SEGMENT_ALLOC, load_timeline, render_png  # noqa: E402

MAX_SECONDS = 5.0
MAX_RSS_BYTES = 2**30
WEIGHTS = 4  # tensors allocated first and never freed, labelled "weights"
SLOTS = 64  # addresses the activations rotate through (reuse exercises alloc/free pairing)
PHASE_NAMES = ("model_load", "inputs", "cold_forward", "warmup", "warm_forward")


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a whole number >= 0: {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def synthetic_timeline(events: int = 1_000_000, seed: int = 0) -> dict:
    """A valid timeline of exactly `events` events (at least WEIGHTS + SLOTS + 1)."""
    import numpy as np
    if events < WEIGHTS + SLOTS + 1:
        raise ValueError(f"events must be at least {WEIGHTS + SLOTS + 1}")
    rng = np.random.default_rng(seed)
    mib = MIB
    pairs = (events - 1 - WEIGHTS - SLOTS) // 2
    extra = (events - 1 - WEIGHTS - SLOTS) % 2  # one trailing segment_alloc keeps the count exact
    weight_sizes = np.array([256, 128, 64, 32], dtype=np.int64)[:WEIGHTS] * mib
    activations = SLOTS + pairs
    # mostly small activations, now and then a large one (multiples of 512 bytes, as the allocator hands out)
    act_sizes = rng.integers(1, 4096, size=activations, dtype=np.int64) * 512
    big = rng.random(activations) < 0.001
    act_sizes[big] = rng.integers(8, 96, size=int(big.sum()), dtype=np.int64) * mib
    base = 1 << 40
    weight_addr = base + np.cumsum(np.concatenate(([0], weight_sizes[:-1])))
    slot_addr = base + (1 << 32) + np.arange(SLOTS, dtype=np.int64) * (128 * mib)
    segment = int(weight_sizes.sum() + SLOTS * 128 * mib)
    action = [np.array([SEGMENT_ALLOC]), np.full(WEIGHTS, ALLOC), np.full(SLOTS, ALLOC)]
    address = [np.array([base]), weight_addr, slot_addr]
    size = [np.array([segment]), weight_sizes, act_sizes[:SLOTS]]
    j = np.arange(SLOTS, activations)
    pair_action = np.empty(2 * pairs, dtype=np.int64)
    pair_action[0::2], pair_action[1::2] = FREE, ALLOC
    pair_address = np.repeat(slot_addr[j % SLOTS], 2)
    pair_size = np.empty(2 * pairs, dtype=np.int64)
    pair_size[0::2], pair_size[1::2] = act_sizes[j - SLOTS], act_sizes[j]
    action += [pair_action, np.full(extra, SEGMENT_ALLOC)]
    address += [pair_address, np.full(extra, base + (1 << 36))]
    size += [pair_size, np.full(extra, 2 * mib)]
    action, address, size = (np.concatenate(c).astype(np.int64) for c in (action, address, size))
    times = np.cumsum(rng.integers(1, 4, size=events, dtype=np.int64))
    times -= times[0]
    edges = np.linspace(0, int(times[-1]) + 1, len(PHASE_NAMES) + 1).astype(np.int64)
    phases = [{"name": n, "index": None, "start_us": int(edges[k]), "end_us": int(edges[k + 1]) - 1}
              for k, n in enumerate(PHASE_NAMES)]
    phase = np.searchsorted(edges, times, side="right") - 1
    label = [None] * events
    for k in range(1, 1 + WEIGHTS):
        label[k] = "weights"
    return {"kind": TIMELINE_KIND, "schema_version": SCHEMA_VERSION, "device": "cuda:0",
            "time_origin_us": 0, "actions": list(TIMELINE_ACTIONS), "initial_allocated_bytes": 0,
            "initial_reserved_bytes": 0,
            "events": {"time_us": times.tolist(), "action": action.tolist(), "address": address.tolist(),
                       "size_bytes": size.tolist(), "phase": phase.tolist(), "label": label},
            "phases": phases, "ooms": []}


def load_and_plot(path, began: float) -> dict:
    """Time load_timeline + render_png on `path` in this process; return seconds, PNG bytes, peak RSS."""
    import matplotlib.figure  # noqa: F401  (imports are not the trace's cost; timed apart)
    import matplotlib.backends.backend_agg  # noqa: F401
    imports = time.perf_counter() - began
    start, cpu_start = time.perf_counter(), time.process_time()
    timeline = load_timeline(path, max_bytes=2**31, check=False)  # plot_timeline validates it
    loaded = time.perf_counter()
    png = render_png(timeline)
    done, cpu_done = time.perf_counter(), time.process_time()
    return {"import_seconds": imports, "load_seconds": loaded - start, "plot_seconds": done - loaded, "total_seconds": done - start,
            "cpu_seconds": cpu_done - cpu_start,
            "png": png, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(path) -> dict:
    """Run load_and_plot in a fresh Python process, so that its memory is its own."""
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return json.loads(out.stdout)


def main(argv=None) -> int:
    parser = CommandParser(prog="timeline_plot", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=_positive_int, default=1_000_000, help="events in the synthetic timeline (default 1000000)")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the synthetic sizes and times (default 0)")
    parser.add_argument("--png", default=None, help="also keep the plot in this new PNG file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = load_and_plot(args.child, BEGAN)
        result["png_bytes"] = len(result.pop("png"))
        print(json.dumps(result))
        return 0
    if args.events < WEIGHTS + SLOTS + 1:
        parser.error(f"--events must be at least {WEIGHTS + SLOTS + 1}")
    if args.png and (Path(args.png).exists() or not Path(args.png).parent.is_dir()):
        parser.error(f"{args.png} exists or its folder does not")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.json"
        path.write_text(json.dumps(synthetic_timeline(args.events, args.seed), separators=(",", ":")))
        file_bytes = path.stat().st_size
        result = measure(path)
        if args.png:
            write_new_bytes(args.png, render_png(load_timeline(path, max_bytes=2**31)))
    # wall-clock is the target; CPU seconds show what contention from other processes added
    rows = [("load + plot seconds", result["total_seconds"], MAX_SECONDS),
            ("  of which CPU seconds", result["cpu_seconds"], MAX_SECONDS),
            ("peak RSS GiB", result["peak_rss_bytes"] / 2**30, MAX_RSS_BYTES / 2**30)]
    print(f"{args.events} events, timeline file {file_bytes} bytes, CPU cores {os.cpu_count()}; "
          f"imports {result['import_seconds']:.2f} s (not counted), load {result['load_seconds']:.2f} s, plot {result['plot_seconds']:.2f} s, PNG {result['png_bytes']} bytes; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'measure':<22} {'value':>8} {'target':>8}  result")
    failed = False
    for name, value, target in rows:
        ok = value < target
        failed |= not ok
        print(f"{name:<22} {value:>8.2f} {'< ' + format(target, 'g'):>8}  {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
