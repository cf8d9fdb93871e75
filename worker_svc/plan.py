"""The micro-batch plan as a stage sees it: plain dataclasses, no protobuf, no torch.

The gRPC layer converts `pagoda.v1` messages into these (`from_pb`) and back; model code
never sees generated classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_svc.sampler import SampleRow


@dataclass(frozen=True)
class PromptScoring:
    """Score prompt tokens among a chunk's new tokens (the last stage): the logits after
    absolute position `first_position + j` give the log-probability of `targets[j]`, with
    `num_top` most likely alternatives."""

    first_position: int
    targets: tuple[int, ...]
    num_top: int = 0


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a micro-batch: `num_tokens` new tokens at the end of its context.

    The new tokens sit at positions `context_len - num_tokens ... context_len - 1`;
    `slot_mapping[j]` is where token j's K/V goes, and `block_table` lists the blocks
    holding positions `0 ... context_len - 1`.
    """

    seq_id: int
    num_tokens: int
    context_len: int
    slot_mapping: tuple[int, ...]
    block_table: tuple[int, ...]
    token_ids: tuple[int, ...] = ()  # stage 0 only
    sample: SampleRow | None = None  # last stage: sample the token after the last row
    prompt_scoring: PromptScoring | None = None  # last stage

    @property
    def start_position(self) -> int:
        return self.context_len - self.num_tokens


@dataclass(frozen=True)
class StagePlan:
    """A micro-batch: sequences in a fixed order, block copies first, releases of sampler state."""

    micro_batch_id: int
    seqs: tuple[SeqChunk, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    released_seq_ids: tuple[int, ...] = field(default=())
    release_all: bool = False  # drop every sequence's sampler state (after a reset)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


def without_tokens(plan: StagePlan) -> StagePlan:
    """The plan as a later stage receives it: hidden states instead of token ids."""
    seqs = tuple(
        SeqChunk(s.seq_id, s.num_tokens, s.context_len, s.slot_mapping, s.block_table, (), s.sample,
                 s.prompt_scoring)
        for s in plan.seqs
    )
    return StagePlan(plan.micro_batch_id, seqs, plan.block_copies, plan.released_seq_ids, plan.release_all)
