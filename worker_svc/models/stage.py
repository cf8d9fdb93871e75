"""A decoder, one pipeline stage's slice of it: layers `[start, end)`.

    StageModel -> the architecture's decoder layer (worker_svc/models/, worker_svc/layers/)
               -> Attention / MLP / RMSNorm

The layers are the blocks of worker_svc/layers/ as the architecture composes them
(`Architecture.layer`, options in `ModelConfig`); this module runs them: embeddings (scaled
where the architecture says), one rotary table per kind of layer, the final norm, the LM
head and its soft-capping.

The first stage embeds token ids; the last applies the final norm and the LM head (to
the rows that are sampled only), and gives pooling requests the final norm's output
(`forward_pooled`). Parameter names equal the checkpoint's tensor names
(`model.layers.3.self_attn.q_proj.weight`), so loading is a name lookup.
Shapes: `T` tokens in the flattened batch, `H` query heads, `Hkv` KV heads, `D` head dim.
With tensor parallelism (worker_svc/execution/tensor_parallel.py) a rank's model is built from its
share of the config (`ModelConfig.shard`): H/t heads, Hkv/t KV heads, intermediate/t MLP
columns; each layer sums the ranks' o_proj and down_proj outputs (`reduce`).
A step with tokens of LoRA adapters (worker_svc/weights/lora.py) passes `lora`: each layer adds the
adapters' low-rank deltas to its products' outputs, per group of tokens; a step without
runs as it would with no adapters loaded (the native decode step included).
KV groups (services/kv_layout.py): the model's layout follows from its layers' windows
(`kv_layout`); a grouped step's metadata holds every sub-group's tables, and each layer
attends through its own sub-group's (`AttentionMetadata.group`); a one-group step hands
every layer the same metadata, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.kv_layout import KVLayout
from worker_svc.kernels.attention import AttentionBackend, AttentionMetadata
from worker_svc.layers.norm import RMSNorm
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.models.fused_decode import FusedDecoder
from worker_svc.models.registry import architecture_of_model
from worker_svc.weights.packed import PackedEmbedding, PackedLinear

if TYPE_CHECKING:  # worker_svc.weights.lora imports the loader, which imports this module
    from worker_svc.weights.lora import LoraStep


class _Body(nn.Module):
    """Holds what the checkpoint calls `model.*` for this stage."""

    def __init__(self, config: ModelConfig, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if first or (last and config.tie_word_embeddings)
            else None
        )
        layer = architecture_of_model(config.model_type).layer
        self.layers = nn.ModuleDict({str(i): layer(config, i) for i in range(start, end)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None


# Rotary tables (`StageModel._cos_sin`) cover positions up to this: 8 MB per kind of layer
# at head_dim 128 in float32; steps beyond it compute their rows
ROPE_TABLE_POSITIONS = 8192


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
        # one rotary table per kind of layer (Gemma 3: the sliding layers' own); each layer
        # reads its kind's cos/sin (`_rope_of`)
        ropes = [config.rope_for(i) for i in range(start, end)]
        kinds = list(dict.fromkeys(ropes))
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(r, config.head_dim, config.max_position_embeddings) for r in kinds
        )
        self.rotaries.to(device)
        self._rope_of = [kinds.index(r) for r in ropes]
        # per (dtype, device), each rotary's (cos, sin) of positions 0 ... n - 1 (`_cos_sin`)
        self._rope_tables: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # KV groups: the layout the KV service and the launcher derive alike, and each local
        # layer's sub-group (all 0 where the layers do not group)
        self.kv_layout: KVLayout = config.kv_layout
        self._kv_group_of = tuple(self.kv_layout.layer_places[i][0] for i in range(start, end))

    def kv_group_of(self, local: int) -> int:
        """The KV sub-group of local layer `local` (0 where the layers do not group)."""
        return self._kv_group_of[local]

    def rope_index(self, local: int) -> int:
        """Which of `rotaries` local layer `local` reads."""
        return self._rope_of[local]

    def fold_norm_offsets(self) -> None:
        """Norms that scale by (offset + w) (Gemma) scale by their weight from now on: called
        once the checkpoint's w is loaded (worker_svc/layers/norm.py)."""
        offset = self.config.norm_offset
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fold_offset(offset)

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
        lora: LoraStep | None = None,  # the step's adapter per token (worker_svc/weights/lora.py)
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
        pool_indices: torch.Tensor,  # rows pooling requests pool (worker_svc/execution/pooler.py)
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

    def _layers(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        *,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """This stage's layers: the hidden states [T, hidden] they output (before the final norm).
        A step with no adapter tokens (`lora` None or not `active`) runs as any step does."""
        body = self.model
        h = self._embed(inputs) if self.is_first else inputs
        ropes = self._cos_sin(positions, max(metadata.context_lens_list), h.dtype)
        if metadata.num_groups != 1 and metadata.num_groups != self.kv_layout.num_groups:
            raise ValueError(
                f"a step of {metadata.num_groups} KV groups; this model's layers form {self.kv_layout.num_groups}"
            )
        if lora is not None and lora.active:
            self._check_lora(lora, h.shape[0])
            metas = metadata.layer_views(self._kv_group_of)  # each layer's sub-group's
            for local, layer in enumerate(body.layers.values()):
                h = layer.forward(
                    h, ropes[self._rope_of[local]], kv_pools[local], metas[local], backend, lora=lora.layer(local)
                )
                self.on_layer()
            return h
        if self.fused_decode is not None and self.fused_decode.applies(h, metadata, kv_pools):
            return self.fused_decode.forward(h, ropes, kv_pools, metadata)  # (reads each layer's group itself)
        metas = metadata.layer_views(self._kv_group_of)
        for local, layer in enumerate(body.layers.values()):
            h = layer.forward(h, ropes[self._rope_of[local]], kv_pools[local], metas[local], backend)
            self.on_layer()
        return h

    def _cos_sin(
        self, positions: torch.Tensor, end: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each rotary's cos/sin ([T, 1, head_dim] each) at `positions`, all below `end`: rows
        of tables of every position kept per dtype and device (computed as `cos_sin` computes them, so
        equal bit for bit; tested), grown by doubling up to ROPE_TABLE_POSITIONS. A decode
        step gathers its rows (4 us) where computing them took 23 us."""
        if end > ROPE_TABLE_POSITIONS:
            return [r.cos_sin(positions, dtype) for r in self.rotaries]
        key = (dtype, positions.device)
        tables = self._rope_tables.get(key)
        if tables is None or tables[0][0].shape[0] < end:
            size = min(ROPE_TABLE_POSITIONS, max(256, 1 << (end - 1).bit_length()))
            every = torch.arange(size, device=positions.device)
            tables = self._rope_tables[key] = [r.cos_sin(every, dtype) for r in self.rotaries]
        return [(cos.index_select(0, positions), sin.index_select(0, positions)) for cos, sin in tables]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids [T] -> [T, hidden]."""
        embed = self.model.embed_tokens
        packed = embed.linear if isinstance(embed, PackedEmbedding) else None
        if packed is not None and packed.kernels is not None and packed.qtype != "BF16" and ids.is_cpu:
            # the rows looked up, dequantized in one native pass, bit for bit the torch
            # dequantizer `PackedEmbedding` runs (a Q6_K row: 12 us against 90)
            h = packed.kernels.dequantize_f32(packed.qweight.index_select(0, ids), packed.qtype, embed.embedding_dim)
        else:
            h = embed(ids)
        if self.config.embed_scale is not None:  # Gemma: times sqrt(hidden) in the model dtype
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def _check_lora(self, lora: LoraStep, num_tokens: int) -> None:
        bank = lora.bank
        if (bank.start, bank.end) != (self.start, self.end) or lora.num_tokens != num_tokens:
            raise ValueError(
                f"LoRA step of {lora.num_tokens} tokens over layers [{bank.start}, "
                f"{bank.end}); this stage runs {num_tokens} tokens over [{self.start}, {self.end})"
            )

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over normed hidden states [N, hidden] -> [N, vocab] (soft-capped
        where the architecture says: cap * tanh(logits / cap))."""
        body = self.model
        if self.lm_head is not None:
            logits = self.lm_head(h) if isinstance(self.lm_head, PackedLinear) else F.linear(h, self.lm_head.weight)
        elif isinstance(body.embed_tokens, PackedEmbedding):  # tied, packed
            logits = body.embed_tokens.as_linear(h)
        else:
            logits = F.linear(h, body.embed_tokens.weight)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
