"""The one budget rule against the GPU it runs on (marker `gpu`; needs one CUDA GPU, seconds):

    python3 -m pytest -o addopts= -m gpu tests/test_gpu_budget_rule.py

It reads the device's total memory as CUDA reports it (torch's total_memory, cudaMemGetInfo's total)
and checks that the budget the lab gives that GPU model never exceeds it. On an H200 it also checks
that the lab's record of the H200 (143771 MiB in data/gpu-memory.json, the reference of every derived
budget) is nvidia-smi's figure, above CUDA's total (150109880320 bytes there), and measures the
usable memory again (the probe `fit` runs) to compare it with MEASURED_USABLE. With ITERAGPU_REPORT_DIR set, the figures go to budget-rule.jsonl."""
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from lab_helpers.real.budget import MEASURED_USABLE, read_gpu_memory  # noqa: E402
from lab_helpers.real.fit import gpu_budget, usable_memory_bytes  # noqa: E402

# the rate card's model_id of a GPU by the name CUDA gives it
BY_NAME = {"NVIDIA H200": "h200-sxm", "NVIDIA B200": "b200", "NVIDIA H100 80GB HBM3": "h100-sxm",
           "NVIDIA H100 NVL": "h100-nvl", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA L4": "l4", "NVIDIA L40S": "l40s",
           "NVIDIA L40": "l40", "NVIDIA A10": "a10", "NVIDIA A40": "a40", "NVIDIA RTX A6000": "rtx-a6000",
           "NVIDIA RTX 6000 Ada Generation": "rtx-6000-ada", "NVIDIA A100-SXM4-80GB": "a100-sxm-80gb",
           "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb"}


def report(row: dict) -> None:
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "budget-rule.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


def test_the_budget_of_this_gpu_model_stays_within_what_cuda_reports():
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    gpu = BY_NAME.get(props.name)
    row = {"name": props.name, "model_id": gpu, "total_memory_bytes": int(props.total_memory),
           "mem_get_info_total_bytes": int(total), "mem_get_info_free_bytes": int(free),
           "driver_cuda": torch.version.cuda, "torch": torch.__version__}
    if gpu is not None:
        row["budget_bytes"] = gpu_budget(gpu)[0]
        record = read_gpu_memory().get(gpu)
        row["file_total_bytes"] = record["total_bytes"] if record else None
    report(row)
    if gpu is None:
        pytest.skip(f"{props.name} is not a GPU model of the rate card")
    assert row["budget_bytes"] <= props.total_memory and row["budget_bytes"] <= total
    if gpu == "h200-sxm":
        # the file's figures are nvidia-smi's; the driver keeps part of them from CUDA (measured on the lab's
        # H200: cudaMemGetInfo's total 150109880320 bytes against nvidia-smi's 143771 MiB)
        assert read_gpu_memory()["h200-sxm"]["total_bytes"] == 143771 * 2**20
        assert props.total_memory == total == 150109880320


def test_the_h200_usable_memory_is_what_the_rule_records():
    if torch.cuda.get_device_properties(0).name != "NVIDIA H200":
        pytest.skip("MEASURED_USABLE holds an H200's figure")
    usable = usable_memory_bytes("cuda:0")
    report({"usable_memory_bytes": usable, "recorded": MEASURED_USABLE["h200-sxm"][0]})
    assert usable == MEASURED_USABLE["h200-sxm"][0]
