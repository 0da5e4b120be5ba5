"""scaled_dot_product_attention as the tracer models it: the backend CUDA picks on the H200, and the
requests cuDNN attention makes, masked and unmasked, against the sequences measured there.

The expected sequences are those benchmarks/sdpa_probe.py measured (NVIDIA H200, torch 2.11.0+cu130,
transformers 5.17.0, measured 2026-12-01 15:13 UTC): every alloc and free inside each SDPA call,
from torch.cuda.memory._record_memory_history. Frees between two allocations are compared as a
set (their order does not change the allocator's state)."""
import pytest

from lab_helpers.allocator.addressed import AddressedAllocator
from lab_helpers.real import tracer as tracer_module
from lab_helpers.real.config import parse_config
from lab_helpers.real.predict import predict_model
from lab_helpers.real.spec import RunSpec
from lab_helpers.real.tracer import (CUDNN, OTHER, AllocationTracer, cudnn_decode_workspace_bytes,
                                     cudnn_output_like, cudnn_sdpa_supported, sdpa_backend)

torch = pytest.importorskip("torch")
F = torch.nn.functional
BF16 = torch.bfloat16


class LoggingAllocator(AddressedAllocator):
    """AddressedAllocator that logs each request: ("alloc", bytes asked), ("free", bytes asked)."""

    def __init__(self):
        super().__init__()
        self.log = []
        self.requested = {}  # id of a live block -> the bytes its request asked for

    def malloc(self, request_bytes):
        block = super().malloc(request_bytes)
        self.requested[id(block)] = request_bytes  # blocks have __slots__: the size asked is kept here
        self.log.append(("alloc", request_bytes))
        return block

    def free(self, block):
        self.log.append(("free", self.requested.pop(id(block))))
        super().free(block)


def grouped(log):
    """Allocations in order, the frees between two allocations as one sorted tuple."""
    out, frees = [], []
    for action, size in log:
        if action == "alloc":
            if frees:
                out.append(("free", tuple(sorted(frees))))
                frees = []
            out.append(("alloc", size))
        else:
            frees.append(size)
    if frees:
        out.append(("free", tuple(sorted(frees))))
    return out


def blhd(batch, heads, length, dim):
    """A query laid out [B, L, H, D] in memory, as a projection's view(...).transpose(1, 2) gives it."""
    return torch.empty(batch, length, heads, dim, dtype=BF16, device="meta").transpose(1, 2)


def bhld(batch, heads, length, dim):
    return torch.empty(batch, heads, length, dim, dtype=BF16, device="meta")


def traced_call(query, key, value, **kwargs):
    """The requests of one SDPA call traced alone (the inputs made before tracing; what the call
    left dead collected, its output alive), and the output's shape and strides."""
    alloc = LoggingAllocator()
    tracer = AllocationTracer(alloc)
    with torch.inference_mode(), tracer:
        out = F.scaled_dot_product_attention(query, key, value, **kwargs)
        tracer.collect()
    return grouped(alloc.log), (tuple(out.shape), out.stride())


A, FREE = "alloc", "free"

