"""Progress of the long steps (tracing a run, a search's predictions): tqdm's plain bar on stderr that
appears only after two seconds, and only on a terminal or in a Jupyter kernel, so that programs reading
the output and quick answers see nothing of it."""
import contextlib
import sys

PROGRESS_DELAY_SECONDS = 2.0


def progress_shown(stream) -> bool:
    """Whether a bar is drawn on `stream`: a terminal, or a Jupyter kernel's stderr (there tqdm's plain
    bar is drawn as text: its notebook bar needs ipywidgets, which the lab does not install, and warns
    "IProgress not found" without them)."""
    if hasattr(stream, "isatty") and stream.isatty():
        return True
    return type(stream).__name__ == "OutStream" and "ipykernel" in sys.modules


def progress_bar(total=None, desc: str = "", unit: str = "step", iterable=None):
    """A tqdm bar (a context manager with update(); iterating it walks `iterable`), silent unless
    progress_shown(stderr)."""
    from tqdm import tqdm  # the plain bar, never tqdm.auto's notebook one
    stream = sys.stderr
    # tqdm writes the count and the rate right against the unit ("12prediction"): a space between
    return tqdm(iterable, total=total, desc=desc, unit=f" {unit}", file=stream, disable=not progress_shown(stream),
                delay=PROGRESS_DELAY_SECONDS, leave=False, dynamic_ncols=True)


def plain_tqdm_in_notebooks() -> None:
    """Call before transformers is imported. In a Jupyter kernel without ipywidgets, tqdm.auto (which
    transformers and huggingface_hub import) warns "IProgress not found" in a pink box, then gives its
    plain bar all the same: it is imported here first with that one warning silenced, so the plain
    bar comes without the box."""
    if "ipykernel" not in sys.modules or "tqdm.auto" in sys.modules:
        return
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto
    del tqdm.auto  # only its import, now done, matters


@contextlib.contextmanager
def stage(description: str):
    """One line on a terminal's stderr while a step with no steps of its own runs (importing torch and
    transformers, building a config), erased when it ends; nothing when stderr is not a terminal or
    in a Jupyter kernel."""
    stream = sys.stderr
    shown = hasattr(stream, "isatty") and stream.isatty() and "ipykernel" not in sys.modules
    if shown:
        stream.write(f"{description}...")
        stream.flush()
    try:
        yield
    finally:
        if shown:
            stream.write("\r\x1b[K")  # back to the line's start, then erase it
            stream.flush()
