"""Where the CUDA driver maps a new segment: the address order that the caching allocator's ties follow.

Among free blocks of equal size the caching allocator takes the lowest address (best fit, then
address), so which of two segments a request lands in depends on where the driver mapped them.
Seen in the memory history of fine-tuning and inference runs on an NVIDIA H200 (driver 580.159.04,
CUDA 13.0, torch 2.11.0+cu130, 2026-12-02):

- the driver hands out virtual addresses in granules of 32 MiB, each new granule below the last;
- a segment of a granule or more takes whole granules (2004 MiB takes 2016, 112 MiB takes 128);
- a smaller one (2 MiB, 16 MiB, 20 MiB) goes to the lowest room that holds it, at the bottom of that
  room, or else starts a new granule at its bottom. A room is what an earlier smaller segment left
  of its granule, or what a larger one left of its last granule. Seen on 2026-12-03: a 20 MiB
  segment above a 1002 MiB one, in the 22 MiB left of its 32 granules (2 MiB above that room's
  bottom, an offset left out here: only the order counts); a 2 MiB one right above a 444 MiB one.

So a 20 MiB segment mapped later lies below an earlier one, and the 2 MiB segments mapped after it
fill its granule, below every 2 MiB segment mapped before. Absolute addresses differ (the CUDA
context and cuBLAS map memory of their own): only the order matters here. A released range is
mapped again: whole granules top-down from the highest hole that fits, a smaller segment's range as
room of its granule. A larger segment whose last granule holds others gives back its whole granules
as a hole and the rest as room.

Not every run follows this (docs/validation/2026-12-03-one-h200.md): the driver also maps memory the
allocator's history does not show (the CUDA context, its libraries, kernels loaded on first use), and
one run mapped segments above its first one.
"""

GRANULE_BYTES = 32 * 2**20


class DriverAddresses:
    """The address of each new segment (`map`) and of each released one (`release`)."""

    def __init__(self):
        self.top = 0  # the lowest granule mapped so far starts here; new ones go below it
        self.room = []  # [start, end] of the unused part of partly used granules
        self.holes = []  # (start, size) of released runs of whole granules

    def map(self, segment_bytes: int) -> int:
        if segment_bytes < GRANULE_BYTES:
            fitting = [r for r in self.room if r[1] - r[0] >= segment_bytes]
            if fitting:
                room = min(fitting)
                start = room[0]
                room[0] += segment_bytes
                return start
            self.top -= GRANULE_BYTES
            self.room.append([self.top + segment_bytes, self.top + GRANULE_BYTES])
            return self.top
        size = -(-segment_bytes // GRANULE_BYTES) * GRANULE_BYTES
        start = self._take_hole(size)
        if start is None:
            self.top -= size
            start = self.top
        if size > segment_bytes:  # the rest of its last granule: room for smaller segments
            self.room.append([start + segment_bytes, start + size])
        return start

    def release(self, address: int, segment_bytes: int) -> None:
        if segment_bytes < GRANULE_BYTES:
            self._free_room(address, address + segment_bytes)
            return
        end = address + -(-segment_bytes // GRANULE_BYTES) * GRANULE_BYTES
        rest = [address + segment_bytes, end]
        if rest[0] < end and rest in self.room:  # its last granule's rest unused: all its granules free
            self.room.remove(rest)
        elif rest[0] < end:  # smaller segments use its last granule (of two or more): it stays, as room
            end -= GRANULE_BYTES
            self._free_room(end, address + segment_bytes)
        start = address
        for hole in list(self.holes):
            if hole[0] + hole[1] == start or hole[0] == end:
                self.holes.remove(hole)
                start, end = min(start, hole[0]), max(end, hole[0] + hole[1])
        self.holes.append((start, end - start))

    def _free_room(self, start: int, end: int) -> None:
        """[start, end) of a granule that other segments share, unused again: one room with its neighbours."""
        for room in [r for r in self.room if r[0] == end or r[1] == start]:  # contiguous: one room
            self.room.remove(room)
            start, end = min(start, room[0]), max(end, room[1])
        self.room.append([start, end])

    def _take_hole(self, size: int):
        """Top-down: the highest released run that fits, at its top end."""
        fitting = [h for h in self.holes if h[1] >= size]
        if not fitting:
            return None
        hole = max(fitting)
        self.holes.remove(hole)
        if hole[1] > size:
            self.holes.append((hole[0], hole[1] - size))
        return hole[0] + hole[1] - size
