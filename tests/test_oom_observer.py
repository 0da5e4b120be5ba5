"""The out-of-memory observer's file and `timeline explain` on it, with no GPU: hand-built documents of
both kinds (the observer's snapshot at the failing allocation, and the fallback taken after the
exception unwound), exact figures, PyTorch's message parsed to the precision it prints, and a table of
malformed fields (one line, exit 2). A stand-in torch plays the allocator's calls."""
import copy
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_main_in_process
from lab_helpers.allocator.history import (OBSERVER_STAT_KEYS, OOM_OBSERVER_ROUTE, OOM_SNAPSHOT_KIND, HistoryRecorder,
                                           parse_oom_message, torch_format_size)
from lab_helpers.measurement.protocol import PhaseError
from lab_helpers.views.explain import explain_document, explanation_table, load_snapshot
from lab_helpers.views.timeline_commands import main as timeline_main
from test_timeline import BASE, MiB, segment

GiB = 2**30
TOTAL = 150_118_940_672  # an H200's total as cudaMemGetInfo reports it, about 139.81 GiB
FREE = 21 * GiB
REQUEST = 22 * GiB + 1000  # rounded to 22 GiB + 1024; the segment asked for: 22 GiB + 2 MiB
SEGMENT_ASKED = 22 * GiB + 2 * MiB


def layout():
    """Two large segments, partly used: 44 GiB allocated, 26 GiB free in holes of 16 and 10 GiB."""
    return [segment(BASE, [(20 * GiB, "active_allocated"), (16 * GiB, "inactive"), (4 * GiB, "active_allocated")]),
            segment(BASE + 64 * GiB, [(10 * GiB, "inactive"), (20 * GiB, "active_allocated")])]


def stats(allocated=44 * GiB, reserved=70 * GiB, split=26 * GiB):
    figures = {key: 0 for key in OBSERVER_STAT_KEYS}
    figures.update({"allocated_bytes.all.current": allocated, "reserved_bytes.all.current": reserved,
                    "active_bytes.all.current": allocated, "inactive_split_bytes.all.current": split,
                    "inactive_split.all.current": 2, "segment.all.current": 2,
                    "allocated_bytes.large_pool.current": allocated, "reserved_bytes.large_pool.current": reserved,
                    "inactive_split_bytes.large_pool.current": split, "num_ooms": 1, "num_alloc_retries": 1})
    return figures


def message(asked="22.00 GiB", free="21.00 GiB", allocated="44.00 GiB", unallocated="26.00 GiB"):
    return (f"CUDA out of memory. Tried to allocate {asked}. GPU 0 has a total capacity of 139.81 GiB of which "
            f"{free} is free. Process 4242 has 118.81 GiB memory in use. Of the allocated memory {allocated} is "
            f"allocated by PyTorch, and {unallocated} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management")


