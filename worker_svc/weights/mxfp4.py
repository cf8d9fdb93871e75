"""MXFP4 weights (gpt-oss's experts) in Hugging Face's layout and in ggml's.

Both store 32-value blocks of 4-bit E2M1 codes with one E8M0 scale byte each, and the same
code means the same value: a nibble q indexes FP4_VALUES (+-0, 0.5, 1, 1.5, 2, 3, 4, 6),
ggml's table kvalues_mxfp4 holds those doubled and its scale is halved, so

    Hugging Face: FP4_VALUES[q] * 2^(s - 127)      ggml: KV[q] * 2^(e - 128), KV = 2 FP4_VALUES

with e = s. Only where a value's nibble sits differs:

- Hugging Face (`<name>_blocks` uint8 [..., rows, K / 32, 16], `<name>_scales` uint8
  [..., rows, K / 32]): byte i of a block holds elements 2i (low nibble) and 2i + 1 (high);
- ggml (type 39, worker_svc/kernels/block_formats.py; rows uint8 [rows, K / 32 * 17], each
  block e then qs[16]): qs[j] holds elements j (low nibble) and j + 16 (high).

So `hf_to_ggml_mxfp4` only moves nibbles within each block: the values are the same bits,
nothing is requantized. transformers' `convert_moe_packed_tensors` dequantizes the Hugging
Face layout to the transpose, [E, K, rows] (gpt-oss's experts hold [in, out]);
`hf_mxfp4_dequantize` gives [..., rows, K], one row per output like an nn.Linear weight.

`quantize_mxfp4` is ggml's quantize_row_mxfp4_ref (byte for byte gguf-py's MXFP4 quantizer):
per block e = floor(log2(amax)) - 2 + 127 (0 for an all-zero block; clamped at 0 for amax
below 2^-125), each value the nearest of KV * 2^(e - 128), the first in KV order on a tie.
The largest block value maps to at most 12 * 2^(e - 128) = 1.5 * 2^floor(log2(amax)), so a
block's extreme may be clipped by up to a quarter, as ggml's is.
"""

from __future__ import annotations

import torch

from worker_svc.kernels.block_formats import MXFP4_KVALUES, dequantize, e8m0_half

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per block
BLOCK_BYTES = 17  # ggml's block: e, qs[16]
_CHUNK_BLOCKS = 1 << 14  # blocks quantized at once: bounds the [chunk, 32, 16] error tensor (32 MB)


def _check_hf(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if (
        not isinstance(blocks, torch.Tensor)
        or blocks.dtype != torch.uint8
        or blocks.dim() < 2
        or blocks.shape[-1] != 16
    ):
        raise ValueError(
            f"blocks must be uint8 [..., K / 32, 16], got {getattr(blocks, 'dtype', type(blocks))} "
            f"{tuple(getattr(blocks, 'shape', ()))}"
        )
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"scales must be uint8 {tuple(blocks.shape[:-1])} (blocks' shape without the last "
            f"dimension), got {getattr(scales, 'dtype', type(scales))} "
            f"{tuple(getattr(scales, 'shape', ()))}"
        )


