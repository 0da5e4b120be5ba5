"""Rebuilds every generated file of the checkout, or checks that none has drifted.

The generated files are the standalone files (the bundler's STANDALONE), the notebooks' generated
cells and the CLI reference (docs/cli.md). A notebook declares its root modules, the ones its
lesson cells call; its generated cells are the bundler's closure of those roots: one collapsed
code cell per module, in dependency order, tagged `generated-from:<path>`, holding the module's
code as the bundler gives it for a notebook (package imports dropped, names unchanged) under a
banner naming the file to edit.

    python -m lab_helpers.build.sync          # rewrite what is stale
    python -m lab_helpers.build.sync --check  # write nothing; exit 1 if anything differs
"""
import hashlib
import sys
from pathlib import Path

import nbformat

from lab_helpers.build.bundle import BundleError, build, check_unique, closure, section_code
from lab_helpers.build.strip import GENERATED_TAG_PREFIX
from lab_helpers.core.cli import Command, Program, program_parser, quiet_broken_pipe, run
from lab_helpers.core.errors import EXIT_FAILURE, EXIT_OK, LabError
from lab_helpers.core.paths import REPOSITORY

PROG = "notebook_sync"
ROOT = REPOSITORY
FIX_COMMAND = "make sync"
TAG_PREFIX = GENERATED_TAG_PREFIX
BANNER = "# Generated from {source} by `make sync`: edit that file, not this cell."
CLI_REFERENCE_MODULE = "lab_helpers/build/cli_reference.py"
# Each notebook's root modules: what its lesson cells call. The closure adds what they need.
NOTEBOOK_ROOTS = {
    "notebooks/mesure-memoire.ipynb": (
        "lab_helpers/synthetic/measure.py",
        "lab_helpers/synthetic/predict.py",
        "lab_helpers/synthetic/estimate.py",
        "lab_helpers/measurement/environment.py",
        "lab_helpers/synthetic/tables.py",
        "lab_helpers/views/plots.py",
        "lab_helpers/views/sweep.py",
        "lab_helpers/views/timeline.py",
    ),
    "notebooks/pic-vs-reserve.ipynb": (
        "lab_helpers/synthetic/measure.py",
        "lab_helpers/synthetic/predict.py",
        "lab_helpers/views/plots.py",
        "lab_helpers/views/timeline.py",
        "lab_helpers/views/explain.py",
        "lab_helpers/real/train.py",
        "lab_helpers/real/train_facts.py",
        "lab_helpers/allocator/lesson.py",
    ),
    "notebooks/real-model.ipynb": (
        "lab_helpers/real/predict.py",
        "lab_helpers/real/protocol.py",
        "lab_helpers/real/fit.py",
        "lab_helpers/real/card_fit.py",
        "lab_helpers/real/card_tables.py",
        "lab_helpers/real/tables.py",
        "lab_helpers/views/plots.py",
    ),
    "notebooks/forfaits.ipynb": (
        "lab_helpers/pricing/forfait.py",
        "lab_helpers/pricing/grid.py",
        "lab_helpers/real/card_fit.py",
        "lab_helpers/real/card_tables.py",
    ),
}


class SyncError(LabError):
    """A notebook the generated cells cannot be written into, or a table naming no such notebook."""


def notebook_sources(notebook: str, root: Path = ROOT, table: dict = None) -> list:
    """The modules `notebook` inlines, in the order of its cells: the closure of its roots."""
    roots = (NOTEBOOK_ROOTS if table is None else table)[notebook]
    missing = [source for source in roots if not (root / source).is_file()]
    if missing:
        raise SyncError(f"{notebook}: its root {missing[0]} is not a module file of the package")
    return closure(roots, root)


def cell_text(source: str, root: Path = ROOT) -> str:
    """The text of the generated cell that holds the module `source` (the same in every notebook)."""
    docstring, code = section_code(source, root, notebook=True)
    summary = docstring.strip().splitlines()[0] if docstring and docstring.strip() else ""
    lines = [BANNER.format(source=source)] + ([f"# {summary}"] if summary else []) + [code]
    return "\n".join(lines).rstrip("\n") + "\n"


