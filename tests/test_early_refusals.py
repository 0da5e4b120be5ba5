"""Refusals that need no model answer before torch and transformers are imported: each case runs
real_model in a fresh Python, which then reports what it imported."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

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
for name in hidden:
    sys.modules[name] = None  # importlib.util.find_spec then finds nothing, and import fails
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


def run_child(argv, hidden, cwd):
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv), json.dumps(hidden)], cwd=cwd, env=environ,
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
