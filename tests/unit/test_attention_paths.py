"""The torch backend's decode groups and prefill path against a naive attention written
from the definition (float64, one query at a time, K/V read slot by slot)."""

from __future__ import annotations

import pytest
import torch

from worker_svc.kernels.attention import AttentionMetadata, TorchAttentionBackend


def layout(chunks, block_size, num_blocks, seed=0):
    """chunks: (context_len, num_new) per sequence -> metadata with shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, taken = [], 0
    for ctx, _ in chunks:
        n = -(-ctx // block_size)
        tables.append(perm[taken : taken + n])
        taken += n
    width = max(len(t) for t in tables)
    table = torch.zeros(len(chunks), width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    starts, slots = [0], []
    for (ctx, new), t in zip(chunks, tables, strict=True):
        starts.append(starts[-1] + new)
        slots += [t[p // block_size] * block_size + p % block_size for p in range(ctx - new, ctx)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts),
        context_lens=torch.tensor([c for c, _ in chunks]),
        block_tables=table,
        query_start_loc_list=tuple(starts),
        context_lens_list=tuple(c for c, _ in chunks),
    ), tables


def naive(q, k_pool, v_pool, chunks, tables, scale, window):
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // kv_heads
    out, row = torch.zeros_like(q, dtype=torch.float64), 0
    for (ctx, new), t in zip(chunks, tables, strict=True):
        k = torch.stack([k_pool[t[p // block_size], p % block_size] for p in range(ctx)]).double()
        v = torch.stack([v_pool[t[p // block_size], p % block_size] for p in range(ctx)]).double()
        for j in range(new):
            pos = ctx - new + j
            for h in range(q.shape[1]):
                scores = (k[:, h // group] @ q[row + j, h].double()) * scale
                allowed = torch.tensor([p <= pos and (window is None or p > pos - window) for p in range(ctx)])
                scores[~allowed] = float("-inf")
                out[row + j, h] = torch.softmax(scores, 0) @ v[:, h // group]
        row += new
    return out


CHUNKS = [(1, 1), (3, 1), (4, 1), (5, 1), (17, 1), (30, 1), (9, 9), (21, 6), (40, 1), (40, 1)]


@pytest.mark.parametrize("budget", [0, 2048, TorchAttentionBackend.DECODE_GROUP_MAX_ELEMENTS])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 1), (8, 2)])
def test_decode_groups_and_prefill_chunks_equal_naive_attention(heads, kv_heads, window, budget):
    torch.manual_seed(0)
    block_size, num_blocks, d = 4, 96, 16
    md, tables = layout(CHUNKS, block_size, num_blocks)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    q = torch.randn(md.query_start_loc_list[-1], heads, d)
    backend = TorchAttentionBackend()
    backend.DECODE_GROUP_MAX_ELEMENTS = budget  # 0: every decode row its own group
    got = backend.forward(q, k_pool, v_pool, md, d**-0.5, window)
    groups, prefills = backend._plan(md, block_size, kv_heads * d, window)
    decode_rows = sorted(int(r) for g in groups for r in g.token_rows)
    assert decode_rows == [md.query_start_loc_list[i] for i, (_, n) in enumerate(CHUNKS) if n == 1]
    assert prefills == [i for i, (_, n) in enumerate(CHUNKS) if n > 1]
    if budget == 0:
        assert all(len(g.token_rows) == 1 for g in groups)
    if budget == TorchAttentionBackend.DECODE_GROUP_MAX_ELEMENTS:
        assert len(groups) == 1
    # a second layer of the same step reuses the plan
    assert backend._plan(md, block_size, kv_heads * d, window)[0] is groups
    want = naive(q, k_pool, v_pool, CHUNKS, tables, d**-0.5, window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("tile_rows", [1, 2, 5])
def test_a_chunk_after_others_is_attended_in_query_tiles_under_the_mask_budget(monkeypatch, window, tile_rows):
    """Long context (issue 14): a later chunk's [queries, context] mask is built for a tile of
    queries at a time under MASK_BUDGET_BYTES; the tiles give the untiled result (to float
    rounding: SDPA blocks the work by the queries it is given)."""
    import worker_svc.kernels.attention as attention

    torch.manual_seed(1)
    chunks = [(21, 6), (40, 11), (9, 9)]
    block_size, num_blocks, heads, kv_heads, d = 4, 96, 4, 2, 16
    md, tables = layout(chunks, block_size, num_blocks)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, d)
    q = torch.randn(md.query_start_loc_list[-1], heads, d)
    whole = TorchAttentionBackend().forward(q, k_pool, v_pool, md, d**-0.5, window)
    widest = max(c for c, n in chunks if n < c)
    monkeypatch.setattr(attention, "MASK_BUDGET_BYTES", 4 * widest * tile_rows)
    tiled = TorchAttentionBackend().forward(q, k_pool, v_pool, md, d**-0.5, window)
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)
    want = naive(q, k_pool, v_pool, chunks, tables, d**-0.5, window)
    torch.testing.assert_close(tiled.double(), want, rtol=1e-5, atol=1e-5)
