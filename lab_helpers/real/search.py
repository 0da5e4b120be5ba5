"""The largest size (a batch, a context) whose run fits a memory budget, with as few predictions as
the answer allows: `fit` and `fit --task train` ask it, each prediction costing a trace and a replay.

The search keeps a bracket, the largest size known to fit and the smallest known not to, until they
are neighbours: the answer is a size that fits whose next one does not. Where fitting is monotone (a
larger batch or context never fits where a smaller one does not) that is the largest size that fits,
the answer of a search that tries every size from 1 up. It is not always: the allocator's segments can
make a context fit where a smaller one does not (tests/test_search.py pins such cases), and then the
answer is one of the boundaries, near the caller's own point when it gives one, not necessarily the
largest.

Only the order of the probes is chosen, from the probes' peaks: a run's peak grows almost affinely
with its batch and context (weights fixed, activations and key/value cache proportional), so the size
where the peak meets the budget is interpolated from the probes nearest to it (regula falsi, in
integers). Before any size has failed, the bound itself is probed where the line through the two
largest sizes that fit stays within the budget up to it (the model's positions, not memory, bound
the answer), else the search doubles. Once one has failed, a round that does not halve the bracket
is followed by a bisection: no search takes more than about twice the probes of a bisection, and
most take a few (the predictions of real fits are in benchmarks/fast_answers_results.md).
"""
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Probe:
    """What one prediction of the search says: whether the run fits, and, where known, its peaks with
    no cap (None where the prediction gave none). The peaks only guide the choice of the next size:
    a run fits at most where its peak allocated meets the budget, and at least where its peak reserved
    with no cap does (under the budget the allocator releases cached segments before failing).

    `later`, where the peaks cost a prediction of their own (a run that does not fit, replayed again
    with no cap), gives them instead, as (peak reserved, peak allocated): the search calls it only
    when it reads them, at most once, so a probe whose peaks never guide a choice costs no replay."""

    fits: bool
    peak_reserved_bytes: "int | None" = None
    peak_allocated_bytes: "int | None" = None
    later: "Callable[[], tuple] | None" = None


class _Later:
    """The peaks of a Probe given `later`, computed when first read."""

    def __init__(self, compute):
        self.compute, self.values = compute, None

    def __call__(self, which: int) -> int:
        if self.values is None:
            self.values = self.compute()
        return self.values[which]


def largest_fitting(probe, high: int, budget_bytes: int, start: "int | None" = None) -> tuple:
    """(the largest v in [1, high] whose probe fits, 0 if none; whether the search stopped first, v then
    being a size that fits, a lower bound of the largest).

    `probe(v)` returns a Probe, or None once the caller's bound on predictions is reached (the search
    then stops). `start`, when in [1, high], is probed first: a size the caller already predicted (its
    own point), whose answer bounds the search from below or above."""
    low, top = 0, high + 1  # fits(low) (0: vacuously), not fits(top) (high + 1: beyond the bound)
    reserved, allocated = {}, {}
    # A round probes where the peak reserved is expected to meet the budget, then one past where the
    # peak allocated is: the boundary lies between them, so where the peaks are close to affine in the
    # size the round closes the bracket or leaves it narrow. Once a size has failed, a round that does
    # not halve the bracket is followed by a bisection (the first failure only ends the climb: the bound
    # above it was no probe's). Where fewer than two peaks are known, the search doubles the largest
    # size that fits until one does not (few probes when the answer is far below the bound).
    pending = [start] if start is not None and 1 <= start <= high else []
    bisect_next = False
    while top - low > 1:
        width, failed_before = top - low, top <= high
        guessed = not pending and not bisect_next
        if pending:
            sizes, pending = pending, []
        elif guessed:
            sizes = [size for size in (_crossing(low, top, reserved, budget_bytes),
                                       _crossing(low, top, allocated, budget_bytes, past=1)) if size is not None]
        else:
            sizes = []
        if not sizes and top > high:  # no size has failed yet
            # the bound itself where the line through the two largest sizes that fit keeps the peak
            # reserved within the budget up to it (a model whose positions, not memory, bound the
            # answer: one probe instead of a gallop's doublings), else gallop up from the largest
            sizes = [high if guessed and _within_at(high, low, reserved, budget_bytes) else min(max(2 * low, 1), high)]
            guessed = False
        elif not sizes:
            sizes, guessed = [(low + top) // 2], False
        for size in sizes:
            if not low < size < top:  # the first probe of a round may have moved the bracket past it
                continue
            answer = probe(size)
            if answer is None:
                return low, True
            if answer.later is not None:  # read through _peak, when a crossing needs them
                later = _Later(answer.later)
                reserved[size], allocated[size] = (later, 0), (later, 1)
            for peaks, value in ((reserved, answer.peak_reserved_bytes), (allocated, answer.peak_allocated_bytes)):
                if value is not None:
                    peaks[size] = value
            if answer.fits:
                low = size
            else:
                top = size
        bisect_next = guessed and failed_before and 2 * (top - low) > width
    return low, False


def _crossing(low: int, top: int, peaks: dict, budget_bytes: int, past: int = 0) -> "int | None":
    """The largest size at which the line through two known peaks stays within the budget, plus `past`:
    the two peaks nearest the bracket (one each side where both are known, else the two nearest on one
    side); None where fewer than two are known, they do not grow, or the size is outside (low, top)."""
    below = sorted(size for size in peaks if size <= low)
    above = sorted(size for size in peaks if size >= top)
    if below and above:
        a, b = below[-1], above[0]
    elif len(below) >= 2:
        a, b = below[-2], below[-1]
    elif len(above) >= 2:
        a, b = above[0], above[1]
    else:
        return None
    peak_a, peak_b = _peak(peaks[a]), _peak(peaks[b])
    rise = peak_b - peak_a
    if rise <= 0:
        return None
    size = a + (budget_bytes - peak_a) * (b - a) // rise + past
    return size if low < size < top else None


def _within_at(size: int, low: int, peaks: dict, budget_bytes: int) -> bool:
    """Does the line through the peaks of the two largest known sizes up to `low` stay within the budget
    at `size`? False where fewer than two are known."""
    below = sorted(known for known in peaks if known <= low)
    if len(below) < 2:
        return False
    a, b = below[-2], below[-1]
    peak_a, peak_b = _peak(peaks[a]), _peak(peaks[b])
    return peak_b + (peak_b - peak_a) * (size - b) // (b - a) <= budget_bytes


def _peak(value) -> int:
    """A known peak, or one of a Probe's `later` peaks, computed now."""
    return value if isinstance(value, int) else value[0](value[1])
