"""Tables and plots of one measurement (or prediction) per phase, in MiB.

Each function takes a document (a dict) or the path of a measurement file, read and validated by
measurement.schema.read_measurement; synthetic and transformers measurements both work (phases only).
Plots speak MiB: the allocator's segment sizes are whole MiB."""
import os

from lab_helpers.core.errors import LabError
from lab_helpers.core.numbers import MIB
from lab_helpers.core.text import printable
from lab_helpers.measurement.schema import COUNTERS, read_measurement

MISSING_PACKAGE = "{name} is not installed: run make lab (or pip install -r requirements.txt)"
POINTS = ("baseline", "end", "peak")
POINT_COLOURS = {"baseline": "#b0b0b0", "end": "#4c72b0", "peak": "#dd8452"}


MAX_DRAWN_CHARS = 40  # a longer name cannot be read on a plot, and a million characters hang the layout


def drawn_text(text, limit: int = MAX_DRAWN_CHARS) -> str:
    """A user's text as a plot may draw it: control characters escaped, at most `limit` characters
    (cut with '…'), and every '$' escaped, so that matplotlib never parses it as mathtext (a
    '$\\frac{$' in a phase name would make the whole plot fail)."""
    text = printable(str(text)[:limit + 1])
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return text.replace("$", r"\$")


def plain_texts(texts) -> None:
    """Draw these Text artists (or Ticks' labels) without LaTeX, whatever the user's matplotlibrc says (text.usetex):
    LaTeX would run on a user's text."""
    for text in texts:
        for part in (text.label1, text.label2) if hasattr(text, "label1") else (text,):  # a Tick's labels
            part.set_usetex(False)


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise LabError(MISSING_PACKAGE.format(name="matplotlib")) from None
    return plt


def _pandas():
    try:
        import pandas as pd
    except ImportError:
        raise LabError(MISSING_PACKAGE.format(name="pandas")) from None
    return pd


def _document(document) -> dict:
    """`document` itself, or the measurement file it names; a tensor-parallel one is refused in one line
    (its phases are per rank: plot one rank's with rank_view)."""
    if isinstance(document, (str, os.PathLike)):
        document = read_measurement(document)
    if "ranks" in document and "phases" not in document:
        raise LabError(f"a tensor-parallel document ({len(document['ranks'])} ranks) has phases per rank: "
                       "plot one rank, e.g. rank_view(document, 0)")
    return document


def rank_view(document, rank: int) -> dict:
    """One rank of a tensor-parallel measurement or prediction (or the file naming it), shaped as a
    one-GPU document, so that every function here draws it."""
    if isinstance(document, (str, os.PathLike)):
        document = read_measurement(document)
    ranks = document.get("ranks")
    if not isinstance(ranks, list):
        raise LabError("not a tensor-parallel document: it has no ranks (plot it as it is)")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
        raise LabError(f"rank must be a whole number from 0 to {len(ranks) - 1}, got {rank!r}")
    view = {key: value for key, value in document.items() if key != "ranks"}
    view["phases"] = ranks[rank]["phases"]
    return view


def phase_labels(phases) -> list:
    """Readable labels, one per phase record ('warm_forward #1')."""
    return [p["phase"] if p.get("index") is None else f"{p['phase']} #{p['index']}" for p in phases]


def phase_table(document):
    """One row per phase record: the six counters in MiB, and the times where measured (a DataFrame)."""
    pd = _pandas()
    phases = _document(document)["phases"]
    table = pd.DataFrame(index=pd.Index(phase_labels(phases), name="phase"))
    for counter in COUNTERS:
        for point in POINTS:
            table[f"{point}_{counter}_mib"] = [p[f"{point}_{counter}_bytes"] / MIB for p in phases]
    for key in ("seconds", "device_seconds", "achieved_tflops"):
        if any(key in p for p in phases):
            table[key] = [p.get(key) for p in phases]
    return table


def plot_phases(document, axes=None):
    """Bars of baseline, end and peak for allocated (left) and reserved (right), per phase."""
    phases = _document(document)["phases"]
    if axes is None:
        _, axes = _pyplot().subplots(1, 2, figsize=(13, 4.5), sharey=True)
    labels = [drawn_text(label) for label in phase_labels(phases)]
    width = 0.27
    for ax, counter in zip(axes, COUNTERS):
        for k, point in enumerate(POINTS):
            values = [p[f"{point}_{counter}_bytes"] / MIB for p in phases]
            xs = [i + (k - 1) * width for i in range(len(phases))]
            bars = ax.bar(xs, values, width, label=point, color=POINT_COLOURS[point])
            if point == "peak":  # small phases are invisible beside the workspace: print them
                ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        plain_texts(ax.set_xticks(range(len(phases)), labels, rotation=30, ha="right"))
        ax.set_title(f"{counter} (this process's PyTorch allocator)")
        ax.set_ylabel("MiB")
        ax.legend(title="read at (peak labelled in MiB)")
        ax.margins(y=0.1)
        ax.grid(axis="y", alpha=0.3)
    axes[0].figure.suptitle("GPU memory per phase: allocated is part of reserved; peaks are separate maxima")
    axes[0].figure.tight_layout()
    return axes


