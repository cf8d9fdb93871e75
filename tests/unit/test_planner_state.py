"""The planner's two pieces of state: `InFlight` (what is in flight and what the KV service is to
hear of it) and `StageView` (what the stages hold of each sequence), alone and composed.

Every operation is followed by the piece's `check_integrity`."""

from __future__ import annotations

import random

import pytest

from kvcache_svc.core import KVCacheManager
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.planner import Planner, PlannerConfig
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, SamplingOptions, Sequence
from scheduler_svc.core.stage_view import StageView
from services.kv_types import StepInput, StepOutput
from services.step import CachedSeq, NewSeq, SampledToken, StepPlan


def _seq(seq_id: int, prompt=(5, 6, 7), block_table=(), **options) -> Sequence:
    """A sequence the KV service answered `block_table` for (its first answer: whole)."""
    request = Request(f"r{seq_id}", tuple(prompt), SamplingOptions(**options), arrival_s=0.0)
    seq = Sequence(seq_id, request, 0, entropy_seed=0)
    if block_table:
        seq.take_answer(0, tuple(block_table))
    request.sequences.append(seq)
    return seq


def _dispatch(flight: InFlight, mb_id: int, *seqs: Sequence, kv: bool = True):
    records = [flight.record(s, 0, 1, True) for s in seqs]
    if kv:
        flight.kv_recorded(mb_id)
    mb = flight.dispatch(StepPlan(mb_id), records)
    flight.check_integrity()
    return mb


# --- InFlight ------------------------------------------------------------------------------


def test_a_sequence_is_busy_until_its_last_step_returns():
    flight = InFlight()
    a = _seq(1)
    first = _dispatch(flight, 1, a)
    assert flight.sole_record(1) is first.seqs[0]
    second = _dispatch(flight, 2, a)  # a placeholder step after it
    assert flight.num_steps(1) == 2 and flight.sole_record(1) is None
    assert flight.complete(1) is first
    flight.check_integrity()
    assert flight.num_steps(1) == 1 and flight.sole_record(1) is second.seqs[0]
    flight.complete(2)
    flight.check_integrity()
    assert not flight.is_busy(1) and not flight.micro_batches
    assert flight.pending_completed == [1, 2]


def test_completing_a_step_that_is_not_in_flight_raises():
    with pytest.raises(KeyError):
        InFlight().complete(3)


def test_a_failure_dooms_the_later_steps_that_compute_its_sequences():
    flight = InFlight()
    a, b, c, d, e = (_seq(i) for i in range(1, 6))
    _dispatch(flight, 1, a, b)
    second = _dispatch(flight, 2, b, c)  # shares b
    third = _dispatch(flight, 3, c, d)  # shares c, which fails with the second
    _dispatch(flight, 4, e)  # shares nothing
    mb, doomed = flight.fail(1)
    flight.check_integrity()
    assert mb.micro_batch_id == 1
    assert doomed == second.seqs + third.seqs
    assert flight.pending_failed == [1] and 1 not in flight.kv_steps
    assert sorted(flight.micro_batches) == [2, 3, 4]  # they fail when their own news comes
    assert flight.fail(1) is None


def test_a_step_the_kv_service_never_recorded_is_not_reported():
    flight = InFlight()
    _dispatch(flight, 1, _seq(1), kv=False)
    flight.complete(1)
    flight.check_integrity()
    assert not flight.has_pending_reports


def test_a_completion_waits_for_the_frees_of_the_sequences_its_step_left_unwritten():
    flight = InFlight()
    _dispatch(flight, 1, _seq(1))
    flight.guard(1, {7})
    flight.free_at_kv([7])
    flight.complete(1)
    flight.check_integrity()
    assert flight.completions_to_send() == ()  # the KV service would cache garbage in 7's blocks
    flight.settle(StepInput(frees=(7,)))
    assert flight.pending_frees == [] and flight.completions_to_send() == (1,)
    flight.settle(StepInput(completed_micro_batch_ids=(1,)))
    flight.check_integrity()
    assert not flight.has_pending_reports and not flight.completion_guard


