"""The package's layout holds: one home per concern, no cycle, public names only across modules, one
of each shared piece, generated standalone files that match their sources and run alone; and the
start-up rule: `--help` and every refusal that needs no model leave torch and transformers unimported."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from lab_helpers.build import bundle

MAX_MODULE_LINES = 800
# the one module that looks a package up without importing it (importlib.util.find_spec)
FIND_SPEC_HOME = "lab_helpers/core/packages.py"
GENERATED = {target.path for target in bundle.STANDALONE}
PACKAGE_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "lab_helpers").rglob("*.py"))
ENTRY_MODULES = [path for path in PACKAGE_FILES if path.count("/") == 1 and path not in GENERATED
                 and not path.endswith("__init__.py")]
MODULES = [path for path in PACKAGE_FILES if path not in GENERATED and path not in ENTRY_MODULES
           and not path.endswith("__init__.py")]


def tree_of(path: str):
    return ast.parse((ROOT / path).read_text(encoding="utf-8"))


def package_imports(path: str):
    for node in ast.walk(tree_of(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lab_helpers"):
            yield node


def test_the_standalone_files_are_the_ones_the_kit_ships():
    assert GENERATED == {"lab_helpers/mesure_memoire.py", "lab_helpers/calcul_forfaits.py"}


@pytest.mark.parametrize("path", MODULES)
def test_no_hand_written_module_is_over_800_lines(path):
    lines = (ROOT / path).read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_MODULE_LINES, f"{path}: {lines} lines"


def test_the_package_has_no_import_cycle():
    # every import of a package module, lazy ones too (build/ tools may alias what they never bundle)
    edges = {path: {bundle.module_path(node.module) for node in package_imports(path)} for path in MODULES}
    done, open_ = set(), []

    def visit(path):
        assert path not in open_, "import cycle: " + " -> ".join([*open_[open_.index(path):], path])
        if path in done:
            return
        open_.append(path)
        for needed in sorted(edges.get(path, ())):
            visit(needed)
        open_.pop()
        done.add(path)

    for path in MODULES:
        visit(path)


# The sub-packages from the bottom up: each imports only from itself and the ones below it, lazy
# imports inside functions included, so no two of them depend on each other (docs/architecture.md)
LAYERS = ["core", "allocator", "measurement", "launch", "synthetic", "pricing", "real", "views", "build",
          "entry modules"]
# the modules that import a package outside the standard library when they load, not inside a function
LOAD_TIME_IMPORTS = {
    "lab_helpers/build/sync.py": {"nbformat"},
    "lab_helpers/real/autocast.py": {"torch"},
    "lab_helpers/real/bnb_kernels.py": {"torch"},
    "lab_helpers/real/tracer.py": {"torch"},
    "lab_helpers/real/train_trace.py": {"torch"},
    "lab_helpers/views/sweep.py": {"tqdm"},
}
HEAVY = {"torch", "transformers", "tqdm"}
# those, and the ones that import a package module of them when they load: importing any of these
# modules loads torch or tqdm; every other module keeps them in functions
LOADS_HEAVY = {"lab_helpers/real/autocast.py", "lab_helpers/real/bnb_kernels.py", "lab_helpers/real/tracer.py",
               "lab_helpers/real/train_trace.py", "lab_helpers/views/sweep.py",
               "lab_helpers/views/sweep_commands.py", "lab_helpers/sweep.py"}


def layer_of(path: str) -> str:
    return "entry modules" if path.count("/") == 1 else path.split("/")[1]


def imported_layers(path: str):
    """(layer, line) of every package module or sub-package `path` imports, at any depth."""
    for node in ast.walk(tree_of(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lab_helpers":
            names = node.module.split(".")[1:2] or [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".")[1] for alias in node.names if alias.name.startswith("lab_helpers.")]
        else:
            continue
        for name in names:
            is_package = (ROOT / "lab_helpers" / name).is_dir()
            yield (name if is_package else "entry modules"), node.lineno


def load_time_imports(path: str):
    """The top-level names of what `path` imports when it loads: every import but those in a function."""
    found, nodes = set(), list(tree_of(path).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
            if node.module.startswith("lab_helpers."):
                found.add(bundle.module_path(node.module))
        nodes.extend(ast.iter_child_nodes(node))
    return found


def test_the_sub_packages_import_only_the_layers_below_them():
    assert sorted({layer_of(path) for path in MODULES + ENTRY_MODULES}) == sorted(LAYERS)
    upward = [f"{path}:{line} ({layer_of(path)}) imports {layer}"
              for path in MODULES + ENTRY_MODULES for layer, line in imported_layers(path)
              if LAYERS.index(layer) > LAYERS.index(layer_of(path))]
    assert not upward, upward


def test_the_sub_package_graph_has_no_cycle():
    edges = {}
    for path in MODULES + ENTRY_MODULES:
        edges.setdefault(layer_of(path), set()).update(
            layer for layer, _ in imported_layers(path) if layer != layer_of(path))
    order = []  # Kahn's algorithm: a layer once every layer it imports is placed
    while len(order) < len(edges):
        ready = sorted(layer for layer, needed in edges.items() if layer not in order and needed <= set(order))
        assert ready, f"cycle among {sorted(set(edges) - set(order))}"
        order += ready
    assert all(LAYERS.index(needed) < LAYERS.index(layer) for layer in edges for needed in edges[layer])


def test_the_modules_that_import_torch_or_tqdm_when_they_load_are_these():
    third_party = {}
    for path in MODULES + ENTRY_MODULES:
        names = {name for name in load_time_imports(path)
                 if "/" not in name and name != "lab_helpers" and name not in sys.stdlib_module_names}
        if names:
            third_party[path] = names
    assert third_party == LOAD_TIME_IMPORTS
    loads = {path for path, names in LOAD_TIME_IMPORTS.items() if names & HEAVY}
    while True:  # and the modules that import one of them at load, through any chain
        more = {path for path in MODULES + ENTRY_MODULES if path not in loads and load_time_imports(path) & loads}
        if not more:
            break
        loads |= more
    assert loads == LOADS_HEAVY


def test_every_bundle_root_bundles():
    """The modules a standalone file or a notebook takes use only the import form the bundler drops."""
    from lab_helpers.build.sync import NOTEBOOK_ROOTS
    for roots in [target.roots for target in bundle.STANDALONE] + list(NOTEBOOK_ROOTS.values()):
        sources = bundle.closure(roots)
        bundle.check_unique([(source, bundle.section_code(source)[1]) for source in sources])


@pytest.mark.parametrize("path", MODULES + ENTRY_MODULES)
def test_modules_import_public_names_of_module_files_only(path):
    for node in package_imports(path):
        assert not node.module.split(".")[-1].startswith("_"), (path, node.module)
        assert bundle.module_path(node.module) in MODULES, f"{path} imports {node.module}, not a package module"
        private = [alias.name for alias in node.names if alias.name.startswith("_")]
        assert not private, f"{path} imports private names {private} from {node.module}"


@pytest.mark.parametrize("path", MODULES + ENTRY_MODULES)
def test_no_inlining_leaks_in_library_code(path):
    text = (ROOT / path).read_text(encoding="utf-8")
    if path == FIND_SPEC_HOME:
        text = re.sub(r"import importlib\.util\n|importlib\.util\.find_spec", "", text)
    for leak in ("# >>> library only", "importlib", 'sys.modules["__main__"]', "globals().get(", "linecache",
                 "args.command =="):
        assert leak not in text, f"{path} holds {leak!r}"


@pytest.mark.parametrize("pattern, home", [
    (r"class \w+\((?:argparse\.)?ArgumentParser\)", "lab_helpers/core/cli.py"),
    (r"except BrokenPipeError", "lab_helpers/core/cli.py"),
    (r"O_NONBLOCK", "lab_helpers/core/files.py"),
    (r"def error\(self, message\)", "lab_helpers/core/cli.py"),
])
def test_one_of_each_shared_piece(pattern, home):
    found = [path for path in MODULES + ENTRY_MODULES if re.search(pattern, (ROOT / path).read_text(encoding="utf-8"))]
    assert found == [home]


@pytest.mark.parametrize("path", ENTRY_MODULES)
def test_entry_modules_only_start_a_main(path):
    tree = tree_of(path)
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    imports = [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom))]
    others = [node for node in body if node not in imports]
    assert [alias.name for node in imports for alias in node.names] == ["sys", "main"]
    assert len(others) == 1 and isinstance(others[0], ast.If)
    assert ast.unparse(others[0]) == "if __name__ == '__main__':\n    sys.exit(main())"


@pytest.mark.parametrize("path", MODULES + ENTRY_MODULES)
def test_nothing_imports_a_generated_file(path):
    for node in package_imports(path):
        assert bundle.module_path(node.module) not in GENERATED, f"{path} imports {node.module}"


def test_generated_files_match_the_package():
    assert bundle.build(check=True) == []


@pytest.mark.parametrize("target", bundle.STANDALONE, ids=lambda t: t.path)
def test_generated_files_say_where_to_edit_and_import_only_the_standard_library(target):
    text = (ROOT / target.path).read_text(encoding="utf-8")
    assert text.startswith(bundle.STANDALONE_BANNER)
    sources = bundle.closure(target.roots)
    for source in sources:
        assert f"\n{bundle.SECTION_MARKER.format(source=source)}" in text
    top = [node for node in ast.parse(text).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {alias.name.split(".")[0] for node in top if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module.split(".")[0] for node in top if isinstance(node, ast.ImportFrom)}
    assert modules and modules <= set(sys.stdlib_module_names), modules - set(sys.stdlib_module_names)


@pytest.mark.parametrize("target", bundle.STANDALONE, ids=lambda t: t.path)
def test_generated_files_run_alone_in_an_empty_folder(target, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "script.py").write_bytes((ROOT / target.path).read_bytes())
    proc = subprocess.run([sys.executable, "-I", "script.py", "--help"], cwd=alone, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ") and proc.stderr == ""
    assert sorted(p.name for p in alone.iterdir()) == ["script.py"]


@pytest.mark.parametrize("case, code, problem", [
    ("alias", "from lab_helpers.core.files import display_path as shown\n", "no alias"),
    ("package import", "import lab_helpers.core.files\n", "cannot be bundled"),
    ("star", "from lab_helpers.core.files import *\n", "no star"),
    ("not a module", "from lab_helpers.nowhere import x\n", "not a module file"),
])
def test_the_bundler_refuses_what_it_cannot_drop(tmp_path, case, code, problem):
    (tmp_path / "lab_helpers").mkdir()
    (tmp_path / "lab_helpers" / "root.py").write_text(code, encoding="utf-8")
    with pytest.raises(bundle.BundleError, match=problem):
        bundle.closure(["lab_helpers/root.py"], tmp_path)


def test_the_bundler_refuses_a_cycle_and_a_name_defined_twice(tmp_path):
    package = tmp_path / "lab_helpers"
    package.mkdir()
    (package / "a.py").write_text("from lab_helpers.b import y\nx = 1\n", encoding="utf-8")
    (package / "b.py").write_text("from lab_helpers.a import x\ny = 2\n", encoding="utf-8")
    with pytest.raises(bundle.BundleError, match="import cycle: lab_helpers/a.py -> lab_helpers/b.py -> lab_helpers/a.py"):
        bundle.closure(["lab_helpers/a.py"], tmp_path)
    (package / "b.py").write_text("y = 2\ndef x():\n    pass\n", encoding="utf-8")
    (package / "a.py").write_text("from lab_helpers.b import y\nx = 1\n", encoding="utf-8")
    sections = [(source, bundle.section_code(source, tmp_path)[1]) for source in bundle.closure(["lab_helpers/a.py"], tmp_path)]
    with pytest.raises(bundle.BundleError, match="x is defined at top level in both lab_helpers/b.py and lab_helpers/a.py"):
        bundle.check_unique(sections)


def test_a_dropped_import_alone_in_its_block_leaves_pass(tmp_path):
    package = tmp_path / "lab_helpers"
    package.mkdir()
    (package / "a.py").write_text('"""A."""\ndef f():\n    from lab_helpers.b import g\n\n\n'
                                  'def h():\n    if True:\n        from lab_helpers.b import g\n    return g()\n',
                                  encoding="utf-8")
    docstring, code = bundle.section_code("lab_helpers/a.py", tmp_path)
    assert docstring == "A."
    assert code == "def f():\n    pass\n\n\ndef h():\n    if True:\n        pass\n    return g()"


# The command line's flags are read in the *commands.py modules only: a library function takes typed
# values. Exempt: core/cli.py (the parser and dispatcher itself) and build/ (programs of their own whose
# handle_* functions take their parsed namespace).
NAMESPACE_READERS_EXEMPT = ("lab_helpers/core/cli.py", "lab_helpers/build/")


def namespace_readers(path: str) -> list:
    """The functions of `path` with a parameter `args` whose attributes they read (torch's
    __torch_function__ takes a tuple `args` and reads none)."""
    found = []
    for node in ast.walk(tree_of(path)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
        if "args" in names and any(isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                                   and inner.value.id == "args" for inner in ast.walk(node)):
            found.append(f"{path}:{node.lineno} {node.name}")
    return found


def test_only_the_commands_modules_take_an_argparse_namespace():
    library = [path for path in MODULES if not path.endswith("commands.py")
               and not path.startswith(NAMESPACE_READERS_EXEMPT)]
    assert [reader for path in library for reader in namespace_readers(path)] == []


def test_a_library_call_names_the_parameter_and_the_command_line_its_flag():
    from lab_helpers.core.errors import ParameterError
    from lab_helpers.real.card_fit import check_request
    from lab_helpers.real.spec import RunSpec
    with pytest.raises(ParameterError) as caught:
        check_request(9, None)
    assert str(caught.value) == "days must be one of 3, 7, 30, got 9"
    assert (caught.value.parameter, caught.value.problem) == ("days", "must be one of 3, 7, 30, got 9")
    with pytest.raises(ParameterError, match="^batch must be a whole number from 1 to 65536, got 0$"):
        RunSpec("x", batch=0)
    with pytest.raises(ParameterError, match="^new_tokens must be"):
        RunSpec("x", new_tokens=0)


def test_the_command_line_maps_a_parameter_to_its_flag():
    import argparse

    from lab_helpers.core.cli import usage_message
    from lab_helpers.core.errors import LabError, ParameterError
    flags = argparse.Namespace(new_tokens=0, optimizer="sgd", fused=True)
    assert usage_message(ParameterError("new_tokens", "must be > 0, got 0"), flags) == "--new-tokens must be > 0, got 0"
    assert usage_message(ParameterError("fused", "is for {optimizer} adamw only", ("optimizer",)), flags) == \
        "--fused is for --optimizer adamw only"
    # a parameter no flag of the command sets is named as raised, and so is any other refusal
    assert usage_message(ParameterError("days", "must be one of 3, 7, 30, got 9"), flags) == \
        "days must be one of 3, 7, 30, got 9"
    assert usage_message(LabError("--days only go with --card"), flags) == "--days only go with --card"


@pytest.mark.parametrize("argv, message", [
    (["fit", "--config", "qwen1.5-0.5b", "--gpu", "h200-sxm", "--batch", "1", "--new-tokens", "1", "--days", "7"],
     "real_model: error: --days only go with --card"),
    (["predict", "--task", "train", "--train", "lora", "--config", "qwen1.5-0.5b", "--batch", "1",
      "--context", "8"], "real_model: error: --lora-rank must be a whole number from 1 to 65536 with --train lora, got None"),
    (["predict", "--task", "train", "--optimizer", "sgd", "--fused", "--config", "qwen1.5-0.5b", "--batch", "1",
      "--context", "8"], "real_model: error: --fused is for --optimizer adamw only"),
])
def test_the_command_line_still_names_the_flag(argv, message, capsys):
    from lab_helpers.real.commands import main
    assert main(argv) == 2
    assert capsys.readouterr().err == message + "\n"


# ---- start-up: refusals that need no model answer before torch and transformers are imported. Each
# case runs real_model in a fresh Python, which then reports what it imported.
HEADER = ("model_id,display_name,gpus_per_lot,memory_per_gpu_gib,duration_days,lot_price_cents,currency,"
          "snapshot_date,provenance\n")
ROW = "h200-sxm,NVIDIA H200 SXM,{gpus},{memory},7,{price},USD,2026-09-24,quoted\n"
CARD = ["fit", "--card", "--config", "llama-3.1-8b", "--batch", "1", "--context", "128", "--new-tokens", "4",
        "--days", "7", "--tariffs"]
SMALL_RUN = ["--batch", "1", "--context", "128", "--new-tokens", "4"]
# Runs real_model's main on argv (json on the command line), with the packages named hidden as if not
# installed; prints, last, which of torch and transformers the process imported.
CHILD = r"""
import json, sys
argv, hidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])
unloadable = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
for name in hidden:
    sys.modules[name] = None  # importlib.util.find_spec then finds nothing, and import fails
