"""Reference quantizers for worker_svc/kernels/kquants.py's types: float32 rows [N, K] -> GGUF
blocks uint8 [N, row_bytes], following llama.cpp's quantize_row_*_ref (no importance
matrix), so that tests and `export-gguf` make their own K-quant files.

- Q5_0, Q5_1: each 32-block against its signed extreme (Q5_0: d = max / -16) or its range
  (Q5_1: d = (max - min) / 31, m = min); equal byte for byte to the `gguf` package's.
- Q2_K, Q4_K, Q5_K: each sub-block's scale and min by make_qkx2_quants (a weighted
  least-squares fit over a sweep of candidate scales, keeping the one of least error; min
  clamped to <= 0); the sub-block scales and mins quantized against the super-block's
  largest (4 bits for Q2_K, 6 for Q4_K/Q5_K), then the values again with the stored ones.
- Q3_K: make_q3_quants (symmetric, x^2-weighted, five passes moving single values to a
  better level); Q6_K: make_qx_quants (symmetric, a sweep of 18 candidate scales around
  the extreme's). Their signed sub-block scales are quantized against the largest in
  magnitude (6 bits, 8 bits).

Rounding is llama.cpp's nearest_int (to nearest, ties to even) and float32 arithmetic, but
sums run in torch's order, so a block may differ from llama.cpp's in a last bit of a scale;
every block is valid and decodes the same under any reader. Vectorised over all blocks: the
Python loops are over candidate scales and positions within a sub-block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker_svc.kernels.kquants import QK_K, block_layout, check_row_length

_F32 = torch.float32
_GROUP_MAX_EPS = 1e-15  # llama.cpp's threshold for an all-zero group


def quantize(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """The GGUF blocks (uint8 [N, row_bytes]) of float32 rows `x` [N, K]; K must be a
    multiple of the type's block (32 or 256)."""
    _, block, size = block_layout(qtype)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(
            f"x must be a 2-D float tensor [N, K], got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}"
        )
    N, K = x.shape
    check_row_length(qtype, K)
    blocks = x.detach().to(device="cpu", dtype=_F32).reshape(-1, block)  # [num_blocks, block]
    if not torch.isfinite(blocks).all():
        raise ValueError(f"x has NaN or infinite values: {qtype} blocks hold finite ones only")
    return _QUANTIZERS[qtype](blocks).reshape(N, K // block * size)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """[B] float32 -> [B, 2] uint8, the fp16 (round to nearest even) little-endian."""
    return v.to(torch.float16).view(-1, 1).view(torch.uint8)


def _fp16_round(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).to(_F32)


def _signed_extreme(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [B, n]: (the value of largest magnitude, signed (the first of ties, as
    llama.cpp's strict `>` scan), its magnitude)."""
    i = x.abs().argmax(dim=-1, keepdim=True)
    top = x.gather(-1, i).squeeze(-1)
    return top, top.abs()


def _safe_inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), torch.zeros_like(d))


def _pack_fields(values: torch.Tensor, width: int) -> torch.Tensor:
    """[..., k, n] small integers -> [..., n] bytes: values[..., i, :] << (width * i), OR-ed
    over i (k * width = 8)."""
    out = torch.zeros(values.shape[:-2] + values.shape[-1:], dtype=torch.uint8)
    for i in range(values.shape[-2]):
        out |= values[..., i, :].to(torch.uint8) << (width * i)
    return out


# ------------------------------------------------------------------------- 32-value blocks


def _quant_q5_0(x: torch.Tensor) -> torch.Tensor:
    top, _ = _signed_extreme(x)
    d = top / -16
    q = torch.trunc(x * _safe_inverse(d)[:, None] + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_fp16_bytes(d), *_five_bit_bytes(q)], dim=-1)


def _quant_q5_1(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.min(dim=-1).values, x.max(dim=-1).values
    d = (hi - lo) / 31
    q = torch.trunc((x - lo[:, None]) * _safe_inverse(d)[:, None] + 0.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(lo), *_five_bit_bytes(q)], dim=-1)


def _five_bit_bytes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, 32] (0..31) -> (qh [B, 4]: bit j of a little-endian uint32 is q[j]'s fifth bit,
    qs [B, 16]: q[j] low nibble | q[j + 16] high nibble)."""
    B = q.shape[0]
    qh = _pack_fields((q >> 4).view(B, 4, 8).transpose(1, 2), 1)  # [B, bit, byte] -> [B, byte]
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    return qh, qs


# ------------------------------------------------------------------- sub-block scale fits


def _affine_fit(
    x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's make_qkx2_quants on each row of x [B, n]: x ~ scale * L - offset with
    levels L in [0, nmax] and offset >= 0, fitted by weighted least squares for each of
    nstep + 1 candidate inverse scales, (rmin + rdelta * i + nmax) / (max - min), keeping the
    fit of least weighted error (absolute with `use_mad`, else squared). Returns
    (scale [B], offset [B], L [B, n])."""
    lo = x.min(dim=-1).values.clamp(max=0)
    hi = x.max(dim=-1).values
    flat = hi == lo
    span = torch.where(flat, 1.0, hi - lo)
    sum_w = weights.sum(-1)
    sum_x = (weights * x).sum(-1)

    def levels(iscale: torch.Tensor) -> torch.Tensor:
        return torch.round(iscale[:, None] * (x - lo[:, None])).clamp(0, nmax)

    def error(scale: torch.Tensor, low: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
        diff = scale[:, None] * L + low[:, None] - x
        return (weights * (diff.abs() if use_mad else diff * diff)).sum(-1)

    iscale = nmax / span
    scale, low = 1.0 / iscale, lo
    L = levels(iscale)
    best = error(scale, low, L)
    for i in range(nstep + 1):
        Lc = levels((rmin + rdelta * i + nmax) / span)
        sum_l, sum_l2, sum_xl = (weights * Lc).sum(-1), (weights * Lc * Lc).sum(-1), (weights * Lc * x).sum(-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        Ds = torch.where(D > 0, D, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_low = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        positive = this_low > 0  # a min above zero: refit the scale alone, min 0
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_low = torch.where(positive, 0.0, this_low)
        err = error(this_scale, this_low, Lc)
        better = (D > 0) & (err < best)
        L = torch.where(better[:, None], Lc, L)
        best = torch.where(better, err, best)
        scale, low = torch.where(better, this_scale, scale), torch.where(better, this_low, low)
    scale = torch.where(flat, 0.0, scale)
    L = torch.where(flat[:, None], 0.0, L)
    return scale, -torch.where(flat, lo, low), L


def _symmetric_fit_q3(x: torch.Tensor, nmax: int = 4) -> torch.Tensor:
    """llama.cpp's make_q3_quants(do_rmse) on each row of x [B, n]: x ~ scale * l, l in
    [-nmax, nmax - 1], x^2-weighted, starting from the extreme's scale and then moving one
    value at a time to the level that lowers the error (five passes). Returns scale [B]."""
    top, amax = _signed_extreme(x)
    zero = amax < _GROUP_MAX_EPS
    iscale = -nmax / torch.where(zero, 1.0, top)
    L = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
    w = x * x
    sumlx, suml2 = (w * x * L).sum(-1), (w * L * L).sum(-1)
    for _ in range(5):
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = torch.round(xi * sl2 / torch.where(slx > 0, slx, 1.0)).clamp(-nmax, nmax - 1)
            slx_new, sl2_new = slx + wi * xi * new, sl2 + wi * new * new
            take = (slx > 0) & (new != li) & (sl2_new > 0) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            L[:, i] = torch.where(take, new, li)
            sumlx, suml2 = torch.where(take, slx_new, sumlx), torch.where(take, sl2_new, suml2)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), 0.0)
    return torch.where(zero, 0.0, scale)


def _symmetric_fit_q6(x: torch.Tensor, nmax: int = 32) -> torch.Tensor:
    """llama.cpp's make_qx_quants(rmse_type 1) on each row of x [B, n]: x ~ scale * l, l in
    [-nmax, nmax - 1], x^2-weighted least squares for the extreme's inverse scale and 18
    around it, -(nmax + 0.1 i) / max, keeping the best. Returns scale [B]."""
    top, amax = _signed_extreme(x)
    zero = amax < _GROUP_MAX_EPS
    top = torch.where(zero, 1.0, top)
    w = x * x

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        L = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        return (w * x * L).sum(-1), (w * L * L).sum(-1)

    sumlx, suml2 = fit(-nmax / top)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), 0.0)
    best = scale * sumlx
    for i in (*range(-9, 0), *range(1, 10)):
        slx, sl2 = fit(-(nmax + 0.1 * i) / top)
        take = (sl2 > 0) & (slx * slx > best * sl2)
        scale = torch.where(take, slx / torch.where(sl2 > 0, sl2, 1.0), scale)
        best = torch.where(take, scale * slx, best)
    return torch.where(zero, 0.0, scale)


