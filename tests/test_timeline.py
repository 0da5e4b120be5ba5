"""Timeline conversion, plot and out-of-memory explainer, on snapshots built by hand in torch's format."""
import importlib.util
import json
import os
import pickle
import struct
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from lab_helpers.allocator.history import OOM_SNAPSHOT_KIND, now_us, timeline_from_snapshot
from lab_helpers.core.errors import LabError
from lab_helpers.synthetic.network import MeasureConfig
from lab_helpers.synthetic.predict import predict
from lab_helpers.views import explain
from lab_helpers.views import timeline as tl
from lab_helpers.views.timeline_commands import build_parser, main

MiB = 2**20
BASE = 0x7F0000000000


def block(address, size, state):
    return {"address": address, "size": size, "requested_size": size if state != "inactive" else 0,
            "state": state, "frames": []}


def segment(address, blocks, segment_type="large", stream=0):
    out, at = [], address
    for size, state in blocks:
        out.append(block(at, size, state))
        at += size
    total = sum(size for size, _ in blocks)
    return {"device": 0, "address": address, "total_size": total, "stream": stream,
            "segment_type": segment_type, "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
            "allocated_size": sum(s for s, st in blocks if st == "active_allocated"),
            "active_size": sum(s for s, st in blocks if st != "inactive"), "blocks": out}


def three_segments():
    """Large S1 (free 12 MiB, largest 8 MiB at its end), large S2 (free 10, largest 5), small S3 wholly free."""
    return [
        segment(BASE, [(6 * MiB, "active_allocated"), (4 * MiB, "inactive"), (2 * MiB, "active_allocated"),
                       (8 * MiB, "inactive")]),
        segment(BASE + 0x2000000, [(5 * MiB, "inactive"), (30 * MiB, "active_allocated"), (5 * MiB, "inactive")]),
        segment(BASE + 0x10000000, [(2 * MiB, "inactive")], segment_type="small"),
    ]


def oom_snapshot(request=12 * MiB, device_free=6 * MiB):
    trace = [{"action": "oom", "device_free": device_free, "size": request, "stream": 0,
              "time_us": 1_700_000_000_000_000, "frames": []}]
    return {"segments": three_segments(), "device_traces": [trace], "allocator_settings": {},
            "external_annotations": []}


# ------------------------------------------------------------------ explainer numbers
def test_explain_exact_numbers_and_fragmentation():
    r = explain.explain_snapshot(oom_snapshot())
    assert r["request_bytes"] == r["rounded_request_bytes"] == 12 * MiB
    assert r["pool"] == "large" and r["segment_bytes_needed"] == 12 * MiB
    assert r["device_free_bytes"] == 6 * MiB  # from the oom entry
    assert r["reserved_bytes"] == 62 * MiB
    assert r["allocated_bytes"] == 38 * MiB
    assert r["reserved_free_bytes"] == 24 * MiB
    assert r["largest_free_block_bytes"] == 8 * MiB
    assert r["usable_free_bytes"] == 22 * MiB  # the small segment cannot serve a large request
    assert r["usable_largest_free_block_bytes"] == 8 * MiB
    assert [(s["free_bytes"], s["largest_free_block_bytes"], s["total_size_bytes"]) for s in r["segments"]] == [
        (12 * MiB, 8 * MiB, 20 * MiB), (10 * MiB, 5 * MiB, 40 * MiB), (2 * MiB, 2 * MiB, 2 * MiB)]
    assert r["verdict"] == "fragmentation"
    # expandable: 8 MiB tail + one 20 MiB page, but 6 MiB free and no whole page in an inner hole
    assert r["expandable_segments"]["largest_tail_free_bytes"] == 8 * MiB
    assert r["expandable_segments"]["page_bytes"] == 20 * MiB
    assert r["expandable_segments"]["device_bytes_to_map"] == 20 * MiB
    assert r["expandable_segments"]["unmappable_free_page_bytes"] == 0
    assert r["expandable_segments"]["would_fit"] is False
    assert r["available_bytes"] == 6 * MiB and r["process_limit_bytes"] is None
    # empty_cache: only the wholly free 2 MiB segment goes back; 8 MiB free < the 12 MiB segment
    assert r["empty_cache"]["released_bytes"] == 2 * MiB
    assert r["empty_cache"]["device_free_after_bytes"] == 8 * MiB
    assert r["empty_cache"]["free_bytes_left_in_partly_used_segments"] == 22 * MiB
    assert r["empty_cache"]["would_fit"] is False
    assert any("FRAGMENTATION" in line for line in r["summary"])


def test_explain_exhaustion():
    r = explain.explain_snapshot(oom_snapshot(), failed_request_bytes=40 * MiB, device_free_bytes=6 * MiB)
    assert r["verdict"] == "exhaustion"  # 22 MiB usable + 6 MiB device < 40 MiB
    assert r["segment_bytes_needed"] == 40 * MiB
    assert r["expandable_segments"]["device_bytes_to_map"] == 40 * MiB
    assert r["expandable_segments"]["would_fit"] is False


