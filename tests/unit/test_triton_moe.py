"""The fused-MoE Triton kernels (worker_svc/kernels/triton_moe.py) against a float64 per-token
reference and against the CPU MoE block (worker_svc/layers/moe.py) on the same weights.

On the CPU the kernels run under Triton's interpreter (the conftest sets TRITON_INTERPRET=1
before triton is imported), so shapes stay small: hidden sizes of 40, intermediate sizes of
24 (neither a multiple of the tiles, so every mask is exercised), 4 to 16 experts. With
TRITON_INTERPRET=0 the same tests run compiled on CUDA; PAGODA_TEST_DEVICE overrides the
device. GPU-sized shapes and timings are in tests/gpu/test_gpu_moe.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from worker_svc.layers.moe import MoE
from worker_svc.model_config import ModelConfig, MoEConfig

triton_moe = pytest.importorskip("worker_svc.kernels.triton_moe")
DEVICE = torch.device(os.environ.get("PAGODA_TEST_DEVICE") or ("cpu" if triton_moe.interpreting() else "cuda"))
if DEVICE.type == "cpu" and not triton_moe.interpreting():
    pytest.skip("Triton runs on the CPU only under TRITON_INTERPRET=1", allow_module_level=True)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need a CUDA device", allow_module_level=True)

HIDDEN, INTER = 40, 24
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to max |ref|


def reference_moe(
    x, w_gate_up, w_down, topk_weights, topk_ids, act_kind=0, alpha=1.702, limit=7.0, b_gate_up=None, b_down=None
) -> torch.Tensor:
    """Each token on its own, in float64: its k experts' gated MLPs, weighted and summed."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(x.double().cpu()):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            gu = w_gate_up[e].double().cpu() @ row
            if b_gate_up is not None:
                gu = gu + b_gate_up[e].double().cpu()
            h = _act(gu[:inter], gu[inter:], act_kind, alpha, limit)
            y = w_down[e].double().cpu() @ h
            if b_down is not None:
                y = y + b_down[e].double().cpu()
            out[t] += weight * y
    return out


def _act(g, u, act_kind, alpha, limit):
    if act_kind == 0:
        return F.silu(g) * u
    if act_kind == 1:
        return F.gelu(g, approximate="tanh") * u
    g = g.clamp(max=limit)
    return (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)


