"""Keeps the notebooks' generated cells identical to their lab_helpers modules.

Direction: library -> notebook. A code cell tagged ``generated-from:<path>`` holds
the module at <path> verbatim, minus its ``if __name__ == "__main__":`` block (a
notebook kernel runs as ``__main__``), under a banner naming the file to edit.

    python -m lab_helpers.notebook_sync          # rewrite stale cells
    python -m lab_helpers.notebook_sync --check  # exit 1 if any cell drifted
"""
import ast
import functools
import re
import sys
from pathlib import Path

import nbformat

from lab_helpers.core.cli import CommandParser, quiet_broken_pipe
from lab_helpers.notebook_strip import GENERATED_TAG_PREFIX

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_SOURCES = {
    "notebooks/mesure-memoire.ipynb": (
        "lab_helpers/mesure_memoire.py",
        "lab_helpers/plots.py",
        "lab_helpers/sweep.py",
        "lab_helpers/timeline.py",
    ),
    "notebooks/forfaits.ipynb": ("lab_helpers/calcul_forfaits.py", "lab_helpers/mesure_memoire.py",
                                 "lab_helpers/grid.py", "lab_helpers/model_config.py",
                                 "lab_helpers/alloc_trace.py", "lab_helpers/real_model.py",
                                 "lab_helpers/forfait_fit.py"),
    "notebooks/pic-vs-reserve.ipynb": ("lab_helpers/mesure_memoire.py", "lab_helpers/plots.py",
                                       "lab_helpers/timeline.py"),
    "notebooks/real-model.ipynb": (
        "lab_helpers/mesure_memoire.py",
        "lab_helpers/calcul_forfaits.py",
        "lab_helpers/model_config.py",
        "lab_helpers/alloc_trace.py",
        "lab_helpers/real_model.py",
        "lab_helpers/plots.py",
    ),
}
TAG_PREFIX = GENERATED_TAG_PREFIX
BANNER = "# Generated from {source} by `make sync`: edit that file, not this cell."
MAIN_GUARD = 'if __name__ == "__main__":'
FIX_COMMAND = "make sync"


LIBRARY_ONLY_START = "# >>> library only"
LIBRARY_ONLY_END = "# <<< library only"
# `from lab_helpers import calcul_forfaits as calc`: in the notebook that module is an earlier cell
SIBLING_ALIAS = re.compile(r"^from lab_helpers import (\w+) as (\w+)$")
RENAMED_NOTE = "# Names this file shares with an earlier cell end in _{stem} here: {names}."


def top_level_names(code: str) -> set:
    """Names a module's code defines at top level (functions, classes, assignments; not imports)."""
    names = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def rename(code: str, names: set, suffix: str) -> str:
    """Return `code` with every use and definition of the top-level `names` given `suffix`."""
    spots = []  # (line index, start byte, end byte): ast columns count UTF-8 bytes
    lines = code.split("\n")
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name) and node.id in names:
            spots.append((node.lineno - 1, node.col_offset, node.end_col_offset))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            line = lines[node.lineno - 1].encode("utf-8")
            match = re.compile(rb"(?:async\s+)?(?:def|class)\s+").match(line, node.col_offset)
            spots.append((node.lineno - 1, match.end(), match.end() + len(node.name.encode())))
        elif isinstance(node, (ast.Global, ast.Nonlocal, ast.arg)):
            bound = node.names if not isinstance(node, ast.arg) else [node.arg]
            if names & set(bound):
                raise ValueError(f"cannot rename {sorted(names & set(bound))}: bound by a global "
                                 "statement or a parameter; give them names of their own")
    encoded = [line.encode("utf-8") for line in lines]
    for index, start, end in sorted(spots, reverse=True):
        encoded[index] = encoded[index][:start] + encoded[index][start:end] + suffix.encode() + encoded[index][end:]
    return "\n".join(line.decode("utf-8") for line in encoded)


