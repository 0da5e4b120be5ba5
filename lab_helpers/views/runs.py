"""Put measurement files side by side: one tidy table, grouped bars, and warm-forward throughput.

The command line (lab_helpers/views/runs_commands.py):

    python -m lab_helpers.runs mesures-h100.json mesures-h200.json [--counter peak_reserved_bytes]
    python -m lab_helpers.runs mesures-*.json --csv runs.csv     # the tidy table, to a new file
    python -m lab_helpers.runs mesures-*.json --plot runs.png    # grouped bars, to a new PNG file
"""
import io
from pathlib import Path

from lab_helpers.core.errors import LabError
from lab_helpers.core.files import csv_text, write_new_bytes, write_new_text
from lab_helpers.core.numbers import MIB
from lab_helpers.measurement.schema import read_measurement
from lab_helpers.views.plots import MISSING_PACKAGE, drawn_text, plain_texts

pd = None  # pandas, imported on first use: reading and checking the files needs only the standard library

ENVIRONMENT_COLUMNS = ("device_name", "torch_version", "cuda_build_version", "compute_capability")
# synthetic and transformers files share the phases and the environment; a column the file's kind
# does not have stays empty
CONFIGURATION_COLUMNS = ("kind", "config_name", "device", "batch", "context", "width", "hidden", "dtype",
                         "warmup", "repeats", "new_tokens", "seed")
MODEL_COLUMNS = ("parameter_count", "parameter_bytes", "forward_flops")
BYTE_COUNTERS = tuple(f"{when}_{counter}_bytes" for when in ("baseline", "end", "peak")
                      for counter in ("allocated", "reserved"))
PHASE_COLUMNS = ("phase", "index", "passes", "seconds", "device_seconds", *BYTE_COUNTERS,
                 "achieved_tflops", "host_to_device_time_ratio")
COLUMNS = ("run", *PHASE_COLUMNS, *CONFIGURATION_COLUMNS, *MODEL_COLUMNS, *ENVIRONMENT_COLUMNS)
INT_COLUMNS = ("index", "passes", *BYTE_COUNTERS, "batch", "context", "width", "hidden", "warmup",
               "repeats", "new_tokens", "seed", *MODEL_COLUMNS)
THROUGHPUT_COLUMNS = ("run", "index", "device_name", "dtype", "batch", "context", "width", "hidden",
                      "forward_flops", "seconds", "device_seconds", "achieved_tflops",
                      "host_to_device_time_ratio")
WARM_FORWARD = "warm_forward"
TERA = 1e12

class RunsError(LabError):
    """A file that cannot be read as a measurement, or a refused output: one line, exit 2."""


def _require_pandas():
    global pd
    if pd is None:
        try:
            import pandas
        except ImportError:
            raise RunsError(MISSING_PACKAGE.format(name="pandas")) from None
        pd = pandas
    return pd


def read_runs(paths) -> list:
    """[(run name, document)] for the files, each read and validated by read_measurement (synthetic or
    transformers); the run is named after the file's stem, which must be unique."""
    documents, seen = [], set()
    for path in map(Path, paths):
        if path.stem in seen:
            raise RunsError(f"two files are named {path.stem!r}; rename one, the run is named after the file")
        seen.add(path.stem)
        document = read_measurement(path)
        if "ranks" in document:  # a tensor-parallel file: its phases are per rank
            raise RunsError(f"{path}: a tensor-parallel measurement (phases per rank); runs compares one-GPU "
                            "files; set its ranks beside their prediction with: python -m "
                            "lab_helpers.mesure_memoire compare FILE")
        documents.append((path.stem, document))
    return documents


def load_runs(paths, documents=None) -> "pd.DataFrame":
    """Return one row per phase record of every file, with its run (file stem), configuration and environment.
    `documents` (from read_runs) saves reading the files again."""
    _require_pandas()
    records = []
    for stem, document in documents if documents is not None else read_runs(paths):
        configuration = document["configuration"]
        model = document.get("synthetic_model") or document.get("model") or {}
        shared = {"run": stem,
                  **{k: configuration.get(k) for k in CONFIGURATION_COLUMNS},
                  "kind": configuration.get("kind", "synthetic"),
                  **{k: model.get(k) for k in MODEL_COLUMNS},
                  **{k: document["environment"].get(k) for k in ENVIRONMENT_COLUMNS}}
        records += [{**shared, **{k: phase.get(k) for k in PHASE_COLUMNS}} for phase in document["phases"]]
    frame = pd.DataFrame.from_records(records, columns=list(COLUMNS))
    frame = frame.astype({column: "Int64" for column in INT_COLUMNS})
    return frame.astype({"achieved_tflops": "float64", "host_to_device_time_ratio": "float64"})