def test_explain_request_rounding_pool_and_fit():
    r = explain.explain_snapshot(oom_snapshot(), failed_request_bytes=600_001, device_free_bytes=0)
    assert r["rounded_request_bytes"] == 600_064 and r["pool"] == "small"
    assert r["usable_free_bytes"] == 2 * MiB and r["verdict"] == "fits_now"
    assert explain.explain_snapshot(oom_snapshot(), 7 * MiB, 0)["verdict"] == "fits_now"
    r = explain.explain_snapshot(oom_snapshot(), failed_request_bytes=9 * MiB, device_free_bytes=10 * MiB)
    assert r["segment_bytes_needed"] == 20 * MiB and r["verdict"] == "segment_size"
    assert r["expandable_segments"]["device_bytes_to_map"] == 20 * MiB  # 8 MiB tail + one page
    assert r["expandable_segments"]["would_fit"] is False  # 10 MiB free < one 20 MiB page
    r = explain.explain_snapshot(oom_snapshot(), failed_request_bytes=9 * MiB, device_free_bytes=20 * MiB)
    assert r["expandable_segments"]["would_fit"] is True
    r = explain.explain_snapshot({"segments": three_segments()}, failed_request_bytes=30 * MiB)
    assert r["device_free_bytes"] is None and r["verdict"] == "undetermined"
    with pytest.raises(tl.TimelineError, match="no failed request"):
        explain.explain_snapshot({"segments": three_segments()})


# ------------------------------------------------------------------ conversion
def traced_snapshot():
    t0 = 1_700_000_000_000_000
    e = lambda action, addr, size, dt: {"action": action, "addr": addr, "size": size, "stream": 0,  # noqa: E731
                                        "time_us": t0 + dt, "frames": []}
    a, b, c, d = BASE, BASE + 4 * MiB, BASE + 12 * MiB, BASE + 13 * MiB
    trace = [e("segment_alloc", BASE, 20 * MiB, 0), e("alloc", a, 4 * MiB, 10), e("alloc", b, 8 * MiB, 20),
             e("free_requested", a, 4 * MiB, 30), e("free_completed", a, 4 * MiB, 31),
             e("alloc", a, 2 * MiB, 40), e("alloc", c, 6 * MiB, 45), e("free_completed", c, 6 * MiB, 50),
             e("snapshot", 0, 0, 55), e("alloc", d, MiB - 500, 70)]  # rounds up to 1 MiB
    # at the end: a 2 MiB, b 8 MiB, d 1 MiB and a 3 MiB tensor made before the trace began
    seg = segment(BASE, [(2 * MiB, "active_allocated"), (2 * MiB, "inactive"), (8 * MiB, "active_allocated"),
                         (MiB, "active_allocated"), (3 * MiB, "active_allocated"), (4 * MiB, "inactive")])
    marks = [("model_load", None, t0, t0 + 25), ("warm_forward", 0, t0 + 26, t0 + 60)]
    return {"segments": [seg], "device_traces": [trace]}, marks


def test_conversion_columns_and_exact_phase_peaks():
    snapshot, marks = traced_snapshot()
    t = timeline_from_snapshot(snapshot, marks, labels={BASE + 4 * MiB: "weights"})
    ev = t["events"]
    assert ev["time_us"] == [0, 10, 20, 30, 40, 45, 50, 70]
    assert ev["action"] == [tl.SEGMENT_ALLOC, tl.ALLOC, tl.ALLOC, tl.FREE, tl.ALLOC, tl.ALLOC, tl.FREE, tl.ALLOC]
    assert ev["phase"] == [0, 0, 0, 1, 1, 1, 1, -1]
    assert ev["label"] == [None, None, "weights", None, None, None, None, None]
    assert ev["size_bytes"][-1] == MiB
    assert t["initial_allocated_bytes"] == 3 * MiB and t["initial_reserved_bytes"] == 0
    peaks = tl.phase_peaks(t)
    assert [(p["start_allocated_bytes"], p["peak_allocated_bytes"], p["peak_time_us"], p["end_allocated_bytes"])
            for p in peaks] == [(3 * MiB, 15 * MiB, 20, 15 * MiB), (15 * MiB, 19 * MiB, 45, 13 * MiB)]
    assert [p["peak_reserved_bytes"] for p in peaks] == [20 * MiB, 20 * MiB]
    assert t["phases"][1] == {"name": "warm_forward", "index": 0, "start_us": 26, "end_us": 60}


def test_conversion_refuses_bad_marks_and_traces():
    snapshot, marks = traced_snapshot()
    with pytest.raises(LabError, match="starts before"):
        timeline_from_snapshot(snapshot, [marks[1], marks[0]])
    with pytest.raises(LabError, match="not \\(name"):
        timeline_from_snapshot(snapshot, [("x", 0, 1)])
    del snapshot["device_traces"][0][2]["time_us"]
    with pytest.raises(LabError, match="time_us"):
        timeline_from_snapshot(snapshot, marks)


