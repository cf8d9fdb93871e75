"""MXFP4 (ggml type 39): the dequantizer and reference quantizer against gguf-py's, the
native kernels (csrc/quant_matmul.c) on every ISA path this CPU runs, `PackedLinear`, the
GGUF reader, and gpt-oss's Hugging Face layout (worker_svc/weights/mxfp4.py) against
transformers' own dequantization.

Kernel tolerances, as tests/unit/test_kquant_kernels.py's: against float64 of the dequantized
weights times the kernel's own quantized activations (per 32-block) only float32 rounding is
left, |y - ref| <= 1e-6 * sum |xq| |w| + 1e-36; against the float32 activations each moves
by at most d_x / 2 of its block, |y - ref| <= sum over blocks of d_x / 2 * sum |w| (+ the
above). The 1e-36: ggml's quantizer gives an all-zero block e = 0 (d_w = 2^-128), so d_w d_x
is a float32 subnormal, and the SIMD paths' per-lane partial sums (each code looked up as
KV + 12, the -12 * sum(q_x) in one lane of the block) cancel only to within its rounding
(measured ~1e-44).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
import torch

from worker_svc.kernels import block_formats
from worker_svc.kernels import quant_kernels as qk
from worker_svc.weights import mxfp4

KERNELS = qk.quant_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="native kernels unavailable (no C compiler?)")

TOL = 1e-6
N = 7  # odd: the row tiles' tails


@functools.cache
def kernels(isa: str) -> qk.QuantKernels:
    return qk.QuantKernels(KERNELS.path, isa=isa)


def kernels_or_skip(isa: str) -> qk.QuantKernels:
    if KERNELS is None or isa not in KERNELS.available:
        pytest.skip(f"this CPU does not run the {isa} path")
    return kernels(isa)


def random_rows(rows: int, K: int, seed: int, e_range: tuple[int, int] = (0, 256)) -> torch.Tensor:
    """uint8 [rows, K / 32 * 17]: every nibble pattern, scale bytes drawn from e_range."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows * K // 32, 17), generator=g, dtype=torch.uint8)
    raw[:, 0] = torch.randint(*e_range, (raw.shape[0],), generator=g).to(torch.uint8)
    return raw.view(rows, -1).contiguous()


def quantized_rows(rows: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, K, generator=g) * 0.1
    w[:, :40] += 0.3
    w[0, :32] = 0.0
    return mxfp4.quantize_mxfp4(w)


def activations(T: int, K: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(T * 7 + K)
    x = torch.randn(T, K, generator=g) * 2.0
    x[0, :32] = 0.0  # an all-zero block
    return x


def gguf_mxfp4():
    gguf = pytest.importorskip("gguf")
    return gguf, gguf.GGMLQuantizationType.MXFP4


# ---------------------------------------------------------------- dequantizer and quantizer


def test_dequantize_equals_gguf_for_every_scale_and_code() -> None:
    gguf, mx = gguf_mxfp4()
    rows = random_rows(33, 256, seed=1)
    rows.view(-1, 17)[:256, 0] = torch.arange(256, dtype=torch.uint8)  # every scale byte once
    with np.errstate(over="ignore"):
        ref = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), mx))
    mine = block_formats.dequantize(rows, "MXFP4", 256)
    assert torch.equal(mine, ref)
    if KERNELS is not None:
        assert torch.equal(KERNELS.dequantize_f32(rows, "MXFP4", 256), ref)
        assert torch.equal(KERNELS.dequantize_bf16(rows, "MXFP4", 256), ref.to(torch.bfloat16))


def test_quantizer_equals_gguf_byte_for_byte() -> None:
    gguf, mx = gguf_mxfp4()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 320, generator=g) * 0.05
    x[:, :40] += 0.2
    x[0, :32] = 0.0  # all zero: e = 0
    x[1, 32:64] *= 1e-20  # small scales
    x[2, 64:96] = torch.tensor([4.0, -6.0, 3.0, 1.5] * 8)  # on the grid, ties between levels
    assert torch.equal(mxfp4.quantize_mxfp4(x), torch.from_numpy(gguf.quants.quantize(x.numpy(), mx)))


