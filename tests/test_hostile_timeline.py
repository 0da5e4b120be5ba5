"""Hostile input for the timeline program (plot, explain, convert, summary) and the runs plot.

Each case runs the program as a subprocess in an empty folder that holds only the bad file: exit 2,
one line on stderr naming the fault, no traceback, nothing on stdout, nothing created. Each bounded
case (text matplotlib would parse, too much to draw) ends in a plot: exit 0, the PNG written, at
most one note on stderr. What a plot draws is counted on its artists, never timed.
"""
import copy
import json
import os
import pickle
import struct
import subprocess
import sys

import pytest

from conftest import ROOT, run_main_in_process
from lab_helpers.allocator.history import OOM_SNAPSHOT_KIND, timeline_from_snapshot
from lab_helpers.views import timeline as tl
from test_runs import measurement
from test_timeline import MiB, oom_snapshot, three_segments, traced_snapshot

TIMEOUT_S = 120  # generous: the suite must pass on a machine under load


def good_timeline() -> dict:
    snapshot, marks = traced_snapshot()
    return timeline_from_snapshot(snapshot, marks)


def changed(change):
    document = copy.deepcopy(good_timeline())
    change(document)
    return json.dumps(document).encode()


def setting(*keys_and_value):
    *keys, value = keys_and_value

    def change(document):
        target = document
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return change


def removing(*keys):
    def change(document):
        target = document
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return change


def events(column, values):
    return setting("events", column, values)


def lab_oom(**changes) -> bytes:
    document = {"kind": OOM_SNAPSHOT_KIND, "schema_version": 1, "device": "cuda:0",
                "failed_request_bytes": 12 * MiB, "device_free_bytes": 6 * MiB,
                "snapshot": {"segments": three_segments(), "device_traces": []}}
    document.update(changes)
    return json.dumps(document).encode()


def deep_list(depth):
    top = cursor = []
    for _ in range(depth):
        cursor.append([])
        cursor = cursor[0]
    return top


def tuple_bomb(levels=80, as_set=False) -> bytes:
    """A pickle of a few hundred bytes: t[i] = (t[i-1], t[i-1]) through the memo, then t[-1] used as a
    dict key (or set item): hashing it visits 2**levels tuples."""
    data = b"\x80\x04)\x94"
    for i in range(1, levels):
        data += b"h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"\x86\x94"
    if as_set:
        return data + b"\x8f(h" + bytes([levels - 1]) + b"\x90."
    return data + b"}h" + bytes([levels - 1]) + b"Ns."


def snapshot_pickle(change) -> bytes:
    snapshot = oom_snapshot()
    change(snapshot)
    return pickle.dumps(snapshot, protocol=4)


def shared_blocks(snapshot):
    segment = snapshot["segments"][0]
    block = segment["blocks"][0]
    segment["blocks"] = [block] * 10_000
    segment["total_size"] = block["size"] * 10_000
    snapshot["segments"] = [segment] * 1_000


class _System:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


PHASES_101K = {"phases": [{"name": "p", "index": None, "start_us": i, "end_us": i} for i in range(100_001)]}
DEEP_EXTRA = {"extra": deep_list(40)}
TL = "t.json"
PLOT = ["plot", TL, "--output", "o.png"]