def test_recorder_says_unavailable_without_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the unavailable path does not apply")
    for call in (lambda: tl.record_history(torch, "cuda:0", 1000), lambda: tl.stop_history(torch, "cuda:0"),
                 lambda: tl.capture_oom_snapshot(torch, "never.json", 1024)):
        with pytest.raises(tl.TimelineError, match="unavailable"):
            call()
    assert not os.path.exists("never.json")


# ------------------------------------------------------------------ command line
def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err):
    assert code == 2, err
    assert err.startswith("timeline: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_plot_writes_png_exclusively(tmp_path, capsys):
    snapshot, marks = traced_snapshot()
    source = tmp_path / "t.json"
    source.write_text(json.dumps(timeline_from_snapshot(snapshot, marks)))
    png = tmp_path / "t.png"
    code, out, err = run_cli(capsys, "plot", source, "--output", png)
    assert code == 0, err
    data = png.read_bytes()
    assert len(data) > 0 and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out)["png_bytes"] == len(data)
    code, out, err = run_cli(capsys, "plot", source, "--output", png)
    one_line_error(code, err)
    assert "already exists" in err and png.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.png"]  # no temporary left


def test_summary_and_convert_roundtrip(tmp_path, capsys):
    snapshot, marks = traced_snapshot()
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(snapshot, protocol=4))
    (tmp_path / "marks.json").write_text(json.dumps([list(m) for m in marks]))
    code, out, err = run_cli(capsys, "convert", tmp_path / "s.pickle", "--phases", tmp_path / "marks.json",
                             "--output", tmp_path / "t.json")
    assert code == 0, err
    assert json.loads(out)["events"] == 8
    code, out, err = run_cli(capsys, "summary", tmp_path / "t.json")
    assert code == 0, err
    assert [p["peak_allocated_bytes"] for p in json.loads(out)] == [15 * MiB, 19 * MiB]


def lab_oom_file(path, **changes):
    document = {"kind": OOM_SNAPSHOT_KIND, "schema_version": 1, "device": "cuda:0",
                "failed_request_bytes": 12 * MiB, "device_free_bytes": 6 * MiB,
                "snapshot": {"segments": three_segments(), "device_traces": []}}
    document.update(changes)
    path.write_text(json.dumps(document))
    return path


