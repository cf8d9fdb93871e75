"""Long context through the stack (issue 14): a 16K-token prompt, chunked over many steps
and two stages, on a checkpoint with llama3 rope scaling, gives transformers' greedy tokens
(tie rule); a second request sharing its first 8K tokens hits the prefix cache and gives
its own reference tokens too."""

from __future__ import annotations

import asyncio
import random

import pytest
from support.reference import HFReference
from support.stack import kill_stack

from services.grpc_utils import aio_channel
from services.pb import scheduler_pb2, scheduler_pb2_grpc
from wiring.launcher import start_stack

PROMPT_LEN, NEW_TOKENS, BLOCK = 16384, 16, 16
ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 2048,
}


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama", max_position_embeddings=PROMPT_LEN + 1024, rope_scaling=ROPE)


async def _generate(address: str, prompt: list[int]) -> tuple[list[int], int]:
    async with aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
        req.sampling_params.max_tokens = NEW_TOKENS
        req.sampling_params.temperature = 0.0  # (unset is 1.0, as OpenAI's)
        req.sampling_params.ignore_eos = True
        tokens, cached = [], 0
        async for resp in stub.Generate(req):
            tokens += resp.token_ids
            if resp.HasField("usage"):
                cached = resp.usage.num_cached_tokens
        return tokens, cached


def test_a_16k_prompt_equals_transformers(model_dir, tmp_path):
    rng = random.Random(16)
    prompt = [rng.randrange(3, 512) for _ in range(PROMPT_LEN)]
    second = prompt[: PROMPT_LEN // 2] + [rng.randrange(3, 512) for _ in range(PROMPT_LEN // 2)]
    blocks = 3 * (PROMPT_LEN + 2 * NEW_TOKENS) // BLOCK
    stack = start_stack(
        model_dir,
        num_stages=2,
        num_kv_blocks=blocks,
        block_size=BLOCK,
        log_dir=tmp_path,
        threads_per_worker=1,
        scheduler_args=("--max-model-len", str(PROMPT_LEN + 1024), "--max-num-batched-tokens", "2048"),
    )
    try:
        first_out, _ = asyncio.run(_generate(stack.scheduler_address, prompt))
        second_out, cached = asyncio.run(_generate(stack.scheduler_address, second))
    finally:
        kill_stack(stack)  # the graceful stop is not tested here
    assert len(first_out) == len(second_out) == NEW_TOKENS
    assert cached >= PROMPT_LEN // 2 - BLOCK  # the shared half came from the prefix cache
    reference = HFReference(model_dir)
    reference.compare(prompt, first_out)
    reference.compare(second, second_out)
