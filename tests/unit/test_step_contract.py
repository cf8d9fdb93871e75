"""The step contract: one plan type, one codec, and decode steps that cost a few bytes.

The planner runs against the real KV-cache core; its plans are encoded as the gRPC
transport encodes them and read back as a stage reads them.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_svc.core import KVCacheManager
from scheduler_svc.core.planner import Planner, PlannerConfig
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, SamplingOptions, sampling_params
from services.pb import worker_pb2
from services.step import (
    CachedSeq,
    NewSeq,
    PositionLogprobs,
    PromptScoring,
    SampledToken,
    ScoredPrompt,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from services.step_codec import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb


def _run_decodes(pp: int, num_requests: int = 8, prompt_len: int = 40, max_tokens: int = 40):
    """Plans of a planner serving `num_requests` requests to the end, sampled by a stand-in."""
    kv = KVCacheManager(512, 16)
    planner = Planner(PlannerConfig(pipeline_parallel_size=pp, max_in_flight=1), WaitingQueue("fcfs"))
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = tuple(rng.randrange(5, 500) for _ in range(prompt_len))
        options = SamplingOptions(
            max_tokens=max_tokens,
            temperature=0.7,
            top_p=0.9,
            seed=i,
            presence_penalty=0.5,
            logit_bias=((7, 1.0),),
            stop_token_ids=(3, 4),
        )
        planner.add(Request(f"r{i}", prompt, options, 0.0, eos_token_ids=(2,)))
    plans = []
    kv_calls = []  # per step: whether the KV service was needed
    while planner.requests:
        proposal = planner.propose()
        mb = planner.finalize(proposal, kv.step(proposal.step_input))
        if mb is None:
            continue
        kv_calls.append(not proposal.skips_kv)
        plans.append(mb.plan)
        sampled = [SampledToken(s.seq_id, 10 + rng.randrange(400)) for s in mb.seqs if s.sample]
        planner.on_result(mb.micro_batch_id, sampled)
    _run_decodes.kv_calls = kv_calls
    return plans


def test_a_decode_step_carries_no_prompt_params_or_whole_table():
    plans = _run_decodes(pp=1)
    decodes = [p for p in plans if not p.new_seqs and all(c.num_scheduled == 1 for c in p.cached_seqs)]
    assert len(decodes) >= 30
    for plan in decodes:
        msg = plan_to_pb(plan)
        assert not msg.new_seqs  # no prompt, no sampling parameters
        assert not msg.cached.new_token_ids  # one stage samples its own tokens
        # a block id only where a sequence crossed into a new block, never a whole table
        assert len(msg.cached.block_ids) <= len(plan.cached_seqs)
        assert all(0 <= c.block_offset and len(c.block_ids) <= 1 for c in plan.cached_seqs)
        assert msg.ByteSize() <= 8 + 8 * len(plan.cached_seqs), msg.ByteSize()
    # the first plan sent each sequence whole
    first = plan_to_pb(plans[0])
    assert len(first.new_seqs) == 8 and all(len(n.token_ids) == 40 for n in first.new_seqs)
    assert first.new_seqs[0].params.presence_penalty == 0.5
    assert first.reset  # a scheduler's first step drops whatever state the stages held


def test_with_several_stages_a_decode_step_carries_each_sequences_new_token():
    plans = _run_decodes(pp=2)
    decodes = [p for p in plans[2:] if not p.new_seqs]
    assert decodes
    for plan in decodes:
        assert all(len(c.new_token_ids) == 1 for c in plan.cached_seqs)
        assert plan_to_pb(plan).ByteSize() <= 8 + 10 * len(plan.cached_seqs)


def test_new_sequences_carry_their_sampling_parameters_once():
    plans = _run_decodes(pp=1)
    sent = [n.seq_id for p in plans for n in p.new_seqs]
    assert len(sent) == len(set(sent)) == 8
    params = sampling_params(
        SamplingOptions(
            max_tokens=40,
            temperature=0.7,
            top_p=0.9,
            seed=0,
            presence_penalty=0.5,
            logit_bias=((7, 1.0),),
            stop_token_ids=(3, 4),
        ),
        (2,),
    )
    assert plans[0].new_seqs[0].sampling == params


_ids = st.integers(0, 2**31)
_small = st.integers(0, 5000)
_scoring = st.none() | st.builds(PromptScoring, _small, st.tuples(_small, _small), st.integers(0, 20))


@st.composite
def _plans(draw):
    params = sampling_params(
        SamplingOptions(
            temperature=draw(st.sampled_from([0.0, 0.5, 1.0])),
            top_k=draw(st.integers(0, 50)),
            seed=draw(st.none() | st.integers(0, 2**64 - 1)),
            logprobs=draw(st.none() | st.integers(0, 20)),
            repetition_penalty=draw(st.sampled_from([1.0, 1.25])),
            min_tokens=draw(st.integers(0, 4)),
            max_tokens=8,
        ),
        tuple(draw(st.lists(_small, max_size=2))),
    )
    new = draw(
        st.lists(
            st.builds(
                lambda i, toks, k, b, sc: NewSeq(
                    i, tuple(toks), max(1, len(toks) // 2), k, 1, tuple(b), params, 3, 77, "req", "", sc
                ),
                _ids,
                st.lists(_small, min_size=1, max_size=30),
                _small,
                st.lists(_small, max_size=5),
                _scoring,
            ),
            max_size=4,
            unique_by=lambda n: n.seq_id,
        )
    )
    cached = draw(
        st.lists(
            st.builds(
                lambda i, n, off, b, t, sc: CachedSeq(i, n, off, tuple(b), tuple(t), sc),
                _ids,
                st.integers(1, 64),
                _small,
                st.lists(_small, max_size=3),
                st.lists(_small, max_size=2),
                _scoring,
            ),
            max_size=6,
        )
    )
    return StepPlan(
        draw(_ids),
        tuple(new),
        tuple(cached),
        tuple(draw(st.lists(_ids, max_size=4))),
        tuple(draw(st.lists(st.tuples(_small, _small), max_size=3))),
        draw(st.booleans()),
    )


@settings(max_examples=200)
@given(_plans())
def test_the_codec_round_trips_every_plan(plan):
    assert plan_from_pb(worker_pb2.MicroBatch.FromString(plan_to_pb(plan).SerializeToString())) == plan


def test_results_round_trip():
    result = StepResult(
        9,
        (SampledToken(1, 5), SampledToken(2, 6, TokenLogprobs(-0.5, [(6, -0.5), (1, -1.5)]))),
        (ScoredPrompt(1, 3, (PositionLogprobs(4, -2.0, 3, [(9, -0.125)]),)),),
    )
    done = worker_pb2.MicroBatchDone(micro_batch_id=9)
    result_to_pb(result, done)
    back = result_from_pb(worker_pb2.MicroBatchDone.FromString(done.SerializeToString()))
    assert back == result


def test_a_decode_step_inside_its_blocks_needs_no_kv_round_trip():
    plans = _run_decodes(pp=1)  # 8 prompts of 40 tokens: they cross block boundaries together
    calls = _run_decodes.kv_calls
    decodes = [i for i, p in enumerate(plans) if not p.new_seqs and all(c.num_scheduled == 1 for c in p.cached_seqs)]
    with_kv = [i for i in decodes if calls[i]]
    # a call only when the sequences cross into a new block (every 16 tokens)
    assert len(with_kv) <= len(decodes) // 16 + 2, (len(with_kv), len(decodes))
    for i in with_kv:
        assert any(c.block_ids for c in plans[i].cached_seqs)


def test_sampled_tokens_travel_as_columns_unless_one_carries_logprobs():
    """A step's sampled tokens go as two columns (no message per row); with logprobs on any
    row, as rows. Either way they decode to the same result; columns that disagree are refused
    (the transport fails that step alone)."""
    import pytest

    from services.pb import worker_pb2
    from services.step import SampledToken, StepResult, TokenLogprobs
    from services.step_codec import PlanDecodeError, result_from_pb, result_to_pb

    plain = StepResult(4, tuple(SampledToken(s, 100 + s, None) for s in (7, 3, 9)))
    done = worker_pb2.MicroBatchDone(micro_batch_id=4)
    result_to_pb(plain, done)
    assert list(done.sampled_seq_ids) == [7, 3, 9] and not done.sampled
    assert result_from_pb(done).sampled == plain.sampled
    with_logprobs = StepResult(
        4, (SampledToken(7, 107, None), SampledToken(3, 103, TokenLogprobs(-0.5, [(103, -0.5), (8, -1.5)])))
    )
    rows = worker_pb2.MicroBatchDone(micro_batch_id=4)
    result_to_pb(with_logprobs, rows)
    assert not rows.sampled_seq_ids and len(rows.sampled) == 2
    got = result_from_pb(rows).sampled
    assert got[0] == with_logprobs.sampled[0] and got[1].logprobs.logprob == -0.5
    done.sampled_token_ids.append(5)
    with pytest.raises(PlanDecodeError, match="3 sampled sequences, 4 tokens"):
        result_from_pb(done)
