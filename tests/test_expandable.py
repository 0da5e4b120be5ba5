"""The model of the caching allocator under expandable_segments:True, request by request: against what
PyTorch reported on an H200, against the rules of c10/cuda/CUDACachingAllocator.cpp on hand-built
sequences, and in the predictions that use it."""
import json

import pytest

from lab_helpers.allocator.expandable import (H200_TOTAL_MEMORY_BYTES, CappedExpandableAllocator, ExpandableAllocator,
                                              PagesOutOfMemory)
from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.allocator.settings import (DEFAULT_SETTINGS, AllocatorSettings, allocator_settings,
                                            parse_allocator_conf, recorded_settings)

MIB, GIB = 2**20, 2**30
EXPANDABLE = AllocatorSettings(expandable_segments=True)


def replay(allocator, steps):
    """Run (name, bytes) allocations, ("free", name) and ("empty_cache", None); return the
    (allocated, reserved) pair after each step."""
    live, seen = {}, []
    for name, value in steps:
        if name == "free":
            allocator.free(live.pop(value))
        elif name == "empty_cache":
            allocator.release_cached()
        else:
            live[name] = allocator.malloc(value)
        seen.append((allocator.allocated, allocator.reserved))
    return seen, live


def mapped_ranges(allocator, small):
    """Each contiguous mapped range of a pool, as torch.cuda.memory_snapshot() lists the segments of an
    expandable segment: (total bytes, [(block bytes, state)])."""
    ranges = []
    for segment in allocator.segments[small]:
        run = []
        for block in [*segment.blocks, None]:
            if block is not None and block.mapped:
                run.append((block.size, "inactive" if block.free else "active_allocated"))
            elif run:
                ranges.append((sum(size for size, _ in run), run))
                run = []
    return ranges


# torch.empty(n, dtype=torch.uint8) on an NVIDIA H200, torch 2.11.0+cu130, PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True: memory_allocated() and memory_reserved() after each step (2026-12-01)
H200_SEQUENCE = [
    (("a", 1024), (1024, 2097152)),
    (("b", MIB), (1049600, 2097152)),
    (("c", MIB + 512), (2098688, 23068672)),
    (("d", 5 * MIB), (7341568, 23068672)),
    (("e", 11 * MIB), (18875904, 23068672)),
    (("f", 21 * MIB), (40896000, 44040192)),
    (("g", 100 * MIB), (145753600, 148897792)),
    (("h", 3 * MIB), (148899328, 169869312)),
    (("free", "g"), (44041728, 169869312)),
    (("i", 50 * MIB), (96470528, 169869312)),
    (("j", 60 * MIB), (159385088, 232783872)),
    (("free", "d"), (154142208, 232783872)),
    (("k", 4 * MIB), (158336512, 232783872)),
    (("free", "j"), (95421952, 232783872)),
    (("free", "i"), (42993152, 232783872)),
    (("l", 30 * MIB), (74450432, 232783872)),
    (("empty_cache", None), (74450432, 127926272)),
    (("m", 7 * MIB), (81790464, 127926272)),
    (("n", 1), (81790976, 127926272)),
    (("o", 700 * 1024), (82507776, 127926272)),
    (("p", 3 * MIB), (85653504, 127926272)),
]
# the snapshot at the end of that sequence
H200_SMALL_RANGES = [(2097152, [(1024, "active_allocated"), (1048576, "active_allocated"), (512, "active_allocated"),
                                (716800, "active_allocated"), (330240, "inactive")])]
H200_LARGE_RANGES = [
    (83886080, [(1049088, "active_allocated"), (4194304, "active_allocated"), (1048576, "inactive"),
                (11534336, "active_allocated"), (22020096, "active_allocated"), (31457280, "active_allocated"),
                (12582400, "inactive")]),
    (41943040, [(7340032, "active_allocated"), (3145728, "active_allocated"), (8389120, "inactive"),
                (3145728, "active_allocated"), (19922432, "inactive")]),
]


