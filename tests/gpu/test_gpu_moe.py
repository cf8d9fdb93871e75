"""The fused-MoE Triton kernels compiled for CUDA, on model-sized shapes (Qwen3-MoE-30B-A3B's
layer, Mixtral-like blocks full of rows, gpt-oss's odd sizes with biases and its clamped
SwiGLU), against the torch path in float32 on the same weights. Timings and the MoE block
on CUDA are in tests/gpu/moe_check.py (scripts/gpu_check.sh runs it).

Needs a CUDA device and compiled kernels: run with TRITON_INTERPRET=0 (the conftest
otherwise chooses the interpreter, and these tests skip).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton_moe = pytest.importorskip("worker_svc.kernels.triton_moe")
if triton_moe.interpreting():
    pytest.skip("TRITON_INTERPRET=1: set TRITON_INTERPRET=0 to compile for the GPU",
                allow_module_level=True)  # fmt: skip

from gpu.moe_check import REL_ERR_BOUND, make_layer, make_tokens, rel_err, torch_moe  # noqa: E402

CUDA = torch.device("cuda")
# (tokens, experts, top_k, hidden, intermediate, dtype, act_kind, bias)
CASES = {
    "qwen3-30b-decode-bf16": (1, 128, 8, 2048, 768, torch.bfloat16, 0, False),
    "qwen3-30b-256-bf16": (256, 128, 8, 2048, 768, torch.bfloat16, 0, False),
    "mixtral-like-full-blocks-bf16": (512, 8, 2, 1024, 1792, torch.bfloat16, 0, False),
    "gpt-oss-like-odd-bias-bf16": (33, 16, 4, 720, 360, torch.bfloat16, 2, True),
    "gelu-bias-fp16": (40, 16, 4, 512, 256, torch.float16, 1, True),
    "fp32-bias": (17, 8, 2, 256, 96, torch.float32, 0, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_fused_moe_matches_torch(name):
    num_tokens, num_experts, top_k, hidden, inter, dtype, act_kind, bias = CASES[name]
    layer = make_layer(num_experts, hidden, inter, dtype, CUDA, seed=num_tokens, bias=bias)
    x, weights, ids = make_tokens(num_tokens, num_experts, top_k, hidden, dtype, CUDA, seed=num_tokens + 1)
    out = triton_moe.fused_moe(
        x,
        layer["w_gate_up"],
        layer["w_down"],
        weights,
        ids,
        act_kind=act_kind,
        b_gate_up=layer["b_gate_up"],
        b_down=layer["b_down"],
    )
    ref = torch_moe(x, layer["w_gate_up"], layer["w_down"], weights, ids, act_kind, layer["b_gate_up"], layer["b_down"])
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < REL_ERR_BOUND[dtype]


def test_gpu_fused_moe_is_deterministic():
    num_tokens, num_experts, top_k, hidden, inter, dtype, _, _ = CASES["qwen3-30b-256-bf16"]
    layer = make_layer(num_experts, hidden, inter, dtype, CUDA)
    x, weights, ids = make_tokens(num_tokens, num_experts, top_k, hidden, dtype, CUDA)
    first = triton_moe.fused_moe(x, layer["w_gate_up"], layer["w_down"], weights, ids)
    assert torch.equal(first, triton_moe.fused_moe(x, layer["w_gate_up"], layer["w_down"], weights, ids))
