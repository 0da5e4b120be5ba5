"""On a CUDA GPU: the workspace cuDNN attention allocates for one query token (a decode step).

    python benchmarks/cudnn_decode_probe.py OUT.json

For each shape (batch, query heads, key-value heads, head dim, keys, boolean mask or none; bf16,
queries and keys in transformers' [B, L, H, D] memory layout), one SDPA call and the bytes its
allocations requested less the seed and offset (8 bytes each), the output and, masked, the two
2-byte scalars and the converted mask: the workspace. lab_helpers.real.tracer's
cudnn_decode_workspace_bytes is the rule these figures follow; tests/test_attention_backends.py
holds the H200's."""
import json
import sys

import torch
import torch.nn.functional as F

dev = "cuda:0"
torch.zeros(1, device=dev)
SHAPES = []
for kv in (127, 128, 255, 256, 1000, 2048, 4096, 16384, 32768):
    SHAPES.append((1, 32, 8, 128, kv, False))
SHAPES += [(4, 32, 8, 128, 4096, False), (8, 32, 8, 128, 4096, False), (16, 32, 8, 128, 4096, False),
           (1, 16, 2, 64, 4096, False), (1, 40, 8, 128, 3000, False), (1, 64, 8, 128, 8192, False), (3, 28, 4, 128, 5000, False),
           (1, 32, 32, 128, 4096, False), (2, 12, 12, 64, 1001, False), (1, 12, 12, 64, 4096, False), (1, 8, 8, 256, 4096, False),
           (4, 32, 32, 128, 4096, False), (1, 32, 32, 96, 2047, False)]
for kv in (100, 128, 129, 1000, 4096, 9000):
    SHAPES.append((1, 32, 32, 128, kv, True))
SHAPES += [(3, 32, 32, 128, 4096, True), (1, 16, 16, 64, 4096, True), (2, 12, 12, 64, 1001, True), (1, 8, 8, 256, 600, True),
           (5, 8, 8, 256, 4096, True), (1, 40, 40, 128, 2500, True), (1, 32, 32, 96, 700, True), (1, 8, 8, 256, 1024, True),
           (4, 8, 8, 256, 1024, True), (1, 32, 32, 128, 4096, True)]
SHAPES += [(1, 32, 8, 128, kv, False) for kv in (1015, 1016, 1017, 1009, 2040, 2033, 4088, 4081, 505, 497, 1023, 2047)]
SHAPES += [(1, 14, 2, 64, 6000, False), (2, 28, 4, 128, 3333, False), (1, 64, 8, 128, 700, False),
           (1, 24, 24, 128, 5000, True), (6, 16, 8, 128, 2000, False), (1, 48, 48, 128, 1500, True),
           (3, 12, 12, 64, 2222, False), (1, 96, 8, 128, 4096, False), (1, 32, 4, 128, 32768, False),
           (1, 32, 1, 128, 32768, False), (2, 16, 2, 256, 9000, False), (1, 8, 8, 256, 1017, True)]
rows = []
for b, hq, hkv, d, kv, masked in SHAPES:
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, kv, hkv, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, kv, hkv, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    mask = torch.ones(b, 1, 1, kv, dtype=torch.bool, device=dev) if masked else None
    gqa = hkv != hq
    choice = int(torch._fused_sdp_choice(q, k, v, mask, 0.0, False, enable_gqa=gqa))
    torch.cuda.synchronize(); s0 = torch.cuda.memory_stats()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    torch.cuda.synchronize(); s1 = torch.cuda.memory_stats()
    n = s1["allocation.all.allocated"] - s0["allocation.all.allocated"]
    req = s1["requested_bytes.all.allocated"] - s0["requested_bytes.all.allocated"]
    ws = req - 16 - o.untyped_storage().nbytes() - ((4 + b * kv * 2) if masked else 0)
    rows.append(dict(b=b, hq=hq, hkv=hkv, d=d, kv=kv, masked=masked, choice=choice, n_alloc=n, workspace=ws))
    print(rows[-1], flush=True)
    del q, k, v, mask, o
json.dump(rows, open(sys.argv[1], "w"))