def cell_text(source: str, root: Path = ROOT, earlier: tuple = ()) -> str:
    """Return the notebook cell text generated from the module file `source`, `earlier` being
    the sources the notebook inlines in cells above it (one namespace for all of them)."""
    earlier = tuple(earlier)
    texts = tuple((root / name).read_text(encoding="utf-8") for name in (*earlier, source))
    return _cell_text(source, earlier, texts)


# each cell needs the names of every cell above it, which need theirs: cached by the files' text,
# or a notebook inlining n modules would rebuild the first ones 2^n times
@functools.lru_cache(maxsize=256)
def _cell_text(source: str, earlier: tuple, texts: tuple) -> str:
    lines = texts[-1].splitlines()
    if MAIN_GUARD in lines:
        lines = lines[: lines.index(MAIN_GUARD)]
    # imports of sibling modules: in the notebook an earlier generated cell defines those names
    while LIBRARY_ONLY_START in lines:
        start = lines.index(LIBRARY_ONLY_START)
        end = lines.index(LIBRARY_ONLY_END, start)
        del lines[start:end + 1]
    earlier_names = set()
    for position, previous in enumerate(earlier):
        earlier_names |= top_level_names(module_text(_cell_text(previous, earlier[:position], texts[:position + 1])))
    stems = {Path(previous).stem for previous in earlier}
    for i, line in enumerate(lines):
        match = SIBLING_ALIAS.match(line)
        if match:
            if match.group(1) not in stems:
                raise ValueError(f"{source} imports lab_helpers.{match.group(1)}, which no cell above "
                                 "it inlines")
            lines[i] = f'{match.group(2)} = __import__("sys").modules[__name__]  # {match.group(1)}: a cell above'
    body = "\n".join(lines).rstrip()
    banner = BANNER.format(source=source)
    shared = top_level_names(body) & earlier_names
    if shared:
        stem = Path(source).stem
        body = rename(body, shared, "_" + stem)
        banner += "\n" + RENAMED_NOTE.format(stem=stem, names=", ".join(sorted(shared)))
    return banner + "\n" + body + "\n"


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
    unknown = sorted(set(only or ()) - set(NOTEBOOK_SOURCES))
    if unknown:
        raise ValueError(f"{unknown[0]} is not a generated notebook; choose from {', '.join(NOTEBOOK_SOURCES)}")
    stale = []
    for notebook, sources in NOTEBOOK_SOURCES.items():
        if only and notebook not in only:
            continue
        path = root / notebook
        nb = nbformat.read(path, as_version=4)
        cells = generated_cells(nb)
        changed = False
        for position, source in enumerate(sources):
            if source not in cells:
                raise KeyError(f"{notebook} has no cell tagged {TAG_PREFIX}{source}")
            want = cell_text(source, root, sources[:position])
            cell = cells[source]
            if cell.source != want:
                stale.append(f"{notebook} <- {source}")
                cell.source = want
                changed = True
            # Collapsed, so the notebook opens on its lesson. A cell you opened is a view choice,
            # not drift: git's filter stores it collapsed anyway; a write closes it again.
            view = cell.metadata.setdefault("jupyter", {})
            if view.get("source_hidden") is not True:
                view["source_hidden"] = True
                changed = True
        if changed and not check:
            nbformat.write(nb, path)
    return stale


@quiet_broken_pipe
def main(argv=None) -> int:
    parser = CommandParser(prog="notebook_sync", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated cell differs from its module")
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                        help="limit to these notebooks (paths as in NOTEBOOK_SOURCES); default all")
    args = parser.parse_args(argv)
    try:
        stale = sync(check=args.check, only=args.notebooks)
    except (KeyError, ValueError, OSError) as exc:
        print(f"notebook_sync: error: {exc}", file=sys.stderr)
        return 2
    for item in stale:
        print(("stale: " if args.check else "updated: ") + item)
    if args.check and stale:
        print(f"generated cells drifted from lab_helpers; run `{FIX_COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