def test_nothing_unwritten_sets_no_guard():
    flight = InFlight()
    flight.guard(1, set())
    assert not flight.completion_guard


def test_reset_forgets_everything_in_flight():
    flight = InFlight()
    _dispatch(flight, 1, _seq(1))
    flight.free_at_kv([3])
    flight.guard(1, {3})
    flight.reset()
    flight.check_integrity()
    assert repr(flight) == repr(InFlight())


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda f: f.busy.__setitem__(1, 2),  # a count that no micro-batch backs
        lambda f: f.busy.pop(1),
        lambda f: f.kv_steps.add(9),  # a recorded step not in flight
        lambda f: f.pending_completed.append(1),  # a step both in flight and ended
        lambda f: f.last_record.__setitem__(1, f.record(_seq(1), 5, 1, True)),  # a record never dispatched
    ],
)
def test_in_flight_integrity_check_catches(corrupt):
    flight = InFlight()
    _dispatch(flight, 1, _seq(1))
    corrupt(flight)
    with pytest.raises(AssertionError):
        flight.check_integrity()


# --- StageView -----------------------------------------------------------------------------


def test_a_sequence_goes_whole_once_then_as_what_changed():
    stages = StageView(track_tokens=False)
    seq = _seq(1, prompt=(5, 6, 7, 8, 9), block_table=(10, 11))
    entry = stages.send(seq, 0, 5)
    assert stages.take_releases() == ((), True)  # the plan it goes in resets the stages first
    stages.check_integrity()
    assert isinstance(entry, NewSeq) and entry.block_ids == (10, 11) and entry.token_ids == (5, 6, 7, 8, 9)
    seq.take_answer(2, (12,))  # a block appended: table (10, 11, 12)
    assert stages.send(seq, 5, 1) == CachedSeq(1, 1, 2, (12,))
    seq.take_answer(1, (13, 12))  # a block replaced (copy on write): (10, 13, 12), resent from there
    assert stages.send(seq, 6, 1) == CachedSeq(1, 1, 1, (13, 12))
    assert stages.send(seq, 7, 1) == CachedSeq(1, 1, 3, ())  # unchanged
    assert stages.on_stages == {1: 3}
    stages.check_integrity()


def test_answers_the_stages_were_not_sent_go_as_one_diff():
    stages = StageView(track_tokens=False)
    seq = _seq(1, prompt=(5, 6, 7, 8, 9), block_table=(10, 11))
    stages.send(seq, 0, 5)
    seq.take_answer(2, (12,))  # held ahead for a step that was then dropped
    seq.take_answer(3, (14,))  # the next block
    assert stages.send(seq, 5, 1) == CachedSeq(1, 1, 2, (12, 14))
    seq.take_answer(4, (15,))
    seq.take_answer(2, (16, 17, 15))  # a block the stages were never sent is replaced too
    assert stages.send(seq, 6, 1) == CachedSeq(1, 1, 2, (16, 17, 15))
    seq.take_answer(5, ())  # nothing changed
    assert seq.unsent_blocks is None and stages.send(seq, 7, 1) == CachedSeq(1, 1, 5, ())
    with pytest.raises(ValueError):
        seq.take_answer(6, (18,))  # keeps more than its table holds


def test_a_first_stage_that_does_not_sample_is_sent_the_tokens_it_lacks():
    stages = StageView(track_tokens=True)
    seq = _seq(1, prompt=(5, 6, 7), block_table=(10,))
    stages.send(seq, 0, 3)
    stages.take_releases()
    seq.output += [40, 41]
    assert stages.send(seq, 3, 1).new_token_ids == (40, 41)
    assert stages.send(seq, 4, 1).new_token_ids == ()
    stages.check_integrity()
    assert stages.stage_tokens == {1: 5}