# (id, program, argv, {file name: bytes}, fragment of the one line)
CASES = [
    # the document and its keys
    ("device-missing", "timeline", PLOT, {TL: changed(removing("device"))}, "'device'"),
    ("device-an-int", "timeline", PLOT, {TL: changed(setting("device", 0))}, "'device'"),
    ("device-a-list", "timeline", PLOT, {TL: changed(setting("device", ["cuda:0"]))}, "'device'"),
    ("device-null", "timeline", PLOT, {TL: changed(setting("device", None))}, "'device'"),
    ("device-empty", "timeline", PLOT, {TL: changed(setting("device", ""))}, "'device'"),
    ("device-1000-chars", "timeline", PLOT, {TL: changed(setting("device", "c" * 1000))}, "'device'"),
    ("kind-missing", "timeline", PLOT, {TL: changed(removing("kind"))}, "not an iteragpu-lab timeline"),
    ("document-a-list", "timeline", PLOT, {TL: b"[1, 2]"}, "not an iteragpu-lab timeline"),
    ("document-a-string", "timeline", PLOT, {TL: b'"timeline"'}, "not an iteragpu-lab timeline"),
    ("schema-version-true", "timeline", PLOT, {TL: changed(setting("schema_version", True))}, "schema_version"),
    ("schema-version-string", "timeline", PLOT, {TL: changed(setting("schema_version", "1"))}, "schema_version"),
    ("schema-version-2", "timeline", PLOT, {TL: changed(setting("schema_version", 2))}, "schema_version"),
    ("actions-missing", "timeline", PLOT, {TL: changed(removing("actions"))}, "'actions'"),
    ("initial-allocated-negative", "timeline", PLOT, {TL: changed(setting("initial_allocated_bytes", -1))},
     "initial_allocated_bytes"),
    ("initial-allocated-float", "timeline", PLOT, {TL: changed(setting("initial_allocated_bytes", 1.5))},
     "initial_allocated_bytes"),
    ("initial-reserved-string", "timeline", PLOT, {TL: changed(setting("initial_reserved_bytes", "0"))},
     "initial_reserved_bytes"),
    ("initial-allocated-2**64", "timeline", PLOT, {TL: changed(setting("initial_allocated_bytes", 2**64))},
     "initial_allocated_bytes"),
    ("time-origin-missing", "timeline", PLOT, {TL: changed(removing("time_origin_us"))}, "time_origin_us"),
    ("events-missing", "timeline", PLOT, {TL: changed(removing("events"))}, "'events'"),
    ("events-a-list", "timeline", PLOT, {TL: changed(setting("events", []))}, "'events'"),
    ("phases-missing", "timeline", PLOT, {TL: changed(removing("phases"))}, "'phases'"),
    ("phases-an-object", "timeline", PLOT, {TL: changed(setting("phases", {}))}, "'phases'"),
    ("phase-a-string", "timeline", PLOT, {TL: changed(setting("phases", 0, "model_load"))}, "phase 0 has no name"),
    ("phase-name-an-int", "timeline", PLOT, {TL: changed(setting("phases", 0, "name", 7))}, "phase 0 has no name"),
    ("phase-name-missing", "timeline", PLOT, {TL: changed(removing("phases", 0, "name"))}, "phase 0 has no name"),
    ("phase-index-negative", "timeline", PLOT, {TL: changed(setting("phases", 1, "index", -1))}, "index"),
    ("phase-index-string", "timeline", PLOT, {TL: changed(setting("phases", 1, "index", "0"))}, "index"),
    ("phase-start-after-end", "timeline", PLOT, {TL: changed(setting("phases", 0, "start_us", 99))},
     "start_us <= end_us"),
    ("phase-start-float", "timeline", PLOT, {TL: changed(setting("phases", 0, "start_us", 0.5))}, "start_us"),
    ("phase-end-2**70", "timeline", PLOT, {TL: changed(setting("phases", 1, "end_us", 2**70))}, "start_us"),
    ("phases-overlap", "timeline", PLOT, {TL: changed(setting("phases", 1, "start_us", 3))}, "starts before"),
    ("phases-over-the-bound", "timeline", PLOT, {TL: changed(lambda d: d.update(PHASES_101K))}, "at most 100000"),
    # the event columns
    ("column-missing", "timeline", PLOT, {TL: changed(removing("events", "time_us"))}, "'time_us'"),
    ("column-an-object", "timeline", PLOT, {TL: changed(events("action", {"0": 1}))}, "'action'"),
    ("columns-unequal", "timeline", PLOT, {TL: changed(events("size_bytes", [512]))}, "'size_bytes' has 1"),
    ("column-with-null", "timeline", PLOT, {TL: changed(events("phase", [0] * 7 + [None]))}, "whole numbers"),
    ("column-of-floats", "timeline", PLOT, {TL: changed(events("size_bytes", [1.0] * 8))}, "whole numbers"),
    ("column-of-bools", "timeline", PLOT, {TL: changed(events("phase", [True] * 8))}, "whole numbers"),
    ("column-ints-and-a-bool", "timeline", PLOT, {TL: changed(events("phase", [0] * 7 + [True]))},
     "whole numbers"),
    ("column-of-strings", "timeline", PLOT, {TL: changed(events("address", ["0x1"] * 8))}, "whole numbers"),
    ("column-nested", "timeline", PLOT, {TL: changed(events("phase", [[0]] * 8))}, "whole numbers"),
    ("column-ragged", "timeline", PLOT, {TL: changed(events("phase", [[0], [0, 1]] * 4))}, "whole numbers"),
    ("size-2**63", "timeline", PLOT, {TL: changed(setting("events", "size_bytes", 1, 2**63))}, "whole numbers"),
    ("address-2**64", "timeline", PLOT, {TL: changed(setting("events", "address", 1, 2**64 + 1))},
     "whole numbers"),
    ("time-negative", "timeline", PLOT, {TL: changed(setting("events", "time_us", 0, -5))}, "time_us is negative"),
    ("time-backwards", "timeline", PLOT, {TL: changed(setting("events", "time_us", 2, 1))}, "goes backwards"),
    ("action-unknown", "timeline", PLOT, {TL: changed(setting("events", "action", 1, 17))}, "action code"),
    ("action-negative", "timeline", PLOT, {TL: changed(setting("events", "action", 1, -1))}, "action code"),
    ("phase-out-of-range", "timeline", PLOT, {TL: changed(setting("events", "phase", 1, 99))}, "phase is not"),
    ("free-more-than-allocated", "timeline", PLOT, {TL: changed(setting("events", "size_bytes", 3, 40 * MiB))},
     "below zero"),
    ("sizes-past-2**62", "timeline", PLOT, {TL: changed(setting("initial_allocated_bytes", 2**62 + 1))}, "2**62"),
    ("label-not-a-list", "timeline", PLOT, {TL: changed(events("label", "weights"))}, "'label'"),
    ("label-too-short", "timeline", PLOT, {TL: changed(events("label", ["w"]))}, "'label'"),
    ("label-an-int", "timeline", PLOT, {TL: changed(events("label", [3] * 8))}, "'label'"),
    ("frames-not-a-list", "timeline", PLOT, {TL: changed(events("frames", 5))}, "'frames'"),
    ("frames-of-ints", "timeline", PLOT, {TL: changed(events("frames", [[1]] * 8))}, "'frames'"),
    ("ooms-an-object", "timeline", PLOT, {TL: changed(setting("ooms", {}))}, "'ooms'"),
    ("oom-without-size", "timeline", PLOT, {TL: changed(setting("ooms", [{"time_us": 1}]))}, "'ooms'"),
    # the file itself
    ("json-nested-40-deep", "timeline", PLOT, {TL: changed(lambda d: d.update(DEEP_EXTRA))}, "nested deeper"),
    ("json-nan", "timeline", PLOT, {TL: changed(setting("extra", 1)).replace(b'"extra": 1', b'"extra": NaN')},
     "not valid JSON"),
    ("json-infinity", "timeline", PLOT, {TL: changed(setting("initial_reserved_bytes", 1)).replace(
        b'"initial_reserved_bytes": 1', b'"initial_reserved_bytes": Infinity')}, "not valid JSON"),
    ("json-lone-surrogate", "timeline", PLOT, {TL: changed(setting("phases", 0, "name", "\ud800"))},
     "lone surrogate"),
    ("not-utf8", "timeline", PLOT, {TL: b'{"kind": "\xff"}'}, "not UTF-8"),
    ("empty-file", "timeline", PLOT, {TL: b""}, "not valid JSON"),
    ("truncated-json", "timeline", PLOT, {TL: changed(lambda d: None)[:200]}, "not valid JSON"),
    ("utf16-json", "timeline", PLOT, {TL: json.dumps(good_timeline()).encode("utf-16")}, "not UTF-8"),
    ("file-over-max-file-bytes", "timeline", [*PLOT, "--max-file-bytes", "100"], {TL: changed(lambda d: None)},
     "100 bytes"),
    ("output-exists", "timeline", PLOT, {TL: changed(lambda d: None), "o.png": b"mine"}, "already exists"),
    ("output-folder-missing", "timeline", ["plot", TL, "--output", "nowhere/o.png"], {TL: changed(lambda d: None)},
     "folder does not exist"),
    ("summary-device-missing", "timeline", ["summary", TL], {TL: changed(removing("device"))}, "'device'"),
    ("summary-phase-index-string", "timeline", ["summary", TL], {TL: changed(setting("phases", 1, "index", "0"))},
     "index"),
    # the flags
    ("max-file-bytes-1e12", "timeline", [*PLOT, "--max-file-bytes", "1e12"], {TL: b"{}"}, "--max-file-bytes"),
    ("max-file-bytes-10**12", "timeline", [*PLOT, "--max-file-bytes", str(10**12)], {TL: b"{}"}, "at most"),
    ("max-file-bytes-1e30", "timeline", [*PLOT, "--max-file-bytes", "1e30"], {TL: b"{}"}, "--max-file-bytes"),
    ("max-file-bytes-10**30", "timeline", [*PLOT, "--max-file-bytes", str(10**30)], {TL: b"{}"}, "at most"),
    ("max-file-bytes-5000-digits", "timeline", [*PLOT, "--max-file-bytes", "9" * 5000], {TL: b"{}"},
     "--max-file-bytes"),
    ("max-file-bytes-zero", "timeline", [*PLOT, "--max-file-bytes", "0"], {TL: b"{}"}, "--max-file-bytes"),
    ("max-file-bytes-negative", "timeline", [*PLOT, "--max-file-bytes", "-1"], {TL: b"{}"}, "--max-file-bytes"),
    ("explain-max-file-bytes-10**12", "timeline", ["explain", "s.pickle", "--max-file-bytes", str(10**12)],
     {"s.pickle": b"\x80\x04N."}, "at most"),
    ("top-a-million", "timeline", [*PLOT, "--top", "1000000"], {TL: b"{}"}, "--top"),
    ("top-negative", "timeline", [*PLOT, "--top", "-1"], {TL: b"{}"}, "--top"),
    ("bins-zero", "timeline", [*PLOT, "--bins", "0"], {TL: b"{}"}, "--bins"),
    ("bins-10**12", "timeline", [*PLOT, "--bins", str(10**12)], {TL: b"{}"}, "--bins"),
    ("bins-exponent", "timeline", [*PLOT, "--bins", "1e3"], {TL: b"{}"}, "--bins"),
    ("bins-fullwidth-digit", "timeline", [*PLOT, "--bins", "\uff12"], {TL: b"{}"}, "--bins"),
    ("failed-request-2**63", "timeline", ["explain", "s.pickle", "--failed-request-bytes", str(2**63)],
     {"s.pickle": b"\x80\x04N."}, "--failed-request-bytes"),
    ("convert-device-2**40", "timeline", ["convert", "s.pickle", "--output", "t2.json", "--device", str(2**40)],
     {"s.pickle": b"\x80\x04N."}, "--device"),
    # pickles: bounded work, plain data only
    ("pickle-tuple-key-memo-bomb", "timeline", ["explain", "s.pickle"], {"s.pickle": tuple_bomb()},
     "container as a key"),
    ("pickle-frozenset-memo-bomb", "timeline", ["explain", "s.pickle"], {"s.pickle": tuple_bomb(as_set=True)},
     "container as a key"),
    ("pickle-memo-index-2**32", "timeline", ["explain", "s.pickle"],
     {"s.pickle": b"\x80\x04N\x94r" + struct.pack("<I", 2**32 - 1) + b"."}, "memo index"),
    ("pickle-shared-blocks", "timeline", ["explain", "s.pickle"], {"s.pickle": snapshot_pickle(shared_blocks)},
     "same object"),
    ("pickle-deep-stream", "timeline", ["explain", "s.pickle"],
     {"s.pickle": snapshot_pickle(lambda s: s["segments"][0].update(stream=deep_list(400)))}, "'stream'"),
    ("pickle-deep-trace-stream", "timeline", ["explain", "s.pickle"],
     {"s.pickle": snapshot_pickle(lambda s: s["device_traces"][0][0].update(stream=deep_list(400)))}, "'stream'"),
    ("pickle-state-a-list", "timeline", ["explain", "s.pickle"],
     {"s.pickle": snapshot_pickle(lambda s: s["segments"][0]["blocks"][0].update(state=deep_list(300)))},
     "'state'"),
    ("pickle-nested-100k", "timeline", ["explain", "s.pickle"],
     {"s.pickle": b"\x80\x04" + b"]" * 100_001 + b"a" * 100_000 + b"."}, "pickle"),
    ("pickle-reduce-on-data", "timeline", ["explain", "s.pickle"], {"s.pickle": b"\x80\x04N)R."}, "REDUCE"),
    ("pickle-build-on-data", "timeline", ["explain", "s.pickle"], {"s.pickle": b"\x80\x04}}b."}, "BUILD"),
    ("pickle-os-system", "timeline", ["explain", "s.pickle"],
     {"s.pickle": pickle.dumps({"segments": [], "x": _System()}, protocol=4)}, "refusing"),
    ("pickle-device-a-string", "timeline", ["explain", "s.pickle"],
     {"s.pickle": snapshot_pickle(lambda s: s["segments"][0].update(device="0"))}, "'device'"),
    ("pickle-addr-a-float", "timeline", ["convert", "s.pickle", "--output", "t2.json"],
     {"s.pickle": snapshot_pickle(lambda s: s["device_traces"][0][0].update(addr=1.5))}, "'addr'"),
    ("convert-phases-deep", "timeline", ["convert", "s.pickle", "--output", "t2.json", "--phases", "m.json"],
     {"s.pickle": snapshot_pickle(lambda s: None), "m.json": json.dumps(deep_list(50)).encode()}, "nested deeper"),
    ("convert-phases-not-a-list", "timeline", ["convert", "s.pickle", "--output", "t2.json", "--phases", "m.json"],
     {"s.pickle": snapshot_pickle(lambda s: None), "m.json": b"{}"}, "list of phase marks"),
    # the lab's out-of-memory JSON
    ("oom-json-stream-a-list", "timeline", ["explain", "o.json"],
     {"o.json": lab_oom(snapshot={"segments": [{**three_segments()[0], "stream": [0]}]})}, "'stream'"),
    ("oom-json-action-an-int", "timeline", ["explain", "o.json"],
     {"o.json": lab_oom(snapshot={"segments": [], "device_traces": [[{"action": 3, "size": 1}]]})}, "'action'"),
    ("oom-json-request-a-string", "timeline", ["explain", "o.json"], {"o.json": lab_oom(failed_request_bytes="12")},
     "failed_request_bytes"),
    ("oom-json-snapshot-a-list", "timeline", ["explain", "o.json"], {"o.json": lab_oom(snapshot=[])}, "not a dict"),
    ("oom-json-nested-deep", "timeline", ["explain", "o.json"], {"o.json": lab_oom(extra=deep_list(60))},
     "nested deeper"),
]


