"""Asynchronous scheduling in the planner: placeholder decodes, steps that compute a sequence's
next token before it is known (vLLM's async scheduling: step k+1 is planned while step k
runs, and the stage feeds itself, or the last stage the first, the token it sampled).

The planner asks at named points and knows nothing else of placeholder steps:

    policy.active                                 may any sequence have one now
    policy.ready(seq, running)                    may this one (its one step in flight samples)
    policy.last                                   they go after every other kind of work
    policy.propose(draft, running)                propose: the placeholder decodes
    policy.take_blocks(proposal, output)          finalize: the blocks they asked for ahead
    policy.steps(proposal)                        finalize: those still to go, and where

A sequence has at most two steps in flight: one, and the placeholder step after it
(`InFlight` bounds them); a sequence that ended at step k wastes at most one step.
"""

from __future__ import annotations

from scheduler_svc.core import forks
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.proposal import Placeholder, Proposal, ProposalDraft
from scheduler_svc.core.request import Request, Sequence
from scheduler_svc.core.speculation_policy import SpeculationPolicy
from services.kv_types import Allocated, Append, StepOutput


class PlaceholderPolicy:
    """When and where placeholder decodes go. `feedback`: the last of several stages feeds the
    first its sampled tokens (without it, the first would need the token in the plan: no
    placeholder steps at several stages). Reads the steps in flight; changes only `feedback`."""

    def __init__(
        self,
        enabled: bool,
        pipeline_parallel_size: int,
        block_size: int,
        max_model_len: int,
        flight: InFlight,
        speculation: SpeculationPolicy,
    ) -> None:
        self.enabled = enabled
        self.pipeline_parallel_size = pipeline_parallel_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.feedback = False
        self._flight = flight
        self._speculation = speculation

    @property
    def last(self) -> bool:
        """With several stages a placeholder step goes after every other kind of work: its
        group's step before it must travel the whole pipeline first, so a stage-0 queue of one
        group's two steps back to back idles the pipeline while the next group waits behind."""
        return self.pipeline_parallel_size > 1

    @property
    def active(self) -> bool:
        """Whether any sequence may have a placeholder step now: the part of `ready`'s question
        that is the same for every sequence, asked once a pass."""
        return self.enabled and (self.pipeline_parallel_size == 1 or self.feedback)

    def ready(self, seq: Sequence, running: list[Request]) -> bool:
        """Once `active` holds: whether a step may compute this sequence's next token before
        it is known: its one step in flight samples that token, the token fits the blocks it
        has or starts the next one (which the KV service then holds ahead for it), and that
        step cannot be its last by length (a stop token is not foreseen: then one step is
        wasted and its token never emitted), nor should it rather verify drafts. The step in
        flight is looked up first: most sequences in flight have none or two (the
        placeholder step planned already)."""
        record = self._flight.sole_record(seq.seq_id)
        if record is None or not record.sample or seq.is_finished or not seq.has_kv:
            return False
        pos = record.context_len
        return (
            pos == seq.num_tokens
            and pos <= seq.num_blocks * self.block_size
            and len(seq.output) + 1 < seq.request.options.max_tokens
            and pos + 1 < self.max_model_len
            and forks.target(seq) == seq.num_tokens
            and not self._speculation.waits_for_drafts(seq, running)
        )

    def propose(self, draft: ProposalDraft, running: list[Request], micro_batch_id: int = 0) -> None:
        """Decodes of sequences whose one step in flight samples the token this one computes.

        With several stages, in the order their tokens come back (the oldest step in flight
        first, rank order within it): a micro-batch then continues one step in flight, not
        rows of two, so the groups keep their shape round the pipeline. Taken by rank alone,
        a step's rows would mix groups and wait for the latest of them: stage 0 then idles
        a whole trip down the pipeline for the step just sent (seen on the emulated A100 at
        PP=2: one micro-batch computing at a time).

        Stage 0 reaches this micro-batch (`micro_batch_id`, the next) once it has computed
        the ones before it; a row continuing step M has its token back by then only when M is
        at least a pipeline's length of micro-batches before it. So a row of a later step than
        the rows taken (any row, when the micro-batch holds other work already) goes only when
        it is that far back: the micro-batch stays smaller rather than wait at stage 0 for a
        step just sent (seen on the emulated A100 at PP=4: groups mixed as requests came and
        went, stage 0 idle ~6 ms a round, 77% busy)."""
        if draft.is_full or not self.active:
            return  # (checked first: with several stages the draft is often full by now)
        candidates = [seq for request in running for seq in request.sequences if self.ready(seq, running)]
        micro_batches = self._flight.micro_batches
        step_of: dict[int, int] | None = None
        if self.pipeline_parallel_size > 1 and len(micro_batches) > 1:
            step_of = {r.seq_id: mb_id for mb_id, mb in micro_batches.items() for r in mb.seqs}
            candidates.sort(key=lambda seq: step_of[seq.seq_id])  # stable: rank order within a step
        waits_for = None if not draft.has_tokens else -1  # the latest step a row continues
        for seq in candidates:
            if draft.is_full:
                return
            if step_of is not None and micro_batch_id:
                step = step_of[seq.seq_id]
                if waits_for is not None and step > waits_for:
                    if micro_batch_id - step < self.pipeline_parallel_size:
                        return  # (sorted: the rest continue later steps still)
                waits_for = step if waits_for is None else max(waits_for, step)
            grows = seq.num_tokens == seq.num_blocks * self.block_size
            if grows:
                # its token starts a block: the KV service allocates it now, ahead of the
                # token (told later, with the tokens it was not told yet)
                draft.appends.append(Append(seq.seq_id, seq.tokens(seq.kv_len, seq.num_tokens), num_lookahead_slots=1))
            draft.placeholders.append(Placeholder(seq, seq.num_tokens, grows))
            draft.spend(1, 1)

    def take_blocks(self, proposal: Proposal, output: StepOutput) -> None:
        """The block each growing placeholder step asked for ahead joins its sequence's table
        (if the sequence is still live: one that ended gives it back with its others)."""
        for p in proposal.placeholders:
            if not p.grows:
                continue
            result = output.results.get(p.seq.seq_id)
            if isinstance(result, Allocated) and p.seq.has_kv and not p.seq.is_finished:
                p.seq.take_answer(result.block_offset, result.block_ids)
                p.seq.kv_len = result.num_computed_tokens + result.num_new_tokens

    def steps(self, proposal: Proposal) -> list[tuple[Sequence, int]]:
        """(sequence, position) of the placeholder steps that go: the sequence is still live,
        its step before is still in flight, and its table has the slot (no block: later)."""
        limit = self.block_size
        flight = self._flight
        return [
            (p.seq, p.position)
            for p in proposal.placeholders
            if p.seq.has_kv
            and not p.seq.is_finished
            and flight.num_steps(p.seq.seq_id) == 1
            and p.position < p.seq.num_blocks * limit
        ]
