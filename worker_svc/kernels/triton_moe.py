"""Fused mixture-of-experts in Triton: the GPU path of worker_svc/layers/moe.py's experts.

    h[s]   = act(x[t] @ gate[e].T + bg[e], x[t] @ up[e].T + bu[e])     for each token slot s = (t, j)
    y[s]   = w[t, j] * (h[s] @ down[e].T + bd[e])                      e = topk_ids[t, j]
    out[t] = sum over j of y[(t, j)]                                   (float32, then x's dtype)

Layout. A step's T * k token slots are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M (`align_by_expert`, vLLM's moe_align_block_size in torch ops), so every
block of BLOCK_M slots belongs to one expert. Two grouped GEMMs then run over the stacked
weights, one launch each: a program takes one block (one expert's weights) and BLOCK_N output
columns, so each active expert's weights are read once per step for all of its rows, never
once per token. The first computes gate and up side by side (two accumulators) and applies
the activation in its epilogue (0 SiLU, 1 GELU-tanh, 2 gpt-oss's clamped SwiGLU), writing
the [T * k, I] intermediate in x's dtype; the second multiplies by `down`, adds its bias,
scales by the routing weight and writes float32 rows that one sum over k turns into the
output. No atomics: the result does not depend on the order programs run in.

The grid is sized from the worst-case padding, so the launch needs no device-to-host read
(blocks past the padded count exit at once). Products accumulate in float32; 16-bit inputs
go through the tensor cores as they are when compiled, and are widened to float32 first
under Triton's CPU interpreter (`TRITON_INTERPRET=1`, whose bfloat16 arithmetic is wrong).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from worker_svc.kernels.triton_attention import interpreting

ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_OAI = 0, 1, 2  # `act_kind` (worker_svc/layers/mlp.py ACT_KINDS)


class ExpertAlignment(NamedTuple):
    """A step's token slots grouped by expert, in blocks of `block_m` (see `align_by_expert`)."""

    sorted_ids: torch.Tensor  # [max_padded] int32: slot t * k + j, or T * k for padding
    block_experts: torch.Tensor  # [max_padded // block_m] int32: each block's expert, -1 past the end
    num_padded: torch.Tensor  # [1] int32: slots in use (each expert's count rounded up to block_m)


class StackedExperts(NamedTuple):
    """An MoE layer's experts as `fused_moe` reads them; biases None where the linears have none."""

    w_gate_up: torch.Tensor  # [E, 2I, H]: gate's rows, then up's
    w_down: torch.Tensor  # [E, H, I]
    b_gate_up: torch.Tensor | None  # [E, 2I]
    b_down: torch.Tensor | None  # [E, H]


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Token slots (`topk_ids.flatten()` positions) sorted by expert, stably (a slot's order
    within its expert is its order in the step), each expert's run padded to a multiple of
    `block_m` with the sentinel T * k; experts with no slots take no block. Torch ops only,
    no host read: `sorted_ids` has room for the worst case, S + min(E, S) * (block_m - 1)
    for S = T * k slots, and the blocks past `num_padded` are marked expert -1."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    device = flat.device
    # (not bincount: on CUDA it reads the largest id back to size its output)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_slots, device=device) - first_of_expert[sorted_experts]
    position = (padded_end - padded)[sorted_experts] + rank
    max_padded = num_slots + min(num_experts, num_slots) * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_ids[position] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_start < padded_end[-1], block_experts, -1).to(torch.int32)
    return ExpertAlignment(sorted_ids, block_experts, padded_end[-1:].to(torch.int32))


