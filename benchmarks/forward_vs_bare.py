"""Warm forward of the synthetic network against its two bare matrix products, on one GPU.

    python benchmarks/forward_vs_bare.py [--batch 16 --context 4096 --width 8192 --hidden 32768]
                                         [--repeats 20] [--no-bias] [--output forward-vs-bare.json]

Both sides use the same bf16 weights and input [batch, context, width] under
torch.inference_mode(), and are timed with CUDA events (median of --repeats after
--warmup passes). The bare side is addmm(bias, x, W.t()) twice by default (the bias add
is part of nn.Linear, so the comparison is like for like; GELU is the only extra work in
the forward); --no-bias times the plain x @ W.t() products. The harness's host/device
time ratio comes from mesure_memoire.measure on the same sizes.
"""
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lab_helpers.mesure_memoire import (EXIT_FAILURE, EXIT_OK, EXIT_PHASE, EXIT_USAGE, MAX_BATCH,  # noqa: E402
                                        MAX_CONTEXT, MAX_HIDDEN, MAX_PASSES, MAX_WIDTH, CommandParser, LabError,
                                        MeasureConfig, PhaseError, check_new_output, measure, synthetic_model,
                                        whole_number, write_new_json)

FORWARD_TO_BARE_MIN = 0.90  # the warm forward reaches at least 90 % of the bare products' TFLOP/s
HOST_TO_DEVICE_MAX = 1.05  # the harness's host time is at most 5 % over the device time
DTYPE = "bfloat16"
TERA = 1e12


