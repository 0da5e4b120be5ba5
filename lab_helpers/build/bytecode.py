"""Byte-compile the modules a first answer imports, once, when the venv is set up (.ci/venv.sh).

    python -m lab_helpers.build.bytecode

.ci/venv.sh installs with pip's --no-compile (byte-compiling every installed file costs a minute of
CPU on 2 cores), counting on Python to compile a module on its first import. Where
PYTHONDONTWRITEBYTECODE is set (many Docker images set it, and so does this lab's CI machine) Python
never writes what it compiled, so every process compiles torch and transformers again: a cold
`real_model predict` of the 8B took 7.2 s there instead of about 3 s. Python still reads bytecode it
may not write, so this writes it once for what the lab's answers import: torch, transformers' auto
classes and the configuration and modeling code of every bundled family, peft where installed, and
the lab's own modules. Prints one line: how many files were written and in how long; a file that
cannot be written (a read-only install) is left to be compiled on import, as before.
"""
import contextlib
import io
import py_compile
import sys
import time

from lab_helpers.real.raw_config import bundled_model_types

# the lab's modules an answer imports lazily (inside the functions that trace or measure)
LAB_MODULES = ("lab_helpers.real.commands", "lab_helpers.real.tracer", "lab_helpers.real.protocol",
               "lab_helpers.real.predict", "lab_helpers.real.fit", "lab_helpers.real.card_fit",
               "lab_helpers.real.layers", "lab_helpers.real.train", "lab_helpers.real.train_trace",
               "lab_helpers.real.autocast", "lab_helpers.real.train_card", "lab_helpers.synthetic.commands",
               "lab_helpers.pricing.commands")


def import_answer_modules() -> None:
    """Import what the lab's answers import; a package or module that is absent is passed over, and
    what the imports print (bitsandbytes' notices on a machine without its kernels) is not shown."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        _import_answer_modules()


def answer_module_names() -> list:
    """The modules to import: torch, transformers, the lab's, each bundled family's configuration and
    modeling modules (in the folder transformers names for its model type: gemma3_text's is gemma3),
    and peft's LoRA."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    names = ["torch", "transformers", *LAB_MODULES]
    for model_type in bundled_model_types():
        if not (isinstance(model_type, str) and model_type.isidentifier()):  # a module name is made of it
            continue
        folder = model_type_to_module_name(model_type)
        names += [f"transformers.models.{folder}.configuration_{folder}",
                  f"transformers.models.{folder}.modeling_{folder}"]
    return names + ["peft", "peft.tuners.lora"]


def _import_answer_modules() -> None:
    try:
        names = answer_module_names()
    except ImportError:  # no transformers: torch and the lab's modules only
        names = ["torch", *LAB_MODULES]
    for name in names:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 (a missing or failing optional module only goes uncompiled)
            continue
    try:
        from transformers import AutoModelForCausalLM, DynamicCache  # noqa: F401 (lazy: loads the auto classes)
    except Exception:  # noqa: BLE001
        pass


def write_bytecode(modules=None) -> int:
    """Files written: the bytecode of every module of `modules` (default: every loaded one) whose source
    is a .py file, where Python caches it (PEP 3147's __pycache__); one that cannot be written is left."""
    written = 0
    for module in list(sys.modules.values() if modules is None else modules):
        spec = getattr(module, "__spec__", None)
        origin, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
        if not (isinstance(origin, str) and origin.endswith(".py") and isinstance(cached, str)):
            continue
        try:
            py_compile.compile(origin, cfile=cached, doraise=True)
        except (OSError, py_compile.PyCompileError, ValueError):
            continue
        written += 1
    return written


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv:
        print(__doc__.strip() if argv in (["-h"], ["--help"]) else f"bytecode: error: no arguments, got {argv[0]!r}",
              file=sys.stdout if argv in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv in (["-h"], ["--help"]) else 2
    started = time.perf_counter()
    import_answer_modules()
    written = write_bytecode()
    print(f"bytecode: {written} files written in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
