"""Progress of the long steps (tracing a run, a search's predictions): a tqdm bar on stderr that
appears only after two seconds and only when stderr is a terminal, so that programs reading the
output and quick answers see nothing of it."""
import sys

PROGRESS_DELAY_SECONDS = 2.0


def progress_bar(total=None, desc: str = "", unit: str = "step", iterable=None):
    """A tqdm bar (a context manager with update(); iterating it walks `iterable`), silent unless
    stderr is a terminal."""
    from tqdm import tqdm
    stream = sys.stderr
    shown = hasattr(stream, "isatty") and stream.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream, disable=not shown, delay=PROGRESS_DELAY_SECONDS,
                leave=False, dynamic_ncols=True)
