"""The first stage's feedback inbox (worker_svc/service/feedback.py): a step waits until every token
it computes is known, and gives up with a reason when they will not come; the inbox's invariants
hold through it all (`check_integrity`). Runs on a real `PersistentBatch`; the step waits on a
thread of its own, as on the stage's step thread."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from test_feedback_batch import held

from services.pb import worker_pb2
from services.step import CachedSeq, StepPlan
from worker_svc.service.feedback import FeedbackInbox

STEP = StepPlan(2, cached_seqs=(CachedSeq(1, 1, 2),))  # position 3: sampled by step 1


def fed(*triples) -> worker_pb2.SampledFeedback:
    fb = worker_pb2.SampledFeedback(micro_batch_id=1)
    for seq_id, position, token in triples:
        fb.seq_ids.append(seq_id)
        fb.positions.append(position)
        fb.token_ids.append(token)
    return fb


def waiting(pool, inbox, batch):
    """`wait_inputs` on the pool's thread, checked to be waiting."""
    future = pool.submit(inbox.wait_inputs, STEP, batch)
    time.sleep(0.05)
    assert not future.done()
    return future


def test_a_step_waits_for_its_fed_token_then_runs():
    inbox, batch = FeedbackInbox(), held()
    inbox.stream_opened()
    with ThreadPoolExecutor(1) as pool:
        step = waiting(pool, inbox, batch)
        inbox.add(fed((1, 3, 42)))
        assert step.result(timeout=5) is None
    assert batch.seqs[1].token_ids == [5, 6, 7, 42]
    assert (inbox.num_fed_tokens, inbox.num_feedback_waits) == (1, 1)
    inbox.check_integrity()


def test_a_step_gives_up_when_its_input_is_abandoned_reset_or_unreachable():
    inbox, batch = FeedbackInbox(), held()
    assert "no feedback stream" in inbox.wait_inputs(STEP, batch)
    inbox.stream_opened()
    with ThreadPoolExecutor(1) as pool:
        step = waiting(pool, inbox, batch)
        inbox.abandon([1])
        assert "sequences [1] will not come" in step.result(timeout=5)
        # a sequence sent whole or dropped awaits nothing: it is forgotten
        inbox.plan_taken(StepPlan(3, finished_seq_ids=(1,)))
        assert inbox.abandoned == set()
        inbox.reset_received()
        assert "reset before its input tokens came" in inbox.wait_inputs(STEP, batch)
        inbox.abandon([1])
        inbox.plan_taken(StepPlan(4, reset=True))  # the reset computes: counted off, abandoned cleared
        assert (inbox.resets_queued, inbox.abandoned) == (0, set())
        step = waiting(pool, inbox, batch)
        inbox.stream_closed()
        assert "no feedback stream" in step.result(timeout=5)
    assert inbox.num_abandoned == 4
    inbox.check_integrity()


def test_check_integrity_names_a_broken_invariant():
    inbox = FeedbackInbox()
    inbox.plan_taken(StepPlan(1, reset=True))  # a reset taken that never arrived
    try:
        inbox.check_integrity()
    except AssertionError as exc:
        assert "-1" in str(exc)
    else:
        raise AssertionError("a negative reset count passed")