def test_round_trip_error_within_half_a_level() -> None:
    """Each value lands on the nearest of FP4 * 2^(m - 2) (m = floor(log2 amax)): off by at
    most half the widest gap (1 unit, between 4 and 6) or, past the largest level 6 units, by
    the clipping."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 512, generator=g) * torch.logspace(-3, 2, 16).unsqueeze(1)
    y = block_formats.dequantize(mxfp4.quantize_mxfp4(x), "MXFP4", 512)
    b, yb = x.view(-1, 32), y.view(-1, 32)
    unit = torch.exp2(torch.floor(torch.log2(b.abs().amax(dim=-1, keepdim=True))) - 2)
    bound = torch.maximum(unit, b.abs() - 6 * unit)
    assert ((yb - b).abs() <= bound).all()
    assert (yb.abs() <= 6 * unit).all()


def test_quantizer_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="NaN or infinite"):
        mxfp4.quantize_mxfp4(torch.full((1, 32), float("inf")))


# ---------------------------------------------------------------------- the native kernels


def check_product(k: qk.QuantKernels, rows: torch.Tensor, x: torch.Tensor, act_bits: int) -> None:
    K = x.shape[1]
    w = block_formats.dequantize(rows, "MXFP4", K).double()
    y = k.matmul(x, rows, "MXFP4", act_bits=act_bits)
    assert y.shape == (x.shape[0], rows.shape[0]) and y.dtype == torch.float32
    q, d = k.quantize_activations(x, act_bits=act_bits)
    d_el = d.double().repeat_interleave(32, dim=1)
    xq = q.double() * d_el
    err = (y.double() - xq @ w.T).abs()
    mag = xq.abs() @ w.abs().T
    assert (err <= TOL * mag + 1e-36).all(), f"max err / mag {(err / mag.clamp_min(1e-300)).max():.3g}"
    bound = (d_el / 2 * 1.0001) @ w.abs().T + TOL * (x.double().abs() @ w.abs().T) + 1e-36
    assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("act_bits", (8, 16))
def test_matmul_matches_float64(isa: str, act_bits: int) -> None:
    k = kernels_or_skip(isa)
    for K in (32, 96, 160, 512):  # 1, 3, 5, 16 blocks: the 4-block groups and their tails
        for rows in (quantized_rows(N, K, seed=K), random_rows(33, K, seed=K, e_range=(100, 150))):
            for T in (1, 4, 17):
                check_product(k, rows, activations(T, K), act_bits)


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("act_bits", (8, 16))
def test_extreme_codes(isa: str, act_bits: int) -> None:
    """Every weight at KV +-12 (the lookup's 24 and 0: the largest unsigned bytes and the
    -12 * sum(q_x) at its largest), every activation at +-3, the extremes of its block."""
    k = kernels_or_skip(isa)
    block = torch.full((17,), 0x77, dtype=torch.uint8)
    block[0] = 128  # d = 2^0: w = KV
    rows = block.repeat(5, 8)  # 5 rows of K = 256
    rows[1::2, 1:17] = 0xFF  # -12 in the first block of odd rows
    x = torch.full((3, 256), 3.0)
    x[1] = -3.0
    check_product(k, rows, x, act_bits)


@needs_kernels
def test_result_does_not_depend_on_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = quantized_rows(65, 96, seed=5)
    x = activations(40, 96)
    one = KERNELS.matmul(x, rows, "MXFP4")
    monkeypatch.setattr(qk.QuantKernels, "_threads", staticmethod(lambda T, N, K: 3))
    assert torch.equal(KERNELS.matmul(x, rows, "MXFP4"), one)


@needs_kernels
def test_rows_not_whole_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"MXFP4 weight \[3, 48\].*multiple of 32"):
        KERNELS.matmul(torch.zeros(1, 48), torch.zeros(3, 34, dtype=torch.uint8), "MXFP4")


@needs_kernels
@pytest.mark.parametrize("act_bits", (8, 16))
def test_the_fused_steps_entry_point_takes_type_39(act_bits: int) -> None:
    """csrc/decode_layers.c multiplies through pagoda_quant_matmul_f32 by ggml's type id, with one
    scratch of scratch_bytes(T, max K): the same product as `matmul` on every path."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr
    )(KERNELS.function_addresses()["quant_matmul_f32"])
    rows, x = quantized_rows(N, 160, seed=12), activations(3, 160)
    for isa in KERNELS.available:
        k = kernels(isa)
        buf = torch.empty(k.scratch_bytes(3, 1536, act_bits=act_bits) + 64, dtype=torch.uint8)
        y = torch.full((3, N), float("nan"))
        rc = fn(
            k.isa_id,
            block_formats.GGML_TYPES["MXFP4"][0],
            act_bits,
            x.data_ptr(),
            160,
            3,
            160,
            rows.data_ptr(),
            N,
            y.data_ptr(),
            N,
            (buf.data_ptr() + 63) & ~63,
        )
        assert rc == 0 and block_formats.GGML_TYPES["MXFP4"][0] == 39
        assert torch.equal(y, k.matmul(x, rows, "MXFP4", act_bits=act_bits))


