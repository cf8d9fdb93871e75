"""The native kernels of the K-quants (Q2_K ... Q6_K) and Q5_0/Q5_1 (csrc/kquant_matmul.inc,
csrc/quant_matmul.c) against float64 products of the dequantized weights
(worker_svc/kernels/kquants.py, itself bit-equal to the `gguf` package), on every ISA path this CPU
runs, at both activation precisions.

Tolerances (as tests/unit/test_quant_kernels.py's):
- against float64 of the dequantized weights times the kernel's own quantized activations
  (per 32-block for Q5_0/Q5_1, per 256-block for the K-quants): the integer sums are exact,
  so only float32 rounding is left (the per-block d_w d_x, the sum of K / block terms, and
  dequantize's own rounding of d s and dmin m): |y - ref| <= 1e-6 * sum |xq| |w| (measured
  < 1.2e-7 for every type, path and act_bits);
- against the float32 activations: each element moves by at most d_x / 2 of its block, so
  |y - ref| <= sum over blocks of d_x / 2 * sum |w| (+ the above).
"""

from __future__ import annotations

import functools

import pytest
import torch

from worker_svc.kernels import block_formats
from worker_svc.kernels import quant_kernels as qk
from worker_svc.kernels.kquants import KQUANT_TYPES, dequantize
from worker_svc.weights.kquants_ref import quantize

KERNELS = qk.quant_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native kernels unavailable (no C compiler?)")

