"""The requests the tracer's allocator is asked, beside the GPU's alloc/free events of the same run.

    python benchmarks/tracer_requests.py PROBE.json [PROBE.json ...] [--show N]

Each PROBE.json is a file of the SDPA probe (torch.cuda.memory._record_memory_history of one
point's measure_model on the H200, with the family, batch and context it ran). The point is
predicted again here on the meta device with every malloc and free of the replayed allocator
recorded, and the two sequences of request sizes are compared: allocations in order, the frees
between two allocations as one set (the tracer finds releases at op boundaries; the order of the
frees between two allocations does not change the allocator's state). The frees after the last
allocation are the end of the run (the GPU's process drops the model, the prediction stops): the
traced ones must be among the GPU's.

One difference is known and left out, and printed: the probe ran its points one after another
in one process, so the cuBLAS (32 MiB) and cuBLASLt (1 MiB) workspaces that a fresh process, and
so the prediction, makes at its first product are in the probe's files only where its process
made them (cuBLAS at its first point, cuBLASLt at its first point with a biased product: GPT-2's).
Prints the first difference or that the sequences are equal; exit 1 if any file differs.
"""
import argparse
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import lab_helpers.real.predict as predict  # noqa: E402
import lab_helpers.real.replay as replay  # noqa: E402
import lab_helpers.real.tracer as tracer  # noqa: E402
from lab_helpers.allocator.addressed import AddressedAllocator  # noqa: E402
from lab_helpers.real.config import parse_config  # noqa: E402
from lab_helpers.real.spec import RunSpec  # noqa: E402