def test_explain_cli_lab_file_and_plain_pickle(tmp_path, capsys):
    code, out, err = run_cli(capsys, "explain", lab_oom_file(tmp_path / "oom.json"), "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["verdict"] == "fragmentation" and result["largest_free_block_bytes"] == 8 * MiB
    for protocol in (2, 4, 5):
        path = tmp_path / f"snap{protocol}.pickle"
        path.write_bytes(pickle.dumps(oom_snapshot(), protocol=protocol))
        code, out, err = run_cli(capsys, "explain", path)
        assert code == 0, err
        assert "FRAGMENTATION" in out and "0x7f0000000000" in out


class _RunsCommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_malicious_pickle_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "x": _RunsCommand(f"touch {marker}")}, protocol=4))
    done = subprocess.run([sys.executable, "-m", "lab_helpers.timeline", "explain", str(evil)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("timeline: error: ") and done.stderr.count("\n") == 1
    assert "refusing" in done.stderr and "system" in done.stderr
    assert not marker.exists()


def _deep_json(depth):
    return "[" * depth + "]" * depth


def _hostile_explain_inputs(tmp_path):
    good = pickle.dumps(oom_snapshot(), protocol=4)
    bad_state = oom_snapshot()
    bad_state["segments"][0]["blocks"][0]["state"] = "borrowed"
    bad_sum = oom_snapshot()
    bad_sum["segments"][0]["total_size"] += 512
    huge = oom_snapshot()
    huge["segments"][0]["total_size"] = 10**30
    string_size = oom_snapshot()
    string_size["segments"][1]["blocks"][0]["size"] = "5242880"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sparse = tmp_path / "sparse.pickle"
    with open(sparse, "wb") as handle:
        handle.truncate(tl.MAX_FILE_BYTES + 1)
    rows = {
        "empty": b"",
        "truncated pickle": good[: len(good) // 2],
        "truncated lab JSON": lab_oom_file(tmp_path / "x.json").read_bytes()[:100],
        "not ours (JSON)": json.dumps({"kind": "something else", "schema_version": 1}).encode(),
        "JSON list": b"[1, 2, 3]",
        "pickle of a list": pickle.dumps([1, 2, 3], protocol=4),
        "pickle of a string": pickle.dumps("segments", protocol=4),
        "segments not a list": pickle.dumps({"segments": {"a": 1}}, protocol=4),
        "unknown block state": pickle.dumps(bad_state, protocol=4),
        "blocks do not add up": pickle.dumps(bad_sum, protocol=4),
        "huge declared total_size": pickle.dumps(huge, protocol=4),
        "size as a string": pickle.dumps(string_size, protocol=4),
        "pickle declaring 2**62 bytes": b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"abc",
        "deep JSON nesting": _deep_json(200_000).encode(),
        "deep pickle nesting": b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b".",
        "a class instance (OrderedDict)": pickle.dumps(__import__("collections").OrderedDict(a=1), protocol=4),
        "binary garbage": os.urandom(4096).replace(b"\x80", b"\x00"),
        "UTF-16 JSON": json.dumps({"kind": OOM_SNAPSHOT_KIND}).encode("utf-16"),
        "wrong schema version": json.dumps({"kind": OOM_SNAPSHOT_KIND, "schema_version": 99}).encode(),
        "negative failed request": None,
        "oom file without request or oom entry": None,
    }
    paths = {}
    for name, data in rows.items():
        path = tmp_path / (name.replace(" ", "_").replace("*", "").replace("(", "").replace(")", "") + ".in")
        if data is not None:
            path.write_bytes(data)
        paths[name] = path
    lab_oom_file(paths["negative failed request"], failed_request_bytes=-5)
    lab_oom_file(paths["oom file without request or oom entry"], failed_request_bytes=None)
    paths.update({"a directory": tmp_path, "a FIFO": fifo, "too large (sparse)": sparse,
                  "missing file": tmp_path / "absent.pickle"})
    return paths


def test_hostile_explain_inputs_one_line_exit_2(tmp_path, capsys):
    paths = _hostile_explain_inputs(tmp_path)
    assert len(paths) >= 20
    before = sorted(p.name for p in tmp_path.iterdir())
    for name, path in paths.items():
        started = time.monotonic()
        code, out, err = run_cli(capsys, "explain", path, "--format", "json")
        assert time.monotonic() - started < 60, name  # a hang guard: each refusal takes milliseconds
        assert out == "", name
        one_line_error(code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_too_large_refused_before_reading(tmp_path, capsys, monkeypatch):
    path = tmp_path / "big.json"
    lab_oom_file(path)
    for name in ("read_json_file", "_parse_pickle"):
        monkeypatch.setattr(explain, name, lambda *a: pytest.fail("parsed a file over the limit"))
    code, out, err = run_cli(capsys, "explain", path, "--max-file-bytes", "100")
    one_line_error(code, err)
    assert "limit" in err


def _timeline_variants():
    snapshot, marks = traced_snapshot()
    good = timeline_from_snapshot(snapshot, marks)

    def variant(change):
        doc = json.loads(json.dumps(good))
        change(doc)
        return doc

    return {
        "not ours": variant(lambda d: d.update(kind="iteragpu-lab measurement")),
        "columns of unequal length": variant(lambda d: d["events"]["size_bytes"].pop()),
        "float size": variant(lambda d: d["events"]["size_bytes"].__setitem__(1, 4.5)),
        "string time": variant(lambda d: d["events"]["time_us"].__setitem__(1, "10")),
        "negative size": variant(lambda d: d["events"]["size_bytes"].__setitem__(1, -1)),
        "time goes backwards": variant(lambda d: d["events"]["time_us"].__setitem__(2, 1)),
        "free of more than allocated": variant(lambda d: d["events"]["size_bytes"].__setitem__(3, 40 * MiB)),
        "unknown action code": variant(lambda d: d["events"]["action"].__setitem__(1, 17)),
        "phase out of range": variant(lambda d: d["events"]["phase"].__setitem__(1, 5)),
        "address over int64": variant(lambda d: d["events"]["address"].__setitem__(1, 2**64 + 1)),
        "nested column": variant(lambda d: d["events"].__setitem__("phase", [[0]] * 8)),
        "events not an object": variant(lambda d: d.__setitem__("events", [])),
        "overlapping phases": variant(lambda d: d["phases"][1].__setitem__("start_us", 3)),
        "label not a string": variant(lambda d: d["events"].__setitem__("label", [5] * 8)),
        "wrong action names": variant(lambda d: d.__setitem__("actions", ["alloc"])),
    }


def test_hostile_timelines_plot_refused_no_output(tmp_path, capsys):
    variants = _timeline_variants()
    for name, doc in variants.items():
        source = tmp_path / "in.json"
        source.write_text(json.dumps(doc))
        png = tmp_path / "out.png"
        code, out, err = run_cli(capsys, "plot", source, "--output", png)
        one_line_error(code, err)
        assert not png.exists(), name
        source.unlink()
    for argv in (["plot", tmp_path / "none.json", "--output", tmp_path / "o.png"],
                 ["plot", tmp_path, "--output", tmp_path / "o.png"],
                 ["plot", tmp_path / "x.json", "--output", tmp_path / "no-such-folder" / "o.png"],
                 ["convert", tmp_path / "none.pickle", "--output", tmp_path / "t.json"]):
        code, out, err = run_cli(capsys, *argv)
        one_line_error(code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_usage_errors_exit_2_one_line():
    for argv in (["plot", "x.json", "--output", "o.png", "--bins", "0"], ["explain"], ["frobnicate"],
                 ["explain", "x", "--format", "xml"], ["explain", "x", "--failed-request-bytes", "-3"]):
        done = subprocess.run([sys.executable, "-m", "lab_helpers.timeline", *argv], capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "error:" in done.stderr, argv


def test_help_names_every_flag():
    text = build_parser()._subparsers._group_actions[0].choices["plot"].format_help()
    for flag in ("--output", "--top", "--bins", "--max-file-bytes"):
        assert flag in text


# ------------------------------------------------------------------ scaling
def _benchmark_module():
    spec = importlib.util.spec_from_file_location("timeline_plot_bench", ROOT / "benchmarks" / "timeline_plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("events", [20_000, 100_000])
def test_a_long_timeline_is_drawn_from_a_number_of_points_its_bins_bound(events, tmp_path):
    """What keeps a long timeline's plot fast, whatever the machine: each band is drawn from at most two
    points per time bin (its highest and its last; a step plot's polygon, both edges, 8 vertices a bin),
    the reserved line likewise, however many events there are. Its seconds are
    benchmarks/timeline_plot.py's (a million events under 5 s on 2 cores), not a test's."""
    from matplotlib.figure import Figure
    bench = _benchmark_module()
    path = tmp_path / "t.json"
    path.write_text(json.dumps(bench.synthetic_timeline(events, seed=1), separators=(",", ":")))
    timeline = tl.load_timeline(path, check=False)
    for bins in (500, 2000):
        ax = tl.plot_timeline(timeline, ax=Figure().add_subplot(), bins=bins)
        vertices = [len(band.vertices) for collection in ax.collections for band in collection.get_paths()]
        reserved = [len(line.get_xdata()) for line in ax.lines if line.get_label() == "reserved"]
        assert len(vertices) >= 2 and 4 * bins < max(vertices) <= 8 * bins + 16  # bins, not events, bound it
        assert reserved and max(reserved) <= 2 * bins + 2
    assert tl.render_png(timeline)[:8] == b"\x89PNG\r\n\x1a\n"


def test_binned_plot_keeps_the_exact_peak():
    bench = _benchmark_module()
    timeline = bench.synthetic_timeline(50_000, seed=2)
    arrays = tl.check_timeline(timeline)
    peak = int(arrays["allocated"].max())
    from matplotlib.figure import Figure
    ax = Figure().add_subplot()
    tl.plot_timeline(timeline, ax=ax, bins=100)
    top = max(collection.get_paths()[0].vertices[:, 1].max() for collection in ax.collections)
    assert top == pytest.approx(peak / MiB)
    assert max(p["peak_allocated_bytes"] for p in tl.phase_peaks(timeline)) == peak


def test_plot_gives_no_band_of_its_own_to_an_allocation_under_one_percent_of_the_peak():
    snapshot, marks = traced_snapshot()  # peak 19 MiB: the 1 MiB block (5.3 %) keeps its band
    t = timeline_from_snapshot(snapshot, marks, labels={BASE + 4 * MiB: "weights"})
    from matplotlib.figure import Figure
    ax = Figure().add_subplot()
    tl.plot_timeline(t, ax=ax, top=8)
    names = [text.get_text() for text in ax.get_legend().get_texts()] if ax.get_legend() else \
        [h.get_label() for h in ax.collections]
    assert "weights" in names and any(n.startswith("1.0 MiB at ") for n in names)
    t["events"]["size_bytes"][-1] = 512  # now 0.003 % of the peak: folded into "other"
    ax = Figure().add_subplot()
    tl.plot_timeline(t, ax=ax, top=8)
    names = [h.get_label() for h in ax.collections]
    assert not any(n.startswith("0.0 MiB") for n in names) and "other" in names


@pytest.mark.gpu
def test_gpu_phase_peaks_equal_torch_counters():
    torch = pytest.importorskip("torch")
    device = "cuda:0"
    keep, marks, measured = [], [], []
    tl.record_history(torch, device, max_entries=100_000)
    try:
        for name, sizes in (("first", [3 * MiB, 5 * MiB + 100]), ("second", [20 * MiB, 700_000, 1000])):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = now_us()
            made = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
            keep.append(made[0])
            del made
            torch.cuda.synchronize(device)
            measured.append(torch.cuda.max_memory_allocated(device))
            marks.append((name, None, start, now_us()))
    finally:
        snapshot = tl.stop_history(torch, device)
    timeline = timeline_from_snapshot(snapshot, marks, device=torch.device(device).index)
    assert [p["peak_allocated_bytes"] for p in tl.phase_peaks(timeline)] == measured
    assert tl.render_png(timeline)[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ fragmentation under a process cap
def holes_snapshot():
    """The shape of pic-vs-reserve's section 9 at its failure: one 400 MiB segment cut into twenty
    20 MiB blocks, every other one freed (the last one alive), and a 40 MiB request refused."""
    blocks = [(20 * MiB, "inactive" if k % 2 == 0 else "active_allocated") for k in range(20)]
    trace = [{"action": "oom", "device_free": 100 * 2**30, "size": 40 * MiB, "stream": 0,
              "time_us": 1_700_000_000_000_000}]
    return {"segments": [segment(BASE, blocks)], "device_traces": [trace]}


def test_explain_fragmentation_under_a_process_cap():
    snapshot = holes_snapshot()
    # without the cap, the device's 100 GiB would hold a new segment: the state looks servable
    assert explain.explain_snapshot(snapshot)["verdict"] == "fits_now"
    r = explain.explain_snapshot(snapshot, process_limit_bytes=410 * MiB)
    assert (r["request_bytes"], r["reserved_bytes"], r["allocated_bytes"]) == (40 * MiB, 400 * MiB, 200 * MiB)
    assert r["reserved_free_bytes"] == 200 * MiB and r["largest_free_block_bytes"] == 20 * MiB
    assert r["segments"][0]["free_blocks"] == 10
    assert r["available_bytes"] == 10 * MiB and r["process_limit_bytes"] == 410 * MiB
    assert r["verdict"] == "fragmentation"
    assert r["empty_cache"]["released_bytes"] == 0 and r["empty_cache"]["would_fit"] is False
    es = r["expandable_segments"]
    assert (es["page_bytes"], es["largest_tail_free_bytes"], es["device_bytes_to_map"],
            es["unmappable_free_page_bytes"], es["would_fit"]) == (20 * MiB, 0, 40 * MiB, 200 * MiB, True)
    assert any("at most 429916160 bytes" in line for line in r["summary"])


# ------------------------------------------------------------------ measure --timeline (no GPU: a stand-in torch)
from lab_helpers import mesure_memoire as mm  # noqa: E402


class _Storage:
    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


class _Tensor:
    def __init__(self, address):
        self.address = address

    def untyped_storage(self):
        return _Storage(self.address)


class _Model:
    def __init__(self, addresses):
        self.addresses = addresses

    def parameters(self):
        return [_Tensor(a) for a in self.addresses]


class _FakeTorch:
    """The few torch.cuda calls HistoryRecorder and oom_snapshot_document make, recorded."""

    def __init__(self, snapshot, free_bytes=6 * MiB, total_bytes=80 * 2**30):
        torch = self
        self.calls = []

        class Memory:
            @staticmethod
            def _snapshot(device=None):
                torch.calls.append(("snapshot", device))
                return json.loads(json.dumps(snapshot))

            @staticmethod
            def _record_memory_history(**options):
                torch.calls.append(("history", options))

        class Cuda:
            memory = Memory

            @staticmethod
            def mem_get_info(device=None):
                return free_bytes, total_bytes

        self.cuda = Cuda


class _Device:
    index = 0

    def __str__(self):
        return "cuda:0"


def test_oom_snapshot_path_and_document():
    assert mm.oom_snapshot_path("runs/t.json") == "runs/t.oom.json"
    assert mm.oom_snapshot_path("t.timeline") == "t.timeline.oom.json"
    snapshot = oom_snapshot()
    snapshot["segments"][0]["blocks"][0]["frames"] = [{"name": "f", "filename": "x.py", "line": 1}]
    document = mm.oom_snapshot_document(_FakeTorch(snapshot), _Device(), 12 * MiB)
    assert {k: v for k, v in document.items() if k != "snapshot"} == {
        "kind": "iteragpu-lab oom snapshot", "schema_version": 1, "device": "cuda:0",
        "failed_request_bytes": 12 * MiB, "device_free_bytes": 6 * MiB, "device_total_bytes": 80 * 2**30}
    assert "frames" not in json.dumps(document["snapshot"])
    assert document["snapshot"]["device_traces"][0][0] == {
        "action": "oom", "device_free": 6 * MiB, "size": 12 * MiB, "stream": 0, "time_us": 1_700_000_000_000_000}
    with pytest.raises(mm.LabError, match="failed_request_bytes"):
        mm.oom_snapshot_document(_FakeTorch(snapshot), _Device(), -1)


def test_recorder_labels_weights_inputs_and_workspace():
    snapshot, marks = traced_snapshot()
    t0 = marks[0][2]
    recorder = mm.HistoryRecorder(max_entries=1000)
    torch = _FakeTorch(snapshot)
    recorder.start(torch)
    assert torch.calls[0] == ("history", {"enabled": "all", "context": None, "stacks": "python",
                                          "max_entries": 1000, "clear_history": True})
    # a cold pass from t0+26 to t0+60: `a` (2 MiB) stays, `c` is freed inside it
    for name, index, start, end in [("model_load", None, t0, t0 + 25), ("cold_forward", None, t0 + 26, t0 + 60)]:
        recorder.mark(name, index, start, end)
    assert mm.workspace_addresses(snapshot["device_traces"][0], t0 + 26, t0 + 60) == {BASE}
    state = {"model": _Model([BASE + 4 * MiB]), "x": _Tensor(BASE + 13 * MiB)}
    recorder.finish(torch, _Device(), state)
    events = recorder.timeline["events"]
    labelled = {(a, lab) for a, lab in zip(events["address"], events["label"]) if lab}
    assert labelled == {(BASE + 4 * MiB, "weights"), (BASE + 13 * MiB, "inputs"), (BASE, "workspace")}
    assert [p["peak_allocated_bytes"] for p in tl.phase_peaks(recorder.timeline)] == [15 * MiB, 19 * MiB]
    assert "frames" not in events
    recorder.stop(torch)
    assert torch.calls[-1] == ("history", {"enabled": None})


def test_recorder_with_stacks_keeps_the_innermost_frames():
    snapshot, marks = traced_snapshot()
    frames = [{"name": f"f{k}", "filename": "model.py", "line": k} for k in range(20)]
    snapshot["device_traces"][0][1]["frames"] = frames
    recorder = mm.HistoryRecorder(max_entries=10, stacks=True)
    torch = _FakeTorch(snapshot)
    recorder.start(torch)
    assert torch.calls[0][1]["context"] == "alloc" and torch.calls[0][1]["stacks"] == "all"
    recorder.marks.extend(marks)
    recorder.finish(torch, _Device(), {"model": _Model([]), "x": _Tensor(1)})
    kept = recorder.timeline["events"]["frames"]
    assert kept[1] == [f"f{k} model.py:{k}" for k in range(mm.STACK_FRAMES_KEPT)]
    assert kept[0] is None and kept[2] == []
    # a library call names the parameter; the command line says --timeline-max-entries
    with pytest.raises(mm.LabError, match="^max_entries must be > 0, got 0$"):
        mm.HistoryRecorder(max_entries=0)


def phase_error_with_snapshot(request=40 * MiB):
    error = mm.PhaseError("cold_forward", RuntimeError("CUDA out of memory. Tried to allocate 40.00 MiB"))
    snapshot = holes_snapshot()
    snapshot["device_traces"][0][0]["size"] = request
    mm.HistoryRecorder().failure(_FakeTorch(snapshot, free_bytes=0), _Device(), error)
    return error


def test_failure_attaches_the_snapshot_with_the_request_from_the_trace():
    error = phase_error_with_snapshot(request=40 * MiB + 512)
    assert error.oom_snapshot["failed_request_bytes"] == 40 * MiB + 512
    assert error.oom_snapshot["phase"] == "cold_forward" and error.oom_snapshot["device_free_bytes"] == 0
    other = mm.PhaseError("inputs", RuntimeError("CUDA error: an illegal memory access was encountered"))
    mm.HistoryRecorder().failure(_FakeTorch(holes_snapshot()), _Device(), other)
    assert other.oom_snapshot is None  # only an out-of-memory failure is explained


def test_measure_timeline_on_oom_writes_only_the_snapshot_and_explain_reads_it(tmp_path, monkeypatch, capsys):
    def failing_measure(config, history):
        assert isinstance(history, mm.HistoryRecorder) and history.stacks is False
        raise phase_error_with_snapshot()
    monkeypatch.setattr(mm, "measure", failing_measure)
    monkeypatch.chdir(tmp_path)
    assert mm.main(["measure", "--output", "m.json", "--timeline", "t.json"]) == 3
    err = capsys.readouterr().err
    assert err == ("mesure_memoire: error: phase cold_forward failed: RuntimeError: CUDA out of memory. Tried to "
                   "allocate 40.00 MiB; no file written; out-of-memory snapshot: t.oom.json\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.oom.json"]
    code, out, err = run_cli(capsys, "explain", tmp_path / "t.oom.json", "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["request_bytes"] == 40 * MiB and result["largest_free_block_bytes"] == 20 * MiB
    assert result["verdict"] == "fragmentation"  # 200 MiB free in holes of 20 MiB; 0 bytes free on the device
    code, out, err = run_cli(capsys, "explain", tmp_path / "t.oom.json")
    assert code == 0 and "41943040 bytes (40.00 MiB)" in out


def test_measure_timeline_writes_it_after_the_measurement(tmp_path, monkeypatch, capsys):
    snapshot, marks = traced_snapshot()
    order = []

    def fake_measure(config, history):
        assert history.max_entries == 5000 and history.stacks is True
        history.timeline = mm.timeline_from_snapshot(snapshot, marks)
        return {"phases": [1, 2]}
    real_write = mm.write_new_text
    monkeypatch.setattr(mm, "write_new_text", lambda path, text: (order.append(str(path)), real_write(path, text)))
    monkeypatch.setattr(mm, "measure", fake_measure)
    monkeypatch.chdir(tmp_path)
    assert mm.main(["measure", "--output", "m.json", "--timeline", "t.json", "--timeline-stacks",
                    "--timeline-max-entries", "5000"]) == 0
    assert json.loads(capsys.readouterr().out) == {"output": "m.json", "phases": 2, "timeline": "t.json",
                                                   "timeline_events": 8}
    assert order == ["m.json", "t.json"]
    assert tl.load_timeline(tmp_path / "t.json")["events"]["time_us"] == [0, 10, 20, 30, 40, 45, 50, 70]


@pytest.mark.parametrize("argv, taken, message", [
    (["--timeline", "t.json"], "t.json", "t.json already exists; choose a new file name"),
    (["--timeline", "t.json"], "t.oom.json", "t.oom.json already exists; choose a new file name"),
    (["--timeline", "m.json"], None, "--output, --failure-report, --timeline and its .oom.json must be different files"),
    (["--timeline", "f.json", "--failure-report", "f.json"], None,
     "--output, --failure-report, --timeline and its .oom.json must be different files"),
    (["--timeline", "missing/t.json"], None, "cannot write missing/t.json: its folder does not exist"),
    (["--timeline-stacks"], None, "--timeline-stacks and --timeline-max-entries need --timeline FILE"),
    (["--timeline-max-entries", "10"], None, "--timeline-stacks and --timeline-max-entries need --timeline FILE"),
])
def test_measure_timeline_paths_are_checked_before_measuring(tmp_path, monkeypatch, capsys, argv, taken, message):
    monkeypatch.setattr(mm, "measure", lambda *a: pytest.fail("measured despite a bad --timeline"))
    monkeypatch.chdir(tmp_path)
    if taken:
        (tmp_path / taken).write_text("keep")
    assert mm.main(["measure", "--output", "m.json", *argv]) == 2
    assert capsys.readouterr().err == f"mesure_memoire: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ([taken] if taken else [])


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "x", str(2**31)])
def test_measure_timeline_max_entries_refuses_bad_numbers(value, capsys):
    with pytest.raises(SystemExit) as stop:
        mm.main(["measure", "--output", "m.json", "--timeline", "t.json", "--timeline-max-entries", value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mesure_memoire: error: argument --timeline-max-entries") and err.count("\n") == 1


def test_measure_timeline_without_gpu_says_so(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    monkeypatch.chdir(tmp_path)
    assert mm.main(["measure", "--output", "m.json", "--timeline", "t.json"]) == 2
    assert "no CUDA/ROCm device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ where the bytes go
def test_predict_splits_end_allocated_by_kind():
    prediction = predict(MeasureConfig())
    split = [p["end_allocated_bytes_by_kind"] for p in prediction["phases"]]
    weights = 65536 + 1024 + 65536 + 512  # each tensor's block: the 256-byte bias takes 512
    assert split[0] == {"weights": weights, "inputs": 0, "workspace": 0, "activations": 0}
    assert split[1] == {"weights": weights, "inputs": 4096, "workspace": 0, "activations": 0}
    assert split[2] == {"weights": weights, "inputs": 4096, "workspace": 33 * MiB, "activations": 4096}
    assert split[3] == {"weights": weights, "inputs": 4096, "workspace": 33 * MiB, "activations": 0}
    for phase in prediction["phases"]:
        assert sum(phase["end_allocated_bytes_by_kind"].values()) == phase["end_allocated_bytes"]


def test_plot_bytes_by_kind_bars_and_markers():
    import matplotlib
    matplotlib.use("Agg")
    from lab_helpers.views import plots
    prediction = predict(MeasureConfig())
    measured = json.loads(json.dumps(prediction))
    measured["phases"][2]["end_allocated_bytes"] += 512
    ax = plots.plot_bytes_by_kind(prediction, measured)
    heights = [round(p.get_height() * MiB) for p in ax.patches]
    n = len(prediction["phases"])
    assert len(heights) == 5 * n  # four kinds stacked, then reserved
    assert heights[:n] == [132608] * n
    assert heights[2 * n:3 * n] == [0, 0, 33 * MiB, 33 * MiB, 33 * MiB, 33 * MiB]
    assert heights[4 * n:] == [p["end_reserved_bytes"] for p in prediction["phases"]]
    marks = {line.get_label(): [round(y * MiB) for y in line.get_ydata()] for line in ax.get_lines()}
    assert marks["measured end allocated"][2] == prediction["phases"][2]["end_allocated_bytes"] + 512
    assert marks["measured end reserved"] == [p["end_reserved_bytes"] for p in prediction["phases"]]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {
        "allocated: weights", "allocated: inputs", "allocated: workspace", "allocated: activations", "reserved",
        "measured end allocated", "measured end reserved"}
    with pytest.raises(LabError, match="end_allocated_bytes_by_kind"):
        plots.plot_bytes_by_kind({"phases": [{k: v for k, v in p.items() if k != "end_allocated_bytes_by_kind"}
                                             for p in prediction["phases"]]})
    measured["phases"].pop()
    with pytest.raises(LabError, match="phases differ"):
        plots.plot_bytes_by_kind(prediction, measured)
    bad = json.loads(json.dumps(prediction))
    bad["phases"][0]["end_allocated_bytes_by_kind"]["weights"] += 1
    with pytest.raises(LabError, match="adds up to"):
        plots.plot_bytes_by_kind(bad)


def test_a_label_names_the_last_tensor_made_at_its_address():
    snapshot, marks = traced_snapshot()
    labels = timeline_from_snapshot(snapshot, marks, labels={BASE: "workspace"})["events"]["label"]
    # BASE held a 4 MiB tensor (freed at 30 us), then the 2 MiB one made at 40 us that is still alive
    assert labels == [None, None, None, None, "workspace", None, None, None]
