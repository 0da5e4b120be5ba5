"""The one budget rule: what one GPU of a rate-card model may reserve, and one rank of N of them.

`fit --gpu`, `fit --card` and the notebooks ask this module, and nothing else, for a GPU model's budget:

- measured: the usable memory of a fresh measuring process, measured on that GPU model
  (MEASURED_USABLE, with the driver and torch it was measured under);
- else derived, not measured: the device's whole memory as the runtime reports it (data/gpu-memory.json,
  each figure cited) less what the CUDA context and libraries took on the H200 (its total less its
  measured usable memory);
- else, where no total is known, derived, not measured: the card's figure, in GiB as its column
  memory_per_gpu_gib states, scaled by the H200's measured usable memory over its card figure.

A budget never exceeds the device's total (checked where the total is known). At tensor parallel
N > 1 one rank may reserve the GPU's budget less what NCCL holds outside the allocator: measured where
MEASURED_NCCL_OUTSIDE has that GPU model and degree, else the figure measured on two H200s at degree 2,
derived, not measured.
"""
import re

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import display_path, read_json_file
from lab_helpers.core.numbers import MIB
from lab_helpers.core.paths import REPOSITORY

MEASURED = "measured"
DERIVED = "derived, not measured"
# Measured with real_model's usable-memory probe (lab_helpers.real.fit.USABLE_PROBE) on 2026-11-29:
# model_id -> (bytes, what it was measured on).
MEASURED_USABLE = {
    "h200-sxm": (149380136960, "NVIDIA H200 143771 MiB, driver 580.159.04, torch 2.11.0+cu130"),
}
# What NCCL holds outside PyTorch's allocator per rank once its communicator has run a first
# collective (as TensorParallelRun leaves it before the first phase): free memory before the
# process group less free memory after, with the allocator empty. (model_id, degree) -> bytes, where.
MEASURED_NCCL_OUTSIDE = {
    ("h200-sxm", 2): (977272832, "2 x NVIDIA H200 143771 MiB, driver 580.159.04, torch 2.11.0+cu130, NCCL 2.28.9"),
}
# The GPU whose measured figures stand in for the others': its card figure (GiB) and the NCCL degree.
REFERENCE_GPU = "h200-sxm"
REFERENCE_CARD_GIB = 141
NCCL_REFERENCE = (REFERENCE_GPU, 2)

GPU_MEMORY_NAME = "gpu-memory.json"
GPU_MEMORY_PATH = REPOSITORY / "data" / GPU_MEMORY_NAME
MAX_GPU_MEMORY_FILE_BYTES = 256 * 1024  # the shipped file is ~5 kB
MAX_GPU_MEMORY_MODELS = 1000
MAX_TOTAL_BYTES = 2**50  # no GPU holds a pebibyte; the largest budget any command accepts
TOTAL_UNITS = {"MiB": MIB, "KiB": 1024}
TOTAL_FIELDS = ("total", "unit", "reported_by", "url", "source_says")
GPU_MEMORY_FIELDS = ("description", "totals", "not_found")
MAX_TEXT_CHARACTERS = 1000
MODEL_ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


class GpuMemoryError(LabError):
    """A fault in the GPU memory file: one line naming the file, exit 2."""


def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT_CHARACTERS:
        raise GpuMemoryError(f"{where} must be a non-empty text of at most {MAX_TEXT_CHARACTERS} characters")
    return value


def _total_record(gpu: str, record, shown: str) -> dict:
    where = f"{shown}: totals.{gpu}"
    if not MODEL_ID.fullmatch(gpu):
        raise GpuMemoryError(f"{shown}: totals has the key {gpu[:40]!r}, not a rate-card model_id such as 'h100-sxm'")
    if not isinstance(record, dict):
        raise GpuMemoryError(f"{where} must be an object")
    missing = [k for k in TOTAL_FIELDS if k not in record]
    extra = sorted(k for k in record if k not in TOTAL_FIELDS)
    if missing or extra:
        raise GpuMemoryError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {extra[0][:40]!r}"] if extra else [])))
    total, unit = record["total"], record["unit"]
    if unit not in TOTAL_UNITS:
        raise GpuMemoryError(f"{where}.unit must be one of {', '.join(TOTAL_UNITS)}, got {str(unit)[:40]!r}")
    if isinstance(total, bool) or not isinstance(total, int) or not 1 <= total * TOTAL_UNITS[unit] <= MAX_TOTAL_BYTES:
        raise GpuMemoryError(f"{where}.total must be a whole number of {unit} from 1 to {MAX_TOTAL_BYTES} bytes, "
                             f"got {str(total)[:40]}")
    for key in ("reported_by", "url", "source_says"):
        _text(record[key], f"{where}.{key}")
    return {**record, "total_bytes": total * TOTAL_UNITS[unit]}


