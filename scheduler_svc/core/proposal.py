"""What `Planner.propose` asks the KV service for, and what `Planner.finalize` reads the
answers against.

A `Proposal` is immutable: the planner's state may change while the KV service answers (an
abort, a stop string), so `finalize` checks each sequence it names again. It names running
sequences by object and new sequences by the ids it asked the KV service for; the sequences
those ids will name are made by `finalize`, which also takes the ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.request import Request, Sequence
from services.kv_types import Append, Fork, NewSequence, StepInput


@dataclass(frozen=True, slots=True)
class Placeholder:
    """A decode of a sequence whose step in flight samples the token this one computes, at
    `position`. `grows`: that token starts a block, which the KV service holds ahead for it."""

    seq: Sequence
    position: int
    grows: bool


@dataclass(frozen=True, slots=True)
class Chunk:
    """A running sequence's decode or prefill chunk: tokens `start ... start + num_tokens - 1`
    (the KV service's view of a sequence may lag its computed tokens by the placeholder steps
    in flight). `deferred`: a decode inside its last block, whose token the KV service is told
    later (no KV round trip for it now). A verify step (speculative decoding) is a decode
    followed by `drafts`, whose slots the KV service holds ahead (lookahead slots)."""

    seq: Sequence
    start: int
    num_tokens: int
    deferred: bool
    drafts: tuple[int, ...] = ()  # a verify step: its last len(drafts) tokens are these drafts


@dataclass(frozen=True, slots=True)
class PlannedFork:
    """The other choices of an n > 1 request, forked from its first: ids `child_seq_ids`,
    choice indices from `first_index` on."""

    parent: Sequence
    child_seq_ids: tuple[int, ...]
    first_index: int


@dataclass(frozen=True, slots=True)
class Readmission:
    """A running sequence that lost its KV, back under a fresh id: a free and its return then
    never share a step."""

    seq: Sequence
    new_seq_id: int


@dataclass(frozen=True, slots=True)
class AdmittedSeq:
    """One choice of an admission: a preempted request's sequence (`existing`, which takes
    `seq_id` when allocated), or a new choice `index` that `finalize` makes under `seq_id`."""

    existing: Sequence | None
    seq_id: int
    index: int


@dataclass(frozen=True, slots=True)
class Admission:
    """A waiting request's choices that fit this micro-batch (a preempted request's may come
    back a few at a time)."""

    request: Request
    seqs: tuple[AdmittedSeq, ...]


@dataclass(frozen=True, slots=True)
class Proposal:
    """One micro-batch's plan before the KV service answered, in planning order.

    `seq_ids` are the sequence ids it uses (the planner's next ones: `finalize` takes them).
    `skips_kv`: nothing for the KV service this step, and the caller skips its round trip
    (`step_input` is then empty).
    """

    step_input: StepInput
    micro_batch_id: int | None
    seq_ids: range
    placeholders: tuple[Placeholder, ...] = ()
    chunks: tuple[Chunk, ...] = ()
    forks: tuple[PlannedFork, ...] = ()
    readmissions: tuple[Readmission, ...] = ()
    admissions: tuple[Admission, ...] = ()
    skips_kv: bool = False

    @property
    def has_work(self) -> bool:
        return self.micro_batch_id is not None


@dataclass
class ProposalDraft:
    """A proposal being built by `propose`'s phases: what is left of the budgets, the sequence
    ids used so far and what the KV service is asked. Lives for one `propose` call."""

    budget: int  # tokens left in the micro-batch
    seq_cap: int  # sequences the micro-batch may hold
    next_seq_id: int
    num_seqs: int = 0
    first_seq_id: int = field(init=False)
    appends: list[Append] = field(default_factory=list)
    new_sequences: list[NewSequence] = field(default_factory=list)
    kv_forks: list[Fork] = field(default_factory=list)
    placeholders: list[Placeholder] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    forks: list[PlannedFork] = field(default_factory=list)
    readmissions: list[Readmission] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first_seq_id = self.next_seq_id

    @property
    def is_full(self) -> bool:
        return self.budget <= 0 or self.num_seqs >= self.seq_cap

    @property
    def has_tokens(self) -> bool:
        """Whether the micro-batch computes anything (a deferred chunk sends no append)."""
        return bool(self.appends or self.new_sequences or self.placeholders or self.chunks)

    def take_seq_id(self) -> int:
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        return seq_id

    def spend(self, num_tokens: int, num_seqs: int) -> None:
        self.budget -= num_tokens
        self.num_seqs += num_seqs

    def proposal(self, step_input: StepInput, micro_batch_id: int | None, skips_kv: bool) -> Proposal:
        return Proposal(
            step_input,
            micro_batch_id,
            range(self.first_seq_id, self.next_seq_id),
            tuple(self.placeholders),
            tuple(self.chunks),
            tuple(self.forks),
            tuple(self.readmissions),
            tuple(self.admissions),
            skips_kv,
        )
