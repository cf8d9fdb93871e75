"""KV groups on a sequence's table: which pages each sliding sub-group still needs.

An entry holds one page per sub-group (services/kv_layout.py); sub-group 0 attends in full,
a sliding sub-group reads only its window, so its pages of blocks no window reaches any more
are `NULL_PAGE` in the entry. Pure functions over a table, the windows and the prefix
cache's answers: `KVCacheManager` decides when, these say which pages.
"""

from __future__ import annotations

from kvcache_svc.core.prefix_cache import ROOT_KEY, TOKEN_BYTES, PrefixCache, PrefixHit
from kvcache_svc.core.sequence import SequenceState
from kvcache_svc.core.validation import ValidNewSequence
from services.kv_layout import NULL_PAGE, first_needed_block

Sliding = tuple[tuple[int, int], ...]  # (sub-group, window) of each sliding sub-group


def sliding_groups(windows: tuple[int, ...]) -> Sliding:
    return tuple((s, w) for s, w in enumerate(windows) if w)


def hit_entries(
    cache: PrefixCache, new: ValidNewSequence, hits: list[PrefixHit], windows: tuple[int, ...], block_size: int
) -> list[tuple[int, ...]]:
    """The table entries of the longest prefix every sub-group can serve.

    One group: the hits. With groups, full-attention sub-groups need their page of every
    hit block from the start, sliding ones only of the blocks the window of the first
    computed position reaches (others come back as `NULL_PAGE`, not held)."""
    if len(windows) == 1 or not hits:
        return [(hit.block_id,) for hit in hits]
    bs, stride, groups = block_size, block_size * TOKEN_BYTES, range(1, len(windows))
    found: list[list[int]] = []
    parent = ROOT_KEY
    for j, hit in enumerate(hits):
        tokens = new.token_bytes[j * stride : (j + 1) * stride]
        pages = [hit.block_id]
        for s in groups:
            page = cache.find(hit.key, s, parent, new.namespace, tokens)
            pages.append(NULL_PAGE if page is None else page)
        found.append(pages)
        parent = hit.key
    length = len(found)
    for s in groups:
        if not windows[s]:
            length = next((j for j in range(length) if found[j][s] == NULL_PAGE), length)
    sliding = sliding_groups(windows)
    while length:
        computed = length * bs - (length * bs == new.num_tokens)
        limits = [(s, first_needed_block(computed, w, bs)) for s, w in sliding]
        if all(found[j][s] != NULL_PAGE for s, lo in limits for j in range(lo, length)):
            for s, lo in limits:
                for j in range(lo):
                    found[j][s] = NULL_PAGE
            break
        length -= 1
    return [tuple(pages) for pages in found[:length]]


def num_slid(entries: list[tuple[int, ...]], num: int, sliding: Sliding) -> int:
    """How many of the first `num` entries have every sliding page given back."""
    if not sliding:
        return 0
    return next((j for j in range(num) if any(entries[j][s] != NULL_PAGE for s, _ in sliding)), num)


def sliding_out(seq: SequenceState, start: int, sliding: Sliding, block_size: int) -> list[tuple[int, int, int]]:
    """(entry, sub-group, page) of the pages sliding sub-groups no longer need once
    the next query is at `start`: no window from there reaches them."""
    entries = seq.block_ids
    limits = [(s, first_needed_block(start, w, block_size)) for s, w in sliding]
    end = min(max(lo for _, lo in limits), len(entries))
    return [
        (j, s, entries[j][s])
        for j in range(seq.num_slid, end)
        for s, lo in limits
        if j < lo and entries[j][s] != NULL_PAGE
    ]
