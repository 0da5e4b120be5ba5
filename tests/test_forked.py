"""A function run in a forked child (lab_helpers.core.forked): its value comes back from the child; whatever
goes wrong there (an exception, an exit, a signal, a value that does not pickle, a child that never
answers) the function runs in this process instead, with its own value or its own exception; no child
outlives the block, and the child prints nothing."""
import logging
import os
import signal
import sys
import threading
import time

import pytest

from lab_helpers.core import forked
from lab_helpers.core.forked import Forked


@pytest.fixture(autouse=True)
def a_child_is_made(monkeypatch):
    """A child whatever the number of cores (forking_helps asks for two)."""
    monkeypatch.setattr(forked, "forking_helps", lambda: True)


PARENT = os.getpid()


def in_child() -> bool:
    return os.getpid() != PARENT


def no_child_left(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_value_comes_from_the_child():
    with Forked(lambda: (os.getpid(), [1, 2, 3], {"a": b"\x00" * 3_000_000})) as other:
        pid = other.pid
        assert pid is not None and pid != PARENT
        value = other.result()
    assert other.from_child and value[0] == pid and value[1:] == ([1, 2, 3], {"a": b"\x00" * 3_000_000})
    assert no_child_left(pid)


def test_a_child_is_made_only_with_two_cores_and_one_python_thread(monkeypatch):
    monkeypatch.undo()  # the autouse fixture's stand-in: the real rule here
    monkeypatch.setattr(forked.sys, "platform", "linux")
    monkeypatch.setattr(forked.os, "sched_getaffinity", lambda pid: {0, 1})
    # an earlier test of this worker may have left a thread of its own: the count is set here
    monkeypatch.setattr(forked.threading, "active_count", lambda: 1)
    assert forked.forking_helps()
    monkeypatch.setattr(forked.os, "sched_getaffinity", lambda pid: {3})
    assert not forked.forking_helps()
    monkeypatch.setattr(forked.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(forked.sys, "platform", "darwin")
    assert not forked.forking_helps()
    monkeypatch.setattr(forked.sys, "platform", "linux")
    monkeypatch.setattr(forked.threading, "active_count", lambda: 2)
    assert not forked.forking_helps()


def test_another_python_thread_leaves_the_function_to_this_process(monkeypatch):
    monkeypatch.undo()
    monkeypatch.setattr(forked.os, "sched_getaffinity", lambda pid: {0, 1})
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not forked.forking_helps()
        with Forked(os.getpid) as block:
            assert block.pid is None and block.result() == PARENT
    finally:
        stop.set()
        other.join()
    assert not block.from_child


def test_without_a_second_core_the_function_runs_here(monkeypatch):
    monkeypatch.setattr(forked, "forking_helps", lambda: False)
    with Forked(os.getpid) as other:
        assert other.pid is None
        assert other.result() == PARENT
    assert not other.from_child


def _exits():
    if in_child():
        os._exit(3)
    return "here"


def _killed():
    if in_child():
        os.kill(os.getpid(), signal.SIGKILL)
    return "here"


def _raises_in_child():
    if in_child():
        raise RuntimeError("child")
    return "here"


def _unpicklable():
    return (lambda: None) if in_child() else "here"


def _prints():
    print("from the child")
    os.write(2, b"to stderr\n")
    return "quiet"


def _hangs_in_child():
    if in_child():
        time.sleep(3600)
    return "here"


@pytest.mark.parametrize("function", [_exits, _killed, _raises_in_child, _unpicklable, _hangs_in_child],
                         ids=["exit 3", "SIGKILL", "an exception", "a value that does not pickle", "no answer"])
def test_a_child_that_fails_leaves_the_function_to_this_process(function, monkeypatch):
    monkeypatch.setattr(forked, "CHILD_PATIENCE_SECONDS", 0.2)  # a child that never answers is stopped
    with Forked(function) as other:
        pid = other.pid
        assert other.result() == "here"
    assert not other.from_child and no_child_left(pid)


def test_an_exception_of_the_function_is_raised_here():
    def fails():
        raise ValueError(f"in {os.getpid()}")

    with Forked(fails) as other:
        with pytest.raises(ValueError, match=f"in {PARENT}$"):
            other.result()


def test_leaving_the_block_stops_a_child_not_read():
    def hangs():
        time.sleep(3600)

    with pytest.raises(KeyError):
        with Forked(hangs) as other:
            pid = other.pid
            raise KeyError("the parent's own work failed")
    assert other.pid is None and other.pipe is None and no_child_left(pid)


def test_the_child_prints_nothing(capfd):
    logger = logging.getLogger("test_forked")
    handler = logging.StreamHandler(sys.stderr)  # made here: it keeps the parent's stream
    logger.addHandler(handler)
    try:
        with Forked(lambda: logger.error("logged in the child") or _prints()) as other:
            result = other.result()
    finally:
        logger.removeHandler(handler)
    assert result == "quiet"
    assert other.from_child and capfd.readouterr() == ("", "")
