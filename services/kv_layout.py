"""How a model's layers share KV pages: one group of tables per attention type.

Layers that attend differently keep their own block tables (vLLM's hybrid KV-cache
manager is the reference). A model whose layers all attend alike has one table per
sequence, as always: a block id names `block_size` slots in every layer. A hybrid model
(some full-attention layers, some sliding-window ones: Gemma 2 and 3) splits its layers by
attention type into *sub-groups* of at most `layers_per_page` layers each, and every
sub-group has its own table per sequence. All tables draw *pages* from one pool: page `p`
is slot range `p * block_size ...` of `layers_per_page` layer pools, and the layer at
`slot` i of a sub-group keeps its KV in pool i. Pages are never in two tables at once, so
one pool serves every sub-group, and memory follows the workload (a long chat needs full
pages; many short ones, sliding and full alike) with no split to guess.

A sequence's table is then one *entry* per block position (`block_size` tokens), and an
entry is a tuple of `num_groups` page ids, one per sub-group, in sub-group order
(`NULL_PAGE` where a sliding sub-group gave the page back: its window has left it). With
one group an entry is a plain int, as before. On the wire entries travel flattened, with
`num_groups` beside them.

A sliding sub-group frees pages whose tokens no query can see again: a step computing
positions from `start` attends to keys from `start - window + 1` on, so pages of blocks
wholly before that go back to the pool, and a long sequence holds `window / block_size + 1`
pages in each sliding sub-group. Only hybrid models group: a model whose layers all slide
(Mistral's `sliding_window`) keeps one table of whole-context blocks.

This module is torch-free: the KV service, the launcher and the stages derive the same
layout from the layers' windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NULL_PAGE = 2**32 - 1  # a sliding sub-group's entry whose page went back (uint32 on the wire)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The sub-groups' windows and where each layer's KV lives.

    `windows[s]` is sub-group s's sliding window (0: full attention; full sub-groups come
    first); `layer_places[layer]` is `(sub-group, slot)`; `layers_per_page` is the slots a
    page spans. One group: `windows == (0,)` and layer i at slot i.
    """

    windows: tuple[int, ...]
    layer_places: tuple[tuple[int, int], ...]
    layers_per_page: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def grouped(self) -> bool:
        return len(self.windows) > 1

    def spec(self) -> str:
        """What the KV service is told (`--kv-groups`): the sub-groups' windows, or "" for
        one table."""
        return ",".join(str(w) for w in self.windows) if self.grouped else ""

    def slots_of(self, layers: Sequence[int]) -> tuple[int, ...]:
        """The page slots `layers` use (a stage's layers: the pools it allocates)."""
        return tuple(sorted({self.layer_places[layer][1] for layer in layers}))

    def describe(self) -> str:
        if not self.grouped:
            return "one table for all layers"
        full = sum(1 for w in self.windows if not w)
        sliding = {w for w in self.windows if w}
        return (
            f"{self.num_groups} KV groups of {self.layers_per_page} layers a page: {full} full-attention, "
            f"{self.num_groups - full} sliding (window {', '.join(str(w) for w in sorted(sliding))})"
        )


def kv_layout(layer_windows: Sequence[int | None]) -> KVLayout:
    """The layout for layers with these windows (None or 0: full attention).

    Hybrid models group by window; a page spans as many layers as the smallest group has,
    and larger groups are split into sub-groups of that many layers (the last one may use
    fewer slots).
    """
    windows = [w or 0 for w in layer_windows]
    kinds = sorted(set(windows))
    if len(kinds) < 2 or 0 not in kinds:  # all alike, or all sliding: one table
        return KVLayout((0,), tuple((0, i) for i in range(len(windows))), max(1, len(windows)))
    members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    per_page = min(len(m) for m in members.values())
    group_windows: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(windows)
    for w in kinds:  # 0 (full) first
        layers = members[w]
        for r, layer in enumerate(layers):
            places[layer] = (len(group_windows) + r // per_page, r % per_page)
        group_windows.extend([w] * -(-len(layers) // per_page))
    return KVLayout(tuple(group_windows), tuple(places), per_page)


def parse_spec(spec: str) -> tuple[int, ...]:
    """`--kv-groups` back into windows; "" is one full-attention group."""
    if not spec.strip():
        return (0,)
    try:
        windows = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"kv_groups: comma-separated windows (0: full attention), got {spec!r}") from None
    if any(w < 0 for w in windows) or windows[0] != 0 or list(windows) != sorted(windows):
        raise ValueError(f"kv_groups: full-attention groups (0) first, then windows ascending, got {spec!r}")
    return windows


def first_needed_block(start: int, window: int, block_size: int) -> int:
    """The first block a sliding sub-group still needs when the next query is at `start`."""
    return max(0, start - window + 1) // block_size


def flat_pages(entries: Sequence[int | tuple[int, ...]]) -> list[int]:
    """Table entries as they travel: each entry's pages in sub-group order."""
    if entries and isinstance(entries[0], tuple):
        return [page for entry in entries for page in entry]  # type: ignore[union-attr]
    return list(entries)  # type: ignore[arg-type]


def entries_of(flat: Sequence[int], groups: int) -> tuple:
    """Flat page ids back into entries of `groups` pages (plain ids for one group)."""
    if groups <= 1:
        return tuple(flat)
    if len(flat) % groups:
        raise ValueError(f"{len(flat)} page ids are not whole entries of {groups}")
    return tuple(tuple(flat[i : i + groups]) for i in range(0, len(flat), groups))


def entries_that_fit(num_pages: int, windows: Sequence[int], block_size: int, chunk_tokens: int) -> int:
    """The most table entries (block positions) one sequence can hold in a pool of `num_pages`
    pages at once: what a request is admitted against. Full sub-groups hold a page of every
    entry; a sliding one at most the entries its window and one prefill chunk of
    `chunk_tokens` span (a chunk's pages are all held while it is computed)."""
    full = sum(1 for w in windows if not w)
    sliding = [w for w in windows if w]
    if not sliding:
        return num_pages // max(1, full)
    span = max(-(-(w - 1 + chunk_tokens) // block_size) + 1 for w in sliding)
    if num_pages // len(windows) < span:
        return num_pages // len(windows)
    return (num_pages - len(sliding) * span) // full
