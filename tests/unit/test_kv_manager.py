"""KVCacheManager: slots, prefix hits, LRU eviction, copy-on-write, validation, stats."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest

from kvcache_svc.core import (
    Allocated,
    Append,
    BlockCopy,
    Fork,
    IntegrityError,
    InvalidStepError,
    KVCacheManager,
    NewSequence,
    NoBlocks,
    SequenceNotFound,
    StepInput,
    slots,
)


def new(
    m: KVCacheManager,
    seq_id: int,
    token_ids: Sequence[int],
    micro_batch_id: int,
    namespace: str | None = None,
    max_num_new_tokens: int | None = None,
    skip_prefix_cache: bool = False,
) -> Allocated | NoBlocks:
    seq = NewSequence(seq_id, token_ids, namespace, max_num_new_tokens, skip_prefix_cache)
    out = m.step(StepInput(new_sequences=[seq], micro_batch_id=micro_batch_id))
    m.check_integrity()
    return out.results[seq_id]


def append(m: KVCacheManager, seq_id: int, token_ids: Sequence[int], micro_batch_id: int) -> Allocated | NoBlocks:
    out = m.step(StepInput(appends=[Append(seq_id, token_ids)], micro_batch_id=micro_batch_id))
    m.check_integrity()
    return out.results[seq_id]


def snapshot(m: KVCacheManager) -> tuple[object, ...]:
    """Everything observable about the manager's state."""
    return (
        {s: (m.block_table(s), m.num_tokens(s)) for s in m.seq_ids()},
        [m.ref_count(b) for b in range(m.num_blocks)],
        m.free_extents(),
        m.evictable_block_ids(),
        {b: m.cached_token_ids(b) for b in range(m.num_blocks)},
        m.in_flight_micro_batch_ids(),
        m.stats(),
    )


# ---- slots ---------------------------------------------------------------------------------


def test_new_sequence_slots_and_appends_interleaved() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    assert new(m, 1, [10, 11, 12], 0) == Allocated(1, (0,), 3, 0, ())
    assert new(m, 2, [20, 21, 22, 23], 1) == Allocated(2, (1,), 4, 0, ())
    # position 3 fills block 0, position 4 opens block 2 (best-fit from the extent (2, 14));
    # the answer keeps the 1 entry of the last and adds block 2
    assert append(m, 1, [13, 14], 2) == Allocated(1, (2,), 2, 3, (), block_offset=1)
    assert m.block_table(1) == (0, 2)
    # a prefill chunk over a block boundary
    assert append(m, 2, [24, 25, 26, 27, 28], 3) == Allocated(2, (3, 4), 5, 4, (), block_offset=1)
    assert m.block_table(2) == (1, 3, 4)
    assert m.num_tokens(2) == 9
    assert m.free_extents() == [(5, 11)]


def test_chunked_prefill_allocates_only_the_chunk() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    prompt = list(range(10))
    assert new(m, 1, prompt, 0, max_num_new_tokens=4) == Allocated(1, (0,), 4, 0, ())
    assert append(m, 1, prompt[4:], 1) == Allocated(1, (1, 2), 6, 4, (), block_offset=1)
    assert m.block_table(1) == (0, 1, 2)
    m.complete([0, 1])
    # the lookup sees the whole prompt even when only one token is allocated
    result = new(m, 2, prompt, 2, max_num_new_tokens=1)
    assert result == Allocated(2, (0, 1, 3), 1, 8, ())


# ---- prefix caching ------------------------------------------------------------------------


def test_partial_prefix_hit_reuses_full_blocks() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    assert new(m, 1, list(range(10)), 0).block_ids == (0, 1, 2)
    m.complete([0])
    assert [m.cached_token_ids(b) for b in (0, 1, 2)] == [(0, 1, 2, 3), (4, 5, 6, 7), None]
    result = new(m, 2, [*range(8), 50, 51, 52], 1)
    assert result == Allocated(2, (0, 1, 3), 3, 8, ())
    assert (m.ref_count(0), m.ref_count(1), m.ref_count(2), m.ref_count(3)) == (2, 2, 1, 1)
    # a prompt diverging inside block 1 reuses block 0 only
    assert new(m, 3, [0, 1, 2, 3, 4, 5, 9, 9], 2).num_computed_tokens == 4
    stats = m.stats()
    assert (stats.num_prefix_queries, stats.num_prefix_hits) == (3, 2)
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (29, 12)
    assert stats.prefix_hit_rate == pytest.approx(12 / 29)


