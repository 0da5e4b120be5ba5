"""One function run on a second core while this process does other work: a forked child computes it
and hands its result back, pickled, through a pipe.

A fork copies this process as it is (torch, transformers, a meta model already built), so the child
starts the function at once, with no import and no setup; the parent reads the result when it needs
it. Whatever goes wrong in the child (an exception, a signal, a result that cannot be pickled, a child
that never answers) is not the caller's problem: `result()` then runs the function here, in this
process, as if no child had been made. So the answer is the function's, with or without a child, and a
failure is raised here, where the caller sees it. The child writes nothing anywhere (its descriptors 1
and 2 and Python's streams go to /dev/null, logging is off: warnings are the parent's to give) and
ends with os._exit, running no atexit handler and flushing no buffer it inherited.

A child is made only where it can gain and is safe: Linux (fork is the platform's own way; on macOS a
fork after the system frameworks load is unsafe), two or more cores this process may run on, and one
Python thread (a fork copies no other thread, so a lock another thread holds, as a Jupyter kernel's
do, would stay held in the child for ever). Standard library only."""
import logging
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings

# a child not done this long after the parent asks for its result (or as long as the parent's own
# share took, when longer) is stopped, and the function run here: the child's share is about as long
# as the parent's, so a child this late is stuck (a lock held by another thread at the fork)
CHILD_PATIENCE_SECONDS = 30.0


def forking_helps() -> bool:
    """Whether a child can run beside this process: Linux, fork, two or more usable cores, and no
    Python thread but this one."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    return len(os.sched_getaffinity(0)) >= 2 and threading.active_count() == 1


class Forked:
    """`function()` computed in a forked child, started on entering the block; `result()` its value.

    Use as `with Forked(f) as other: ...; value = other.result()`: leaving the block stops a child
    still running (the parent's own work failed, or its result was not read)."""

    def __init__(self, function):
        self.function = function
        self.pid = self.pipe = self.started = None
        self.from_child = False  # whether result() gave the child's value (tests read it)

    def __enter__(self):
        if forking_helps():
            self._start()
        return self

    def __exit__(self, *exc_info):
        self._stop()
        return False

    def _start(self) -> None:
        read, write = os.pipe()
        try:
            # Python 3.12 warns at a fork while the process has other OS threads, and torch starts one
            # at import: no Python thread but this one is checked above, and a child stuck on a lock
            # of a C thread is stopped after CHILD_PATIENCE_SECONDS, its work then done here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:  # no memory or no process left for a child: the function runs here
            os.close(read)
            os.close(write)
            return
        if pid == 0:
            os.close(read)
            self._child(write)
        os.close(write)
        self.pid, self.pipe, self.started = pid, read, time.monotonic()

    def _child(self, write: int) -> None:
        code = 1
        try:
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            # Python's own streams may not be those descriptors (a Jupyter kernel's send to its
            # front end), and logging's handlers keep the stream they were made with
            sys.stdout = sys.stderr = open(os.devnull, "w")
            logging.disable(logging.CRITICAL)
            data = pickle.dumps(self.function(), protocol=pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(write, view):]
            code = 0
        except BaseException:  # anything, an interrupt included: the parent computes it itself
            code = 1
        finally:
            os._exit(code)

    def _read(self) -> "bytes | None":
        """The child's bytes, once it closed the pipe and exited 0; None otherwise."""
        now = time.monotonic()
        chunks, deadline = [], now + max(CHILD_PATIENCE_SECONDS, now - self.started)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.pipe], [], [], left)[0]:
                return None
            chunk = os.read(self.pipe, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        return b"".join(chunks) if os.waitstatus_to_exitcode(status) == 0 else None

    def result(self):
        """The function's value: the child's where it gave one, else computed here."""
        if self.pid is not None:
            data = self._read()
            self._stop()
            if data is not None:
                try:
                    value = pickle.loads(data)
                except Exception:  # damaged bytes: computed here
                    pass
                else:
                    self.from_child = True
                    return value
        return self.function()

    def _stop(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = None
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None
