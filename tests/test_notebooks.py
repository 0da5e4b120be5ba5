"""Committed notebooks: no outputs, a parameters cell, no project import, no drift from lab_helpers.

Cells are numbered from 1, every cell counted (markdown too), as JupyterLab shows them: "cell N"
means the same cell here, in the kit's refusals and in make sync's messages."""
import ast
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from lab_helpers.build.bundle import MAIN_GUARD, STANDALONE
from lab_helpers.build.strip import strip_bytes
from lab_helpers.build.sync import (BANNER, NOTEBOOK_ROOTS, TAG_PREFIX, SyncError, cell_source, generated_cells,
                                    notebook_code, notebook_code_upto, notebook_sources, sync)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["forfaits.ipynb", "mesure-memoire.ipynb", "pic-vs-reserve.ipynb",
                                           "real-model.ipynb"]


def committed_forms(path: Path) -> dict:
    """Return what the repository holds for `path`: the HEAD and staged blobs in a git checkout
    (the working copy may keep its outputs), else the file itself."""
    git = shutil.which("git")
    top = subprocess.run([git, "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True,
                         text=True) if git else None
    if top is None or top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT.resolve():
        return {"file": path.read_bytes()}
    rel = path.relative_to(ROOT).as_posix()
    forms = {}
    for label, spec in (("HEAD", f"HEAD:{rel}"), ("staged", f":{rel}")):
        proc = subprocess.run([git, "show", spec], cwd=ROOT, capture_output=True)
        if proc.returncode == 0:
            forms[label] = proc.stdout
    return forms or {"file": path.read_bytes()}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_or_execution_counts(path):
    for label, data in committed_forms(path).items():
        nb = nbformat.reads(data.decode("utf-8"), as_version=4)
        nbformat.validate(nb)
        dirty = [n for n, c in enumerate(nb.cells, start=1)
                 if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
        assert dirty == [], (f"{path.name} ({label}): cell {dirty[0]} has outputs or an execution count;"
                             " run `make test` once (it sets git's notebook filter), "
                             "then `git add` the notebook again")
        assert strip_bytes(data) == data, (
            f"{path.name} ({label}): volatile metadata committed; `git add` it again with the filter set")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_is_tagged_parameters(path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "parameters" in first.metadata.get("tags", [])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_imports_no_project_module(path):
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not re.search(r"^\s*(from|import)\s+lab_helpers\b", code, re.MULTILINE)


def test_generated_cells_match_the_library():
    stale = sync(check=True)
    assert stale == [], f"generated cells drifted from lab_helpers: {stale}; run `make sync`"


def copy_checkout(tmp_path: Path, table: dict) -> None:
    """The notebooks of `table` and every module their cells take, copied under `tmp_path`."""
    for notebook in table:
        (tmp_path / notebook).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / notebook).write_bytes((ROOT / notebook).read_bytes())
        for source in notebook_sources(notebook, ROOT, table):
            (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / source).write_bytes((ROOT / source).read_bytes())


def test_sync_check_command_names_the_fix(tmp_path):
    copy_checkout(tmp_path, NOTEBOOK_ROOTS)
    edited = tmp_path / "lab_helpers" / "views" / "plots.py"
    edited.write_text(edited.read_text() + "\nEDITED_ONLY_IN_THE_LIBRARY = 1\n")
    both = ["notebooks/mesure-memoire.ipynb <- lab_helpers/views/plots.py",
            "notebooks/pic-vs-reserve.ipynb <- lab_helpers/views/plots.py",
            "notebooks/real-model.ipynb <- lab_helpers/views/plots.py"]
    assert sync(tmp_path, check=True) == both
    assert sync(tmp_path) == both
    assert sync(tmp_path, check=True) == []
    code = notebook_code("notebooks/mesure-memoire.ipynb", "lab_helpers/views/plots.py", tmp_path)
    assert "EDITED_ONLY_IN_THE_LIBRARY = 1" in code
    # a generated cell opened and saved is no drift; a write closes it again
    path = tmp_path / "notebooks/forfaits.ipynb"
    nb = nbformat.read(path, as_version=4)
    generated_cells(nb)["lab_helpers/pricing/grid.py"].metadata["jupyter"]["source_hidden"] = False
    nbformat.write(nb, path)
    assert sync(tmp_path, check=True) == []
    assert sync(tmp_path) == []
    assert path.read_bytes() == (ROOT / "notebooks/forfaits.ipynb").read_bytes()


# A table of modules this checkout has whatever else moves: the synthetic network's roots.
SYNTHETIC_TABLE = {"notebooks/pic-vs-reserve.ipynb": ("lab_helpers/synthetic/measure.py",
                                                      "lab_helpers/synthetic/predict.py")}


def test_sync_writes_one_cell_per_module_of_the_closure(tmp_path):
    copy_checkout(tmp_path, SYNTHETIC_TABLE)
    notebook = "notebooks/pic-vs-reserve.ipynb"
    # the copy starts from an older layout: one generated cell, of a module the table does not take
    stale = nbformat.read(tmp_path / notebook, as_version=4)
    first = next(i for i, cell in enumerate(stale.cells) if cell_source(cell))
    old_cell = stale.cells[first]
    old_cell.metadata["tags"] = [TAG_PREFIX + "lab_helpers/views/explain.py"]
    old_cell.source = BANNER.format(source="lab_helpers/views/explain.py") + "\nOLD = 1\n"
    stale.cells = [cell for i, cell in enumerate(stale.cells) if i == first or not cell_source(cell)]
    nbformat.write(stale, tmp_path / notebook)
    before = nbformat.read(tmp_path / notebook, as_version=4)
    sources = notebook_sources(notebook, tmp_path, SYNTHETIC_TABLE)
    assert sources[-1] == "lab_helpers/synthetic/predict.py"  # the table's root comes last
    assert sources.index("lab_helpers/synthetic/measure.py") < sources.index("lab_helpers/synthetic/predict.py")
    assert sources.index("lab_helpers/core/errors.py") < sources.index("lab_helpers/core/files.py")
    old = [source for source in generated_cells(before) if source not in sources]
    assert sync(tmp_path, check=True, table=SYNTHETIC_TABLE) == (
        [f"{notebook} <- {source}" for source in sources] + [f"{notebook}: drops {source}" for source in old])
    assert nbformat.read(tmp_path / notebook, as_version=4) == before  # --check writes nothing
    sync(tmp_path, table=SYNTHETIC_TABLE)
    written = (tmp_path / notebook).read_bytes()
    assert sync(tmp_path, check=True, table=SYNTHETIC_TABLE) == []
    assert sync(tmp_path, table=SYNTHETIC_TABLE) == [] and (tmp_path / notebook).read_bytes() == written
    assert strip_bytes(written) == written  # what git stores: no outputs, collapsed
    nb = nbformat.read(tmp_path / notebook, as_version=4)
    nbformat.validate(nb)
    lessons = [cell for cell in nb.cells if not cell_source(cell)]
    assert lessons == [cell for cell in before.cells if not cell_source(cell)]  # lesson cells untouched
    cells = [cell for cell in nb.cells if cell_source(cell)]
    assert [cell_source(cell) for cell in cells] == sources
    for cell in cells:
        assert cell.source.splitlines()[0] == BANNER.format(source=cell_source(cell))
        assert cell.metadata["jupyter"]["source_hidden"] is True and cell.outputs == []
        assert not re.search(r"^\s*(from|import)\s+lab_helpers\b", cell.source, re.MULTILINE)
        assert MAIN_GUARD not in cell.source
    # the library's own names, not renamed: the lesson's calls run as they would in a script
    code = notebook_code_upto(notebook, root=tmp_path)
    namespace = {"__name__": "notebook_kernel"}
    exec(compile(code, "notebook-cells", "exec"), namespace)
    from lab_helpers.synthetic.network import MeasureConfig
    from lab_helpers.synthetic.predict import predict
    config = namespace["MeasureConfig"](batch=2, width=32)
    assert namespace["predict"](config) == predict(MeasureConfig(batch=2, width=32))
    # an edit of one module makes that one cell stale
    edited = tmp_path / "lab_helpers" / "core" / "tables.py"
    edited.write_text(edited.read_text() + "\nEDITED_ONLY_IN_THE_LIBRARY = 1\n")
    assert sync(tmp_path, check=True, table=SYNTHETIC_TABLE) == [f"{notebook} <- lab_helpers/core/tables.py"]


def test_sync_refuses_what_it_cannot_build(tmp_path):
    copy_checkout(tmp_path, SYNTHETIC_TABLE)
    notebook = "notebooks/pic-vs-reserve.ipynb"
    with pytest.raises(SyncError, match="^absent.ipynb is not a generated notebook"):
        sync(tmp_path, only=["absent.ipynb"], table=SYNTHETIC_TABLE)
    with pytest.raises(SyncError, match="its root lab_helpers/synthetic/absent.py is not a module file"):
        sync(tmp_path, table={notebook: ("lab_helpers/synthetic/absent.py",)})
    # one namespace per notebook: a name two of its modules define is refused, not renamed
    twice = tmp_path / "lab_helpers" / "synthetic" / "twice.py"
    twice.write_text("from lab_helpers.synthetic.predict import predict\n\n\ndef compare():\n    return predict\n")
    with pytest.raises(SyncError, match="compare is defined at top level in both"):
        sync(tmp_path, check=True, table={notebook: ("lab_helpers/synthetic/twice.py",)})
    # the generated cells stand together, where the notebook put them
    nb = nbformat.read(tmp_path / notebook, as_version=4)
    first = next(n for n, cell in enumerate(nb.cells) if cell_source(cell))
    nb.cells.insert(first + 1, nbformat.v4.new_code_cell("x = 1"))
    nbformat.write(nb, tmp_path / notebook)
    with pytest.raises(SyncError, match="generated cells are not together"):
        sync(tmp_path, check=True, table=SYNTHETIC_TABLE)
    nb.cells = [cell for cell in nb.cells if not cell_source(cell)]
    nbformat.write(nb, tmp_path / notebook)
    with pytest.raises(SyncError, match="has no generated cell"):
        sync(tmp_path, check=True, table=SYNTHETIC_TABLE)


def test_check_cli_exit_status():
    proc = subprocess.run([sys.executable, "-m", "lab_helpers.notebook_sync", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generated_cells_drop_the_main_block_and_library_imports():
    for notebook in NOTEBOOK_ROOTS:
        for source in notebook_sources(notebook):
            code = notebook_code(notebook, source)
            assert MAIN_GUARD not in code
            assert "# >>> library only" not in code
            assert not re.search(r"^\s*(from|import)\s+lab_helpers\b", code, re.MULTILINE)


def test_the_real_model_notebook_inlines_no_launcher_and_no_synthetic_network():
    sources = notebook_sources("notebooks/real-model.ipynb")
    assert [s for s in sources if s.startswith(("lab_helpers/launch/", "lab_helpers/synthetic/"))] == []


# --- the lesson comes first; cells call the library, they do not restate it ---------------

def _generated_source(cell) -> str:
    tags = [t for t in cell.metadata.get("tags", []) if t.startswith(TAG_PREFIX)]
    return tags[0][len(TAG_PREFIX):] if tags else None


@pytest.mark.parametrize("notebook", sorted(NOTEBOOK_ROOTS), ids=lambda n: Path(n).name)
def test_generated_cells_are_collapsed_behind_one_markdown_line(notebook):
    # what is committed: a cell you opened in your working copy is stored collapsed by the filter
    data = next(iter(committed_forms(ROOT / notebook).values()))
    nb = nbformat.reads(data.decode("utf-8"), as_version=4)
    numbers = [n for n, c in enumerate(nb.cells, start=1) if _generated_source(c)]
    sources = notebook_sources(notebook)
    assert [_generated_source(nb.cells[n - 1]) for n in numbers] == list(sources)
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "generated cells stay together"
    for n in numbers:
        assert nb.cells[n - 1].metadata.get("jupyter", {}).get("source_hidden") is True, f"cell {n} is open"
        source = _generated_source(nb.cells[n - 1])
        assert nb.cells[n - 1].source.splitlines()[0] == BANNER.format(source=source), f"cell {n} does not name {source}"
    intro = nb.cells[numbers[0] - 2]
    assert intro.cell_type == "markdown" and "\n" not in intro.source.strip() and len(intro.source) <= 260
    assert "`lab_helpers/`" in intro.source, f"cell {numbers[0] - 1} does not say where the code comes from"
    assert "make sync" in intro.source
    first_code = next(n for n, c in enumerate(nb.cells, start=1) if c.cell_type == "code")
    assert first_code < numbers[0], "the parameters come before the generated code"


@functools.lru_cache(maxsize=1)  # the package's files do not change during a run: parsed once
def _library_definitions() -> tuple:
    """Return (name -> module file) for the top-level functions, classes and ALL_CAPS constants of
    lab_helpers, and (int value -> constant name) for its byte-size constants (`*_BYTES`, 512 and more):
    a count limit that happens to equal 1024 is not a restated allocator size. A name's file is its
    home in the package, never a generated standalone file."""
    names, values = {}, {}
    generated = {target.path for target in STANDALONE}
    for path in sorted((ROOT / "lab_helpers").rglob("*.py")):
        home = path.relative_to(ROOT).as_posix()
        if home in generated:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.setdefault(node.name, home)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.isupper():
                        names.setdefault(target.id, home)
                        value = _constant_value(node.value)
                        if (target.id.endswith("_BYTES") and isinstance(value, int)
                                and not isinstance(value, bool) and value >= 512):
                            values.setdefault(value, target.id)
    return names, values


def _constant_value(node):
    """The value of a literal or of integer arithmetic on literals (2 * 2**20), else None."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Pow, ast.Add, ast.Sub)):
        left, right = _constant_value(node.left), _constant_value(node.right)
        if isinstance(left, int) and isinstance(right, int) and (abs(right) < 256 or not isinstance(node.op, ast.Pow)):
            return {ast.Mult: left * right, ast.Pow: left ** right, ast.Add: left + right,
                    ast.Sub: left - right}[type(node.op)]
    return None


def restated_library_names(nb) -> list:
    """Return 'cell N: ...' for each top-level definition of a non-generated code cell that
    restates a lab_helpers name, or gives an ALL_CAPS name one of the library's constant values."""
    names, values = _library_definitions()
    found = []
    for number, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code" or _generated_source(cell):
            continue
        code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        for node in ast.parse(code).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
                found.append(f"cell {number}: defines {node.name}, already in {names[node.name]}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if not (isinstance(target, ast.Name) and target.id.isupper()):
                        continue
                    value = _constant_value(node.value) if node.value is not None else None
                    if target.id in names:
                        found.append(f"cell {number}: assigns {target.id}, already in {names[target.id]}")
                    elif isinstance(value, int) and value in values:
                        found.append(f"cell {number}: {target.id} = {value} restates {values[value]}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_cells_call_the_library_instead_of_restating_it(path):
    nb = nbformat.read(path, as_version=4)
    assert restated_library_names(nb) == []


def test_the_restatement_check_catches_what_it_should():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("def gpu_day_price(row):\n    return 1"),
        nbformat.v4.new_code_cell("MIN_BLOCK_BYTES = 512\nOWN_SEGMENT_MIN_BYTES = 10 * 2**20"),
        nbformat.v4.new_code_cell("%matplotlib inline\nclass AllocatorModel:\n    pass\nKIB = 2**10\nx = 512"),
        nbformat.v4.new_code_cell("def load_grid(p):\n    pass",
                                  metadata={"tags": ["generated-from:lab_helpers/grid.py"]}),
    ])
    price_home = _library_definitions()[0]["gpu_day_price"]  # the pricing module, wherever it lives
    assert price_home.startswith("lab_helpers/") and price_home not in {t.path for t in STANDALONE}
    assert restated_library_names(nb) == [
        f"cell 1: defines gpu_day_price, already in {price_home}",
        "cell 2: assigns MIN_BLOCK_BYTES, already in lab_helpers/allocator/model.py",
        "cell 2: OWN_SEGMENT_MIN_BYTES = 10485760 restates MIN_LARGE_ALLOC_BYTES",
        "cell 3: defines AllocatorModel, already in lab_helpers/allocator/model.py",
    ]


# what a Jupyter kernel defines besides the builtins
KERNEL_NAMES = {"display", "get_ipython", "In", "Out", "__name__"}


def bound_names(tree, everywhere: bool) -> set:
    """Names `tree` binds: at its top level only (what a cell leaves in the kernel's namespace), or
    `everywhere` (function parameters and locals too, so that a lesson's own names are never reported)."""
    names = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
                if not everywhere:
                    continue
            if not everywhere and isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                                     ast.GeneratorExp)):
                continue
            if isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
                names.add(child.id)
            elif isinstance(child, ast.arg):
                names.add(child.arg)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in child.names)
            elif isinstance(child, ast.ExceptHandler) and child.name:
                names.add(child.name)
            elif isinstance(child, (ast.Global, ast.Nonlocal)):
                names.update(child.names)
            visit(child)

    visit(tree)
    return names


def names_the_notebook_lacks(nb) -> list:
    """Names the lesson cells read that neither they, the generated cells nor the kernel define: a
    library name a lesson still spells the old way (`x_timeline`, `mm.predict`) shows up here."""
    import builtins
    generated = set().union(*(bound_names(ast.parse(c.source), False) for c in nb.cells if _generated_source(c)))
    lessons = [ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                   for line in c.source.splitlines()))
               for c in nb.cells if c.cell_type == "code" and not _generated_source(c)]
    own = set().union(*(bound_names(tree, True) for tree in lessons))
    read = {node.id for tree in lessons for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return sorted(read - own - generated - set(dir(builtins)) - KERNEL_NAMES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_lesson_cells_read_only_names_the_notebook_defines(path):
    assert names_the_notebook_lacks(nbformat.read(path, as_version=4)) == []


def test_the_missing_name_check_catches_what_it_should():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("from pathlib import Path\n\n\ndef load_timeline(p):\n    return [p]",
                                  metadata={"tags": ["generated-from:lab_helpers/views/timeline.py"]}),
        nbformat.v4.new_code_cell("%matplotlib inline\nrows = load_timeline(Path('t.json'))\n"
                                  "peaks = phase_peaks_timeline(rows)\nprint(mm.predict(rows), len(peaks))"),
        nbformat.v4.new_code_cell("def f(x):\n    local = x\n    return [y for y in local]\ndisplay(f(rows))"),
    ])
    assert names_the_notebook_lacks(nb) == ["mm", "phase_peaks_timeline"]


