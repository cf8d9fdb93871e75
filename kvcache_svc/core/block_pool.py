"""Reference-counted blocks and best-fit placement in free extents."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable

from services.kv_errors import IntegrityError

# KVCacheStats.block_map's values (kvcache.proto)
BLOCK_FREE, BLOCK_USED, BLOCK_SHARED, BLOCK_PARKED = 0, 1, 2, 3


class BlockPool:
    """`num_blocks` blocks with reference counts; free blocks kept as extents.

    Every block is in exactly one of three states:

    - used: `ref_count > 0`;
    - free: `ref_count == 0` and inside exactly one free extent;
    - parked: `ref_count == 0` and outside the extents — its owner (the prefix cache's LRU
      of evictable blocks) holds it until `acquire_parked` or `release` hands it back.

    A free extent is a run `[start, start + length)` of free blocks; extents are maximal (no
    two touch), indexed by start, by end, and in a sorted list keyed by `(length, start)`
    (packed into one int), so placement and merging cost `O(log E)` comparisons plus a
    list insert, never a scan of the blocks.

    Placement (`allocate(k)`) is best-fit: the `k` blocks are the first `k` of the smallest
    extent that holds `k`. When no extent holds `k`, the largest extent is taken whole,
    repeatedly, until the remainder fits one extent, which is then placed best-fit; this
    uses the fewest extents possible. Ties go to the lowest start; block ids come back in
    the order taken.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_blocks = num_blocks
        self._shift = num_blocks.bit_length()
        self._start_mask = (1 << self._shift) - 1
        self._ref_counts = [0] * num_blocks
        # bumped on every allocation, so a stale reference to an earlier use is detectable
        self._generations = [0] * num_blocks
        self._in_extent = bytearray(b"\x01") * num_blocks
        self._length_by_start: dict[int, int] = {0: num_blocks}
        self._start_by_end: dict[int, int] = {num_blocks: 0}
        self._sorted_keys: list[int] = [self._key(num_blocks, 0)]
        self._num_free = num_blocks

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks inside free extents (parked blocks are not counted)."""
        return self._num_free

    @property
    def num_free_extents(self) -> int:
        return len(self._sorted_keys)

    @property
    def largest_free_extent(self) -> int:
        return self._sorted_keys[-1] >> self._shift if self._sorted_keys else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """`(start, length)` of every free extent, by start."""
        return sorted(self._length_by_start.items())

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def generation(self, block_id: int) -> int:
        return self._generations[block_id]

    def is_free(self, block_id: int) -> bool:
        return bool(self._in_extent[block_id])

    def state_map(self) -> bytes:
        """One byte per block: BLOCK_FREE, BLOCK_USED (one holder), BLOCK_SHARED (several),
        BLOCK_PARKED (no holder, not free: kept by the prefix cache, evictable)."""
        refs, in_extent = self._ref_counts, self._in_extent
        return bytes(
            BLOCK_FREE
            if in_extent[b]
            else BLOCK_PARKED
            if refs[b] == 0
            else BLOCK_USED
            if refs[b] == 1
            else BLOCK_SHARED
            for b in range(self._num_blocks)
        )

    # ---- allocation and references -------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (best-fit, see the class docstring) with ref count 1."""
        if num_blocks > self._num_free:
            raise ValueError(f"asked for {num_blocks} blocks, {self._num_free} free")
        block_ids: list[int] = []
        remaining = num_blocks
        while remaining:
            i = bisect_left(self._sorted_keys, remaining << self._shift)
            if i == len(self._sorted_keys):  # none holds the rest: the largest, lowest start
                largest = self._sorted_keys[-1] >> self._shift
                i = bisect_left(self._sorted_keys, largest << self._shift)
            key = self._sorted_keys[i]
            start, length = key & self._start_mask, key >> self._shift
            taken = min(length, remaining)
            self._remove_extent(start, length)
            if taken < length:
                self._add_extent(start + taken, length - taken)
            block_ids.extend(range(start, start + taken))
            remaining -= taken
        self._num_free -= num_blocks
        refs, gens, in_extent = self._ref_counts, self._generations, self._in_extent
        for b in block_ids:
            refs[b] = 1
            gens[b] += 1
            in_extent[b] = 0
        return block_ids

    def acquire_parked(self, block_id: int) -> None:
        """Reuse a parked block (an evicted one) for a new owner: ref count 1."""
        if self._ref_counts[block_id] or self._in_extent[block_id]:
            raise ValueError(f"block {block_id} is not parked")
        self._ref_counts[block_id] = 1
        self._generations[block_id] += 1

    def incref(self, block_id: int) -> None:
        """One more holder; a parked block may be taken back this way (a prefix hit)."""
        if self._in_extent[block_id]:
            raise ValueError(f"block {block_id} is free")
        self._ref_counts[block_id] += 1

    def decref(self, block_id: int) -> int:
        """One holder fewer; returns the new count. At 0 the block is parked: the caller
        either keeps it parked (cached) or hands it to `release`."""
        count = self._ref_counts[block_id] - 1
        if count < 0:
            raise ValueError(f"block {block_id} freed twice")
        self._ref_counts[block_id] = count
        return count

    def release(self, block_ids: Iterable[int]) -> None:
        """Return parked blocks to the free extents, merging with their neighbours."""
        ordered = sorted(block_ids)
        if len(set(ordered)) != len(ordered):
            raise ValueError("a block released twice")
        for b in ordered:
            if self._ref_counts[b] or self._in_extent[b]:
                raise ValueError(f"block {b} is not parked")
        i = 0
        while i < len(ordered):
            j = i + 1
            while j < len(ordered) and ordered[j] == ordered[j - 1] + 1:
                j += 1
            self._free_run(ordered[i], j - i)
            i = j
        for b in ordered:
            self._in_extent[b] = 1
        self._num_free += len(ordered)

    # ---- extents -------------------------------------------------------------------------

    def _key(self, length: int, start: int) -> int:
        return (length << self._shift) | start

    def _add_extent(self, start: int, length: int) -> None:
        self._length_by_start[start] = length
        self._start_by_end[start + length] = start
        insort(self._sorted_keys, self._key(length, start))

    def _remove_extent(self, start: int, length: int) -> None:
        del self._length_by_start[start]
        del self._start_by_end[start + length]
        key = self._key(length, start)
        i = bisect_left(self._sorted_keys, key)
        del self._sorted_keys[i]

    def _free_run(self, start: int, length: int) -> None:
        end = start + length
        left_start = self._start_by_end.get(start)
        if left_start is not None:
            self._remove_extent(left_start, start - left_start)
            start = left_start
        right_length = self._length_by_start.get(end)
        if right_length is not None:
            self._remove_extent(end, right_length)
            end += right_length
        self._add_extent(start, end - start)

    # ---- integrity -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Extents are maximal, disjoint, consistently indexed, and hold exactly the free
        blocks; free blocks have ref count 0. Raises `IntegrityError`."""
        keys = [self._key(length, start) for start, length in self._length_by_start.items()]
        if sorted(keys) != self._sorted_keys:
            raise IntegrityError("sorted extent index disagrees with extents by start")
        if len(self._start_by_end) != len(self._length_by_start):
            raise IntegrityError("extent indices by start and by end differ in size")
        marked = bytearray(self._num_blocks)
        total = 0
        for start, length in self._length_by_start.items():
            end = start + length
            if length <= 0 or start < 0 or end > self._num_blocks:
                raise IntegrityError(f"extent ({start}, {length}) out of range")
            if self._start_by_end.get(end) != start:
                raise IntegrityError(f"extent ({start}, {length}) missing from end index")
            if end in self._length_by_start:
                raise IntegrityError(f"extent ({start}, {length}) touches the next one")
            for b in range(start, end):
                if marked[b]:
                    raise IntegrityError(f"block {b} in two extents")
                marked[b] = 1
            total += length
        if marked != self._in_extent:
            raise IntegrityError("free-block marks disagree with the extents")
        if total != self._num_free:
            raise IntegrityError(f"extents hold {total} blocks, counted {self._num_free}")
        for b in range(self._num_blocks):
            if self._ref_counts[b] < 0:
                raise IntegrityError(f"block {b} has ref count {self._ref_counts[b]}")
            if marked[b] and self._ref_counts[b]:
                raise IntegrityError(f"free block {b} has ref count {self._ref_counts[b]}")
