"""GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and the K-quants Q2_K ... Q6_K):
the types' ids and sizes, the checks of a weight's rows, and `dequantize`, the pure-torch
reading of every type (the fallback of the native kernels in worker_svc/kernels/quant_kernels.py).

Layouts. A weight matrix of N output rows and K inputs is uint8 [N, row_bytes], rows
contiguous, each row K / 32 blocks of 32 weights along K, as GGUF stores them:

    Q8_0 (type 8, 34 bytes): fp16 d, int8 q[32]             w[j] = d * q[j]
    Q4_0 (type 2, 18 bytes): fp16 d, uint8 qs[16]           w[j] = d * ((qs[j] & 15) - 8),
                                                            w[j + 16] = d * ((qs[j] >> 4) - 8)
    Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, uint8 qs[16]   w[j] = d * (qs[j] & 15) + m,
                                                            w[j + 16] = d * (qs[j] >> 4) + m

    Q5_0 (type 6, 22 bytes), Q5_1 (type 7, 24 bytes): Q4_0 / Q4_1 with a fifth bit per
                            value (qh, 32 bits), w = d * (q - 16) / d * q + m
    MXFP4 (type 39, 17 bytes): E8M0 e, uint8 qs[16]  w[j] = d * KV[qs[j] & 15],
                                                     w[j + 16] = d * KV[qs[j] >> 4]
        KV = MXFP4_KVALUES (ggml's kvalues_mxfp4: the E2M1 values doubled), d = 2^(e - 128)
        (GGML_E8M0_TO_FP32_HALF; e 0 and 1 give float32 subnormals). gpt-oss's Hugging Face
        layout of the same values: worker_svc/weights/mxfp4.py.

row_bytes = K / 32 * block bytes. The K-quants (types 10-14, worker_svc/kernels/kquants.py has their
layouts) hold 256-value super-blocks, so their rows must be whole super-blocks (K % 256 == 0,
a ValueError naming the weight's shape otherwise; llama.cpp writes other rows in Q5_0, Q8_0
and the like). bfloat16 weights are torch's bfloat16 [N, K].
"""

from __future__ import annotations

import torch

from worker_svc.kernels import kquants
from worker_svc.kernels.kquants import KQUANT_TYPES

# name -> (ggml type id, elements per block, bytes per block)
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "BF16": (30, 1, 2),
    "MXFP4": (39, 32, 17),
    **KQUANT_TYPES,  # Q5_0, Q5_1 (32-blocks) and Q2_K ... Q6_K (256-value super-blocks)
}
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # the 32-block types gguf-py also quantizes
SUPER_BLOCK_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # rows of K % 256 == 0 only
KERNEL_TYPES = (*BLOCK_TYPES, "Q5_0", "Q5_1", "MXFP4", *SUPER_BLOCK_TYPES)  # every type QuantKernels.matmul takes
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # ggml's kvalues_mxfp4
_PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def row_bytes(qtype: str, K: int) -> int:
    """Bytes of one weight row of K inputs in `qtype`."""
    _, block, size = GGML_TYPES[qtype]
    return K // block * size


def check_row_length(qtype: str, K: int, N: int | None = None) -> None:
    """ValueError, naming the weight's shape and type, unless rows of K inputs are whole
    blocks of `qtype` (32 values; 256 for the K-quants, whose packed kernels take no other
    rows: llama.cpp writes such rows in Q5_0/Q8_0 and the like instead)."""
    if qtype not in KERNEL_TYPES:
        raise ValueError(f"qtype must be one of {KERNEL_TYPES}, got {qtype!r}")
    block = GGML_TYPES[qtype][1]
    if not isinstance(K, int) or K < 0 or K % block:
        shape = f"[{N}, {K}]" if N is not None else f"[N, {K}]"
        raise ValueError(
            f"a {qtype} weight {shape} needs rows of whole {block}-value blocks: K must be a "
            f"multiple of {block}, got {K}"
        )


def check_block_weights(w: torch.Tensor, qtype: str, K: int) -> int:
    """The row count N of `w`, a contiguous CPU uint8 [N, row_bytes] of `qtype` rows of K
    inputs; ValueError otherwise."""
    check_row_length(qtype, K, w.shape[0] if isinstance(w, torch.Tensor) and w.dim() == 2 else None)
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.dim() != 2:
        raise ValueError(
            f"w must be a 2-D uint8 tensor [N, row_bytes], got "
            f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}"
        )
    if not w.is_cpu or not w.is_contiguous():
        raise ValueError(f"w must be a contiguous CPU tensor, got {w.device} strides {w.stride()}")
    if w.shape[1] != row_bytes(qtype, K):
        raise ValueError(f"w has {w.shape[1]} bytes per row; {qtype} with K={K} has {row_bytes(qtype, K)}")
    return w.shape[0]


def dequantize(w: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """The float32 [N, K] weights of `w` (uint8 [N, row_bytes] in GGUF layout), in torch
    ops over all blocks at once; equal to `gguf.quants.dequantize`. Also takes F32, F16 and
    BF16 rows (raw bytes)."""
    if qtype in _PLAIN_DTYPES:
        if (
            not isinstance(w, torch.Tensor)
            or w.dtype != torch.uint8
            or w.dim() != 2
            or w.shape[1] != row_bytes(qtype, K)
        ):
            raise ValueError(f"w must be uint8 [N, {row_bytes(qtype, K)}] for {qtype} with K={K}")
        return w.contiguous().view(_PLAIN_DTYPES[qtype]).to(torch.float32)
    if qtype in KQUANT_TYPES:
        check_block_weights(w, qtype, K)
        return kquants.dequantize(w, qtype, K)
    N = check_block_weights(w, qtype, K)
    _, _, size = GGML_TYPES[qtype]
    blocks = w.view(N, K // 32, size)  # [N, num_blocks, block bytes]
    if qtype == "MXFP4":
        return _dequantize_mxfp4(blocks).view(N, K)
    d = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32)  # [N, num_blocks, 1]
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)  # [N, num_blocks, 32]
        return (q * d).view(N, K)
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]  # [N, num_blocks, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, num_blocks, 32]: low nibbles first
    if qtype == "Q4_0":
        return (d * (q.to(torch.int8) - 8).to(torch.float32)).view(N, K)
    m = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
    return (d * q.to(torch.float32) + m).view(N, K)  # two roundings, as gguf-py's (d * q) + m


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's GGML_E8M0_TO_FP32_HALF of E8M0 bytes (uint8): float32 2^(e - 128), exactly (the
    float32 bits (e - 1) << 23, or for e 0 and 1 the subnormals 2^-128 and 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e.clamp(max=1), (e - 1) << 23)
    return bits.view(torch.float32)


def _dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., 17] -> float32 [..., 32]: d * KV[q] in float32, as gguf-py's."""
    d = e8m0_half(blocks[..., :1])  # [..., 1]
    qs = blocks[..., 1:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()  # [..., 32]: low nibbles first
    return d * torch.tensor(MXFP4_KVALUES, dtype=torch.float32)[q]
