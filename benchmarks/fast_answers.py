"""How long the buyer's questions take, as ratios to importing torch and transformers, cold (no trace
kept) and warm (the same question again, its traces read from the cache folder), and ten questions
asked in one process as a notebook's kernel asks them.

    python benchmarks/fast_answers.py [--cases predict-70b,card-8b,fit-70b,notebook,searches] [--repeats 1]
        [--check-exact] [--repository PATH] [--bytecode kept|none]

The goals (issue "Fast answers, restated"): cold, `predict` within 1.2 x MODEL_CODE_IMPORT, `fit` of the
70B within 2.5 x, `fit --card` within 2 x; in one process, from the second question on, `predict`
and `fit` of an 8B within 1 s and `fit --card` within 2 s (`notebook`: ten questions, their seconds
each, an empty cache folder at the start, in a Jupyter kernel where jupyter_client is installed, else
in one Python process); `searches`: the predictions each `fit` runs, for five models (fit's JSON
"predictions_run"), in one process.

Each figure is a fresh process (`python -m lab_helpers.real_model ...`) with its own empty cache
folder (XDG_CACHE_HOME) for the cold run, kept for the warm one; beside it the median of
`python -c "import torch, transformers"` in the same run (the unit of the first speed goals), and of that
import with the model's config and modeling modules (MODEL_CODE_IMPORT: the floor of any cold answer,
which traces the model's own code; a warm one reads its traces and imports neither). A seconds bound
holds only on an idle machine, so the ratios are the figures to compare; the seconds are printed
too, with the machine's load (os.getloadavg) before and after, and the CPU seconds of each process with
their ratio to the import's CPU seconds (on a machine shared with other work, the steadier figure). --repository runs the commands of
another checkout (an older version, for a before/after). --check-exact replays each case's fast
trace (decode steps extended from four traced ones) and its full trace (every step traced) in this
process and checks the predictions are byte-identical (long: the full trace runs every step on meta;
tests/test_fast_answers.py runs the same check in CI on each case cut to 8 new tokens).

Bytecode: where Python may write it, a module is compiled on its first import only; where
PYTHONDONTWRITEBYTECODE is set (as on some CI machines, or a venv installed with --no-compile and no
write access), every process compiles torch and transformers again, several seconds of CPU each, on
both sides of every ratio. --bytecode kept (the default) gives every child one temporary
PYTHONPYCACHEPREFIX and runs the import and each case's command once, untimed, before measuring: the
figures are those of an installation that has run once. --bytecode none leaves the environment as it is.
Prints one JSON object; not a test.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lab_helpers.core.cli import CommandParser  # noqa: E402
from lab_helpers.core.numbers import whole_number  # noqa: E402

IMPORT_ONLY = ["-c", "import torch, transformers"]
# What any exact answer for the cases' model (Llama) imports before its first trace: transformers'
# import is lazy, and the config and modeling modules pull in torch.distributed.tensor (sympy) and
# torch._dynamo (transformers' activations, core_model_loading, masking_utils). A cold answer cannot
# be faster than this; the ratio to it is the lab's own share.
MODEL_CODE_IMPORT = ["-c", "import torch, transformers; from transformers import AutoModelForCausalLM, DynamicCache; "
                           "from transformers.models.llama import configuration_llama, modeling_llama"]
# the bound on each cold case's seconds, as a ratio to MODEL_CODE_IMPORT's (issue "Fast answers, restated")
GOALS = {"predict-70b": 1.2, "card-8b": 2.0, "fit-70b": 2.5}
# in one process, from the second question on: seconds of a predict or fit of an 8B, of a fit --card
IN_PROCESS_GOALS = {"predict": 1.0, "fit": 1.0, "card": 2.0}
_EIGHT_B = ["--config", "llama-3.1-8b", "--new-tokens", "64"]
# a notebook's ten questions on one model, in order: (kind of IN_PROCESS_GOALS, arguments)
NOTEBOOK = [
    ("predict", ["predict", *_EIGHT_B, "--batch", "1", "--context", "4096"]),
    ("predict", ["predict", *_EIGHT_B, "--batch", "1", "--context", "4096"]),
    ("predict", ["predict", *_EIGHT_B, "--batch", "2", "--context", "4096"]),
    ("predict", ["predict", *_EIGHT_B, "--batch", "1", "--context", "8192"]),
    ("fit", ["fit", *_EIGHT_B, "--gpu", "h100-sxm", "--batch", "1", "--context", "4096"]),
    ("fit", ["fit", *_EIGHT_B, "--gpu", "h100-sxm", "--batch", "1", "--context", "4096"]),
    ("fit", ["fit", *_EIGHT_B, "--gpu", "h200-sxm", "--batch", "4", "--context", "2048"]),
    ("card", ["fit", "--card", *_EIGHT_B, "--batch", "1", "--context", "4096", "--days", "7"]),
    ("card", ["fit", "--card", *_EIGHT_B, "--batch", "1", "--context", "4096", "--days", "7"]),
    ("card", ["fit", "--card", *_EIGHT_B, "--batch", "2", "--context", "8192", "--days", "30"]),
]
# five models' fits (issue "Fast answers, restated", item 3: the predictions of each)
SEARCHES = [
    ["--config", "llama-3.1-8b", "--gpu", "h200-sxm", "--batch", "4", "--context", "2048", "--new-tokens", "64"],
    ["--config", "llama-3.1-70b", "--gpu", "h200-sxm", "--batch", "1", "--context", "8192", "--new-tokens", "256"],
    ["--config", "qwen2.5-7b", "--gpu", "h200-sxm", "--batch", "8", "--context", "8192", "--new-tokens", "256"],
    ["--config", "mistral-7b-v0.1", "--gpu", "h100-sxm", "--batch", "2", "--context", "4096", "--new-tokens", "128"],
    ["--config", "qwen3-8b", "--gpu", "a100-sxm-80gb", "--batch", "16", "--context", "1024", "--new-tokens", "128"],
]
# run in one child process (argv[1]: the questions as JSON): each question's seconds, exit code and,
# for a fit's JSON, its predictions; output captured, progress off (stderr is not a terminal)
IN_PROCESS = r"""
import contextlib, io, json, sys, time
from lab_helpers.real.commands import main
out = []
for argv in json.loads(sys.argv[1]):
    started = time.perf_counter()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main([*argv, "--format", "json"] if argv[0] == "fit" and "--card" not in argv else argv)
    entry = {"seconds": round(time.perf_counter() - started, 3), "exit": code}
    if argv[0] == "fit" and "--card" not in argv and code == 0:
        document = json.loads(text.getvalue())
        entry.update({key: document.get(key) for key in ("predictions_run", "largest_context_at_batch",
                                                         "largest_batch_at_context")})
    out.append(entry)
