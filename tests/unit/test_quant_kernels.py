"""The native quantized and bfloat16 matmul kernels (worker_svc/kernels/quant_kernels.py,
csrc/quant_matmul.c) against float64 references, on every ISA path this CPU runs (the AVX2
and portable paths run on an AVX-512 host too); the pure-torch `dequantize` against gguf-py.

Tolerances:
- quantized weights vs float64 of the dequantized weights times the dequantized integer
  activations (the kernel's own quantization: int8 checked bit-exact against gguf-py's
  Q8_0, int16 against a numpy reference): the integer dots are exact, the per-block scales
  and the float32 sum of K / 32 block terms round at ~6e-8 each, so
  |y - ref| <= tol * sum_k |xq_k| |w_k| with tol 1e-5 for int8 activations (act_bits 8,
  measured < 4e-7) and 1e-6 for int16 (act_bits 16, measured < 5e-7, the most for Q4_1,
  whose d q and m parts of w are each larger than w);
- the same vs the float32 activations: the rounding of x moves each element by at most
  d_x / 2 of its block, so |y - ref| <= sum over blocks of d_x / 2 * sum |w| (+ tol * the
  magnitude above): d_x = amax / 127 for int8, amax / 32767 for int16, a bound 258x
  tighter (measured: int8 up to ~7e-3 of sum |x| |w|, int16 up to ~3e-5);
- bfloat16 weights vs float64 of the same bfloat16 values: 1e-5 * sum |x| |w| (float32
  accumulation over at most ~40 terms a lane); with vdpbf16ps (x rounded to bfloat16,
  relative error 2^-9) 2^-8 * sum |x| |w|.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from worker_svc.kernels import block_formats
from worker_svc.kernels import quant_kernels as qk

gguf = pytest.importorskip("gguf")

KERNELS = qk.quant_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native kernels unavailable (no C compiler?)")

QUANT_TOL = {8: 1e-5, 16: 1e-6}  # by act_bits
QUANT_LEVELS = {8: 127, 16: 32767}  # d_x = amax / levels
ACT_BITS = (8, 16)
BF16_TOL = 1e-5
BF16_DOT_TOL = 2.0**-8
NS = (1, 7, 33, 100)
KS = (32, 96, 576)
TS = (1, 3, 17, 64)


@functools.cache
def kernels(isa: str) -> qk.QuantKernels:
    return qk.QuantKernels(KERNELS.path, isa=isa)


def kernels_or_skip(isa: str) -> qk.QuantKernels:
    if isa not in KERNELS.available:
        pytest.skip(f"this CPU does not run the {isa} path (it runs {KERNELS.available})")
    return kernels(isa)


def ggml(qtype: str) -> gguf.GGMLQuantizationType:
    return getattr(gguf.GGMLQuantizationType, qtype)


@functools.cache
def weights(qtype: str, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks uint8 [N, row_bytes] and their float32 values per gguf-py."""
    rng = np.random.default_rng(N * 1000 + K + len(qtype))
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    blocks = gguf.quants.quantize(w, ggml(qtype))
    return torch.from_numpy(blocks), torch.from_numpy(gguf.quants.dequantize(blocks, ggml(qtype)))


def activations(T: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + T * 7 + K)
    x = torch.randn(T, K, generator=g) * 2.0
    if K >= 64:
        x[0, 32:64] = 0.0  # an all-zero activation block
    return x


