"""GGUF K-quants and Q5_0/Q5_1 (worker_svc/kernels/kquants.py, worker_svc/weights/kquants_ref.py): the
dequantizers equal the `gguf` package's numpy ones bit for bit, on random valid blocks and
on the reference quantizers' blocks; rows that are not whole blocks are refused; each
quantizer's round trip is within its bit width's bound."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from worker_svc.kernels.kquants import KQUANT_TYPES, dequantize, row_bytes
from worker_svc.weights.kquants_ref import quantize

TYPES = list(KQUANT_TYPES)
# the byte ranges of each type's fp16 fields (d, and dmin or m), within a block
FP16_FIELDS = {
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
BITS = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5}


def _row_lengths(qtype: str) -> tuple[int, ...]:
    return (256, 768) if KQUANT_TYPES[qtype][1] == 256 else (32, 96, 288)


def _theirs(blocks: torch.Tensor, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(KQUANT_TYPES[qtype][0]))


def _assert_bit_equal(ours: torch.Tensor, theirs: np.ndarray) -> None:
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    same = ours.numpy().view(np.uint32) == theirs.astype(np.float32).view(np.uint32)
    assert same.all(), (ours.numpy()[~same][:5], theirs[~same][:5])


def _random_blocks(qtype: str, N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes, every bit pattern valid, with finite fp16 scales (of either sign)."""
    _, block, size = KQUANT_TYPES[qtype]
    raw = torch.randint(0, 256, (N * K // block, size), generator=g, dtype=torch.uint8)
    for at in FP16_FIELDS[qtype]:
        scale = torch.randn(raw.shape[0], generator=g) * torch.exp2(torch.randint(-12, 4, (raw.shape[0],), generator=g))
        raw[:, at : at + 2] = scale.to(torch.float16).view(-1, 1).view(torch.uint8)
    return raw.view(N, K // block * size)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf_on_random_blocks(qtype):
    g = torch.Generator().manual_seed(KQUANT_TYPES[qtype][0])
    for K in _row_lengths(qtype):
        for N in (1, 3, 7):
            w = _random_blocks(qtype, N, K, g)
            assert w.shape == (N, row_bytes(qtype, K))
            _assert_bit_equal(dequantize(w, qtype, K), _theirs(w, qtype).reshape(N, K))


def _samples(K: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Rows of several shapes of distribution; odd row counts."""
    heavy = torch.distributions.StudentT(2.0).sample((5, K))
    rows = {
        "gaussian": torch.randn(7, K, generator=g),
        "uniform": torch.rand(3, K, generator=g) * 6 - 1,
        "positive": torch.rand(3, K, generator=g) + 0.5,
        "heavy": heavy,
        "small": torch.randn(3, K, generator=g) * 1e-3,
    }
    special = torch.randn(5, K, generator=g)
    special[0] = 0.0  # an all-zero row
    special[1] = 0.75  # a constant row
    special[2, : K // 2] = 0.0  # half zeros
    special[3, ::7] *= 40  # outliers
    rows["special"] = special
    return rows


@pytest.mark.parametrize("qtype", TYPES)
def test_quantizer_blocks_decode_as_gguf_decodes_them(qtype):
    g = torch.Generator().manual_seed(11)
    torch.manual_seed(11)  # StudentT samples from the global generator
    for K in _row_lengths(qtype):
        for name, x in _samples(K, g).items():
            w = quantize(x, qtype)
            assert w.dtype == torch.uint8 and w.shape == (x.shape[0], row_bytes(qtype, K)), name
            _assert_bit_equal(dequantize(w, qtype, K), _theirs(w, qtype).reshape(x.shape))


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_q5_quantizers_equal_gguf_byte_for_byte(qtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 96, generator=g) * 3
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType(KQUANT_TYPES[qtype][0]))
    assert np.array_equal(quantize(x, qtype).numpy(), theirs)


@pytest.mark.parametrize("qtype", TYPES)
def test_round_trip_error_within_the_bit_width(qtype):
    """Each bit halves the error: on Gaussian rows the relative RMS error is at most
    1.5 * 2^-bits (measured 1.13-1.44x), and no value is off by more than 2^-(bits-1) of its
    block's largest magnitude (a super-block's for the K-quants; 1.1x that for the fp16
    scales' rounding: Q6_K's d of rows near 1e-3 is an fp16 subnormal, measured 1.03x). All-
    zero rows come back zero; a constant row within 2^-bits."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    bits, block = BITS[qtype], KQUANT_TYPES[qtype][1]
    for K in _row_lengths(qtype):
        x = torch.randn(31, K, generator=g)
        back = dequantize(quantize(x, qtype), qtype, K)
        rel = ((back - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item()
        assert rel <= 1.5 * 2.0**-bits, (K, rel)
        for name, rows in _samples(K, g).items():
            back = dequantize(quantize(rows, qtype), qtype, K)
            err = (back - rows).abs().view(-1, block)
            amax = rows.abs().view(-1, block).amax(-1, keepdim=True)
            assert (err <= 1.1 * amax * 2.0 ** -(bits - 1)).all(), (name, (err / amax).max())
        special = _samples(K, g)["special"]
        back = dequantize(quantize(special, qtype), qtype, K)
        assert torch.equal(back[0], torch.zeros(K))
        assert ((back[1] - 0.75).abs() <= 0.75 * 2.0**-bits).all(), back[1][:4]


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_of_partial_blocks_are_refused(qtype):
    block = KQUANT_TYPES[qtype][1]
    K = block + 32 if block == 256 else 48
    with pytest.raises(
        ValueError,
        match=f"{qtype} rows hold whole {block}-value blocks: K must be a positive multiple of {block}, got {K}",
    ):
        quantize(torch.randn(3, K), qtype)
    with pytest.raises(ValueError, match=f"multiple of {block}, got {K}"):
        dequantize(torch.zeros(3, 100, dtype=torch.uint8), qtype, K)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="qtype must be one of Q5_0, Q5_1, Q2_K"):
        dequantize(torch.zeros(1, 144, dtype=torch.uint8), "Q4_0", 256)
    with pytest.raises(ValueError, match=r"w must be uint8 \[N, 144\] for Q4_K with K=256"):
        dequantize(torch.zeros(1, 143, dtype=torch.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="x must be a 2-D float tensor"):
        quantize(torch.zeros(256), "Q4_K")
    with pytest.raises(ValueError, match="x has NaN or infinite values"):
        quantize(torch.full((1, 256), float("inf")), "Q4_K")


def test_types_match_gguf_constants():
    for name, (type_id, block, size) in KQUANT_TYPES.items():
        qtype = gguf.GGMLQuantizationType[name]
        assert int(qtype) == type_id and gguf.GGML_QUANT_SIZES[qtype] == (block, size), name