# (name, query, key, value, mask, kwargs, expected requests, expected output strides), each from a
# probe file: the call's events as the GPU made them
CASES = [
    # mistral-1-8192.json, prefill past the 4096 window: bool mask (1, 1, 8192, 8192), head dim 128
    ("mistral prefill, masked", lambda: (blhd(1, 32, 8192, 128), bhld(1, 32, 8192, 128), bhld(1, 32, 8192, 128),
                                         torch.empty(1, 1, 8192, 8192, dtype=torch.bool, device="meta")),
     {}, [(A, 2), (A, 2), (A, 134217728), (FREE, (2, 2)), (A, 8), (A, 8), (A, 67108864), (A, 256),
          (FREE, (8, 8, 256, 134217728))], (33554432, 128, 4096, 1)),
    # mistral-2-4094.json, decode: bool mask (2, 1, 1, 4096) expanded over the batch (stride 0), then
    # cuDNN's decode workspace (133248 bytes: 8 splits of the keys)
    ("mistral decode, masked, expanded batch",
     lambda: (bhld(2, 32, 1, 128), bhld(2, 32, 4096, 128), bhld(2, 32, 4096, 128),
              torch.empty(1, 1, 1, 4096, dtype=torch.bool, device="meta").expand(2, 1, 1, 4096)),
     {}, [(A, 2), (A, 2), (A, 16384), (FREE, (2, 2)), (A, 8), (A, 8), (A, 16384), (A, 133248),
          (FREE, (8, 8, 16384, 133248))],
     (4096, 128, 128, 1)),
    # gemma2-1-8000.json, prefill of a sliding layer: head dim 256, bool mask (1, 1, 8000, 8000)
    ("gemma 2 prefill, head dim 256, masked",
     lambda: (blhd(1, 8, 8000, 256), bhld(1, 8, 8000, 256), bhld(1, 8, 8000, 256),
              torch.empty(1, 1, 8000, 8000, dtype=torch.bool, device="meta")),
     {}, [(A, 2), (A, 2), (A, 128000000), (FREE, (2, 2)), (A, 8), (A, 8), (A, 32768000), (A, 256),
          (FREE, (8, 8, 256, 128000000))], (16384000, 256, 2048, 1)),
    # gemma2-1-8000.json, prefill of a global layer: causal, grouped query attention, no mask
    ("gemma 2 prefill, head dim 256, causal gqa",
     lambda: (blhd(1, 8, 8000, 256), bhld(1, 4, 8000, 256), bhld(1, 4, 8000, 256), None),
     {"is_causal": True, "enable_gqa": True},
     [(A, 8), (A, 8), (A, 32768000), (A, 256), (FREE, (8, 8, 256))], (16384000, 256, 2048, 1)),
    # phi3-1-4000.json, prefill: a contiguous [B, H, L, D] query gives a contiguous output
    ("phi-3 prefill, head dim 96, masked, contiguous query",
     lambda: (bhld(1, 32, 4000, 96), bhld(1, 32, 4000, 96), bhld(1, 32, 4000, 96),
              torch.empty(1, 1, 4000, 4000, dtype=torch.bool, device="meta")),
     {}, [(A, 2), (A, 2), (A, 32000000), (FREE, (2, 2)), (A, 8), (A, 8), (A, 24576000), (A, 256),
          (FREE, (8, 8, 256, 32000000))], (12288000, 384000, 96, 1)),
    # phi3-1-4000.json, decode: mask (1, 1, 1, 2047), a bias of 4094 bytes (rounded only by the allocator)
    ("phi-3 decode, masked, odd window",
     lambda: (bhld(1, 32, 1, 96), bhld(1, 32, 2047, 96), bhld(1, 32, 2047, 96),
              torch.empty(1, 1, 1, 2047, dtype=torch.bool, device="meta")),
     {}, [(A, 2), (A, 2), (A, 4094), (FREE, (2, 2)), (A, 8), (A, 8), (A, 6144), (A, 100480),
          (FREE, (8, 8, 4094, 100480))],
     (3072, 96, 96, 1)),
]


