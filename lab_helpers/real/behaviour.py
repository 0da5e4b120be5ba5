"""What CUDA kernels allocate that their meta versions do not, as the tracer (lab_helpers.real.tracer)
replays it, and cuDNN's decode workspace rule: a trace's key names the one, the replay reads the other
(lab_helpers.real.replay.decode_workspace_affine), so both are read without importing torch (a warm
answer, its traces kept, imports neither torch nor transformers)."""
from dataclasses import dataclass

from lab_helpers.core.numbers import MIB


@dataclass(frozen=True)
class CudaBehaviour:
    """What CUDA kernels allocate that their meta versions do not (bytes, in order).

    Measured with torch.cuda.memory._record_memory_history on an NVIDIA H200 (compute
    capability 9.0), torch 2.11.0+cu130, transformers 5.17.0."""

    # the first cuBLAS product of the process (a plain mm/bmm/matmul) allocates its
    # workspace right after its output: PyTorch's default on compute capability 9.0
    cublas_workspace_bytes: int = 32 * MIB
    # the first product with a bias (addmm, cuBLASLt) adds cuBLASLt's own workspace
    cublaslt_workspace_bytes: int = MIB
    # cuDNN attention, chosen for every SDPA call of the probed families (head dim 64 to
    # 256, with a boolean mask or none): a philox seed and offset (int64 scalars, 8 bytes
    # each), the output, then a workspace freed before the call returns: 256 bytes for
    # every call of more than one query token (measured at head dims 64, 96, 128, 256,
    # masked and unmasked; benchmarks/sdpa_probe.py, 2026-12-01)
    cudnn_prefill_workspace_bytes: int = 256
    # cuDNN's largest head dim on compute capability 9.0 with the image's cuDNN: 256
    # (check_cudnn_tensor_shapes allows 256 on sm90 with a cuDNN newer than 9.22.0 and cudnn-frontend
    # >= 1.24, else 128); measured: head dim 256 calls chose cuDNN (torch._fused_sdp_choice 3)
    cudnn_max_head_dim: int = 256
    # the device, for the reduction kernels' launch configuration
    multiprocessors: int = 132
    threads_per_multiprocessor: int = 2048
    # compute capability major.minor (two ints: a trace key is JSON, where a tuple would read back a list)
    compute_major: int = 9
    compute_minor: int = 0


DEFAULT_BEHAVIOUR = CudaBehaviour()


def cudnn_decode_workspace_bytes(batch: int, query_heads: int, key_heads: int, kv_length: int,
                                 head_dim: int) -> int:
    """Workspace of cuDNN attention for one query token over `kv_length` keys (bytes requested).

    cuDNN splits the keys of a decode call across thread blocks when there are few (batch x
    key-value head) pairs, then merges the splits from a workspace: per (batch, query head,
    split) a float32 partial output of `head_dim` values, then two float32 statistics each
    (that array padded to 256 bytes), then 128 bytes. The number of splits is a power of two:
    the smallest that leaves at most 254 keys a split, at most 256 // (batch x key-value heads)
    (rounded down to a power of two), at most 64; below 4 the keys are not split and nothing is
    allocated. Derived from 73 decode calls measured on the H200 (torch 2.11.0+cu130,
    2026-12-01: masked and unmasked, head dims 64 / 96 / 128 / 256, 8 to 96 query and 1 to 48
    key-value heads, batch 1 to 16, 100 to 32768 keys), which it reproduces to the byte
    (tests/test_attention_backends.py holds them); elsewhere the same rule, unverified."""
    pairs = batch * key_heads
    if pairs <= 0 or kv_length <= 0:
        return 0
    by_length = 1 << max(0, (-(-kv_length // 254) - 1).bit_length())
    by_blocks = 1 << ((256 // pairs).bit_length() - 1) if pairs <= 256 else 0
    splits = min(by_length, by_blocks, 64)
    if splits < 4:
        return 0
    units = batch * query_heads * splits
    return units * head_dim * 4 + -(-units * 8 // 256) * 256 + 128
