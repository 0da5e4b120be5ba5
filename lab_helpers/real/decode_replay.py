"""Extended decode steps replayed in bulk where the allocator's small pool repeats itself exactly.

Under PyTorch's default allocator the small pool (blocks up to 1 MiB, in 2 MiB segments) and the
large pool never share a block: a request goes to the pool its rounded size names, a block merges
only with neighbours of its own segment. They meet in three places only: allocated and reserved
are their sums, a new segment's address comes from one counter, and under a budget a new segment
that does not fit first releases the wholly free cached segments of both pools.

A decode step past the traced ones asks what the step before asked, plus constant differences
(lab_helpers.real.replay.expand_decode); in a long run most of its requests are small and of the
same rounded size in every step. When two consecutive steps leave the small pool in the same state
(the same free blocks at the same addresses, the same live blocks at the same addresses, each live
block of a step request made by the same request of its step), and the next steps ask the small
pool for the same rounded sizes, every next step leaves it in that state again: the same state and
the same requests give the same choices. Those steps are replayed on the large pool alone, through
the allocator's own malloc and free; the small pool makes no new segment in them, so the address
counter and reserved move as in the whole replay; allocated is the sum of both pools, its peak
within a step taken over the small pool's known course between two large requests.

A large request that needs a new segment beyond the budget would release the small pool's free
segments too: there the replay stops being bulk. The small pool is brought to that very request
(its requests of the step replayed up to it, its blocks renumbered to the step's requests), and
the rest of the run is replayed request by request, as it would have been all along
(tests/test_replay.py compares the documents byte for byte). Standard library only.
"""
from bisect import bisect_left

from lab_helpers.allocator.model import (ADDRESS_BIAS, ADDRESS_BITS, MIN_BLOCK_BYTES, SMALL_REQUEST_MAX_BYTES,
                                         AllocatorModel)

rounded_bytes = AllocatorModel.round_size  # what the allocator hands out for a request


# the small pool may come back to a state every step or every few steps (a token's tensor that takes
# turns between two free blocks): periods up to this are looked for
MAX_PERIOD = 4


class NeedsRelease(Exception):
    """A large request needs a segment beyond the budget (internal: the bulk replay stops there)."""


def refuse_release():
    raise NeedsRelease