def _codes(values: torch.Tensor, top: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative sub-block values [B, m] as codes round(values * nmax / top) in [0, nmax]
    and the super-block step top / nmax (fp16-rounded, as stored)."""
    inv = torch.where(top > 0, nmax / torch.where(top > 0, top, 1.0), 0.0)
    codes = torch.round(inv[:, None] * values).clamp(0, nmax)
    return codes, _fp16_round(top / nmax)


def _requantize(
    x: torch.Tensor, step: torch.Tensor, offset: torch.Tensor | float, default: torch.Tensor | int, lo: int, hi: int
) -> torch.Tensor:
    """The levels of x [B, m, n] under the stored sub-block steps [B, m] and offsets [B, m]
    (x ~ step * L - offset), clamped to [lo, hi]; a sub-block of step 0 (all its values
    decode to -offset whatever the level) takes `default`."""
    s = step[..., None]
    off = offset[..., None] if isinstance(offset, torch.Tensor) else offset
    new = torch.round((x + off) / torch.where(s != 0, s, 1.0)).clamp(lo, hi)
    return torch.where(s != 0, new, default)


def _pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 8 six-bit (sc, m) [B, 8] -> 12 bytes [B, 12] (kquants.get_scale_min's
    inverse)."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    return torch.cat(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        dim=-1,
    )


# ------------------------------------------------------------------------ 256-value blocks


def _quant_q2_k(x: torch.Tensor) -> torch.Tensor:
    B = x.shape[0]
    sub = x.view(B * 16, 16)
    scale, offset, L = _affine_fit(sub, sub.abs(), 3, -0.5, 0.1, 15, use_mad=True)
    scale, offset = scale.view(B, 16), offset.view(B, 16)
    sc, d = _codes(scale, scale.max(-1).values.clamp(min=0), 15)
    mc, dmin = _codes(offset, offset.max(-1).values.clamp(min=0), 15)
    L = _requantize(x.view(B, 16, 16), d[:, None] * sc, dmin[:, None] * mc, L.view(B, 16, 16), 0, 3)
    qs = _pack_fields(L.view(B, 2, 4, 32), 2).view(B, 64)
    scales = sc.to(torch.uint8) | (mc.to(torch.uint8) << 4)
    return torch.cat([scales, qs, _fp16_bytes(d), _fp16_bytes(dmin)], dim=-1)


def _quant_q3_k(x: torch.Tensor) -> torch.Tensor:
    B = x.shape[0]
    scale = _symmetric_fit_q3(x.view(B * 16, 16)).view(B, 16)
    top, _ = _signed_extreme(scale)
    iscale = torch.where(top != 0, -32 / torch.where(top != 0, top, 1.0), 0.0)
    codes = torch.round(iscale[:, None] * scale).clamp(-32, 31) + 32  # [B, 16] in 0..63
    d = _fp16_round(_safe_inverse(iscale))
    L = _requantize(x.view(B, 16, 16), d[:, None] * (codes - 32), 0.0, 0, -4, 3).view(B, QK_K) + 4
    high = L > 3
    hmask = _pack_fields(high.view(B, 8, 32), 1)
    qs = _pack_fields((L - 4 * high).view(B, 2, 4, 32), 2).view(B, 64)
    c = codes.to(torch.uint8)
    scales = torch.cat([(c[:, :8] & 0x0F) | ((c[:, 8:] & 0x0F) << 4), _pack_fields((c >> 4).view(B, 4, 4), 2)], dim=-1)
    return torch.cat([hmask, qs, scales, _fp16_bytes(d)], dim=-1)


def _quant_q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, ...]:
    """Q4_K's and Q5_K's common part: (d, dmin, the 12 scale bytes, levels [B, 256] in
    [0, nmax]) of x [B, 256], sub-blocks of 32 weighted by rms + |x|."""
    B = x.shape[0]
    sub = x.view(B * 8, 32)
    weights = (sub * sub).sum(-1).div(32).sqrt()[:, None] + sub.abs()
    scale, offset, L = _affine_fit(sub, weights, nmax, rmin, 0.1, nstep, use_mad=False)
    scale, offset = scale.view(B, 8), offset.view(B, 8)
    sc, d = _codes(scale, scale.max(-1).values.clamp(min=0), 63)
    mc, dmin = _codes(offset, offset.max(-1).values.clamp(min=0), 63)
    L = _requantize(x.view(B, 8, 32), d[:, None] * sc, dmin[:, None] * mc, L.view(B, 8, 32), 0, nmax)
    return d, dmin, _pack_scale_min(sc, mc), L.view(B, QK_K)


def _quant_q4_k(x: torch.Tensor) -> torch.Tensor:
    B = x.shape[0]
    d, dmin, scales, L = _quant_q45_k(x, 15, -1.0, 20)
    qs = _pack_fields(L.view(B, 4, 2, 32), 4).view(B, 128)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, qs], dim=-1)


def _quant_q5_k(x: torch.Tensor) -> torch.Tensor:
    B = x.shape[0]
    d, dmin, scales, L = _quant_q45_k(x, 31, -0.5, 15)
    qh = _pack_fields((L.to(torch.uint8) >> 4).view(B, 8, 32), 1)
    qs = _pack_fields((L.to(torch.uint8) & 0x0F).view(B, 4, 2, 32), 4).view(B, 128)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, qh, qs], dim=-1)


def _quant_q6_k(x: torch.Tensor) -> torch.Tensor:
    B = x.shape[0]
    scale = _symmetric_fit_q6(x.view(B * 16, 16)).view(B, 16)
    top, amax = _signed_extreme(scale)
    live = amax >= _GROUP_MAX_EPS
    iscale = torch.where(live, -128 / torch.where(live, top, 1.0), 0.0)
    d = _fp16_round(_safe_inverse(iscale))
    codes = torch.round(iscale[:, None] * scale).clamp(-128, 127)  # [B, 16]
    L = (_requantize(x.view(B, 16, 16), d[:, None] * codes, 0.0, 0, -32, 31) + 32).to(torch.uint8)
    L = L.view(B, 2, 4, 32)  # [half, quarter, element]: quarters 0/1 low nibbles, 2/3 high
    low = L & 0x0F
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(B, 128)
    qh = _pack_fields(L >> 4, 2).view(B, 64)
    return torch.cat([ql, qh, codes.to(torch.int8).view(torch.uint8), _fp16_bytes(d)], dim=-1)


_QUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q5_0": _quant_q5_0,
    "Q5_1": _quant_q5_1,
    "Q2_K": _quant_q2_k,
    "Q3_K": _quant_q3_k,
    "Q4_K": _quant_q4_k,
    "Q5_K": _quant_q5_k,
    "Q6_K": _quant_q6_k,
}
