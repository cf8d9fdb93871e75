"""The planner: which tokens of which sequences go into the next micro-batch.

One plan is two halves around one KV-service round trip:

    proposal = planner.propose()            # decodes first, then prefill chunks, then admissions
    output = await kv.step(proposal.step_input)
    micro_batch = planner.finalize(proposal, output)

`propose` never changes the planner's state (the sequence and micro-batch ids it uses are the
next ones, which `finalize` takes); `finalize` applies the KV service's answers: allocated
sequences join the micro-batch, a decode that got no block preempts the lowest-ranked running
request by recompute (its blocks are freed in the next step, it waits again ahead of its
peers), a new request that got no block stays queued. Results come back
through `on_result` / `on_failure`. A sequence is in at most one micro-batch in flight, but for
asynchronous scheduling's placeholder decodes (its next step planned before this one's token is
known; `InFlight` bounds them).

State: the planner owns the ids and composes three pieces, each with its invariants and
`check_integrity`: `RunningSet` (running.py: the live requests, their ranks and lifecycle),
`InFlight` (in_flight.py: the micro-batches in flight, the sequences they hold, what the KV
service is still to hear of them) and `StageView` (stage_view.py: what the stages hold of
each sequence, what the next plan sends and releases).

Budgets: `max_num_batched_tokens` bounds each micro-batch; `max_num_seqs` bounds all running
sequences together; `microbatch_size` ("auto" or an int) caps sequences per micro-batch, with
"auto" spreading the running sequences evenly over the micro-batches in flight.

The features that cut across the phases sit behind small interfaces the phases call at named
points, each in its own module with its own tests: n > 1 forks (forks.py), async placeholder
decodes (placeholders.py: `PlaceholderPolicy`), speculative decoding (speculation_policy.py:
`SpeculationPolicy`; a new draft method touches only it), pooling (pooling.py), the LoRA
namespace (lora.py). Admissions (admissions.py) and a step's sampled tokens and their stops
(stops.py) are phases of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_svc.core import admissions, forks, pooling, stops
from scheduler_svc.core.admissions import Allocations
from scheduler_svc.core.exports import HeldExports
from scheduler_svc.core.in_flight import InFlight, MicroBatch, ScheduledSeq, check_kv_lead
from scheduler_svc.core.placeholders import PlaceholderPolicy
from scheduler_svc.core.planner_config import PlannerConfig
from scheduler_svc.core.proposal import Chunk, Proposal, ProposalDraft
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, RequestState, Sequence
from scheduler_svc.core.running import RunningSet
from scheduler_svc.core.speculation_policy import SpeculationPolicy
from scheduler_svc.core.stage_view import StageView
from services.kv_types import Allocated, Append, NoBlocks, StepInput, StepOutput
from services.pooling import Embedding
from services.step import TIER_LOAD, CachedSeq, NewSeq, PooledOutput, SampledToken, ScoredPrompt, StepPlan


@dataclass
class SeqUpdate:
    """New output of one sequence after a micro-batch: for streaming to the client."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list
    finished: bool


# one sequence's share of a micro-batch being built: (sequence, start, num_tokens, samples,
# the drafts its last tokens are)
SeqStep = tuple[Sequence, int, int, bool, tuple[int, ...]]