def snapshot_of(folder) -> list:
    return sorted((p.name, p.read_bytes()) for p in folder.iterdir())


SUBPROCESS_EVERY = 12  # one row in twelve also runs as a fresh `python -m` (the rest in-process)


def in_process_main(program):
    from lab_helpers.views.runs_commands import main as runs_main
    from lab_helpers.views.sweep_commands import main as sweep_main
    from lab_helpers.views.timeline_commands import main as timeline_main
    return {"timeline": timeline_main, "runs": runs_main, "sweep": sweep_main}[program]


def run_program(program, argv, folder, in_process=False):
    if in_process:
        return run_main_in_process(in_process_main(program), argv, folder)
    # the package under test, wherever the checkout is; the folder itself holds only the bad files
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", f"lab_helpers.{program}", *argv], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_the_table_is_large_and_its_ids_unique():
    ids = [case[0] for case in CASES]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_hostile_input_is_refused_in_one_line(case, tmp_path):
    _, program, argv, files, fragment = case
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    before = snapshot_of(tmp_path)
    in_process = CASES.index(case) % SUBPROCESS_EVERY != 0
    done = run_program(program, argv, tmp_path, in_process=in_process)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"{program}: error: ")
    assert fragment in done.stderr
    assert str(tmp_path) not in done.stderr  # no path the user did not type
    assert snapshot_of(tmp_path) == before  # nothing created, nothing changed