print(json.dumps(out))
"""
# name -> (the command's arguments, (config, batch, context, new tokens, degrees) of its predictions)
CASES = {
    "predict-70b": (["predict", "--config", "llama-3.1-70b", "--batch", "1", "--context", "32768",
                     "--new-tokens", "256", "--decode-record-every", "256"],
                    ("llama-3.1-70b", 1, 32768, 256, (1,))),
    "card-8b": (["fit", "--card", "--config", "llama-3.1-8b", "--dtype", "bfloat16", "--batch", "4",
                 "--context", "8192", "--new-tokens", "256", "--days", "7"],
                ("llama-3.1-8b", 4, 8192, 256, (1, 2))),
    "fit-70b": (["fit", "--config", "llama-3.1-70b", "--gpu", "h200-sxm", "--batch", "1", "--context", "8192",
                 "--new-tokens", "256"], None),
}
IN_PROCESS_CASES = ("notebook", "searches")


def timed(argv: list, env: dict, repository: Path, stdout: "list | None" = None) -> tuple:
    """(wall seconds, child CPU seconds, child peak RSS in KiB) of a fresh Python process; its stdout
    appended to `stdout` when given."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    environment = {**os.environ, **env, "PYTHONPATH": str(repository)}
    if "PYTHONPYCACHEPREFIX" in env:  # --bytecode kept: written there, whatever the environment says
        environment.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, *argv], cwd=repository, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=environment)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"fast_answers: error: {' '.join(argv[:4])} exited {proc.returncode}: "
                         f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if stdout is not None:
        stdout.append(proc.stdout)
    return seconds, cpu, after.ru_maxrss


def in_process(questions: list, env: dict, repository: Path) -> list:
    """Each question's entry (IN_PROCESS) of one process asking them in turn, its cache folder empty
    at the start."""
    with tempfile.TemporaryDirectory(prefix="fast-answers-") as folder:
        printed = []
        timed(["-c", IN_PROCESS, json.dumps(questions)], {**env, "XDG_CACHE_HOME": folder}, repository, printed)
    return json.loads(printed[0])


