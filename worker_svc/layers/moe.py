"""The mixture-of-experts MLP, one block for every MoE architecture (`MoEConfig`).

    weights, experts = top_k(softmax(router(x)))      (renormalised to sum 1 when asked)
    weights, experts = softmax(top_k(router(x)))      (gpt-oss: `softmax_after_topk`)
    out = sum over the token's experts of weight * expert(x)   [+ sigmoid(gate(x)) * shared(x)]

Each expert is the gated MLP of worker_svc/layers/mlp.py, named as checkpoints name them
(`experts.N.gate_proj`...), so loading, tensor parallelism (each expert's columns split like
a dense MLP's), packed weights and the bfloat16 packing apply to them unchanged. A step's
rows are grouped by expert: each active expert's weights are read once, for all the rows
routed to it, never once per token. The router and the combination run in float32.

On a GPU, `fuse` stacks the experts ([E, 2I, hidden] and [E, hidden, I], the experts' own
weights then views of them) and a step runs the fused-MoE Triton kernels
(worker_svc/kernels/triton_moe.py: rows aligned by expert into blocks, one grouped product
for gate/up with the activation, one for down with the routing weights) instead of the
loop over experts; packed or quantized experts keep the loop.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.layers.mlp import MLP, GatedAct
from worker_svc.model_config import ModelConfig
from worker_svc.weights.quantization import weight_bytes


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.renormalize, self.num_experts = moe.top_k, moe.renormalize, moe.num_experts
        self.softmax_after_topk = moe.softmax_after_topk
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=moe.router_bias)  # the router
        act = GatedAct(moe.activation or config.hidden_act, moe.swiglu_alpha, moe.swiglu_limit)
        # expert parallelism: the experts other ranks hold are empty places (no weights), so
        # every expert keeps its checkpoint name `experts.N`
        self.local = moe.local_experts
        self.experts = nn.ModuleList(
            MLP(config, moe.intermediate_size, act=act, bias=moe.expert_bias) if e in self.local else nn.Identity()
            for e in range(moe.num_experts)
        )
        self.shared_expert = MLP(config, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if self.shared_expert else None
        self.stacked = None  # the experts stacked for the fused kernels (`stack`), or None: the loop

    def fuse(self) -> bool:
        """Each expert's gate and up in one product (`MLP.fuse`); on a GPU, the experts
        stacked for the fused kernels."""
        experts = [*self.held(), *([self.shared_expert] if self.shared_expert is not None else [])]
        fused = all([e.fuse() for e in experts])
        router = next(t for t in (*self.gate.parameters(), *self.gate.buffers()))  # a PackedLinear's too
        if router.device.type == "cuda":
            self.stack()
        return fused

    def held(self) -> list[MLP]:
        """The experts this rank holds (all of them without expert parallelism)."""
        return [self.experts[e] for e in self.local]

    def stack(self) -> bool:
        """Run the experts through the fused-MoE kernels from now on (where the Triton
        kernels run: a GPU, or the CPU under the interpreter); False where they cannot
        stack (packed or quantized experts), which keep the loop."""
        from worker_svc.kernels.triton_moe import stack_experts

        if len(self.local) != self.num_experts:  # expert parallelism: the loop over the rank's own
            return False
        try:
            self.stacked = stack_experts(self)
        except ValueError:
            self.stacked = None
        return self.stacked is not None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [rows, top_k] float32, experts [rows, top_k]) of each row."""
        logits = self.gate(x).float()
        if self.softmax_after_topk:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor, *, lora=None) -> torch.Tensor:
        if lora is not None:
            raise ValueError("LoRA adapters on mixture-of-experts layers are not served")
        weights, experts = self.route(x)
        out = self._fused(x, weights, experts) if self.stacked is not None else self._loop(x, weights, experts)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x).float())
            out += gate * self.shared_expert.forward(x).float()
        return out.to(x.dtype)

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        from worker_svc.kernels.triton_moe import fused_moe

        s, act = self.stacked, self.experts[0].gated
        return fused_moe(
            x,
            s.w_gate_up,
            s.w_down,
            weights,
            experts,
            act_kind=act.kind,
            alpha=act.alpha,
            limit=act.limit,
            b_gate_up=s.b_gate_up,
            b_down=s.b_down,
        ).float()

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] float32: each active expert over the rows routed to it."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
        rows = order // self.top_k
        slot_weights = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count and expert in self.local:
                sel = rows[start : start + count]
                y = self.experts[expert].forward(x.index_select(0, sel))
                out.index_add_(0, sel, y.float() * slot_weights[start : start + count, None])
            start += count
        return out


def expert_weight_bytes(model: nn.Module) -> int:
    """Of `weight_bytes(model)`, what the experts of its mixture-of-experts layers hold."""
    return sum(weight_bytes(m.experts) for m in model.modules() if isinstance(m, MoE))
