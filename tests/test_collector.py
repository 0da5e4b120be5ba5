"""The collector while a command loads its libraries (lab_helpers.core.collector): paused and set back
in any process, frozen only in a command-line process, and the same documents either way."""
import gc
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_main_in_process
from lab_helpers.core.collector import loading_libraries
from lab_helpers.real.commands import main


@pytest.mark.parametrize("enabled", [True, False])
def test_the_pause_sets_the_collector_back_as_it_was_and_freezes_nothing_in_a_test_process(enabled):
    was, frozen = gc.isenabled(), gc.get_freeze_count()
    (gc.enable if enabled else gc.disable)()
    try:
        with loading_libraries():
            assert not gc.isenabled()
            held = [[] for _ in range(1000)]
        assert gc.isenabled() is enabled
        assert gc.get_freeze_count() == frozen
        with pytest.raises(KeyError):
            with loading_libraries():
                raise KeyError("an import that failed")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    del held


PROCESS = r"""
import gc, json, sys
from lab_helpers.core.collector import before_exit, for_this_process, loading_libraries
for_this_process()
with loading_libraries():
    paused = not gc.isenabled()
    kept = [[] for _ in range(1000)]
after_block = gc.get_freeze_count()
made_after = [[] for _ in range(1000)]
before_exit()
print(json.dumps({"paused": paused, "enabled": gc.isenabled(), "after_block": after_block,
                  "at_exit": gc.get_freeze_count()}))
"""


def test_a_command_line_process_freezes_what_its_libraries_made_then_everything_before_exit():
    proc = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout)
    assert state["paused"] and state["enabled"]
    assert state["after_block"] >= 1000  # the block's lists at least
    assert state["at_exit"] >= state["after_block"] + 1000


def test_the_command_line_prints_the_document_a_call_in_this_process_prints(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                  "vocab_size": 1000, "max_position_embeddings": 4096}))
    argv = ["predict", "--config", str(config), "--batch", "2", "--context", "16", "--new-tokens", "5", "--no-cache"]
    # the process's own command line (main() with no argv), its collector frozen as it ends
    script = ("import gc, sys; from lab_helpers.real.commands import main; code = main(); "
              "print(gc.get_freeze_count(), file=sys.stderr); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stderr.strip().splitlines()[-1]) > 10000  # torch's and transformers' objects
    here = run_main_in_process(main, argv, tmp_path)
    assert here.returncode == 0, here.stderr
    assert proc.stdout == here.stdout
