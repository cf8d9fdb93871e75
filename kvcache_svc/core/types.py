"""Inputs and results of `KVCacheManager.step`: small frozen dataclasses and NamedTuples.

Ids are plain ints: `seq_id` names a sequence (the scheduler's choice, unique while it lives),
`micro_batch_id` names the micro-batch a step's writes belong to, block ids are `0 ...
num_blocks - 1` and a slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


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
    """A sequence's slots for this step.

    This step's tokens are positions `num_computed_tokens ... num_computed_tokens +
    num_new_tokens - 1`. For a new sequence `num_computed_tokens` is its prefix-cache hit
    (tokens whose KV is already there). No slot mapping is carried: a token's slot follows
    from the table and its position (`slots`), and the stages derive it themselves.
    """

    seq_id: int
    block_ids: tuple[int, ...]  # the whole block table after this step
    num_new_tokens: int
    num_computed_tokens: int
    copies: tuple[BlockCopy, ...]

    def slots(self, block_size: int) -> tuple[int, ...]:
        """Where this step's tokens' K/V go: position p is in slot `block_ids[p // block_size]
        * block_size + p % block_size`."""
        start = self.num_computed_tokens
        return tuple(self.block_ids[p // block_size] * block_size + p % block_size
                     for p in range(start, start + self.num_new_tokens))


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