def test_blocks_become_findable_only_after_their_micro_batch_completes() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(8)), 0)
    assert new(m, 2, list(range(8)), 1).num_computed_tokens == 0
    m.complete([0])
    assert new(m, 3, [*range(8), 99], 2).num_computed_tokens == 8


def test_failed_micro_batch_makes_nothing_findable_now_or_later() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(6)), 0)
    m.fail([0])
    assert m.in_flight_micro_batch_ids() == ()
    assert new(m, 2, [*range(4), 77], 1).num_computed_tokens == 0
    # sequence 1's later blocks attend to garbage KV: never cached either
    append(m, 1, [6, 7, 8], 2)
    m.complete([1, 2])
    assert m.cached_token_ids(m.block_table(1)[1]) is None
    assert m.cached_token_ids(m.block_table(1)[0]) is None
    # sequence 2 is clean: its block 0 ([0, 1, 2, 3]) became findable
    assert new(m, 3, [0, 1, 2, 3, 5], 3).num_computed_tokens == 4


def test_whole_prompt_hit_is_capped_and_copies_the_last_block() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(8)), 0)
    m.complete([0])
    result = new(m, 2, list(range(8)), 1)
    # 7 tokens computed; the last token is computed again into a copy of block 1, so the
    # cached block 1 is never written
    assert result == Allocated(2, (0, 2), 1, 7, (BlockCopy(1, 2),))
    assert (m.ref_count(0), m.ref_count(1), m.ref_count(2)) == (2, 1, 1)
    m.complete([1])
    assert m.cached_token_ids(2) is None  # block 1 keeps the key
    assert m.stats().num_copy_on_write == 1


def test_whole_prompt_hit_on_evictable_blocks_parks_the_source_again() -> None:
    m = KVCacheManager(4, 4, watermark=0.0)
    new(m, 1, list(range(4)), 0)
    m.complete([0])
    m.free(1)
    assert m.evictable_block_ids() == (0,)
    result = new(m, 2, list(range(4)), 1)
    assert result == Allocated(2, (1,), 1, 3, (BlockCopy(0, 1),))
    assert m.evictable_block_ids() == (0,)
    assert m.ref_count(0) == 0


def test_whole_prompt_hit_never_evicts_its_own_source() -> None:
    m = KVCacheManager(2, 4, watermark=0.0)
    new(m, 1, list(range(4)), 0)
    m.complete([0])
    m.free(1)
    new(m, 2, [9], 1)  # takes the only free block
    # the only available block is the source of the copy: no blocks, nothing evicted
    assert new(m, 3, list(range(4)), 2) == NoBlocks(3, 1, 0)
    assert m.evictable_block_ids() == (0,)
    assert m.stats().num_evictions == 0


def test_namespaces_separate_prefixes() -> None:
    m = KVCacheManager(32, 4, watermark=0.0)
    prompt = [*range(8), 42]
    new(m, 1, prompt, 0, namespace="llama/adapter-a")
    m.complete([0])
    assert new(m, 2, prompt, 1, namespace="llama/adapter-b").num_computed_tokens == 0
    assert new(m, 3, prompt, 2, namespace=None).num_computed_tokens == 0
    assert new(m, 4, prompt, 3, namespace="").num_computed_tokens == 0
    assert new(m, 5, prompt, 4, namespace="llama/adapter-a").num_computed_tokens == 8


def test_hash_collision_never_returns_other_tokens() -> None:
    m = KVCacheManager(16, 4, watermark=0.0, hash_fn=lambda parent, ns, tokens: b"same")
    new(m, 1, [1, 2, 3, 4, 9], 0)
    m.complete([0])
    assert m.cached_token_ids(0) == (1, 2, 3, 4)
    assert new(m, 2, [5, 6, 7, 8, 9], 1).num_computed_tokens == 0
    m.complete([1])
    assert m.cached_token_ids(m.block_table(2)[0]) is None  # the key was taken
    assert new(m, 3, [1, 2, 3, 4, 0], 2).num_computed_tokens == 4


def test_sequence_freed_before_completion_caches_nothing() -> None:
    m = KVCacheManager(8, 4, watermark=0.0)
    new(m, 1, list(range(8)), 0)
    m.free(1)
    # the same blocks go to another sequence before micro-batch 0 reports back
    assert new(m, 2, [9] * 8, 1).block_ids == (0, 1)
    m.complete([0])
    assert m.stats().num_cached_blocks == 0
    m.complete([1])
    assert [m.cached_token_ids(b) for b in (0, 1)] == [(9,) * 4, (9,) * 4]