def median_seconds(torch, step, warmup: int, repeats: int) -> float:
    """Median device seconds of `step` over `repeats` CUDA-event timings, after `warmup` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in ms
    return statistics.median(times)


def harness_ratio(config: MeasureConfig) -> dict:
    """Median host/device time ratio and TFLOP/s of the warm forwards that measure() records."""
    warm = [p for p in measure(config)["phases"] if p["phase"] == "warm_forward"]
    return {"repeats": len(warm),
            "host_to_device_time_ratio": statistics.median(p["host_to_device_time_ratio"] for p in warm),
            "achieved_tflops": statistics.median(p["achieved_tflops"] for p in warm)}


def forward_vs_bare(torch, config: MeasureConfig, bias: bool) -> dict:
    """Time the warm forward and the bare products on the same weights; return seconds and TFLOP/s."""
    device, dtype = torch.device(config.device), getattr(torch, DTYPE)
    b, t, w, h = config.batch, config.context, config.width, config.hidden_features
    torch.manual_seed(config.seed)  # the layers of mesure_memoire's network, initialised on the GPU directly
    model = torch.nn.Sequential(torch.nn.Linear(w, h, device=device, dtype=dtype), torch.nn.GELU(),
                                torch.nn.Linear(h, w, device=device, dtype=dtype)).eval()
    x = torch.randn((b, t, w), device=device, dtype=dtype)
    w1, b1, w2, b2 = model[0].weight, model[0].bias, model[2].weight, model[2].bias
    flat = x.view(-1, w)
    if bias:
        def bare():
            return torch.addmm(b2, torch.addmm(b1, flat, w1.t()), w2.t())
    else:
        def bare():
            return (flat @ w1.t()) @ w2.t()
    flops = synthetic_model(config)["forward_flops"]
    with torch.inference_mode():
        forward_s = median_seconds(torch, lambda: model(x), config.warmup, config.repeats)
        bare_s = median_seconds(torch, bare, config.warmup, config.repeats)
    return {"forward_seconds": forward_s, "bare_seconds": bare_s,
            "forward_tflops": flops / forward_s / TERA, "bare_tflops": flops / bare_s / TERA}


def main(argv=None) -> int:
    """Run the comparison, print the table and PASS/FAIL; 0 if both targets hold, 1 if not."""
    parser = CommandParser(prog="forward_vs_bare", description=__doc__.splitlines()[0])
    for name, default, low, high in (("batch", 16, 1, MAX_BATCH), ("context", 4096, 1, MAX_CONTEXT),
                                     ("width", 8192, 1, MAX_WIDTH), ("hidden", 32768, 1, MAX_HIDDEN),
                                     ("warmup", 3, 0, MAX_PASSES), ("repeats", 20, 1, MAX_PASSES)):
        parser.add_argument(f"--{name}", type=whole_number(low, high), default=default,
                            help=f"{low} to {high} (default {default})")
    parser.add_argument("--device", default="cuda:0", help="explicit cuda:N (default cuda:0)")
    parser.add_argument("--no-bias", action="store_true", help="bare side without bias: x @ W.t() twice")
    parser.add_argument("--output", help="also write the results to this new JSON file")
    args = parser.parse_args(argv)
    try:
        config = MeasureConfig(device=args.device, batch=args.batch, context=args.context, width=args.width,
                               hidden=args.hidden, dtype=DTYPE, warmup=args.warmup, repeats=args.repeats)
        try:
            import torch
        except ImportError as exc:
            raise LabError(f"torch cannot be imported ({exc}); this benchmark needs a CUDA build") from None
        if not torch.cuda.is_available():
            raise LabError("no CUDA device is available to torch; this benchmark needs a GPU")
        if args.output:
            check_new_output(args.output)
        harness = harness_ratio(config)  # first, in a clean allocator, like a fresh measure run
        torch.cuda.empty_cache()
        timing = forward_vs_bare(torch, config, bias=not args.no_bias)
    except LabError as exc:
        print(f"forward_vs_bare: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PhaseError as exc:
        print(f"forward_vs_bare: error: {exc}", file=sys.stderr)
        return EXIT_PHASE
    except RuntimeError as exc:  # out of memory or a CUDA error while timing
        print(f"forward_vs_bare: error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}", file=sys.stderr)
        return EXIT_PHASE
    ratio = timing["forward_tflops"] / timing["bare_tflops"]
    checks = {"forward_to_bare": ratio >= FORWARD_TO_BARE_MIN,
              "host_to_device": harness["host_to_device_time_ratio"] <= HOST_TO_DEVICE_MAX}
    result = {
        "device_name": torch.cuda.get_device_name(config.device), "torch_version": torch.__version__,
        "configuration": {k: getattr(config, k) for k in ("batch", "context", "width", "hidden", "dtype",
                                                          "warmup", "repeats")},
        "forward_flops": synthetic_model(config)["forward_flops"],
        "bare_variant": "x @ W.t() twice, no bias" if args.no_bias else "addmm(bias, x, W.t()) twice",
        **timing, "forward_to_bare_ratio": ratio, "harness": harness,
        "targets": {"forward_to_bare_min": FORWARD_TO_BARE_MIN, "host_to_device_max": HOST_TO_DEVICE_MAX},
        "pass": checks,
    }
    if args.output:
        try:
            write_new_json(args.output, result)
        except LabError as exc:
            print(f"forward_vs_bare: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    c = config
    print(f"{result['device_name']}, torch {result['torch_version']}, bf16, B={c.batch} T={c.context} "
          f"W={c.width} H={c.hidden_features}, median of {c.repeats}; bare side: {result['bare_variant']}")
    print(f"{'':<28}{'seconds':>12}{'TFLOP/s':>10}")
    print(f"{'warm forward':<28}{timing['forward_seconds']:>12.6f}{timing['forward_tflops']:>10.1f}")
    print(f"{'bare products':<28}{timing['bare_seconds']:>12.6f}{timing['bare_tflops']:>10.1f}")
    print(f"{'harness (measure) forward':<28}{'':>12}{harness['achieved_tflops']:>10.1f}")
    verdict = {True: "PASS", False: "FAIL"}
    print(f"forward / bare   {ratio:.3f}  (target >= {FORWARD_TO_BARE_MIN:.2f})  {verdict[checks['forward_to_bare']]}")
    print(f"host / device    {harness['host_to_device_time_ratio']:.4f} (target <= {HOST_TO_DEVICE_MAX:.2f})  "
          f"{verdict[checks['host_to_device']]}")
    return EXIT_OK if all(checks.values()) else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