def test_the_h200_sequence_is_replayed_to_the_byte():
    allocator = ExpandableAllocator()
    seen, _ = replay(allocator, [step for step, _ in H200_SEQUENCE])
    assert seen == [counters for _, counters in H200_SEQUENCE]
    assert mapped_ranges(allocator, small=True) == H200_SMALL_RANGES
    assert mapped_ranges(allocator, small=False) == H200_LARGE_RANGES


def test_the_h200_sequence_after_a_clear_grows_the_tail_only_by_the_missing_pages():
    # measured after everything was freed and the cache emptied: (0, 0), then these four steps
    allocator = ExpandableAllocator()
    seen, _ = replay(allocator, [("a", 25 * MIB), ("b", 25 * MIB + 1), ("free", "a"), ("c", 10 * MIB),
                                 ("d", 16 * MIB)])
    assert [seen[0], seen[1], seen[3], seen[4]] == [(26214400, 41943040), (52429312, 62914560),
                                                    (36700672, 62914560), (53477888, 83886080)]


def test_the_h200_out_of_memory_sequence_releases_the_free_pages_then_opens_a_second_range():
    # measured: the device's free bytes before any tensor were 149557477376, and nothing outside the
    # allocator was created (no library handle): that is what the allocator may map
    allocator = CappedExpandableAllocator(149557477376)
    seen, live = replay(allocator, [("a", 60 * GIB), ("b", 40 * GIB), ("c", 20 * GIB), ("free", "b"),
                                    ("d", 50 * GIB)])
    assert seen[2] == (120 * GIB, 120 * GIB) and seen[3] == (80 * GIB, 120 * GIB)
    assert seen[4] == (130 * GIB, 130 * GIB)  # b's 40 GiB unmapped before d's 50 GiB were mapped
    assert allocator.retries == 1 and allocator.unmapped_bytes == 40 * GIB
    # d does not fit in the first range's address space (8088 pages of 20 MiB): a second segment
    assert mapped_ranges(allocator, small=False) == [(60 * GIB, [(60 * GIB, "active_allocated")]),
                                                     (20 * GIB, [(20 * GIB, "active_allocated")]),
                                                     (50 * GIB, [(50 * GIB, "active_allocated")])]
    with pytest.raises(PagesOutOfMemory):  # PyTorch: "Tried to allocate 30.00 GiB ... 9.29 GiB is free"
        allocator.malloc(30 * GIB)
    assert (allocator.allocated, allocator.reserved) == (130 * GIB, 130 * GIB)
    assert live["d"].segment is not live["a"].segment


def test_each_pool_maps_its_own_page_size():
    allocator = ExpandableAllocator()
    allocator.malloc(MIB)  # the small pool: one 2 MiB page
    assert allocator.reserved == 2 * MIB
    allocator.malloc(MIB + 1)  # 1 MiB + 512 after rounding: the large pool, one 20 MiB page
    assert allocator.reserved == 22 * MIB
    allocator.malloc(41 * MIB)  # 19 MiB - 512 free at the end, 22 MiB + 512 more: two pages
    assert allocator.reserved == 62 * MIB
    assert allocator.peak_reserved == 62 * MIB and allocator.allocated == MIB + (MIB + 512) + 41 * MIB


def test_a_large_request_no_longer_gets_a_segment_of_its_own_size():
    # default: 10 MiB and more gets its own segment rounded to 2 MiB; expandable: whole 20 MiB pages
    default, expandable = AllocatorModel(), ExpandableAllocator()
    for allocator in (default, expandable):
        allocator.malloc(11 * MIB)
    assert (default.reserved, expandable.reserved) == (12 * MIB, 20 * MIB)
    for allocator in (default, expandable):
        allocator.malloc(11 * MIB)
    assert (default.reserved, expandable.reserved) == (24 * MIB, 40 * MIB)
    for allocator in (default, expandable):
        allocator.malloc(11 * MIB)
    assert (default.reserved, expandable.reserved) == (36 * MIB, 40 * MIB)  # 18 MiB free at the end


