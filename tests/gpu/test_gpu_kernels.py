"""Triton paged attention compiled for CUDA, on GPU-sized shapes (head dim 64 and 128,
contexts of thousands of tokens, long prefill chunks), against the torch reference.

Needs a CUDA device and compiled kernels: run with TRITON_INTERPRET=0 (the conftest
otherwise chooses the interpreter, and these tests skip).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton_attention = pytest.importorskip("worker_svc.kernels.triton_attention")
if triton_attention.interpreting():
    pytest.skip("TRITON_INTERPRET=1: set TRITON_INTERPRET=0 to compile for the GPU",
                allow_module_level=True)  # fmt: skip

from unit.test_triton_attention import TOLERANCE, Case, make_batch  # noqa: E402

from worker_svc.kernels.attention import TorchAttentionBackend  # noqa: E402

CUDA = torch.device("cuda")
# decodes over long contexts, chunks of several query tiles on top of cached context
MIXED = ((1, 1), (1, 2047), (1, 2048), (300, 1500), (512, 512), (1, 3001), (17, 17), (64, 4000))
DECODE = tuple((1, ctx) for ctx in (1, 15, 16, 17, 255, 1024, 4095, 4096, 4097, 8191))

CASES = {
    "bs16-gqa4-d128-bf16-mixed": Case(16, 32, 8, 128, torch.bfloat16, MIXED),
    "bs16-gqa8-d128-bf16-decode": Case(16, 64, 8, 128, torch.bfloat16, DECODE),
    "bs32-gqa1-d64-fp16-mixed": Case(32, 8, 8, 64, torch.float16, MIXED),
    "bs16-gqa4-d128-fp32-mixed": Case(16, 16, 4, 128, torch.float32, MIXED),
    "bs16-gqa4-d128-bf16-window": Case(16, 16, 4, 128, torch.bfloat16, MIXED, sliding_window=1024),
    "bs1-gqa7-d80-fp16-mixed": Case(1, 14, 2, 80, torch.float16, MIXED[:4]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_attention_matches_reference(name):
    case = CASES[name]
    q, (k_pool, v_pool), (k, v), metadata = make_batch(case, seed=3, device=CUDA)
    triton_backend = triton_attention.TritonAttentionBackend()
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    TorchAttentionBackend().write_kv(ref_k, ref_v, k, v, metadata.slot_mapping)
    triton_backend.write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
    assert torch.equal(k_pool, ref_k) and torch.equal(v_pool, ref_v)

    scale = case.head_dim**-0.5
    out = triton_backend.forward(q, k_pool, v_pool, metadata, scale, case.sliding_window)
    ref = TorchAttentionBackend().forward(
        q.float(), k_pool.float(), v_pool.float(), metadata, scale, case.sliding_window
    )
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def test_gpu_attention_is_deterministic():
    case = CASES["bs16-gqa4-d128-bf16-mixed"]
    q, (k_pool, v_pool), _, metadata = make_batch(case, seed=4, device=CUDA)
    backend = triton_attention.TritonAttentionBackend()
    first = backend.forward(q, k_pool, v_pool, metadata, 0.1, None)
    assert torch.equal(first, backend.forward(q, k_pool, v_pool, metadata, 0.1, None))
