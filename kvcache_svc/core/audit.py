"""What a `KVCacheManager` reports of itself: its statistics and its integrity check.

Read-only views over the manager's parts (its `BlockPool`, `PrefixCache` and sequence
tables) and its cumulative `Counters`: the manager changes state, these only look at it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from kvcache_svc.core.block_pool import BlockPool
from kvcache_svc.core.groups import sliding_groups
from kvcache_svc.core.prefix_cache import TOKEN_BYTES, PrefixCache
from kvcache_svc.core.sequence import SequenceState
from kvcache_svc.core.tier import TierIndex
from kvcache_svc.core.validation import MAX_LOOKAHEAD_SLOTS
from services.kv_errors import IntegrityError
from services.kv_layout import NULL_PAGE
from services.kv_stats import (
    KVCacheStats,
    SequenceBlockStats,
    count_extents,
    external_fragmentation,
    internal_fragmentation,
    prefix_hit_rate,
)


@dataclass(slots=True)
class Counters:
    """The manager's cumulative counts; `reset()` keeps them."""

    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_evictions: int = 0
    num_copy_on_write: int = 0
    num_resets: int = 0
    num_slid_pages: int = 0  # pages sliding windows gave back
    num_tier_hit_tokens: int = 0  # prompt tokens loaded from the KV tier


def sequence_stats(seq: SequenceState, pool: BlockPool, windows: tuple[int, ...]) -> SequenceBlockStats:
    """One sequence's block distribution (pages, with KV groups; extents of group 0)."""
    pages = [p for entry in seq.block_ids for p in entry if p != NULL_PAGE]
    sliding = sliding_groups(windows)
    window = sum(1 for entry in seq.block_ids for s, _ in sliding if entry[s] != NULL_PAGE)
    return SequenceBlockStats(
        seq_id=seq.seq_id,
        num_tokens=seq.num_tokens,
        num_blocks=len(pages),
        num_extents=count_extents([entry[0] for entry in seq.block_ids]),
        num_shared_blocks=sum(1 for p in pages if pool.ref_count(p) > 1),
        num_window_blocks=window,
    )


