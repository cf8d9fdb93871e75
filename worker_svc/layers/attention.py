"""The attention block: q/k/v products, optional per-head q/k RMSNorm (Qwen3, Gemma 3),
rotary, the K/V write to the paged pools, paged attention (worker_svc/kernels/attention.py's
backends: window, logit soft-capping and gpt-oss's sinks as the layer's options) and o_proj.
A sink is a learned logit per head that joins every softmax's denominator and attends to
nothing, so a head can give its queries' weight away.

Shapes: `T` tokens in the flattened batch, `H` query heads, `Hkv` KV heads, `D` head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.kernels.attention import AttentionBackend, AttentionMetadata
from worker_svc.layers.linear import fuse_linears
from worker_svc.layers.norm import RMSNorm, rms_norm
from worker_svc.layers.rotary import rotate
from worker_svc.model_config import ModelConfig
from worker_svc.weights.packed import PackedLinear

if TYPE_CHECKING:  # worker_svc.weights.lora imports the loader, which imports the model
    from worker_svc.weights.lora import LoraLayer

_QKV = ("q_proj", "k_proj", "v_proj")  # worker_svc.weights.lora_adapter.QKV_TARGETS


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.sliding_window = config.window(layer)
        self.softcap = config.attn_logit_softcap
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        # [H] one learned logit a head (gpt-oss); None: plain softmax
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()
        self.qkv_packed: PackedLinear | None = None  # set by fuse() when q/k/v are packed

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D]
        kv: tuple[torch.Tensor, torch.Tensor],  # pools [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        *,
        lora: LoraLayer | None = None,  # the step's adapters at this layer (worker_svc/weights/lora.py)
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv is not None or self.qkv_packed is not None:  # one product
            q = self._fused_qkv(x, rope, kv, metadata, backend, lora)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if lora is not None:
                q, k, v = (lora.add(out, x, (name,)) for out, name in zip((q, k, v), _QKV, strict=True))
            q = self._norm(q.view(num_tokens, self.num_heads, self.head_dim), self.q_norm)
            k = self._norm(k.view(num_tokens, self.num_kv_heads, self.head_dim), self.k_norm)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = rotate(q, *rope), rotate(k, *rope)
            backend.write_kv(*kv, k, v, metadata.slot_mapping)
        # the options only where set: a backend without one (Triton: no soft-capping) refuses it
        options = {k: v for k, v in (("softcap", self.softcap), ("sinks", self.sinks)) if v is not None}
        out = backend.forward(q, *kv, metadata, self.scale, self.sliding_window, **options)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if lora is not None:  # a partial sum under tensor parallelism, as o_proj's own
            return lora.add(self.o_proj(out), out, ("o_proj",))
        if self.qkv is not None:  # a plain linear: skip the module call
            return F.linear(out, self.o_proj.weight, self.o_proj.bias)
        return self.o_proj(out)

    @staticmethod
    def _norm(x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        return x if norm is None else rms_norm(x, norm.weight, norm.eps)

    def _fused_qkv(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoraLayer | None,
    ) -> torch.Tensor:
        """q [T, H, D] from one q/k/v product; k and v rotated and written to the pools."""
        num_tokens = x.shape[0]
        if self.qkv_packed is not None:
            qkv = self.qkv_packed(x)
        else:
            weight, bias = self.qkv
            qkv = F.linear(x, weight, bias)
        if lora is not None:
            lora.add(qkv, x, _QKV)
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim  # q, k side by side
        if self.q_norm is not None:  # normalised in place, then rotated as any q/k
            q_size = self.num_heads * self.head_dim
            q_view = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
            k_view = qkv[:, q_size:qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            q_view.copy_(self._norm(q_view, self.q_norm))
            k_view.copy_(self._norm(k_view, self.k_norm))
        q = qkv[:, : self.num_heads * self.head_dim].view(num_tokens, self.num_heads, self.head_dim)
        native = getattr(backend, "rope_write", None)  # rotation and K/V write in one call
        if native is None or not native(qkv, *rope, *kv, metadata.slot_mapping, self.num_heads):
            qk = rotate(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim), *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            backend.write_kv(*kv, k, v, metadata.slot_mapping)
        return q

    def fuse(self) -> bool:
        """Compute q, k and v with one matrix product (see `fuse_linears`; packed layers:
        `PackedLinear.concat`)."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if all(isinstance(m, PackedLinear) for m in parts):
            self.qkv_packed = PackedLinear.concat(parts)
            return self.qkv_packed is not None
        if type(self.o_proj) is nn.Linear:
            self.qkv = fuse_linears(*parts)
        return self.qkv is not None