# (batch, query heads, key-value heads, head dim, keys, boolean mask, workspace bytes): decode calls
# measured on the H200 (torch 2.11.0+cu130, 2026-12-01) by benchmarks/cudnn_decode_probe.py and, the
# last ones, inside the families' runs by benchmarks/sdpa_probe.py
DECODE_WORKSPACES = [
    (1, 32, 8, 128, 127, False, 0), (1, 32, 8, 128, 128, False, 0), (1, 32, 8, 128, 255, False, 0),
    (1, 32, 8, 128, 256, False, 0), (1, 32, 8, 128, 1000, False, 66688), (1, 32, 8, 128, 2048, False, 266368),
    (1, 32, 8, 128, 4096, False, 532608), (1, 32, 8, 128, 16384, False, 532608),
    (1, 32, 8, 128, 32768, False, 532608), (4, 32, 8, 128, 4096, False, 532608),
    (8, 32, 8, 128, 4096, False, 532608), (16, 32, 8, 128, 4096, False, 0),
    (1, 16, 2, 64, 4096, False, 135296), (1, 40, 8, 128, 3000, False, 332928),
    (1, 64, 8, 128, 8192, False, 1065088), (3, 28, 4, 128, 5000, False, 699008),
    (1, 32, 32, 128, 4096, False, 133248), (2, 12, 12, 64, 1001, False, 25472),
    (1, 12, 12, 64, 4096, False, 50816), (1, 8, 8, 256, 4096, False, 264320),
    (4, 32, 32, 128, 4096, False, 0), (1, 32, 32, 96, 2047, False, 100480), (1, 32, 32, 128, 100, True, 0),
    (1, 32, 32, 128, 128, True, 0), (1, 32, 32, 128, 129, True, 0), (1, 32, 32, 128, 1000, True, 66688),
    (1, 32, 32, 128, 4096, True, 133248), (1, 32, 32, 128, 9000, True, 133248),
    (3, 32, 32, 128, 4096, True, 0), (1, 16, 16, 64, 4096, True, 67712), (2, 12, 12, 64, 1001, True, 25472),
    (1, 8, 8, 256, 600, True, 33152), (5, 8, 8, 256, 4096, True, 165248), (1, 40, 40, 128, 2500, True, 83328),
    (1, 32, 32, 96, 700, True, 50304), (1, 8, 8, 256, 1024, True, 66176), (4, 8, 8, 256, 1024, True, 264320),
    (1, 32, 8, 128, 1015, False, 66688), (1, 32, 8, 128, 1016, False, 66688),
    (1, 32, 8, 128, 1017, False, 133248), (1, 32, 8, 128, 1009, False, 66688),
    (1, 32, 8, 128, 2040, False, 266368), (1, 32, 8, 128, 2033, False, 266368),
    (1, 32, 8, 128, 4088, False, 532608), (1, 32, 8, 128, 4081, False, 532608),
    (1, 32, 8, 128, 505, False, 0), (1, 32, 8, 128, 497, False, 0), (1, 32, 8, 128, 1023, False, 133248),
    (1, 32, 8, 128, 2047, False, 266368), (1, 14, 2, 64, 6000, False, 118400),
    (2, 28, 4, 128, 3333, False, 466048), (1, 64, 8, 128, 700, False, 133248),
    (1, 24, 24, 128, 5000, True, 99968), (6, 16, 8, 128, 2000, False, 199808),
    (1, 48, 48, 128, 1500, True, 99968), (3, 12, 12, 64, 2222, False, 38272),
    (1, 96, 8, 128, 4096, False, 1597568), (1, 32, 4, 128, 32768, False, 1065088),
    (1, 32, 1, 128, 32768, False, 1065088), (2, 16, 2, 256, 9000, False, 2113664),
    (1, 8, 8, 256, 1017, True, 66176), (2, 32, 8, 128, 4095, False, 532608),
    (1, 8, 4, 256, 8001, False, 264320), (1, 32, 8, 128, 513, False, 66688),
    (1, 8, 4, 256, 8193, False, 528512), (8, 12, 12, 64, 1001, False, 0), (8, 32, 32, 96, 1001, False, 0),
    (2, 8, 4, 256, 4095, False, 528512), (4, 8, 4, 256, 1023, False, 264320),
    (2, 32, 32, 128, 4096, True, 133248), (1, 8, 8, 256, 4096, True, 264320),
    (2, 8, 8, 256, 4096, True, 264320), (1, 32, 32, 96, 2047, True, 100480),
]


@pytest.mark.parametrize("batch, query_heads, key_heads, head_dim, keys, masked, measured", DECODE_WORKSPACES)
def test_the_decode_workspace_is_the_measured_one(batch, query_heads, key_heads, head_dim, keys, masked, measured):
    assert cudnn_decode_workspace_bytes(batch, query_heads, key_heads, keys, head_dim) == measured
    query = bhld(batch, query_heads, 1, head_dim)
    key, value = bhld(batch, key_heads, keys, head_dim), bhld(batch, key_heads, keys, head_dim)
    kwargs = {"enable_gqa": key_heads != query_heads}
    if masked:
        kwargs["attn_mask"] = torch.empty(batch, 1, 1, keys, dtype=torch.bool, device="meta")
    requests, _ = traced_call(query, key, value, **kwargs)
    output = batch * query_heads * head_dim * 2
    head = [(A, 2), (A, 2), (A, batch * keys * 2), (FREE, (2, 2))] if masked else []
    bias = (batch * keys * 2,) if masked else ()
    workspace = (measured,) if measured else ()
    tail = [(A, size) for size in workspace] + [(FREE, tuple(sorted((8, 8, *bias, *workspace))))]
    assert requests == head + [(A, 8), (A, 8), (A, output)] + tail


