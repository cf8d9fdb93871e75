"""Inputs and results of `KVCacheManager.step`: small frozen dataclasses and NamedTuples.

Ids are plain ints: `seq_id` names a sequence (the scheduler's choice, unique while it lives),
`micro_batch_id` names the micro-batch a step's writes belong to, block ids are `0 ...
num_blocks - 1` and a slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from services.step import TierOp


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A new sequence and its prompt.

    The manager looks the prompt up in the prefix cache, shares the cached blocks of its
    longest cached prefix and allocates slots for the prompt tokens after it: all of them, or
    at most `max_num_new_tokens` (a chunked prefill; the rest of the prompt then comes as
    `Append`s). The prefix lookup always sees the whole prompt.
    """

    seq_id: int
    token_ids: Sequence[int]
    namespace: str | None = None  # model / adapter: prefixes are only shared within one
    max_num_new_tokens: int | None = None
    skip_prefix_cache: bool = False  # no lookup, and its blocks (and its forks') never cached


@dataclass(frozen=True, slots=True)
class Append:
    """Slots for `token_ids` at the end of an existing sequence (a decode token or a chunk),
    and room held for `num_lookahead_slots` tokens after them that are not known yet (an
    asynchronous scheduler's placeholder step): their blocks are allocated now and later
    appends fill them. With lookahead slots, `token_ids` may be empty."""

    seq_id: int
    token_ids: Sequence[int]
    num_lookahead_slots: int = 0


@dataclass(frozen=True, slots=True)
class Fork:
    """`child_seq_id` starts as a copy of `parent_seq_id` sharing all of its blocks."""

    parent_seq_id: int
    child_seq_id: int


@dataclass(frozen=True, slots=True)
class StepInput:
    """One scheduler plan's worth of KV bookkeeping, validated whole before any of it applies.

    Applied in this order: failed then completed micro-batches, frees, forks, appends (in the
    given order), new sequences (in the given order). `micro_batch_id` names the micro-batch
    that writes this step's tokens; it is required when the step has appends or new
    sequences, and must not be in flight already.
    """

    new_sequences: Sequence[NewSequence] = ()
    appends: Sequence[Append] = ()
    forks: Sequence[Fork] = ()
    frees: Sequence[int] = ()
    completed_micro_batch_ids: Sequence[int] = ()
    failed_micro_batch_ids: Sequence[int] = ()
    micro_batch_id: int | None = None


class BlockCopy(NamedTuple):
    """Workers copy the whole block `src_block_id` into `dst_block_id` before this step writes."""

    src_block_id: int
    dst_block_id: int


class Allocated(NamedTuple):
    """A sequence's slots for this step, and its block table as a diff against the last
    answer the manager gave for it.

    The table after this step is `last_answer[:block_offset] + block_ids`: `block_offset` is
    the number of entries the last answer holds that are unchanged (usually all of them: a
    step crossing into a new block adds one id, a copy-on-write replaces the partly filled
    last block), and it is 0 with the whole table in `block_ids` for a sequence never
    answered yet (new, or a fork child). This is the form the stages' plan carries
    (`services.step.CachedSeq`), so a scheduler passes it on as it comes.

    This step's tokens are positions `num_computed_tokens ... num_computed_tokens +
    num_new_tokens - 1`. For a new sequence `num_computed_tokens` is its prefix-cache hit
    (tokens whose KV is already there). No slot mapping is carried: a token's slot follows
    from the table and its position (`slots`), and the stages derive it themselves.
    """

    seq_id: int
    block_ids: tuple[int, ...]  # the table's entries from `block_offset` on
    num_new_tokens: int
    num_computed_tokens: int
    copies: tuple[BlockCopy, ...]
    block_offset: int = 0

    @property
    def num_blocks(self) -> int:
        """The length of the table after this step."""
        return self.block_offset + len(self.block_ids)

    def applied_to(self, table: Sequence[int]) -> tuple[int, ...]:
        """The whole table after this step, given the last answer's `table`."""
        if len(table) < self.block_offset:
            raise ValueError(f"sequence {self.seq_id}: keeps {self.block_offset} blocks of a table of {len(table)}")
        return tuple(table[: self.block_offset]) + self.block_ids


def slots(block_ids: Sequence[int], start: int, num_tokens: int, block_size: int) -> tuple[int, ...]:
    """Where tokens `start ... start + num_tokens - 1` of a sequence with the whole table
    `block_ids` have their K/V: position p is in slot `block_ids[p // block_size] * block_size
    + p % block_size`."""
    return tuple(block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens))


class NoBlocks(NamedTuple):
    """Not enough blocks for this sequence; it was left exactly as it was (or not created).

    `num_free_blocks` is how many it could have had: free plus evictable blocks, less the
    watermark for a new sequence.
    """

    seq_id: int
    num_needed_blocks: int
    num_free_blocks: int


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One result per appended or new sequence, and every block copy of the step in order.

    No copy's source is another copy's destination within one step, so workers may apply
    `copies` in order or all at once (read every source, then write); either way before
    writing this step's tokens.
    """

    results: Mapping[int, Allocated | NoBlocks]
    copies: tuple[BlockCopy, ...]
    tier_ops: tuple[TierOp, ...] = ()  # moves to and from the KV tier, applied before `copies`
