"""lab_helpers/allocator/lesson.py: the lesson's experiments replayed on the allocator model."""
import pytest

from lab_helpers.allocator.lesson import (PREDICTED_LABEL, LessonAllocator, cached_free_blocks, predict_holes,
                                          replay_steps)
from lab_helpers.allocator.model import AllocatorModel
from lab_helpers.core.errors import LabError

KIB, MIB = 2**10, 2**20


def test_the_label_says_it_is_a_prediction():
    assert PREDICTED_LABEL == "predicted, not measured"


def test_rounding_and_the_small_pool():
    rows = replay_steps([("1 byte", [("malloc", "a", 1)]), ("513 bytes", [("malloc", "b", 513)])])
    assert [r["allocated"] for r in rows] == [512, 512 + 1024]
    assert rows[-1]["small_pool_allocated"] == 1536 and rows[-1]["large_pool_allocated"] == 0
    assert rows[-1]["small_pool_segments"] == 1 and rows[-1]["reserved"] == 2 * MIB
    steps = [(f"#{k}", [("malloc", k, 256 * KIB)]) for k in range(1, 10)]
    rows = replay_steps(steps)
    assert [r["small_pool_segments"] for r in rows] == [1] * 8 + [2]
    assert [r["reserved"] for r in rows] == [2 * MIB] * 8 + [4 * MIB]
    border = replay_steps([("1 MiB", [("malloc", "s", MIB)]), ("1 MiB + 1", [("malloc", "l", MIB + 1)])])
    assert border[0]["small_pool_reserved"] == 2 * MIB and border[0]["large_pool_reserved"] == 0
    assert border[1]["large_pool_reserved"] == 20 * MIB and border[1]["large_pool_segments"] == 1


def test_the_large_pool_shares_20_mib_and_does_not_split_1_mib():
    rows = replay_steps([(n, [("malloc", n, n * MIB)]) for n in (3, 4, 9, 10, 25)])
    assert [r["reserved"] // MIB for r in rows] == [20, 20, 20, 30, 56]
    assert rows[-1]["allocated"] == (3 + 4 + 9 + 10 + 26) * MIB  # 25 MiB holds its whole 26 MiB segment
    assert rows[-1]["large_pool_segments"] == 3


def test_del_keeps_segments_and_empty_cache_returns_only_wholly_free_ones():
    rows = replay_steps([("a", [("malloc", "a", 16 * MIB), ("malloc", "b", 3 * MIB), ("malloc", "c", 3 * MIB)]),
                         ("del", [("free", "a", "b")]),
                         ("empty_cache", [("empty_cache",)]),
                         ("reset", [("reset_peaks",)])])
    assert [(r["allocated"] // MIB, r["reserved"] // MIB) for r in rows] == [(22, 36), (3, 36), (3, 20), (3, 20)]
    assert rows[2]["max_allocated"] == 22 * MIB and rows[2]["max_reserved"] == 36 * MIB  # peaks survive
    assert rows[3]["max_allocated"] == 3 * MIB and rows[3]["max_reserved"] == 20 * MIB
    assert rows[2]["large_pool_segments"] == 1 and rows[2]["large_pool_reserved"] == 20 * MIB


def test_the_per_pool_counters_follow_the_model():
    allocator = LessonAllocator()
    replay_steps([("x", [("malloc", "x", 700), ("malloc", "y", 5 * MIB), ("free", "x")])], allocator)
    plain = AllocatorModel()
    plain.free(plain.malloc(700))
    plain.malloc(5 * MIB)
    assert (allocator.allocated, allocator.reserved) == (plain.allocated, plain.reserved)
    assert sum(p["allocated"] for p in allocator.pools.values()) == allocator.allocated
    assert sum(p["reserved"] for p in allocator.pools.values()) == allocator.reserved
    assert cached_free_blocks(allocator) == {"split_free_bytes": 15 * MIB, "split_free_blocks": 1,
                                             "largest_free_block": 15 * MIB,
                                             "wholly_free_segment_bytes": 2 * MIB}


@pytest.mark.parametrize("call, message", [
    (("malloc", "x", 0), "whole number of bytes"), (("malloc", "x", True), "whole number of bytes"),
    (("free", "nothing"), "is not allocated"), (("copy", "x"), "not a call the lesson replays"),
    (("empty_cache", "x"), "not a call the lesson replays"),
])
def test_a_bad_step_is_refused(call, message):
    with pytest.raises(LabError, match=message):
        replay_steps([("bad", [call])])
    with pytest.raises(LabError, match="already allocated"):
        replay_steps([("twice", [("malloc", "x", 1), ("malloc", "x", 1)])])


def test_holes_fail_by_default_and_fit_with_expandable_segments():
    outcome = predict_holes(400 * MIB, 20 * MIB, 20, 40 * MIB, 410 * MIB)
    default, expandable = outcome["default"], outcome["expandable"]
    assert default["succeeded"] is False
    assert (default["reserved"], default["allocated"]) == (400 * MIB, 200 * MIB)
    assert (default["split_free_bytes"], default["split_free_blocks"], default["largest_free_block"]) == (
        200 * MIB, 10, 20 * MIB)
    oom = default["out_of_memory"]
    assert oom["segment_bytes"] == 40 * MIB and oom["released_before_failing_bytes"] == 0
    assert oom["free_under_budget_bytes"] == 10 * MIB
    # the holes' pages unmapped, 40 MiB mapped at the segment's end
    assert expandable == {"succeeded": True, "allocated": 240 * MIB, "reserved": 240 * MIB}
    roomy = predict_holes(400 * MIB, 20 * MIB, 20, 40 * MIB, 440 * MIB)
    assert roomy["default"]["succeeded"] is True and roomy["default"]["reserved"] == 440 * MIB
