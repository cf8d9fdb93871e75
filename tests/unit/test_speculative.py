"""Speculative decoding (n-gram drafts), in-process: the scheduler engine, the in-process KV
manager and the stage runners with the real model slice.

Greedy output with speculation equals output without (and transformers, under the tie
rule) at PP 1 and 2, synchronous and asynchronous, with preemption under a small pool;
seeded sampling gives the same tokens; verification is rejection sampling (the target's
distribution, checked over a small vocabulary); no KV block is left after aborts.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from support.reference import HFReference

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.request import Request, SamplingOptions
from scheduler_svc.core.speculation import Drafts
from services.sampling import SamplingParams
from services.speculative import SpeculativeConfig
from wiring.local_engine import build_local_engine
from worker_svc.execution.sampler import Sampler
from worker_svc.execution.sampler_types import SampleRow

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


def copy_prompts() -> list[list[int]]:
    """Input-grounded prompts: a random segment, half of it, then all of it again (the model's
    continuation often copies, and random tiny models loop: both give n-gram matches)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (5, 20, 40, 70):
        seg = torch.randint(5, 512, (n,), generator=g).tolist()
        out.append(seg + seg[: n // 2] + seg)
    return out


async def run(model_dir, options, prompts, num_kv_blocks=512, abort_after=None, **cfg):
    config = SchedulerConfig(block_size=16, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=128, **cfg)
    engine = build_local_engine(model_dir, config, num_kv_blocks=num_kv_blocks)
    planner, on_result = engine.planner, engine.planner.on_result

    def checked(*args, **kwargs):  # the planner's invariants (KV lead included) after every result
        updates = on_result(*args, **kwargs)
        planner.check_integrity()
        return updates

    planner.on_result = checked
    await engine.start()
    try:
        requests = [Request(f"r{i}", tuple(p), o, 0.0) for i, (p, o) in enumerate(zip(prompts, options, strict=True))]
        streams = [engine.submit(r) for r in requests]

        async def collect(i, stream):
            toks: dict[int, list[int]] = {}
            async for out in stream:
                for d in out.deltas:
                    toks.setdefault(d.index, []).extend(d.token_ids)
                if abort_after is not None and i % 2 and len(toks.get(0, ())) >= abort_after:
                    engine.abort(f"r{i}")
            return toks

        results = await asyncio.gather(*(collect(i, s) for i, s in enumerate(streams)))
        engine.planner.check_integrity()
        stats = await engine.kv.stats()
        return results, engine.planner, stats
    finally:
        await engine.stop()


CASES = [(1, False, 512), (1, True, 512), (2, False, 512), (2, True, 512), (1, True, 14), (2, False, 14)]


@pytest.mark.parametrize(
    ("pp", "async_scheduling", "blocks"),
    CASES,
    ids=["pp1-sync", "pp1-async", "pp2-sync", "pp2-async", "pp1-async-small", "pp2-sync-small"],
)
def test_greedy_output_equals_output_without_speculation(model_dir, reference, pp, async_scheduling, blocks):
    ps = copy_prompts()
    greedy = [SamplingOptions(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(ps)
    kw = dict(num_kv_blocks=blocks, pipeline_parallel_size=pp, async_scheduling=async_scheduling)
    plain, _, _ = asyncio.run(run(model_dir, greedy, ps, **kw))
    spec, planner, stats = asyncio.run(run(model_dir, greedy, ps, speculative_config=NGRAM, **kw))
    assert [r[0] for r in spec] == [r[0] for r in plain]
    for p, r in zip(ps, spec, strict=True):
        assert reference.compare(p, r[0]).tie_divergences <= 1
    assert planner.spec.num_drafts > 0 and planner.spec.num_accepted_tokens > 0
    assert planner.spec.num_accepted_tokens <= planner.spec.num_draft_tokens
    if blocks == 14:  # 224 slots for four prompts of 12..175 tokens and 40 more each
        assert planner.num_preemptions > 0
    assert stats.num_used_blocks == 0


def test_seeded_sampling_penalties_min_tokens_and_logprobs_are_unchanged(model_dir):
    """Verification draws each position exactly as one step at a time would: the same seeded
    tokens, penalties and min_tokens over the accepted drafts, the same logprobs; n = 2."""
    ps = copy_prompts()
    opts = [
        SamplingOptions(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        SamplingOptions(max_tokens=24, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, ignore_eos=True),
        SamplingOptions(max_tokens=24, temperature=0.0, min_tokens=20, logprobs=2),
        SamplingOptions(max_tokens=24, temperature=0.7, seed=11, n=2, ignore_eos=True),
    ]
    plain, _, _ = asyncio.run(run(model_dir, opts, ps))
    spec, planner, stats = asyncio.run(run(model_dir, opts, ps, speculative_config=NGRAM))
    assert spec == plain
    assert planner.spec.num_drafts > 0
    assert stats.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_no_block_is_left_after_aborts(model_dir, async_scheduling):
    ps = copy_prompts() * 2
    greedy = [SamplingOptions(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(ps)
    results, planner, stats = asyncio.run(
        run(
            model_dir,
            greedy,
            ps,
            num_kv_blocks=30,
            abort_after=6,
            async_scheduling=async_scheduling,
            speculative_config=NGRAM,
        )
    )
    assert planner.spec.num_drafts > 0
    assert stats.num_used_blocks == 0 and stats.num_sequences == 0
    assert all(len(r[0]) == 40 for i, r in enumerate(results) if i % 2 == 0)


def test_verification_is_rejection_sampling():
    """A point-mass draft is kept exactly when the target's own draw there equals it: the
    first token follows the target's distribution p0 whatever the draft, and after a kept
    draft the next follows p1 (chi-square over 4,000 seeds, vocabulary of 6)."""
    from scipy.stats import chisquare

    p0 = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.1, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.2, 0.1, 0.25, 0.05])
    logits = torch.stack([p0.log(), p1.log()])
    draft = 3
    first, second = torch.zeros(6), torch.zeros(6)
    trials = 4000
    for seed in range(trials):
        sampler = Sampler()
        row = SampleRow(1, SamplingParams(temperature=1.0), 0, 0, seed)
        out = sampler.sample(logits, [row], [(draft,)])
        first[out.token_ids[0]] += 1
        assert (len(out.token_ids) == 2) == (out.token_ids[0] == draft)
        if len(out.token_ids) == 2:
            second[out.token_ids[1]] += 1
    assert chisquare(first.numpy(), (p0 * trials).numpy()).pvalue > 1e-3
    kept = second.sum()
    assert abs(kept / trials - p0[draft]) < 4 * math.sqrt(0.3 * 0.7 / trials)
    assert chisquare(second.numpy(), (p1 * kept).numpy()).pvalue > 1e-3


def test_ngram_lookup_takes_the_longest_latest_match_and_backs_off():
    d = Drafts()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3]
    # "2 3" follows at 1 and 6; "1 2 3" only at 0: the longest wins
    assert d.lookup(tokens, 3, 1, 3) == (4, 5, 9)
    assert d.lookup(tokens + [4], 2, 2, 2) == (7, 1)  # "3 4": latest at 7 -> 7, 1
    assert d.lookup([5, 6, 7], 3, 1, 3) == ()
    assert d.take_turn()
    d.verified(4, 0)
    assert [d.take_turn() for _ in range(2)] == [False, True]
    d.verified(4, 0)
    assert [d.take_turn() for _ in range(3)] == [False, False, True]
    d.verified(4, 2)
    assert d.misses == 0


def test_speculative_config_reads_vllms_json():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (5, 3, 3)
    assert SpeculativeConfig.parse(None) is None
    for bad, field in [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "foo"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="speculative_config"):
        SchedulerConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 99}')


def test_verify_fields_cross_the_wire_and_bad_ones_are_refused(model_dir):
    from services.step import CachedSeq, NewSeq, StepPlan
    from services.step_codec import plan_from_pb, plan_to_pb
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.errors import InvalidPlanError
    from worker_svc.execution.runner import StageRunner

    plan = StepPlan(
        3, (), (CachedSeq(1, 3, 1, draft_token_ids=(7, 8)), CachedSeq(2, 1, 1, start=5), CachedSeq(4, 1, 2))
    )
    assert plan_from_pb(plan_to_pb(plan)) == plan

    runner = StageRunner(load_stage(model_dir, 0, 1, dtype="float32"), 16, 16)
    greedy = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(1, (NewSeq(1, (5, 6, 7, 8), 4, 0, 4, (0,), greedy),)))
    for bad, why in [
        (CachedSeq(1, 2, 1, draft_token_ids=(9, 10)), "at least one known token"),
        (CachedSeq(1, 3, 1, draft_token_ids=(9, 600)), "draft token id"),
        (CachedSeq(1, 2, 1, start=7), "start 7 beyond"),
        (CachedSeq(1, 2, 1, draft_token_ids=(9,), start=2), "drafts after position"),
    ]:
        with pytest.raises(InvalidPlanError, match=why):
            runner.execute(StepPlan(2, (), (bad,)))
    # a verify step: known token 4's successor, then drafts; the stage keeps what it accepts
    result = runner.execute(StepPlan(2, (), (CachedSeq(1, 3, 1, draft_token_ids=(9, 10)),)))
    state = runner.batch.seqs[1]
    kept = len(result.sampled.token_ids) - 1
    assert state.num_computed == 5 + kept and len(state.token_ids) == 6 + kept
    assert result.sampled_positions == tuple(range(5, 6 + kept))


@pytest.mark.parametrize(
    ("pp", "async_scheduling", "blocks"),
    CASES,
    ids=["pp1-sync", "pp1-async", "pp2-sync", "pp2-async", "pp1-async-small", "pp2-sync-small"],
)
def test_draft_model_greedy_output_equals_output_without(
    model_dir, model_factory, reference, pp, async_scheduling, blocks
):
    """`{"method": "draft_model"}`: the last stage's draft model (a smaller tiny model with the
    same vocabulary) proposes drafts after each step; greedy output is unchanged. The target
    itself as its own draft model accepts every draft."""
    import json

    small = model_factory(arch="llama", num_layers=2, hidden_size=32)
    ps = copy_prompts()
    greedy = [SamplingOptions(max_tokens=32, temperature=0.0, ignore_eos=True)] * len(ps)
    kw = dict(pipeline_parallel_size=pp, async_scheduling=async_scheduling, num_kv_blocks=blocks)
    plain, _, _ = asyncio.run(run(model_dir, greedy, ps, **kw))
    for draft in (small, model_dir):
        spec = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
        got, planner, stats = asyncio.run(run(model_dir, greedy, ps, speculative_config=spec, **kw))
        assert [r[0] for r in got] == [r[0] for r in plain]
        assert planner.spec.num_drafts > 0 and stats.num_used_blocks == 0
        if draft == model_dir:
            assert planner.spec.num_accepted_tokens >= 0.9 * planner.spec.num_draft_tokens
        if blocks == 14:
            assert planner.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_structured_output_cuts_refused_drafts_and_is_unchanged(model_dir, async_scheduling):
    """JSON-schema output with n-gram drafts: a draft the grammar refuses is never kept (the
    sample there is drawn under the grammar's mask), so the output is the one without
    speculation, and it validates."""
    import json

    import jsonschema
    from support.schemas import SCHEMAS

    from services.sampling import StructuredOutput
    from services.text import Tokenizer

    ps = copy_prompts()
    schemas = [SCHEMAS[i] for i in (0, 3, 5, 11)]
    opts = [
        SamplingOptions(
            max_tokens=80,
            temperature=0.0 if i % 2 else 0.8,
            seed=40 + i,
            structured=StructuredOutput("json_schema", json.dumps(sc)),
        )
        for i, sc in enumerate(schemas)
    ]
    plain, _, _ = asyncio.run(run(model_dir, opts, ps, async_scheduling=async_scheduling))
    spec, planner, stats = asyncio.run(
        run(model_dir, opts, ps, async_scheduling=async_scheduling, speculative_config=NGRAM)
    )
    assert spec == plain
    assert planner.spec.num_drafts > 0 and planner.spec.num_accepted_tokens < planner.spec.num_draft_tokens
    tokenizer = Tokenizer(model_dir)
    eos = set(tokenizer.eos_token_ids)
    for schema, out in zip(schemas, spec, strict=True):
        jsonschema.validate(json.loads(tokenizer.decode([t for t in out[0] if t not in eos])), schema)
    assert stats.num_used_blocks == 0
