"""A Llama-family decoder, one pipeline stage's slice of it: layers `[start, end)`.

    StageModel -> DecoderLayer -> Attention / MLP / RMSNorm

The first stage embeds token ids; the last applies the final norm and the LM head (to
the rows that are sampled only), and gives pooling requests the final norm's output
(`forward_pooled`). Parameter names equal the checkpoint's tensor names
(`model.layers.3.self_attn.q_proj.weight`), so loading is a name lookup.
Shapes: `T` tokens in the flattened batch, `H` query heads, `Hkv` KV heads, `D` head dim.
With tensor parallelism (worker_svc/tensor_parallel.py) a rank's model is built from its
share of the config (`ModelConfig.shard`): H/t heads, Hkv/t KV heads, intermediate/t MLP
columns; each layer sums the ranks' o_proj and down_proj outputs (`reduce`).
A step with tokens of LoRA adapters (worker_svc/lora.py) passes `lora`: each layer adds the
adapters' low-rank deltas to its products' outputs, per group of tokens; a step without
runs as it would with no adapters loaded (the native decode step included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.attention import AttentionBackend, AttentionMetadata
from worker_svc.fused_decode import FusedDecoder
from worker_svc.model_config import ModelConfig
from worker_svc.packed import PackedEmbedding, PackedLinear
from worker_svc.rope import RotaryEmbedding, apply_rotary, rotate

if TYPE_CHECKING:  # worker_svc.lora imports the loader, which imports this module
    from worker_svc.lora import LoraLayer, LoraStep

_QKV = ("q_proj", "k_proj", "v_proj")  # worker_svc.lora.QKV_TARGETS
_GATE_UP = ("gate_proj", "up_proj")  # worker_svc.lora.GATE_UP_TARGETS


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, bit for bit the reference's result
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalise in float32, as the reference does, then scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _fuse_linears(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for linears that read the same input, their outputs side by
    side; each linear's own parameters become views into it, so the weights are held once
    and keep their checkpoint names. None when any of them is not a plain `nn.Linear`
    (a quantized one) or they do not agree on dtype, device and bias."""
    if any(type(m) is not nn.Linear for m in linears):
        return None
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or weights[0].is_meta:
        return None
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([w.detach() for w in weights])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_window
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
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
        lora: LoraLayer | None = None,  # the step's adapters at this layer (worker_svc/lora.py)
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        k_pool, v_pool = kv
        if self.qkv is not None or self.qkv_packed is not None:  # one product
            if self.qkv_packed is not None:
                qkv = self.qkv_packed(x)
            else:
                weight, bias = self.qkv
                qkv = F.linear(x, weight, bias)
            if lora is not None:
                lora.add(qkv, x, _QKV)
            q = qkv[:, : self.num_heads * self.head_dim].view(num_tokens, self.num_heads, self.head_dim)
            native = getattr(backend, "rope_write", None)  # rotation and K/V write in one call
            if native is None or not native(qkv, *rope, k_pool, v_pool, metadata.slot_mapping, self.num_heads):
                qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim  # q, k rotated together
                qk = rotate(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim), *rope)
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
                v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
                backend.write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if lora is not None:
                q, k, v = (lora.add(out, x, (name,)) for out, name in zip((q, k, v), _QKV, strict=True))
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary(q, k, *rope)
            backend.write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
        out = backend.forward(q, k_pool, v_pool, metadata, self.scale, self.sliding_window)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if lora is not None:  # a partial sum under tensor parallelism, as o_proj's own
            return lora.add(self.o_proj(out), out, ("o_proj",))
        if self.qkv is not None:  # a plain linear: skip the module call
            return F.linear(out, self.o_proj.weight)
        return self.o_proj(out)

    def fuse(self) -> bool:
        """Compute q, k and v with one matrix product (see `_fuse_linears`; packed layers:
        `PackedLinear.concat`)."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if all(isinstance(m, PackedLinear) for m in parts):
            self.qkv_packed = PackedLinear.concat(parts)
            return self.qkv_packed is not None
        if type(self.o_proj) is nn.Linear:
            self.qkv = _fuse_linears(*parts)
        return self.qkv is not None


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        self.gate_up: torch.Tensor | None = None  # set by fuse()
        self.gate_up_packed: PackedLinear | None = None  # set by fuse() when gate/up are packed

    def forward(self, x: torch.Tensor, *, lora: LoraLayer | None = None) -> torch.Tensor:
        if lora is not None:
            return self._forward_lora(x, lora)
        if self.gate_up_packed is not None:
            gate_up = self.gate_up_packed(x)
            kernels = self.gate_up_packed.kernels
            if kernels is not None and gate_up.dim() == 2:  # one native pass (packed stages only)
                return self.down_proj(kernels.silu_mul(gate_up))
            size = self.gate_proj.out_features
            return self.down_proj(F.silu(gate_up[:, :size]) * gate_up[:, size:])
        if self.gate_up is not None:
            gate_up = F.linear(x, self.gate_up)
            size = self.gate_proj.out_features
            return F.linear(F.silu(gate_up[:, :size]) * gate_up[:, size:], self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

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
        act = F.silu(gate) * up
        return lora.add(self.down_proj(act), act, ("down_proj",))

    def fuse(self) -> bool:
        """Compute gate and up with one matrix product (see `_fuse_linears`; packed layers:
        `PackedLinear.concat`)."""
        if isinstance(self.gate_proj, PackedLinear) and isinstance(self.up_proj, PackedLinear):
            self.gate_up_packed = PackedLinear.concat([self.gate_proj, self.up_proj])
            return self.gate_up_packed is not None
        if type(self.down_proj) is not nn.Linear or self.gate_proj.bias is not None:
            return False
        fused = _fuse_linears(self.gate_proj, self.up_proj)
        self.gate_up = None if fused is None else fused[0]
        return self.gate_up is not None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # tensor parallelism: sums the ranks' partial outputs of o_proj and down_proj in
        # place (each rank holds some heads and MLP columns); None on one rank
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

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
        out = self.self_attn.forward(rms_norm(h, norm.weight, norm.eps), rope, kv, metadata, backend,
                                     lora=lora)
        h = h + (out if self.reduce is None else self.reduce(out))
        norm = self.post_attention_layernorm
        out = self.mlp.forward(rms_norm(h, norm.weight, norm.eps), lora=lora)
        return h + (out if self.reduce is None else self.reduce(out))


class _Body(nn.Module):
    """Holds what the checkpoint calls `model.*` for this stage."""

    def __init__(self, config: ModelConfig, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if first or (last and config.tie_word_embeddings)
            else None
        )
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in range(start, end)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None


def _no_progress() -> None:
    pass


class StageModel(nn.Module):
    """Layers `[start, end)` of the model; `is_first` embeds, `is_last` yields logits."""

    def __init__(
        self,
        config: ModelConfig,
        start: int,
        end: int,
        is_first: bool,
        is_last: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside 0..{config.num_layers}")
        self.config = config
        self.start, self.end = start, end
        self.is_first, self.is_last = is_first, is_last
        self.source_dir: str | None = None  # the checkpoint folder, set by load_stage
        self.weight_format = ""  # packed weights' format ("gguf:Q4_1/Q8_0"), set by the loader
        # packed stages: every layer of a decode step in one native call (fuse_projections)
        self.fused_decode: FusedDecoder | None = None
        self.on_layer: Callable[[], None] = _no_progress  # called after each layer (a stage's progress)
        # Weights come from the checkpoint (load_state_dict(assign=True)): build them on the
        # meta device so that nothing is allocated or initialised twice.
        with torch.device("meta"):
            self.model = _Body(config, start, end, is_first, is_last)
            self.lm_head = (
                nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                if is_last and not config.tie_word_embeddings
                else None
            )
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.rotary.to(device)

    @property
    def num_local_layers(self) -> int:
        return self.end - self.start

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> shape, for exactly what this stage loads."""
        return {name: tuple(p.shape) for name, p in self.named_parameters()}

    def set_reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Tensor parallelism: the all-reduce each layer applies to its row-parallel outputs."""
        for layer in self.model.layers.values():
            layer.reduce = reduce
        if reduce is not None:  # the native decode step sums no ranks
            self.fused_decode = None

    def fuse_projections(self) -> int:
        """Fuse each layer's q/k/v and gate/up products (after loading and any quantization;
        layers with quantized linears keep theirs). Returns how many layers were fused."""
        fused = 0
        for layer in self.model.layers.values():
            fused += int(layer.self_attn.fuse() & layer.mlp.fuse())
        if fused == self.num_local_layers:
            self.fused_decode = FusedDecoder.for_model(self)
        return fused

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,  # stage 0: token ids [T]; later stages: hidden [T, hidden]
        positions: torch.Tensor,  # [T]
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) per local layer
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,  # rows to sample, last stage only
        *,
        lora: LoraStep | None = None,  # the step's adapter per token (worker_svc/lora.py)
    ) -> torch.Tensor:
        """Returns hidden states [T, hidden], or on the last stage logits [len(logits_indices), vocab]."""
        h = self._layers(inputs, positions, kv_pools, metadata, backend, lora=lora)
        if not self.is_last:
            return h
        if logits_indices is not None:
            h = h[logits_indices]
        return self._logits(self.model.norm(h))

    @torch.inference_mode()
    def forward_pooled(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # rows to sample
        pool_indices: torch.Tensor,  # rows pooling requests pool (worker_svc/pooler.py)
        *,
        lora: LoraStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage with pooling rows: (logits [len(logits_indices), vocab], the final
        norm's output [len(pool_indices), hidden])."""
        if not self.is_last:
            raise ValueError("forward_pooled: only the last stage applies the final norm")
        h = self._layers(inputs, positions, kv_pools, metadata, backend, lora=lora)
        norm = self.model.norm
        return self._logits(norm(h[logits_indices])), norm(h[pool_indices])

    def _layers(self, inputs: torch.Tensor, positions: torch.Tensor,
                kv_pools: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
                backend: AttentionBackend, *, lora: LoraStep | None = None) -> torch.Tensor:
        """This stage's layers: the hidden states [T, hidden] they output (before the final norm).
        A step with no adapter tokens (`lora` None or not `active`) runs as any step does."""
        body = self.model
        h = body.embed_tokens(inputs) if self.is_first else inputs
        rope = self.rotary.cos_sin(positions, h.dtype)
        if lora is not None and lora.active:
            self._check_lora(lora, h.shape[0])
            for local, layer in enumerate(body.layers.values()):
                h = layer.forward(h, rope, kv_pools[local], metadata, backend, lora=lora.layer(local))
                self.on_layer()
            return h
        if self.fused_decode is not None and self.fused_decode.applies(h, metadata, kv_pools):
            return self.fused_decode.forward(h, rope, kv_pools, metadata, self.config.sliding_window)
        for local, layer in enumerate(body.layers.values()):
            h = layer.forward(h, rope, kv_pools[local], metadata, backend)
            self.on_layer()
        return h

    def _check_lora(self, lora: LoraStep, num_tokens: int) -> None:
        bank = lora.bank
        if (bank.start, bank.end) != (self.start, self.end) or lora.num_tokens != num_tokens:
            raise ValueError(f"LoRA step of {lora.num_tokens} tokens over layers [{bank.start}, "
                             f"{bank.end}); this stage runs {num_tokens} tokens over [{self.start}, {self.end})")

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over normed hidden states [N, hidden] -> [N, vocab]."""
        body = self.model
        if self.lm_head is not None:
            return self.lm_head(h) if isinstance(self.lm_head, PackedLinear) else F.linear(h, self.lm_head.weight)
        if isinstance(body.embed_tokens, PackedEmbedding):  # tied, packed
            return body.embed_tokens.as_linear(h)
        return F.linear(h, body.embed_tokens.weight)
