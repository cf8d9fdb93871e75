"""Counter-based randomness for the sampler's exponential race.

A sampled row draws one uniform per vocabulary entry from a stateless 32-bit integer hash of
(seed, choice_index, output_position, token_id): nothing else enters the draw, so a seeded
choice gives the same token whatever batch or row it lands in, whatever the pipeline split, and
after preemption and recompute. The hash uses only int64 shifts, xors, masks and products that
stay below 2**63, so CPU and CUDA produce the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK32 = 0xFFFFFFFF
# lowbias32 (Chris Wellons' hash prospector): a 32-bit bijection with good avalanche.
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x846CA68B
# Two independent lanes of 32 bits each give every (seed, choice, position) a 64-bit key.
_LANE_IVS = (0x9E3779B9, 0x85EBCA77)
# Turns 32 random bits into a uniform in (0, 1): (bits + 0.5) / 2**32, exact in float64.
_INV_2_32 = 2.0**-32


def _mix32_int(x: int) -> int:
    """lowbias32 on a Python int in [0, 2**32); the reference for _mix32."""
    x ^= x >> 16
    x = (x * _MIX_MUL_1) & _MASK32
    x ^= x >> 15
    x = (x * _MIX_MUL_2) & _MASK32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), exactly: the constant is split in 16-bit
    halves so every intermediate stays below 2**49 (no signed overflow on any device)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 elementwise on int64 values in [0, 2**32). Shifts of non-negative values are
    logical, so torch's arithmetic right shift is harmless here."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MUL_2)
    return x ^ (x >> 16)


def key_prefix(seed: int, choice_index: int) -> tuple[int, int]:
    words = (seed & _MASK32, seed >> 32, choice_index)
    lanes = []
    for lane in _LANE_IVS:
        for word in words:
            lane = _mix32_int(lane ^ word)
        lanes.append(lane)
    return lanes[0], lanes[1]


def row_key(seed: int, choice_index: int, output_position: int) -> tuple[int, int]:
    """The two 32-bit hash keys of one draw: each lane folds seed (as two 32-bit words),
    choice_index and output_position through lowbias32 from its own starting value."""
    return position_key(key_prefix(seed, choice_index), output_position)


def position_key(prefix: tuple[int, int], output_position: int) -> tuple[int, int]:
    """`row_key` from the lanes already folded over (seed, choice_index) (`key_prefix`)."""
    return _mix32_int(prefix[0] ^ output_position), _mix32_int(prefix[1] ^ output_position)


def uniform_bits(keys: Sequence[tuple[int, int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[rows, vocab] int64 in [0, 2**32): the random word of each (row key, token id).

    bits = mix(mix(token_id ^ key_a) ^ key_b), a keyed two-round hash of the token id.
    """
    key_a = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=device).unsqueeze(1)
    key_b = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=device).unsqueeze(1)
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0)
    return _mix32(_mix32(token_ids ^ key_a) ^ key_b)


def log_exponential_noise(keys: Sequence[tuple[int, int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[rows, vocab] float32 log E with E = -log U ~ Exp(1), U = (bits + 0.5) / 2**32 in (0, 1).

    Computed in float64 so that U keeps all 32 bits and never rounds to 0 or 1.
    """
    u = (uniform_bits(keys, vocab_size, device).double() + 0.5) * _INV_2_32
    return torch.log(-torch.log(u)).float()
