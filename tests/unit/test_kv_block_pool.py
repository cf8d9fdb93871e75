"""BlockPool: best-fit placement with exact block ids, merging, reference counts."""

from __future__ import annotations

import pytest

from kvcache_svc.core.block_pool import BlockPool
from services.kv_stats import count_extents, external_fragmentation


def _pool_with_extents(num_blocks: int, free_runs: list[tuple[int, int]]) -> BlockPool:
    """A pool whose only free blocks are the given `(start, length)` runs."""
    pool = BlockPool(num_blocks)
    assert pool.allocate(num_blocks) == list(range(num_blocks))
    released = [b for start, length in free_runs for b in range(start, start + length)]
    for b in released:
        assert pool.decref(b) == 0
    pool.release(released)
    pool.check_integrity()
    return pool


def test_fresh_pool_is_one_extent() -> None:
    pool = BlockPool(10)
    assert pool.free_extents() == [(0, 10)]
    assert pool.num_free_blocks == 10
    assert pool.largest_free_extent == 10
    pool.check_integrity()


def test_best_fit_picks_smallest_extent_that_holds_k_lowest_start_on_ties() -> None:
    pool = _pool_with_extents(20, [(0, 3), (5, 2), (9, 4), (15, 1), (17, 3)])
    assert pool.allocate(2) == [5, 6]  # the 2-extent, not the first 3-extent
    assert pool.allocate(3) == [0, 1, 2]  # tie between (0, 3) and (17, 3): lowest start
    assert pool.allocate(1) == [15]
    assert pool.free_extents() == [(9, 4), (17, 3)]
    pool.check_integrity()


def test_best_fit_takes_the_head_of_a_larger_extent() -> None:
    pool = _pool_with_extents(20, [(2, 5), (10, 8)])
    assert pool.allocate(4) == [2, 3, 4, 5]
    assert pool.free_extents() == [(6, 1), (10, 8)]


def test_split_across_extents_takes_largest_first_then_best_fit_remainder() -> None:
    pool = _pool_with_extents(20, [(0, 4), (9, 4), (15, 1), (17, 3)])
    # no extent holds 6: the largest is taken whole (two 4s: the lowest start), then the
    # remaining 2 go best-fit into (17, 3)
    assert pool.allocate(6) == [0, 1, 2, 3, 17, 18]
    assert pool.free_extents() == [(9, 4), (15, 1), (19, 1)]
    pool.check_integrity()


def test_split_uses_fewest_pieces() -> None:
    pool = _pool_with_extents(30, [(0, 2), (4, 2), (8, 3), (13, 5)])
    # 9 blocks: 5 (largest) + 3 (next largest) + 1 best-fit into a 2-extent at the lowest start
    assert pool.allocate(9) == [13, 14, 15, 16, 17, 8, 9, 10, 0]
    assert pool.free_extents() == [(1, 1), (4, 2)]
    pool.check_integrity()


def test_release_merges_with_both_neighbours() -> None:
    pool = _pool_with_extents(12, [(0, 3), (4, 2), (8, 4)])
    assert pool.decref(3) == 0
    pool.release([3])
    assert pool.free_extents() == [(0, 6), (8, 4)]
    for b in (6, 7):
        pool.decref(b)
    pool.release([7, 6])
    assert pool.free_extents() == [(0, 12)]
    assert pool.largest_free_extent == 12
    pool.check_integrity()


def test_reference_counts_and_misuse() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.incref(b)
    assert pool.ref_count(b) == 2
    assert pool.decref(b) == 1
    with pytest.raises(ValueError):
        pool.release([b])  # still held
    assert pool.decref(b) == 0
    with pytest.raises(ValueError):
        pool.release([b, b])
    pool.release([b])
    with pytest.raises(ValueError):
        pool.decref(b)  # freed twice
    with pytest.raises(ValueError):
        pool.incref(b)  # free blocks cannot be taken by reference
    with pytest.raises(ValueError):
        pool.allocate(5)
    pool.check_integrity()


def test_parked_blocks_are_outside_extents_until_released_or_acquired() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.decref(0) == 0  # parked: the prefix cache would hold it
    assert pool.free_extents() == [(2, 2)]
    generation = pool.generation(0)
    pool.acquire_parked(0)
    assert pool.ref_count(0) == 1 and pool.generation(0) == generation + 1
    with pytest.raises(ValueError):
        pool.acquire_parked(0)
    pool.check_integrity()


def test_fragmentation_helpers() -> None:
    assert count_extents([]) == 0
    assert count_extents([4, 5, 6]) == 1
    assert count_extents([4, 5, 9, 10, 2]) == 3
    assert external_fragmentation(0, 0) == 0.0
    assert external_fragmentation(8, 8) == 0.0
    assert external_fragmentation(2, 8) == 0.75