GRID_LINES = [
    ",".join(("date", "gpu_model", "forfait_days", "forfait_lots", "device", "torch_version",
              "measurement_file", "task", "acceptance_threshold", "units_produced", "units_accepted",
              "wall_seconds", "notes")),
    "2026-10-01,b200,7,2,NVIDIA B200,2.9.0,mesures-b200.json,invoices,all fields exact,1200,1000,5400.5,",
    "2026-10-02,h100-sxm,7,1,NVIDIA H100 80GB HBM3,2.9.0,,invoices,all fields exact,700,600,7200,",
    "2026-10-03,h100-sxm,3,1,NVIDIA H100 80GB HBM3,2.9.0,,invoices,all fields exact,10,0,100,stopped",
]


def test_forfaits_notebook_runs_the_library_grid_and_calculator(tmp_path):
    from lab_helpers.pricing.card import load_card
    from lab_helpers.pricing.forfait import gpu_day_price
    from lab_helpers.pricing.grid import load_grid, model_costs, row_costs
    code = notebook_code_upto("notebooks/forfaits.ipynb", "lab_helpers/pricing/grid.py")
    module_path = tmp_path / "forfaits_cells.py"
    module_path.write_text(code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("forfaits_cells", module_path)
    cells = importlib.util.module_from_spec(spec)
    sys.modules["forfaits_cells"] = cells
    try:
        spec.loader.exec_module(cells)
    finally:
        del sys.modules["forfaits_cells"]
    card_path = ROOT / "data" / "tarifs-forfaits.csv"
    grid_path = tmp_path / "resultats-bruts.csv"
    grid_path.write_text("\n".join(GRID_LINES) + "\n", encoding="utf-8")
    card, nb_card = load_card(card_path), cells.load_card(card_path)  # after grid's cell
    assert nb_card == card
    assert [cells.gpu_day_price(row) for row in card] == [gpu_day_price(row) for row in card]
    rows = load_grid(grid_path, card)
    assert cells.load_grid(grid_path, card) == rows
    assert cells.row_costs(rows, card) == row_costs(rows, card)
    assert cells.model_costs(cells.row_costs(rows, card)) == model_costs(row_costs(rows, card))
    with pytest.raises(cells.GridError, match="line 2"):
        bad = tmp_path / "bad.csv"
        bad.write_text(GRID_LINES[0] + "\n" + GRID_LINES[1].replace(",1000,", ",9999,") + "\n", encoding="utf-8")
        cells.load_grid(bad, card)


@pytest.mark.parametrize("notebook", ["forfaits.ipynb", "pic-vs-reserve.ipynb"])
def test_notebook_cells_use_the_library_names(notebook):
    code = "\n".join(c.source for c in nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells
                     if c.cell_type == "code" and not _generated_source(c))
    wanted = {"forfaits.ipynb": ["gpu_day_price(", "load_grid(", "row_costs(", "model_costs("],
              "pic-vs-reserve.ipynb": ["MIN_BLOCK_BYTES", "SMALL_REQUEST_MAX_BYTES", "SMALL_SEGMENT_BYTES",
                                       "LARGE_SEGMENT_BYTES", "AllocatorModel.round_size",
                                       "AllocatorModel.segment_size"]}[notebook]
    assert [name for name in wanted if name not in code] == []


def test_mesure_memoire_notebook_alone_runs_and_measures_nothing_without_a_gpu(tmp_path):
    from nbclient import NotebookClient
    alone = tmp_path / "alone"
    alone.mkdir()
    nb = nbformat.read(ROOT / "notebooks" / "mesure-memoire.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(alone)}}).execute()
    errors = [n for n, c in enumerate(nb.cells, start=1) for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    sweep = next(c for c in nb.cells if c.cell_type == "code" and "run_sweep(" in c.source
                 and not _generated_source(c))
    text = "".join(o.get("text", "") for o in sweep.outputs)
    assert text == "No GPU: no sweep (every point is measured on the GPU, in a fresh process).\n"
    assert sorted(p.name for p in alone.iterdir()) == []  # nothing written without a GPU


def test_every_notebook_names_the_kernel_as_jupyterlab_saves_it():
    # JupyterLab rewrites the kernelspec on save: a stored name that differs shows up in `git diff`
    specs = {path.name: nbformat.read(path, as_version=4).metadata.get("kernelspec") for path in NOTEBOOKS}
    assert all(spec == {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
               for spec in specs.values()), specs
