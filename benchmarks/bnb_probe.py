"""On a CUDA GPU with bitsandbytes: every caching-allocator event of a 4-bit (or 8-bit) model's
load and forward, with the code that asked for it.

    python benchmarks/bnb_probe.py OUT.json CONFIG LAYERS QUANT [BATCH CONTEXT NEW_TOKENS]

CONFIG is a bundled name (data/models/NAME.json), cut to LAYERS decoder layers; QUANT is nf4,
nf4-double, fp4, int8 (LLM.int8(), bitsandbytes' default outlier threshold 6.0), int8-threshold-0 (no
outlier column: the lab's --quantize int8-threshold-0) or int8-every (the
threshold at 1e-6: every column of every product's input holds an outlier, the most LLM.int8()
allocates whatever the data). A random bfloat16 checkpoint is saved with save_pretrained (CPU, before
anything touches the GPU), then loaded as users load one for QLoRA: from_pretrained with a
BitsAndBytesConfig and device_map on the GPU; then the prompt, a prefill and NEW_TOKENS decode
steps. OUT.json holds the allocator's memory history (each alloc and free with its size and up
to five frames of bitsandbytes, transformers or this file), and memory_stats' counters after each
phase."""
import json
import os
import sys
import tempfile

import torch

out_path, name, layers, quant = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
batch, context, new_tokens = (int(v) for v in (sys.argv[5:8] or (2, 128, 3)))
dev = "cuda:0"

from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, DynamicCache  # noqa: E402

root = os.path.join(os.path.dirname(__file__), "..", "data", "models")
with open(os.path.join(root, name + ".json")) as f:
    raw = json.load(f)
raw["num_hidden_layers"] = layers
if "layer_types" in raw:
    raw["layer_types"] = raw["layer_types"][:layers]
config = AutoConfig.for_model(**raw)
torch.manual_seed(0)
folder = tempfile.mkdtemp()
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
if quant == "int8":
    qc = BitsAndBytesConfig(load_in_8bit=True)
elif quant == "int8-threshold-0":
    qc = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
elif quant == "int8-every":
    qc = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=1e-6)
else:
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant.split("-")[0],
                            bnb_4bit_use_double_quant=quant.endswith("-double"),
                            bnb_4bit_compute_dtype=torch.bfloat16)
torch.cuda.set_device(0)
torch.cuda.init()
KEEP = ("bitsandbytes", "transformers", "bnb_probe")
stats = []


def counters(phase):
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    stats.append(dict(phase=phase, **{k: s[k] for k in (
        "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
        "reserved_bytes.all.peak", "requested_bytes.all.current", "allocation.all.current")}))
    torch.cuda.reset_peak_memory_stats()


torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
counters("start")
model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=qc, device_map={"": dev},
                                             dtype=torch.bfloat16, attn_implementation="sdpa").eval()
counters("model_load")
# (input columns, outlier columns) of each 8-bit product, read from the layer's state after it ran:
# no allocation, so the memory history is the run's own
outliers = []
if quant.startswith("int8"):
    import bitsandbytes as bnb  # noqa: E402
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            module.register_forward_hook(lambda m, i, o: outliers.append(
                (m.in_features, -1 if m.state.idx is None else m.state.idx.numel())))
g = torch.Generator(device=dev).manual_seed(0)
ids = torch.randint(0, config.vocab_size, (batch, context), device=dev, generator=g)
counters("inputs")
with torch.inference_mode():
    cache = DynamicCache(config=config)
    o = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = o.logits[:, -1, :].argmax(dim=-1, keepdim=True)
    del o
    counters("prefill")
    for step in range(new_tokens):
        o = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = o.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        del o
        counters(f"decode {step}")
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
events = []
for e in snap["device_traces"][0]:
    frames = [f"{os.path.basename(fr['filename'])}:{fr['line']}:{fr['name']}" for fr in e.get("frames", [])
              if any(k in fr["filename"] for k in KEEP)][:5]
    events.append([e["action"], e["addr"], e["size"], frames])
import bitsandbytes  # noqa: E402
import transformers  # noqa: E402

print(name, layers, quant, [(s["phase"], s["allocated_bytes.all.current"], s["reserved_bytes.all.current"]) for s in stats])
with open(out_path, "w") as f:
    json.dump(dict(config=name, layers=layers, quant=quant, batch=batch, context=context, new_tokens=new_tokens,
                   versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                                 bitsandbytes=bitsandbytes.__version__, cuda=torch.version.cuda,
                                 device=torch.cuda.get_device_name(0)),
                   stats=stats, events=events, outliers=outliers), f)