def notebook_cells(notebook: str, root: Path = ROOT, table: dict = None) -> list:
    """[(source, cell text), ...] of `notebook`'s generated cells, refused if two define one name."""
    sources = notebook_sources(notebook, root, table)
    cells = [(source, cell_text(source, root)) for source in sources]
    try:
        check_unique(cells)
    except BundleError as exc:
        raise SyncError(f"{notebook}: {exc}") from None
    return cells


def module_text(cell_source: str) -> str:
    """The module code a generated cell holds (its banner removed)."""
    first, _, rest = cell_source.partition("\n")
    if not first.startswith("# Generated from "):
        raise SyncError("not a generated cell: its banner is missing")
    return rest


def cell_source(cell):
    """The module path a cell is generated from, or None for a lesson cell."""
    tags = [tag for tag in cell.get("metadata", {}).get("tags", []) if tag.startswith(TAG_PREFIX)]
    return tags[0][len(TAG_PREFIX):] if tags else None


def generated_cells(nb) -> dict:
    """Map each `generated-from:` module path to its cell in notebook `nb`."""
    return {cell_source(cell): cell for cell in nb.cells if cell_source(cell)}


def read_notebook(notebook: str, root: Path = ROOT):
    return nbformat.read(root / notebook, as_version=4)


def notebook_code(notebook: str, source: str, root: Path = ROOT) -> str:
    """The module code that `notebook` holds in its cell generated from `source`."""
    cells = generated_cells(read_notebook(notebook, root))
    if source not in cells:
        raise SyncError(f"{notebook} has no cell tagged {TAG_PREFIX}{source}")
    return module_text(cells[source].source)


def notebook_code_upto(notebook: str, source: str = None, root: Path = ROOT) -> str:
    """The code of `notebook`'s generated cells, in order, up to the one from `source` (default:
    all of them): what the notebook's kernel has defined once that cell has run."""
    parts = []
    for cell in read_notebook(notebook, root).cells:
        if cell_source(cell):
            parts.append(module_text(cell.source))
            if cell_source(cell) == source:
                return "\n\n".join(parts)
    if source is None:
        return "\n\n".join(parts)
    raise SyncError(f"{notebook} has no cell tagged {TAG_PREFIX}{source}")


def cell_id(source: str) -> str:
    """A new generated cell's id: derived from its module, so that two syncs write the same bytes."""
    return "gen-" + hashlib.sha256(source.encode("utf-8")).hexdigest()[:8]


def new_generated_cell(source: str, text: str):
    return nbformat.v4.new_code_cell(source=text, id=cell_id(source),
                                     metadata={"jupyter": {"source_hidden": True}, "tags": [TAG_PREFIX + source]})


def generated_block(notebook: str, nb) -> tuple:
    """(first, last) index of `nb`'s generated cells, which stand together."""
    where = [index for index, cell in enumerate(nb.cells) if cell_source(cell)]
    if not where:
        raise SyncError(f"{notebook} has no generated cell: tag one code cell {TAG_PREFIX}<module path> "
                        "where the lab's code goes")
    if where != list(range(where[0], where[-1] + 1)):
        raise SyncError(f"{notebook}: its generated cells are not together (cells {where[0] + 1} to "
                        f"{where[-1] + 1} hold lesson cells); move them next to each other")
    return where[0], where[-1]


