"""The allocator model and predict/compare, on the CPU.

The regression table holds counters measured on an NVIDIA H200 with torch 2.11.0+cu130
(driver 580.159.04) in fresh processes, with 2 warm-up passes and 1 repeat, read after
model_load, inputs, cold_forward, warmup and warm_forward."""
import json
import subprocess
import sys

import pytest

from conftest import full_measurement

MIB = 2**20
# (batch, context, width, hidden, dtype) -> per phase (end allocated, peak allocated, end reserved, peak reserved)
MEASURED_ON_H200 = [
    ((1, 16, 64, 256, 'float32'), [(132608, 132608, 2097152, 2097152), (136704, 136704, 2097152, 2097152), (34743808, 34772480, 35651584, 35651584), (34739712, 34772480, 35651584, 35651584), (34743808, 34772480, 35651584, 35651584)]),
    ((2, 128, 1024, 4096, 'float32'), [(33574912, 33574912, 35651584, 35651584), (34623488, 34623488, 35651584, 35651584), (70275072, 77615104, 92274688, 92274688), (69226496, 77615104, 92274688, 92274688), (70275072, 77615104, 92274688, 92274688)]),
    ((2, 128, 1024, 4096, 'float16'), [(16787456, 16787456, 23068672, 23068672), (17311744, 17311744, 23068672, 23068672), (52439040, 56109056, 58720256, 58720256), (51914752, 56109056, 58720256, 58720256), (52439040, 56109056, 58720256, 58720256)]),
    ((3, 77, 1000, 3000, 'bfloat16'), [(12008448, 12008448, 23068672, 23068672), (12470784, 12470784, 23068672, 23068672), (47536128, 49846784, 56623104, 56623104), (47073792, 49846784, 56623104, 56623104), (47536128, 49846784, 56623104, 56623104)]),
    ((1, 1, 7, 5, 'float16'), [(2048, 2048, 2097152, 2097152), (2560, 2560, 2097152, 2097152), (34606080, 34606592, 35651584, 35651584), (34605568, 34606592, 35651584, 35651584), (34606080, 34606592, 35651584, 35651584)]),
    ((8, 4096, 4096, 16384, 'bfloat16'), [(268476416, 268476416, 270532608, 270532608), (536911872, 536911872, 538968064, 538968064), (839950336, 2718998528, 2720006144, 2720006144), (571514880, 2718998528, 2720006144, 2720006144), (839950336, 2718998528, 2720006144, 2720006144)]),
    ((4, 2048, 4096, 16384, 'float32'), [(536952832, 536952832, 538968064, 538968064), (671170560, 671170560, 673185792, 673185792), (839991296, 1779515392, 1780482048, 1780482048), (705773568, 1779515392, 1780482048, 1780482048), (839991296, 1779515392, 1780482048, 1780482048)]),
    ((5, 999, 1234, 4321, 'float32'), [(42680320, 42680320, 48234496, 48234496), (67846144, 67846144, 73400320, 73400320), (127104512, 275117056, 283115520, 283115520), (102449152, 275117056, 283115520, 283115520), (127104512, 275117056, 283115520, 283115520)]),
]


@pytest.mark.parametrize("sizes, measured", MEASURED_ON_H200, ids=lambda v: str(v) if isinstance(v, tuple) else "")
def test_predict_matches_h200_measurements(mm, sizes, measured):
    batch, context, width, hidden, dtype = sizes
    config = mm.MeasureConfig(batch=batch, context=context, width=width, hidden=hidden, dtype=dtype,
                              warmup=2, repeats=1)
    phases = mm.predict(config)["phases"]
    got = [(p["end_allocated_bytes"], p["peak_allocated_bytes"], p["end_reserved_bytes"], p["peak_reserved_bytes"])
           for p in phases]
    assert got == measured


@pytest.mark.parametrize("request_bytes, rounded", [(1, 512), (511, 512), (512, 512), (513, 1024), (2**20, 2**20), (2**20 + 1, 2**20 + 512)])
def test_round_size(mm, request_bytes, rounded):
    assert mm.AllocatorModel.round_size(request_bytes) == rounded


@pytest.mark.parametrize("rounded, segment", [(512, 2 * MIB), (MIB, 2 * MIB), (MIB + 512, 20 * MIB), (10 * MIB - 512, 20 * MIB), (10 * MIB, 10 * MIB), (10 * MIB + 512, 12 * MIB)])
def test_segment_size(mm, rounded, segment):
    assert mm.AllocatorModel.segment_size(rounded) == segment