def parse_gpu_memory(document, shown: str) -> dict:
    """The validated content of a GPU memory document: {model_id: record with total_bytes}."""
    if not isinstance(document, dict):
        raise GpuMemoryError(f"{shown}: not a JSON object")
    missing = [k for k in GPU_MEMORY_FIELDS if k not in document]
    extra = sorted(k for k in document if k not in GPU_MEMORY_FIELDS)
    if missing:
        raise GpuMemoryError(f"{shown}: missing {', '.join(missing)}")
    if extra:
        raise GpuMemoryError(f"{shown}: unknown key {extra[0][:40]!r}")
    _text(document["description"], f"{shown}: description")
    totals, absent = document["totals"], document["not_found"]
    for name, value in (("totals", totals), ("not_found", absent)):
        if not isinstance(value, dict):
            raise GpuMemoryError(f"{shown}: {name} must be an object")
    if len(totals) + len(absent) > MAX_GPU_MEMORY_MODELS:
        raise GpuMemoryError(f"{shown}: more than {MAX_GPU_MEMORY_MODELS} GPU models")
    if REFERENCE_GPU not in totals:
        raise GpuMemoryError(f"{shown}: totals has no {REFERENCE_GPU}, whose measured usable memory the rule "
                             "compares with its total")
    for gpu, why in absent.items():
        if gpu in totals:
            raise GpuMemoryError(f"{shown}: {gpu} is both in totals and in not_found")
        if not MODEL_ID.fullmatch(gpu):
            raise GpuMemoryError(f"{shown}: not_found has the key {gpu[:40]!r}, not a rate-card model_id")
        _text(why, f"{shown}: not_found.{gpu}")
    records = {gpu: _total_record(gpu, record, shown) for gpu, record in totals.items()}
    for gpu, (usable, _) in MEASURED_USABLE.items():
        if gpu in records and usable > records[gpu]["total_bytes"]:
            raise GpuMemoryError(f"{shown}: totals.{gpu} ({records[gpu]['total_bytes']} bytes) is below the "
                                 f"{usable} bytes measured usable on it")
    held = records[REFERENCE_GPU]["total_bytes"] - MEASURED_USABLE[REFERENCE_GPU][0]
    for gpu, record in records.items():
        if gpu not in MEASURED_USABLE and record["total_bytes"] <= held:
            raise GpuMemoryError(f"{shown}: totals.{gpu} ({record['total_bytes']} bytes) is not above the {held} "
                                 "bytes the CUDA context and libraries took on the H200")
    return records


_READ = {}


def read_gpu_memory(path=None) -> dict:
    """The GPU memory file at `path` (default data/gpu-memory.json), validated; the default file is
    read and checked once per process."""
    key = None if path is None else str(path)
    if key in _READ:
        return _READ[key]
    source = GPU_MEMORY_PATH if path is None else path
    shown = f"data/{GPU_MEMORY_NAME}" if path is None else display_path(path)
    try:
        document = read_json_file(source, max_bytes=MAX_GPU_MEMORY_FILE_BYTES)
    except GpuMemoryError:
        raise
    except LabError as exc:  # named as shown: the default file by its place in the checkout
        text = str(exc).replace(display_path(source), shown, 1).replace("a measurement file", "the GPU memory file")
        raise GpuMemoryError(text) from None
    records = parse_gpu_memory(document, shown)
    if path is None:
        _READ[key] = records
    return records


def context_bytes(totals: dict) -> int:
    """What the CUDA context and libraries of a measuring process took on the H200: its total less
    its measured usable memory."""
    return totals[REFERENCE_GPU]["total_bytes"] - MEASURED_USABLE[REFERENCE_GPU][0]


