"""The torch backend's batched decode path equals its per-sequence path."""

from __future__ import annotations

import pytest
import torch

from worker_svc.attention import AttentionMetadata, TorchAttentionBackend


def metadata(ctx_lens, block_size, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, taken = [], 0
    for ctx in ctx_lens:
        n = -(-ctx // block_size)
        tables.append(perm[taken:taken + n])
        taken += n
    width = max(len(t) for t in tables)
    table = torch.zeros(len(ctx_lens), width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    starts = list(range(len(ctx_lens) + 1))
    slots = [tables[i][(c - 1) // block_size] * block_size + (c - 1) % block_size for i, c in enumerate(ctx_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        context_lens=torch.tensor(ctx_lens), block_tables=table,
        query_start_loc_list=tuple(starts), context_lens_list=tuple(ctx_lens),
    )


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 1), (8, 2)])
def test_batched_decodes_equal_the_per_sequence_loop(heads, kv_heads, window):
    torch.manual_seed(0)
    block_size, num_blocks, d = 4, 64, 16
    ctx = [1, 3, 4, 5, 17, 30]
    md = metadata(ctx, block_size, num_blocks)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    q = torch.randn(len(ctx), heads, d)
    batched = TorchAttentionBackend()
    looped = TorchAttentionBackend()
    looped.BATCH_DECODE_MAX_ELEMENTS = 0  # never batch
    assert batched._batch_decodes(list(range(len(ctx))), md, kv_heads * d)
    a = batched.forward(q, k_pool, v_pool, md, d**-0.5, window)
    b = looped.forward(q, k_pool, v_pool, md, d**-0.5, window)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
