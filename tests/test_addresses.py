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