def hf_to_ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hugging Face MXFP4 (`blocks` uint8 [..., rows, K / 32, 16], `scales` uint8 [..., rows,
    K / 32]) as ggml MXFP4 rows uint8 [..., rows, K / 32 * 17]: the same values bit for bit."""
    _check_hf(blocks, scales)
    b = blocks.contiguous()
    lo, hi = b[..., :8], b[..., 8:]  # elements 0-15 and 16-31, two a byte
    even = (lo & 0x0F) | (hi << 4)  # qs[2m]: elements 2m and 2m + 16
    odd = (lo >> 4) | (hi & 0xF0)  # qs[2m + 1]: elements 2m + 1 and 2m + 17
    qs = torch.stack([even, odd], dim=-1).view(*b.shape)
    out = torch.cat([scales.contiguous().unsqueeze(-1), qs], dim=-1)  # [..., rows, K / 32, 17]
    return out.view(*b.shape[:-2], b.shape[-2] * BLOCK_BYTES)


def ggml_to_hf_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows uint8 [..., row_bytes] (row_bytes = K / 32 * 17) as Hugging Face's
    (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]): `hf_to_ggml_mxfp4`'s inverse."""
    if (
        not isinstance(rows, torch.Tensor)
        or rows.dtype != torch.uint8
        or rows.dim() < 1
        or rows.shape[-1] % BLOCK_BYTES
    ):
        raise ValueError(
            f"rows must be uint8 [..., K / 32 * {BLOCK_BYTES}], got "
            f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}"
        )
    g = rows.contiguous().view(*rows.shape[:-1], rows.shape[-1] // BLOCK_BYTES, BLOCK_BYTES)
    qs = g[..., 1:].reshape(*g.shape[:-1], 8, 2)
    even, odd = qs[..., 0], qs[..., 1]  # qs[2m], qs[2m + 1]
    lo = (even & 0x0F) | (odd << 4)  # byte m: elements 2m, 2m + 1
    hi = (even >> 4) | (odd & 0xF0)  # byte 8 + m: elements 16 + 2m, 17 + 2m
    return torch.cat([lo, hi], dim=-1), g[..., 0].contiguous()


def hf_mxfp4_dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The values of Hugging Face MXFP4 weights as `dtype` [..., rows, K]: FP4_VALUES[q] *
    2^(s - 127), exact in float32 and then rounded to `dtype` (every value but overflows is
    exact in bfloat16 and float32). transformers' convert_moe_packed_tensors gives the same
    values transposed over the last two dimensions (for every scale byte, 255 included:
    what overflows is infinite in both)."""
    ggml = hf_to_ggml_mxfp4(blocks, scales)
    K = blocks.shape[-2] * BLOCK
    flat = ggml.view(-1, ggml.shape[-1])
    return dequantize(flat, "MXFP4", K).view(*blocks.shape[:-2], K).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """ggml MXFP4 rows uint8 [N, K / 32 * 17] of float rows `x` [N, K] (K % 32 == 0), as ggml's
    quantize_row_mxfp4_ref (module docstring)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point() or x.shape[1] % BLOCK:
        raise ValueError(
            f"x must be a 2-D float tensor [N, K] with K a multiple of {BLOCK}, got "
            f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}"
        )
    N, K = x.shape
    blocks = x.detach().to(device="cpu", dtype=torch.float32).reshape(-1, BLOCK)
    if not torch.isfinite(blocks).all():
        raise ValueError("x has NaN or infinite values: MXFP4 blocks hold finite ones only")
    out = torch.empty(blocks.shape[0], BLOCK_BYTES, dtype=torch.uint8)
    kv = torch.tensor(MXFP4_KVALUES, dtype=torch.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        v = blocks[start : start + _CHUNK_BLOCKS]
        amax = v.abs().amax(dim=-1)
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax))
        e = exp.clamp(0, 255).to(torch.uint8)
        d = e8m0_half(e).unsqueeze(-1)  # [B, 1]
        q = ((d.unsqueeze(-1) * kv - v.unsqueeze(-1)).abs()).argmin(dim=-1).to(torch.uint8)  # [B, 32]
        out[start : start + _CHUNK_BLOCKS, 0] = e
        out[start : start + _CHUNK_BLOCKS, 1:] = q[:, :16] | (q[:, 16:] << 4)
    return out.view(N, K // BLOCK * BLOCK_BYTES)


def quantize_hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights `w` [..., rows, K] (one row per output; transformers' gpt-oss experts hold
    the transpose) as Hugging Face MXFP4 (blocks uint8 [..., rows, K / 32, 16], scales uint8
    [..., rows, K / 32]), quantized as `quantize_mxfp4`."""
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        raise ValueError(
            f"w must be a float tensor [..., rows, K], got {getattr(w, 'dtype', type(w))} "
            f"{tuple(getattr(w, 'shape', ()))}"
        )
    K = w.shape[-1]
    ggml = quantize_mxfp4(w.reshape(-1, K))
    blocks, scales = ggml_to_hf_mxfp4(ggml)
    return blocks.view(*w.shape[:-1], K // BLOCK, 16), scales.view(*w.shape[:-1], K // BLOCK)
