"""CPython's cyclic garbage collector while a command loads torch and transformers, and at its exit.

Importing torch and transformers' config and model code makes about 360,000 objects tracked by the
collector, nearly all of which live as long as the process (modules, classes, functions). A full
collection walks every tracked object: seven of them run while those imports grow the heap, and one
more at interpreter shutdown, about 1 s of CPU on a 2-core machine in all, more than a cold
prediction's own work (docs/benchmarks.md). The imports leave little cyclic garbage behind, so no
collection runs while they load (`loading_libraries`); in a command-line process (`for_this_process`)
what they made then leaves the collector's walks for good (gc.freeze: the permanent generation), and
so does everything before the interpreter shuts down (`before_exit`). In a notebook's kernel or a
test's process only the pause applies: the collector is as it was after the block, nothing is frozen.
Standard library only."""
import gc
from contextlib import contextmanager

_STATE = {"freeze": False}  # set by a command-line entry point only


def for_this_process() -> None:
    """Called by a command-line entry point, once, before its command runs: the libraries it loads
    stay for the process's life, so they are frozen once loaded."""
    _STATE["freeze"] = True


@contextmanager
def loading_libraries():
    """No collection while the block imports long-lived modules; after it, in a command-line process,
    every object then alive is frozen. The collector is enabled again after the block, raise or not,
    where it was enabled before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _STATE["freeze"]:
            gc.freeze()
        if enabled:
            gc.enable()


def before_exit() -> None:
    """In a command-line process whose command is done (its output written and flushed): the
    shutdown's collections skip every object alive now, which the process's end frees anyway."""
    if _STATE["freeze"]:
        gc.freeze()