def test_small_requests_share_a_segment(mm):
    alloc = mm.AllocatorModel()
    blocks = [alloc.malloc(256 * 1024) for _ in range(8)]
    assert alloc.allocated == 8 * 256 * 1024 and alloc.reserved == 2 * MIB
    alloc.malloc(1)
    assert alloc.reserved == 4 * MIB  # the first segment is full: a second one
    for b in blocks:
        alloc.free(b)
    assert alloc.allocated == 512 and alloc.reserved == 4 * MIB  # freeing never returns segments
    again = alloc.malloc(2 * MIB // 2)
    assert alloc.reserved == 4 * MIB and again.size == MIB  # merged free space is reused


def test_large_block_not_split_when_one_mib_or_less_remains(mm):
    alloc = mm.AllocatorModel()
    block = alloc.malloc(11 * MIB)  # segment rounds to 12 MiB, 1 MiB would remain: no split
    assert block.size == 12 * MIB and alloc.allocated == 12 * MIB and alloc.reserved == 12 * MIB
    other = mm.AllocatorModel().malloc(11 * MIB - 1024)  # 1 MiB + 1 KiB remains: split
    assert other.size == 11 * MIB - 1024


def test_medium_requests_share_20_mib_segments(mm):
    alloc = mm.AllocatorModel()
    alloc.malloc(3 * MIB)
    alloc.malloc(3 * MIB)
    assert alloc.reserved == 20 * MIB and alloc.allocated == 6 * MIB


def test_peaks_reset_to_current(mm):
    alloc = mm.AllocatorModel()
    block = alloc.malloc(4 * MIB)
    alloc.free(block)
    assert alloc.peak_allocated == 4 * MIB
    alloc.reset_peaks()
    assert alloc.peak_allocated == 0 and alloc.peak_reserved == 20 * MIB


def test_prediction_layout(mm):
    got = mm.predict(mm.MeasureConfig(warmup=0, repeats=3))
    assert [p["phase"] for p in got["phases"]] == ["model_load", "inputs", "cold_forward", "warmup"] + ["warm_forward"] * 3
    assert [p["index"] for p in got["phases"]][-3:] == [0, 1, 2]
    warmup = got["phases"][3]
    assert warmup["passes"] == 0 and warmup["peak_allocated_bytes"] == warmup["end_allocated_bytes"] == warmup["baseline_allocated_bytes"]
    for p in got["phases"]:
        assert p["baseline_allocated_bytes"] <= p["peak_allocated_bytes"] and p["end_allocated_bytes"] <= p["peak_allocated_bytes"]
        assert p["end_allocated_bytes"] <= p["end_reserved_bytes"] and p["peak_allocated_bytes"] <= p["peak_reserved_bytes"]
    assert got["workspace"]["bytes"] == [32 * MIB, MIB] and "H200" in got["workspace"]["source"]


def test_workspace_term_shifts_everything_after_the_first_product(mm):
    config = mm.MeasureConfig(batch=2, context=128, width=1024)
    with_ws = mm.predict(config)["phases"]
    without = mm.predict(config, workspace_bytes=())["phases"]
    assert with_ws[:2] == without[:2]
    for a, b in zip(with_ws[2:], without[2:]):
        assert a["end_allocated_bytes"] - b["end_allocated_bytes"] == 33 * MIB


def measurement_like(mm, config, shift=0):
    """A document with a measurement's layout whose counters are the prediction (a test fixture)."""
    prediction = mm.predict(config)
    phases = [dict(p) for p in prediction["phases"]]
    phases[-1]["peak_allocated_bytes"] += shift
    return {"configuration": prediction["configuration"], "phases": phases}


def test_compare_exact_and_detects_workspace(mm):
    config = mm.MeasureConfig(batch=3, context=77, width=1000, hidden=3000, dtype="bfloat16")
    got = mm.compare(measurement_like(mm, config))
    assert got["allocated_exact"] is True
    assert got["workspace_detected_bytes"] == 33 * MIB
    assert all(v == 0 for row in got["rows"] for k, v in row.items() if k.startswith("difference_"))


def test_compare_reports_a_difference(mm, mm_script, tmp_path):
    doc = full_measurement(mm, mm.MeasureConfig(), shift=512)
    got = mm.compare(doc)
    assert got["allocated_exact"] is False
    assert got["rows"][-1]["difference_peak_allocated_bytes"] == 512
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, str(mm_script), "compare", str(path), "--fail-on-difference"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and json.loads(proc.stdout)["allocated_exact"] is False
    proc = subprocess.run([sys.executable, str(mm_script), "compare", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0


def test_predict_cli_workspace_override(mm_script):
    proc = subprocess.run([sys.executable, str(mm_script), "predict", "--workspace-bytes", "8519680"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["workspace"] == {"bytes": [8519680], "source": "given on the command line"}