def test_releases_go_out_with_the_next_plan_and_the_first_plan_resets():
    stages = StageView(track_tokens=True)
    stages.check_integrity()
    stages.send(_seq(1, block_table=(10,)), 0, 3)
    stages.send(_seq(2, block_table=(11,)), 0, 3)
    assert stages.take_releases() == ((), True)  # the stages may hold an earlier scheduler's state
    stages.check_integrity()
    stages.release(1)
    stages.check_integrity()
    assert stages.take_releases() == ((1,), False)
    assert set(stages.on_stages) == set(stages.stage_tokens) == {2}
    assert stages.take_releases() == ((), False)
    stages.reset()
    stages.check_integrity()
    assert not stages.holds_any and stages.take_releases() == ((), True)


def test_token_tracking_changes_only_while_nothing_is_held():
    stages = StageView(track_tokens=True)
    stages.track_tokens(False)
    assert stages.stage_tokens is None
    stages.send(_seq(1, block_table=(10,)), 0, 3)
    with pytest.raises(RuntimeError):
        stages.track_tokens(True)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda s: s.stage_tokens.pop(1),  # a held sequence whose tokens are not tracked
        lambda s: setattr(s, "release_all", True),  # a reset pending while the stages hold state
        lambda s: s.pending_released.extend([4, 4]),  # one sequence released twice
    ],
)
def test_stage_view_integrity_check_catches(corrupt):
    stages = StageView(track_tokens=True)
    stages.send(_seq(1, block_table=(10,)), 0, 3)
    stages.take_releases()
    stages.check_integrity()
    corrupt(stages)
    with pytest.raises(AssertionError):
        stages.check_integrity()


# --- the planner composing them ------------------------------------------------------------


def _planner(**cfg) -> tuple[Planner, KVCacheManager]:
    return Planner(PlannerConfig(block_size=4, **cfg), WaitingQueue()), KVCacheManager(64, 4)


def _plan(planner: Planner, kv: KVCacheManager, now: float = 0.0):
    proposal = planner.propose()
    output = StepOutput({}, ()) if proposal.skips_kv else kv.step(proposal.step_input)
    mb = planner.finalize(proposal, output, now)
    planner.check_integrity()
    return proposal, mb


def test_a_dropped_sequence_is_freed_at_the_kv_service_and_released_on_the_stages():
    planner, kv = _planner()
    planner.add(Request("a", (5, 6, 7), SamplingOptions(max_tokens=4), arrival_s=0.0))
    planner.add(Request("b", (8, 9), SamplingOptions(max_tokens=4), arrival_s=0.0))
    _, mb = _plan(planner, kv)
    planner.on_result(mb.micro_batch_id, [SampledToken(s.seq_id, 20) for s in mb.seqs])
    seq_id = planner.requests["a"].sequences[0].seq_id
    planner.abort("a")
    planner.check_integrity()
    proposal, mb = _plan(planner, kv)
    assert seq_id in proposal.step_input.frees
    assert mb.plan.finished_seq_ids == (seq_id,)
    assert not mb.plan.reset  # only the first plan resets the stages


def test_reset_all_forgets_what_is_in_flight_and_what_the_stages_hold():
    planner, kv = _planner(pipeline_parallel_size=2, max_in_flight=2)
    planner.add(Request("a", (5, 6, 7), SamplingOptions(max_tokens=4), arrival_s=0.0))
    _, mb = _plan(planner, kv)
    assert planner.in_flight and planner._stages.holds_any
    with pytest.raises(RuntimeError):
        planner.set_feedback(True)  # the stages hold state planned without feedback
    assert planner.reset_all() == [planner.requests["a"]]
    planner.check_integrity()
    assert not planner.in_flight and not planner.has_pending_kv_work and not planner._stages.holds_any
    planner.set_feedback(True)
    assert planner.feedback and planner._stages.stage_tokens is None
    kv.reset()
    _, mb = _plan(planner, kv)
    assert mb.plan.reset and [n.seq_id for n in mb.plan.new_seqs] == [s.seq_id for s in mb.seqs]


