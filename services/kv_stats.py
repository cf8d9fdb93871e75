"""The memory monitor's numbers: frozen snapshots and the formulas behind them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


def internal_fragmentation(num_empty_slots: int, num_used_blocks: int, block_size: int) -> float:
    """Empty slots in used blocks over all slots of used blocks, in [0, 1); 0 with none used.

    A slot counts as filled once a step has allocated it to a token (computed or not).
    """
    total_slots = num_used_blocks * block_size
    return num_empty_slots / total_slots if total_slots else 0.0


def external_fragmentation(largest_free_extent: int, num_free_blocks: int) -> float:
    """1 - largest free extent / free blocks, in [0, 1); 0 when nothing is free.

    Counts free (uncached) blocks only: evictable cached blocks are outside the extents.
    0 means all free blocks are one run; near 1, they are scattered single blocks.
    """
    return 1.0 - largest_free_extent / num_free_blocks if num_free_blocks else 0.0


def count_extents(block_ids: Sequence[int]) -> int:
    """Runs of consecutive block ids in table order: 1 is a perfectly contiguous table."""
    runs = 1 if block_ids else 0
    for prev, cur in pairwise(block_ids):
        if cur != prev + 1:
            runs += 1
    return runs


def prefix_hit_rate(num_hit_tokens: int, num_query_tokens: int) -> float:
    return num_hit_tokens / num_query_tokens if num_query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class SequenceBlockStats:
    """How one sequence's blocks lie: `num_extents == 1` is fully contiguous."""

    seq_id: int
    num_tokens: int
    num_blocks: int
    num_extents: int
    num_shared_blocks: int  # blocks with another holder (prefix hits, forks)
    num_window_blocks: int = 0  # of `num_blocks`, pages of sliding-window KV groups


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the pool and the cumulative counters.

    Every block is exactly one of used (held by at least one sequence), free (nobody holds
    it, not cached: in the free extents) or evictable (nobody holds it, cached: in the LRU),
    so `num_used_blocks + num_free_blocks + num_evictable_blocks == num_blocks`.
    `num_cached_blocks` counts every findable block, used or evictable. Blocks a new
    allocation can have right now: `num_free_blocks + num_evictable_blocks`.

    With KV groups every count is of pages (one sub-group's share of a block position).

    The counters (`num_prefix_*`, `num_evictions`, `num_copy_on_write`) are cumulative over
    the manager's life and survive `reset()`, like Prometheus counters.
    """

    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_cached_blocks: int
    watermark_blocks: int
    num_sequences: int
    num_used_slots: int  # slots holding a token, over all used blocks
    num_free_extents: int
    largest_free_extent: int
    internal_fragmentation: float
    external_fragmentation: float
    num_prefix_queries: int  # new sequences looked up
    num_prefix_hits: int  # ... of which hit at least one token
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    prefix_hit_rate: float  # hit tokens / query tokens
    num_evictions: int
    num_copy_on_write: int  # block copies reported to workers
    num_resets: int
    # KV groups (services/kv_layout.py): each sub-group's window (0: full attention), the
    # pages sliding sub-groups hold now, and the pages their windows gave back (cumulative)
    group_windows: tuple[int, ...] = (0,)
    num_window_blocks: int = 0
    num_slid_blocks: int = 0
    # the KV tier below the pool (--kv-offload; kvcache_svc/core/tier.py): capacity and
    # blocks held per medium, prompt tokens loaded from it, and its moves (cumulative)
    tier_host_capacity: int = 0
    tier_host_blocks: int = 0
    tier_disk_capacity: int = 0
    tier_disk_blocks: int = 0
    num_tier_hit_tokens: int = 0
    num_tier_saves: int = 0
    num_tier_loads: int = 0
    num_tier_demotions: int = 0
    num_tier_drops: int = 0