def kv_stats(
    pool: BlockPool,
    cache: PrefixCache,
    seqs: Mapping[int, SequenceState],
    counters: Counters,
    *,
    block_size: int,
    windows: tuple[int, ...],
    watermark_blocks: int,
    tier: TierIndex | None = None,
) -> KVCacheStats:
    bs = block_size
    num_free = pool.num_free_blocks
    num_evictable = cache.num_evictable_blocks
    num_used = pool.num_blocks - num_free - num_evictable
    # only a sequence's last block with tokens can be partial, and sharers of a partial
    # block fill it equally; blocks held ahead (never shared) are empty
    partial_fill = {
        page: seq.num_tokens % bs
        for seq in seqs.values()
        if seq.num_tokens % bs
        for page in seq.block_ids[seq.num_tokens // bs]
    }
    num_ahead = sum(len(seq.block_ids) - -(-seq.num_tokens // bs) for seq in seqs.values())
    num_empty_slots = sum(bs - fill for fill in partial_fill.values()) + num_ahead * bs * len(windows)
    window_pages = {
        entry[s] for seq in seqs.values() for entry in seq.block_ids[seq.num_slid :] for s, _ in sliding_groups(windows)
    } - {NULL_PAGE}
    largest = pool.largest_free_extent
    return KVCacheStats(
        num_blocks=pool.num_blocks,
        block_size=bs,
        num_used_blocks=num_used,
        num_free_blocks=num_free,
        num_evictable_blocks=num_evictable,
        num_cached_blocks=cache.num_cached_blocks,
        watermark_blocks=watermark_blocks,
        num_sequences=len(seqs),
        num_used_slots=num_used * bs - num_empty_slots,
        num_free_extents=pool.num_free_extents,
        largest_free_extent=largest,
        internal_fragmentation=internal_fragmentation(num_empty_slots, num_used, bs),
        external_fragmentation=external_fragmentation(largest, num_free),
        num_prefix_queries=counters.num_prefix_queries,
        num_prefix_hits=counters.num_prefix_hits,
        num_prefix_query_tokens=counters.num_prefix_query_tokens,
        num_prefix_hit_tokens=counters.num_prefix_hit_tokens,
        prefix_hit_rate=prefix_hit_rate(counters.num_prefix_hit_tokens, counters.num_prefix_query_tokens),
        num_evictions=counters.num_evictions,
        num_copy_on_write=counters.num_copy_on_write,
        num_resets=counters.num_resets,
        group_windows=windows,
        num_window_blocks=len(window_pages),
        num_slid_blocks=counters.num_slid_pages,
        num_tier_hit_tokens=counters.num_tier_hit_tokens,
        **(_tier_stats(tier) if tier is not None else {}),
    )


def _tier_stats(tier: TierIndex) -> dict[str, int]:
    return {
        "tier_host_capacity": tier.host_blocks,
        "tier_host_blocks": tier.num_host,
        "tier_disk_capacity": tier.disk_blocks,
        "tier_disk_blocks": tier.num_disk,
        "num_tier_saves": tier.num_saves,
        "num_tier_loads": tier.num_loads,
        "num_tier_demotions": tier.num_demotions,
        "num_tier_drops": tier.num_drops,
    }


def _check_entries(seq: SequenceState, windows: tuple[int, ...], block_size: int) -> list[int]:
    """Entries have a page per sub-group, `NULL_PAGE` only where a window left; no page
    held twice. Returns the pages held."""
    sliding = {s for s, _ in sliding_groups(windows)}
    for j, entry in enumerate(seq.block_ids):
        if len(entry) != len(windows):
            raise IntegrityError(f"sequence {seq.seq_id}: entry {j} has {len(entry)} pages")
        if any(p == NULL_PAGE and (s not in sliding or j * block_size >= seq.num_tokens) for s, p in enumerate(entry)):
            raise IntegrityError(f"sequence {seq.seq_id}: entry {j} lacks a page it needs")
    pages = [p for entry in seq.block_ids for p in entry if p != NULL_PAGE]
    if len(set(pages)) != len(pages):
        raise IntegrityError(f"sequence {seq.seq_id} holds a block twice")
    return pages


def _check_tables(
    seqs: Mapping[int, SequenceState], *, block_size: int, windows: tuple[int, ...], enable_prefix_caching: bool
) -> Counter[int]:
    """Each table fits its token count and its last answer; returns each page's holders."""
    bs = block_size
    holders: Counter[int] = Counter()
    for seq_id, seq in seqs.items():
        if not -(-seq.num_tokens // bs) <= len(seq.block_ids) <= -(-(seq.num_tokens + MAX_LOOKAHEAD_SLOTS) // bs):
            raise IntegrityError(f"sequence {seq_id}: {len(seq.block_ids)} blocks for {seq.num_tokens} tokens")
        pages = _check_entries(seq, windows, bs)
        if seq.num_answered is not None and seq.num_answered > len(seq.block_ids):
            raise IntegrityError(f"sequence {seq_id}: answered {seq.num_answered} of {len(seq.block_ids)} blocks")
        if enable_prefix_caching and (len(seq.partial_token_bytes) != (seq.num_tokens % bs) * TOKEN_BYTES):
            raise IntegrityError(f"sequence {seq_id}: partial block tokens out of step")
        holders.update(pages)
    return holders


def check_integrity(
    pool: BlockPool,
    cache: PrefixCache,
    seqs: Mapping[int, SequenceState],
    *,
    block_size: int,
    windows: tuple[int, ...],
    enable_prefix_caching: bool,
) -> None:
    """Raise `IntegrityError` unless: each block's ref count equals the number of tables
    holding it; every block is exactly one of used (ref > 0), free (in an extent) or
    evictable (cached, ref 0, in the LRU) — so used + free + evictable == total; the
    extents and the prefix index are consistent; each table fits its token count and
    holds every entry its last answer named."""
    pool.check_integrity()
    cache.check_integrity(pool.ref_count)
    holders = _check_tables(seqs, block_size=block_size, windows=windows, enable_prefix_caching=enable_prefix_caching)
    num_used = 0
    for block_id in range(pool.num_blocks):
        ref = pool.ref_count(block_id)
        if ref != holders.get(block_id, 0):
            raise IntegrityError(f"block {block_id}: ref count {ref}, held by {holders.get(block_id, 0)}")
        states = (ref > 0) + pool.is_free(block_id) + cache.is_evictable(block_id)
        if states != 1:
            raise IntegrityError(
                f"block {block_id}: ref {ref}, free {pool.is_free(block_id)}, evictable {cache.is_evictable(block_id)}"
            )
        num_used += ref > 0
    total = num_used + pool.num_free_blocks + cache.num_evictable_blocks
    if total != pool.num_blocks:
        raise IntegrityError(f"used + free + evictable = {total} != {pool.num_blocks}")