# the probe's reduced configs (benchmarks/sdpa_probe.py): bundled shape, changed keys
PROBE_FAMILIES = {
    "mistral": ("mistral-7b-v0.1", {"num_hidden_layers": 2}),
    "gemma2": ("gemma-2-2b", {"num_hidden_layers": 4}),
    "gemma3": ("gemma-3-4b-text", {"num_hidden_layers": 4,
                                   "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "phi3": ("phi-3-mini-4k", {"num_hidden_layers": 2}),
    "gpt2": ("gpt2", {"n_layer": 4}),
    "mixtral": ("mixtral-8x7b", {"num_hidden_layers": 2}),
}
# the probe's points in the order its one process ran them; the families whose products have a bias
PROBE_ORDER = [("mistral", 1, 8192), ("mistral", 2, 4094), ("gemma2", 1, 8000), ("gemma2", 2, 4094),
               ("gemma3", 1, 8192), ("gemma3", 4, 1022), ("phi3", 1, 512), ("phi3", 1, 4000), ("phi3", 8, 1000),
               ("gpt2", 4, 512), ("gpt2", 8, 1000), ("mixtral", 1, 512)]
BIASED = {"gpt2"}
CUBLAS_BYTES, CUBLASLT_BYTES = 32 * 2**20, 2**20


class RecordingAllocator(AddressedAllocator):
    """AddressedAllocator that logs every request: ("alloc", bytes) and ("free", bytes asked)."""

    log = []  # shared by the deep copies predict_model makes
    requested = {}  # id of a live block -> the bytes asked for it (blocks have __slots__), shared likewise
    frames = None  # with a list: the model code's innermost frames of each allocation

    def malloc(self, request_bytes: int):
        block = super().malloc(request_bytes)
        self.requested[id(block)] = request_bytes
        self.log.append(("alloc", request_bytes))
        if self.frames is not None:
            stack = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()
                     if "/torch/" not in f.filename and "lab_helpers" not in f.filename]
            self.frames.append(stack[-3:][::-1])
        return block

    def free(self, block) -> None:
        self.log.append(("free", self.requested.pop(id(block))))
        super().free(block)


class MarkingTracer(tracer.AllocationTracer):
    """AllocationTracer whose process-long workspaces are marked in the log, to be left out."""

    def _persistent(self, nbytes: int) -> None:
        RecordingAllocator.log.append(("workspace", nbytes))
        super()._persistent(nbytes)


def made_before(probe: dict, fresh: bool = False) -> set:
    """The workspaces the probe's process had made before this point (none when it ran first)."""
    point = (probe["family"], probe["batch"], probe["context"])
    if fresh:
        return set()
    earlier = PROBE_ORDER[:PROBE_ORDER.index(point)]
    cublaslt = any(family in BIASED for family, _, _ in earlier)
    return ({CUBLAS_BYTES} if earlier else set()) | ({CUBLASLT_BYTES} if cublaslt else set())


def canonical(events, dropped=()) -> list:
    """(action, bytes) events as a list of allocations and sorted runs of frees; the allocation
    after a workspace mark left out when its size is in `dropped`."""
    out, frees, skip = [], [], False
    for action, size in events:
        if action == "workspace":
            skip = size in dropped
        elif action == "alloc":
            if skip:
                skip = False
                continue
            if frees:
                out.append(("free", tuple(sorted(frees))))
                frees = []
            out.append(("alloc", size))
        else:
            frees.append(size)
    if frees:
        out.append(("free", tuple(sorted(frees))))
    return out


def gpu_events(probe: dict) -> list:
    """The probe's alloc and free requests (free_requested; free_completed repeats it)."""
    events, frames = [], []
    for action, size, _, stack in probe["events"]:
        if action in ("alloc", "free_requested"):
            events.append(("alloc" if action == "alloc" else "free", size))
            frames.append(stack)
    return events, frames


def traced_events(probe: dict) -> list:
    name, changes = PROBE_FAMILIES[probe["family"]]
    raw = json.loads((ROOT / "data" / "models" / f"{name}.json").read_text())
    shape = parse_config({**raw, **changes}, probe["family"])
    RecordingAllocator.log, RecordingAllocator.requested = [], {}
    # the replay's allocator is made in lab_helpers.real.replay; no trace cache, so that the run is traced
    original = replay.replay_allocator_for, tracer.AllocationTracer
    replay.replay_allocator_for = lambda settings, capacity_bytes=None: RecordingAllocator()
    tracer.AllocationTracer = MarkingTracer
    try:
        predict.predict_model(shape, RunSpec(shape.name, batch=probe["batch"], context=probe["context"],
                                             new_tokens=4), trace_cache=None)
    finally:
        replay.replay_allocator_for, tracer.AllocationTracer = original
    return RecordingAllocator.log


def compare(path: Path, show: int, fresh: bool = False) -> bool:
    probe = json.loads(path.read_text())
    gpu, _ = gpu_events(probe)
    before = made_before(probe, fresh)
    gpu_c, traced_c = canonical(gpu), canonical(traced_events(probe), before)
    label = f"{probe['family']} ({probe['batch']}, {probe['context']})"
    print(f"{label}: left out: the workspaces made earlier by the probe's process {sorted(before)}")
    return same_requests(gpu_c, traced_c, show)


def same_requests(gpu_c: list, traced_c: list, show: int) -> bool:
    """Print the first difference of two canonical sequences, or that they are equal; the frees after
    the last allocation are the end of the run: the traced ones must be among the GPU's."""
    gpu_tail = gpu_c.pop()[1] if gpu_c and gpu_c[-1][0] == "free" else ()
    traced_tail = traced_c.pop()[1] if traced_c and traced_c[-1][0] == "free" else ()
    for i, (g, t) in enumerate(zip(gpu_c, traced_c)):
        if g != t:
            print(f"  first difference at item {i} of {len(gpu_c)} (GPU) / {len(traced_c)} (traced)")
            for j in range(max(0, i - 3), min(i + show, max(len(gpu_c), len(traced_c)))):
                print(f"  {j:5d} gpu {gpu_c[j] if j < len(gpu_c) else '-'!s:60.60} "
                      f"traced {traced_c[j] if j < len(traced_c) else '-'!s:60.60}")
            return False
    if len(gpu_c) != len(traced_c):
        print(f"  equal over {min(len(gpu_c), len(traced_c))} items, then GPU {len(gpu_c)}, traced {len(traced_c)}")
        return False
    rest = list(gpu_tail)
    for size in traced_tail:
        if size not in rest:
            print(f"  the traced run ends freeing {size} bytes, which the GPU's end does not free")
            return False
        rest.remove(size)
    print(f"  equal: {len(gpu_c)} items")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probes", nargs="+", type=Path, help="probe files (JSON) of the SDPA probe")
    parser.add_argument("--show", type=int, default=8, help="items shown after the first difference")
    parser.add_argument("--fresh", action="store_true",
                        help="each file's point ran first in its process (sdpa_probe.py OUT FAMILY:BATCH:CONTEXT)")
    args = parser.parse_args(argv)
    results = [compare(path, args.show, args.fresh) for path in args.probes]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