class DecodeReplayer:
    """The bookkeeping of one rank's replay that lets extended decode steps run in bulk: the rounded
    size of every request so far, the live requests, and the small pool's state after each step.

    `template` is decode_template's ((pre, own), (pre_step, own_step)); `last` the index of the last
    traced decode step (step s asks own + (s - last) x own_step)."""

    def __init__(self, alloc, blocks: list, template: tuple, last: int, decode_steps: int):
        (pre, own), (pre_step, own_step) = template
        self.alloc, self.blocks, self.own, self.own_step = alloc, blocks, own, own_step
        self.last, self.decode_steps = last, decode_steps
        self.usable = not pre  # releases between steps: replayed request by request
        self.mallocs = [p for p, e in enumerate(own) if e > 0]  # the positions of a step's requests
        self.shift = len(self.mallocs)  # request ids advance this much per step
        self.usable = self.usable and all(d == -self.shift for e, d in zip(own, own_step) if e < 0)
        # _plan plans no bulk step while a small request's rounded size changes from one step to the
        # next: one growing by 512 bytes a step or more that is still small in the last step does so
        # in every step, so no step is ever replayed in bulk, and the bookkeeping would be for nothing
        self.usable = self.usable and not any(
            e > 0 and d >= MIN_BLOCK_BYTES and rounded_bytes(e + (decode_steps - 1 - last) * d) <= SMALL_REQUEST_MAX_BYTES
            for e, d in zip(own, own_step))
        self.sizes = []  # rounded bytes of each request, by id
        self.live = set()  # ids of the requests not yet released
        self.first1 = None  # the id of decode step 1's first request
        self.history = {}  # step -> (small-pool state, releases) after the last request-by-request steps
        self.span = None  # (first, last) bulk steps ahead
        self.stats = {"bulk_steps": 0, "resumed": 0}

    # ------------------------------------------------------------------ request by request
    def track(self, events: list) -> None:
        """Account for events just replayed request by request."""
        start = len(self.sizes)
        self.sizes.extend([rounded_bytes(e) for e in events if e > 0])
        self.live.update(range(start, len(self.sizes)))
        self.live.difference_update([~e for e in events if e < 0])

    def _state(self, first: int) -> tuple:
        """The small pool after a step whose first request is `first`: its free blocks, and its live
        blocks with the request that holds each (a step's request by its place in its step)."""
        blocks, first1 = self.blocks, self.first1
        live = []
        for x in self.live:
            b = blocks[x]
            if b.small:
                live.append((b.address, b.size, x >= first1, x - first if x >= first1 else x))
        live.sort()
        return tuple(self.alloc.free_blocks[True].keys), tuple(live)

    def step_done(self, step: int, first: int, events: list, releases: int) -> None:
        """After decode step `step` (its first request `first`, its `events`) was replayed request by
        request: when it left the small pool as one of the MAX_PERIOD steps before did (with no release
        between), the bulk span that starts next."""
        if not self.usable or step < 1:
            return
        if step == 1:
            self.first1 = first
        state = self._state(first)
        history = self.history
        period = next((p for p in range(1, MAX_PERIOD + 1)
                       if history.get(step - p) == (state, releases)), None)
        history[step] = (state, releases)
        history.pop(step - MAX_PERIOD - 1, None)
        if period is None or step + 1 < self.last + 1 or len(self.blocks) != first + self.shift:
            return
        self._plan(step, first, events, period)

    def _plan(self, s: int, first: int, events: list, period: int) -> None:
        """The steps after `s` that may run in bulk, and what each asks the large pool."""
        own, own_step, last, shift = self.own, self.own_step, self.last, self.shift
        end = self.decode_steps - 1
        large_rank = []
        for p in self.mallocs:
            e, d = own[p] + (s - last) * own_step[p], own_step[p]
            size = rounded_bytes(e)
            large_rank.append(size > SMALL_REQUEST_MAX_BYTES)
            if size <= SMALL_REQUEST_MAX_BYTES:  # the same rounded size in every bulk step
                if d > 0:
                    end = min(end, s + (size - e) // d)
                elif d < 0:
                    floor = 0 if size == MIN_BLOCK_BYTES else size - MIN_BLOCK_BYTES
                    end = min(end, s + (e - floor - 1) // -d)
            elif d < 0:  # large in every bulk step
                end = min(end, s + (e - SMALL_REQUEST_MAX_BYTES - 1) // -d)
        if end <= s:
            return
        sizes, first1 = self.sizes, self.first1
        # ops: [is a request, bytes, difference per step, its place, position, small max, released next]
        ops, in_large = [], []
        profile = smax0 = 0  # the small pool's allocated bytes since the step's start; their highest
        rank = 0
        for p, event in enumerate(events):
            if event > 0:
                is_large, size = large_rank[rank], sizes[first + rank]
                op = [True, own[p], own_step[p], rank, p, 0]
                rank += 1
            else:
                y = ~event
                if y < first1:  # a request of the steps before the repeating ones
                    return
                size, is_large = -sizes[y], sizes[y] > SMALL_REQUEST_MAX_BYTES
                # the request it releases, by its place in its step, is of the same pool in every step
                if large_rank[(y - first1) % shift] != is_large:
                    return
                for j in range(s + 1, end + 1):  # a release, in bulk, of a request made one by one
                    yj = y + (j - s) * shift
                    if yj >= first + shift:
                        break
                    if (sizes[yj] > SMALL_REQUEST_MAX_BYTES) != is_large:
                        return
                op = [False, own[p], own_step[p], None, p, 0]
            in_large.append(is_large)
            if is_large:
                op[5] = profile
                ops.append(op)
            else:
                profile += size
                if ops:
                    ops[-1][5] = max(ops[-1][5], profile)
                else:
                    smax0 = max(smax0, profile)
        if profile != 0:  # the small pool holds more or less after the step: not a repeating state
            return
        # a request released by the next large event (a workspace) leaves the large pool as it found it:
        # the block it takes is whole again, at its place in the free list, once released
        for op, after in zip(ops, ops[1:]):
            op.append(op[0] and not after[0] and ~events[after[4]] == first + op[3])
        if ops:
            ops[-1].append(False)
        self.ops = [tuple(op) for op in ops]
        self.smax0, self.in_large = smax0, in_large
        self.span, self.base_step, self.period = (s + 1, end), s, period
        self.limit = first + shift  # requests from here on are made in bulk
        self.frozen = {x: self.blocks[x] for x in self.live if self.blocks[x].small}
        self.live_large = {x for x in self.live if not self.blocks[x].small}
        self.large = {}

    # ------------------------------------------------------------------------------ bulk
    def in_span(self, step: int) -> bool:
        return self.span is not None and self.span[0] <= step <= self.span[1]

    def bulk_step(self, step: int):
        """Replay decode step `step` on the large pool (the phase begun: budget set, peaks reset).
        None when it completed; else the position in its events from which the caller replays it
        request by request (the allocator then holds the whole state up to there)."""
        alloc = self.alloc
        guarded = hasattr(alloc, "release_cached")
        if guarded:
            alloc.release_cached = refuse_release  # a release would change the small pool: stop there
        try:
            if type(alloc).malloc is AllocatorModel.malloc and type(alloc).free is AllocatorModel.free:
                stopped, peak = self._large_ops_inline(step)
            else:
                stopped, peak = self._large_ops(step)
        finally:
            if guarded:
                del alloc.release_cached
        if stopped is None:
            alloc.peak_allocated = peak
            self.stats["bulk_steps"] += 1
            return None
        return self.resume(step, stopped, peak)

    def _large_ops(self, step: int) -> tuple:
        """(the position where a request needs a release, or None; the step's peak allocated) of the
        step's large requests and releases, through the allocator's malloc and free."""
        alloc, blocks, large, limit = self.alloc, self.blocks, self.large, self.limit
        j = step - self.last
        first = limit + (step - self.base_step - 1) * self.shift
        peak = alloc.allocated + self.smax0
        malloc, free, live_large = alloc.malloc, alloc.free, self.live_large
        for is_malloc, e, d, r, position, smax, _ in self.ops:
            if is_malloc:
                try:
                    large[first + r] = malloc(e + j * d)
                except NeedsRelease:
                    return position, peak
            else:
                y = ~(e + j * d)
                if y >= limit:
                    free(large.pop(y))
                else:
                    free(blocks[y])
                    live_large.discard(y)
            v = alloc.allocated + smax
            if v > peak:
                peak = v
        return None, peak

    def _large_ops_inline(self, step: int) -> tuple:
        """_large_ops with AllocatorModel's malloc and free written out, as AllocatorModel.replay
        writes them (the same choices; tests/test_replay.py compares the documents with the calls'):
        a long run replays hundreds of large requests in each of its bulk steps. A request that
        needs a new segment goes through the allocator's malloc (its budget, its addresses)."""
        alloc, blocks, large, limit = self.alloc, self.blocks, self.large, self.limit
        j = step - self.last
        first = limit + (step - self.base_step - 1) * self.shift
        allocated = alloc.allocated
        peak = allocated + self.smax0
        live_large = self.live_large
        pools = alloc.free_blocks
        small_keys, small_blocks = pools[True].keys, pools[True].blocks
        large_keys, large_blocks = pools[False].keys, pools[False].blocks
        shift, bias, min_block, small_max = ADDRESS_BITS, ADDRESS_BIAS, MIN_BLOCK_BYTES, SMALL_REQUEST_MAX_BYTES
        block_type = None  # the allocator's block class, from the first block taken
        passing = False  # the last request taken was released by this event: nothing to undo
        for is_malloc, e, d, r, position, smax, released_next in self.ops:
            if passing:
                passing = False
                v = allocated + smax
                if v > peak:
                    peak = v
                continue
            if is_malloc:
                request = e + j * d
                size = min_block if request <= min_block else -(-request // min_block) * min_block
                small = size <= small_max
                keys, members = (small_keys, small_blocks) if small else (large_keys, large_blocks)
                i = bisect_left(keys, size << shift)
                if released_next and i < len(keys):
                    # taken and released with no large event between: the block, split or not, is
                    # merged back whole (a free block has no free neighbour) and put back where it
                    # was; only allocated moves meanwhile, by what the allocator would hand out
                    remaining = members[i].size - size
                    split = remaining >= min_block if small else remaining > small_max
                    v = allocated + (size if split else members[i].size) + smax
                    if v > peak:
                        peak = v
                    passing = True
                    continue
                if i == len(keys):  # a new segment: the allocator's own malloc
                    alloc.allocated = allocated
                    try:
                        block = alloc.malloc(request)
                    except NeedsRelease:
                        return position, peak
                    allocated = alloc.allocated
                else:
                    del keys[i]
                    block = members.pop(i)
                    remaining = block.size - size
                    if remaining >= min_block if small else remaining > small_max:
                        after = block.next
                        block_type = block_type or type(block)
                        rest = block_type(remaining, block.address + size, small, True, block, after)
                        if after is not None:
                            after.prev = rest
                        block.next = rest
                        key = (remaining << shift) | (rest.address + bias)
                        k = bisect_left(keys, key)
                        keys.insert(k, key)
                        members.insert(k, rest)
                        block.size = size
                    block.free = False
                    allocated += block.size
                large[first + r] = block
            else:
                y = ~(e + j * d)
                if y >= limit:
                    block = large.pop(y)
                else:
                    block = blocks[y]
                    live_large.discard(y)
                allocated -= block.size
                block.free = True
                keys, members = (small_keys, small_blocks) if block.small else (large_keys, large_blocks)
                after = block.next
                if after is not None and after.free:
                    k = bisect_left(keys, (after.size << shift) | (after.address + bias))
                    del keys[k]
                    del members[k]
                    block.size += after.size
                    block.next = after = after.next
                    if after is not None:
                        after.prev = block
                before = block.prev
                if before is not None and before.free:
                    k = bisect_left(keys, (before.size << shift) | (before.address + bias))
                    del keys[k]
                    del members[k]
                    block.size += before.size
                    block.address = before.address
                    block.prev = before = before.prev
                    if before is not None:
                        before.next = block
                key = (block.size << shift) | (block.address + bias)
                k = bisect_left(keys, key)
                keys.insert(k, key)
                members.insert(k, block)
            v = allocated + smax
            if v > peak:
                peak = v
        alloc.allocated = allocated
        return None, peak

    def pending(self) -> bool:
        """Whether steps were replayed in bulk that a request-by-request step must first take up."""
        return self.span is not None

    def resume(self, step: int, position: int, peak: int) -> int:
        """Bring the allocator's small pool and the id -> block list to the state of the whole replay
        just before event `position` of decode step `step` (the steps before it replayed in bulk, and
        its large requests before `position`); returns `position`."""
        alloc, blocks, shift, large = self.alloc, self.blocks, self.shift, self.large
        base, first1 = self.base_step, self.first1
        # the small pool as it was after step `base` is its state after every step base + k x period:
        # from the last of those before `step`, the small requests are replayed again
        since = (step - 1 - base) % self.period
        start_step = step - since  # its first request follows that state
        start = self.limit + (start_step - base - 1) * shift
        offset = (start_step - 1 - base) * shift
        if len(blocks) < start:
            blocks.extend([None] * (start - len(blocks)))
        small_ids = []
        for x, b in self.frozen.items():  # renumbered from the requests of step `base` to those of start_step - 1
            y = x + offset if x >= first1 else x
            blocks[y] = b
            small_ids.append(y)
        for y, b in large.items():
            if y < start:
                blocks[y] = b
        sizes, own, own_step, last = self.sizes, self.own, self.own_step, self.last
        for k in range(base + 1, start_step):  # the rounded sizes of the requests made in bulk
            sizes.extend([rounded_bytes(own[p] + (k - last) * own_step[p]) for p in self.mallocs])
        del sizes[start:]
        self.live = set(small_ids) | self.live_large | {y for y in large if y < start}
        in_large = self.in_large
        for k in range(start_step, step + 1):
            j = k - last
            events = [e + j * d for e, d in zip(own, own_step)]
            if k == step:
                events = events[:position]
            for p, event in enumerate(events):
                if in_large[p]:  # replayed in bulk already
                    if event > 0:
                        blocks.append(large.get(len(blocks)))
                elif event > 0:
                    blocks.append(alloc.malloc(event))
                else:
                    alloc.free(blocks[~event])
            self.track(events)
        alloc.peak_allocated = peak
        self.large = {}
        self.span = None
        self.history = {}
        self.stats["resumed"] += 1
        return position