def test_a_block_freed_at_the_end_merges_with_the_free_tail_and_serves_the_next_request():
    allocator = ExpandableAllocator()
    first = allocator.malloc(12 * MIB)
    last = allocator.malloc(6 * MIB)  # [12, 18) of the first page; 2 MiB free after it
    allocator.free(last)
    assert [(b.size, b.free) for b in first.segment.blocks if b.mapped] == [(12 * MIB, False), (8 * MIB, True)]
    again = allocator.malloc(8 * MIB)  # the merged 8 MiB at the end, no new page
    assert again.address == first.address + 12 * MIB and allocator.reserved == 20 * MIB


def test_best_fit_passes_over_the_growable_end_for_a_block_that_cannot_grow():
    # get_free_block: the 4 MiB block at the end counts as its size plus the unmapped range after it,
    # so the 6 MiB hole at the start serves a 3 MiB request (the default allocator takes the 4 MiB)
    allocator = ExpandableAllocator()
    head = allocator.malloc(6 * MIB)
    for size in (2 * MIB, 6 * MIB, 2 * MIB):
        allocator.malloc(size)
    allocator.free(head)
    taken = allocator.malloc(3 * MIB)
    assert taken.address == head.address and allocator.reserved == 20 * MIB
    tail = allocator.malloc(4 * MIB)  # the end still serves what only it fits
    assert tail.address == head.address + 16 * MIB and allocator.reserved == 20 * MIB


def test_a_large_block_splits_even_when_less_than_1_mib_would_remain():
    default, expandable = AllocatorModel(), ExpandableAllocator()
    for allocator in (default, expandable):
        allocator.free(allocator.malloc(20 * MIB))  # one free 20 MiB range in each
        allocator.malloc(20 * MIB - 4096)
        allocator.malloc(2048)  # small pool
    # default: 4096 bytes left (under 1 MiB) stay inside the block; expandable: split off
    assert default.allocated == 20 * MIB + 2048
    assert expandable.allocated == 20 * MIB - 4096 + 2048


def test_release_gives_back_whole_free_pages_only():
    allocator = ExpandableAllocator()
    blocks = [allocator.malloc(size) for size in (30 * MIB, 15 * MIB, 35 * MIB)]  # 80 MiB: four pages
    allocator.free(blocks[0])  # [0, 30): page 0 is wholly free, page 1 is shared with blocks[1]
    allocator.free(blocks[2])  # [45, 80): page 3 wholly free, page 2 shared
    allocator.release_cached()
    assert allocator.reserved == 40 * MIB and allocator.unmapped_bytes == 40 * MIB
    mapped = [(b.address, b.size, b.free) for b in blocks[1].segment.blocks if b.mapped]
    assert mapped == [(20 * MIB, 10 * MIB, True), (30 * MIB, 15 * MIB, False), (45 * MIB, 15 * MIB, True)]
    allocator.malloc(30 * MIB)  # the lowest place: the unmapped page 0 and the free 10 MiB after it
    assert allocator.reserved == 60 * MIB
    assert allocator.peak_reserved == 80 * MIB


def test_releasing_everything_returns_to_zero_and_the_segment_is_gone():
    allocator = ExpandableAllocator()
    for block in [allocator.malloc(size) for size in (3 * MIB, 100, 50 * MIB)]:
        allocator.free(block)
    allocator.release_cached()
    assert (allocator.allocated, allocator.reserved) == (0, 0)
    assert allocator.segments == {True: [], False: []}


def test_under_a_capacity_the_free_pages_are_released_before_out_of_memory():
    class Full(Exception):
        pass
    allocator = CappedExpandableAllocator(80 * MIB, Full)
    first, middle, last = (allocator.malloc(20 * MIB) for _ in range(3))  # pages 0, 1, 2
    allocator.free(middle)  # page 1 wholly free, between two live blocks
    big = allocator.malloc(30 * MIB)  # two more pages at the end would make 100 MiB: release page 1, retry
    assert allocator.retries == 1 and allocator.unmapped_bytes == 20 * MIB
    assert big.address == last.address + 20 * MIB and (allocator.allocated, allocator.reserved) == (70 * MIB, 80 * MIB)
    assert allocator.peak_reserved == 80 * MIB
    with pytest.raises(Full):  # page 1 again would make 100 MiB; nothing free is left to release
        allocator.malloc(20 * MIB)
    assert (allocator.allocated, allocator.reserved) == (70 * MIB, 80 * MIB) and allocator.retries == 2
    assert first.address == 0


