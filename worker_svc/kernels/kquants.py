"""GGUF's K-quants (Q2_K ... Q6_K) and the 5-bit 32-blocks (Q5_0, Q5_1): dequantizers in
torch ops over all blocks at once, and reference quantizers that make valid blocks (for
tests and `export-gguf`). The packed kernels' own types (Q8_0, Q4_0, Q4_1) are in
worker_svc/kernels/quant_kernels.py; these are, for now, dequantized at load.

Layouts (ggml-common.h). A weight matrix of N rows and K inputs is uint8 [N, row_bytes],
each row K / block blocks laid end to end; fp16 values little-endian.

    Q5_0 (type 6, 32 values, 22 bytes): fp16 d, qh[4], qs[16]
        q[j] = (qs[j] & 15 | bit j of qh << 4), q[j + 16] = (qs[j] >> 4 | bit j+16 << 4)
        w = d * (q - 16)
    Q5_1 (type 7, 32 values, 24 bytes): fp16 d, fp16 m, qh[4], qs[16]; w = d * q + m

The K-quants hold 256 values (a super-block) in sub-blocks of 16 or 32, each with its own
scale (and min) quantized against the super-block's fp16 d (and dmin):

    Q2_K (type 10, 84 bytes): scales[16], qs[64], fp16 d, fp16 dmin
        16 sub-blocks of 16: scales[i] = sc | m << 4 (4 bits each); 2-bit q
        w = d * sc * q - dmin * m
    Q3_K (type 11, 110 bytes): hmask[32], qs[64], scales[12], fp16 d
        16 sub-blocks of 16: 6-bit sc (low 4 bits in scales[0..7]'s nibbles, high 2 bits
        in scales[8..11]'s pairs); q = 2 low bits | high bit from hmask; the value is
        q - 4 where the hmask bit is clear, q where it is set
        w = d * (sc - 32) * value
    Q4_K (type 12, 144 bytes): fp16 d, fp16 dmin, scales[12], qs[128]
        8 sub-blocks of 32: 6-bit sc and m packed in 12 bytes (get_scale_min below)
        w = d * sc * q - dmin * m, q 4 bits (each 32 bytes: low nibbles one sub-block,
        high nibbles the next)
    Q5_K (type 13, 176 bytes): fp16 d, fp16 dmin, scales[12], qh[32], qs[128]
        as Q4_K with a fifth bit: bit i of qh[j] for sub-block i's element j
    Q6_K (type 14, 210 bytes): ql[128], qh[64], int8 scales[16], fp16 d
        16 sub-blocks of 16; q = low 4 bits | 2 high bits, w = d * scale * (q - 32)

Bit exact: each product and difference is computed in the same order as the `gguf`
package's numpy dequantizers (and llama.cpp's dequantize_row_*), so the float32 results are
equal bit for bit (tests/unit/test_kquants.py).

The quantizers follow llama.cpp's quantize_row_*_ref (no importance matrix): Q5_0/Q5_1
round each 32-block against its extreme (equal to the `gguf` package's quantizers); Q2_K,
Q4_K and Q5_K fit each sub-block's scale and min by a weighted search over candidate scales
(make_qkx2_quants); Q3_K and Q6_K fit a symmetric scale per sub-block (make_q3_quants,
make_qx_quants); then the sub-block scales are quantized against the super-block's and the
values quantized again with the stored scales. Vectorised over all blocks: the loops are over
candidate scales and sub-block positions, never over blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256
# name -> (ggml type id, elements per block, bytes per block)
KQUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q2_K": (10, QK_K, 84),
    "Q3_K": (11, QK_K, 110),
    "Q4_K": (12, QK_K, 144),
    "Q5_K": (13, QK_K, 176),
    "Q6_K": (14, QK_K, 210),
}
# elements dequantized per pass: bounds the temporaries of one call to a few hundred MB
_CHUNK_ELEMENTS = 1 << 24


def row_bytes(qtype: str, K: int) -> int:
    """Bytes of one row of K values in `qtype` (K a multiple of its block)."""
    _, block, size = block_layout(qtype)
    check_row_length(qtype, K)
    return K // block * size


def block_layout(qtype: str) -> tuple[int, int, int]:
    """(ggml type id, values per block, bytes per block) of `qtype`; ValueError if it is not
    one of KQUANT_TYPES."""
    if qtype not in KQUANT_TYPES:
        raise ValueError(f"qtype must be one of {', '.join(KQUANT_TYPES)}, got {qtype!r}")
    return KQUANT_TYPES[qtype]


def check_row_length(qtype: str, K: int) -> None:
    """ValueError unless rows of K values are whole blocks of `qtype`."""
    block = KQUANT_TYPES[qtype][1]
    if not isinstance(K, int) or K <= 0 or K % block:
        raise ValueError(
            f"{qtype} rows hold whole {block}-value blocks: K must be a positive multiple of {block}, got {K}"
        )


# ---------------------------------------------------------------------------- dequantizers


def dequantize(w: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """The float32 [N, K] values of `w` (uint8 [N, row_bytes] in GGUF layout), equal bit for
    bit to `gguf.quants.dequantize`."""
    _, block, size = block_layout(qtype)
    check_row_length(qtype, K)
    want = K // block * size
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != want:
        raise ValueError(
            f"w must be uint8 [N, {want}] for {qtype} with K={K}, got "
            f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}"
        )
    w = w.contiguous()
    N = w.shape[0]
    out = torch.empty(N, K, dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS // K)
    for start in range(0, N, step):  # whole rows at a time, all their blocks at once
        rows = w[start : start + step]
        out[start : start + step] = _DEQUANTIZERS[qtype](rows.reshape(-1, size)).view(rows.shape[0], K)
    return out


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[B, 2] uint8 (little-endian fp16) -> [B, 1] float32."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _unpack(raw: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """[..., n] bytes -> [..., len(shifts), n]: the `mask` bits of each byte at each shift."""
    s = torch.tensor(shifts, dtype=torch.uint8).view(-1, 1)
    return (raw.unsqueeze(-2) >> s) & mask


def get_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [B, 12] -> the 8 sub-blocks' 6-bit (sc, m), uint8 [B, 8]:
    bytes 0-3 hold sc 0-3 (and sc 4-7's top bits), 4-7 m 0-3 (and m 4-7's top bits), 8-11 the
    low nibbles of sc 4-7 and m 4-7."""
    d, m, low = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, 0:2])  # [B, 1]
    q = _five_bits(blocks[:, 2:6], blocks[:, 6:22])
    return d * (q.to(torch.int16) - 16).to(torch.float32)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    q = _five_bits(blocks[:, 4:8], blocks[:, 8:24])
    return d * q.to(torch.float32) + m  # two roundings, as gguf-py's (d * q) + m


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32 values [B, 32] (0..31) from qh [B, 4] (a little-endian uint32 of high
    bits) and qs [B, 16] (low nibbles: values 0-15, high nibbles: 16-31)."""
    B = qs.shape[0]
    high = _unpack(qh, tuple(range(8)), 1).transpose(1, 2).reshape(B, 32)  # bit j of the uint32
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return low | (high << 4)


def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    B = blocks.shape[0]
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).view(B, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(B, 16, 1)
    q = _unpack(qs.reshape(B, 2, 32), (0, 2, 4, 6), 3).reshape(B, 16, 16).to(torch.float32)
    return (dl * q - ml).view(B, QK_K)


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    B = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    low = _unpack(scales[:, 0:8], (0, 4), 0x0F).reshape(B, 16)
    high = _unpack(scales[:, 8:12], (0, 2, 4, 6), 3).reshape(B, 16)
    sc = ((low | (high << 4)).to(torch.int16) - 32).to(torch.float32)
    dl = (d * sc).view(B, 16, 1)
    ql = _unpack(qs.reshape(B, 2, 32), (0, 2, 4, 6), 3).reshape(B, 16, 16)
    qh = _unpack(hmask.reshape(B, 1, 32), tuple(range(8)), 1).reshape(B, 16, 16) ^ 1  # set bit: no -4
    q = (ql.to(torch.int16) - (qh.to(torch.int16) << 2)).to(torch.float32)
    return (dl * q).view(B, QK_K)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    B = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = get_scale_min(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).view(B, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(B, 8, 1)
    q = _unpack(blocks[:, 16:144].reshape(B, 4, 32), (0, 4), 0x0F).reshape(B, 8, 32).to(torch.float32)
    return (dl * q - ml).view(B, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    B = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = get_scale_min(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).view(B, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(B, 8, 1)
    ql = _unpack(blocks[:, 48:176].reshape(B, 4, 32), (0, 4), 0x0F).reshape(B, 8, 32)
    qh = _unpack(blocks[:, 16:48].reshape(B, 1, 32), tuple(range(8)), 1).reshape(B, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).view(B, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    B = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(blocks[:, 208:210]) * scales).view(B, 16, 1)
    low = _unpack(ql.reshape(B, 2, 64), (0, 4), 0x0F).reshape(B, 8, 32)
    high = _unpack(qh.reshape(B, 2, 32), (0, 2, 4, 6), 3).reshape(B, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.float32).view(B, 16, 16)
    return (d * q).view(B, QK_K)


_DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q5_0": _dequant_q5_0,
    "Q5_1": _dequant_q5_1,
    "Q2_K": _dequant_q2_k,
    "Q3_K": _dequant_q3_k,
    "Q4_K": _dequant_q4_k,
    "Q5_K": _dequant_q5_k,
    "Q6_K": _dequant_q6_k,
}
