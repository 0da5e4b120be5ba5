"""Progress on a terminal's stderr and nothing elsewhere: the stage line of a step without steps, the
card's bar over its GPU models, and a real command under a pseudo-terminal."""
import io
import json
import os
import pty
import subprocess
import sys
import types

from conftest import ROOT
from lab_helpers.pricing.card import load_card
from lab_helpers.real import card_fit, progress, train_card
from lab_helpers.real.config import parse_config
from lab_helpers.real.progress import stage
from lab_helpers.real.spec import RunSpec

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 128}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_stage_is_one_line_on_a_terminal_erased_when_it_ends(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.setattr(sys, "stderr", Terminal())
    with stage("reading tiny"):
        assert sys.stderr.getvalue() == "reading tiny..."
    assert sys.stderr.getvalue() == "reading tiny...\r\x1b[K"


def test_a_stage_writes_nothing_piped_or_in_a_notebook(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with stage("reading tiny"):
        pass
    assert sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    with stage("reading tiny"):
        pass
    assert sys.stderr.getvalue() == ""


def recorded_bars(monkeypatch, module):
    bars = []

    def progress_bar(total=None, desc="", unit="step", iterable=None):
        bars.append({"total": total, "desc": desc, "unit": unit, "items": list(iterable)})
        return iter(bars[-1]["items"])
    monkeypatch.setattr(module, "progress_bar", progress_bar)
    return bars


def test_the_card_shows_a_bar_over_its_gpu_models(monkeypatch):
    bars = recorded_bars(monkeypatch, card_fit)
    rows = load_card(ROOT / "data" / "tarifs-forfaits.csv")
    shape = parse_config(TINY, "tiny")
    answer = card_fit.cheapest_forfaits(shape, RunSpec("tiny", batch=1, context=8, new_tokens=2), 7, rows,
                                        fits=lambda degree, budget: {"fits": True, "peak_reserved_bytes": 1,
                                                                     "peak_allocated_bytes": 1})
    models = sorted({row["model_id"] for row in rows})
    assert [(b["total"], b["desc"], b["unit"]) for b in bars] == [(len(models), "card: GPU models", "GPU model")]
    assert sorted(gpu for gpu, _ in bars[0]["items"]) == models == sorted(r["gpu"] for r in answer["rows"])


def test_the_training_card_shows_a_bar_over_its_gpu_models(monkeypatch):
    from lab_helpers.real.train import TrainSpec
    bars = recorded_bars(monkeypatch, train_card)
    rows = load_card(ROOT / "data" / "tarifs-forfaits.csv")
    shape = parse_config(TINY, "tiny")
    train_card.cheapest_training_forfaits(shape, TrainSpec("tiny", batch=1, context=8), 7, rows,
                                          fits=lambda degree, budget: {"fits": True, "peak_reserved_bytes": 1,
                                                                       "peak_allocated_bytes": 1})
    assert [(b["total"], b["desc"]) for b in bars] == [(len({r["model_id"] for r in rows}), "card: GPU models")]


def test_a_bar_counts_with_a_space_before_its_unit(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with progress.progress_bar(None, "fit tiny", "prediction") as bar:
        assert bar.unit == " prediction"


def run_with_stderr(argv, terminal: bool, cwd):
    """(exit status, stdout, what reached stderr) of real_model, stderr a pseudo-terminal or a pipe."""
    command = [sys.executable, "-m", "lab_helpers.real_model", *argv]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(cwd / "cache")}
    if not terminal:
        proc = subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)
        return proc.returncode, proc.stdout, proc.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(command, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    out = proc.communicate(timeout=600)[0]
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed: everything was read
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    return proc.returncode, out, seen.decode()


def test_a_command_shows_its_stage_on_a_terminal_and_nothing_through_a_pipe(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    argv = ["predict", "--config", str(config), "--batch", "1", "--context", "8", "--new-tokens", "2"]
    code, out, err = run_with_stderr(argv, True, tmp_path)
    assert code == 0 and json.loads(out)["phases"]
    assert "reading tiny with torch and transformers (seconds on a first question)...\r\x1b[K" in err, err
    code, piped_out, err = run_with_stderr(argv, False, tmp_path)
    assert code == 0 and err == "" and json.loads(piped_out) == json.loads(out)
