"""The first stage's side of sampled-token feedback (worker_svc/execution/batch.py): which steps wait
for a fed token, how fed tokens apply, and plan tokens that overlap fed ones."""

from __future__ import annotations

import pytest

from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, StepPlan
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.batch import PersistentBatch, StageShape

FIRST = StageShape(is_first=True, is_last=False, num_blocks=32, block_size=4, max_positions=512, vocab_size=100)
GREEDY = SamplingParams(temperature=0.0)


def held(prompt=(5, 6, 7)) -> PersistentBatch:
    batch = PersistentBatch(FIRST)
    batch.apply(StepPlan(1, new_seqs=(NewSeq(1, prompt, len(prompt), 0, len(prompt), (0, 1), GREEDY),)))
    return batch


def test_a_step_past_the_known_tokens_awaits_the_feedback_and_then_runs():
    batch = held()
    step = StepPlan(2, cached_seqs=(CachedSeq(1, 1, 2),))  # position 3: sampled by step 1
    assert batch.awaiting(step) == {1}
    assert batch.awaiting(StepPlan(2, cached_seqs=(CachedSeq(1, 1, 2),), reset=True)) == set()
    assert batch.awaiting(StepPlan(2, cached_seqs=(CachedSeq(1, 1, 2),), finished_seq_ids=(1,))) == set()
    with pytest.raises(InvalidPlanError, match="knows 3 tokens"):
        batch.apply(step)
    # stale (another position, a dropped sequence, outside the vocabulary) is ignored
    assert batch.feed([(1, 2, 9), (1, 5, 9), (7, 3, 9), (1, 3, 100)]) == 0
    assert batch.feed([(1, 3, 42)]) == 1 and batch.seqs[1].token_ids == [5, 6, 7, 42]
    assert batch.feed([(1, 3, 43)]) == 0  # that position is known now
    assert batch.awaiting(step) == set()
    (row,) = batch.apply(step)
    assert (row.start, row.num_tokens) == (3, 1)


def test_plan_tokens_that_came_by_feedback_too_are_not_appended_twice():
    batch = held()
    batch.feed([(1, 3, 42)])
    batch.apply(StepPlan(2, cached_seqs=(CachedSeq(1, 1, 2, new_token_ids=(42,)),)))
    assert batch.seqs[1].token_ids == [5, 6, 7, 42]
    # a plan token that disagrees with a fed one is refused, the state unchanged
    batch.feed([(1, 4, 50)])
    with pytest.raises(InvalidPlanError, match="do not continue"):
        batch.apply(StepPlan(3, cached_seqs=(CachedSeq(1, 1, 2, new_token_ids=(51,)),)))
    assert batch.seqs[1].token_ids == [5, 6, 7, 42, 50] and batch.seqs[1].num_computed == 4
    # without feedback the plan brings the token as before
    other = held()
    other.apply(StepPlan(2, cached_seqs=(CachedSeq(1, 1, 2, new_token_ids=(42,)),)))
    assert other.seqs[1].token_ids == [5, 6, 7, 42]
    with pytest.raises(InvalidPlanError, match="do not continue"):  # a gap: tokens it never had
        other.apply(StepPlan(3, cached_seqs=(CachedSeq(1, 1, 2, new_token_ids=(1, 2, 3, 4, 5, 6)),)))