import importlib.abc, importlib.machinery
class Unloadable(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # found where it is installed (its files readable), but its code never runs: an import fails
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in unloadable:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = self
        return spec
    def create_module(self, spec):
        raise ImportError(f"{spec.name} is not to be imported here")
    def exec_module(self, module):
        raise ImportError(module.__name__)
sys.meta_path.insert(0, Unloadable())
from lab_helpers.real.commands import main
try:
    code = main(argv)
except SystemExit as exc:
    code = exc.code
sys.stdout.write("\n" + json.dumps({"code": code, "imported": sorted(
    name for name in ("torch", "transformers") if sys.modules.get(name) is not None)}) + "\n")
"""


def card_file(text: "str | bytes"):
    def make(folder):
        path = folder / "card.csv"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(path)
    return make


def folder_card(folder):
    (folder / "card").mkdir()
    return str(folder / "card")


def fifo_card(folder):
    os.mkfifo(folder / "card.fifo")
    return str(folder / "card.fifo")


def sparse_card(folder):
    with open(folder / "card.csv", "wb") as handle:
        handle.truncate(2 * 2**30)  # a hole: costs no disk
    return str(folder / "card.csv")


def looping_card(folder):
    (folder / "a.csv").symlink_to(folder / "b.csv")
    (folder / "b.csv").symlink_to(folder / "a.csv")
    return str(folder / "a.csv")


TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 128}
BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}


def config_file(**changes):
    def make(folder):
        path = folder / "config.json"
        path.write_text(json.dumps({**TINY, **changes}))
        return str(path)
    return make


# (id, argv after real_model (a callable making the last argument in a folder), packages hidden, words)
CASES = [
    ("unknown gpu", ["fit", "--config", "llama-3.1-8b", "--gpu", "h900", *SMALL_RUN], [], "unknown --gpu 'h900'"),
    ("predict unknown gpu", ["predict", "--config", "llama-3.1-8b", "--gpu", "h900", *SMALL_RUN], [],
     "unknown --gpu 'h900'"),
    ("measure without a gpu", ["measure", "--config", "llama-3.1-8b", *SMALL_RUN, "--output", "m.json"], [],
     "measure runs on a CUDA or ROCm GPU, never on the CPU, and this machine has no CUDA or ROCm device"),
    ("measure train without a gpu", ["measure", "--task", "train", "--config", "llama-3.1-8b", "--batch", "1",
                                     "--context", "16", "--output", "m.json"], [],
     "measure runs on a CUDA or ROCm GPU"),
    ("fit without a budget or a gpu", ["fit", "--config", "llama-3.1-8b", *SMALL_RUN], [],
     "no GPU visible as cuda:0 (this machine has no CUDA or ROCm device"),
    ("predict --device without a gpu", ["predict", "--config", "llama-3.1-8b", *SMALL_RUN, "--device", "cuda:0"], [],
     "no GPU visible as cuda:0 (this machine has no CUDA or ROCm device"),
    ("peft missing", ["fit", "--card", "--task", "train", "--train", "lora", "--lora-rank", "16", "--config",
                      "llama-3.1-8b", "--batch", "1", "--context", "2048", "--days", "7"], ["peft"],
     "--train lora needs peft 0.21.2, not installed in this Python"),
    ("peft missing for predict", ["predict", "--task", "train", "--train", "lora", "--lora-rank", "8", "--config",
                                  "llama-3.1-8b", "--batch", "1", "--context", "16"], ["peft"],
     "--train lora needs peft 0.21.2"),
    ("bitsandbytes missing", ["fit", "--config", "mixtral-8x7b", "--quantize", "nf4", "--gpu", "h100-sxm",
                              *SMALL_RUN], ["bitsandbytes"], "--quantize nf4 needs bitsandbytes 0.50.2"),
    ("beyond the positions", ["predict", "--config", "gpt2", "--batch", "1", "--context", "1020", "--new-tokens",
                              "64"], [], "--context 1020 plus --new-tokens 64 is beyond the model's 1024 positions"),
    ("fit beyond the positions", ["fit", "--config", "gpt2", "--gpu", "h100-sxm", "--batch", "1", "--context",
                                  "1020", "--new-tokens", "64"], [],
     "--context 1020 is beyond the model's 1024 positions minus 64 new tokens"),
    ("tokens over 2^26", ["predict", "--config", "llama-3.1-8b", "--batch", "65536", "--context", "2048",
                          "--new-tokens", "1"], [], "batch x (context + new tokens) must be at most 67108864"),
    ("no attention heads", ["predict", "--config", config_file(num_attention_heads=0), *SMALL_RUN], [],
     "num_attention_heads"),
    ("hidden size far out of bounds", ["fit", "--config", config_file(hidden_size=1000000), "--gpu", "h100-sxm",
                                       *SMALL_RUN], [], "hidden_size"),
    ("an encoder", ["fit", "--config", lambda folder: config_file(**BERT)(folder), "--gpu", "h100-sxm",
                    *SMALL_RUN], [], "bert"),
    ("a hub id", ["predict", "--config", "meta-llama/Llama-3.1-8B", *SMALL_RUN], [], "did you mean llama-3.1-8b?"),
    ("card missing", [*CARD, lambda folder: str(folder / "none.csv")], [], "cannot read the rate card"),
    ("card is a folder", [*CARD, folder_card], [], "card"),
    ("card empty", [*CARD, card_file("")], [], "card.csv"),
    ("card binary", [*CARD, card_file(b"\x00\x01\x02PK\x03\x04")], [], "card.csv"),
    ("card a fifo", [*CARD, fifo_card], [], "card.fifo"),
    ("card sparse 2 GB", [*CARD, sparse_card], [], "over the 1048576-byte limit"),
    ("card not utf-8", [*CARD, card_file(HEADER.encode() + b"h200-sxm,\xff\xfe\n")], [], "UTF-8"),
    ("card header only", [*CARD, card_file(HEADER)], [], "card.csv"),
    ("card zero memory", [*CARD, card_file(HEADER + ROW.format(gpus=8, memory=0, price=1000))], [],
     "memory_per_gpu_gib"),
    ("card nan price", [*CARD, card_file(HEADER + ROW.format(gpus=8, memory=141, price="nan"))], [],
     "lot_price_cents"),
    ("card zero gpus per lot", [*CARD, card_file(HEADER + ROW.format(gpus=0, memory=141, price=1000))], [],
     "gpus_per_lot"),
    ("card symlink loop", [*CARD, looping_card], [], "a.csv"),
    ("card /dev/zero", [*CARD, "/dev/zero"], [], "/dev/zero"),
    ("train card missing", ["fit", "--card", "--task", "train", "--config", "llama-3.1-8b", "--batch", "1",
                            "--context", "128", "--days", "7", "--tariffs", "none.csv"], [],
     "cannot read the rate card"),
]


def run_child(argv, hidden, cwd, unloadable=()):
    """(report, stdout, stderr) of real_model's main in a fresh Python: `hidden` packages absent, the
    `unloadable` ones installed but never imported (an import of them fails)."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv), json.dumps(hidden),
                           json.dumps(list(unloadable))], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=600)
    *out, report = proc.stdout.rstrip("\n").split("\n")
    return json.loads(report), "\n".join(out), proc.stderr


