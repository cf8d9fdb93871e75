"""What every attention backend shares: the step's batch layout and the backend interface.

`AttentionMetadata` describes a flattened, variable-length batch (see `worker_svc/kernels/attention.py`);
`AttentionBackend` is the two methods each backend implements (the torch and CPU backends in
attention.py, the Triton one in triton_attention.py). Apart from the backends so that none of
them imports another.

KV groups (services/kv_layout.py): a grouped step carries every sub-group's block tables and
slots (`group_block_tables`, `group_slot_mapping`); a layer attends through its sub-group's
view (`group(g)`), an ordinary one-group metadata, so the backends never see groups. The
views are made on first use and cached for the step, so the layers of a sub-group share
one (and its backends' derived plans); sub-group 0 (full attention) is the metadata itself.
A sliding sub-group's page that went back (`NULL_PAGE`) reads as page 0 in the tables: no
attention path reads a key outside a query's window (the native decode kernel starts at
the window, the torch and Triton paths mask it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.kv_layout import NULL_PAGE


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step layout of a flattened batch; tensors live on the stage's device. Grouped:
    `block_tables` and `slot_mapping` are sub-group 0's (`group_block_tables[0]`, ...)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, on CPU as a list too
    context_lens: torch.Tensor  # [num_seqs] int64: tokens in KV after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_start_loc_list: tuple[int, ...]
    context_lens_list: tuple[int, ...]
    # what a backend derives from the layout once per step and reuses in every layer
    derived: dict = field(default_factory=dict, compare=False, repr=False)
    # KV groups: every sub-group's tables and slots (NULL pages as 0); None with one group
    group_block_tables: torch.Tensor | None = None  # [num_groups, num_seqs, max_blocks] int64, contiguous
    group_slot_mapping: torch.Tensor | None = None  # [num_groups, num_tokens] int64, contiguous

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

    @property
    def num_groups(self) -> int:
        return 1 if self.group_block_tables is None else self.group_block_tables.shape[0]

    def group(self, g: int) -> AttentionMetadata:
        """Sub-group `g`'s view: its tables and slots, the rest (and the row split) shared;
        made once per step and cached. Sub-group 0, or a one-group step: this metadata."""
        if g == 0 or self.group_block_tables is None:
            return self
        views = self.derived.setdefault("groups", {})
        view = views.get(g)
        if view is None:
            view = views[g] = AttentionMetadata(
                slot_mapping=self.group_slot_mapping[g],
                query_start_loc=self.query_start_loc,
                context_lens=self.context_lens,
                block_tables=self.group_block_tables[g],
                query_start_loc_list=self.query_start_loc_list,
                context_lens_list=self.context_lens_list,
                derived={"split": self.split_rows()},
            )
        return view

    def layer_views(self, groups: Sequence[int]) -> list[AttentionMetadata]:
        """Each layer's metadata, given each layer's sub-group; a one-group step hands every
        layer this metadata."""
        if self.group_block_tables is None:
            return [self] * len(groups)
        return [self.group(g) for g in groups]

    def split_rows(self) -> tuple[list[int], list[int]]:
        """(sequences with one new token, sequences with several), in batch order; made
        once per step and shared by every layer and backend."""
        split = self.derived.get("split")
        if split is None:
            starts, decodes, prefills = self.query_start_loc_list, [], []
            for i in range(self.num_seqs):
                (decodes if starts[i + 1] - starts[i] == 1 else prefills).append(i)
            split = self.derived["split"] = (decodes, prefills)
        return split


class AttentionBackend(Protocol):
    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
        sinks: torch.Tensor | None = None,  # [num_heads] one more logit in each softmax (gpt-oss)
    ) -> torch.Tensor: ...


def paged_layout(
    spans: list[tuple[int, int, list]], block_size: int, device: torch.device | str, num_groups: int = 1
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata and positions of a flattened batch of sequences on paged KV, each span
    `(start, end, block_ids)`: positions `start ... end - 1`, the sequence's block table
    (slots: `block_ids[p // block_size] * block_size + p % block_size`). With KV groups
    (`num_groups` > 1) a table's entries are tuples of one page per sub-group, or their
    `entry_table`: made from Python ints every step, a 64-sequence step of 7 sub-groups at
    4K tokens took 9 ms, against 0.5 ms from the tensors (and 1 ms for one table)."""
    if num_groups > 1:
        return _grouped_layout(spans, block_size, device, num_groups)
    bs = block_size
    starts, positions, slots, table = [0], [], [], []
    max_blocks = max(-(-end // bs) for _, end, _ in spans)
    for start, end, blocks in spans:
        starts.append(starts[-1] + end - start)
        if end - start == 1:  # a decode
            positions.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            span = range(start, end)
            positions.extend(span)
            slots.extend(blocks[p // bs] * bs + p % bs for p in span)
        n = -(-end // bs)
        table += blocks[:n]
        table += [0] * (max_blocks - n)  # padding: block 0
    context_lens = tuple(end for _, end, _ in spans)
    # every field one slice of one tensor: one conversion (and one copy to the device) a
    # step, where five took 15 us of a 1-sequence decode step's 20
    flat = torch.tensor(slots + starts + list(context_lens) + positions + table, dtype=torch.long, device=device)
    fields = flat.split([len(slots), len(starts), len(context_lens), len(positions), len(table)])
    metadata = AttentionMetadata(
        slot_mapping=fields[0],
        query_start_loc=fields[1],
        context_lens=fields[2],
        block_tables=fields[4].view(len(spans), max_blocks),
        query_start_loc_list=tuple(starts),
        context_lens_list=context_lens,
    )
    return metadata, fields[3]


def entry_table(entries, num_groups: int) -> torch.Tensor:
    """A grouped table's entries as an int64 [entries, groups] tensor, NULL pages as 0 (what
    `paged_layout` takes in place of the entries; a stage keeps one per sequence)."""
    table = torch.tensor(entries, dtype=torch.long).reshape(-1, num_groups)
    return table.masked_fill_(table == NULL_PAGE, 0)


def _grouped_layout(
    spans: list[tuple[int, int, object]], block_size: int, device: torch.device | str, num_groups: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """`paged_layout` of tables of entries (or their `entry_table`s): the tables padded into
    one [seqs, blocks, groups] tensor, then every sub-group's slots gathered from it at once."""
    bs = block_size
    starts, positions, seq_of, tables = [0], [], [], []
    for i, (start, end, entries) in enumerate(spans):
        starts.append(starts[-1] + end - start)
        positions.extend(range(start, end))
        seq_of.extend([i] * (end - start))
        tables.append(entries if isinstance(entries, torch.Tensor) else entry_table(entries, num_groups))
    table = _padded(tables, [-(-end // bs) for _, end, _ in spans]).permute(2, 0, 1).contiguous()
    pos = torch.tensor(positions, dtype=torch.long)
    slots = table[:, torch.tensor(seq_of, dtype=torch.long), pos // bs] * bs + pos % bs  # [groups, tokens]
    table, slots = table.to(device), slots.contiguous().to(device)
    context_lens = tuple(end for _, end, _ in spans)
    metadata = AttentionMetadata(
        slot_mapping=slots[0],
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        block_tables=table[0],
        query_start_loc_list=tuple(starts),
        context_lens_list=context_lens,
        group_block_tables=table,
        group_slot_mapping=slots,
    )
    return metadata, pos.to(device)


def _padded(tables: list[torch.Tensor], needed: list[int]) -> torch.Tensor:
    """The first `needed[i]` rows of each [entries, groups] table as one [seqs, max needed,
    groups] tensor, padded with page 0: one concatenation and one gather, whatever the
    number of sequences (slicing each and torch's pad_sequence took 4x as long at 64)."""
    flat = torch.cat(tables)
    offsets, at = [], 0
    for t in tables:
        offsets.append(at)
        at += t.shape[0]
    cols = torch.arange(max(needed))
    valid = cols[None, :] < torch.tensor(needed)[:, None]  # [seqs, max needed]
    index = (torch.tensor(offsets)[:, None] + cols[None, :]).masked_fill_(~valid, 0)
    return flat[index].masked_fill_(~valid[..., None], 0)