@pytest.mark.parametrize("T", (3, 200))  # integer kernels; a prefill's dequantized GEMM
def test_packed_linear(T: int) -> None:
    from worker_svc.weights.packed import PackedLinear

    rows = quantized_rows(N, 256, seed=6)
    layer = PackedLinear(rows, "MXFP4", 256, bias=torch.arange(N, dtype=torch.float32))
    w = block_formats.dequantize(rows, "MXFP4", 256)
    x = activations(T, 256)
    want = x.double() @ w.double().T + layer.bias.double()
    scale = x.double().abs() @ w.double().abs().T
    assert ((layer(x).double() - want).abs() <= 1e-2 * scale + 1e-5).all()
    layer.kernels = None  # the torch fallback: dequantized weights, float32 activations
    assert torch.allclose(layer(x), (x @ w.T + layer.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.dequantized(), w)


# ------------------------------------------------------------------------------- GGUF files


def test_gguf_reader_keeps_mxfp4_packed(tmp_path) -> None:
    gguf, mx = gguf_mxfp4()
    from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint

    rows = quantized_rows(5, 64, seed=7)
    path = tmp_path / "mx.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.ffn_down.weight", rows.numpy(), raw_dtype=mx)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = GGUFCheckpoint(path).tensor("model.layers.0.mlp.down_proj.weight")
    assert (t.qtype, t.shape, t.packed) == ("MXFP4", (5, 64), True)
    assert torch.equal(t.data, rows)
    assert torch.equal(t.to_float32(), block_formats.dequantize(rows, "MXFP4", 64))


# ------------------------------------------------------------- gpt-oss's Hugging Face layout


def hf_random(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_hf_dequantize_equals_transformers(dtype: torch.dtype) -> None:
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    blocks, scales = hf_random((3, 5, 8), seed=8)  # [E, rows, K / 32]: every scale byte
    scales.view(-1)[:120] = torch.arange(120, dtype=torch.uint8) * 2 + 15
    theirs = convert(blocks, scales, dtype=dtype).transpose(1, 2)  # theirs: [E, K, rows]
    ours = mxfp4.hf_mxfp4_dequantize(blocks, scales, dtype)
    assert ours.shape == (3, 5, 256) and ours.dtype == dtype
    assert torch.equal(ours, theirs)
    # the ggml rows hold the same values, bit for bit
    ggml = mxfp4.hf_to_ggml_mxfp4(blocks, scales)
    assert ggml.shape == (3, 5, 8 * 17)
    assert torch.equal(block_formats.dequantize(ggml.view(15, -1), "MXFP4", 256).view(3, 5, 256).to(dtype), theirs)


def test_hf_layout_round_trips() -> None:
    blocks, scales = hf_random((2, 4, 3), seed=9)
    b, s = mxfp4.ggml_to_hf_mxfp4(mxfp4.hf_to_ggml_mxfp4(blocks, scales))
    assert torch.equal(b, blocks) and torch.equal(s, scales)
    # element 2i is byte i's low nibble in Hugging Face's layout, element j qs[j]'s in ggml's
    one = torch.zeros(1, 1, 16, dtype=torch.uint8)
    one[0, 0, 0] = 0x21  # elements 0 (code 1: 0.5) and 1 (code 2: 1.0)
    one[0, 0, 8] = 0x0F  # element 16 (code 15: -6.0)
    w = mxfp4.hf_mxfp4_dequantize(one, torch.full((1, 1), 127, dtype=torch.uint8), torch.float32)
    want = torch.zeros(1, 32)
    want[0, :2] = torch.tensor([0.5, 1.0])
    want[0, 16] = -6.0
    assert torch.equal(w, want)


def test_quantize_hf_mxfp4_is_the_ggml_quantizer_in_hf_layout() -> None:
    g = torch.Generator().manual_seed(10)
    w = torch.randn(2, 6, 96, generator=g)  # [E, rows, K]
    blocks, scales = mxfp4.quantize_hf_mxfp4(w)
    assert blocks.shape == (2, 6, 3, 16) and scales.shape == (2, 6, 3)
    ggml = mxfp4.quantize_mxfp4(w.reshape(12, 96))
    assert torch.equal(mxfp4.hf_to_ggml_mxfp4(blocks, scales).view(12, -1), ggml)
    assert torch.equal(
        mxfp4.hf_mxfp4_dequantize(blocks, scales, torch.float32).view(12, 96),
        block_formats.dequantize(ggml, "MXFP4", 96),
    )


def test_hf_shapes_are_checked() -> None:
    blocks, scales = hf_random((4, 3), seed=11)
    with pytest.raises(ValueError, match="scales must be uint8"):
        mxfp4.hf_to_ggml_mxfp4(blocks, scales[:, :2])
    with pytest.raises(ValueError, match="blocks must be uint8"):
        mxfp4.hf_to_ggml_mxfp4(blocks[..., :8], scales)