def oom_trace(request=REQUEST, free=FREE):
    rounded = -(-request // 512) * 512
    return [{"action": "oom", "addr": None, "size": rounded, "stream": 0, "time_us": 1_700_000_000_000_000,
             "device_free": free}]


def observer_document(request=REQUEST, **changes) -> dict:
    document = {
        "kind": OOM_SNAPSHOT_KIND, "schema_version": 1, "device": "cuda:0", "snapshot_source": "observer",
        "failed_request_bytes": -(-request // 512) * 512, "device_free_bytes": FREE, "device_total_bytes": TOTAL,
        "process_limit_bytes": None,
        "observer": {"device_index": 0, "alloc_bytes": SEGMENT_ASKED if request == REQUEST else
                     -(-request // (2 * MiB)) * 2 * MiB, "device_limit_bytes": TOTAL, "device_free_bytes": FREE,
                     "stats": stats()},
        "error_message": message(), "phase": "prefill",
        "snapshot": {"segments": layout(), "device_traces": [oom_trace(request)]}}
    document.update(changes)
    return document


def after_unwinding_document() -> dict:
    """The same failure seen after unwinding: 4 GiB of the first segment's first block and its last
    4 GiB block were the failed pass's and are freed, so one 24 GiB free block now holds the request."""
    unwound = [segment(BASE, [(16 * GiB, "active_allocated"), (24 * GiB, "inactive")]), layout()[1]]
    return {"kind": OOM_SNAPSHOT_KIND, "schema_version": 1, "device": "cuda:0", "snapshot_source": "after unwinding",
            "observer": None, "observer_problem": "PyTorch's caching allocator did not call the observer for this failure",
            "failed_request_bytes": -(-REQUEST // 512) * 512, "device_free_bytes": FREE, "device_total_bytes": TOTAL,
            "error_message": message(allocated="44.00 GiB"), "phase": "prefill",
            "snapshot": {"segments": unwound, "device_traces": [oom_trace()]}}


def loaded(document, tmp_path):
    path = tmp_path / "o.oom.json"
    path.write_text(json.dumps(document))
    return load_snapshot(path)


# ------------------------------------------------------------------ PyTorch's message
def test_format_size_is_c10s():
    cases = [(0, "0 bytes"), (1024, "1024 bytes"), (1025, "1.00 KiB"), (MiB, "1024.00 KiB"), (MiB + 1, "1.00 MiB"),
             (40 * MiB, "40.00 MiB"), (GiB, "1024.00 MiB"), (GiB + 1, "1.00 GiB"), (SEGMENT_ASKED, "22.00 GiB"),
             (23_782_883_328, "22.15 GiB"), (TOTAL, "139.81 GiB"), (2**40, "1024.00 GiB")]
    assert [torch_format_size(size) for size, _ in cases] == [text for _, text in cases]


def test_the_message_is_parsed_to_its_printed_figures():
    assert parse_oom_message(message()) == {
        "tried_to_allocate": "22.00 GiB", "gpu": 0, "total_capacity": "139.81 GiB", "free": "21.00 GiB",
        "allowed": None, "allocated_by_pytorch": "44.00 GiB", "private_pools": None,
        "reserved_unallocated": "26.00 GiB"}
    capped = ("CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which "
              "139.00 GiB is free. Including non-PyTorch memory, this process has 930.00 MiB memory in use. "
              "410.00 MiB allowed; Of the allocated memory 200.00 MiB is allocated by PyTorch, with 2.00 MiB "
              "allocated in private pools (e.g., CUDA Graphs), and 200.00 MiB is reserved by PyTorch but unallocated.")
    figures = parse_oom_message(capped)
    assert (figures["allowed"], figures["private_pools"], figures["reserved_unallocated"]) == (
        "410.00 MiB", "2.00 MiB", "200.00 MiB")
    assert parse_oom_message("CUDA error: out of memory") is None and parse_oom_message(None) is None


# ------------------------------------------------------------------ the recorder and the observer
class FakeTorch:
    """The calls HistoryRecorder makes: history recording, the observer's attachment (torch._C),
    memory_stats, _snapshot and mem_get_info, all answering the fixed state of one failure."""

    def __init__(self, snapshot, figures, free=FREE, total=TOTAL, fail_stats=False):
        self.attached = []
        fake = self

        class C:
            @staticmethod
            def _cuda_attach_out_of_memory_observer(observer):
                fake.attached.append(observer)

        class Memory:
            @staticmethod
            def _snapshot(device=None):
                return copy.deepcopy(snapshot)

            @staticmethod
            def _record_memory_history(**options):
                pass

        class Cuda:
            memory = Memory

            @staticmethod
            def memory_stats(device=None):
                if fail_stats:
                    raise RuntimeError("stats unavailable")
                return dict(figures, **{"active.all.current": 7})

            @staticmethod
            def mem_get_info(device=None):
                return free, total

        self._C, self.cuda = C, Cuda


class Device:
    index = 0

    def __str__(self):
        return "cuda:0"


@pytest.fixture(autouse=True)
def fresh_route(monkeypatch):
    monkeypatch.setitem(OOM_OBSERVER_ROUTE, "attached", False)
    monkeypatch.setitem(OOM_OBSERVER_ROUTE, "recorder", None)


def failing(recorder, torch, text=None, phase_start_us=0):
    recorder.mark("prefill", None, phase_start_us, phase_start_us + 1)
    error = PhaseError("prefill", RuntimeError(text or message()))
    recorder.failure(torch, Device(), error)
    return error


def test_the_observer_keeps_the_state_at_the_failure_and_the_file_says_so():
    snapshot = {"segments": layout(), "device_traces": [oom_trace()]}
    torch = FakeTorch(snapshot, stats())
    recorder = HistoryRecorder()
    recorder.start(torch)
    assert len(torch.attached) == 1 and recorder.observer_problem is None
    torch.attached[0](0, SEGMENT_ASKED, TOTAL, FREE)  # as c10 calls it, before it raises
    error = failing(recorder, torch)
    document = error.oom_snapshot
    assert document["snapshot_source"] == "observer" and document["phase"] == "prefill"
    assert document["failed_request_bytes"] == 22 * GiB + 1024
    assert document["device_free_bytes"] == FREE and document["device_total_bytes"] == TOTAL
    assert document["process_limit_bytes"] is None
    assert document["observer"] == {"device_index": 0, "alloc_bytes": SEGMENT_ASKED, "device_limit_bytes": TOTAL,
                                    "device_free_bytes": FREE, "stats": stats()}
    assert document["error_message"] == message()
    assert "frames" not in json.dumps(document["snapshot"])  # tracebacks are dropped, the rest kept
    assert [[b["size"] for b in s["blocks"]] for s in document["snapshot"]["segments"]] == [
        [b["size"] for b in s["blocks"]] for s in snapshot["segments"]]
    assert document["snapshot"]["device_traces"] == snapshot["device_traces"]
    assert recorder.observed is None  # used once
    # a second run in the process attaches nothing more (c10 cannot detach) and gets the calls
    other = HistoryRecorder()
    other.start(torch)
    assert len(torch.attached) == 1 and OOM_OBSERVER_ROUTE["recorder"] is other
    other.stop(torch)
    torch.attached[0](0, SEGMENT_ASKED, TOTAL, FREE)  # between runs: nobody keeps it
    assert other.observed is None and recorder.observed is None


def test_a_cap_set_by_set_per_process_memory_fraction_is_the_observers_limit():
    torch = FakeTorch({"segments": layout(), "device_traces": [oom_trace()]}, stats())
    recorder = HistoryRecorder()
    recorder.start(torch)
    torch.attached[0](0, SEGMENT_ASKED, 80 * GiB, FREE)
    document = failing(recorder, torch).oom_snapshot
    assert document["process_limit_bytes"] == 80 * GiB and document["observer"]["device_limit_bytes"] == 80 * GiB


@pytest.mark.parametrize("case", ["no-call", "raising-observer", "other-request", "earlier-phase", "no-observer",
                                  "not-the-allocators-message"])
def test_without_a_matching_observer_call_the_snapshot_is_taken_after_unwinding(case):
    snapshot = {"segments": layout(), "device_traces": [oom_trace()]}
    torch = FakeTorch(snapshot, stats(), fail_stats=case == "raising-observer")
    if case == "no-observer":
        del torch._C
    recorder = HistoryRecorder()
    recorder.start(torch)
    if case in ("raising-observer", "earlier-phase"):
        torch.attached[0](0, SEGMENT_ASKED, TOTAL, FREE)  # never raises, whatever fails inside
    if case == "other-request":
        torch.attached[0](0, 2 * MiB, TOTAL, FREE)
    if case == "not-the-allocators-message":
        torch.attached[0](0, SEGMENT_ASKED, TOTAL, FREE)  # a failure caught inside the phase, then another
    start = 2**62 if case == "earlier-phase" else 0
    text = "CUDA error: out of memory" if case == "not-the-allocators-message" else message()
    document = failing(recorder, torch, text=text, phase_start_us=start).oom_snapshot
    assert document["snapshot_source"] == "after unwinding" and document["observer"] is None
    assert document["failed_request_bytes"] == 22 * GiB + 1024 and document["error_message"] == text
    assert document["observer_problem"] == {
        "no-call": "PyTorch's caching allocator did not call the observer for this failure",
        "raising-observer": "the observer failed: RuntimeError: stats unavailable",
        "other-request": "the observer's last call was for 2.00 MiB, the error's for 22.00 GiB",
        "earlier-phase": "the observer's last call was in an earlier phase",
        "no-observer": "this torch has no out-of-memory observer",
        "not-the-allocators-message": "the error is not the caching allocator's out-of-memory message; the "
                                      "observer's last call was for another failure"}[case]


def test_a_real_model_run_is_named_in_the_file():
    torch = FakeTorch({"segments": layout(), "device_traces": [oom_trace()]}, stats())
    recorder = HistoryRecorder()
    recorder.run = {"configuration": {"config_name": "tiny", "batch": 4}, "model_config": {"model_type": "llama"}}
    recorder.start(torch)
    torch.attached[0](0, SEGMENT_ASKED, TOTAL, FREE)
    assert failing(recorder, torch).oom_snapshot["run"] == recorder.run


# ------------------------------------------------------------------ explain: observer and fallback
def test_explain_on_the_observers_file_gives_fragmentation_with_the_figures_side_by_side(tmp_path):
    r = explain_document(loaded(observer_document(), tmp_path))
    assert r["snapshot_source"] == "observer"
    assert (r["request_bytes"], r["rounded_request_bytes"], r["segment_bytes_needed"], r["pool"]) == (
        22 * GiB + 1024, 22 * GiB + 1024, SEGMENT_ASKED, "large")
    assert (r["device_free_bytes"], r["allocated_bytes"], r["reserved_bytes"]) == (FREE, 44 * GiB, 70 * GiB)
    assert (r["reserved_free_bytes"], r["reserved_unallocated_bytes"], r["largest_free_block_bytes"]) == (
        26 * GiB, 26 * GiB, 16 * GiB)
    assert [(s["free_bytes"], s["largest_free_block_bytes"]) for s in r["segments"]] == [
        (16 * GiB, 16 * GiB), (10 * GiB, 10 * GiB)]
    assert r["verdict"] == "fragmentation"
    es = r["expandable_segments"]
    assert (es["largest_tail_free_bytes"], es["device_bytes_to_map"], es["unmappable_free_page_bytes"],
            es["would_fit"]) == (0, 1127 * 20 * MiB, (819 + 512) * 20 * MiB, True)
    rows = {row["figure"]: row for row in r["figures"]}
    assert [(row["message"], row["observer_bytes"], row["explainer_bytes"], row["agree"]) for row in r["figures"]] == [
        ("22.00 GiB", SEGMENT_ASKED, SEGMENT_ASKED, True), ("139.81 GiB", TOTAL, TOTAL, True),
        ("21.00 GiB", FREE, FREE, True), ("44.00 GiB", 44 * GiB, 44 * GiB, True),
        ("26.00 GiB", 26 * GiB, 26 * GiB, True), (None, 70 * GiB, 70 * GiB, True), (None, 26 * GiB, 26 * GiB, True)]
    assert rows["free on the device"]["printed"] == "21.00 GiB" and r["figures_agree"] is True
    assert r["message_verdict"] == "fragmentation"
    text = explanation_table(r)
    assert "PyTorch's out-of-memory observer at the failing allocation" in text
    assert "Verdict: FRAGMENTATION" in text and "agree" in text
    assert "roughly, free bytes + reserved but free >= the rounded request" in text
    assert "27917287424 bytes (26.00 GiB) in 2 of 2 segments" in text


def test_explain_on_the_observers_file_gives_exhaustion():
    document = observer_document(request=60 * GiB)
    document["error_message"] = message(asked="60.00 GiB")
    r = explain_document(loaded_dict(document))
    assert r["verdict"] == "exhaustion" and r["message_verdict"] == "exhaustion"  # 26 + 21 GiB < 60 GiB
    assert r["expandable_segments"]["would_fit"] is False and r["figures_agree"] is True


def loaded_dict(document):
    return {key: document.get(key) for key in ("snapshot", "failed_request_bytes", "device_free_bytes",
                                               "process_limit_bytes", "device_total_bytes", "snapshot_source",
                                               "observer", "observer_problem", "error_message", "phase", "run")}


def test_a_figure_that_does_not_match_the_message_is_flagged():
    document = observer_document()
    document["error_message"] = message(allocated="44.01 GiB")
    r = explain_document(loaded_dict(document))
    assert [row["agree"] for row in r["figures"]][3] is False and r["figures_agree"] is False
    assert any("DISAGREE" in line for line in r["summary"])


def test_explain_on_the_fallback_file_says_the_snapshot_is_late_and_reads_the_message(tmp_path):
    r = explain_document(loaded(after_unwinding_document(), tmp_path))
    assert r["snapshot_source"] == "after unwinding" and r["verdict"] == "fits_now"  # the late snapshot's view
    assert r["allocated_bytes"] == 36 * GiB and r["largest_free_block_bytes"] == 24 * GiB
    rows = {row["figure"]: row for row in r["figures"]}
    assert rows["allocated by PyTorch"]["message"] == "44.00 GiB"
    assert rows["allocated by PyTorch"]["observer_bytes"] is None
    assert rows["allocated by PyTorch"]["explainer_bytes"] == 36 * GiB and rows["allocated by PyTorch"]["agree"] is False
    assert r["message_verdict"] == "fragmentation"  # 22 GiB asked, 21 free, 26 reserved but unallocated
    text = "\n".join(r["summary"])
    assert "taken after the exception unwound (PyTorch's caching allocator did not call the observer" in text
    assert "From PyTorch's message alone (its rounded figures, every pool): FRAGMENTATION." in text


def test_explain_cli_prints_the_figures_and_json(tmp_path):
    (tmp_path / "o.oom.json").write_text(json.dumps(observer_document()))
    done = run_main_in_process(timeline_main, ["explain", "o.oom.json"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "allocated by PyTorch" in done.stdout and "47244640256" in done.stdout
    done = run_main_in_process(timeline_main, ["explain", "o.oom.json", "--format", "json"], tmp_path)
    result = json.loads(done.stdout)
    assert result["snapshot_source"] == "observer" and result["figures_agree"] is True
    assert result["verdict"] == "fragmentation"


def test_older_files_without_the_new_fields_still_explain(tmp_path):
    document = observer_document()
    for key in ("snapshot_source", "observer", "error_message", "phase", "device_total_bytes"):
        del document[key]
    r = explain_document(loaded(document, tmp_path))
    assert r["snapshot_source"] is None and r["verdict"] == "fragmentation"
    assert r["message_figures"] is None and r["message_verdict"] is None
    assert r["figures"] == [] and r["figures_agree"] is None  # nothing to set beside the snapshot


# ------------------------------------------------------------------ malformed new fields: one line, exit 2
def changed(**changes):
    document = observer_document()
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".", 1)
            if inner.startswith("stats."):
                document[outer]["stats"][inner[len("stats."):]] = value
            else:
                document[outer][inner] = value
        else:
            document[key] = value
    return document


def without_stat(key):
    document = observer_document()
    del document["observer"]["stats"][key]
    return document


RUN = {"configuration": {"config_name": "tiny", "dtype": "bfloat16", "batch": 2, "context": 16, "new_tokens": 1},
       "model_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                        "vocab_size": 128, "max_position_embeddings": 64}}


def run_with(**configuration):
    run = copy.deepcopy(RUN)
    run["configuration"].update(configuration)
    return run


FIT = ["--predict-fit"]
SUBPROCESS_EVERY = 24
HOSTILE = [
    # (id, the document, extra flags, a fragment of the one line)
    ("source-unknown", changed(snapshot_source="observed"), [], "snapshot_source must be one of"),
    ("source-an-int", changed(snapshot_source=1), [], "snapshot_source must be one of"),
    ("observer-source-without-observer", changed(observer=None), [], "'observer' is not an object"),
    ("observer-a-list", changed(observer=[1]), [], "'observer' is not an object"),
    ("observer-with-fallback-source", changed(snapshot_source="after unwinding"), [], "needs snapshot_source"),
    ("alloc-a-string", changed(**{"observer.alloc_bytes": "1"}), [], "observer 'alloc_bytes'"),
    ("alloc-negative", changed(**{"observer.alloc_bytes": -1}), [], "observer 'alloc_bytes'"),
    ("alloc-a-bool", changed(**{"observer.alloc_bytes": True}), [], "observer 'alloc_bytes'"),
    ("alloc-past-int64", changed(**{"observer.alloc_bytes": 2**63}), [], "observer 'alloc_bytes'"),
    ("device-index-a-float", changed(**{"observer.device_index": 0.5}), [], "observer 'device_index'"),
    ("limit-missing", changed(observer={k: v for k, v in observer_document()["observer"].items()
                                        if k != "device_limit_bytes"}), [], "observer 'device_limit_bytes'"),
    ("observer-free-null", changed(**{"observer.device_free_bytes": None}), [], "observer 'device_free_bytes'"),
    ("stats-a-list", changed(**{"observer.stats": [1, 2]}), [], "observer 'stats'"),
    ("stats-missing-allocated", without_stat("allocated_bytes.all.current"), [], "'allocated_bytes.all.current'"),
    ("stats-extra-key", changed(**{"observer.stats.peak.all": 1}), [], "does not record"),
    ("stats-a-float", changed(**{"observer.stats.reserved_bytes.all.current": 1.5}), [], "'reserved_bytes.all.current'"),
    ("stats-allocated-above-reserved", changed(**{"observer.stats.allocated_bytes.all.current": 71 * GiB}), [],
     "allocated is larger than reserved"),
    ("free-differs-from-observer", changed(device_free_bytes=FREE + 512), [], "differs from the observer"),
    ("total-a-float", changed(device_total_bytes=1.5), [], "device_total_bytes"),
    ("limit-negative", changed(process_limit_bytes=-1), [], "process_limit_bytes"),
    ("message-an-int", changed(error_message=3), [], "error_message must be a string"),
    ("message-too-long", changed(error_message="x" * 2001), [], "error_message must be a string"),
    ("problem-a-list", changed(observer_problem=["x"]), [], "observer_problem must be a string"),
    ("phase-an-object", changed(phase={}), [], "phase must be a string"),
    ("run-a-list", changed(run=[]), [], "run must be an object"),
    ("run-without-model-config", changed(run={"configuration": {}}), [], "run must be an object"),
    ("fit-without-run", observer_document(), FIT, "needs the run the file names"),
    ("fit-batch-zero", changed(run=run_with(batch=0)), FIT, "--batch must be a whole number"),
    ("fit-batch-a-string", changed(run=run_with(batch="2")), FIT, "--batch must be a whole number"),
    ("fit-dtype-unknown", changed(run=run_with(dtype="int3")), FIT, "--dtype must be one of"),
    ("fit-name-missing", changed(run=run_with(config_name=None)), FIT, "config_name"),
    ("fit-tensor-parallel", changed(run=run_with(tensor_parallel=2)), FIT, "tensor-parallel"),
    ("fit-config-bad", changed(run={**RUN, "model_config": {"model_type": 3}}), FIT, "the file's run: "),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_malformed_new_fields_are_refused_in_one_line(case, tmp_path):
    _, document, flags, fragment = case
    (tmp_path / "o.json").write_text(json.dumps(document))
    before = sorted(p.name for p in tmp_path.iterdir())
    if HOSTILE.index(case) % SUBPROCESS_EVERY == 0:  # a sample as a fresh `python -m`, the rest in-process
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "lab_helpers.timeline", "explain", "o.json", *flags],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    else:
        done = run_main_in_process(timeline_main, ["explain", "o.json", *flags], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("timeline: error: "), done.stderr
    assert fragment in done.stderr, done.stderr
    assert str(tmp_path) not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_hostile_ids_are_unique():
    assert len({case[0] for case in HOSTILE}) == len(HOSTILE) >= 30


def test_predict_fit_searches_the_run_under_the_failures_budget(tmp_path):
    pytest.importorskip("transformers")
    from lab_helpers.real.config import parse_config
    from lab_helpers.real.fit import fit_model
    document = observer_document()
    document["snapshot"] = {"segments": [segment(BASE, [(20 * MiB, "active_allocated"), (12 * MiB, "inactive"),
                                                        (8 * MiB, "active_allocated")])],
                            "device_traces": [oom_trace(request=30 * MiB, free=10 * MiB)]}
    document.update(failed_request_bytes=30 * MiB, device_free_bytes=10 * MiB, run=RUN,
                    error_message=message("30.00 MiB", "10.00 MiB", "28.00 MiB", "12.00 MiB"))
    document["observer"].update(alloc_bytes=30 * MiB, device_free_bytes=10 * MiB,
                                stats=stats(allocated=28 * MiB, reserved=40 * MiB, split=12 * MiB))
    (tmp_path / "o.oom.json").write_text(json.dumps(document))
    done = run_main_in_process(timeline_main, ["explain", "o.oom.json", "--predict-fit", "--format", "json"], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    prediction = result["fit_prediction"]
    assert prediction["budget_bytes"] == 50 * MiB  # reserved 40 MiB + 10 MiB free on the device
    assert prediction["label"] == "prediction (real_model fit's search on the meta device), not a measurement"
    assert result["figures_agree"] is True and result["verdict"] == "exhaustion"
    want = fit_model(parse_config(RUN["model_config"], "tiny"), "bfloat16", 1, 50 * MiB, "x", batch=2, context=16)
    assert (prediction["fits"], prediction["largest_batch_at_context"], prediction["largest_context_at_batch"]) == (
        want["fits"], want["largest_batch_at_context"], want["largest_context_at_batch"])
    assert any(line.startswith("PREDICTION, not a measurement") for line in result["summary"])


# Measured on an H200 (torch 2.11.0+cu130): 100 GiB allocated in segments of 20, 40 and 40 GiB (a wholly
# free 20 GiB segment already released by the allocator's retry), then a 45 GiB request. The observer
# was called as (0, 48318382080, 150109880320, 42183294976): its third argument is the device's total.
H200_MESSAGE = ("CUDA out of memory. Tried to allocate 45.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
                "39.29 GiB is free. Including non-PyTorch memory, this process has 100.51 GiB memory in use. Of the "
                "allocated memory 100.00 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but "
                "unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
                "Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-"
                "with-pytorch-cuda-alloc-conf)")


def test_the_h200s_measured_observer_call_and_message_agree_and_say_exhaustion(tmp_path):
    total, free, asked = 150_109_880_320, 42_183_294_976, 48_318_382_080
    segments = [segment(BASE + k * 64 * GiB, [(size, "active_allocated")]) for k, size in enumerate((20, 40, 40))]
    for s, size in zip(segments, (20, 40, 40)):
        s["blocks"][0]["size"] = s["total_size"] = size * GiB
    torch = FakeTorch({"segments": segments, "device_traces": [oom_trace(request=asked, free=free)]},
                      stats(allocated=100 * GiB, reserved=100 * GiB, split=0), free=free, total=total)
    recorder = HistoryRecorder()
    recorder.start(torch)
    torch.attached[0](0, asked, total, free)
    document = failing(recorder, torch, text=H200_MESSAGE).oom_snapshot
    assert document["snapshot_source"] == "observer" and document["process_limit_bytes"] is None
    r = explain_document(loaded(document, tmp_path))
    assert [(row["message"], row["observer_bytes"], row["agree"]) for row in r["figures"][:5]] == [
        ("45.00 GiB", asked, True), ("139.80 GiB", total, True), ("39.29 GiB", free, True),
        ("100.00 GiB", 100 * GiB, True), ("0 bytes", 0, True)]
    assert r["verdict"] == r["message_verdict"] == "exhaustion" and r["figures_agree"] is True
    assert r["expandable_segments"]["would_fit"] is False  # 39.29 GiB free < 45 GiB, no free page anywhere


def test_an_observer_snapshot_with_room_says_the_refusal_had_another_cause():
    document = observer_document(request=10 * GiB)  # a 16 GiB hole would hold it
    document["error_message"] = message(asked="10.00 GiB")
    r = explain_document(loaded_dict(document))
    assert r["verdict"] == "fits_now"
    assert any(line.startswith("The observer's snapshot has room for the request, yet") for line in r["summary"])
