"""On a CUDA GPU: what attention allocates, as the tracer's model of it was measured.

    python benchmarks/sdpa_probe.py OUT_FOLDER [FAMILY:BATCH:CONTEXT ...]     (from the repository root)

For each point (a family's bundled shape cut to 2-4 layers, bf16, 4 new tokens), the run of
lab_helpers.real.protocol.measure_model with the allocator's history recorded: every alloc and free
with its top Python frames, and for every scaled_dot_product_attention call its arguments, the
backend torch._fused_sdp_choice picks (3 is cuDNN attention) and what was allocated inside it.
The points run one after another in one process, so allocations made once per process (cuBLAS's
workspaces) appear at the first point only. benchmarks/tracer_requests.py compares the files with
the tracer's requests; tests/test_attention_backends.py holds the sequences measured on the H200."""
import json, sys, os
import torch
import torch.nn.functional as F
from lab_helpers.real.config import load_config
from lab_helpers.real.protocol import measure_model
from lab_helpers.real.spec import RunSpec

FAM = {"mistral": ("mistral-7b-v0.1", {"num_hidden_layers": 2}),
       "gemma2": ("gemma-2-2b", {"num_hidden_layers": 4}),
       "gemma3": ("gemma-3-4b-text", {"num_hidden_layers": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
       "phi3": ("phi-3-mini-4k", {"num_hidden_layers": 2}),
       "gpt2": ("gpt2", {"n_layer": 4}),
       "mixtral": ("mixtral-8x7b", {"num_hidden_layers": 2})}
POINTS = [("mistral", 1, 8192), ("mistral", 2, 4094), ("gemma2", 1, 8000), ("gemma2", 2, 4094), ("gemma3", 1, 8192),
          ("gemma3", 4, 1022), ("phi3", 1, 512), ("phi3", 1, 4000), ("phi3", 8, 1000), ("gpt2", 4, 512),
          ("gpt2", 8, 1000), ("mixtral", 1, 512)]
out = sys.argv[1]
# optional: only these points (family:batch:context), run in this fresh process in the order given
if len(sys.argv) > 2:
    POINTS = [(f, int(b), int(c)) for f, b, c in (a.split(":") for a in sys.argv[2:])]
calls = []
orig = F.scaled_dot_product_attention

def desc(t):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype), "offset": t.storage_offset(),
            "contiguous": t.is_contiguous()}

def wrapped(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    try:
        choice = int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
    except Exception as exc:
        choice = repr(exc)
    torch.cuda.reset_peak_memory_stats()
    result = orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    calls.append({"q": desc(q), "k": desc(k), "v": desc(v), "mask": desc(attn_mask), "dropout": dropout_p,
                  "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa, "choice": choice,
                  "out": desc(result),
                  "n_alloc": after["allocation.all.allocated"] - before["allocation.all.allocated"],
                  "bytes_requested": after["requested_bytes.all.allocated"] - before["requested_bytes.all.allocated"],
                  "peak_over_start": after["allocated_bytes.all.peak"] - before["allocated_bytes.all.current"],
                  "segments_new": after["segment.all.allocated"] - before["segment.all.allocated"]})
    return result

F.scaled_dot_product_attention = wrapped
torch.nn.functional.scaled_dot_product_attention = wrapped
os.makedirs(out, exist_ok=True)
for fam, batch, context in POINTS:
    name, changes = FAM[fam]
    raw = json.load(open(f"data/models/{name}.json"))
    path = f"/tmp/{fam}.json"
    json.dump({**raw, **changes}, open(path, "w"))
    shape = load_config(path)
    calls.clear()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        doc = measure_model(shape, RunSpec(shape.name, batch=batch, context=context, new_tokens=4, device="cuda:0"))
        err = None
    except Exception as exc:
        doc, err = None, repr(exc)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = []
    for e in snap["device_traces"][0]:
        frames = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in e.get("frames", [])
                  if f["filename"].endswith(".py")][:4]
        events.append([e["action"], e["size"], e.get("addr", 0), frames])
    json.dump({"family": fam, "batch": batch, "context": context, "error": err, "document": doc, "sdpa_calls": calls,
               "events": events}, open(f"{out}/{fam}-{batch}-{context}.json", "w"))
    print(fam, batch, context, "error" if err else "ok", len(events), "events", len(calls), "sdpa calls",
          sorted({str(c["choice"]) for c in calls}), flush=True)
    torch.cuda.empty_cache()