@pytest.mark.parametrize("name, make, kwargs, expected, strides", CASES, ids=[c[0] for c in CASES])
def test_cudnn_requests_are_the_measured_sequence(name, make, kwargs, expected, strides):
    query, key, value, mask = make()
    if mask is not None:
        kwargs = dict(kwargs, attn_mask=mask)
    assert sdpa_backend(query, key, value, mask, 0.0, kwargs.get("enable_gqa", False)) == CUDNN
    requests, (_, out_strides) = traced_call(query, key, value, **kwargs)
    assert requests == expected
    assert out_strides == strides


def test_gpt2_fused_qkv_query_gives_a_dense_blhd_output():
    # gpt2-4-512.json: q, k, v split from Conv1D's (4, 512, 2304) output, k and v from the cache;
    # the GPU's output strides (393216, 64, 768, 1); requests 8, 8, output, 256
    qkv = torch.empty(4, 512, 2304, dtype=BF16, device="meta")
    query = qkv[..., :768].view(4, 512, 12, 64).transpose(1, 2)
    key, value = bhld(4, 12, 512, 64), bhld(4, 12, 512, 64)
    assert query.stride() == (1179648, 64, 2304, 1)
    requests, (_, strides) = traced_call(query, key, value, is_causal=True)
    assert requests == [(A, 8), (A, 8), (A, 3145728), (A, 256), (FREE, (8, 8, 256))]
    assert strides == (393216, 64, 768, 1)


def test_an_additive_mask_is_passed_through():
    query, key, value = blhd(1, 8, 64, 128), bhld(1, 8, 64, 128), bhld(1, 8, 64, 128)
    mask = torch.empty(1, 1, 64, 64, dtype=BF16, device="meta")
    requests, _ = traced_call(query, key, value, attn_mask=mask)
    assert requests == [(A, 8), (A, 8), (A, 131072), (A, 256), (FREE, (8, 8, 256))]


def test_output_layout_follows_the_query_when_value_dims_differ():
    query = blhd(2, 4, 16, 192)
    out = cudnn_output_like(query, 128)
    assert out.shape == (2, 4, 16, 128) and out.stride() == (8192, 128, 512, 1)


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


# sdp_utils.cpp's cuDNN filters (can_use_cudnn_attention, torch 2.11) on the H200: each case
# breaks one
REFUSED = [
    ("head dim not a multiple of 8", (meta(1, 4, 16, 20), meta(1, 4, 16, 20), meta(1, 4, 16, 20)), {}),
    ("head dim over 256", (meta(1, 4, 16, 264), meta(1, 4, 16, 264), meta(1, 4, 16, 264)), {}),
    ("float32", (meta(1, 4, 16, 64, dtype=torch.float32),) * 3, {}),
    ("mixed dtypes", (meta(1, 4, 16, 64), meta(1, 4, 16, 64, dtype=torch.float16), meta(1, 4, 16, 64)), {}),
    ("3-D inputs", (meta(4, 16, 64), meta(4, 16, 64), meta(4, 16, 64)), {}),
    ("one key", (meta(1, 4, 1, 64), meta(1, 4, 1, 64), meta(1, 4, 1, 64)), {}),
    ("no query", (meta(1, 4, 0, 64), meta(1, 4, 16, 64), meta(1, 4, 16, 64)), {}),
    ("kv heads differ without enable_gqa", (meta(1, 8, 16, 64), meta(1, 2, 16, 64), meta(1, 2, 16, 64)), {}),
    ("kv heads do not divide", (meta(1, 6, 16, 64), meta(1, 4, 16, 64), meta(1, 4, 16, 64)), {"enable_gqa": True}),
    ("batches differ", (meta(2, 4, 16, 64), meta(1, 4, 16, 64), meta(1, 4, 16, 64)), {}),
    ("3-D mask", (meta(1, 4, 16, 64),) * 3, {"attn_mask": meta(1, 16, 16, dtype=torch.bool)}),
    ("mask of the wrong length", (meta(1, 4, 16, 64),) * 3, {"attn_mask": meta(1, 1, 16, 15, dtype=torch.bool)}),
    ("mask's last stride not 1", (meta(1, 4, 16, 64),) * 3,
     {"attn_mask": meta(1, 1, 16, 32, dtype=torch.bool)[..., ::2]}),
    ("dropout", (meta(1, 4, 16, 64),) * 3, {"dropout_p": 0.125}),
    ("query's last stride not 1", (meta(1, 4, 64, 16).transpose(-1, -2), meta(1, 4, 16, 64), meta(1, 4, 16, 64)),
     {}),
]


