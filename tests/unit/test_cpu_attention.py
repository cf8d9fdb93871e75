"""The native CPU kernels (worker_svc/kernels/csrc/paged_decode.c) against attention written from
the definition and the torch rotary embedding, and the `cpu` backend's fallbacks."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_attention_paths import CHUNKS, layout, naive
from worker_svc.kernels import cpu_kernels
from worker_svc.kernels.attention import CpuAttentionBackend, TorchAttentionBackend, get_backend
from worker_svc.layers.rotary import RotaryEmbedding, rotate
from worker_svc.model_config import RopeConfig

kernel = cpu_kernels.paged_decode()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler: the cpu backend falls back to torch")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "block_size"), [(4, 4, 16, 4), (4, 1, 16, 1), (8, 2, 64, 16), (6, 3, 8, 3)]
)
def test_native_decode_and_prefill_equal_naive_attention(heads, kv_heads, d, block_size, window, threads):
    torch.manual_seed(0)
    num_blocks = 256
    md, tables = layout(CHUNKS, block_size, num_blocks)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    q = torch.randn(md.query_start_loc_list[-1], heads, d)
    backend = get_backend("cpu")
    assert backend.kernel is kernel
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = backend.forward(q, k_pool, v_pool, md, d**-0.5, window)
        again = backend.forward(q, k_pool, v_pool, md, d**-0.5, window)  # the step's rows, reused
    finally:
        torch.set_num_threads(before)
    assert md.derived["cpu"].prefills == [i for i, (_, n) in enumerate(CHUNKS) if n > 1]
    want = naive(q, k_pool, v_pool, CHUNKS, tables, d**-0.5, window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)


@needs_kernel
def test_all_decode_step_uses_the_steps_own_tensors_and_long_contexts():
    torch.manual_seed(1)
    chunks = [(ctx, 1) for ctx in (1, 2, 15, 16, 17, 300, 513)]
    md, tables = layout(chunks, 16, 96)
    k_pool, v_pool = torch.randn(96, 16, 2, 32), torch.randn(96, 16, 2, 32)
    q = torch.randn(len(chunks), 4, 32)
    got = CpuAttentionBackend().forward(q, k_pool, v_pool, md, 0.2, None)
    torch.testing.assert_close(got.double(), naive(q, k_pool, v_pool, chunks, tables, 0.2, None), rtol=1e-5, atol=1e-5)


def test_falls_back_to_torch_for_other_dtypes_and_without_the_kernel(monkeypatch):
    torch.manual_seed(2)
    md, tables = layout(CHUNKS, 4, 96)
    k_pool, v_pool = torch.randn(96, 4, 2, 16), torch.randn(96, 4, 2, 16)
    q = torch.randn(md.query_start_loc_list[-1], 4, 16)
    want = naive(q, k_pool, v_pool, CHUNKS, tables, 0.25, None)
    backend = CpuAttentionBackend()
    got16 = backend.forward(q.half(), k_pool.half(), v_pool.half(), md, 0.25, None)
    torch.testing.assert_close(got16.double(), want, rtol=2e-2, atol=2e-2)
    assert "cpu" not in md.derived  # the torch path planned this step
    backend.kernel = None
    torch.testing.assert_close(backend.forward(q, k_pool, v_pool, md, 0.25, None).double(), want, rtol=1e-5, atol=1e-5)


def test_disabled_by_environment_and_a_missing_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    cpu_kernels.paged_decode.cache_clear()
    try:
        assert cpu_kernels.paged_decode() is None
    finally:
        cpu_kernels.paged_decode.cache_clear()
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernels.build("no-such-cc")


@needs_kernel
def test_build_is_cached_by_content(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left


def test_malloc_settings_apply_once_and_can_be_turned_off(monkeypatch):
    cpu_kernels.keep_freed_memory.cache_clear()
    monkeypatch.setenv("PAGODA_TUNE_MALLOC", "0")
    assert cpu_kernels.keep_freed_memory() is False
    cpu_kernels.keep_freed_memory.cache_clear()
    monkeypatch.delenv("PAGODA_TUNE_MALLOC")
    assert cpu_kernels.keep_freed_memory() is True  # glibc here


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 4, 16), (8, 2, 64), (6, 3, 8)])
def test_native_rotary_and_kv_write_equal_torch_bit_for_bit(heads, kv_heads, d):
    """The fused q|k|v rows of a step: rotated in place and K/V written to the pools, as the
    torch path does it (`rotate`, then `write_kv`), to the last bit."""
    torch.manual_seed(3)
    num_tokens, num_blocks, block_size = 9, 8, 4
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d) * 3
    positions = torch.tensor([0, 1, 2, 7, 30, 31, 500, 4000, 9])
    rope = RotaryEmbedding(RopeConfig(), d, 8192).cos_sin(positions, torch.float32)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    pools = [torch.zeros(num_blocks, block_size, kv_heads, d) for _ in range(4)]

    qk_size = (heads + kv_heads) * d
    qk = rotate(qkv[:, :qk_size].view(num_tokens, -1, d), *rope)
    v = qkv[:, qk_size:].view(num_tokens, kv_heads, d)
    TorchAttentionBackend().write_kv(pools[0], pools[1], qk[:, heads:], v, slots)

    native = qkv.clone()
    assert CpuAttentionBackend().rope_write(native, *rope, pools[2], pools[3], slots, heads)
    assert torch.equal(native[:, :qk_size], qk.reshape(num_tokens, -1))
    assert torch.equal(native[:, qk_size:], qkv[:, qk_size:])  # v untouched
    assert torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])
    assert pools[2].abs().sum() > 0

    # declined (the caller then uses torch): other dtypes, rows not contiguous
    backend = CpuAttentionBackend()
    half = [p.half() for p in pools[2:]]
    assert not backend.rope_write(qkv.half(), *(r.half() for r in rope), *half, slots, heads)
    assert not backend.rope_write(qkv.t().contiguous().t(), *rope, pools[2], pools[3], slots, heads)


@needs_kernel
def test_decode_reads_query_rows_that_are_apart():
    """q as the model hands it over: the q columns of the fused q|k|v rows (a view)."""
    torch.manual_seed(4)
    chunks = [(ctx, 1) for ctx in (1, 5, 16, 40)]
    md, tables = layout(chunks, 4, 64)
    k_pool, v_pool = torch.randn(64, 4, 2, 16), torch.randn(64, 4, 2, 16)
    qkv = torch.randn(len(chunks), (4 + 2 * 2) * 16)
    q = qkv[:, : 4 * 16].view(len(chunks), 4, 16)
    assert not q.is_contiguous()
    got = CpuAttentionBackend().forward(q, k_pool, v_pool, md, 0.25, None)
    assert torch.equal(got, CpuAttentionBackend().forward(q.contiguous(), k_pool, v_pool, md, 0.25, None))
    torch.testing.assert_close(got.double(), naive(q, k_pool, v_pool, chunks, tables, 0.25, None), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_native_argmax_equals_torch_with_ties_nan_and_infinities():
    torch.manual_seed(5)
    x = torch.randn(9, 8192)
    x[1, 100] = x[1, 7000] = x[1].max() + 1  # a tie: the lower index
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 5000] = float("nan")  # NaN counts as largest
    x[3, 6000] = float("nan")
    x[4, 8191] = float("inf")  # the last element
    x[5, 31], x[5, 32] = 50.0, 50.0  # a tie across the 32-wide chunks
    x[6] = 0.0  # all equal
    for rows in (x, x[:, :37], x[:, :1], x[::2]):  # also short rows and rows apart
        assert torch.equal(kernel.argmax(rows), rows.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "block_size"), [(4, 4, 16, 4), (8, 2, 64, 16), (6, 3, 8, 3)])
def test_bfloat16_pools_decode_as_their_widened_values(heads, kv_heads, d, block_size, window):
    """`--kv-cache-dtype bfloat16`: float32 queries over bfloat16 pools (decode rows by the
    native kernel, prefill rows by torch after widening) equal attention over the pools'
    values widened to float32; the torch backend takes the same pools."""
    torch.manual_seed(5)
    md, tables = layout(CHUNKS, block_size, 256)
    k_pool = torch.randn(256, block_size, kv_heads, d).bfloat16()
    v_pool = torch.randn(256, block_size, kv_heads, d).bfloat16()
    q = torch.randn(md.query_start_loc_list[-1], heads, d)
    want = naive(q, k_pool.float(), v_pool.float(), CHUNKS, tables, d**-0.5, window)
    got = CpuAttentionBackend().forward(q, k_pool, v_pool, md, d**-0.5, window)
    assert "cpu" in md.derived  # the native path ran
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    md2, _ = layout(CHUNKS, block_size, 256)
    torch.testing.assert_close(
        TorchAttentionBackend().forward(q, k_pool, v_pool, md2, d**-0.5, window).double(), want, rtol=1e-5, atol=1e-5
    )


@needs_kernel
def test_native_kv_write_into_bfloat16_pools_rounds_as_torch():
    torch.manual_seed(6)
    heads, kv_heads, d, num_tokens = 4, 2, 16, 7
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d) * 3
    qkv[0, heads * d] = float("nan")  # a NaN stays a NaN
    rope = RotaryEmbedding(RopeConfig(), d, 8192).cos_sin(torch.arange(num_tokens), torch.float32)
    slots = torch.randperm(32)[:num_tokens]
    torch_pools = [torch.zeros(8, 4, kv_heads, d, dtype=torch.bfloat16) for _ in range(2)]
    qk = rotate(qkv[:, : (heads + kv_heads) * d].view(num_tokens, -1, d), *rope)
    TorchAttentionBackend().write_kv(
        *torch_pools, qk[:, heads:], qkv[:, (heads + kv_heads) * d :].view(num_tokens, kv_heads, d), slots
    )
    native_pools = [torch.zeros_like(p) for p in torch_pools]
    assert CpuAttentionBackend().rope_write(qkv.clone(), *rope, *native_pools, slots, heads)
    for got, want in zip(native_pools, torch_pools, strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
