"""Paged attention over a flattened, variable-length batch.

A batch mixes prefill chunks and single decode tokens of several sequences, with no
padding: sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`, and after
this step its KV holds `context_lens[i]` tokens, the last `num_new` of them being this
step's (so the chunk attends causally within itself and fully over the cached context).
Its KV lives in the blocks `block_tables[i]`: token t of the sequence is in block
`block_tables[i][t // block_size]`, offset `t % block_size`.

`TorchAttentionBackend` is the reference and the CPU path; a Triton backend implements
the same two methods (`write_kv`, `forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step layout of a flattened batch; tensors live on the stage's device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, on CPU as a list too
    context_lens: torch.Tensor  # [num_seqs] int64: tokens in KV after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_start_loc_list: tuple[int, ...]
    context_lens_list: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)


class AttentionBackend(Protocol):
    def write_kv(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Plain torch paged attention: gathers each sequence's blocks and runs SDPA."""

    name = "torch"

    def write_kv(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # pools: [num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
        k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def forward(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim] -> out: same shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        starts = metadata.query_start_loc_list
        decodes = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
        batched: set[int] = set()
        if len(decodes) > 1 and self._batch_decodes(decodes, metadata, num_kv_heads * head_dim):
            # single-token rows in one batched computation, padded to the longest context
            self._decode_batch(q, k_pool, v_pool, metadata, decodes, scale, sliding_window, out)
            batched = set(decodes)
        for i, ctx in enumerate(metadata.context_lens_list):
            if i in batched:
                continue
            q_start, q_end = starts[i], starts[i + 1]
            num_new = q_end - q_start
            num_blocks = -(-ctx // block_size)
            blocks = metadata.block_tables[i, :num_blocks]
            k = k_pool[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]  # [ctx, kv_heads, d]
            v = v_pool[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            mask = _mask(num_new, ctx, sliding_window, q.device)
            o = F.scaled_dot_product_attention(
                q[q_start:q_end].transpose(0, 1),  # [heads, num_new, d]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
            )
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    # Measured on CPU (one thread): batching single-token rows halves a decode step where the
    # per-sequence loop's fixed cost dominates (tiny models: 3.0 vs 6.5 ms for 16 sequences),
    # but costs more than it saves once each sequence's K/V is large (25M model, 200-token
    # contexts: 80 vs 48 ms), where the fused SDPA kernel per sequence wins.
    BATCH_DECODE_MAX_ELEMENTS = 16_384  # max context x num_kv_heads x head_dim

    def _batch_decodes(self, rows, metadata, kv_width: int) -> bool:
        max_ctx = max(metadata.context_lens_list[i] for i in rows)
        return max_ctx * kv_width <= self.BATCH_DECODE_MAX_ELEMENTS

    def _decode_batch(self, q, k_pool, v_pool, metadata, rows, scale, sliding_window, out) -> None:
        """Single-token rows together: gather each one's blocks, mask the padding, two matmuls."""
        block_size, num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
        group = q.shape[1] // num_kv_heads
        n = len(rows)
        ctx_list = [metadata.context_lens_list[i] for i in rows]
        max_ctx = max(ctx_list)
        max_blocks = -(-max_ctx // block_size)
        index = torch.tensor(rows, dtype=torch.long, device=q.device)
        tables = metadata.block_tables[index, :max_blocks]  # [S, max_blocks]; padding reads block 0
        k = k_pool[tables].view(n, max_blocks * block_size, num_kv_heads, head_dim)[:, :max_ctx]
        v = v_pool[tables].view(n, max_blocks * block_size, num_kv_heads, head_dim)[:, :max_ctx]
        token_rows = torch.tensor([metadata.query_start_loc_list[i] for i in rows], device=q.device)
        qg = q[token_rows].view(n, num_kv_heads, group, head_dim)  # [S, Hkv, g, D]
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [S, Hkv, g, ctx]
        ctx = torch.tensor(ctx_list, device=q.device)
        pos = torch.arange(max_ctx, device=q.device)[None, :]
        keep = pos < ctx[:, None]
        if sliding_window is not None:
            keep &= pos > (ctx[:, None] - 1 - sliding_window)
        scores.masked_fill_(~keep[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        o = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [S, Hkv, g, D]
        out[token_rows] = o.reshape(n, num_kv_heads * group, head_dim)


def _mask(
    num_new: int, ctx: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [num_new, ctx] mask (True = attend): causal within the chunk, windowed if asked."""
    if num_new == 1 and (sliding_window is None or ctx <= sliding_window):
        return None
    q_pos = torch.arange(ctx - num_new, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


BACKEND_NAMES = ("torch", "triton")


def get_backend(name: str) -> AttentionBackend:
    """The attention backend named by configuration: `torch` (reference, CPU) or `triton` (GPU)."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        # Imported only when chosen: importing triton fixes interpreter vs compiled mode.
        try:
            from worker_svc.triton_attention import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention backend 'triton' needs the triton package: {exc}") from exc
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