def test_prefix_caching_disabled() -> None:
    m = KVCacheManager(16, 4, watermark=0.0, enable_prefix_caching=False)
    new(m, 1, list(range(8)), 0)
    m.complete([0])
    assert new(m, 2, list(range(8)), 1).num_computed_tokens == 0
    m.free(1)
    assert m.stats().num_cached_blocks == 0
    assert m.stats().num_prefix_queries == 0
    assert m.evictable_block_ids() == ()


def test_a_sequence_that_skips_the_prefix_cache_neither_hits_nor_fills_it() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(8)), 0)
    m.complete([0])
    skipping = new(m, 2, list(range(8)), 1, skip_prefix_cache=True)
    assert skipping.num_computed_tokens == 0 and skipping.num_new_tokens == 8  # computed whole
    new(m, 3, list(range(100, 108)), 2, skip_prefix_cache=True)
    m.complete([1, 2])
    # the fork fills whole blocks of its own: still nothing cached
    m.step(
        StepInput(forks=[Fork(3, 4)], appends=[Append(3, [108]), Append(4, list(range(200, 208)))], micro_batch_id=3)
    )
    m.complete([3])
    m.free(2)
    m.free(3)
    m.free(4)
    m.check_integrity()
    # only sequence 1's two blocks are cached; the skipping ones (and the fork) went back free
    assert m.stats().num_cached_blocks == 2
    assert new(m, 5, list(range(100, 108)), 4).num_computed_tokens == 0
    assert new(m, 7, list(range(100, 108)) + list(range(200, 208)), 6).num_computed_tokens == 0
    assert new(m, 6, list(range(8)), 5).num_computed_tokens == 7  # a whole-prompt hit, capped
    assert m.stats().num_prefix_queries == 4  # the skipping sequences did not look


def test_a_request_that_fits_the_pool_exactly_is_admitted_when_nothing_else_is_held() -> None:
    """The watermark keeps room for running sequences to grow; with none held it would only
    make a request that fits the pool wait for ever (found in review)."""
    m = KVCacheManager(100, 16, watermark=0.01)  # 1 watermark block
    prompt = list(range(5, 5 + 1584))  # 99 blocks, and one block for 16 output tokens
    assert isinstance(new(m, 1, prompt, 0), Allocated)
    assert isinstance(append(m, 1, list(range(16)), 1), Allocated)  # the pool is full
    m.complete([0, 1])
    m.free(1)
    # again, now a whole-prompt hit: 98 shared blocks plus a copy of the last one
    again = new(m, 2, prompt, 2)
    assert isinstance(again, Allocated) and again.num_computed_tokens == 1583
    m.complete([2])
    # with a sequence held, the watermark applies again
    refused = new(m, 3, list(range(9000, 9016)), 3)
    assert isinstance(refused, NoBlocks) and refused.num_free_blocks == 0


# ---- eviction ------------------------------------------------------------------------------


def test_lru_eviction_order_is_exact() -> None:
    m = KVCacheManager(8, 2, watermark=0.0)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert new(m, 1, a, 0).block_ids == (0, 1)
    assert new(m, 2, b, 1).block_ids == (2, 3)
    m.complete([0, 1])
    m.free(1)
    m.free(2)
    # each sequence's tail is parked before its head, so it is evicted first
    assert m.evictable_block_ids() == (1, 0, 3, 2)
    assert m.free_extents() == [(4, 4)]

    # a hit takes block 0 out of the LRU; freeing parks it again, most recently used
    assert new(m, 3, [1, 2, 99], 2).block_ids == (0, 4)
    assert m.evictable_block_ids() == (1, 3, 2)
    m.free(3)
    assert m.evictable_block_ids() == (1, 3, 2, 0)
    assert m.free_extents() == [(4, 4)]

    # free blocks go first, then eviction in LRU order
    result = new(m, 4, list(range(100, 112)), 3)
    assert result.block_ids == (4, 5, 6, 7, 1, 3)
    assert m.evictable_block_ids() == (2, 0)
    assert (m.cached_token_ids(1), m.cached_token_ids(3)) == (None, None)
    assert m.stats().num_evictions == 2

    # a hit's blocks are held before allocating, so they are never evicted into the hit
    assert new(m, 5, [5, 6, 7], 4) == Allocated(5, (2, 0), 1, 2, ())
    assert m.evictable_block_ids() == ()