def dequantized_activations(
    k: qk.QuantKernels, x: torch.Tensor, act_bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 q * d of the kernel's int8 / int16 activations, and d per element."""
    q, d = k.quantize_activations(x, act_bits=act_bits)
    assert q.dtype == (torch.int16 if act_bits == 16 else torch.int8)
    d_el = d.double().repeat_interleave(32, dim=1)
    return q.double() * d_el, d_el


def q16_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's int16 block quantization: d = amax / 32767, q = round(x / d) half away from
    zero (gguf-py's np_roundf), all in float32; q = 0 where d == 0."""
    T, K = x.shape
    b = x.astype(np.float32).reshape(T, K // 32, 32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(32767)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(d == 0, np.float32(0), b / d).astype(np.float32)
    a = np.abs(v)
    r = np.floor(a) + np.floor(np.float32(2) * (a - np.floor(a)))
    q = np.clip(np.sign(v) * r, -32767, 32767).astype(np.int16)
    return q.reshape(T, K), d.reshape(T, K // 32)


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("qtype", block_formats.BLOCK_TYPES)
@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("act_bits", ACT_BITS)
def test_quant_matmul_matches_float64(isa: str, qtype: str, N: int, K: int, act_bits: int) -> None:
    k = kernels_or_skip(isa)
    blocks, w = weights(qtype, N, K)
    tol = QUANT_TOL[act_bits]
    for T in TS:
        x = activations(T, K)
        y = k.matmul(x, blocks, qtype, act_bits=act_bits)
        assert y.shape == (T, N) and y.dtype == torch.float32
        xq, d_el = dequantized_activations(k, x, act_bits)
        ref = xq @ w.double().T
        mag = xq.abs() @ w.double().abs().T
        err = (y.double() - ref).abs()
        assert (err <= tol * mag).all(), f"T={T}: max err / mag {(err / mag.clamp_min(1e-300)).max():.3g}"
        # against the float32 activations: the rounding's bound (d_x / 2 an element)
        ref32 = x.double() @ w.double().T
        bound = (d_el / 2 * 1.0001) @ w.double().abs().T + tol * (x.double().abs() @ w.double().abs().T)
        assert ((y.double() - ref32).abs() <= bound).all(), f"T={T}"


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("qtype", block_formats.BLOCK_TYPES)
def test_int16_activations_bound_is_258x_tighter(isa: str, qtype: str) -> None:
    """Against the float32 activations, act_bits 16 stays within the int8 bound / 256 (the
    rounding bound's ratio is 32767 / 127 = 258), and is that much closer in fact."""
    k = kernels_or_skip(isa)
    K = 576
    blocks, w = weights(qtype, 100, K)
    x = activations(17, K)
    ref32 = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    amax = x.double().abs().view(17, K // 32, 32).amax(dim=-1).repeat_interleave(32, dim=1)
    bound8 = (amax / 127 / 2) @ w.double().abs().T
    err8 = (k.matmul(x, blocks, qtype, act_bits=8).double() - ref32).abs()
    err16 = (k.matmul(x, blocks, qtype, act_bits=16).double() - ref32).abs()
    assert (err16 <= bound8 / 256 + QUANT_TOL[16] * mag).all()
    assert (err8 / mag).max() > 50 * (err16 / mag).max()


@pytest.mark.parametrize("isa", qk.ISAS)
def test_activation_quantization_is_ggufs_q8_0(isa: str) -> None:
    k = kernels_or_skip(isa)
    x = activations(5, 256, seed=3)
    x[1, :32] = torch.arange(32) * 0.5 - 8.0  # exact halves: rounding ties (away from zero)
    x[2, :32] = 1e-30  # tiny values
    x[3, 32:64] = -x[3, 32:64].abs()  # all negative
    q, d = k.quantize_activations(x, act_bits=8)
    ref = gguf.quants.quantize(x.numpy(), ggml("Q8_0")).reshape(5, 8, 34)
    assert np.array_equal(q.numpy().view(np.uint8).reshape(5, 8, 32), ref[..., 2:])
    assert np.array_equal(d.numpy().astype(np.float16).view(np.uint8).reshape(5, 8, 2), ref[..., :2])


@pytest.mark.parametrize("isa", qk.ISAS)
def test_int16_activation_quantization_matches_numpy(isa: str) -> None:
    k = kernels_or_skip(isa)
    x = activations(6, 256, seed=4)
    x[1, :32] = (torch.arange(32) - 16 + 0.5) * 2.0**-10  # exact halves of d: ties (away from zero)
    x[1, 0] = 32767 * 2.0**-10  # amax: d = 2^-10 exactly
    x[2, :32] = 1e-30  # tiny values
    x[2, 32:64] = torch.linspace(-1e-36, 1e-36, 32)  # d subnormal (1 / d would overflow)
    x[2, 64:96] = 1e-44  # d == 0: q = 0
    x[3, 32:64] = -x[3, 32:64].abs()  # all negative
    x[4] *= 1e6
    q, d = k.quantize_activations(x, act_bits=16)
    assert q.dtype == torch.int16 and d.dtype == torch.float32
    q_ref, d_ref = q16_reference(x.numpy())
    assert np.array_equal(d.numpy(), d_ref)
    assert np.array_equal(q.numpy(), q_ref)
    assert q_ref[1, 0] == 32767 and q_ref[1, 1] == -15 and q_ref[1, 16] == 1  # -14.5 -> -15, 0.5 -> 1
    assert (q_ref[2, 64:96] == 0).all() and np.abs(q_ref).max() == 32767


@pytest.mark.parametrize("qtype", block_formats.BLOCK_TYPES)
def test_dequantize_equals_gguf(qtype: str) -> None:
    blocks, w = weights(qtype, 33, 576)
    got = block_formats.dequantize(blocks, qtype, 576)
    assert got.dtype == torch.float32 and torch.equal(got, w)


@pytest.mark.parametrize("qtype", block_formats.BLOCK_TYPES)
@pytest.mark.parametrize("threads", (1, 3))
def test_native_dequantize_to_bf16_is_the_rounded_float32(
    qtype: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for N, K in ((1, 32), (33, 576), (200, 96)):
        blocks, w = weights(qtype, N, K)
        got = KERNELS.dequantize_bf16(blocks, qtype, K)
        assert got.dtype == torch.bfloat16 and torch.equal(got, w.to(torch.bfloat16)), (N, K)
    with pytest.raises(ValueError, match="multiple of 32"):
        KERNELS.dequantize_bf16(blocks, qtype, 95)


@pytest.mark.parametrize("qtype", block_formats.BLOCK_TYPES)
def test_packed_prefill_gemm_matches_float64(qtype: str) -> None:
    """A packed layer's product from PACKED_GEMM_MIN_ROWS rows: weights dequantized to
    bfloat16, x rounded to bfloat16, oneDNN's GEMM accumulating in float32: within
    2^-8 of sum |x| |w| of the float64 product of the file's weights (both roundings 2^-9)."""
    from worker_svc.weights.packed import PACKED_GEMM_MIN_ROWS, PackedLinear

    N, K = 100, 576
    blocks, w = weights(qtype, N, K)
    layer = PackedLinear(blocks, qtype, K)
    for T in (PACKED_GEMM_MIN_ROWS - 1, PACKED_GEMM_MIN_ROWS, 300):
        x = activations(T, K, seed=4)
        y = layer(x)
        ref = x.double() @ w.double().T
        mag = x.double().abs() @ w.double().abs().T
        assert ((y.double() - ref).abs() <= 2.0**-8 * mag).all(), T
        if T < PACKED_GEMM_MIN_ROWS:  # the integer kernels: int16 activations, far tighter
            assert ((y.double() - ref).abs() <= 1e-4 * mag).all(), T


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("width", (1, 15, 16, 17, 100, 1536))
def test_silu_mul_matches_float64(isa: str, width: int) -> None:
    """silu(g) * u of a [g u] row block: within 1e-6 relative of float64 (AVX-512's polynomial
    exp measured < 3.1e-7, expf < 2e-7), saturating cleanly far out (|g| up to 120)."""
    k = kernels_or_skip(isa)
    g = torch.Generator().manual_seed(width)
    gu = torch.randn(7, 2 * width, generator=g) * 6
    gu[0, :width] = torch.linspace(-120, 120, width)
    got = k.silu_mul(gu)
    ref = torch.nn.functional.silu(gu[:, :width].double()) * gu[:, width:].double()
    assert got.shape == (7, width) and got.dtype == torch.float32
    assert ((got.double() - ref).abs() <= 1e-6 * ref.abs() + 1e-30).all()
    with pytest.raises(ValueError, match="even width"):
        k.silu_mul(torch.randn(2, 5))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_dequantize_plain_types(qtype: str) -> None:
    w = torch.randn(3, 40)
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
    raw = w.to(dtype).contiguous().view(torch.uint8)
    assert torch.equal(block_formats.dequantize(raw, qtype, 40), w.to(dtype).float())


@pytest.mark.parametrize("isa", qk.ISAS)
@pytest.mark.parametrize("K", (1, 15, 16, 17, 100, 577))
@pytest.mark.parametrize("N", NS)
def test_bf16_matmul_matches_float64(isa: str, K: int, N: int) -> None:
    k = kernels_or_skip(isa)
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(N + K)) * 0.1).to(torch.bfloat16)
    for T in TS:
        x = activations(T, K, seed=1)
        y = k.matmul_bf16(x, w)
        ref = x.double() @ w.double().T
        mag = x.double().abs() @ w.double().abs().T
        assert ((y.double() - ref).abs() <= BF16_TOL * mag).all(), f"T={T}"


@pytest.mark.parametrize("K", (17, 100, 577))
def test_bf16_dot_path(K: int) -> None:
    if not KERNELS.has_bf16_dot:
        pytest.skip("this CPU lacks AVX-512 BF16")
    k = qk.QuantKernels(KERNELS.path, bf16_dot=True)
    w = (torch.randn(100, K) * 0.1).to(torch.bfloat16)
    for T in TS:
        x = activations(T, K, seed=2)
        y = k.matmul_bf16(x, w)
        ref = x.double() @ w.double().T
        mag = x.double().abs() @ w.double().abs().T
        assert ((y.double() - ref).abs() <= BF16_DOT_TOL * mag).all(), f"T={T}"
        # exact for activations that are bfloat16 already
        xb = x.to(torch.bfloat16).float()
        refb = xb.double() @ w.double().T
        assert ((y.double() - refb).abs() <= BF16_TOL * mag).all(), f"T={T}"


@pytest.mark.parametrize("qtype", [*[f"{q}/{b}" for q in block_formats.BLOCK_TYPES for b in ACT_BITS], "bf16"])
@pytest.mark.parametrize("T", (9, 13))  # rows streamed one by one; 4-row tiles
def test_result_does_not_depend_on_threads(qtype: str, T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qk, "MIN_MACS_PER_THREAD", 1)
    K, N = 96, 101
    x = activations(T, K)
    if qtype == "bf16":
        w = torch.randn(N, K).to(torch.bfloat16)
        runs = [functools.partial(kernels(isa).matmul_bf16, x, w) for isa in KERNELS.available]
    else:
        name, bits = qtype.split("/")
        runs = [
            functools.partial(kernels(isa).matmul, x, weights(name, N, K)[0], name, act_bits=int(bits))
            for isa in KERNELS.available
        ]
    threads = torch.get_num_threads()
    try:
        for run in runs:
            torch.set_num_threads(1)
            one = run()
            for n in (2, 3):
                torch.set_num_threads(n)
                assert torch.equal(run(), one)
    finally:
        torch.set_num_threads(threads)


def test_act_bits_default_environment_and_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(qk.ACT_BITS_ENV, raising=False)
    assert qk.DEFAULT_ACT_BITS == 16 and qk.QuantKernels(KERNELS.path).act_bits == 16
    monkeypatch.setenv(qk.ACT_BITS_ENV, " 8 ")
    k8 = qk.QuantKernels(KERNELS.path)
    assert k8.act_bits == 8
    assert qk.QuantKernels(KERNELS.path, act_bits=16).act_bits == 16  # the argument wins
    monkeypatch.setenv(qk.ACT_BITS_ENV, "4")  # not a precision: logged, the default
    assert qk.QuantKernels(KERNELS.path).act_bits == 16
    assert qk.select_act_bits(None) == qk.select_act_bits("") == 16 and qk.select_act_bits("8") == 8
    monkeypatch.setenv(qk.ACT_BITS_ENV, "8")
    try:
        qk.quant_kernels.cache_clear()
        assert qk.quant_kernels().act_bits == 8
    finally:
        monkeypatch.undo()
        qk.quant_kernels.cache_clear()
    # calls take the object's precision unless they name one
    k16 = qk.QuantKernels(KERNELS.path, act_bits=16)
    blocks, _ = weights("Q4_1", 33, 576)
    x = activations(3, 576)
    y8, y16 = k8.matmul(x, blocks, "Q4_1"), k16.matmul(x, blocks, "Q4_1")
    assert not torch.equal(y8, y16)
    assert torch.equal(k16.matmul(x, blocks, "Q4_1", act_bits=8), y8)
    assert torch.equal(k8.matmul(x, blocks, "Q4_1", act_bits=16), y16)
    assert k8.quantize_activations(x)[0].dtype == torch.int8
    assert k16.quantize_activations(x)[0].dtype == torch.int16


def test_native_entry_points_for_other_kernels() -> None:
    """function_addresses / isa_id / scratch_bytes: what a native caller (the fused decode
    step) needs to call pagoda_quant_matmul_f32 itself; it computes what matmul does."""
    import ctypes

    blocks, _ = weights("Q4_0", 33, 96)
    x = activations(2, 96)
    for bits in ACT_BITS:
        for isa in KERNELS.available:
            k = kernels(isa)
            qmm = ctypes.CFUNCTYPE(
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
            )(k.function_addresses()["quant_matmul_f32"])
            scratch = torch.zeros(k.scratch_bytes(2, 96, act_bits=bits) + 64, dtype=torch.uint8)
            y = torch.empty(2, 33)
            rc = qmm(
                k.isa_id,
                2,
                bits,
                x.data_ptr(),
                96,
                2,
                96,
                blocks.data_ptr(),
                33,
                y.data_ptr(),
                33,
                scratch.data_ptr() + (-scratch.data_ptr()) % 64,
            )
            assert rc == 0 and torch.equal(y, k.matmul(x, blocks, "Q4_0", act_bits=bits))
            assert (
                qmm(
                    k.isa_id,
                    2,
                    12,
                    x.data_ptr(),
                    96,
                    2,
                    96,
                    blocks.data_ptr(),
                    33,
                    y.data_ptr(),
                    33,
                    scratch.data_ptr(),
                )
                == -3
            )
    assert set(KERNELS.function_addresses()) == {"quant_matmul_f32", "bf16_matmul"}


@pytest.mark.parametrize("act_bits", ACT_BITS)
def test_strided_rows_and_out(act_bits: int) -> None:
    blocks, w = weights("Q8_0", 7, 96)
    big = activations(4, 160)
    x = big[:, 32:128]  # rows 160 apart
    out_big = torch.full((4, 10), 7.0)
    out = out_big[:, 1:8]
    y = KERNELS.matmul(x, blocks, "Q8_0", out=out, act_bits=act_bits)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(y, KERNELS.matmul(x.contiguous(), blocks, "Q8_0", act_bits=act_bits))
    assert (out_big[:, 0] == 7.0).all() and (out_big[:, 8:] == 7.0).all()
    wb = torch.randn(7, 96).to(torch.bfloat16)
    assert torch.equal(KERNELS.matmul_bf16(x, wb), KERNELS.matmul_bf16(x.contiguous(), wb))


def test_empty_shapes() -> None:
    blocks, _ = weights("Q4_0", 7, 96)
    assert KERNELS.matmul(torch.empty(0, 96), blocks, "Q4_0").shape == (0, 7)
    assert KERNELS.matmul(torch.randn(2, 96), blocks[:0], "Q4_0").shape == (2, 0)
    assert KERNELS.matmul_bf16(torch.empty(0, 5), torch.zeros(3, 5, dtype=torch.bfloat16)).shape == (0, 3)
    for isa in KERNELS.available:  # K = 0: sums of nothing
        for bits in ACT_BITS:
            assert torch.equal(
                KERNELS.matmul(torch.randn(2, 0), torch.empty(3, 0, dtype=torch.uint8), "Q8_0", isa=isa, act_bits=bits),
                torch.zeros(2, 3),
            )
        assert torch.equal(
            KERNELS.matmul_bf16(torch.randn(2, 0), torch.empty(3, 0, dtype=torch.bfloat16), isa=isa), torch.zeros(2, 3)
        )


def test_bad_arguments_raise_value_error() -> None:
    blocks, _ = weights("Q8_0", 7, 96)
    x = torch.randn(2, 96)
    cases = [
        ("qtype must be one of", lambda: KERNELS.matmul(x, blocks, "IQ4_NL")),
        ("K must be a multiple of 32", lambda: KERNELS.matmul(torch.randn(2, 100), blocks, "Q8_0")),
        ("bytes per row", lambda: KERNELS.matmul(x, blocks, "Q4_0")),
        ("uint8", lambda: KERNELS.matmul(x, blocks.to(torch.int16), "Q8_0")),
        ("float32", lambda: KERNELS.matmul(x.double(), blocks, "Q8_0")),
        ("2-D", lambda: KERNELS.matmul(x[0], blocks, "Q8_0")),
        ("contiguous rows", lambda: KERNELS.matmul(torch.randn(96, 2).T, blocks, "Q8_0")),
        ("contiguous CPU", lambda: KERNELS.matmul(x, blocks.T.contiguous().T, "Q8_0")),
        ("out must be", lambda: KERNELS.matmul(x, blocks, "Q8_0", out=torch.empty(2, 8))),
        ("out must be", lambda: KERNELS.matmul(x, blocks, "Q8_0", out=torch.empty(2, 7, dtype=torch.float64))),
        ("isa must be one of", lambda: KERNELS.matmul(x, blocks, "Q8_0", isa="sse2")),
        ("isa must be one of", lambda: qk.QuantKernels(KERNELS.path, isa="neon")),
        ("bfloat16 tensor", lambda: KERNELS.matmul_bf16(x, torch.zeros(3, 95, dtype=torch.bfloat16))),
        ("bfloat16 tensor", lambda: KERNELS.matmul_bf16(x, torch.zeros(3, 96))),
        ("float32", lambda: KERNELS.matmul_bf16(x.half(), torch.zeros(3, 96, dtype=torch.bfloat16))),
        ("bytes per row", lambda: block_formats.dequantize(blocks, "Q8_0", 64)),
        ("K must be a multiple of 32", lambda: KERNELS.quantize_activations(torch.randn(1, 40))),
        ("act_bits must be one of", lambda: KERNELS.matmul(x, blocks, "Q8_0", act_bits=4)),
        ("act_bits must be one of", lambda: KERNELS.matmul(x, blocks, "Q8_0", act_bits=True)),
        ("act_bits must be one of", lambda: KERNELS.quantize_activations(x, act_bits=32)),
        ("act_bits must be one of", lambda: qk.QuantKernels(KERNELS.path, act_bits=12)),
    ]
    for message, call in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_select_isa() -> None:
    full = ("avx512", "avx2", "scalar")
    assert qk.select_isa(None, full) == "avx512"
    assert qk.select_isa("", full) == "avx512"
    assert qk.select_isa(" AVX2 ", full) == "avx2"
    assert qk.select_isa("scalar", full) == "scalar"
    assert qk.select_isa("neon", full) == "avx512"  # unknown: the best, logged
    assert qk.select_isa("avx512", ("avx2", "scalar")) == "avx2"  # not on this CPU: the best


def test_environment_selects_isa_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv(qk.ISA_ENV, "scalar")
        qk.quant_kernels.cache_clear()
        assert qk.quant_kernels().isa == "scalar"
        monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
        qk.quant_kernels.cache_clear()
        assert qk.quant_kernels() is None and qk.available_isas() == ()
    finally:
        monkeypatch.undo()
        qk.quant_kernels.cache_clear()
    assert qk.quant_kernels() is not None


def test_failed_build_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cc failed")

    try:
        monkeypatch.setattr(qk.cpu_kernels, "build", fail)
        qk.quant_kernels.cache_clear()
        assert qk.quant_kernels() is None
    finally:
        monkeypatch.undo()
        qk.quant_kernels.cache_clear()
    assert qk.quant_kernels() is not None


def test_available_isas() -> None:
    assert "scalar" in qk.available_isas()
    assert KERNELS.isa in KERNELS.available
    assert list(KERNELS.available) == [i for i in qk.ISAS if i in KERNELS.available]


def test_ggml_types() -> None:
    assert block_formats.GGML_TYPES["Q8_0"] == (8, 32, 34)
    assert block_formats.GGML_TYPES["Q4_0"] == (2, 32, 18)
    assert block_formats.GGML_TYPES["Q4_1"] == (3, 32, 20)
    assert {name: v[0] for name, v in block_formats.GGML_TYPES.items() if v[1] == 1} == {"F32": 0, "F16": 1, "BF16": 30}
    for name in block_formats.BLOCK_TYPES:
        assert block_formats.GGML_TYPES[name][0] == int(ggml(name))