def test_help_imports_neither_torch_nor_transformers(tmp_path):
    for argv in (["--help"], ["fit", "--help"], ["predict", "--help"], ["measure", "--help"]):
        report, out, err = run_child(argv, [], tmp_path)
        assert report == {"code": 0, "imported": []} and out.startswith("usage: ") and err == "", argv


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_refusal_that_needs_no_model_imports_neither_torch_nor_transformers(tmp_path, case):
    _, argv, hidden, words = case
    if "CUDA or ROCm device" in words and os.path.exists("/dev/nvidia0"):
        pytest.skip("this machine has a GPU: the refusal of a machine without one cannot happen here")
    argv = [arg(tmp_path) if callable(arg) else arg for arg in argv]
    report, out, err = run_child(argv, hidden, tmp_path)
    lines = err.splitlines()
    assert report == {"code": 2, "imported": []}, (report, err[-800:])
    assert out == "" and len(lines) == 1 and lines[0].startswith("real_model: error: "), err[-800:]
    assert words in lines[0], lines[0]
    assert not (tmp_path / "m.json").exists()


WARM_CASES = [  # (id, argv after real_model): answers whose traces the cache folder keeps
    ("predict", ["predict", "--config", "qwen1.5-0.5b", *SMALL_RUN]),
    ("fit", ["fit", "--config", "qwen1.5-0.5b", "--gpu", "h100-sxm", *SMALL_RUN, "--format", "json"]),
    ("fit --card", ["fit", "--card", "--config", "qwen1.5-0.5b", *SMALL_RUN, "--days", "7"]),
    ("predict at tensor parallel 2", ["predict", "--config", config_file(max_position_embeddings=4096), *SMALL_RUN,
                                      "--tensor-parallel", "2"]),
]


@pytest.mark.parametrize("case", WARM_CASES, ids=[case[0] for case in WARM_CASES])
def test_a_warm_answer_imports_neither_torch_nor_transformers_and_is_the_same(tmp_path, monkeypatch, case):
    """A question asked again from a fresh process, its shape and traces kept in the cache folder, reads
    torch's and transformers' versions from their files (the traces' key) and replays: it answers with
    both packages installed but never imported, byte for byte what the first answer printed."""
    argv = [arg(tmp_path) if callable(arg) else arg for arg in case[1]]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cold, cold_out, cold_err = run_child(argv, [], tmp_path)
    assert cold == {"code": 0, "imported": ["torch", "transformers"]}, cold_err[-800:]
    warm, warm_out, warm_err = run_child(argv, [], tmp_path, unloadable=["torch", "transformers"])
    assert warm == {"code": 0, "imported": []}, warm_err[-800:]
    assert warm_out == cold_out and warm_out.strip()
