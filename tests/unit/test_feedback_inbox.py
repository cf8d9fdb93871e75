"""The first stage's feedback inbox (worker_svc/service/feedback.py): a step waits until every token
it computes is known, and gives up with a reason when they will not come; the inbox's invariants
hold through it all (`check_integrity`). Runs on a real `PersistentBatch`."""

from __future__ import annotations

import asyncio

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


def test_a_step_waits_for_its_fed_token_then_runs():
    async def scenario():
        inbox, batch = FeedbackInbox(), held()
        inbox.stream_opened()
        waiting = asyncio.ensure_future(inbox.await_inputs(STEP, batch))
        await asyncio.sleep(0)
        assert not waiting.done()
        inbox.add(fed((1, 3, 42)))
        assert await asyncio.wait_for(waiting, 1.0) is None
        assert batch.seqs[1].token_ids == [5, 6, 7, 42]
        assert (inbox.num_fed_tokens, inbox.num_feedback_waits) == (1, 1)
        inbox.check_integrity()

    asyncio.run(scenario())


def test_a_step_gives_up_when_its_input_is_abandoned_reset_or_unreachable():
    async def scenario():
        inbox, batch = FeedbackInbox(), held()
        assert "no feedback stream" in await inbox.await_inputs(STEP, batch)
        inbox.stream_opened()
        waiting = asyncio.ensure_future(inbox.await_inputs(STEP, batch))
        await asyncio.sleep(0)
        inbox.abandon([1])
        assert "sequences [1] will not come" in await asyncio.wait_for(waiting, 1.0)
        # a sequence sent whole or dropped awaits nothing: it is forgotten
        inbox.plan_taken(StepPlan(3, finished_seq_ids=(1,)))
        assert inbox.abandoned == set()
        inbox.reset_received()
        assert "reset before its input tokens came" in await inbox.await_inputs(STEP, batch)
        inbox.abandon([1])
        inbox.plan_taken(StepPlan(4, reset=True))  # the reset computes: counted off, abandoned cleared
        assert (inbox.resets_queued, inbox.abandoned) == (0, set())
        waiting = asyncio.ensure_future(inbox.await_inputs(STEP, batch))
        await asyncio.sleep(0)
        inbox.stream_closed()
        assert "no feedback stream" in await asyncio.wait_for(waiting, 1.0)
        inbox.check_integrity()

    asyncio.run(scenario())


def test_check_integrity_names_a_broken_invariant():
    inbox = FeedbackInbox()
    inbox.plan_taken(StepPlan(1, reset=True))  # a reset taken that never arrived
    try:
        inbox.check_integrity()
    except AssertionError as exc:
        assert "-1" in str(exc)
    else:
        raise AssertionError("a negative reset count passed")