# ------------------------------------------------------------------ bounded: drawn, with a note
def many_phases(count):
    def change(document):
        document["phases"] = [{"name": f"p{i}", "index": i, "start_us": 2 * i, "end_us": 2 * i + 1}
                              for i in range(count)]
        document["events"]["phase"] = [-1] * len(document["events"]["phase"])
    return change


def many_labels(count):
    def change(document):
        document["events"] = {"time_us": list(range(count)), "action": [tl.ALLOC] * count,
                              "address": [i * 4096 for i in range(count)], "size_bytes": [MiB] * count,
                              "phase": [-1] * count, "label": [f"L{i}" for i in range(count)]}
    return change


MATH = (r"$\frac{$", r"$\undefinedcmd$", "$unbalanced", r"a$b$c$", r"\$x\$")
BOUNDED = [
    # (id, the change to a good timeline, a fragment of the note or None for no note)
    ("mathtext-phase-names", lambda d: [p.update(name=name) for p, name in zip(d["phases"], MATH)], None),
    ("mathtext-labels", events("label", list(MATH) + [r"$\sqrt{$"] * 3), None),
    ("mathtext-device", setting("device", r"$\frac{$"), None),
    ("control-characters-in-a-name", setting("phases", 0, "name", "a\nb\x1b[31mc\x00"), None),
    ("a-million-character-name", setting("phases", 0, "name", "x" * 1_000_000), "names cut"),
    ("5000-phases", many_phases(5000), "4960 of 5000 phases"),
    ("2000-labels", many_labels(2000), "1976 of 2000 labels"),
    ("times-near-2**62", lambda d: d["events"].update(time_us=[t * 2**56 for t in d["events"]["time_us"]]), None),
]


