"""The in-process engine (scheduler engine + in-process KV + stage runners) with the real model."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.reference import HFReference

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.request import Request, SamplingOptions
from wiring.local_engine import LLM, build_local_engine

PROMPT_LENGTHS = (1, 3, 16, 17, 45, 100, 177, 300)


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


def prompts():
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(5, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


async def run(model_dir, options_list, prompt_list, num_kv_blocks=512, **cfg):
    config = SchedulerConfig(block_size=16, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=128, **cfg)
    engine = build_local_engine(model_dir, config, num_kv_blocks=num_kv_blocks)
    await engine.start()
    try:
        requests = [
            Request(f"r{i}", tuple(p), o, 0.0) for i, (p, o) in enumerate(zip(prompt_list, options_list, strict=True))
        ]
        streams = [engine.submit(r) for r in requests]

        async def collect(stream):
            outs = {}
            final = None
            async for out in stream:
                for d in out.deltas:
                    outs.setdefault(d.index, []).extend(d.token_ids)
                final = out
            return outs, final

        results = await asyncio.gather(*(collect(s) for s in streams))
        stats = await engine.kv.stats()
        return results, engine.planner.num_preemptions, stats
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("pp", "async_scheduling"),
    [(1, False), (1, True), (2, False), (2, True), (3, True)],
    ids=["pp1-sync", "pp1-async", "pp2-sync", "pp2-async", "pp3-async"],
)
def test_greedy_with_preemption_equals_transformers(model_dir, reference, pp, async_scheduling):
    ps = prompts()
    greedy = [SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(ps)
    # 40 blocks of 16 = 640 slots for 8 prompts of up to 300 + 24 tokens: preemption must happen
    results, preemptions, stats = asyncio.run(
        run(model_dir, greedy, ps, num_kv_blocks=40, pipeline_parallel_size=pp, async_scheduling=async_scheduling)
    )
    assert preemptions > 0
    diverged = 0
    for p, (outs, final) in zip(ps, results, strict=True):
        assert final.finished and final.error is None
        assert len(outs[0]) == 24
        diverged += reference.compare(p, outs[0]).tie_divergences > 0
    assert diverged <= 1
    assert stats.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampling_is_unchanged_by_preemption(model_dir, async_scheduling):
    ps = prompts()
    seeded = [
        SamplingOptions(max_tokens=16, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(len(ps))
    ]
    roomy, p0, _ = asyncio.run(run(model_dir, seeded, ps, num_kv_blocks=512))
    tight, p1, _ = asyncio.run(run(model_dir, seeded, ps, num_kv_blocks=40, async_scheduling=async_scheduling))
    assert p0 == 0 and p1 > 0
    assert [r[0] for r in roomy] == [r[0] for r in tight]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_n_choices_share_and_differ(model_dir, async_scheduling):
    p = prompts()[5]
    opts = [
        SamplingOptions(n=2, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
        SamplingOptions(n=2, max_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    results, _, stats = asyncio.run(run(model_dir, opts, [p, p], async_scheduling=async_scheduling))
    sampled, greedy = results[0][0], results[1][0]
    assert sampled[0] != sampled[1]
    assert greedy[0] == greedy[1]
    assert stats.num_copy_on_write >= 1


def test_offline_llm_generate_in_order(model_dir):
    llm = LLM(model_dir, num_kv_blocks=256)
    outs = llm.generate(["Hello world", [5, 6, 7, 8]], SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    assert isinstance(outs[0].outputs[0].text, str)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_trace_shows_overlap_only_when_asynchronous(model_dir, tmp_path, async_scheduling):
    import json

    trace = tmp_path / "trace.jsonl"
    ps = prompts()
    greedy = [SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(ps)
    asyncio.run(
        run(model_dir, greedy, ps, pipeline_parallel_size=2, async_scheduling=async_scheduling, trace_file=str(trace))
    )
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    order = [(e["event"], e["micro_batch_id"]) for e in events if e["event"] in ("dispatched", "result")]
    dispatched_before_previous_returned = 0
    returned: set[int] = set()
    for kind, mb_id in order:
        if kind == "result":
            returned.add(mb_id)
        elif (
            mb_id - 1 >= 1
            and (mb_id - 1) not in returned
            and any(k == "dispatched" and m == mb_id - 1 for k, m in order)
        ):
            dispatched_before_previous_returned += 1
    assert any(e["event"] == "micro_batch" for e in events)  # the decisions are traced too
    if async_scheduling:
        assert dispatched_before_previous_returned > 0
    else:
        assert dispatched_before_previous_returned == 0


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_async_runs_the_next_step_on_the_last_stages_own_token(model_dir, reference, tmp_path, pp):
    """vLLM-style async scheduling: step k+1 of a decoding sequence is planned and dispatched
    before step k's result reaches the scheduler, carrying no token for it (the last stage
    samples step k's token and feeds it to step k+1 itself: the same stage with one, the
    first stage with several); outputs stay exact."""
    import json

    trace = tmp_path / "trace.jsonl"
    ps = prompts()[:4]
    greedy = [SamplingOptions(max_tokens=20, temperature=0.0, ignore_eos=True)] * len(ps)
    plans = []

    async def go():
        config = SchedulerConfig(
            block_size=16,
            num_kv_blocks=512,
            max_num_batched_tokens=512,
            async_scheduling=True,
            trace_file=str(trace),
            pipeline_parallel_size=pp,
        )
        engine = build_local_engine(model_dir, config, num_kv_blocks=512)
        submit = engine.transport.submit

        async def spy(plan):
            plans.append(plan)
            await submit(plan)

        engine.transport.submit = spy
        await engine.start()
        try:
            streams = [
                engine.submit(Request(f"r{i}", tuple(p), o, 0.0))
                for i, (p, o) in enumerate(zip(ps, greedy, strict=True))
            ]

            async def collect(stream):
                return [t async for out in stream for d in out.deltas for t in d.token_ids]

            assert engine.planner.feedback == (pp > 1)
            return await asyncio.gather(*(collect(s) for s in streams)), engine.planner.num_placeholder_steps
        finally:
            await engine.stop()

    outputs, placeholders = asyncio.run(go())
    for p, out in zip(ps, outputs, strict=True):
        assert len(out) == 20 and reference.compare(p, out).tie_divergences == 0
    assert placeholders >= 4 * 20 // 2
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    returned: set[int] = set()
    ahead = 0
    for e in events:
        if e["event"] == "result":
            returned.add(e["micro_batch_id"])
        elif e["event"] == "dispatched" and e["micro_batch_id"] - 1 in {p.step_id for p in plans}:
            ahead += e["micro_batch_id"] - 1 not in returned
    assert ahead >= 10  # most steps were in the stage's hands before the previous one returned
    decodes = [p for p in plans if p.cached_seqs and not p.new_seqs]
    assert decodes and all(not c.new_token_ids for p in decodes for c in p.cached_seqs)


def test_a_choice_ended_at_the_gateway_counts_as_a_stop(model_dir):
    """A stop string matched at the gateway ends the choice with Abort(index): the scheduler
    counts a stop, as the gateway does (a cancelled call counts an abort)."""
    from scheduler_svc.metrics import SchedulerMetrics

    async def go():
        config = SchedulerConfig(block_size=16, num_kv_blocks=64)
        engine = build_local_engine(model_dir, config, num_kv_blocks=64)
        engine.metrics = metrics = SchedulerMetrics("m")
        await engine.start()
        try:
            stopped = engine.submit(Request("s", (5, 6, 7), SamplingOptions(max_tokens=200, temperature=0), 0.0))
            cancelled = engine.submit(Request("c", (5, 6, 8), SamplingOptions(max_tokens=200, temperature=0), 0.0))
            await stopped.__anext__()
            await cancelled.__anext__()
            assert engine.abort("s", 0) and engine.abort("c")
            async for _ in stopped:
                pass
            await cancelled.aclose()
            return metrics, engine.summary()
        finally:
            # (this stop once waited for ever: Python 3.11's wait_for swallowed its cancel)
            await engine.stop()

    metrics, summary = asyncio.run(asyncio.wait_for(go(), 120))
    count = metrics.request_success.labels("m", "stop")._value.get()
    aborted = metrics.request_success.labels("m", "abort")._value.get()
    assert (count, aborted) == (1, 1)
    assert summary["num_aborted"] == 1


@pytest.mark.parametrize(
    ("pp", "async_scheduling"), [(1, True), (2, True), (2, False)], ids=["pp1-async", "pp2-async", "pp2-sync"]
)
def test_structured_output_conforms_through_preemption_and_forks(model_dir, pp, async_scheduling):
    """Each of 8 prompts under its own JSON schema, greedy, seeded, and n=3: every output
    validates, and a tight pool (preemption: grammar state rebuilt from the tokens) gives
    exactly the outputs of a roomy one."""
    import json

    import jsonschema
    from support.schemas import SCHEMAS

    from services.sampling import StructuredOutput

    ps = prompts()
    schemas = [SCHEMAS[i] for i in (0, 3, 5, 11, 13, 17, 18, 19)]
    opts = [
        SamplingOptions(
            max_tokens=100,
            temperature=0.0 if i % 2 else 0.9,
            seed=40 + i,
            n=3 if i == 4 else 1,
            structured=StructuredOutput("json_schema", json.dumps(s)),
        )
        for i, s in enumerate(schemas)
    ]
    roomy, p0, _ = asyncio.run(
        run(model_dir, opts, ps, num_kv_blocks=512, pipeline_parallel_size=pp, async_scheduling=async_scheduling)
    )
    tight, p1, stats = asyncio.run(
        run(model_dir, opts, ps, num_kv_blocks=40, pipeline_parallel_size=pp, async_scheduling=async_scheduling)
    )
    assert p0 == 0 and p1 > 0
    from services.text import Tokenizer

    tokenizer = Tokenizer(model_dir)
    for schema, o, (outs, final) in zip(schemas, opts, tight, strict=True):
        assert final.error is None and sorted(outs) == list(range(o.n))
        for tokens in outs.values():
            eos = set(tokenizer.eos_token_ids)
            text = tokenizer.decode([t for t in tokens if t not in eos])
            jsonschema.validate(json.loads(text), schema)
    assert [r[0] for r in roomy] == [r[0] for r in tight]
    assert len({tuple(v) for v in tight[4][0].values()}) > 1  # n=3 sampled: the choices differ
    assert stats.num_used_blocks == 0
