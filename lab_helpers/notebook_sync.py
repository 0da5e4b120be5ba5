"""Keeps the notebooks' generated cells identical to their lab_helpers modules.

Direction: library -> notebook. A code cell tagged ``generated-from:<path>`` holds
the module at <path> verbatim, minus its ``if __name__ == "__main__":`` block (a
notebook kernel runs as ``__main__``), under a banner naming the file to edit.

    python -m lab_helpers.notebook_sync          # rewrite stale cells
    python -m lab_helpers.notebook_sync --check  # exit 1 if any cell drifted
"""
import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_SOURCES = {
    "notebooks/mesure-memoire.ipynb": (
        "lab_helpers/mesure_memoire.py",
        "lab_helpers/plots.py",
        "lab_helpers/sweep.py",
    ),
    "notebooks/forfaits.ipynb": ("lab_helpers/calcul_forfaits.py",),
    "notebooks/real-model.ipynb": (
        "lab_helpers/mesure_memoire.py",
        "lab_helpers/calcul_forfaits.py",
        "lab_helpers/model_config.py",
        "lab_helpers/alloc_trace.py",
        "lab_helpers/real_model.py",
    ),
}
TAG_PREFIX = "generated-from:"
BANNER = "# Generated from {source} by `make sync`: edit that file, not this cell."
MAIN_GUARD = 'if __name__ == "__main__":'
FIX_COMMAND = "make sync"


LIBRARY_ONLY_START = "# >>> library only"
LIBRARY_ONLY_END = "# <<< library only"


def cell_text(source: str, root: Path = ROOT) -> str:
    """Return the notebook cell text generated from the module file `source`."""
    text = (root / source).read_text(encoding="utf-8")
    lines = text.splitlines()
    if MAIN_GUARD in lines:
        lines = lines[: lines.index(MAIN_GUARD)]
    # imports of sibling modules: in the notebook an earlier generated cell defines those names
    while LIBRARY_ONLY_START in lines:
        start = lines.index(LIBRARY_ONLY_START)
        end = lines.index(LIBRARY_ONLY_END, start)
        del lines[start:end + 1]
    body = "\n".join(lines).rstrip()
    return BANNER.format(source=source) + "\n" + body + "\n"


def module_text(cell_source: str) -> str:
    """Return the module code held by a generated cell (banner removed)."""
    first, _, rest = cell_source.partition("\n")
    if not first.startswith("# Generated from "):
        raise ValueError("not a generated cell: its banner is missing")
    return rest


def generated_cells(nb) -> dict:
    """Map each `generated-from:` source path to its cell in notebook `nb`."""
    found = {}
    for cell in nb.cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            if tag.startswith(TAG_PREFIX):
                found[tag[len(TAG_PREFIX):]] = cell
    return found


def notebook_code(notebook: str, source: str, root: Path = ROOT) -> str:
    """Return the module code that `notebook` inlines from `source`."""
    nb = nbformat.read(root / notebook, as_version=4)
    cells = generated_cells(nb)
    if source not in cells:
        raise KeyError(f"{notebook} has no cell tagged {TAG_PREFIX}{source}")
    return module_text(cells[source].source)


def notebook_code_upto(notebook: str, source: str, root: Path = ROOT) -> str:
    """Return the code of `notebook`'s generated cells, in order, up to the one from `source`."""
    nb = nbformat.read(root / notebook, as_version=4)
    parts = []
    for cell in nb.cells:
        tags = [t for t in cell.get("metadata", {}).get("tags", []) if t.startswith(TAG_PREFIX)]
        if tags:
            parts.append(module_text(cell.source))
            if tags[0][len(TAG_PREFIX):] == source:
                return "\n\n".join(parts)
    raise KeyError(f"{notebook} has no cell tagged {TAG_PREFIX}{source}")


def sync(root: Path = ROOT, check: bool = False, only=None) -> list:
    """Regenerate (or with check=True only compare) every cell; return the stale ones."""
    stale = []
    for notebook, sources in NOTEBOOK_SOURCES.items():
        if only and notebook not in only:
            continue
        path = root / notebook
        nb = nbformat.read(path, as_version=4)
        cells = generated_cells(nb)
        changed = False
        for source in sources:
            if source not in cells:
                raise KeyError(f"{notebook} has no cell tagged {TAG_PREFIX}{source}")
            want = cell_text(source, root)
            if cells[source].source != want:
                stale.append(f"{notebook} <- {source}")
                cells[source].source = want
                changed = True
        if changed and not check:
            nbformat.write(nb, path)
    return stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated cell differs from its module")
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                        help="limit to these notebooks (paths as in NOTEBOOK_SOURCES); default all")
    args = parser.parse_args(argv)
    try:
        stale = sync(check=args.check, only=args.notebooks)
    except (KeyError, ValueError, OSError) as exc:
        print(f"notebook_sync: {exc}", file=sys.stderr)
        return 2
    for item in stale:
        print(("stale: " if args.check else "updated: ") + item)
    if args.check and stale:
        print(f"generated cells drifted from lab_helpers; run `{FIX_COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
