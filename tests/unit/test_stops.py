"""A step's results for one sequence alone: sampled tokens and their finishes
(scheduler_svc/core/stops.py), a pooling request's vector (scheduler_svc/core/pooling.py).
The planner's use of them: tests/unit/test_planner.py, test_embeddings.py."""

from __future__ import annotations

from scheduler_svc.core import pooling, stops
from scheduler_svc.core.request import FinishReason, Request, SamplingOptions, Sequence
from services.pooling import PoolingType


def _seq(**options) -> Sequence:
    request = Request("r", (1, 2, 3), SamplingOptions(**options), 0.0)
    return Sequence(1, request, 0, entropy_seed=1)


def test_tokens_join_up_to_the_first_that_finishes_the_sequence():
    seq = _seq(stop_token_ids=[7], max_tokens=10)
    assert stops.append_sampled(seq, [(5, None), (7, None), (8, None)], 100) == ([5, 7], [None, None])
    assert (seq.output, seq.finish_reason, seq.stop_token_id) == ([5, 7], FinishReason.STOP, 7)


def test_stops_wait_for_min_tokens_length_and_context_do_not():
    seq = _seq(stop_token_ids=[7], min_tokens=2, max_tokens=3)
    assert stops.append_sampled(seq, [(7, None), (7, None)], 100) == ([7, 7], [None, None])
    assert seq.finish_reason is None  # two stops masked before min_tokens
    assert stops.append_sampled(seq, [(4, None)], 100) == ([4], [None])
    assert seq.finish_reason == FinishReason.LENGTH and seq.stop_token_id is None
    short = _seq(max_tokens=10)
    stops.append_sampled(short, [(4, None)], 4)
    assert short.finish_reason == FinishReason.LENGTH  # the context is full


def test_a_pooling_request_never_samples_and_finishes_with_its_vector():
    request = Request("e", (1, 2, 3), SamplingOptions(), 0.0, pooling=PoolingType.LAST)
    seq = Sequence(1, request, 0, entropy_seed=1)
    assert pooling.never_samples(request) and not pooling.never_samples(_seq().request)
    seq.num_computed = 2
    assert not pooling.is_pooled(seq)
    seq.num_computed = 3
    assert pooling.is_pooled(seq)
    pooling.take_vector(seq, None)
    assert seq.finish_reason == FinishReason.ERROR  # the last stage returned none: a bug