def make_inputs(num_tokens, num_experts, top_k, dtype=torch.float32, bias=False, seed=0):
    """Weights scaled so that products stay near 1, biases large enough to matter, a router
    that spreads the tokens over most experts."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)

    x = rand(num_tokens, HIDDEN, scale=2.0)
    w_gate_up = rand(num_experts, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
    w_down = rand(num_experts, HIDDEN, INTER, scale=INTER**-0.5)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    biases = (rand(num_experts, 2 * INTER, scale=0.5), rand(num_experts, HIDDEN, scale=0.5)) if bias else (None, None)
    return x, w_gate_up, w_down, weights.to(DEVICE), ids.to(DEVICE), biases


def assert_close_to(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = float((out.double().cpu() - ref).abs().max())
    assert err <= TOLERANCE[dtype] * max(1.0, float(ref.abs().max())), f"max abs error {err:.3g}"


# (tokens, experts, top_k): decode, a small batch, and batches whose slots fill blocks of 16,
# 32 and 64 (the tile follows the mean slots per expert)
SHAPES = [(1, 16, 4), (5, 8, 2), (33, 16, 4), (33, 4, 2), (64, 2, 2)]


@pytest.mark.parametrize("act_kind", [0, 1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), SHAPES[:3])
def test_fused_moe_equals_a_per_token_reference(num_tokens, num_experts, top_k, act_kind, bias):
    x, w_gate_up, w_down, weights, ids, (b_gate_up, b_down) = make_inputs(
        num_tokens, num_experts, top_k, bias=bias, seed=num_tokens + act_kind
    )
    # a low limit, so that gpt-oss's clamps bite on these activations
    kwargs = {"act_kind": act_kind, "alpha": 1.702, "limit": 0.75, "b_gate_up": b_gate_up, "b_down": b_down}
    out = triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids, **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close_to(out, reference_moe(x, w_gate_up, w_down, weights, ids, **kwargs), torch.float32)
    if num_tokens > 1:
        assert len(set(ids.flatten().tolist())) >= min(num_experts, 4)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), SHAPES[3:])
def test_larger_blocks_equal_the_reference(num_tokens, num_experts, top_k):
    x, w_gate_up, w_down, weights, ids, _ = make_inputs(num_tokens, num_experts, top_k, seed=3)
    out = triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert_close_to(out, reference_moe(x, w_gate_up, w_down, weights, ids), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    """16-bit inputs: the reference on the same rounded values; the intermediate is rounded
    to the input dtype, as the CPU path rounds it."""
    x, w_gate_up, w_down, weights, ids, (bgu, bd) = make_inputs(9, 8, 2, dtype=dtype, bias=True, seed=5)
    out = triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids, act_kind=2, b_gate_up=bgu, b_down=bd)
    assert out.dtype == dtype
    ref = reference_moe(x, w_gate_up, w_down, weights, ids, act_kind=2, b_gate_up=bgu, b_down=bd)
    assert_close_to(out, ref, dtype)


def _moe_config(hidden_act: str) -> ModelConfig:
    if hidden_act == "swiglu_oai":  # gpt-oss: biases everywhere, a limit low enough to bite
        moe = MoEConfig(
            16,
            4,
            INTER,
            False,
            softmax_after_topk=True,
            router_bias=True,
            expert_bias=True,
            activation="swiglu_oai",
            swiglu_limit=0.75,
        )
    else:
        moe = MoEConfig(16, 4, INTER, True, 0)
    return ModelConfig(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        100,
        HIDDEN,
        64,
        1,
        4,
        2,
        8,
        1e-6,
        256,
        False,
        False,
        hidden_act="silu" if hidden_act == "swiglu_oai" else hidden_act,
        moe=moe,
    )


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh", "swiglu_oai"])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_fused_moe_equals_the_moe_block(hidden_act, num_tokens):
    """The CPU block's forward and the kernel on its stacked experts and its routing."""
    torch.manual_seed(num_tokens)
    block = MoE(_moe_config(hidden_act))
    for p in block.parameters():
        p.data = torch.randn_like(p) / p.shape[-1] ** 0.5
    block.to(DEVICE)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE)
    want = block(x)
    stacked = triton_moe.stack_experts(block)
    weights, ids = block.route(x)
    act = block.experts[0].gated
    assert (stacked.b_down is not None) == (hidden_act == "swiglu_oai")
    out = triton_moe.fused_moe(
        x,
        stacked.w_gate_up,
        stacked.w_down,
        weights,
        ids,
        act_kind=act.kind,
        alpha=act.alpha,
        limit=act.limit,
        b_gate_up=stacked.b_gate_up,
        b_down=stacked.b_down,
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # the experts now read the stacks: the weights are held once, and the block is unchanged
    expert = block.experts[3]
    assert expert.down_proj.weight.data_ptr() == stacked.w_down[3].data_ptr()
    assert expert.up_proj.weight.data_ptr() == stacked.w_gate_up[3, INTER:].data_ptr()
    torch.testing.assert_close(block(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("shared", [0, 32])
def test_a_stacked_block_runs_the_fused_kernels_and_equals_its_loop(shared, monkeypatch):
    """`MoE.stack` (what `fuse` does on a GPU): the block's forward then goes through the
    kernels, shared expert beside them, and gives the loop's output."""
    torch.manual_seed(shared)
    config = _moe_config("swiglu_oai")
    if shared:
        config = ModelConfig(**{**config.__dict__, "moe": MoEConfig(16, 4, INTER, True, shared)})
    block = MoE(config)
    for p in block.parameters():
        p.data = torch.randn_like(p) / p.shape[-1] ** 0.5
    block.to(DEVICE)
    x = torch.randn(9, HIDDEN, device=DEVICE)
    want = block(x)
    assert block.stack() and block.stacked is not None
    calls, real = [], triton_moe.fused_moe
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = block(x)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Expert(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=bias)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=bias)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=bias)


class _Experts(nn.Module):
    def __init__(self, biases: list[bool]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(_Expert(b) for b in biases)


def test_stack_experts_takes_biases_and_refuses_what_does_not_stack():
    torch.manual_seed(0)
    moe = _Experts([True] * 3)
    w = [(e.gate_proj.weight.clone(), e.up_proj.bias.clone(), e.down_proj.bias.clone()) for e in moe.experts]
    stacked = triton_moe.stack_experts(moe)
    assert stacked.w_gate_up.shape == (3, 2 * INTER, HIDDEN) and stacked.w_down.shape == (3, HIDDEN, INTER)
    assert stacked.b_gate_up.shape == (3, 2 * INTER) and stacked.b_down.shape == (3, HIDDEN)
    for e, (gate_w, up_b, down_b) in enumerate(w):
        assert torch.equal(stacked.w_gate_up[e, :INTER], gate_w)
        assert torch.equal(stacked.b_gate_up[e, INTER:], up_b)
        assert torch.equal(stacked.b_down[e], down_b)
    assert triton_moe.stack_experts(_Experts([False] * 2)).b_down is None
    with pytest.raises(ValueError, match="disagree on having biases"):
        triton_moe.stack_experts(_Experts([True, False]))
    odd = _Experts([False] * 2)
    odd.experts[1].down_proj = nn.Linear(INTER + 1, HIDDEN, bias=False)
    with pytest.raises(ValueError, match="do not stack"):
        triton_moe.stack_experts(odd)


def test_fused_moe_refuses_mismatched_shapes():
    x, w_gate_up, w_down, weights, ids, _ = make_inputs(3, 4, 2)
    with pytest.raises(ValueError, match="w_down"):
        triton_moe.fused_moe(x, w_gate_up, w_down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids[:, :1])
    assert triton_moe.fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0]).shape == (0, HIDDEN)