@pytest.mark.parametrize("seed", range(6))
def test_both_pieces_hold_their_invariants_through_failures_and_resets(seed):
    rng = random.Random(seed)
    pp = 1 + seed % 2
    planner, kv = _planner(
        max_num_batched_tokens=16, max_num_seqs=4, max_in_flight=3, pipeline_parallel_size=pp, async_decode=True
    )
    if pp > 1 and seed % 4 == 1:
        planner.set_feedback(True)
    for i in range(10):
        prompt = tuple(rng.randrange(5, 500) for _ in range(rng.randint(1, 12)))
        planner.add(
            Request(
                f"r{i}", prompt, SamplingOptions(n=rng.choice([1, 2]), max_tokens=rng.randint(1, 6)), arrival_s=float(i)
            )
        )
    fifo = []
    for step in range(300):
        if not planner.requests and not planner.has_pending_kv_work and not fifo:
            break
        while len(planner.in_flight) < 3:
            _, mb = _plan(planner, kv, float(step))
            if mb is None:
                break
            fifo.append(mb)
        roll = rng.random()
        if roll < 0.03:
            planner.reset_all(float(step))
            kv.reset()
            fifo.clear()
        elif fifo and roll < 0.12:
            planner.on_failure(fifo.pop(0).micro_batch_id, float(step))
        elif fifo:
            mb = fifo.pop(0)
            if mb.micro_batch_id in planner.in_flight:
                sampled = [SampledToken(s.seq_id, rng.randrange(5, 500)) for s in mb.seqs if s.sample]
                planner.on_result(mb.micro_batch_id, sampled, float(step))
        planner.check_integrity()
        kv.check_integrity()
    assert not planner.requests and not planner.in_flight


# --- how far the scheduler runs ahead of the KV service -------------------------------------


def test_the_kv_lead_check_allows_deferred_decodes_and_one_lookahead_block():
    from scheduler_svc.core.in_flight import check_kv_lead

    seq = _seq(1, prompt=(5, 6, 7, 8, 9), block_table=(10, 11))
    seq.take_unsent_blocks()  # the stages hold (10, 11)
    seq.kv_len = 5
    check_kv_lead(seq, 5, 2, 4)  # as told
    check_kv_lead(seq, 8, 2, 4)  # three deferred decodes fill the last block
    seq.kv_len = 8
    seq.take_answer(2, (12,))  # a placeholder step's block held ahead: (10, 11, 12)
    check_kv_lead(seq, 8, 2, 4)  # its placeholder step was dropped: sent later
    seq.take_unsent_blocks()
    check_kv_lead(seq, 9, 3, 4)


@pytest.mark.parametrize(
    "kv_len, end, table, held, unsent",
    [
        (6, 5, (10, 11), 2, None),  # the KV service told a token never scheduled
        (5, 9, (10, 11), 2, None),  # a deferred decode beyond the table
        (4, 4, (10, 11, 12), 3, None),  # more than one slot held ahead
        (5, 5, (10,), 1, None),  # the table does not cover what the KV service was told
        (5, 5, (10, 11), 2, (1, (11,))),  # the stages hold another table
        (5, 5, (10, 11), 1, (1, (11,))),  # the stages miss a block with tokens
        (5, 5, (10, 11), 1, None),  # the stages miss a block nobody will send them
    ],
)
def test_the_kv_lead_check_catches(kv_len, end, table, held, unsent):
    from scheduler_svc.core.in_flight import check_kv_lead

    seq = _seq(1, prompt=(5, 6, 7, 8, 9), block_table=table)
    seq.kv_len, seq.unsent_blocks = kv_len, unsent
    with pytest.raises(AssertionError):
        check_kv_lead(seq, end, held, 4)