@triton.jit
def _gated(g, u, alpha, limit, ACT: tl.constexpr):
    """The activation of float32 gate and up tiles."""
    if ACT == 0:
        out = g * tl.sigmoid(g) * u
    elif ACT == 1:  # 0.5 * (1 + tanh(y)) == sigmoid(2 * y)
        out = g * tl.sigmoid(2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g)) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1.0) * g * tl.sigmoid(alpha * g)
    return out


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, h_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_slots, stride_x_tok, stride_w_e, stride_w_n, stride_b_e, stride_h_slot, alpha, limit,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h[slot, n] = act(x[token] . gate[e, n], x[token] . up[e, n]) for one block of one
    expert's slots and BLOCK_N of the I columns (w's rows n and I + n)."""
    pid = tl.program_id(0)
    num_n = (INTER + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        slot_ok = slots < num_slots
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < INTER
        x_rows = x_ptr + (slots // TOP_K)[:, None] * stride_x_tok
        w_gate = w_ptr + expert * stride_w_e + offs_n[None, :] * stride_w_n  # [1, BLOCK_N]
        w_up = w_gate + INTER * stride_w_n
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            a = tl.load(x_rows + offs_k[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_gate + offs_k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_up + offs_k[:, None], mask=w_mask, other=0.0)
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            bias = b_ptr + expert * stride_b_e + offs_n
            acc_g += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias + INTER, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        h = _gated(acc_g, acc_u, alpha, limit, ACT)
        h_ptrs = h_ptr + slots[:, None] * stride_h_slot + offs_n[None, :]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=slot_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_slots, stride_h_slot, stride_w_e, stride_w_n, stride_b_e, stride_y_slot,
    H: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[slot, n] = weight[slot] * (h[slot] . down[e, n] + bd[e, n]), float32, for one block
    of one expert's slots and BLOCK_N of the H columns."""
    pid = tl.program_id(0)
    num_n = (H + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        slot_ok = slots < num_slots
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        h_rows = h_ptr + slots[:, None] * stride_h_slot
        w_cols = w_ptr + expert * stride_w_e + offs_n[None, :] * stride_w_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < INTER
            a = tl.load(h_rows + offs_k[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert * stride_b_e + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc *= tl.load(weights_ptr + slots, mask=slot_ok, other=0.0)[:, None]
        y_ptrs = y_ptr + slots[:, None] * stride_y_slot + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=slot_ok[:, None] & n_ok[None, :])


class _Launch(NamedTuple):
    """Tile sizes and the compile-time flags both kernels share."""

    block_m: int
    block_n: int
    block_k: int
    upcast: bool
    dot_precision: str
    num_warps: int


def _launch(num_slots: int, num_experts: int, dtype: torch.dtype) -> _Launch:
    """BLOCK_M near the mean slots per expert (16 for decode: tl.dot's least), wider N tiles
    once blocks are full. float32 takes IEEE products: the tests hold it to the reference."""
    per_expert = -(-num_slots // num_experts)
    block_m = min(64, max(16, triton.next_power_of_2(per_expert)))
    block_n = 32 if block_m == 16 else 64
    interpret = interpreting()
    return _Launch(
        block_m,
        block_n,
        64 if block_m <= 32 else 32,
        interpret and dtype != torch.float32,
        "ieee" if dtype == torch.float32 else "tf32",
        4,
    )


def _check(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    num_experts, two_i, hidden = w_gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_i % 2:
        raise ValueError(f"x {tuple(x.shape)} and w_gate_up {tuple(w_gate_up.shape)} do not fit [T, H], [E, 2I, H]")
    if tuple(w_down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w_down {tuple(w_down.shape)}: expected {(num_experts, hidden, two_i // 2)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{x.shape[0]}, k]"
        )
    if not x.dtype == w_gate_up.dtype == w_down.dtype:
        raise ValueError(f"x, w_gate_up and w_down differ in dtype: {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    if not interpreting() and x.device.type != "cuda":
        raise ValueError(
            f"fused_moe needs CUDA tensors, got {x.device}; on the CPU set TRITON_INTERPRET=1 before triton is imported"
        )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    act_kind: int = ACT_SILU,
    alpha: float = 1.702,
    limit: float = 7.0,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' part of an MoE layer: [T, H] -> [T, H] in x's dtype (module docstring).
    x [T, H]; w_gate_up [E, 2I, H] (gate's rows then up's); w_down [E, H, I]; topk_weights
    [T, k] (float32, as the router gives them); topk_ids [T, k]; optional biases b_gate_up
    [E, 2I] and b_down [E, H]. act_kind: 0 SiLU, 1 GELU-tanh, 2 gpt-oss's clamped SwiGLU
    (`alpha`, `limit`)."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    num_slots = topk_ids.numel()
    if num_tokens == 0:
        return torch.empty_like(x)
    cfg = _launch(num_slots, num_experts, x.dtype)
    aligned = align_by_expert(topk_ids, num_experts, cfg.block_m)
    num_blocks = aligned.block_experts.numel()
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    h = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    bgu = b_gate_up.contiguous() if b_gate_up is not None else w_gate_up  # (unread without a bias)
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, cfg.block_n),)](
        x, w_gate_up, bgu, h, aligned.sorted_ids, aligned.block_experts, aligned.num_padded,
        num_slots, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), bgu.stride(0), h.stride(0),
        float(alpha), float(limit),
        H=hidden, INTER=inter, TOP_K=topk_ids.shape[1], ACT=int(act_kind), HAS_BIAS=b_gate_up is not None,
        UPCAST=cfg.upcast, DOT_PRECISION=cfg.dot_precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
    )  # fmt: skip
    y = torch.empty((num_slots, hidden), dtype=torch.float32, device=x.device)
    bd = b_down.contiguous() if b_down is not None else w_down
    weights = topk_weights.float().contiguous()
    _down_kernel[(num_blocks * triton.cdiv(hidden, cfg.block_n),)](
        h, w_down, bd, y, weights, aligned.sorted_ids, aligned.block_experts, aligned.num_padded,
        num_slots, h.stride(0), w_down.stride(0), w_down.stride(1), bd.stride(0), y.stride(0),
        H=hidden, INTER=inter, HAS_BIAS=b_down is not None, UPCAST=cfg.upcast, DOT_PRECISION=cfg.dot_precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
    )  # fmt: skip
    return y.view(num_tokens, -1, hidden).sum(dim=1).to(x.dtype)


def stack_experts(moe: nn.Module) -> StackedExperts:
    """The `experts` of an MoE module (each an MLP with gate_proj, up_proj, down_proj plain
    `nn.Linear`s) stacked as `fused_moe` reads them. The experts' parameters become views
    into the stacks (as `fuse_linears` does), so the weights are held once; an expert's
    fused `gate_up` too. ValueError when an expert's linears are not plain `nn.Linear`s
    (packed or quantized) or do not agree on shape, dtype, device or bias."""
    experts = list(moe.experts)
    linears = [(m.gate_proj, m.up_proj, m.down_proj) for m in experts]
    if any(type(lin) is not nn.Linear for trio in linears for lin in trio):
        raise ValueError("fused_moe stacks plain nn.Linear experts only (not packed or quantized ones)")
    if len({lin.bias is None for trio in linears for lin in trio}) != 1:
        raise ValueError("the experts' linears disagree on having biases")
    try:
        w_gate_up = torch.stack([torch.cat([g.weight.detach(), u.weight.detach()]) for g, u, _ in linears])
        w_down = torch.stack([d.weight.detach() for _, _, d in linears])
        b_gate_up = b_down = None
        if linears[0][0].bias is not None:
            b_gate_up = torch.stack([torch.cat([g.bias.detach(), u.bias.detach()]) for g, u, _ in linears])
            b_down = torch.stack([d.bias.detach() for _, _, d in linears])
    except (RuntimeError, TypeError, AttributeError) as exc:  # shapes, dtypes, devices or a missing bias
        raise ValueError(f"the experts do not stack: {exc}") from exc
    inter = w_gate_up.shape[1] // 2
    for e, (mlp, (gate, up, down)) in enumerate(zip(experts, linears, strict=True)):
        gate.weight = nn.Parameter(w_gate_up[e, :inter], requires_grad=False)
        up.weight = nn.Parameter(w_gate_up[e, inter:], requires_grad=False)
        down.weight = nn.Parameter(w_down[e], requires_grad=False)
        if b_gate_up is not None and b_down is not None:
            gate.bias = nn.Parameter(b_gate_up[e, :inter], requires_grad=False)
            up.bias = nn.Parameter(b_gate_up[e, inter:], requires_grad=False)
            down.bias = nn.Parameter(b_down[e], requires_grad=False)
        if getattr(mlp, "gate_up", None) is not None:
            mlp.gate_up = w_gate_up[e]
    return StackedExperts(w_gate_up, w_down, b_gate_up, b_down)
