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
        for i, ctx in enumerate(metadata.context_lens_list):
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
