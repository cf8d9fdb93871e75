"""The step contract: what the planner produces and every stage consumes, and what comes back.

One torch-free, typed plan (the shape of vLLM v1's `SchedulerOutput`), the same in-process
and over gRPC (`services.step_codec` is its one codec, next to the proto):

- `NewSeq`: a sequence the stages hold no state for (new, forked, re-admitted after
  preemption, or after a reset): its known tokens, sampling parameters and whole block
  table travel once.
- `CachedSeq`: a sequence the stages hold: its id, how many tokens to compute this step,
  and only what changed (blocks appended or replaced, tokens a non-sampling first stage does
  not know yet).
- `StepPlan.finished_seq_ids`: sequences whose state the stages drop (finished, aborted,
  preempted); `reset` drops every sequence's state first (after a failure).

Stages keep each sequence's state across steps (vLLM's persistent batch): its tokens (the
first stage embeds them; the last stage samples with them), its computed length (positions),
its block table (slots: `block_ids[p // block_size] * block_size + p % block_size`). A
stage samples a sequence exactly when the step computes up to its last known token; the
last stage appends what it samples, so with one stage a decode step carries no token at all.
A pooling sequence (`NewSeq.pooling`) is never sampled: the step that computes its last
prompt position returns its pooled vector (`StepResult.pooled`) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from services.pooling import Embedding, PoolingType
from services.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """Score prompt tokens among a step's new tokens (the last stage): the logits after
    absolute position `first_position + j` give the log-probability of `targets[j]`, with
    `num_top` most likely alternatives."""

    first_position: int
    targets: tuple[int, ...]
    num_top: int = 0


@dataclass(frozen=True, slots=True)
class NewSeq:
    """A sequence sent whole: the stages (re)start its state from this.

    `token_ids` are all its known tokens (prompt, then the output so far after a
    preemption); positions `0 ... num_computed - 1` already have KV (a prefix-cache hit or a
    fork's shared pages), and this step computes `num_scheduled` tokens from `num_computed`.
    `pooling` set: a pooling sequence (`services.pooling`): its tokens are its prompt, and
    the last stage pools where it would sample.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    prompt_len: int
    num_computed: int
    num_scheduled: int
    block_ids: tuple[int, ...]
    sampling: SamplingParams
    choice_index: int = 0
    entropy_seed: int = 0
    request_id: str = ""  # for logs and error messages
    trace_context: str = ""  # W3C traceparent of the request's scheduler span
    prompt_scoring: PromptScoring | None = None
    pooling: PoolingType | None = None
    lora_name: str = ""  # multi-LoRA: the adapter it runs under ("": the base model)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass(frozen=True, slots=True)
class CachedSeq:
    """A sequence the stages hold: `num_scheduled` tokens from where it stands.

    `block_ids` replace its block table from index `block_offset` on (usually an append:
    `block_offset` is the table's length; a copy-on-write replaces a shared last block).
    `new_token_ids` extend its known tokens on stages that do not sample (the last stage
    appends the tokens it samples itself); empty when the first stage has them already.

    Speculative decoding: `draft_token_ids` are proposed tokens after the known ones; the
    step computes them too (its last `len(draft_token_ids)` positions) and the last stage
    verifies them: it samples at every position from the last known token on, keeps the
    drafts up to the first one the target model would not have produced, and adds that
    position's own token (`StepResult.sampled`: one to `len(draft_token_ids) + 1` tokens for
    the sequence, in order). `start` (-1: where the stages stand) moves a sequence back to
    an earlier position: after a verify step the stages stand past every draft, and the
    rejected drafts' positions are computed again from the accepted tokens.
    """

    seq_id: int
    num_scheduled: int
    block_offset: int
    block_ids: tuple[int, ...] = ()
    new_token_ids: tuple[int, ...] = ()
    prompt_scoring: PromptScoring | None = None
    draft_token_ids: tuple[int, ...] = ()
    start: int = -1


class TierOp(NamedTuple):
    """One move between a stage's KV pool and its KV tier (the host memory and disk below the
    pool, `--kv-offload`), decided by the KV manager and carried out by every stage in order,
    before the step's block copies. `key` is the block's prefix key (the hash chain of the KV
    events); each stage moves its own layers' part of the block."""

    kind: int  # TIER_SAVE, TIER_LOAD, TIER_DEMOTE or TIER_DROP
    key: bytes
    block_id: int = -1  # SAVE: the pool block written to the host tier; LOAD: the block read into


TIER_SAVE = 1  # pool block -> host tier (the block is about to be reused)
TIER_LOAD = 2  # host or disk tier -> pool block (a prefix hit below the pool)
TIER_DEMOTE = 3  # host tier -> disk tier (the host tier is full)
TIER_DROP = 4  # forgotten (its tier is full, or a step that loaded it failed)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step (micro-batch): applied as `reset`, `finished_seq_ids`, `tier_ops`,
    `block_copies`, then new and cached sequences; the batch's token order is `new_seqs` then
    `cached_seqs`."""

    step_id: int
    new_seqs: tuple[NewSeq, ...] = ()
    cached_seqs: tuple[CachedSeq, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    reset: bool = False
    tier_ops: tuple[TierOp, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled for s in self.new_seqs) + sum(s.num_scheduled for s in self.cached_seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.new_seqs) + len(self.cached_seqs)

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(s.seq_id for s in self.new_seqs) + tuple(s.seq_id for s in self.cached_seqs)


# --- what comes back ----------------------------------------------------------------------


class TokenLogprobs(NamedTuple):
    """A token's log-probability under the raw logits, and the most likely alternatives
    `(token id, logprob)`, most likely first."""

    logprob: float
    top: Sequence[tuple[int, float]] = ()


@dataclass(frozen=True, slots=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the sequence's params ask for them


class PooledOutput(NamedTuple):
    """A pooling sequence's vector (`services.pooling.Embedding`: float32 bytes),
    L2-normalized, from the step that computed its last position."""

    seq_id: int
    embedding: Embedding


class PositionLogprobs(NamedTuple):
    """One scored prompt position: the next prompt token, its logprob and 1-based rank, and
    the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: Sequence[tuple[int, float]] = ()


class ScoredPrompt(NamedTuple):
    seq_id: int
    first_position: int
    positions: tuple[PositionLogprobs, ...]


@dataclass(frozen=True, slots=True)
class StageTiming:
    stage_index: int
    received_ns: int
    compute_start_ns: int
    compute_end_ns: int


@dataclass(frozen=True, slots=True)
class StepResult:
    """The last stage's outcome of a step: one sampled token per sequence that sampled, in
    plan order (a verify step's sequence: its accepted drafts and the token after them, in
    order), any scored prompt positions, and the vectors of the pooling sequences whose
    prompt this step completed."""

    step_id: int
    sampled: tuple[SampledToken, ...] = ()
    prompt_logprobs: tuple[ScoredPrompt, ...] = ()
    timings: tuple[StageTiming, ...] = ()
    pooled: tuple[PooledOutput, ...] = ()
    # speculative decoding with a draft model (on the last stage): (sequence, the draft
    # model's next tokens after what it sampled), for the sequence's next verify step
    proposals: tuple[tuple[int, tuple[int, ...]], ...] = ()