def plot_prediction(comparison, ax=None):
    """Measured against predicted peak allocated and peak reserved, per phase, in MiB."""
    if ax is None:
        _, ax = _pyplot().subplots(figsize=(12, 4.5))
    rows = comparison["rows"]
    labels = [drawn_text(label) for label in phase_labels(rows)]
    series = [("measured", "allocated", "#4c72b0"), ("predicted", "allocated", "#9ecae1"),
              ("measured", "reserved", "#dd8452"), ("predicted", "reserved", "#fdd0a2")]
    width = 0.2
    for k, (source, counter, colour) in enumerate(series):
        values = [r[f"{source}_peak_{counter}_bytes"] / MIB for r in rows]
        xs = [i + (k - 1.5) * width for i in range(len(rows))]
        ax.bar(xs, values, width, label=f"{source} peak {counter}", color=colour)
    for i, r in enumerate(rows):
        diff = r["difference_peak_allocated_bytes"]
        top = max(r[f"{source}_peak_{counter}_bytes"] for source, counter, _ in series) / MIB
        ax.annotate("exact" if diff == 0 else f"{diff:+,} B", (i, top), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8)
    plain_texts(ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right"))
    ax.set_ylabel("MiB")
    ax.set_title("Predicted vs measured peaks (above each phase: measured - predicted peak allocated)")
    ax.margins(y=0.12)
    ax.legend(ncols=2)
    ax.grid(axis="y", alpha=0.3)
    ax.figure.tight_layout()
    return ax


KIND_COLOURS = {"weights": "#4c72b0", "inputs": "#55a868", "workspace": "#8172b3", "activations": "#dd8452",
                "kv_cache": "#c44e52", "gradients": "#937860", "optimizer_states": "#da8bc3"}
BY_KIND_KEY = "end_allocated_bytes_by_kind"


def bytes_by_kind(document) -> dict:
    """Per phase label, the end allocated bytes split by kind and the end reserved bytes:
    {"labels", "kinds", "by_kind" {kind: [bytes per phase]}, "reserved" [bytes per phase]}.
    Needs a document whose phases carry ``end_allocated_bytes_by_kind``: a prediction of
    the synthetic network's predict or real_model.predict_model (adds kv_cache), or of a training
    run (adds gradients and optimizer_states; its activations are what autograd saved for backward)."""
    phases = _document(document)["phases"]
    kinds = []
    for i, p in enumerate(phases):
        split = p.get(BY_KIND_KEY)
        if not isinstance(split, dict):
            raise LabError(f"phase {i} has no {BY_KIND_KEY}: use a prediction (mesure_memoire.predict "
                           "or real_model.predict_model)")
        bad = [k for k, v in split.items() if type(v) is not int or v < 0]
        if bad:  # a negative part would draw a bar below the others and still add up
            raise LabError(f"phase {i}: {BY_KIND_KEY}[{bad[0]!r}] is {split[bad[0]]!r}, "
                           "not a whole number of bytes >= 0")
        if sum(split.values()) != p["end_allocated_bytes"]:
            raise LabError(f"phase {i}: {BY_KIND_KEY} adds up to {sum(split.values())} bytes, "
                           f"not its end_allocated_bytes {p['end_allocated_bytes']}")
        kinds += [k for k in split if k not in kinds]
    return {"labels": phase_labels(phases), "kinds": kinds,
            "by_kind": {k: [p[BY_KIND_KEY].get(k, 0) for p in phases] for k in kinds},
            "reserved": [p["end_reserved_bytes"] for p in phases]}


def plot_bytes_by_kind(prediction_or_labelled, measurement=None, ax=None):
    """Where the bytes go: per phase, end allocated as a bar stacked by kind (weights, inputs,
    workspace, activations, KV cache, gradients and optimizer states where the document has them) beside end reserved; a measurement's
    end allocated and end reserved drawn over them as markers (the same phases, in order)."""
    data = bytes_by_kind(prediction_or_labelled)
    measured = None
    if measurement is not None:
        measured = _document(measurement)["phases"]
        if phase_labels(measured) != data["labels"]:
            raise LabError("the measurement's phases differ from the prediction's: "
                           f"{len(measured)} records against {len(data['labels'])}")
    if ax is None:
        _, ax = _pyplot().subplots(figsize=(12, 4.8))
    width = 0.38
    xs = range(len(data["labels"]))
    bottom = [0] * len(data["labels"])
    for kind in data["kinds"]:
        values = [v / MIB for v in data["by_kind"][kind]]
        ax.bar([x - width / 2 for x in xs], values, width, bottom=bottom, label=f"allocated: {drawn_text(kind)}",
               color=KIND_COLOURS.get(kind))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar([x + width / 2 for x in xs], [r / MIB for r in data["reserved"]], width, label="reserved",
           color="#b0b0b0")
    if measured is not None:
        ax.plot([x - width / 2 for x in xs], [p["end_allocated_bytes"] / MIB for p in measured], "k_",
                markersize=22, markeredgewidth=2.5, linestyle="none", label="measured end allocated")
        ax.plot([x + width / 2 for x in xs], [p["end_reserved_bytes"] / MIB for p in measured], "kx",
                markersize=9, markeredgewidth=2, linestyle="none", label="measured end reserved")
    ax.set_xticks(list(xs), [drawn_text(label) for label in data["labels"]], rotation=30, ha="right")
    ax.set_ylabel("MiB")
    ax.set_title("Where the bytes go at each phase's end: predicted allocated by kind, beside reserved"
                 + ("; measured totals as markers" if measured is not None else ""))
    plain_texts(ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8).get_texts())
    plain_texts(ax.get_xticklabels())
    ax.grid(axis="y", alpha=0.3)
    ax.figure.tight_layout()
    return ax