def in_kernel(questions: list, env: dict, repository: Path) -> list:
    """Each question's entry (seconds, exit) asked in turn in a Jupyter kernel (python3), one cell each,
    its cache folder empty at the start: a kernel runs several threads, so the layer expansion's larger
    trace is made in the kernel's process, not in a forked child (lab_helpers.core.forked)."""
    from jupyter_client.manager import start_new_kernel
    with tempfile.TemporaryDirectory(prefix="fast-answers-") as folder:
        environment = {**os.environ, **env, "XDG_CACHE_HOME": folder, "PYTHONPATH": str(repository)}
        manager, client = start_new_kernel(kernel_name="python3", cwd=str(repository), env=environment)
        try:
            run_cell(client, "import contextlib, io, json, time\nfrom lab_helpers.real.commands import main")
            answers = []
            for argv in questions:
                printed = run_cell(client, f"argv = {argv!r}\nstarted = time.perf_counter()\ntext = io.StringIO()\n"
                                           "with contextlib.redirect_stdout(text):\n    code = main(argv)\n"
                                           "print(json.dumps({'seconds': round(time.perf_counter() - started, 3), "
                                           "'exit': code}))")
                answers.append(json.loads(printed.strip().splitlines()[-1]))
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=True)
    return answers


def run_cell(client, code: str) -> str:
    """What a cell printed on stdout; SystemExit with the traceback where it raised."""
    message_id, printed = client.execute(code), []
    while True:
        message = client.get_iopub_msg(timeout=600)
        if message["parent_header"].get("msg_id") != message_id:
            continue
        kind, content = message["msg_type"], message["content"]
        if kind == "stream" and content["name"] == "stdout":
            printed.append(content["text"])
        elif kind == "error":
            raise SystemExit(f"fast_answers: error: a kernel cell raised {content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(printed)


def notebook_entry(env: dict, repository: Path) -> dict:
    """The ten NOTEBOOK questions in a Jupyter kernel where jupyter_client is installed, else in one
    plain process: seconds each, and whether each from the second on is within its IN_PROCESS_GOALS
    bound."""
    try:
        import jupyter_client  # noqa: F401
        where, answers = "a Jupyter kernel", in_kernel([argv for _, argv in NOTEBOOK], env, repository)
    except ImportError:
        where, answers = "one Python process", in_process([argv for _, argv in NOTEBOOK], env, repository)
    rows = []
    for number, ((kind, argv), answer) in enumerate(zip(NOTEBOOK, answers), 1):
        rows.append({"question": number, "command": " ".join(argv), **answer,
                     "goal_seconds": IN_PROCESS_GOALS[kind] if number > 1 else None,
                     "within_goal": answer["seconds"] <= IN_PROCESS_GOALS[kind] if number > 1 else None})
    return {"asked_in": where, "questions": rows, "all_within_goal": all(r["within_goal"] for r in rows[1:])}


def searches_entry(env: dict, repository: Path) -> dict:
    """The SEARCHES fits in one process: each fit's predictions and answers."""
    answers = in_process([["fit", *argv] for argv in SEARCHES], env, repository)
    return {"fits": [{"command": "fit " + " ".join(argv), **answer} for argv, answer in zip(SEARCHES, answers)]}


def exact(case: tuple, new_tokens: "int | None" = None) -> dict:
    """Each prediction of a case through the fast path and with every decode step and every layer
    traced, unbounded and under a budget just under its peak (release-and-retry, then out of memory):
    identical documents? `new_tokens` replaces the case's (a shorter full trace)."""
    from lab_helpers.real.config import load_config
    from lab_helpers.real.predict import predict_model
    from lab_helpers.real.spec import RunSpec
    from lab_helpers.real.trace_cache import TraceCache
    name, batch, context, case_tokens, degrees = case
    new_tokens = new_tokens or case_tokens
    shape, out = load_config(name), {}
    for degree in degrees:
        spec = RunSpec(name, batch=batch, context=context, new_tokens=new_tokens, decode_record_every=new_tokens,
                       tensor_parallel=degree)
        caches = {True: TraceCache(None), False: TraceCache(None)}

        def document(expand, budget=None):
            return json.dumps(predict_model(shape, spec, capacity_bytes=budget, report_out_of_memory=True,
                                            trace_cache=caches[expand], expand_decode_steps=expand), sort_keys=True)

        free = document(False)
        budget = json.loads(free)["overall"]["peak_reserved_bytes"] - 2**20
        out[f"degree {degree}"] = document(True) == free and document(True, budget) == document(False, budget)
    return out


def main(argv=None) -> int:
    parser = CommandParser(prog="fast_answers", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join([*CASES, *IN_PROCESS_CASES]),
                        help=f"comma-separated, of {', '.join([*CASES, *IN_PROCESS_CASES])} (default all)")
    parser.add_argument("--repeats", type=whole_number(1, 20), default=1, help="runs of each side (default 1)")
    parser.add_argument("--check-exact", action="store_true", help="also check the fast trace against the full one")
    parser.add_argument("--repository", default=str(ROOT), help="the checkout whose commands run (default this one)")
    parser.add_argument("--bytecode", choices=("kept", "none"), default="kept",
                        help="kept: one bytecode folder for every child, filled by an untimed run of each command "
                             "first (an installation that has run once); none: the environment as it is")
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES and n not in IN_PROCESS_CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; valid: {', '.join([*CASES, *IN_PROCESS_CASES])}")
    repository = Path(args.repository)
    with tempfile.TemporaryDirectory(prefix="fast-answers-bytecode-") as bytecode:
        return measure(args, names, repository, {"PYTHONPYCACHEPREFIX": bytecode} if args.bytecode == "kept" else {})


def measure(args, names: list, repository: Path, base: dict) -> int:
    report = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}, "bytecode": args.bytecode,
              "cases": {}}
    if base:  # compiled once, untimed: the imports, then each case's command on a throw-away cache
        timed(IMPORT_ONLY, base, repository)
        timed(MODEL_CODE_IMPORT, base, repository)
        for name in (n for n in names if n in CASES):
            with tempfile.TemporaryDirectory(prefix="fast-answers-") as folder:
                timed(["-m", "lab_helpers.real_model", *CASES[name][0]], {**base, "XDG_CACHE_HOME": folder},
                      repository)
    imports = [timed(IMPORT_ONLY, base, repository) for _ in range(max(3, args.repeats))]
    import_seconds = statistics.median(m[0] for m in imports)
    import_cpu = statistics.median(m[1] for m in imports)
    report["import_torch_transformers_seconds"] = round(import_seconds, 3)
    report["import_torch_transformers_cpu_seconds"] = round(import_cpu, 3)
    floors = [timed(MODEL_CODE_IMPORT, base, repository) for _ in range(max(3, args.repeats))]
    floor_seconds = statistics.median(m[0] for m in floors)
    report["import_model_code_seconds"] = round(floor_seconds, 3)
    report["import_model_code_ratio_to_import"] = round(floor_seconds / import_seconds, 2)
    if base and any(n in IN_PROCESS_CASES for n in names):  # their modules compiled once, untimed
        in_process([NOTEBOOK[0][1]], base, repository)
    for name in (n for n in names if n in IN_PROCESS_CASES):
        report["cases"][name] = (notebook_entry if name == "notebook" else searches_entry)(base, repository)
    for name in (n for n in names if n in CASES):
        command = ["-m", "lab_helpers.real_model", *CASES[name][0]]
        runs = {"cold": [], "warm": []}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="fast-answers-") as folder:
                runs["cold"].append(timed(command, {**base, "XDG_CACHE_HOME": folder}, repository))
                runs["warm"].append(timed(command, {**base, "XDG_CACHE_HOME": folder}, repository))
        entry = {}
        for kind, measured in runs.items():
            seconds = statistics.median(m[0] for m in measured)
            cpu = statistics.median(m[1] for m in measured)
            entry[kind] = {"seconds": round(seconds, 3), "ratio_to_import": round(seconds / import_seconds, 2),
                           "ratio_to_model_code_import": round(seconds / floor_seconds, 2),
                           # the goals bound a cold answer (a warm one imports no model code)
                           "within_goal": seconds / floor_seconds <= GOALS[name] if kind == "cold" else None,
                           "cpu_seconds": round(cpu, 3), "cpu_ratio_to_import": round(cpu / import_cpu, 2),
                           "largest_child_rss_kib_so_far": max(m[2] for m in measured)}
        if args.check_exact and CASES[name][1] is not None:
            entry["fast_equals_full_trace"] = exact(CASES[name][1])
        report["cases"][name] = {"command": " ".join(CASES[name][0]), "goal_ratio_to_model_code_import": GOALS[name],
                                 **entry}
    report["machine"]["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