@pytest.mark.parametrize("case", BOUNDED, ids=[case[0] for case in BOUNDED])
def test_bounded_input_is_drawn_with_a_note(case, tmp_path):
    name, change, note = case
    (tmp_path / TL).write_bytes(changed(change))
    # a fresh `python -m` for the first row and for the inputs that once hung the plot (a name of a
    # million characters, thousands of phases or labels, times near 2**62), its timeout a hang guard;
    # the mathtext and control-character rows, which crashed rather than hung, run in this process
    fresh = case is BOUNDED[0] or note is not None or name == "times-near-2**62"
    done = run_program("timeline", PLOT, tmp_path, in_process=not fresh)
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if note is None:
        assert done.stderr == ""
    else:
        assert done.stderr.startswith("timeline: note: ") and done.stderr.count("\n") == 1, done.stderr
        assert note in done.stderr


def drawn(change):
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    figure = Figure()
    FigureCanvasAgg(figure)
    document = json.loads(changed(change))
    left_out = []
    ax = tl.plot_timeline(document, ax=figure.add_subplot(), left_out=left_out)
    figure.canvas.draw()  # mathtext is parsed at draw time
    return ax, left_out


def test_5000_phases_draw_at_most_the_bound_of_lines_names_and_peaks():
    ax, left_out = drawn(many_phases(5000))
    names = [t for t in ax.texts if t.get_rotation() == 90]
    assert len(names) == tl.MAX_DRAWN_PHASES
    assert len(ax.lines) <= 2 * tl.MAX_DRAWN_PHASES + 1  # a boundary and a peak marker each, and reserved
    assert any("4960 of 5000 phases" in note for note in left_out)