def test_evicted_prefix_is_no_longer_found() -> None:
    m = KVCacheManager(2, 2, watermark=0.0)
    new(m, 1, [1, 2, 3], 0)
    m.complete([0])
    m.free(1)
    assert m.evictable_block_ids() == (0,)
    new(m, 2, [7, 7, 7, 7], 1)  # needs both blocks: block 0 is evicted
    m.free(2)
    assert new(m, 3, [1, 2, 3], 2).num_computed_tokens == 0


# ---- sharing -------------------------------------------------------------------------------


def test_fork_shares_blocks_and_append_copies_a_shared_partial_block() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(6)), 0)
    m.complete([0])
    m.fork(1, 2)
    assert m.block_table(2) == (0, 1)
    assert (m.ref_count(0), m.ref_count(1)) == (2, 2)
    # the child writes into the shared partial block 1: it gets a copy first
    assert append(m, 2, [60], 1) == Allocated(2, (0, 2), 1, 6, (BlockCopy(1, 2),))
    assert (m.ref_count(0), m.ref_count(1), m.ref_count(2)) == (2, 1, 1)
    # the parent now holds block 1 alone: no copy, and its table is as last answered
    assert append(m, 1, [70], 2) == Allocated(1, (), 1, 6, (), block_offset=2)
    assert m.block_table(1) == (0, 1)
    assert m.stats().num_copy_on_write == 1


def test_parent_and_children_appending_in_one_step_copy_once_per_extra_holder() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(5)), 0)
    m.complete([0])
    out = m.step(
        StepInput(
            forks=[Fork(1, 2), Fork(1, 3)], appends=[Append(1, [5]), Append(2, [6]), Append(3, [7])], micro_batch_id=1
        )
    )
    m.check_integrity()
    assert out.copies == (BlockCopy(1, 2), BlockCopy(1, 3))
    assert out.results[3] == Allocated(3, (0, 1), 1, 5, ())
    assert [m.block_table(s) for s in (1, 2, 3)] == [(0, 2), (0, 3), (0, 1)]


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(8)), 0)
    m.fork(1, 2)
    assert append(m, 2, [8], 1) == Allocated(2, (0, 1, 2), 1, 8, ())


def test_free_drops_references_and_unknown_free_is_not_found() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(6)), 0)
    m.fork(1, 2)
    m.free(1)
    assert (m.ref_count(0), m.ref_count(1)) == (1, 1)
    m.free(2)
    assert m.free_extents() == [(0, 16)]
    for seq_id in (1, 2, 3):
        with pytest.raises(SequenceNotFound):
            m.free(seq_id)
    m.check_integrity()


# ---- validation and running short ----------------------------------------------------------


def test_no_blocks_leaves_that_sequence_unchanged_and_applies_the_others() -> None:
    m = KVCacheManager(4, 2, watermark=0.0)
    new(m, 1, [1, 2, 3, 4], 0)
    new(m, 2, [5, 6], 1)
    out = m.step(
        StepInput(appends=[Append(1, [1, 2, 3]), Append(2, [7])], new_sequences=[NewSequence(3, [8])], micro_batch_id=2)
    )
    m.check_integrity()
    assert out.results == {1: NoBlocks(1, 2, 1), 2: Allocated(2, (3,), 1, 2, (), block_offset=1), 3: NoBlocks(3, 1, 0)}
    assert (m.block_table(1), m.num_tokens(1)) == ((0, 1), 4)
    assert m.block_table(2) == (2, 3)
    assert not m.has_sequence(3)
    assert m.stats().num_prefix_queries == 2  # the refused one is not counted


def test_no_blocks_for_a_copy_on_write() -> None:
    m = KVCacheManager(2, 2, watermark=0.0)
    new(m, 1, [1, 2, 3], 0)
    m.fork(1, 2)
    before = snapshot(m)
    assert append(m, 2, [4], 1) == NoBlocks(2, 1, 0)
    assert snapshot(m)[:5] == before[:5]


def test_watermark_gates_new_sequences_not_appends() -> None:
    m = KVCacheManager(100, 4, watermark=0.1)
    assert m.watermark_blocks == 10
    assert m.can_allocate(90) and not m.can_allocate(91)
    assert new(m, 9, [7], 0).block_ids == (0,)  # something held: the watermark applies
    assert new(m, 1, [0] * (90 * 4), 1) == NoBlocks(1, 90, 89)
    assert new(m, 1, [0] * (88 * 4 + 1), 2).block_ids == tuple(range(1, 90))
    assert not m.can_allocate(1)
    assert new(m, 2, [1], 3) == NoBlocks(2, 1, 0)
    # running sequences may dig into the reserve
    assert isinstance(append(m, 1, [0] * 40, 4), Allocated)
    assert m.stats().num_free_blocks == 0