def test_a_mapping_that_does_not_fit_maps_nothing():
    allocator = CappedExpandableAllocator(50 * MIB)
    allocator.malloc(30 * MIB)  # two pages
    with pytest.raises(PagesOutOfMemory):
        allocator.malloc(30 * MIB)  # 10 MiB free at the end + one page would be 60 MiB
    assert (allocator.allocated, allocator.reserved) == (30 * MIB, 40 * MIB)


def test_the_virtual_range_of_an_h200():
    allocator = ExpandableAllocator()
    allocator.malloc(MIB + 512)
    segment = allocator.segments[False][0]
    assert sum(b.size for b in segment.blocks) == 8088 * 20 * MIB
    assert H200_TOTAL_MEMORY_BYTES == 150754820096


# -------------------------------------------------------------------------- the settings
@pytest.mark.parametrize("text, expandable", [
    ("expandable_segments:True", True), ("expandable_segments:False", False), (" expandable_segments : True ", True),
    ("", False), ("   ", False)])
def test_the_settings_the_lab_models(text, expandable):
    assert parse_allocator_conf(text, "--allocator-conf").expandable_segments is expandable


def test_the_flag_wins_over_the_environment_and_both_variables_are_read():
    assert allocator_settings("expandable_segments:False", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) \
        == DEFAULT_SETTINGS
    assert allocator_settings(None, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == EXPANDABLE
    assert allocator_settings(None, {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                     "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments : True"}) == EXPANDABLE
    assert allocator_settings(None, {}) == DEFAULT_SETTINGS


def test_a_measurement_file_says_which_allocator_ran():
    assert recorded_settings({"pytorch_cuda_alloc_conf": "expandable_segments:True"}) == EXPANDABLE
    assert recorded_settings({"pytorch_cuda_alloc_conf": None, "pytorch_alloc_conf": None}) == DEFAULT_SETTINGS
    assert recorded_settings({}) == DEFAULT_SETTINGS  # a file from before the variables were recorded
    assert recorded_settings(None) == DEFAULT_SETTINGS


# ------------------------------------------------------------------------ the predictions
def test_the_synthetic_prediction_under_expandable_segments():
    from lab_helpers.synthetic.network import MeasureConfig
    from lab_helpers.synthetic.predict import predict
    config = MeasureConfig(batch=2, context=128, width=1024, dtype="bfloat16")
    default, expandable = predict(config), predict(config, allocator=EXPANDABLE)
    assert expandable["allocator_conf"] == "expandable_segments:True"
    for a, b in zip(default["phases"], expandable["phases"]):
        assert {k: v for k, v in a.items() if "allocated" in k} == {k: v for k, v in b.items() if "allocated" in k}
    # model_load: 8 MiB weight -> one 20 MiB page, the second 8 MiB weight fits beside it, the biases
    # one 2 MiB small page; cold forward: the 32 MiB cuBLAS workspace maps two more pages, the 512 KiB
    # output a second small page. The default: both weights in one 20 MiB segment, the biases and inputs
    # in a 2 MiB one, then a 32 MiB segment of the workspace's own and a second 2 MiB one: 56 MiB.
    assert [p["end_reserved_bytes"] for p in expandable["phases"]] == [22 * MIB, 22 * MIB, 64 * MIB, 64 * MIB,
                                                                       64 * MIB, 64 * MIB]
    assert [p["end_reserved_bytes"] for p in default["phases"]] == [22 * MIB, 22 * MIB, 56 * MIB, 56 * MIB,
                                                                    56 * MIB, 56 * MIB]


def test_synthetic_compare_replays_the_files_setting():
    from lab_helpers.synthetic.network import MeasureConfig
    from lab_helpers.synthetic.predict import compare, predict
    config = MeasureConfig(batch=2, context=128, width=1024, dtype="bfloat16")
    document = predict(config, allocator=EXPANDABLE)
    for key in ("workspace", "reserved_assumptions", "allocator_conf"):
        del document[key]
    document["kind"] = "iteragpu-lab measurement"
    document["environment"] = {
        "python_version": "3.12.3", "torch_version": "2.11.0+cu130", "cuda_build_version": "13.0",
        "hip_build_version": None, "runtime_note": "note", "device": "cuda:0", "device_count": 1,
        "device_visible": True, "device_name": "NVIDIA H200", "compute_capability": "9.0",
        "total_memory_bytes": 150754820096, "free_memory_bytes": 150000000000,
        "pytorch_cuda_alloc_conf": "expandable_segments:True", "pytorch_alloc_conf": None}
    for phase in document["phases"]:
        phase.update(seconds=0.002, device_seconds=0.001)
        if phase["phase"] == "warm_forward":
            phase.update(achieved_tflops=1.5, host_to_device_time_ratio=2.0)
    result = compare(document)
    assert result["allocator_conf"] == "expandable_segments:True"
    assert all(row[k] == 0 for row in result["rows"] for k in row if k.startswith("difference_"))
    document["environment"]["pytorch_cuda_alloc_conf"] = None  # the same counters under the defaults differ
    result = compare(document)
    assert any(row["difference_end_reserved_bytes"] != 0 for row in result["rows"])


TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096}