def sync_notebook(notebook: str, wanted: list, root: Path = ROOT, check: bool = False) -> list:
    """Give `notebook` the generated cells `wanted` ([(source, text), ...]); return what was stale."""
    path = root / notebook
    nb = nbformat.read(path, as_version=4)
    first, last = generated_block(notebook, nb)
    old = nb.cells[first:last + 1]
    have = {cell_source(cell): cell for cell in old}
    stale = [f"{notebook} <- {source}" for source, text in wanted
             if source not in have or have[source].source != text]
    stale += [f"{notebook}: drops {source}" for source in have if source not in dict(wanted)]
    if not stale and [cell_source(cell) for cell in old] != [source for source, _ in wanted]:
        stale.append(f"{notebook}: generated cells reordered")
    cells = []
    for source, text in wanted:
        cell = have.get(source) or new_generated_cell(source, text)
        cell.source = text
        cells.append(cell)
    # Collapsed, so the notebook opens on its lesson. A cell you opened is a view choice, not drift:
    # git's filter stores it collapsed anyway; a write closes it again.
    reopened = [cell for cell in cells if cell.metadata.get("jupyter", {}).get("source_hidden") is not True]
    for cell in reopened:
        cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
    if (stale or reopened) and not check:
        nb.cells[first:last + 1] = cells
        nbformat.write(nb, path)
    return stale


def sync(root: Path = ROOT, check: bool = False, only=None, table: dict = None) -> list:
    """Regenerate (or with check=True only compare) the notebooks' generated cells; return the stale
    ones. `only` limits it to some notebooks; `table` replaces NOTEBOOK_ROOTS."""
    table = NOTEBOOK_ROOTS if table is None else table
    unknown = sorted(set(only or ()) - set(table))
    if unknown:
        raise SyncError(f"{unknown[0]} is not a generated notebook; choose from {', '.join(table)}")
    stale = []
    for notebook in table:
        if not only or notebook in only:
            stale += sync_notebook(notebook, notebook_cells(notebook, root, table), root, check)
    return stale


def cli_reference(check: bool) -> list:
    """Rewrite (or check) docs/cli.md; [] with a note when its generator is not in this checkout."""
    if not (ROOT / CLI_REFERENCE_MODULE).is_file():
        print(f"{PROG}: skipped the CLI reference: {CLI_REFERENCE_MODULE} is not in this checkout",
              file=sys.stderr)
        return []
    from lab_helpers.build.cli_reference import write_reference
    return list(write_reference(check=check))


SCHEMA_PATH = "lab_helpers/measurement.schema.json"


def measurement_schema(root: Path = ROOT, check: bool = False) -> list:
    """Rewrite (or check) measurement.schema.json from lab_helpers.measurement.schema."""
    import json

    from lab_helpers.core.files import replace_text
    from lab_helpers.measurement.schema import MEASUREMENT_SCHEMA
    want = json.dumps(MEASUREMENT_SCHEMA, indent=2) + "\n"
    path = root / SCHEMA_PATH
    if path.is_file() and path.read_text(encoding="utf-8") == want:
        return []
    if not check:
        replace_text(path, want)
    return [SCHEMA_PATH]


def sync_all(root: Path = ROOT, check: bool = False) -> list:
    """Every generated file: the standalone files, the notebooks, the CLI reference, the measurement
    schema; the stale ones."""
    stale = build(root, check=check)
    stale += sync(root, check=check)
    if root == ROOT:  # the reference documents this checkout's own parsers
        stale += cli_reference(check)
        stale += measurement_schema(root, check)
    return stale


def add_sync_arguments(parser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated file or cell differs from what the "
                             "package builds")
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                        help="only these notebooks' cells (paths as in NOTEBOOK_ROOTS); default: every "
                             "generated file")


def handle_sync(args) -> int:
    try:
        stale = sync(check=args.check, only=args.notebooks) if args.notebooks else sync_all(check=args.check)
    except (BundleError, OSError, SyntaxError) as exc:  # the package or a notebook as it stands
        raise SyncError(str(exc)) from None
    for item in stale:
        print(("stale: " if args.check else "updated: ") + item)
    if args.check and stale:
        print(f"generated files drifted from lab_helpers; run `{FIX_COMMAND}`", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


PROGRAM = Program(
    prog=PROG,
    description=__doc__.splitlines()[0],
    commands=(Command("sync", "rebuild or check the generated files", add_sync_arguments, handle_sync),),
    single=True,
)


def build_parser():
    return program_parser(PROGRAM)


@quiet_broken_pipe
def main(argv=None) -> int:
    return run(PROGRAM, argv)


if __name__ == "__main__":
    sys.exit(main())