def check_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Every slot once; each block one expert's, in slot order; runs padded to block_m."""
    aligned = triton_moe.align_by_expert(topk_ids, num_experts, block_m)
    flat = topk_ids.flatten().tolist()
    num_slots = len(flat)
    ids, experts = aligned.sorted_ids.tolist(), aligned.block_experts.tolist()
    num_padded = int(aligned.num_padded.item())
    counts = [flat.count(e) for e in range(num_experts)]
    assert num_padded == sum(-(-c // block_m) * block_m for c in counts)
    assert len(ids) % block_m == 0 and len(experts) == len(ids) // block_m
    assert len(ids) >= num_padded
    assert all(i == num_slots for i in ids[num_padded:])  # padding past the end
    assert experts[num_padded // block_m :] == [-1] * (len(experts) - num_padded // block_m)
    assert sorted(i for i in ids if i < num_slots) == list(range(num_slots))  # every slot once
    used = experts[: num_padded // block_m]
    assert used == sorted(used) and len(set(used)) == sum(c > 0 for c in counts)
    for b, expert in enumerate(used):
        real = [i for i in ids[b * block_m : (b + 1) * block_m] if i < num_slots]
        assert real, "a block of padding only"
        assert all(flat[i] == expert for i in real)
    for expert in set(used):  # stable: an expert's slots in step order
        run = [
            i for b, e in enumerate(used) if e == expert for i in ids[b * block_m : (b + 1) * block_m] if i < num_slots
        ]
        assert run == [i for i, e in enumerate(flat) if e == expert]


@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 4), st.sampled_from([1, 4, 16]), st.randoms())
def test_align_by_expert_invariants(num_tokens, num_experts, top_k, block_m, rnd):
    top_k = min(top_k, num_experts)
    skewed = rnd.random() < 0.5  # most slots on a few experts, as real routers do
    rows = [rnd.sample(range(min(num_experts, top_k + 1) if skewed else num_experts), top_k) for _ in range(num_tokens)]
    check_alignment(torch.tensor(rows), num_experts, block_m)


def test_align_by_expert_exact_layout():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # slots 0..5
    aligned = triton_moe.align_by_expert(ids, 4, 4)
    assert aligned.sorted_ids.tolist()[:12] == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert aligned.block_experts.tolist()[:3] == [0, 1, 2]
    assert int(aligned.num_padded.item()) == 12
