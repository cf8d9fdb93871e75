"""Teacher-forced logits of a whole-model StageModel at every position of a batch."""

from __future__ import annotations

import torch

from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.kernels.attention import AttentionMetadata, TorchAttentionBackend
from worker_svc.models.stage import StageModel


def all_logits(model: StageModel, seqs: list[list[int]], block_size: int = 16) -> torch.Tensor:
    """Teacher-forced logits at every position: [num_seqs, seq_len, vocab], float32."""
    n, length = len(seqs), len(seqs[0])
    blocks_per_seq = -(-length // block_size)
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device
    config = model.config
    cache = PagedKVCache(
        model.num_local_layers, n * blocks_per_seq, block_size, config.num_kv_heads,
        config.head_dim, dtype, device,
    )  # fmt: skip
    table = torch.arange(n * blocks_per_seq, device=device).view(n, blocks_per_seq)
    pos = torch.arange(length, device=device)
    slots = torch.cat([table[i, pos // block_size] * block_size + pos % block_size for i in range(n)])
    starts = tuple(i * length for i in range(n + 1))
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor(starts, device=device),
        context_lens=torch.full((n,), length, device=device),
        block_tables=table,
        query_start_loc_list=starts,
        context_lens_list=(length,) * n,
    )
    logits = model(
        torch.tensor(seqs, device=device).view(-1), pos.repeat(n), cache.pools, metadata,
        TorchAttentionBackend(), logits_indices=torch.arange(n * length, device=device),
    )  # fmt: skip
    return logits.float().view(n, length, -1)