def device_budget(gpu: str, card_gib: int, totals=None) -> dict:
    """One GPU's budget by the one rule: {budget_bytes, memory_source, memory_basis, cuda_total_bytes}
    (cuda_total_bytes None where no total is known)."""
    totals = read_gpu_memory() if totals is None else totals
    total = totals[gpu]["total_bytes"] if gpu in totals else None
    if gpu in MEASURED_USABLE:
        value, where = MEASURED_USABLE[gpu]
        entry = {"budget_bytes": value, "memory_source": MEASURED,
                 "memory_basis": f"{MEASURED}: the usable memory of a fresh measuring process ({where})"}
    elif total is not None:
        held = context_bytes(totals)
        record = totals[gpu]
        value = total - held
        entry = {"budget_bytes": value, "memory_source": DERIVED,
                 "memory_basis": (f"{DERIVED}: the device's total {record['total']} {record['unit']} = {total} bytes "
                                  f"({record['reported_by']}, {record['url']}) less the {held} bytes the CUDA "
                                  f"context and libraries took on the H200 = {value} bytes")}
    else:
        usable = MEASURED_USABLE[REFERENCE_GPU][0]
        value = card_gib * usable // REFERENCE_CARD_GIB  # = card_gib x 2^30 x usable / (141 x 2^30), rounded down
        entry = {"budget_bytes": value, "memory_source": DERIVED,
                 "memory_basis": (f"{DERIVED}: no total of {gpu} is known; the card's {card_gib} GiB x 2^30 x "
                                  f"{usable} / ({REFERENCE_CARD_GIB} x 2^30) = floor({card_gib} x {usable} / "
                                  f"{REFERENCE_CARD_GIB}) = {value} bytes, which may exceed the device: no total "
                                  f"to check it against")}
    if total is not None and entry["budget_bytes"] > total:
        raise LabError(f"the budget of {gpu} ({entry['budget_bytes']} bytes) exceeds its total memory ({total} bytes)")
    return {**entry, "cuda_total_bytes": total}


def nccl_outside(gpu, degree: int) -> dict:
    """What NCCL holds outside the allocator per rank of `gpu` (a model_id, or None when the GPU model
    is not known) at `degree`: {nccl_outside_allocator_bytes, nccl_source, nccl_basis} (0 at degree 1)."""
    if degree == 1:
        return {"nccl_outside_allocator_bytes": 0, "nccl_source": "no NCCL at degree 1", "nccl_basis": None}
    if (gpu, degree) in MEASURED_NCCL_OUTSIDE:
        value, where = MEASURED_NCCL_OUTSIDE[(gpu, degree)]
        return {"nccl_outside_allocator_bytes": value, "nccl_source": MEASURED,
                "nccl_basis": f"{MEASURED} ({where})"}
    value, where = MEASURED_NCCL_OUTSIDE[NCCL_REFERENCE]
    return {"nccl_outside_allocator_bytes": value, "nccl_source": DERIVED,
            "nccl_basis": (f"{DERIVED}: not measured on {gpu or 'this GPU model'} at {degree}; the {value} bytes "
                           f"measured on {NCCL_REFERENCE[0]} at {NCCL_REFERENCE[1]} ({where})")}


def rank_budget(gpu: str, card_gib: int, degree: int, totals=None) -> dict:
    """device_budget and nccl_outside together, with rank_budget_bytes: what one rank may reserve."""
    budget = device_budget(gpu, card_gib, totals)
    nccl = nccl_outside(gpu, degree)
    return {**budget, **nccl, "rank_budget_bytes": budget["budget_bytes"] - nccl["nccl_outside_allocator_bytes"]}


def budget_source_text(entry: dict, degree: int) -> str:
    """One line saying where a rank_budget entry comes from (fit's budget_source)."""
    text = entry["memory_basis"]
    if degree > 1:
        text += (f"; less {entry['nccl_outside_allocator_bytes']} bytes NCCL holds outside the allocator per rank "
                 f"at tensor parallel {degree}, {entry['nccl_basis']}")
    return text


def budget_rule_text(totals=None) -> dict:
    """The rule in words, by label (fit --card's memory_rule)."""
    totals = read_gpu_memory() if totals is None else totals
    usable = MEASURED_USABLE[REFERENCE_GPU][0]
    return {
        MEASURED: "the usable memory of a fresh measuring process, measured on that GPU model (MEASURED_USABLE)",
        DERIVED: (f"the device's total as the runtime reports it (data/{GPU_MEMORY_NAME}, cited) less the "
                  f"{context_bytes(totals)} bytes the CUDA context and libraries took on the H200 "
                  f"({totals[REFERENCE_GPU]['total_bytes']} total - {usable} usable); where no total is known, "
                  f"the card's figure G GiB scaled by the H200's usable / its card figure: "
                  f"floor(G x {usable} / {REFERENCE_CARD_GIB}) bytes"),
    }


def with_memory_source(result: dict, label: str) -> dict:
    """`result` (fit's) with memory_source (measured, derived, not measured, or given) after budget_source."""
    out = {}
    for key, value in result.items():
        out[key] = value
        if key == "budget_source":
            out["memory_source"] = label
    if "memory_source" not in out:
        out["memory_source"] = label
    return out
