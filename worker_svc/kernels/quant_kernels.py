"""Matrix products with GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and
the K-quants Q2_K ... Q6_K) and with bfloat16 weights on the CPU: native kernels
(`csrc/quant_matmul.c` with `csrc/kquant_matmul.inc`, built and loaded as `cpu_kernels`
does) and a pure-torch `dequantize`, the fallback (worker_svc/kernels/block_formats.py).

Layouts: worker_svc/kernels/block_formats.py. A weight matrix of N output rows and K inputs is
uint8 [N, row_bytes] in GGUF's blocks, rows contiguous; a K-quant's rows must be whole 256-value
super-blocks (a ValueError naming the weight's shape otherwise). bfloat16 weights are torch's
bfloat16 [N, K]. MXFP4: a decode step's product (2880 x 2880, T = 1, one thread, weights from
DRAM, AVX-512 on Zen 4) takes ~1.16x Q4_0's time and ~0.83x Q8_0's: a 17-byte block's nibbles
take a 16-byte load each where Q4_0's 4-block groups take two loads and a word permute.

Methods. Quantized weights: the float32 activations x [T, K] are quantized per 32-block to
integers, then y[t, n] = sum over blocks of d_w * d_x * dot(q_w, q_x), the dot in integers,
plus Q4_1's m_w * d_x * sum(q_x) (and Q4_0's -8 * sum(q_x) inside the dot; MXFP4's nibbles
are looked up, by pshufb, as KV + 12 in 0..24, and -12 * sum(q_x) enters the same way). The result is
exact for the quantized activations up to float32 rounding (measured: under 4e-7 of
sum |x| |w|); against the float32 activations it differs by at most sum over blocks of
d_x / 2 * sum |w| (the rounding of q_x). Two activation precisions (`act_bits`):

- 16 (the default): int16, d_x = amax / 32767, q_x = round(x / d_x); dots by AVX-512 VNNI's
  vpdpwssd (int16 pairs into int32; the weights widened to int16) or AVX2's vpmaddwd, exact
  in int32. The activations' rounding is 258x finer than int8's (measured up to ~3e-5 of
  sum |x| |w|, int8 ~8e-3), so close greedy decisions of a model follow its float32
  products. Cost on AVX-512 (Zen 4, one thread): prefill (T >= 12) ~1.4x the int8 path's
  time (vpdpwssd does half vpdpbusd's multiply-adds), a decode step ~1.1-1.25x (weights
  from memory; the widening to int16 adds a few instructions per 4 blocks). AVX2: about
  the int8 path's time.
- 8: int8 as llama.cpp computes (d_x = amax / 127, bit-exact with gguf-py's Q8_0
  quantization), vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd with AVX2; its error
  (measured up to ~8e-3 of sum |x| |w|; on SmolLM2-135M Q4_1's first-token logits up to
  ~0.1, int16's ~0.002) can flip close greedy decisions, as llama.cpp's does. The
  llama.cpp-compatible mode.

The default comes from PAGODA_PACKED_ACT_BITS (8 or 16) unless the constructor names one;
`matmul(..., act_bits=)` overrides it per call.

Q5_0/Q5_1 take the 32-block path above (the fifth bit added as the weights are unpacked).
The K-quants quantize the activations per 256-block instead, as llama.cpp's Q8_K (int8, d_x
= amax / 127 over 256 values, with the sums of each 16) or, at act_bits 16, to int16 the same
way; each super-block's sub-block scales (and mins, by those sums) enter the integer sums,
exact in int32 (csrc/kquant_matmul.inc gives the bounds). So both act_bits run for every type,
with the same contract: exact for the quantized activations up to float32 rounding (measured
< 1.2e-7 of sum |x| |w|), and within sum over blocks of d_x / 2 * sum |w| of the float32
activations, d_x now a 256-block's (tests/unit/test_kquant_kernels.py). A prefill of many
rows may instead dequantize (`dequantize_f32` / `dequantize_bf16`, every type, bit for bit
as `dequantize`) for a GEMM, as worker_svc/weights/packed.py does.

bfloat16 weights are widened to float32 and multiplied with the float32 x by FMA,
accumulated in float32 (~1e-7 of sum |x| |w|): the default. `bf16_dot=True` uses AVX-512
BF16's vdpbf16ps instead, on x rounded to bfloat16: twice the multiply-adds per
instruction (prefill ~2x faster, decode the same: it is bound by memory either way) but an
error of ~2e-3 of sum |x| |w| (x's rounding), which the float32 activations would not have.

Register tiles of up to 4 rows x 4 tokens reuse every unpacked weight block for several
tokens, and a group of rows runs through a chunk of tokens held in L2, so a prefill is not T
separate matrix-vector products. Below 12 tokens (a decode step) the rows are streamed one
at a time, in memory order, each read once. Rows are split over `torch.get_num_threads()`
threads (in multiples of 4, so the result does not depend on the thread count) when there
is at least MIN_MACS_PER_THREAD of work a thread; the C calls release the GIL.

ISA paths: "avx512" (AVX-512 F/BW/DQ/VL + VNNI), "avx2" (AVX2 + FMA + F16C) and "scalar"
(portable C), all compiled into one library and chosen per call, so the narrower paths run
(and are tested) on a wider CPU. `quant_kernels()` picks the best the CPU runs unless
PAGODA_CPU_ISA names one; `available_isas()` lists them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from services.settings import CPU_ISA, PACKED_ACT_BITS, env_value
from worker_svc.kernels import cpu_kernels
from worker_svc.kernels.block_formats import GGML_TYPES, check_block_weights, check_row_length
from worker_svc.kernels.cpu_features import cpu_features

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.c"

ISAS = ("avx512", "avx2", "scalar")  # best first
ISA_ENV = CPU_ISA.variable
ACT_BITS = (8, 16)  # activation precisions of the quantized products
ACT_BITS_ENV = PACKED_ACT_BITS.variable
DEFAULT_ACT_BITS = int(PACKED_ACT_BITS.default)
_ISA_IDS = {"scalar": 0, "avx2": 1, "avx512": 2}
_ISA_AVX512_BF16 = 3
_ISA_LEVELS = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512_vnni"}  # cpu_features' level each needs
# one thread per this many multiply-adds at least: below it a thread hand-off costs more
MIN_MACS_PER_THREAD = 1 << 20

_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


def _check_activations(x: torch.Tensor, what: str = "x") -> tuple[int, int]:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(
            f"{what} must be a 2-D float32 tensor [T, K], got "
            f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}"
        )
    T, K = x.shape
    row_stride, col_stride = x.stride()
    if not x.is_cpu or (col_stride != 1 and K > 1) or (row_stride < K and T > 1):
        raise ValueError(f"{what} must be on the CPU with contiguous rows, got {x.device} strides {x.stride()}")
    return T, K


def _check_out(out: torch.Tensor | None, T: int, N: int) -> torch.Tensor:
    if out is None:
        return torch.empty(T, N, dtype=torch.float32)
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != torch.float32
        or out.shape != (T, N)
        or not out.is_cpu
        or (N > 1 and out.stride(1) != 1)
    ):
        raise ValueError(
            f"out must be a float32 CPU tensor [{T}, {N}] with contiguous rows, got "
            f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}"
        )
    return out


def _split(total: int, parts: int, align: int) -> list[int]:
    """Bounds of `parts` ranges over [0, total), each start a multiple of `align`."""
    bounds = [min(total, total * i // parts // align * align) for i in range(parts)]
    return [*bounds, total]


def _valid_act_bits(act_bits: object) -> int:
    if isinstance(act_bits, bool) or act_bits not in ACT_BITS:
        raise ValueError(f"act_bits must be one of {ACT_BITS}, got {act_bits!r}")
    return int(act_bits)  # type: ignore[call-overload]


def select_act_bits(requested: str | None) -> int:
    """The activation precision from a PAGODA_PACKED_ACT_BITS value: 8 or 16, else (unset,
    or not one of them: logged) DEFAULT_ACT_BITS."""
    name = (requested or "").strip()
    if not name:
        return DEFAULT_ACT_BITS
    if name not in ("8", "16"):
        log.warning("%s=%r is not one of %s: using %d", ACT_BITS_ENV, requested, ACT_BITS, DEFAULT_ACT_BITS)
        return DEFAULT_ACT_BITS
    return int(name)


class QuantKernels:
    """ctypes bindings of `csrc/quant_matmul.c`. `isa` is the path calls take unless they
    name one; it is always one of `available` (the paths this CPU runs, best first).
    `bf16_dot`: whether `matmul_bf16` uses AVX-512 BF16's vdpbf16ps (x rounded to
    bfloat16) instead of widening the weights to float32 (x kept float32). `act_bits`: the
    activation precision `matmul` uses unless a call names one, 8 or 16 (None:
    PAGODA_PACKED_ACT_BITS, else 16)."""

    def __init__(self, path: Path, isa: str | None = None, bf16_dot: bool = False, act_bits: int | None = None) -> None:
        self.path = path
        lib = self._lib = ctypes.CDLL(str(path))  # CDLL: the GIL is released during calls
        lib.pagoda_isa_supported.restype = _INT
        lib.pagoda_isa_supported.argtypes = [_INT]
        self.available = tuple(name for name in ISAS if lib.pagoda_isa_supported(_ISA_IDS[name]))
        self.has_bf16_dot = bool(lib.pagoda_isa_supported(_ISA_AVX512_BF16))
        if isa is None:
            isa = self.available[0]
        self.isa = self._check_isa(isa)
        if bf16_dot and not self.has_bf16_dot:
            raise ValueError("bf16_dot needs AVX-512 BF16, which this CPU lacks")
        self.bf16_dot = bf16_dot
        self.act_bits = select_act_bits(env_value(PACKED_ACT_BITS)) if act_bits is None else _valid_act_bits(act_bits)
        quantize_args = [_INT, _PTR, _I64, _I64, _I64, _I64] + [_PTR] * 4
        self._quantize = {
            8: self._bind(lib.pagoda_q8_quantize, quantize_args),
            16: self._bind(lib.pagoda_q16_quantize, quantize_args),
        }
        self._scratch_bytes = self._bind(lib.pagoda_quant_scratch_bytes, [_INT, _INT, _I64, _I64], _I64)
        self._prepare = self._bind(
            lib.pagoda_quant_prepare, [_INT, _INT, _INT, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR]
        )
        self._qmm = self._bind(
            lib.pagoda_quant_matmul, [_INT, _INT, _INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64]
        )
        self._qmm_f32 = self._bind(
            lib.pagoda_quant_matmul_f32, [_INT, _INT, _INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR]
        )
        self._bmm = self._bind(lib.pagoda_bf16_matmul, [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64])
        self._to_bf16 = self._bind(lib.pagoda_f32_to_bf16, [_PTR, _I64, _I64, _I64, _I64, _PTR])
        self._bmm_dp = self._bind(lib.pagoda_bf16_matmul_dp, [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64])
        self._dequant = {
            dtype: self._bind(fn, [_INT, _PTR, _I64, _I64, _I64, _PTR])
            for dtype, fn in ((torch.bfloat16, lib.pagoda_dequant_bf16), (torch.float32, lib.pagoda_dequant_f32))
        }
        self._silu_mul = self._bind(lib.pagoda_silu_mul, [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR])
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()  # each calling thread's scratch buffer

    @staticmethod
    def _bind(fn: ctypes._CFuncPtr, argtypes: list, restype: type = _INT) -> ctypes._CFuncPtr:
        fn.argtypes = argtypes
        fn.restype = restype
        return fn

    def _check_isa(self, isa: str | None) -> str:
        isa = self.isa if isa is None else isa
        if isa not in ISAS:
            raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
        if isa not in self.available:
            raise ValueError(f"this CPU does not run the {isa} path (it runs {self.available})")
        return isa

    def _check_act_bits(self, act_bits: int | None) -> int:
        return self.act_bits if act_bits is None else _valid_act_bits(act_bits)

    @property
    def isa_id(self) -> int:
        """The native id of `isa` (the `isa` argument of the C entry points)."""
        return _ISA_IDS[self.isa]

    def scratch_bytes(self, T: int, K: int, isa: str | None = None, act_bits: int | None = None) -> int:
        """Bytes of the quantized-activation scratch that pagoda_quant_matmul_f32 needs for T
        tokens of K inputs (64-byte aligned by the caller)."""
        return int(self._scratch_bytes(_ISA_IDS[self._check_isa(isa)], self._check_act_bits(act_bits), T, K))

    def function_addresses(self) -> dict[str, int]:
        """Addresses of C entry points, for native callers: "quant_matmul_f32"
        (pagoda_quant_matmul_f32: isa, qtype, act_bits, x, x_stride, T, K, w, N, y, y_stride,
        scratch) and "bf16_matmul" (pagoda_bf16_matmul). Valid while this object lives."""
        return {
            name: ctypes.cast(getattr(self._lib, f"pagoda_{name}"), _PTR).value
            for name in ("quant_matmul_f32", "bf16_matmul")
        }

    def _parallel(self, run: Callable[[int, int], None], total: int, threads: int, align: int) -> None:
        """run(begin, end) over [0, total) split into `threads` ranges, this thread taking the first."""
        if threads <= 1:
            run(0, total)
            return
        if self._pool is None or self._pool._max_workers < threads - 1:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="quant-matmul")
        bounds = _split(total, threads, align)
        futures = [self._pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, threads)]
        run(bounds[0], bounds[1])
        for f in futures:
            f.result()

    @staticmethod
    def _threads(T: int, N: int, K: int) -> int:
        return max(1, min(torch.get_num_threads(), (N + 3) // 4, T * N * K // MIN_MACS_PER_THREAD))

    @staticmethod
    def _raise(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: native kernel returned {rc}")

    def quantize_activations(
        self, x: torch.Tensor, isa: str | None = None, act_bits: int | None = None, block: int = 32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The integer activations q [T, K] (int8, or int16 for act_bits 16) and their
        float32 block scales d [T, K / block] that `matmul` multiplies with (x ~ q * d per
        block): 32-blocks for Q8_0 ... Q5_1, 256-blocks for the K-quants (block=256)."""
        isa_id = _ISA_IDS[self._check_isa(isa)]
        bits = self._check_act_bits(act_bits)
        T, K = _check_activations(x)
        if block == 256:
            return self._quantize_super_blocks(x, isa_id, bits)
        if K % 32:
            raise ValueError(f"K must be a multiple of 32, got {K}")
        q = torch.empty(T, K, dtype=torch.int16 if bits == 16 else torch.int8)
        d, s = torch.empty(T, K // 32), torch.empty(T, K // 32)
        isum = torch.empty(T, K // 32, dtype=torch.int32)
        self._raise(
            self._quantize[bits](
                isa_id, x.data_ptr(), x.stride(0), K, 0, T, q.data_ptr(), d.data_ptr(), isum.data_ptr(), s.data_ptr()
            ),
            "quantize",
        )
        return q, d

    def _quantize_super_blocks(self, x: torch.Tensor, isa_id: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """quantize_activations(block=256): the records the K-quant kernels read (see
        csrc/kquant_matmul.inc), taken apart."""
        T, K = x.shape
        check_row_length("Q4_K", K, T)
        rec = 1408 if bits == 16 else 384
        buf = torch.empty(T, K // 256, rec, dtype=torch.uint8)
        self._raise(
            self._prepare(isa_id, GGML_TYPES["Q4_K"][0], bits, x.data_ptr(), x.stride(0), T, K, 0, T, buf.data_ptr()),
            "quantize",
        )
        if bits == 16:  # q's low bytes at 512, high bytes at 768, in element order
            q = buf[..., 768:1024].view(torch.int8).to(torch.int16) * 256 + buf[..., 512:768].to(torch.int16)
            d = buf[..., 1344:1348].contiguous().view(torch.float32).reshape(T, K // 256)
            return q.reshape(T, K), d
        q = buf[..., :256].contiguous().view(torch.int8).reshape(T, K)
        d = buf[..., 320:324].contiguous().view(torch.float32).reshape(T, K // 256)
        return q, d

    def matmul(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        qtype: str,
        out: torch.Tensor | None = None,
        isa: str | None = None,
        act_bits: int | None = None,
    ) -> torch.Tensor:
        """y = x @ dequantize(w, qtype, K).T, float32 [T, N] (written into `out` when
        given): x float32 [T, K] (rows contiguous), w uint8 [N, row_bytes] GGUF blocks;
        x quantized to int8 or int16 per 32-block (per 256-block for the K-quants; act_bits
        8 or 16; None: self.act_bits)."""
        isa_id = _ISA_IDS[self._check_isa(isa)]
        bits = self._check_act_bits(act_bits)
        T, K = _check_activations(x)
        N = check_block_weights(w, qtype, K)
        out = _check_out(out, T, N)
        if T == 0 or N == 0:
            return out
        type_id = GGML_TYPES[qtype][0]
        scratch = self._scratch(self._scratch_bytes(isa_id, bits, T, K))
        threads = self._threads(T, N, K)
        if threads <= 1:
            self._raise(
                self._qmm_f32(
                    isa_id,
                    type_id,
                    bits,
                    x.data_ptr(),
                    x.stride(0),
                    T,
                    K,
                    w.data_ptr(),
                    N,
                    out.data_ptr(),
                    out.stride(0),
                    scratch,
                ),
                "matmul",
            )
            return out

        def prepare(begin: int, end: int) -> None:
            self._raise(
                self._prepare(isa_id, type_id, bits, x.data_ptr(), x.stride(0), T, K, begin, end, scratch), "quantize"
            )

        def rows(begin: int, end: int) -> None:
            self._raise(
                self._qmm(
                    isa_id, type_id, bits, scratch, T, K, w.data_ptr(), begin, end, out.data_ptr(), out.stride(0)
                ),
                "matmul",
            )

        self._parallel(prepare, T, min(threads, T), 1)
        self._parallel(rows, N, threads, 4)
        return out

    def _scratch(self, n_bytes: int) -> int:
        """The address of this thread's scratch buffer of at least n_bytes (64-byte aligned)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < n_bytes:
            buf = self._local.buf = torch.empty(max(n_bytes, 1 << 16) + 64, dtype=torch.uint8)
        return (buf.data_ptr() + 63) & ~63

    def dequantize_bf16(self, w: torch.Tensor, qtype: str, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights of `w` (uint8 [N, row_bytes], any of KERNEL_TYPES) as bfloat16 [N, K]:
        `dequantize(w, qtype, K)` rounded to bfloat16 (nearest even), bit for bit, in one
        native pass (rows split over the threads). For a prefill's products on oneDNN's
        bfloat16 GEMM (worker_svc/weights/packed.py)."""
        return self._dequantize(w, qtype, K, out, torch.bfloat16)

    def dequantize_f32(self, w: torch.Tensor, qtype: str, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`dequantize(w, qtype, K)` (float32 [N, K]) bit for bit, in one native pass: for a
        prefill's products on the float32 GEMM of a CPU without BF16 units."""
        return self._dequantize(w, qtype, K, out, torch.float32)

    def _dequantize(
        self, w: torch.Tensor, qtype: str, K: int, out: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        N = check_block_weights(w, qtype, K)
        if out is None:
            out = torch.empty(N, K, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != (N, K) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor [{N}, {K}]")
        type_id, fn = GGML_TYPES[qtype][0], self._dequant[dtype]

        def rows(begin: int, end: int) -> None:
            self._raise(fn(type_id, w.data_ptr(), K, begin, end, out.data_ptr()), "dequantize")

        self._parallel(rows, N, max(1, min(torch.get_num_threads(), N // 64)), 1)
        return out

    def silu_mul(self, gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        """`silu(g) * u` of a gate/up product `gate_up` = [g u] (float32 [T, 2 I], rows
        contiguous) as a new float32 [T, I], in one pass (torch takes three and two
        temporaries). AVX-512: exp by a polynomial (within ~3e-7 relative of expf)."""
        isa_id = _ISA_IDS["avx512" if self._check_isa(isa) == "avx512" else "scalar"]
        T, width = _check_activations(gate_up, "gate_up")
        if width % 2:
            raise ValueError(f"gate_up must have an even width (gate then up), got {width}")
        out = torch.empty(T, width // 2)

        def rows(begin: int, end: int) -> None:
            self._raise(
                self._silu_mul(isa_id, gate_up.data_ptr(), gate_up.stride(0), width // 2, begin, end, out.data_ptr()),
                "silu_mul",
            )

        self._parallel(rows, T, max(1, min(torch.get_num_threads(), T * width // (1 << 16))), 1)
        return out

    def matmul_bf16(
        self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, isa: str | None = None
    ) -> torch.Tensor:
        """y = x @ w.T in float32 [T, N]: x float32 [T, K] (rows contiguous), w bfloat16
        [N, K] contiguous; any K and N."""
        isa = self._check_isa(isa)
        T, K = _check_activations(x)
        if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] != K:
            raise ValueError(
                f"w must be a 2-D bfloat16 tensor [N, {K}], got "
                f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}"
            )
        if not w.is_cpu or not w.is_contiguous():
            raise ValueError(f"w must be a contiguous CPU tensor, got {w.device} strides {w.stride()}")
        N = w.shape[0]
        out = _check_out(out, T, N)
        if T == 0 or N == 0:
            return out
        threads = self._threads(T, N, K)
        if self.bf16_dot and isa == "avx512":
            xb = torch.empty(T, K, dtype=torch.bfloat16)

            def convert(begin: int, end: int) -> None:
                self._raise(self._to_bf16(x.data_ptr(), x.stride(0), K, begin, end, xb.data_ptr()), "bf16")

            def rows_dp(begin: int, end: int) -> None:
                self._raise(
                    self._bmm_dp(xb.data_ptr(), T, K, w.data_ptr(), begin, end, out.data_ptr(), out.stride(0)),
                    "matmul_bf16",
                )

            self._parallel(convert, T, min(threads, T), 1)
            self._parallel(rows_dp, N, threads, 4)
            return out
        isa_id = _ISA_IDS[isa]

        def rows(begin: int, end: int) -> None:
            self._raise(
                self._bmm(
                    isa_id, x.data_ptr(), x.stride(0), T, K, w.data_ptr(), begin, end, out.data_ptr(), out.stride(0)
                ),
                "matmul_bf16",
            )

        self._parallel(rows, N, threads, 4)
        return out


def select_isa(requested: str | None, available: tuple[str, ...]) -> str:
    """The ISA path to use: `requested` (a PAGODA_CPU_ISA value) when the CPU runs it, else
    the best available (logged when a request is not honoured)."""
    name = (requested or "").strip().lower()
    if not name:
        return available[0]
    if name not in ISAS:
        log.warning("%s=%r is not one of %s: using %s", ISA_ENV, requested, ISAS, available[0])
        return available[0]
    if name not in available:
        log.warning("%s=%s: this CPU runs only %s: using %s", ISA_ENV, name, available, available[0])
        return available[0]
    return name


@functools.cache
def quant_kernels() -> QuantKernels | None:
    """The kernels (built once per process), or None (logged once, with the reason) when they
    cannot be had: no C compiler, a failed build, or PAGODA_CPU_KERNELS=0."""
    if not cpu_kernels.enabled():
        log.info("native CPU kernels off (PAGODA_CPU_KERNELS=0): quantized matmuls use torch")
        return None
    try:
        path = cpu_kernels.build(source=SOURCE)
        kernels = QuantKernels(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native quantized matmul kernels unavailable, using torch: %s", exc)
        return None
    # the paths an ISA cap leaves (an AVX2-only CPU emulated on a wider one: cpu_features)
    allowed = tuple(name for name in kernels.available if cpu_features().has(_ISA_LEVELS[name])) or ("scalar",)
    isa = select_isa(env_value(CPU_ISA), allowed)
    if isa != kernels.isa:
        kernels = QuantKernels(path, isa)
    log.info(
        "native quantized matmul kernels (%s of %s, int%d activations): %s",
        kernels.isa,
        kernels.available,
        kernels.act_bits,
        kernels.path,
    )
    return kernels


def available_isas() -> tuple[str, ...]:
    """The ISA paths this CPU runs, best first (empty without the native kernels)."""
    kernels = quant_kernels()
    return kernels.available if kernels is not None else ()
