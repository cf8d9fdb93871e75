"""What the planner has in flight, and what the KV service is still to hear of it.

A micro-batch is in flight from `Planner.finalize` until its result (`complete`) or its
failure (`fail`) comes back. The KV service records each step it allocated for; it must hear
how each one ended (a completion lets it cache the blocks the step wrote, a failure makes it
forget them), and the frees of the sequences the planner dropped. Those reports ride on the
next KV call (`pending_frees`, `completions_to_send`, `pending_failed`) and stay pending until
`settle` sees them applied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_svc.core.request import Sequence
from services.kv_types import StepInput
from services.step import StepPlan


@dataclass(slots=True)
class ScheduledSeq:
    """The planner's record of one sequence's share of a step in flight: tokens
    `start ... start + num_tokens - 1`, under the id it was scheduled with (a sequence
    re-admitted later gets another)."""

    seq: Sequence
    seq_id: int
    start: int
    num_tokens: int
    sample: bool
    num_drafts: int = 0  # a verify step: its last num_drafts tokens are drafts

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens


@dataclass
class MicroBatch:
    """A step in flight: the plan the stages were sent and the planner's record of it."""

    plan: StepPlan
    seqs: list[ScheduledSeq]

    @property
    def micro_batch_id(self) -> int:
        return self.plan.step_id

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class InFlight:
    """The micro-batches in flight, the sequences they hold, and the KV service's reports.

    The attributes are read by the planner; only these methods change them.

    Invariants (`check_integrity`):
    - `busy[seq_id]` is how many micro-batches in flight hold that sequence id: one, or two
      for a step and the placeholder step after it; a micro-batch holds an id once;
    - `last_record[seq_id]`, when present, is that id's record in the latest micro-batch in
      flight holding it (a placeholder step continues from it);
    - `kv_steps`, the steps the KV service recorded and has not heard the end of, are in
      flight; a step that ended is in `pending_completed` or `pending_failed` (not both,
      once) until the KV service applied that, and is no longer in flight;
    - `completion_guard[mb_id]`: sequences allocated in that step but left out of it (their
      slots were never written); its completion is not sent while one of them is still to
      be freed, or the KV service would cache blocks holding garbage.
    """

    def __init__(self) -> None:
        self.micro_batches: dict[int, MicroBatch] = {}
        self.busy: dict[int, int] = {}  # seq_id -> micro-batches in flight holding it
        self.last_record: dict[int, ScheduledSeq] = {}  # seq_id -> its latest step in flight
        self.kv_steps: set[int] = set()
        self.completion_guard: dict[int, set[int]] = {}
        self.pending_frees: list[int] = []
        self.pending_completed: list[int] = []
        self.pending_failed: list[int] = []

    def __repr__(self) -> str:  # all of it: tests compare snapshots of the planner
        return f"InFlight({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    # --- sequences in flight -------------------------------------------------------------

    def is_busy(self, seq_id: int) -> bool:
        return seq_id in self.busy

    def num_steps(self, seq_id: int) -> int:
        """How many micro-batches in flight hold this sequence id."""
        return self.busy.get(seq_id, 0)

    def sole_record(self, seq_id: int) -> ScheduledSeq | None:
        """The record of the one step in flight holding this id; None for none or two."""
        record = self.last_record.get(seq_id)
        if record is None or self.busy.get(seq_id) != 1:
            return None
        return record

    def record(self, seq: Sequence, start: int, num_tokens: int, sample: bool, num_drafts: int = 0) -> ScheduledSeq:
        """One sequence's share of the micro-batch being built (dispatched next)."""
        record = ScheduledSeq(seq, seq.seq_id, start, num_tokens, sample, num_drafts)
        self.busy[seq.seq_id] = self.busy.get(seq.seq_id, 0) + 1
        self.last_record[seq.seq_id] = record
        return record

    def dispatch(self, plan: StepPlan, records: list[ScheduledSeq]) -> MicroBatch:
        mb = MicroBatch(plan, records)
        self.micro_batches[plan.step_id] = mb
        return mb

    def complete(self, mb_id: int) -> MicroBatch:
        """A micro-batch came back (KeyError if it is not in flight): its sequences are free
        to be scheduled again, and the KV service is to hear of it."""
        mb = self.micro_batches.pop(mb_id)
        self.complete_at_kv(mb_id)
        for record in mb.seqs:
            self._release(record)
        return mb

    def fail(self, mb_id: int) -> tuple[MicroBatch, list[ScheduledSeq]] | None:
        """A micro-batch failed (None if it is not in flight): its sequences are free, and the
        KV service is to forget it. Also returns the records of the later micro-batches in
        flight that fail with it, in order: those that compute one of its sequences, or one
        of theirs (placeholder steps planned on state the stages will not have)."""
        mb = self.micro_batches.pop(mb_id, None)
        if mb is None:
            return None
        if mb_id in self.kv_steps:
            self.kv_steps.discard(mb_id)
            self.pending_failed.append(mb_id)
        for record in mb.seqs:
            self._release(record)
        doomed_ids = {s.seq_id for s in mb.seqs}
        doomed: list[ScheduledSeq] = []
        for later_id in sorted(i for i in self.micro_batches if i > mb_id):
            later = self.micro_batches[later_id]
            if doomed_ids & {s.seq_id for s in later.seqs}:
                doomed_ids |= {s.seq_id for s in later.seqs}
                doomed.extend(later.seqs)
        return mb, doomed

    def _release(self, record: ScheduledSeq) -> None:
        count = self.busy.get(record.seq_id, 0) - 1
        if count > 0:
            self.busy[record.seq_id] = count
        else:
            self.busy.pop(record.seq_id, None)
        if self.last_record.get(record.seq_id) is record:
            del self.last_record[record.seq_id]

    # --- what the KV service is to hear --------------------------------------------------

    @property
    def has_pending_reports(self) -> bool:
        return bool(self.pending_frees or self.pending_completed or self.pending_failed)

    def kv_recorded(self, mb_id: int) -> None:
        """The KV service recorded this step (it was asked for it)."""
        self.kv_steps.add(mb_id)

    def complete_at_kv(self, mb_id: int) -> None:
        """A step is done (or was dropped with nothing in it: the KV service holds its id in
        flight all the same): the KV service hears of it, if it recorded it."""
        if mb_id in self.kv_steps:
            self.kv_steps.discard(mb_id)
            self.pending_completed.append(mb_id)

    def fail_at_kv(self, mb_id: int) -> None:
        """A step dropped before it was sent, whose KV tier moves no stage will make: the KV
        service hears of it as failed (it forgets every key the step moved)."""
        if mb_id in self.kv_steps:
            self.kv_steps.discard(mb_id)
            self.pending_failed.append(mb_id)

    def free_at_kv(self, seq_ids: Iterable[int]) -> None:
        self.pending_frees.extend(seq_ids)

    def guard(self, mb_id: int, unwritten: set[int]) -> None:
        """Sequences allocated in step `mb_id` but left out of it: its completion waits for
        their frees."""
        if unwritten:
            self.completion_guard[mb_id] = unwritten

    def completions_to_send(self) -> tuple[int, ...]:
        """Completed steps the KV service may hear of now: not one whose unwritten sequences
        are still to be freed."""
        frees = set(self.pending_frees)
        return tuple(
            m for m in self.pending_completed if not (self.completion_guard.get(m) and self.completion_guard[m] & frees)
        )

    def settle(self, step: StepInput) -> None:
        """The frees, completions and failures the KV service applied are no longer pending."""
        applied_frees = set(step.frees)
        self.pending_frees = [s for s in self.pending_frees if s not in applied_frees]
        self.pending_completed = [m for m in self.pending_completed if m not in step.completed_micro_batch_ids]
        for m in step.completed_micro_batch_ids:
            self.completion_guard.pop(m, None)
        self.pending_failed = [m for m in self.pending_failed if m not in step.failed_micro_batch_ids]

    def reset(self) -> None:
        """Everything is forgotten: the KV service and the stages are reset."""
        self.micro_batches.clear()
        self.busy.clear()
        self.last_record.clear()
        self.kv_steps.clear()
        self.completion_guard.clear()
        self.pending_frees.clear()
        self.pending_completed.clear()
        self.pending_failed.clear()

    def check_integrity(self) -> None:
        busy: dict[int, int] = {}
        latest: dict[int, ScheduledSeq] = {}
        for mb_id, mb in self.micro_batches.items():
            assert mb.micro_batch_id == mb_id, (mb.micro_batch_id, mb_id)
            ids = [s.seq_id for s in mb.seqs]
            assert len(ids) == len(set(ids)), (mb_id, ids)
            for s in mb.seqs:
                busy[s.seq_id] = busy.get(s.seq_id, 0) + 1
                latest[s.seq_id] = s
        assert busy == self.busy, (busy, self.busy)
        assert all(count <= 2 for count in busy.values()), busy
        for seq_id, record in self.last_record.items():
            assert latest.get(seq_id) is record, (seq_id, record)
        assert self.kv_steps <= self.micro_batches.keys(), (self.kv_steps, sorted(self.micro_batches))
        ended = self.pending_completed + self.pending_failed
        assert len(ended) == len(set(ended)), ended
        assert not set(ended) & self.micro_batches.keys(), (ended, sorted(self.micro_batches))


