"""bfloat16 autocast on CUDA against its reproduction on meta (marker `gpu`): every call of
tests/autocast_cases.py dispatches the same aten ops, casts included, with the same output dtypes,
under torch.autocast("cuda", dtype=torch.bfloat16) on the GPU and under
lab_helpers.real.autocast.MetaAutocast on meta. With ITERAGPU_REPORT_DIR set, each case's CUDA calls
are appended to autocast-calls.jsonl there (tests/h200_autocast_calls.json pins them for the CPU tests).

    ITERAGPU_TEST_DEVICE=cuda:0 python3 -m pytest -o addopts= -m gpu tests/test_gpu_autocast.py"""
import contextlib
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from autocast_cases import CASES, aten_calls  # noqa: E402
from lab_helpers.real.autocast import MetaAutocast, installed  # noqa: E402

TEST_DEVICE = os.environ.get("ITERAGPU_TEST_DEVICE", "cuda:0")


def meta_region():
    stack = contextlib.ExitStack()
    mode = stack.enter_context(installed(MetaAutocast()))
    stack.enter_context(mode.region(True))
    return stack


@pytest.mark.parametrize("case", list(CASES))
def test_meta_autocast_dispatches_what_cuda_autocast_does(case):
    on_cuda = aten_calls(case, TEST_DEVICE, torch.autocast("cuda", dtype=torch.bfloat16))
    folder = os.environ.get("ITERAGPU_REPORT_DIR")
    if folder:
        with open(Path(folder) / "autocast-calls.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"case": case, "torch": torch.__version__, "calls": on_cuda}) + "\n")
    assert aten_calls(case, "meta", meta_region()) == on_cuda