# ---- statistics, reset, integrity ----------------------------------------------------------


def test_stats_on_a_hand_computed_case() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(6)), 0)  # blocks 0, 1 (1 holds 2 tokens)
    new(m, 2, [50, 51, 52], 1)  # block 2 (3 tokens)
    new(m, 3, list(range(100, 108)), 2)  # blocks 3, 4 (full)
    append(m, 1, [6, 7, 8], 3)  # block 1 full, block 5 holds 1 token
    stats = m.stats()
    # used 6 blocks = 24 slots; filled 9 + 3 + 8 = 20; empty 3 (block 5) + 1 (block 2)
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_evictable_blocks) == (6, 10, 0)
    assert stats.num_used_slots == 20
    assert stats.internal_fragmentation == pytest.approx(4 / 24)
    assert stats.external_fragmentation == 0.0  # one extent (6, 10)
    by_seq = {s.seq_id: s for s in m.sequence_stats()}
    assert (by_seq[1].num_blocks, by_seq[1].num_extents) == (3, 2)  # blocks 0, 1, 5
    assert (by_seq[3].num_blocks, by_seq[3].num_extents) == (2, 1)

    m.free(2)  # block 2 back: extents (2, 1) and (6, 10)
    m.complete([0, 1, 2, 3])  # caches blocks 0, 1 (seq 1) and 3, 4 (seq 3)
    stats = m.stats()
    assert (stats.num_free_blocks, stats.num_free_extents, stats.largest_free_extent) == (11, 2, 10)
    assert stats.external_fragmentation == pytest.approx(1 - 10 / 11)
    assert stats.num_cached_blocks == 4
    new(m, 4, [0, 1, 2, 3, 4, 5, 6, 7, 1, 1], 4)  # hits 8 of 10 tokens
    stats = m.stats()
    assert stats.num_prefix_query_tokens == 6 + 3 + 8 + 10
    assert stats.num_prefix_hit_tokens == 8
    assert stats.prefix_hit_rate == pytest.approx(8 / 27)
    assert {s.seq_id: s.num_shared_blocks for s in m.sequence_stats()} == {1: 2, 3: 0, 4: 2}
    # the block map: 0, 1 shared by 1 and 4; 3, 4 (seq 3) and 5 (seq 1) used; seq 4's own two
    # blocks (its 10th token and the next) taken best-fit from the free run (2, 1) then (6, ...)
    layout, block_map = m.layout()
    tables = {s.seq_id: table for s, table in layout}
    assert list(block_map[:2]) == [2, 2] and block_map[3] == block_map[4] == block_map[5] == 1
    assert sum(b == 1 for b in block_map) == len({b for t in tables.values() for b in t}) - 2
    assert sum(b == 0 for b in block_map) == m.stats().num_free_blocks

    for seq_id in (1, 3, 4):
        m.free(seq_id)
    assert list(m.layout()[1]).count(3) == 4  # the cached blocks, parked
    stats = m.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_evictable_blocks == stats.num_cached_blocks == 4
    assert stats.num_free_blocks + stats.num_evictable_blocks == 16
    assert stats.internal_fragmentation == 0.0


def test_reset_forgets_everything_but_the_counters() -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    new(m, 1, list(range(8)), 0)
    m.complete([0])
    new(m, 2, list(range(8)), 1)
    m.reset()
    m.check_integrity()
    assert m.seq_ids() == () and m.in_flight_micro_batch_ids() == ()
    assert m.free_extents() == [(0, 16)]
    stats = m.stats()
    assert (stats.num_cached_blocks, stats.num_resets, stats.num_prefix_hits) == (0, 1, 1)
    with pytest.raises(InvalidStepError):
        m.complete([1])
    assert new(m, 3, list(range(8)), 1).num_computed_tokens == 0


def test_check_integrity_catches_a_broken_ref_count() -> None:
    m = KVCacheManager(8, 4, watermark=0.0)
    new(m, 1, [1, 2, 3], 0)
    m._pool.incref(0)  # simulate a bug
    with pytest.raises(IntegrityError, match="block 0: ref count 2, held by 1"):
        m.check_integrity()


