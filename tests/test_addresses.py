"""Where the model maps a new segment (lab_helpers.allocator.addresses): the order the H200's driver
was seen to give (docs/validation/2026-12-02-night-one-h200.md, section 3), which decides the
caching allocator's ties between equal free blocks."""
from lab_helpers.allocator.addresses import GRANULE_BYTES, DriverAddresses

MIB = 2**20


def test_each_new_granule_lies_below_the_last_and_large_segments_take_whole_granules():
    d = DriverAddresses()
    weights = d.map(2004 * MIB)  # 2004 MiB takes 63 granules (2016 MiB)
    head = d.map(64 * MIB)
    twenty = d.map(20 * MIB)
    later_twenty = d.map(20 * MIB)
    assert head == weights - 64 * MIB
    assert twenty == head - GRANULE_BYTES and later_twenty == twenty - GRANULE_BYTES  # a later one lies lower
    assert d.map(112 * MIB) == later_twenty - 128 * MIB  # 3.5 granules take 4


def test_smaller_segments_fill_the_lowest_granule_with_room_from_its_bottom():
    d = DriverAddresses()
    first = d.map(20 * MIB)
    small = [d.map(2 * MIB) for _ in range(2)]
    assert small == [first + 20 * MIB, first + 22 * MIB]  # the room above the 20 MiB segment
    second = d.map(20 * MIB)  # 8 MiB of room left in the first granule: a new granule, below
    assert second == first - GRANULE_BYTES
    after = d.map(2 * MIB)  # the lowest room is the new granule's: below the 2 MiB segments before it
    assert after == second + 20 * MIB and after < min(small)
    assert d.map(16 * MIB) == second - GRANULE_BYTES  # no room of 16 MiB left: a new granule


def test_released_ranges_are_mapped_again():
    d = DriverAddresses()
    big = d.map(60 * MIB)  # two granules
    d.release(big, 60 * MIB)
    assert d.map(64 * MIB) == big  # the released run, from its top
    twenty = d.map(20 * MIB)
    small = d.map(2 * MIB)
    d.release(small, 2 * MIB)  # joins the granule's room above it: 12 MiB in one piece
    assert d.map(12 * MIB) == small
    d.release(twenty, 20 * MIB)
    assert d.map(20 * MIB) == twenty


def test_a_larger_segment_leaves_the_rest_of_its_last_granule_as_room():
    # llama-3.1-8b (1, 2048) on the H200, 2026-12-03: the 20 MiB segment mapped third went above the
    # 1002 MiB one, in its last granule, not into a new granule below the 32 MiB one
    d = DriverAddresses()
    weights = d.map(1002 * MIB)  # 32 granules, 22 MiB of the last one left
    head = d.map(32 * MIB)
    assert head == weights - GRANULE_BYTES
    twenty = d.map(20 * MIB)
    assert twenty == weights + 1002 * MIB
    assert d.map(32 * MIB) == head - GRANULE_BYTES  # granules go on downwards
    mlp = d.map(112 * MIB)  # 4 granules, 16 MiB left
    assert mlp == head - 5 * GRANULE_BYTES
    assert d.map(2 * MIB) == mlp + 112 * MIB  # the lowest room that holds it: the 112 MiB one's rest
    assert d.map(2 * MIB) == mlp + 114 * MIB


def test_a_larger_segment_released_gives_back_whole_granules_and_its_shared_granule_as_room():
    d = DriverAddresses()
    alone = d.map(40 * MIB)  # two granules, 24 MiB of the second left and unused
    shared = d.map(40 * MIB)
    small = d.map(2 * MIB)  # the lowest room: in `shared`'s last granule
    assert small == shared + 40 * MIB
    d.release(alone, 40 * MIB)
    assert d.map(64 * MIB) == alone  # both of its granules, as one run
    d.release(shared, 40 * MIB)  # its first granule free; its second still holds `small`
    assert d.map(32 * MIB) == shared  # the one whole granule it gave back
    assert d.map(10 * MIB) == shared + 42 * MIB  # the freed 8 MiB below `small` is too small: above it
    assert d.map(8 * MIB) == shared + GRANULE_BYTES  # that 8 MiB, the lowest room that holds it