def check_kv_lead(seq: Sequence, scheduled_end: int, held: int | None, block_size: int, lookahead: int = 1) -> None:
    """How far the scheduler may run ahead of the KV service (deferred decodes and lookahead
    slots, docs/step-protocol.md "KV bookkeeping"), checked for one live sequence between plans.

    `seq.kv_len` tokens were told to the KV service and `seq.num_blocks` is the length of its
    last answer; `scheduled_end` is where the sequence's latest step (in flight or returned)
    ends; `held` is how many blocks the stages hold of it (None: not sent yet) and
    `seq.unsent_blocks` the answers they were not sent.

    - the KV service is told only tokens that were scheduled: `kv_len <= scheduled_end`;
    - every scheduled token has a slot (a deferred decode or placeholder step goes only where
      the table has room): `scheduled_end <= num_blocks * block_size`;
    - the KV service holds at most `lookahead` slots beyond the tokens it was told (a
      placeholder step's lookahead block: 1; a verify step's drafts: up to
      num_speculative_tokens), and covers those: `ceil(kv_len / bs) <= num_blocks <=
      ceil((kv_len + lookahead) / bs)`; so the deferred tokens all lie in the last block;
    - the stages hold that table (nothing unsent), or all of it but a held-ahead block whose
      placeholder step was dropped (its step before returned during the KV call): the unsent
      diff is that block, sent with the next step.
    (A forked choice not allocated yet has no table here: it shares its parent's there.)
    """
    kv_len, num_blocks, unsent = seq.kv_len, seq.num_blocks, seq.unsent_blocks
    where = f"sequence {seq.seq_id}: kv_len {kv_len}, scheduled to {scheduled_end}, {num_blocks} blocks"
    assert kv_len <= scheduled_end <= num_blocks * block_size, where
    assert -(-kv_len // block_size) <= num_blocks <= -(-(kv_len + lookahead) // block_size), where
    assert (
        held is None
        or (held == num_blocks and unsent is None)
        or (
            held == num_blocks - 1
            and kv_len == held * block_size
            and unsent is not None
            and unsent[0] == held
            and len(unsent[1]) == 1
        )
    ), (where, held, unsent)