@pytest.mark.parametrize("name, tensors, kwargs", REFUSED, ids=[r[0] for r in REFUSED])
def test_cudnn_is_refused_where_sdp_utils_refuses_it(name, tensors, kwargs):
    query, key, value = tensors
    assert not cudnn_sdpa_supported(query, key, value, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                                    kwargs.get("enable_gqa", False))
    assert sdpa_backend(query, key, value, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                        kwargs.get("enable_gqa", False)) == OTHER


def test_cudnn_is_accepted_with_broadcast_masks_and_gqa():
    q, k = meta(2, 8, 16, 64), meta(2, 2, 16, 64)
    for mask in (meta(16, 16, dtype=torch.bool), meta(1, 1, 1, 16, dtype=torch.bool), meta(2, 8, 16, 16, dtype=torch.bool)):
        assert cudnn_sdpa_supported(q, k, k, mask, 0.0, True)
    assert cudnn_sdpa_supported(q, k, k, None, 0.0, True)
    assert not cudnn_sdpa_supported(q, k, k, None, 0.0, False)


def test_cudnn_disabled_by_the_user_is_not_taken():
    q = meta(1, 4, 16, 64)
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert not cudnn_sdpa_supported(q, q, q, None, 0.0, False)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)
    assert cudnn_sdpa_supported(q, q, q, None, 0.0, False)


# tiny configs whose head dims are multiples of 8, as every probed family's are: windows of 7 under
# a context of 11, so the sliding layers take a boolean mask in the prefill and past the window
NO_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
TINY = dict(hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=1001, head_dim=16, **NO_IDS)
MASKED_FAMILIES = {
    "mistral-sliding": dict(TINY, model_type="mistral", sliding_window=7),
    "gemma2": dict(TINY, model_type="gemma2", sliding_window=7, query_pre_attn_scalar=16, head_dim=32),
    "gemma3_text": dict(TINY, model_type="gemma3_text", sliding_window=7, sliding_window_pattern=2,
                        query_pre_attn_scalar=16, head_dim=32),
    "phi3": dict({k: v for k, v in TINY.items() if k != "head_dim"}, model_type="phi3", num_key_value_heads=3,
                 sliding_window=7),
    "gpt2": dict(model_type="gpt2", n_embd=96, n_layer=2, n_head=6, vocab_size=1001, n_positions=64, **NO_IDS),
}


@pytest.mark.parametrize("family", MASKED_FAMILIES)
def test_the_families_attention_is_traced_as_cudnn_without_the_scores(family, monkeypatch):
    calls = []

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        backend = sdpa_backend(query, key, value, attn_mask, *args, **kwargs)
        calls.append((backend, attn_mask is not None, query.shape[-2], key.shape[-2]))
        return backend

    def no_math(*args, **kwargs):
        raise AssertionError("the math fallback (B x H x L x S scores) was traced")

    monkeypatch.setattr(tracer_module, "sdpa_backend", recording)
    monkeypatch.setattr(torch.ops.aten._scaled_dot_product_attention_math.default, "decompose", no_math)
    shape = parse_config(MASKED_FAMILIES[family], family)
    prediction = predict_model(shape, RunSpec(family, batch=2, context=11, new_tokens=3))
    assert [r["phase"] for r in prediction["phases"]][2:] == ["prefill", "decode", "decode", "decode"]
    assert calls and all(backend == CUDNN for backend, *_ in calls)
    if family != "gpt2":
        assert any(masked for _, masked, _, _ in calls)  # the sliding layers past their window