def test_2000_labels_draw_at_most_the_bound_of_bands_and_legend_entries():
    ax, left_out = drawn(many_labels(2000))
    assert len(ax.collections) <= tl.MAX_LABEL_BANDS + 8 + 1  # labels, --top's default, "other"
    assert len(ax.get_legend().get_texts()) <= tl.MAX_LABEL_BANDS + 8 + 2
    assert any("1976 of 2000 labels" in note for note in left_out)


def test_a_million_character_name_is_drawn_cut():
    ax, left_out = drawn(setting("phases", 0, "name", "x" * 1_000_000))
    assert max(len(t.get_text()) for t in ax.texts) <= tl.MAX_DRAWN_CHARS + 10
    assert any("cut to" in note for note in left_out)


def test_mathtext_is_drawn_as_typed():
    ax, _ = drawn(lambda d: [p.update(name=name) for p, name in zip(d["phases"], MATH)])
    shown = {t.get_text() for t in ax.texts}
    assert r"\$\frac{\$" in shown  # escaped: matplotlib shows it as typed, '$' included


def test_runs_plot_draws_a_file_named_in_mathtext(tmp_path):
    name = r"$\frac{$.json"
    (tmp_path / name).write_text(json.dumps(measurement("mesures-h100")))
    # in-process: mathtext in a file name crashed the plot, it did not hang it; the table's fresh
    # rows cover the fresh process
    done = run_program("runs", [name, "--plot", "o.png"], tmp_path, in_process=True)
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
