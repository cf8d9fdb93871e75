"""Decoder layers: attention and MLP blocks around the residual stream.

    DecoderLayer          h += attn(norm(h));            h += mlp(norm(h))         Llama, Qwen, Phi-3
    SandwichDecoderLayer  h += norm(attn(norm(h)));      h += norm(mlp(norm(h)))   Gemma 2, Gemma 3

Under tensor parallelism each rank holds some heads and MLP columns: `reduce` sums the
ranks' partial outputs of o_proj and down_proj (None on one rank), before any norm after
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker_svc.kernels.attention import AttentionBackend, AttentionMetadata
from worker_svc.layers.attention import Attention
from worker_svc.layers.mlp import MLP
from worker_svc.layers.moe import MoE
from worker_svc.layers.norm import RMSNorm, rms_norm
from worker_svc.model_config import ModelConfig
from worker_svc.weights.packed import PackedLinear

if TYPE_CHECKING:  # worker_svc.weights.lora imports the loader, which imports the model
    from worker_svc.weights.lora import LoraLayer


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe(layer) else MLP(config)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def norms(self) -> list[RMSNorm]:
        return [m for m in self.modules() if isinstance(m, RMSNorm)]

    @property
    def native_decode(self) -> bool:
        """Whether the native decode step (worker_svc/models/fused_decode.py) computes this layer:
        it computes every option of worker_svc/layers/ (pre-norm or sandwich, SiLU, GELU-tanh or
        the clamped SwiGLU, q/k norms, windows, rotary tables, soft-capped scores, sinks), and a
        mixture of experts whose experts are all packed (float32 experts: the module path)."""
        if not isinstance(self.mlp, MoE):
            return True
        if len(self.mlp.local) != self.mlp.num_experts:  # expert parallelism (under TP: no native step)
            return False
        shared = [] if self.mlp.shared_expert is None else [self.mlp.shared_expert]
        return all(
            isinstance(e.gate_up_packed, PackedLinear) and isinstance(e.down_proj, PackedLinear)
            for e in [*self.mlp.held(), *shared]
        )

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        *,
        lora: LoraLayer | None = None,
    ) -> torch.Tensor:
        # Module calls cost more than a small decode step's arithmetic: call the forwards.
        norm = self.input_layernorm
        out = self.self_attn.forward(rms_norm(h, norm.weight, norm.eps), rope, kv, metadata, backend, lora=lora)
        h = h + (out if self.reduce is None else self.reduce(out))
        norm = self.post_attention_layernorm
        out = self.mlp.forward(rms_norm(h, norm.weight, norm.eps), lora=lora)
        return h + (out if self.reduce is None else self.reduce(out))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma's layer: `post_attention_layernorm` normalises the attention's output, and the
    MLP has a norm before (`pre_feedforward_layernorm`) and after it."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        *,
        lora: LoraLayer | None = None,
    ) -> torch.Tensor:
        norm = self.input_layernorm
        out = self.self_attn.forward(rms_norm(h, norm.weight, norm.eps), rope, kv, metadata, backend, lora=lora)
        out = out if self.reduce is None else self.reduce(out)
        norm = self.post_attention_layernorm
        h = h + rms_norm(out, norm.weight, norm.eps)
        norm = self.pre_feedforward_layernorm
        out = self.mlp.forward(rms_norm(h, norm.weight, norm.eps), lora=lora)
        out = out if self.reduce is None else self.reduce(out)
        norm = self.post_feedforward_layernorm
        return h + rms_norm(out, norm.weight, norm.eps)