TOL = 1e-6
SUPER = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TYPES = ("Q5_0", "Q5_1", *SUPER)
TS = (1, 2, 5, 12, 33, 64)
N = 7  # not a multiple of 4: the row tiles' tails
# the byte offsets of each type's fp16 fields (d, and dmin or m) within a block
FP16_FIELDS = {
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def row_lengths(qtype: str) -> tuple[int, ...]:
    return (256, 512, 768) if qtype in SUPER else (96, 256)


def block_of(qtype: str) -> int:
    return 256 if qtype in SUPER else 32


@functools.cache
def kernels(isa: str) -> qk.QuantKernels:
    return qk.QuantKernels(KERNELS.path, isa=isa)


def kernels_or_skip(isa: str) -> qk.QuantKernels:
    if isa not in KERNELS.available:
        pytest.skip(f"this CPU does not run the {isa} path (it runs {KERNELS.available})")
    return kernels(isa)


@functools.cache
def weights(qtype: str, rows: int, K: int, kind: str = "quantized") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks uint8 [rows, row_bytes] and their float64 values: the reference quantizer's
    blocks of shifted normal rows (mins and offsets matter), or random bytes (every bit
    pattern: extreme scales and values) with finite fp16 scales."""
    g = torch.Generator().manual_seed(K * 31 + rows + KQUANT_TYPES[qtype][0])
    if kind == "quantized":
        w = torch.randn(rows, K, generator=g) * 0.1
        w[:, :40] += 0.3
        w[0, :32] = 0.0
        blocks = quantize(w, qtype)
    else:
        _, block, size = KQUANT_TYPES[qtype]
        raw = torch.randint(0, 256, (rows * K // block, size), generator=g, dtype=torch.uint8)
        for at in FP16_FIELDS[qtype]:
            scale = torch.randn(raw.shape[0], generator=g) * 0.01
            raw[:, at : at + 2] = scale.to(torch.float16).view(-1, 1).view(torch.uint8)
        blocks = raw.view(rows, -1).contiguous()
    return blocks, dequantize(blocks, qtype, K).double()


def activations(T: int, K: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(T * 7 + K)
    x = torch.randn(T, K, generator=g) * 2.0
    x[0, :32] = 0.0  # an all-zero 32-block (and a 256-block with fewer values)
    return x


def dequantized_activations(
    k: qk.QuantKernels, x: torch.Tensor, act_bits: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 q * d of the kernel's own activations, and d per element."""
    q, d = k.quantize_activations(x, act_bits=act_bits, block=block)
    d_el = d.double().repeat_interleave(block, dim=1)
    return q.double() * d_el, d_el


def check_product(
    k: qk.QuantKernels, qtype: str, blocks: torch.Tensor, w: torch.Tensor, x: torch.Tensor, act_bits: int
) -> None:
    y = k.matmul(x, blocks, qtype, act_bits=act_bits)
    assert y.shape == (x.shape[0], blocks.shape[0]) and y.dtype == torch.float32
    xq, d_el = dequantized_activations(k, x, act_bits, block_of(qtype))
    mag = xq.abs() @ w.abs().T
    err = (y.double() - xq @ w.T).abs()
    assert (err <= TOL * mag).all(), f"max err / mag {(err / mag.clamp_min(1e-300)).max():.3g}"
    bound = (d_el / 2 * 1.0001) @ w.abs().T + TOL * (x.double().abs() @ w.abs().T)
    assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("act_bits", (8, 16))
def test_kquant_matmul_matches_float64(isa: str, qtype: str, act_bits: int) -> None:
    k = kernels_or_skip(isa)
    for K in row_lengths(qtype):
        blocks, w = weights(qtype, N, K)
        for T in TS:
            check_product(k, qtype, blocks, w, activations(T, K), act_bits)


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("act_bits", (8, 16))
def test_random_blocks_every_bit_pattern(isa: str, qtype: str, act_bits: int) -> None:
    k = kernels_or_skip(isa)
    K = row_lengths(qtype)[1]
    blocks, w = weights(qtype, 33, K, kind="random")
    for T in (1, 12, 17):
        check_product(k, qtype, blocks, w, activations(T, K), act_bits)


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("act_bits", (8, 16))
def test_int32_sums_do_not_overflow_at_the_extremes(isa: str, act_bits: int) -> None:
    """The largest int16 sum a lane can take: Q6_K at q = 0 (value -32) under scale -128 with
    every activation at its block's extreme, 16 products of 4096 * 32767 a lane (< 2^31)."""
    k = kernels_or_skip(isa)
    block = torch.zeros(210, dtype=torch.uint8)
    block[192:208] = 0x80  # int8 scales -128
    block[208:210] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    blocks = block.repeat(3, 2)  # 3 rows of K = 512
    x = torch.full((2, 512), 3.0)
    x[1] = -3.0
    y = k.matmul(x, blocks, "Q6_K", act_bits=act_bits)
    want = 512 * 4096 * 3.0
    assert torch.equal(y, torch.tensor([[want] * 3, [-want] * 3]))


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("act_bits", (8, 16))
def test_super_block_activation_quantization(isa: str, act_bits: int) -> None:
    """Per 256-block: d = amax / 127 (int8; q = round(x * (1 / d))) or amax / 32767 (int16;
    q = round(x / d)), half away from zero, in float32: the same bits on every path."""
    k = kernels_or_skip(isa)
    x = activations(5, 768)
    q, d = k.quantize_activations(x, act_bits=act_bits, block=256)
    b = x.view(5, 3, 256)
    levels = 127.0 if act_bits == 8 else 32767.0
    want_d = b.abs().amax(dim=-1) / torch.tensor(levels)
    v = b * (1.0 / want_d).unsqueeze(-1) if act_bits == 8 else b / want_d.unsqueeze(-1)
    a = v.abs()
    want_q = torch.sign(v) * (torch.floor(a) + torch.floor(2.0 * (a - torch.floor(a))))
    assert torch.equal(d, want_d)
    assert torch.equal(q.float(), want_q.view(5, 768))
    assert q.dtype == (torch.int16 if act_bits == 16 else torch.int8)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("threads", (1, 2))
def test_native_dequantize_is_kquants_bit_for_bit(qtype: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for kind in ("quantized", "random"):
        blocks, _ = weights(qtype, 133, row_lengths(qtype)[-1], kind)
        K = row_lengths(qtype)[-1]
        ref = dequantize(blocks, qtype, K)
        assert torch.equal(KERNELS.dequantize_f32(blocks, qtype, K), ref)
        assert torch.equal(KERNELS.dequantize_bf16(blocks, qtype, K), ref.to(torch.bfloat16))
        assert torch.equal(block_formats.dequantize(blocks, qtype, K), ref)


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K", "Q5_0"))
def test_result_does_not_depend_on_threads(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    K = 768 if qtype in SUPER else 96
    blocks, _ = weights(qtype, 65, K)
    x = activations(40, K)
    one = KERNELS.matmul(x, blocks, qtype)
    monkeypatch.setattr(qk.QuantKernels, "_threads", staticmethod(lambda T, N, K: 3))
    assert torch.equal(KERNELS.matmul(x, blocks, qtype), one)


@pytest.mark.parametrize("qtype", SUPER)
def test_rows_not_whole_super_blocks_are_refused(qtype: str) -> None:
    size = KQUANT_TYPES[qtype][2]
    w = torch.zeros(5, 288 // 256 * size + size, dtype=torch.uint8)  # whatever the bytes: K is refused first
    x = torch.zeros(1, 288)
    with pytest.raises(ValueError, match=rf"{qtype} weight \[5, 288\].*multiple of 256"):
        KERNELS.matmul(x, w, qtype)
    with pytest.raises(ValueError, match=rf"{qtype} weight \[5, 288\]"):
        KERNELS.dequantize_f32(w, qtype, 288)
    with pytest.raises(ValueError, match=r"multiple of 256"):
        KERNELS.quantize_activations(x, block=256)


def test_q5_rows_of_any_whole_32_blocks_multiply() -> None:
    for qtype in ("Q5_0", "Q5_1"):
        blocks, w = weights(qtype, N, 96)
        check_product(KERNELS, qtype, blocks, w, activations(3, 96), 16)


def test_scratch_covers_every_type() -> None:
    """One scratch buffer serves every type of a model (the fused decode step sizes one)."""
    for act_bits in (8, 16):
        for isa in KERNELS.available:
            need = KERNELS.scratch_bytes(7, 1536, isa=isa, act_bits=act_bits)
            assert need >= 7 * 6 * (1408 if act_bits == 16 else 384)


def test_packed_linear_refuses_rows_not_whole_super_blocks() -> None:
    from worker_svc.weights.packed import PackedLinear

    with pytest.raises(ValueError, match=r"Q4_K weight \[3, 288\]"):
        PackedLinear(torch.zeros(3, 144, dtype=torch.uint8), "Q4_K", 288)


@pytest.mark.parametrize("rows", (3, 200))  # integer kernels; a prefill's dequantized GEMM
def test_concat_of_different_types_is_parts_side_by_side(rows: int) -> None:
    """q/k in Q4_K and v in Q6_K (a Q4_K_M file's layer): `concat` gives a PackedParts whose
    product is the three products side by side, biases included; same-type runs are stacked."""
    from worker_svc.weights.packed import PackedLinear, PackedParts

    K = 512
    specs = (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32), ("Q5_0", 8))
    linears = []
    for i, (qtype, n) in enumerate(specs):
        blocks, _ = weights(qtype, n, K)
        linears.append(PackedLinear(blocks, qtype, K, bias=torch.full((n,), float(i))))
    x = activations(rows, K)
    separate = torch.cat([m(x) for m in linears], dim=1)
    fused = PackedLinear.concat(linears)
    assert isinstance(fused, PackedParts) and fused.qtype == "Q4_K+Q6_K+Q5_0"
    assert [p.out_features for p in fused.parts] == [96, 32, 8] and fused.out_features == 136
    assert torch.equal(fused(x), separate)
    assert torch.equal(fused.dequantized(), torch.cat([m.dequantized() for m in linears]))
    bf16 = PackedLinear(torch.zeros(8, K, dtype=torch.bfloat16), "BF16", K)
    assert PackedLinear.concat([linears[0], bf16]) is None


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("qtype", SUPER)
@pytest.mark.parametrize("act_bits", (8, 16))
def test_a_token_gets_the_same_bits_at_any_token_count(isa: str, qtype: str, act_bits: int) -> None:
    """int16 takes two routes to the same int32 lane sums (q's two bytes by vpmaddubsw up to
    KQ_SPLIT tokens, the weights widened once beyond; csrc/kquant_matmul.inc): a token's row is
    the same bits alone, in a decode step's few tokens and in a prefill's chunks."""
    k = kernels_or_skip(isa)
    blocks, _ = weights(qtype, 33, 768, kind="random")
    x = activations(70, 768)
    full = k.matmul(x, blocks, qtype, act_bits=act_bits)
    for begin, end in ((0, 1), (5, 6), (0, 2), (3, 6), (0, 4), (1, 6), (64, 70)):
        assert torch.equal(k.matmul(x[begin:end].contiguous(), blocks, qtype, act_bits=act_bits), full[begin:end])
