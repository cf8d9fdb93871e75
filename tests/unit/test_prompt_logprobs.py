"""Prompt log-probabilities (`prompt_logprobs`): every prompt token's log-probability given
the tokens before it, its rank and the most likely alternatives, equal to `transformers`,
whatever the chunking, pipeline split, preemption, n or prefix cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.request import Request, SamplingOptions
from services.sampling import SamplingParams
from services.step import NewSeq, PromptScoring, StepPlan
from wiring.local_engine import LLM, _collect, build_local_engine
from worker_svc.errors import InvalidPlanError


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


def check(hf_llama, prompt, got, num_top):
    """got: per position 0 .. len - 2, (token id, logprob, rank, [(id, logprob)])."""
    assert got is not None and len(got) == len(prompt) - 1
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_llama(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    for i, (token, logprob, rank, top) in enumerate(got):
        row = logprobs[i]
        assert token == prompt[i + 1]
        assert logprob == pytest.approx(float(row[token]), abs=1e-4)
        # 1 + the number of more likely tokens (near-ties may fall either way)
        assert int((row > row[token] + 1e-4).sum()) + 1 <= rank <= int((row > row[token] - 1e-4).sum()) + 1
        assert len(top) == num_top
        want_values, want_ids = row.topk(num_top)
        for (tid, lp), want_lp in zip(top, want_values.tolist(), strict=True):
            assert lp == pytest.approx(want_lp, abs=1e-4)
            assert float(row[tid]) == pytest.approx(lp, abs=1e-4)  # the id's own (ties may reorder)


def prompts(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 60, (n,), generator=g)]


@pytest.mark.parametrize(("pp", "budget"), [(1, 2048), (1, 7), (2, 16)])
def test_prompt_logprobs_equal_transformers(model_dir, hf_llama, pp, budget):
    ps = prompts(5) + [[7]]  # a one-token prompt has no positions to score
    opts = [SamplingOptions(max_tokens=3, temperature=0.0, prompt_logprobs=k) for k in (0, 1, 5, 20, 2, 3)]
    llm = LLM(model_dir, pipeline_parallel_size=pp, num_kv_blocks=256, max_num_batched_tokens=budget)
    outs = llm.generate(ps, opts, detokenize=False)
    for prompt, o, out in zip(ps, opts, outs, strict=True):
        check(hf_llama, prompt, out.prompt_logprobs, o.prompt_logprobs)
    plain = llm.generate(ps[:1], [SamplingOptions(max_tokens=3, temperature=0.0)], detokenize=False)
    assert plain[0].prompt_logprobs is None


def test_with_preemption_and_n(model_dir, hf_llama):
    """A pool too small for all: requests are preempted mid-prefill and recomputed; each
    position is still reported once, and n = 3 choices share one prompt scoring."""
    ps = prompts(6, seed=4)
    opts = [
        SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2, n=3 if i == 0 else 1)
        for i in range(len(ps))
    ]
    llm = LLM(model_dir, num_kv_blocks=24, block_size=4, max_num_batched_tokens=8)
    outs = llm.generate(ps, opts, detokenize=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert len(outs[0].outputs) == 3
    for prompt, out in zip(ps, outs, strict=True):
        check(hf_llama, prompt, out.prompt_logprobs, 2)


def test_a_cached_prompt_is_still_scored_whole(model_dir, hf_llama):
    """The prefix cache holds the prompt from an earlier request; a request that scores its
    prompt computes every position anyway."""
    prompt = prompts(1, seed=5)[0] + list(range(100, 140))
    config = SchedulerConfig(block_size=4, num_kv_blocks=128, max_num_batched_tokens=64)

    async def go():
        engine = build_local_engine(model_dir, config, num_kv_blocks=128)
        await engine.start()
        try:
            first = await _collect(engine.submit(Request("a", tuple(prompt), SamplingOptions(max_tokens=2), 0.0)))
            second = await _collect(
                engine.submit(Request("b", tuple(prompt), SamplingOptions(max_tokens=2, prompt_logprobs=1), 0.0))
            )
            third = await _collect(engine.submit(Request("c", tuple(prompt), SamplingOptions(max_tokens=2), 0.0)))
            return first[1], second[1], third[1]
        finally:
            await engine.stop()

    first, second, third = asyncio.run(go())
    assert third.num_cached_tokens > 0  # the cache works for requests that do not score
    assert second.num_cached_tokens == 0
    check(hf_llama, prompt, second.prompt_logprobs, 1)


def test_malformed_scoring_is_refused(model_dir):
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.runner import StageRunner

    runner = StageRunner(load_stage(model_dir), 16, 4)

    def plan(scoring):
        return StepPlan(1, (NewSeq(1, (5, 6, 7), 3, 0, 3, (0,), SamplingParams(), prompt_scoring=scoring),))

    for bad in (
        PromptScoring(1, (6, 7, 8)),
        PromptScoring(1, (99999,)),
        PromptScoring(0, ()),
        PromptScoring(0, (6,), num_top=21),
    ):
        with pytest.raises(InvalidPlanError, match="prompt scoring"):
            runner.execute(plan(bad))
    assert runner.execute(plan(PromptScoring(0, (6, 7), 2))).prompt_logprobs[0][0] == 1


def test_the_wire_carries_scoring_both_ways():
    from services.pb import worker_pb2
    from services.step import PositionLogprobs, ScoredPrompt, StepResult
    from services.step_codec import plan_from_pb, plan_to_pb, result_to_pb

    sent = StepPlan(
        1,
        (
            NewSeq(
                3, (5, 6, 7, 8), 4, 0, 3, (0,), SamplingParams(), 0, 1, prompt_scoring=PromptScoring(0, (6, 7, 8), 2)
            ),
        ),
    )
    plan = plan_from_pb(plan_to_pb(sent))
    assert plan.new_seqs[0].prompt_scoring == PromptScoring(0, (6, 7, 8), 2)
    done = worker_pb2.MicroBatchDone(micro_batch_id=1)
    scored = ScoredPrompt(3, 0, (PositionLogprobs(6, -1.5, 2, [(9, -0.5), (6, -1.5)]),))
    result_to_pb(StepResult(1, prompt_logprobs=(scored,)), done)
    p = done.prompt_logprobs[0]
    assert (p.seq_id, p.first_position, p.positions[0].sampled.rank) == (3, 0, 2)
    assert [(t.token_id, t.rank) for t in p.positions[0].top] == [(9, 1), (6, 2)]


def test_only_a_sequence_still_scoring_keeps_out_of_the_prefix_cache():
    from scheduler_svc.core.request import Sequence
    from scheduler_svc.core.stage_view import scores_prompt

    request = Request("r", (5, 6, 7, 8), SamplingOptions(prompt_logprobs=1, n=2), 0.0)
    first, second = Sequence(1, request, 0, entropy_seed=1), Sequence(2, request, 1, entropy_seed=2)
    assert scores_prompt(first) and not scores_prompt(second)  # only choice 0 scores
    request.prompt_logprobs.extend([(6, -1.0, 1, [])] * 3)
    assert not scores_prompt(first)  # done: a re-admission may use the cache again
    plain = Request("q", (5, 6), SamplingOptions(), 0.0)
    assert not scores_prompt(Sequence(3, plain, 0, entropy_seed=1))


def test_offline_llm_returns_the_sampled_tokens_logprobs(model_dir, hf_llama):
    prompt = [5, 17, 99, 260, 31]
    out = (
        LLM(model_dir, num_kv_blocks=64)
        .generate(
            [prompt], [SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)], detokenize=False
        )[0]
        .outputs[0]
    )
    assert out.logprobs is not None and len(out.logprobs) == 4
    with torch.no_grad():
        logits = hf_llama(input_ids=torch.tensor([prompt + out.token_ids])).logits[0].float()
    for i, (token, (logprob, top)) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        want = torch.log_softmax(logits[len(prompt) - 1 + i], -1)
        assert logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert len(top) == 3 and top[0][0] == token  # greedy: the most likely
    plain = (
        LLM(model_dir, num_kv_blocks=64)
        .generate([prompt], SamplingOptions(max_tokens=2), detokenize=False)[0]
        .outputs[0]
    )
    assert plain.logprobs is None
