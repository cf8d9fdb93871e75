"""Rotary position embeddings, with the scaling kinds that Llama 3 and common checkpoints use.

The inverse frequencies are computed exactly as transformers computes them, so that
positions rotate bit for bit alike.

LongRoPE (Phi-3): two sets of frequencies, the short factors' for positions below
`original_max_position_embeddings` and the long factors' from there on, chosen per token
(as vLLM does). transformers chooses per forward pass by the longest position in it, so a
prompt that crosses that length in one pass rotates its earlier tokens differently there;
below it both agree exactly.
"""

from __future__ import annotations

import math

import torch

from worker_svc.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2] float32, attention_factor) for the rope kind."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    if rope.rope_type == "longrope":
        return _longrope(rope, dim, long=False)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(rope: RopeConfig, dim: int, long: bool) -> tuple[torch.Tensor, float]:
    orig = rope.original_max_position_embeddings
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * rope.theta**shape), float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin of each token's absolute position, computed as the reference computes them."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor
        self.max_positions = max_positions
        self.long_from: int | None = None  # LongRoPE: positions from here take `long_inv_freq`
        if rope.rope_type == "longrope":
            long_inv_freq, _ = _longrope(rope, head_dim, long=True)
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
            self.long_from = rope.original_max_position_embeddings

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [num_tokens, 1, head_dim], in the activations' dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim // 2]
        if self.long_from is not None:
            long = positions.float()[:, None] * self.long_inv_freq[None, :]
            freqs = torch.where((positions >= self.long_from)[:, None], long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_factor).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_factor).to(dtype)[:, None, :]
        return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` ([num_tokens, heads, head_dim]) rotated by each token's cos/sin."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