def test_a_block_held_ahead_for_a_dropped_placeholder_step_goes_with_the_next_step():
    """The step before returns while the KV service holds a block ahead for the placeholder
    step after it: that step is dropped, and the stages get the block with the next step."""
    kv = KVCacheManager(16, 4)
    planner = Planner(PlannerConfig(block_size=4, async_decode=True, max_in_flight=2), WaitingQueue("fcfs"))
    planner.add(Request("r", (5, 6, 7, 8), SamplingOptions(max_tokens=5), 0.0))
    prefill = planner.finalize(proposal := planner.propose(), kv.step(proposal.step_input))
    ahead = planner.propose()  # a placeholder decode whose token starts block 2
    assert ahead.step_input.appends[0].num_lookahead_slots == 1
    output = kv.step(ahead.step_input)
    planner.on_result(prefill.micro_batch_id, [SampledToken(prefill.seqs[0].seq_id, 9)])
    assert planner.finalize(ahead, output) is None  # dropped: its token is known now
    planner.check_integrity()
    (seq,) = planner.running[0].sequences
    table = kv.block_table(seq.seq_id)
    assert seq.num_blocks == len(table) == 2 and planner._stages.on_stages[seq.seq_id] == 1
    decode = planner.propose()
    assert decode.skips_kv  # deferred: the held block has room
    mb = planner.finalize(decode, StepOutput(results={}, copies=()))
    planner.check_integrity()
    assert mb.plan.cached_seqs == (CachedSeq(seq.seq_id, 1, 1, table[1:]),)


def test_a_placeholder_row_makes_its_micro_batch_wait_no_longer_than_it_must():
    """(issue 37) With several stages a micro-batch reaches stage 0 once the ones before it
    are computed there; a row continuing step M has its token back by then only when M is a
    pipeline's length of micro-batches back. So the rows of a micro-batch continue the oldest
    step it takes from, or steps that far back: one row of a step just sent (groups mixed as
    requests come and go) made the whole micro-batch wait at stage 0 a trip down the
    pipeline (the emulated A100 at PP=4: stage 0 idle ~6 ms a round)."""
    pp, rng = 4, random.Random(5)
    planner, kv = _planner(
        max_num_batched_tokens=64, max_num_seqs=16, max_in_flight=2 * pp, pipeline_parallel_size=pp, async_decode=True
    )
    planner.set_feedback(True)

    def add(i: int, now: float) -> None:
        prompt = tuple(rng.randrange(5, 500) for _ in range(rng.randint(2, 8)))
        planner.add(Request(f"r{i}", prompt, SamplingOptions(max_tokens=rng.randint(4, 16)), arrival_s=now))

    for i in range(6):
        add(i, 0.0)
    fifo, checked, added = [], 0, 6
    for step in range(3000):
        if not planner.requests and not planner.has_pending_kv_work and not fifo:
            break
        while len(planner.in_flight) < 2 * pp:
            latest = {r.seq_id: mb_id for mb_id, mb in sorted(planner.in_flight.items()) for r in mb.seqs}
            _, mb = _plan(planner, kv, float(step))
            if mb is None:
                break
            n = mb.micro_batch_id
            continued = sorted(latest[s.seq_id] for s in mb.seqs if s.seq_id in latest)
            if continued:
                first, others = continued[0], len(mb.seqs) - len(continued)
                assert all(n - m >= pp for m in continued if m > first), (n, continued)
                assert not others or n - first >= pp, (n, continued, others)
                checked += 1
            fifo.append(mb)
        if fifo:
            mb = fifo.pop(0)  # results in order, as from the last stage
            sampled = [SampledToken(s.seq_id, rng.randrange(5, 500)) for s in mb.seqs if s.sample]
            planner.on_result(mb.micro_batch_id, sampled)
        if added < 14 and rng.random() < 0.1:  # requests come and go
            add(added, float(step))
            added += 1
        planner.check_integrity()
    assert not planner.requests and not planner.in_flight
    assert checked > 30 and planner.num_placeholder_steps > 30