def run_phase_labels(df: "pd.DataFrame") -> "pd.Series":
    """Label each record by its phase, with the repeat index for warm forwards: 'warm_forward #0'."""
    _require_pandas()
    return df["phase"] + df["index"].map(lambda i: "" if pd.isna(i) else f" #{i}")


def plot_runs(df: "pd.DataFrame", counter: str = "peak_allocated_bytes", ax=None):
    """Grouped bars: for each phase, one bar per run of `counter` in MiB, labelled; return the Axes."""
    table = memory_table(df, counter)
    if ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=(9, 4))[1]
    width = 0.8 / max(len(table.columns), 1)
    for i, run in enumerate(table.columns):
        positions = [x + (i - (len(table.columns) - 1) / 2) * width for x in range(len(table))]
        bars = ax.bar(positions, table[run].astype("float64") / MIB, width, label=drawn_text(run))
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    plain_texts(ax.set_xticks(range(len(table)), [drawn_text(label) for label in table.index], rotation=30,
                              ha="right"))
    ax.set(ylabel=f"{counter.replace('_bytes', '').replace('_', ' ')} (MiB)", title="Runs side by side, per phase")
    plain_texts(ax.legend().get_texts())
    return ax


def throughput_table(df: "pd.DataFrame") -> "pd.DataFrame":
    """One row per warm forward: network FLOPs, TFLOP/s from the device time, host/device time ratio."""
    warm = df[df["phase"] == WARM_FORWARD].reset_index(drop=True)
    table = warm[list(THROUGHPUT_COLUMNS)].copy()
    table["achieved_tflops"] = warm["forward_flops"].astype("float64") / warm["device_seconds"] / TERA
    table["host_to_device_time_ratio"] = warm["seconds"] / warm["device_seconds"]
    return table


def memory_table(df: "pd.DataFrame", counter: str = "peak_allocated_bytes") -> "pd.DataFrame":
    """`counter` in bytes per phase (rows) and run (columns), phases in measured order."""
    if counter not in BYTE_COUNTERS:
        raise RunsError(f"counter must be one of {', '.join(BYTE_COUNTERS)}, got {counter!r}")
    table = df.assign(phase_label=run_phase_labels(df)).pivot(index="phase_label", columns="run", values=counter)
    return table.reindex(index=list(dict.fromkeys(run_phase_labels(df))), columns=list(dict.fromkeys(df["run"])))


def runs_csv_text(df) -> str:
    """The tidy table as CSV text: numbers stay numbers, empty cells are empty, and no text cell can
    start a spreadsheet formula (mesure_memoire.csv_text)."""
    cells = df.astype(object).where(df.notna(), None)
    return csv_text(list(df.columns), cells.itertuples(index=False, name=None))


def write_new_csv(df, path) -> None:
    """Write `df` to `path` whole or not at all; refuse if `path` exists."""
    write_new_text(path, runs_csv_text(df))


def write_new_plot(df, path, counter: str = "peak_allocated_bytes") -> None:
    """Draw plot_runs into a new PNG file at `path`, whole or not at all; refuse if `path` exists."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no display needed
    except ImportError:
        raise RunsError(MISSING_PACKAGE.format(name="matplotlib")) from None
    figure = Figure(figsize=(9, 4))
    plot_runs(df, counter, ax=figure.subplots())
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    write_new_bytes(path, buffer.getvalue())


def runs_report(df: "pd.DataFrame", counter: str = "peak_allocated_bytes") -> str:
    """What the runs command prints: one line per run (environment and sizes), `counter` per phase and
    run, and the warm-forward throughput."""
    runs = df.drop_duplicates("run").set_index("run")
    with pd.option_context("display.width", 200, "display.max_columns", None):
        return "\n".join([
            runs[[*ENVIRONMENT_COLUMNS, "kind", "batch", "context", "width", "hidden", "dtype"]].to_string(),
            f"\n{counter} per phase:",
            memory_table(df, counter).to_string(),
            "\nwarm forward throughput:",
            throughput_table(df).to_string(index=False, float_format=lambda v: f"{v:.6g}"),
        ])