class Planner:
    """Plans micro-batches (`propose` -> KV -> `finalize`) and takes their results in; composes
    `RunningSet` (the live requests), `InFlight` (what is in flight, and what the KV service is
    to hear of it) and `StageView` (what the stages hold of each sequence). A sequence's KV
    is dropped in both of the latter at once (`RunningSet.drop_kv`)."""

    def __init__(self, config: PlannerConfig, queue: WaitingQueue) -> None:
        self.config = config
        self._flight = InFlight()  # what is in flight, and what the KV service is to hear
        # what the stages hold of each sequence (with several stages, the first does not
        # sample: plans carry the tokens it lacks, unless the last stage feeds it)
        self._stages = StageView(track_tokens=config.pipeline_parallel_size > 1)
        self._requests = RunningSet(queue, self._flight, self._stages)
        self.exports = HeldExports()  # P/D: finished prompts' KV held for a decode replica
        # its containers, shared (never rebound): the running set, live requests, decisions
        self.queue, self.running, self.requests = queue, self._requests.running, self._requests.requests
        self.decisions = self._requests.decisions  # for scheduler tracing; drained by the engine
        self._next_seq_id = 1
        self._next_mb_id = 1
        self.num_placeholder_steps = 0  # sequence-steps scheduled before their input was known
        # prompt tokens the KV service looked up in its prefix cache and found there, counted
        # as its answers come (the KV service's own totals, without asking it)
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._speculation = SpeculationPolicy(
            config.num_speculative_tokens,
            config.speculative_method,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.speculative_max_batch,
            config.max_model_len,
        )
        self.spec = self._speculation.stats  # speculative decoding's counters, as verify steps come back
        self._placeholders = PlaceholderPolicy(
            config.async_decode,
            config.pipeline_parallel_size,
            config.block_size,
            config.max_model_len,
            self._flight,
            self._speculation,
        )
        # tokens a micro-batch may hold now: the budget, or less after a step was late
        # (core/deadlines.py); under the budget, prompts are chunked whatever the setting
        self.step_token_cap = config.max_num_batched_tokens

    @property
    def feedback(self) -> bool:
        """Whether the last stage feeds the first its sampled tokens (`set_feedback`)."""
        return self._placeholders.feedback

    @property
    def num_preemptions(self) -> int:
        return self._requests.num_preemptions

    # --- requests in: the running set's (running.py) ---------------------------------------

    def add(self, request: Request) -> Request | None:
        """Queue a new request; returns the waiting one it displaced, if any (`RunningSet.add`)."""
        return self._requests.add(request)

    def abort(self, request_id: str, now: float = 0.0) -> Request | None:
        """Abort a live request (`RunningSet.abort`); None if unknown or ended."""
        return self._requests.abort(request_id, now)

    def finish_choice(self, request_id: str, index: int, now: float = 0.0) -> Request | None:
        """End one choice early; the request when that finished it (`RunningSet.finish_choice`)."""
        return self._requests.finish_choice(request_id, index, now)

    def release_export(self, request_id: str) -> bool:
        """End the hold on a finished request's KV (`core/exports.py`); False: none held."""
        seq = self.exports.release(request_id)
        if seq is not None:
            self._requests.drop_kv(seq)
        return seq is not None

    def expire_exports(self, now: float) -> None:
        for seq in self.exports.expired(now):
            self._requests.drop_kv(seq)

    @property
    def in_flight(self) -> dict[int, MicroBatch]:
        """micro_batch_id -> the micro-batch in flight (read-only: `finalize`, `on_result` and
        `on_failure` change it)."""
        return self._flight.micro_batches

    # --- planning ------------------------------------------------------------------------

    @property
    def has_pending_kv_work(self) -> bool:
        return self._flight.has_pending_reports

    def has_schedulable(self) -> bool:
        if len(self.queue):
            return True
        placeholders, flight = self._placeholders, self._flight
        may_place = placeholders.active
        return any(
            not s.is_finished and (not flight.is_busy(s.seq_id) or (may_place and placeholders.ready(s, self.running)))
            for r in self.running
            for s in r.sequences
        ) or forks.any_due(self.running, flight)

    def _seq_cap(self) -> int:
        if isinstance(self.config.microbatch_size, int):
            return self.config.microbatch_size
        # "auto": the running sequences spread evenly over the stages, so that each stage has a
        # micro-batch to work on; with one stage, no split (a second micro-batch in flight then
        # carries only what the first could not: splitting would just double per-step overhead)
        # (a request's choices not forked yet count: its fork must fit beside the others)
        live = sum(forks.reserved(r) for r in self.running) + len(self.queue)
        ways = min(self.config.max_in_flight, self.config.pipeline_parallel_size)
        return max(1, math.ceil(live / ways))

    def propose(self) -> Proposal:
        """Choose the next micro-batch's tokens and what to ask the KV service for them.

        Changes no state (the KV service's answer may not come, and the state may change while
        it answers): the sequence and micro-batch ids it uses are the next ones, which
        `finalize` takes. The order is the micro-batch's: decodes, placeholder decodes, prefill
        chunks of running sequences (rank order), forks, re-admissions, admissions; with
        several stages the placeholder decodes come last, so that a stage's next micro-batch is
        another group's work, not one that waits for this group's tokens.
        """
        draft = ProposalDraft(self.step_token_cap, self._seq_cap(), self._next_seq_id)
        placeholders = self._placeholders  # (with several stages they go last: `last`)
        self._propose_running(draft, prefill=False)
        if not placeholders.last:
            placeholders.propose(draft, self.running)
        self._propose_running(draft, prefill=True)
        forks.propose(draft, self.running, self._flight)
        namespace = self.config.namespace
        admissions.propose_readmissions(draft, self.running, self._flight, namespace)
        # a prompt is chunked whatever the setting under a cap that a late step set
        chunked = self.config.enable_chunked_prefill or self.step_token_cap < self.config.max_num_batched_tokens
        admissions.propose_admissions(draft, self.queue, self.running, self.config.max_num_seqs, chunked, namespace)
        if placeholders.last:
            placeholders.propose(draft, self.running, self._next_mb_id)
        mb_id = self._next_mb_id if draft.has_tokens else None
        flight = self._flight
        if not (
            draft.appends or draft.new_sequences or draft.kv_forks or flight.pending_frees or flight.pending_failed
        ) and (draft.has_tokens or not self.has_pending_kv_work):
            # decodes inside their blocks only: completions wait for the next call that is needed
            return draft.proposal(StepInput(), mb_id, skips_kv=True)
        step_input = StepInput(
            new_sequences=tuple(draft.new_sequences),
            appends=tuple(draft.appends),
            forks=tuple(draft.kv_forks),
            frees=tuple(flight.pending_frees),
            completed_micro_batch_ids=flight.completions_to_send(),
            failed_micro_batch_ids=tuple(flight.pending_failed),
            micro_batch_id=mb_id,
        )
        return draft.proposal(step_input, mb_id, skips_kv=False)

    def _propose_running(self, draft: ProposalDraft, prefill: bool) -> None:
        """Decodes (`prefill` False) or prefill chunks of running sequences that hold their KV
        and have no step in flight. An admitted sequence continues in chunks (only a recompute
        can need them when chunked prefill is off: a fresh prompt is admitted whole)."""
        block_size = self.config.block_size
        for request in self.running:
            for seq in request.sequences:
                if draft.is_full:
                    return
                if seq.is_finished or not seq.has_kv or self._flight.is_busy(seq.seq_id) or seq.is_prefill != prefill:
                    continue
                target = forks.target(seq)
                remaining = target - seq.num_computed
                if remaining <= 0:
                    continue
                n = min(remaining, draft.budget)
                start = seq.num_computed
                drafts = (
                    self._speculation.drafts(seq, draft.budget - 1, self.running)
                    if remaining == 1 and not prefill
                    else ()
                )
                # its blocks hold the step's positions (a verify step's drafts included) and
                # nothing past them: no KV round trip (never for a parent about to fork: its
                # children copy what the KV service knows of it)
                end = start + 1 + len(drafts)
                deferred = n == 1 and seq.num_blocks == -(-end // block_size) and target == seq.num_tokens
                if not deferred:  # the KV service catches up on every token it was not told yet
                    # (a verify step's drafts get slots held ahead; blocks held for rejected ones
                    # come back with the sequence's next call, which holds only what it needs)
                    draft.appends.append(
                        Append(seq.seq_id, seq.tokens(seq.kv_len, start + n), num_lookahead_slots=len(drafts))
                    )
                draft.chunks.append(Chunk(seq, start, n + len(drafts), deferred, drafts))
                draft.spend(n + len(drafts), 1)

    def finalize(self, proposal: Proposal, output: StepOutput, now: float = 0.0) -> MicroBatch | None:
        """Apply the KV service's answers; returns the micro-batch to dispatch, or None.

        Three phases: the allocations are applied (sequences that ended meanwhile give theirs
        back), the lowest-ranked requests are preempted for those that got no block, and the
        plan is built from what is left.
        """
        self._take_ids(proposal)
        self._flight.settle(proposal.step_input)  # the reports it carried were applied
        if proposal.micro_batch_id is None:
            return None
        self._count_prefix_lookups(proposal, output)
        scheduled, starving = self._apply_allocations(proposal, output, now)
        self._preempt_for_starving(starving, scheduled, now)
        return self._build_micro_batch(proposal.micro_batch_id, proposal, output, scheduled, now)

    def _take_ids(self, proposal: Proposal) -> None:
        """The ids the proposal used are taken (a proposal is finalized once, in order)."""
        mb_id = proposal.micro_batch_id
        if proposal.seq_ids.start != self._next_seq_id or mb_id not in (None, self._next_mb_id):
            raise RuntimeError("finalize: not the proposal made last (or finalized already)")
        self._next_seq_id = proposal.seq_ids.stop
        if mb_id is None:
            return
        self._next_mb_id += 1
        if not proposal.skips_kv:
            self._flight.kv_recorded(mb_id)

    def _count_prefix_lookups(self, proposal: Proposal, output: StepOutput) -> None:
        """Each new sequence the KV service gave blocks was looked up in its prefix cache
        (unless kept out of it), whether the planner keeps it or gives it back."""
        for new in proposal.step_input.new_sequences:
            result = output.results.get(new.seq_id)
            if isinstance(result, Allocated) and not new.skip_prefix_cache:
                self.num_prefix_query_tokens += len(new.token_ids)
                self.num_prefix_hit_tokens += result.num_computed_tokens
        # (blocks loaded from the KV tier count as its hits, as the KV service counts them)
        self.num_prefix_hit_tokens -= self.config.block_size * sum(op.kind == TIER_LOAD for op in output.tier_ops)

    # --- finalize, phase 1: the KV service's allocations ---------------------------------
    # An abort or a stop string may have ended sequences while the KV service answered: what
    # it allocated for them is given back (the completion guard keeps the step's completion
    # behind those frees), and they are not scheduled.

    def _apply_allocations(
        self, proposal: Proposal, output: StepOutput, now: float
    ) -> tuple[Allocations, list[Sequence]]:
        """Returns the allocated sequences (seq_id -> sequence and its slots) and those of the
        running sequences that got no block."""
        scheduled: Allocations = {}
        forked = forks.apply(proposal, self.running, self._flight)
        starving: list[Sequence] = []
        running = [c.seq for c in proposal.chunks if not c.deferred]
        for seq in running + [s for _, ch in forked for s in ch] + [p for p, _ in forked]:
            if not seq.has_kv or seq.is_finished or seq.request not in self.running:
                continue
            result = output.results.get(seq.seq_id)
            if isinstance(result, Allocated):
                scheduled[seq.seq_id] = (seq, result)
            elif isinstance(result, NoBlocks):
                # a decode or a prefill chunk: either way the lowest-ranked request (maybe this
                # one) gives its blocks back, or two half-prefilled requests could wait forever
                starving.append(seq)
        admissions.apply_readmissions(proposal, output, self._requests, self._flight, scheduled)
        admissions.apply_admissions(proposal, output, self._requests, self._flight, scheduled, now)
        self._placeholders.take_blocks(proposal, output)
        return scheduled, starving

    # --- finalize, phase 2: preemption ---------------------------------------------------

    def _preempt_for_starving(self, starving: list[Sequence], scheduled: Allocations, now: float) -> None:
        """Sequences that got no block: the lowest-ranked running request is preempted by
        recompute (its blocks are freed in the next step); it is not scheduled."""
        for seq in starving:
            if seq.request not in self.running:
                continue  # already preempted in this round
            victim = self._requests.pick_victim(exclude=seq.request, scheduled=scheduled)
            if victim is None:
                continue  # the victim is in flight: the starving sequence waits a round
            for s in victim.sequences:
                scheduled.pop(s.seq_id, None)
            self._requests.preempt(victim, now)

    # --- finalize, phase 3: the plan -----------------------------------------------------

    def _build_micro_batch(
        self, mb_id: int, proposal: Proposal, output: StepOutput, scheduled: Allocations, now: float
    ) -> MicroBatch | None:
        placeholders = self._placeholders.steps(proposal)
        discarded = (
            {k for k, r in output.results.items() if isinstance(r, Allocated)}
            - {seq.seq_id for seq, _ in scheduled.values()}
            - {seq.seq_id for seq, _ in placeholders}
        )
        self._flight.guard(mb_id, discarded)
        # (sequence, start, num_tokens, samples), in planning order: placeholder decodes, the
        # running sequences' decodes and chunks, then forks, re-admissions and admissions
        steps = [(seq, pos, 1, True, ()) for seq, pos in placeholders]
        self.num_placeholder_steps += len(placeholders)
        steps += self._allocated_steps(proposal, scheduled)
        records, new_seqs, cached_seqs = self._record_steps(steps, now)
        if not records:
            # the KV service holds this id in flight even with nothing written; a step whose KV
            # tier moves no stage will make is failed there instead (its keys forgotten)
            if output.tier_ops:
                self._flight.fail_at_kv(mb_id)
            else:
                self._flight.complete_at_kv(mb_id)
            return None
        released, release_all = self._stages.take_releases()
        plan = StepPlan(
            mb_id, tuple(new_seqs), tuple(cached_seqs), released, tuple(output.copies), release_all, output.tier_ops
        )
        mb = self._flight.dispatch(plan, records)
        self._requests.trace(
            "micro_batch",
            None,
            micro_batch_id=mb_id,
            num_tokens=mb.num_tokens,
            seqs=[[s.seq_id, s.start, s.num_tokens] for s in records],
        )
        return mb

    def _allocated_steps(self, proposal: Proposal, scheduled: Allocations) -> list[SeqStep]:
        """The running sequences' chunks still live, then the new sequences that got slots;
        each allocated one takes the block table and KV length the KV service gave it."""
        planned = {c.seq.seq_id: c for c in proposal.chunks}
        deferred = {c.seq.seq_id: c for c in proposal.chunks if c.deferred and c.seq.has_kv and not c.seq.is_finished}
        order = [i for i in planned if i in deferred or i in scheduled]
        order += [i for i in scheduled if i not in planned]
        steps: list[SeqStep] = []
        for seq_id in order:
            chunk = deferred.get(seq_id)
            drafts = planned[seq_id].drafts if seq_id in planned else ()
            if chunk is not None:  # its block holds the token: the table is unchanged
                seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            else:
                seq, result = scheduled[seq_id]
                # a sequence's own plan, or the KV service's for a new one (its prefix-cache hit)
                chunk = planned.get(seq_id)
                start, n = (
                    (chunk.start, chunk.num_tokens)
                    if chunk is not None
                    else (result.num_computed_tokens, result.num_new_tokens)
                )
                seq.kv_len = result.num_computed_tokens + result.num_new_tokens
                seq.num_computed = start  # a prefix hit: these tokens are already there
                seq.take_answer(result.block_offset, result.block_ids)
            end = start + n - len(drafts)  # (a verify step samples after its known tokens)
            # a pooling sequence never samples (so no placeholder step follows it): the step
            # that completes its prompt brings back its pooled vector instead
            samples = end == forks.target(seq) and end == seq.num_tokens and not pooling.never_samples(seq.request)
            steps.append((seq, start, n, samples, drafts))
        return steps

    def _record_steps(
        self, steps: list[SeqStep], now: float
    ) -> tuple[list[ScheduledSeq], list[NewSeq], list[CachedSeq]]:
        """Each step as the stages get it (whole, or what changed since the state they hold)
        and as the planner records it in flight."""
        records: list[ScheduledSeq] = []
        new_seqs: list[NewSeq] = []
        cached_seqs: list[CachedSeq] = []
        for seq, start, n, sample, drafts in steps:
            entry = self._stages.send(seq, start, n, drafts)
            if isinstance(entry, NewSeq):
                new_seqs.append(entry)
            else:
                cached_seqs.append(entry)
            records.append(self._flight.record(seq, start, n, sample, len(drafts)))
            if seq.request.first_scheduled_s is None:
                seq.request.first_scheduled_s = now
        return records, new_seqs, cached_seqs

    # --- results in ----------------------------------------------------------------------

    def on_result(
        self,
        mb_id: int,
        sampled: Iterable[SampledToken],
        now: float = 0.0,
        prompt_logprobs: Iterable[ScoredPrompt] = (),
        pooled: Iterable[PooledOutput] = (),
        proposals: Iterable[tuple[int, tuple[int, ...]]] = (),
    ) -> list[SeqUpdate]:
        """A micro-batch came back: computed tokens advance, sampled tokens append, finishes;
        scored prompt positions extend their request's prompt logprobs; a pooling request
        whose prompt is computed finishes with its vector; a draft model's proposals wait
        for their sequence's next step."""
        mb = self._flight.complete(mb_id)
        by_id: dict[int, list[tuple[int, object]]] = {}
        for s in sampled:
            by_id.setdefault(s.seq_id, []).append((s.token_id, s.logprobs))
        scored = {p.seq_id: (p.first_position, p.positions) for p in prompt_logprobs}
        vectors = {p.seq_id: p.embedding for p in pooled}
        offered = dict(proposals) if self._speculation.enabled else {}
        updates = []
        for s in mb.seqs:
            seq = s.seq
            request = seq.request
            if not request.state.is_live or not seq.has_kv or seq.is_finished or seq.seq_id != s.seq_id:
                continue  # aborted or preempted while in flight (and maybe re-admitted since)
            seq.num_computed = s.context_len
            if s.num_drafts:  # a verify step: it stands after the drafts it kept
                self._speculation.verified(seq, s, len(by_id.get(seq.seq_id, ())))
            first, positions = scored.get(seq.seq_id, (-1, ()))
            if positions and first == len(request.prompt_logprobs):
                request.prompt_logprobs.extend(positions)
            if pooling.never_samples(request):
                if pooling.is_pooled(seq):
                    updates.append(self._finish_pooled(seq, vectors.get(seq.seq_id), now))
                continue
            sampled_here = by_id.get(seq.seq_id, [])
            new_tokens, new_logprobs = stops.append_sampled(seq, sampled_here, self.config.max_model_len)
            if seq.seq_id in offered:
                self._speculation.offer(seq, offered[seq.seq_id])
            if new_tokens and request.state == RequestState.PREFILLING:
                request.transition(RequestState.DECODING, now)
            if seq.is_finished and HeldExports.wanted(request):
                self.exports.hold(seq, self.config.block_size, now)
            elif seq.is_finished:
                self._requests.drop_kv(seq)
            if new_tokens or seq.is_finished:
                updates.append(SeqUpdate(seq, new_tokens, new_logprobs, seq.is_finished))
            if request.all_finished and request.state == RequestState.DECODING:
                self._requests.retire(request, now)
        return updates

    def _finish_pooled(self, seq: Sequence, embedding: Embedding | None, now: float) -> SeqUpdate:
        """A pooling request's prompt came back computed: it finishes with its vector (STOP),
        or with ERROR when the last stage returned none (a bug), and frees its blocks."""
        pooling.take_vector(seq, embedding)
        self._requests.drop_kv(seq)
        self._requests.retire(seq.request, now)
        return SeqUpdate(seq, [], [], True)

    def on_failure(self, mb_id: int, now: float = 0.0) -> list[Request]:
        """A micro-batch failed on some stage: its requests are preempted (recomputed later)."""
        failed = self._flight.fail(mb_id)
        if failed is None:
            return []
        mb, doomed = failed
        hit: list[Request] = []
        for s in mb.seqs:
            request = s.seq.request
            if s.seq.seq_id != s.seq_id:
                continue  # already preempted and re-admitted: this entry is stale
            if request in self.running and request not in hit:
                hit.append(request)
        for request in hit:
            self._requests.preempt(request, now)
        # a later step in flight that computes one of these sequences (a placeholder step) was
        # planned on state the stages will not have: it fails too, and with it every request
        # in it, so they are preempted now (not counted as their failure)
        for s in doomed:
            request = s.seq.request
            if s.seq.seq_id == s.seq_id and request in self.running:
                self._requests.preempt(request, now)
        return hit

    def cap_step_tokens(self, cap: int) -> None:
        """Micro-batches hold at most `cap` tokens from the next plan on (at most the budget,
        at least one): a step that was late is never planned again at its size."""
        self.step_token_cap = max(1, min(int(cap), self.config.max_num_batched_tokens))

    def set_feedback(self, on: bool) -> None:
        """Whether the first of several stages gets sampled tokens from the last directly (set
        at each connection to the stages, before anything is planned on it): then plans carry
        no tokens and placeholder steps work at any pipeline size."""
        if self._flight.micro_batches or self._stages.holds_any:
            raise RuntimeError("set_feedback: only before the stages hold any state")
        several = self.config.pipeline_parallel_size > 1
        self._placeholders.feedback = on and several
        self._stages.track_tokens(several and not self.feedback)

    def reset_all(self, now: float = 0.0) -> list[Request]:
        """A stage or the KV service failed: everything running is preempted, KV state forgotten.

        The caller resets the KV service; results of micro-batches in flight are dropped.
        """
        self._flight.reset()
        self._stages.reset()
        self.exports.clear()
        hit = list(self.running)
        for request in hit:
            self._requests.preempt(request, now, free=False)
        return hit

    # --- helpers -------------------------------------------------------------------------

    # --- views ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self._requests.check_integrity()
        self._flight.check_integrity()
        self._stages.check_integrity()
        self.exports.check_integrity()
        self.queue.check_integrity()
        for request in self.running:
            for seq in request.sequences:
                if seq.has_kv and not seq.is_finished and seq.num_blocks:
                    record = self._flight.last_record.get(seq.seq_id)
                    end = record.context_len if record is not None and record.seq is seq else seq.num_computed
                    check_kv_lead(
                        seq,
                        end,
                        self._stages.on_stages.get(seq.seq_id),
                        self.config.block_size,
                        self._speculation.max_lookahead,
                    )