def test_the_real_model_prediction_under_expandable_segments(tmp_path):
    from lab_helpers.real.config import load_config
    from lab_helpers.real.predict import predict_model
    from lab_helpers.real.spec import RunSpec
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    shape = load_config(str(path))
    spec = RunSpec("tiny", batch=2, context=16, new_tokens=2)
    default, expandable = predict_model(shape, spec), predict_model(shape, spec, allocator=EXPANDABLE)
    assert expandable["allocator_conf"] == "expandable_segments:True"
    assert "expandable_segments:True" in expandable["assumptions"]
    for a, b in zip(default["phases"], expandable["phases"]):
        assert (a["phase"], a["index"]) == (b["phase"], b["index"])
        assert {k: v for k, v in a.items() if "allocated" in k and k.endswith("_bytes")} == \
            {k: v for k, v in b.items() if "allocated" in k and k.endswith("_bytes")}
    # a tiny model: its weights (under 1 MiB each) take small pages of 2 MiB, its 256000-byte
    # embedding too; the cuBLAS workspace (32 MiB) two 20 MiB pages, where the default cuts a 32 MiB segment
    assert all(p["end_reserved_bytes"] % (2 * MIB) == 0 for p in expandable["phases"])
    assert [p["end_reserved_bytes"] for p in default["phases"]] != [p["end_reserved_bytes"] for p in expandable["phases"]]
    prefill = next(p for p in expandable["phases"] if p["phase"] == "prefill")
    load = expandable["phases"][0]
    assert prefill["end_reserved_bytes"] - load["end_reserved_bytes"] >= 40 * MIB


def test_the_setting_is_put_in_force_before_cuda_starts():
    import subprocess
    import sys
    code = ("import os; from lab_helpers.allocator.settings import AllocatorSettings, put_in_force, "
            "settings_from_environment\n"
            "put_in_force(AllocatorSettings(expandable_segments=True))\n"
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'], os.environ['PYTORCH_ALLOC_CONF'], "
            "settings_from_environment().expandable_segments)\n"
            "import torch\n"
            "put_in_force(AllocatorSettings(expandable_segments=False))\n"  # torch imported, CUDA not started
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])\n")
    from conftest import ROOT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["expandable_segments:True", "expandable_segments:True", "True",
                                   "expandable_segments:False"]
    assert "Warning" not in proc.stderr
