"""What every attention backend shares: the step's batch layout and the backend interface.

`AttentionMetadata` describes a flattened, variable-length batch (see `worker_svc/attention.py`);
`AttentionBackend` is the two methods each backend implements (the torch and CPU backends in
attention.py, the Triton one in triton_attention.py). Apart from the backends so that none of
them imports another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step layout of a flattened batch; tensors live on the stage's device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, on CPU as a list too
    context_lens: torch.Tensor  # [num_seqs] int64: tokens in KV after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_start_loc_list: tuple[int, ...]
    context_lens_list: tuple[int, ...]
    # what a backend derives from the layout once per step and reuses in every layer
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

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
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
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
    ) -> torch.Tensor: ...


def paged_layout(spans: list[tuple[int, int, list[int]]], block_size: int,
                 device: torch.device | str) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata and positions of a flattened batch of sequences on paged KV, each span
    `(start, end, block_ids)`: positions `start ... end - 1`, the sequence's block table
    (slots: `block_ids[p // block_size] * block_size + p % block_size`)."""
    bs = block_size
    starts, positions, slots, table_rows = [0], [], [], []
    max_blocks = max(-(-end // bs) for _, end, _ in spans)
    for start, end, blocks in spans:
        starts.append(starts[-1] + end - start)
        span = range(start, end)
        positions.extend(span)
        slots.extend(blocks[p // bs] * bs + p % bs for p in span)
        n = -(-end // bs)
        table_rows.append(blocks[:n] + [0] * (max_blocks - n))  # padding: block 0
    context_lens = tuple(end for _, end, _ in spans)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        block_tables=torch.tensor(table_rows, dtype=torch.long).to(device),
        query_start_loc_list=tuple(starts),
        context_lens_list=context_lens,
    )
    return metadata, torch.tensor(positions, dtype=torch.long, device=device)
