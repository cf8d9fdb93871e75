"""The gated MLP: down(act(gate(x)) * up(x)), act SiLU (Llama, Qwen, Phi-3) or GELU with
the tanh approximation (Gemma's `gelu_pytorch_tanh`); gpt-oss's experts gate with a clamped
SwiGLU instead, (clamp(up) + 1) * g * sigmoid(alpha * g) for g = min(gate, limit), and carry
biases on all three products."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.linear import fuse_linears
from worker_svc.model_config import ModelConfig
from worker_svc.weights.packed import PackedLinear

if TYPE_CHECKING:  # worker_svc.weights.lora imports the loader, which imports the model
    from worker_svc.weights.lora import LoraLayer

_GATE_UP = ("gate_proj", "up_proj")  # worker_svc.weights.lora_adapter.GATE_UP_TARGETS
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SWIGLU_OAI = "swiglu_oai"  # gpt-oss's experts' clamped SwiGLU (`GatedAct`)
# the native kernels' numbering of the gating functions (csrc/decode_layers.c)
ACT_KINDS = {"silu": 0, "gelu_pytorch_tanh": 1, SWIGLU_OAI: 2}


@dataclass(frozen=True)
class GatedAct:
    """How an MLP gates: `name` one of ACT_KINDS; gpt-oss's `alpha` and `limit`."""

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def kind(self) -> int:
        return ACT_KINDS[self.name]

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return F.silu(gate) * up
        if self.name == SWIGLU_OAI:
            gate = gate.clamp(max=self.limit)
            return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)
        return F.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        intermediate_size: int | None = None,
        *,
        act: GatedAct | None = None,
        bias: bool = False,
    ) -> None:
        """`intermediate_size`, `act`, `bias`: an expert's (worker_svc/layers/moe.py); by
        default the config's size and `hidden_act`, no biases."""
        super().__init__()
        if act is None and config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r}: supported {', '.join(ACTIVATIONS)}")
        size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, size, bias=bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)
        self.gated = act or GatedAct(config.hidden_act)
        self.act_kind = self.gated.kind
        self.alpha, self.limit = self.gated.alpha, self.gated.limit
        self.silu = self.act_kind == 0
        self.gate_up: torch.Tensor | None = None  # set by fuse()
        self.gate_up_packed: PackedLinear | None = None  # set by fuse() when gate/up are packed

    def forward(self, x: torch.Tensor, *, lora: LoraLayer | None = None) -> torch.Tensor:
        if lora is not None:
            return self._forward_lora(x, lora)
        size = self.gate_proj.out_features
        if self.gate_up_packed is not None:
            gate_up = self.gate_up_packed(x)
            kernels = self.gate_up_packed.kernels
            if kernels is not None and gate_up.dim() == 2 and self.silu:  # one native pass (packed stages)
                return self.down_proj(kernels.silu_mul(gate_up))
            return self.down_proj(self.gated(gate_up[:, :size], gate_up[:, size:]))
        if self.gate_up is not None:
            gate_up = F.linear(x, self.gate_up)
            return F.linear(self.gated(gate_up[:, :size], gate_up[:, size:]), self.down_proj.weight)
        return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))

    def _forward_lora(self, x: torch.Tensor, lora: LoraLayer) -> torch.Tensor:
        """`forward` with the step's adapters: their deltas added to the gate/up products
        (fused or not) and to down_proj's output (a partial sum under tensor parallelism)."""
        size = self.gate_proj.out_features
        if self.gate_up_packed is not None or self.gate_up is not None:
            gate_up = self.gate_up_packed(x) if self.gate_up_packed is not None else F.linear(x, self.gate_up)
            lora.add(gate_up, x, _GATE_UP)
            gate, up = gate_up[:, :size], gate_up[:, size:]
        else:
            gate = lora.add(self.gate_proj(x), x, ("gate_proj",))
            up = lora.add(self.up_proj(x), x, ("up_proj",))
        act = self.gated(gate, up)
        return lora.add(self.down_proj(act), act, ("down_proj",))

    def fuse(self) -> bool:
        """Compute gate and up with one matrix product (see `fuse_linears`; packed layers:
        `PackedLinear.concat`)."""
        if isinstance(self.gate_proj, PackedLinear) and isinstance(self.up_proj, PackedLinear):
            self.gate_up_packed = PackedLinear.concat([self.gate_proj, self.up_proj])
            return self.gate_up_packed is not None
        if type(self.down_proj) is not nn.Linear or self.gate_proj.bias is not None:
            return False
        fused = fuse_linears(self.gate_proj, self.up_proj)
        self.gate_up = None if fused is None else fused[0]
        return self.gate_up is not None