def test_constructor_rejects_bad_configuration() -> None:
    for kwargs in ({"num_blocks": 0}, {"block_size": 0}, {"watermark": 1.0}):
        with pytest.raises(ValueError):
            KVCacheManager(**{"num_blocks": 8, "block_size": 4, **kwargs})


def test_100k_blocks_1000_sequences_is_fast() -> None:
    """Not a benchmark: catches an accidental scan of every block per call."""
    rng = random.Random(0)
    m = KVCacheManager(100_000, 16)
    prompts = [[rng.randrange(32_000) for _ in range(rng.randrange(1, 1200))] for _ in range(1000)]
    started = time.perf_counter()
    out = m.step(StepInput(new_sequences=[NewSequence(i, p) for i, p in enumerate(prompts)], micro_batch_id=0))
    assert all(isinstance(r, Allocated) for r in out.results.values())
    m.complete([0])
    order = list(range(1000))
    rng.shuffle(order)
    for i, seq_id in enumerate(order[:500]):  # churn: scattered frees and re-allocations
        m.free(seq_id)
        m.step(StepInput(new_sequences=[NewSequence(1000 + i, [7] * 300)], micro_batch_id=1 + i))
    m.step(StepInput(frees=m.seq_ids()))
    elapsed = time.perf_counter() - started
    m.check_integrity()
    assert m.stats().num_used_blocks == 0
    # well under a second on an idle core; the bound only catches a per-call scan of all blocks
    assert elapsed < 10.0, f"{elapsed:.2f} s"


def test_lookahead_slots_hold_a_block_ahead_that_later_appends_fill() -> None:
    """An asynchronous scheduler's placeholder step needs the slot of a token not known yet:
    `num_lookahead_slots` allocates its block now (with or without tokens to record), later
    appends fill it without a new block, forks do not share it, and stats count it empty."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    first = new(m, 1, [1, 2, 3, 4], micro_batch_id=1)
    assert len(first.block_ids) == 1
    out = m.step(StepInput(appends=[Append(1, [], num_lookahead_slots=1)], micro_batch_id=2))
    m.check_integrity()
    held = out.results[1]
    table = m.block_table(1)
    assert isinstance(held, Allocated) and held.num_new_tokens == 0 and held.num_computed_tokens == 4
    assert held.applied_to(first.block_ids) == table and len(table) == 2 and m.num_tokens(1) == 4
    stats = m.stats()
    assert stats.num_used_blocks == 2 and stats.num_used_slots == 4
    # a fork shares only the blocks with tokens
    m.step(StepInput(forks=[Fork(1, 2)]))
    m.check_integrity()
    assert m.block_table(2) == table[:1]
    # the held block takes the next tokens: no new block, no copy, the table as answered
    out = m.step(StepInput(appends=[Append(1, [5, 6])], micro_batch_id=3))
    m.check_integrity()
    filled = out.results[1]
    assert (filled.block_offset, filled.block_ids) == (2, ()) and out.copies == ()
    assert m.block_table(1) == table
    assert slots(table, filled.num_computed_tokens, filled.num_new_tokens, 4) == (table[1] * 4, table[1] * 4 + 1)
    # tokens and lookahead together: room for 6 + 2 + 3 = 11 tokens -> 3 blocks
    out = m.step(StepInput(appends=[Append(1, [7, 8], num_lookahead_slots=3)], micro_batch_id=4))
    m.check_integrity()
    assert out.results[1].num_blocks == 3 and m.num_tokens(1) == 8
    m.step(StepInput(frees=(1, 2), completed_micro_batch_ids=(1, 2, 3, 4)))
    m.check_integrity()
    assert m.stats().num_used_blocks == 0


def test_lookahead_slots_are_validated() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    new(m, 1, [1, 2, 3], micro_batch_id=1)
    for bad in (-1, 65, True, 1.5):
        with pytest.raises(InvalidStepError, match="num_lookahead_slots"):
            m.step(StepInput(appends=[Append(1, [4], num_lookahead_slots=bad)], micro_batch_id=2))
    with pytest.raises(InvalidStepError, match="no token ids"):
        m.step(StepInput(appends=[Append(1, [])], micro_batch_id=2))
    with pytest.raises(InvalidStepError, match="exceed the pool"):
        m.step(StepInput(appends=[Append(1, [], num_lookahead_slots=64)], micro_batch_id=2))
    m.check_integrity()
    assert m.num_tokens(1) == 3 and len(m.block_table(1)) == 1
