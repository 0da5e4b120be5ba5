"""The exactness check of benchmarks/fast_answers.py, in CI: each benchmark case's predictions through
the fast path (decode steps extended from four traced ones, layers expanded from six and seven traced
ones, decode steps replayed in bulk) equal, byte for byte, those with every decode step and every
layer traced, unbounded and under a budget 1 MiB under the peak (release-and-retry, then out of
memory). The cases are cut to 8 new tokens so that the full traces stay short; the benchmark's
--check-exact runs them at their own length."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fast_answers", ROOT / "benchmarks" / "fast_answers.py")
fast_answers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fast_answers)
CHECKED = [name for name, (_, case) in fast_answers.CASES.items() if case is not None]


def test_every_case_but_the_fit_search_is_checked():
    # fit-70b is a search of predictions, each one the predict path checked here
    assert CHECKED == ["predict-70b", "card-8b"]


@pytest.mark.parametrize("name", CHECKED)
def test_the_fast_path_equals_the_full_trace(name):
    checked = fast_answers.exact(fast_answers.CASES[name][1], new_tokens=8)
    degrees = fast_answers.CASES[name][1][4]
    assert checked == {f"degree {d}": True for d in degrees}
