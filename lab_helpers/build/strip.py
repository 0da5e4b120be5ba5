"""The committed form of a notebook: no outputs, no execution counts, no volatile metadata.

Used as git's clean filter for *.ipynb (see .gitattributes; `make lab` and `make test`
configure it), so a notebook run and autosaved in JupyterLab keeps its outputs in the
working copy while git, the tests and the kit see the clean form.

    python3 -m lab_helpers.notebook_strip < run.ipynb > clean.ipynb
    python3 -m lab_helpers.notebook_strip notebooks/forfaits.ipynb   # prints the clean form

Standard library only, and so is everything it imports (lab_helpers/build/__init__.py is empty,
core/cli, core/errors, core/files and core/text use the standard library): git runs it with whatever
`python3` is on PATH, venv or not.

A filter must never hang and never store what is not a notebook: it reads at most
MAX_NOTEBOOK_BYTES + 1 bytes (a FIFO or a device given as the argument is refused unread), and on
input it cannot clean (not UTF-8, not JSON, a NaN outside the outputs, a lone surrogate) it prints
one line and exits 2, so git refuses the add; it never writes the working copy.
"""
import json
import sys

from lab_helpers.core.cli import Command, Program, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_OK, LabError
from lab_helpers.core.files import display_path, read_bounded_bytes

PROG = "notebook_strip"
FILTER_NAME = "notebook-strip"
FILTER_COMMAND = "python3 -m lab_helpers.notebook_strip"
GENERATED_TAG_PREFIX = "generated-from:"
# Cell metadata that records how a cell was last run or shown, not what it is.
VOLATILE_CELL_METADATA = ("collapsed", "scrolled", "execution", "ExecuteTime", "heading_collapsed")
# Notebook metadata written by widgets and by whichever kernel ran last.
VOLATILE_NOTEBOOK_METADATA = ("widgets", "signature")
# A run notebook with many plots is tens of MiB; the bound keeps a wrong argument (/dev/zero on
# stdin, a huge file) from filling memory, parsing included (a few times the size).
MAX_NOTEBOOK_BYTES = 256 * 2**20


class StripError(LabError):
    """The input is not a notebook that can be stripped."""


def strip_notebook(notebook: dict) -> dict:
    """Return `notebook` (a parsed .ipynb) in its committed form; the argument is modified."""
    if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
        raise StripError("not a notebook: no list of cells")
    metadata = notebook.get("metadata")
    if isinstance(metadata, dict):
        for key in VOLATILE_NOTEBOOK_METADATA:
            metadata.pop(key, None)
        language = metadata.get("language_info")
        # A kernel fills in its version, lexer and mimetype on every run; the name is what matters.
        if isinstance(language, dict) and "name" in language:
            metadata["language_info"] = {"name": language["name"]}
    for number, cell in enumerate(notebook["cells"], start=1):
        if not isinstance(cell, dict):
            raise StripError(f"cell {number} is not an object")
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        cell_metadata = cell.setdefault("metadata", {})
        if not isinstance(cell_metadata, dict):
            raise StripError(f"cell {number} has metadata that is not an object")
        for key in VOLATILE_CELL_METADATA:
            cell_metadata.pop(key, None)
        _normalise_view(cell_metadata)
    return notebook


def _normalise_view(cell_metadata: dict) -> None:
    # Collapsing is a view choice; the committed form shows generated cells collapsed and the
    # others open, whatever the last person clicked.
    tags = cell_metadata.get("tags")
    generated = isinstance(tags, list) and any(
        isinstance(tag, str) and tag.startswith(GENERATED_TAG_PREFIX) for tag in tags)
    view = cell_metadata.get("jupyter")
    view = dict(view) if isinstance(view, dict) else {}
    view.pop("outputs_hidden", None)
    view.pop("source_hidden", None)
    if generated:
        view["source_hidden"] = True
    if view:
        cell_metadata["jupyter"] = view
    else:
        cell_metadata.pop("jupyter", None)


def dumps(notebook: dict) -> str:
    """Serialise as nbformat writes a notebook: one-space indent, sorted keys, UTF-8, final newline.
    ValueError for NaN or an infinity (no JSON reader accepts them)."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def strip_bytes(data: bytes) -> bytes:
    """Return the committed form of the notebook file content `data`; StripError if it is not one
    or if what is left after stripping is not valid JSON in UTF-8."""
    try:
        notebook = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StripError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise StripError("JSON nested too deeply") from None
    except ValueError as exc:
        raise StripError(f"not valid JSON ({(str(exc).splitlines() or [''])[0][:120]})") from None
    clean = strip_notebook(notebook)
    # NaN and lone surrogates are accepted by Python's reader; inside an output they are dropped
    # with it, anywhere else they would be stored as a file no JSON reader accepts
    try:
        return dumps(clean).encode("utf-8")
    except RecursionError:
        raise StripError("JSON nested too deeply") from None
    except UnicodeEncodeError as exc:  # a ValueError too, so caught first
        raise StripError(f"a string holds a lone surrogate ({exc.object[exc.start:exc.end]!r}), "
                         "which is not Unicode text; remove it from the cell or metadata") from None
    except ValueError:
        raise StripError("holds NaN or Infinity outside the outputs, which is not JSON; "
                         "remove it from the cell or metadata") from None


def committed_form(data: bytes) -> bytes:
    """Return what git stores for the notebook content `data`: its stripped form, or `data`
    unchanged when it is not a notebook (the caller's own check then reports it)."""
    try:
        return strip_bytes(data)
    except (StripError, RecursionError):
        return data


def add_strip_arguments(parser) -> None:
    parser.add_argument("notebook", nargs="?",
                        help="the .ipynb file to read (default: standard input); it is never modified")


def read_standard_input() -> bytes:
    """At most MAX_NOTEBOOK_BYTES of standard input (git pipes the notebook in); a terminal is refused,
    since waiting on one would look like a hang."""
    stream = sys.stdin.buffer if sys.stdin is not None else None
    if stream is None:
        raise LabError("no standard input: give a notebook file")
    try:
        if stream.isatty():
            raise LabError("standard input is a terminal: give a notebook file or pipe one in")
        data = stream.read(MAX_NOTEBOOK_BYTES + 1)
    except OSError as exc:
        raise LabError(f"cannot read standard input: {exc.strerror or exc}") from None
    if len(data) > MAX_NOTEBOOK_BYTES:
        raise LabError(f"standard input: more than {MAX_NOTEBOOK_BYTES} bytes, over the limit for a notebook")
    return data


def handle_strip(args) -> int:
    if args.notebook:
        source = display_path(args.notebook)
        data = read_bounded_bytes(args.notebook, MAX_NOTEBOOK_BYTES, "notebook", shown=source)
    else:
        source = "standard input"
        data = read_standard_input()
    try:
        clean = strip_bytes(data)
    except (StripError, RecursionError) as exc:
        raise LabError(f"{source}: {exc}") from None
    sys.stdout.buffer.write(clean)
    sys.stdout.buffer.flush()
    return EXIT_OK


PROGRAM = Program(
    prog=PROG,
    description="Print a notebook without outputs, execution counts or volatile metadata "
                "(git's clean filter for *.ipynb).",
    commands=(Command("strip", "print the committed form of a notebook", add_strip_arguments, handle_strip),),
    single=True,
)


def build_parser():
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    return run(PROGRAM, argv)


if __name__ == "__main__":
    sys.exit(main())
