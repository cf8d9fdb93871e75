"""Tensor parallelism inside a stage (issue 14), through real processes: each stage is 2
processes (its rank 0 starts rank 1), every layer's heads, KV heads and MLP columns split
between them, the row-parallel outputs summed over gloo.

- greedy output equals `transformers` (tie rule) at TP=2 x PP=1 and TP=2 x PP=2, for a
  Llama and a Qwen2 (q/k/v biases) checkpoint, both with grouped-query attention (4 heads
  over 2 KV heads: one KV head per rank), with chunked prefill and a small block size;
- a pool sized from memory counts the stage's whole KV (each rank holds half of a block);
- `pagoda serve -tp 2 -pp 2`: killing one rank's process is a stage failure: the stage is
  restarted whole and every request completes with the undisturbed output.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from support.reference import HFReference
from support.stack import children, start_serve

from services.grpc_utils import aio_channel
from services.pb import scheduler_pb2, scheduler_pb2_grpc
from wiring.kv_pool import MemorySetting
from wiring.launcher import pagoda_command, stage_load_infos, start_stack
from worker_svc.execution.memory import kv_block_bytes
from worker_svc.models.registry import load_config

RANK_MODULE = "worker_svc.execution.tensor_parallel"


@pytest.fixture(scope="module")
def models(model_factory):
    return {arch: model_factory(arch=arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def references(models):
    return {arch: HFReference(path) for arch, path in models.items()}


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(5, 500) for _ in range(length)], rng.randint(6, 14)) for length in (1, 3, 9, 17, 33, 70, 5, 120)
    ]


async def generate_all(address: str, work) -> list[list[int]]:
    async with aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        async def one(prompt, max_tokens):
            req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
            req.sampling_params.max_tokens = max_tokens
            req.sampling_params.temperature = 0.0
            req.sampling_params.ignore_eos = True
            out = []
            async for resp in stub.Generate(req):
                out.extend(resp.token_ids)
            return out

        return await asyncio.gather(*(one(p, n) for p, n in work))


def ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes a stage worker started."""
    return [child for child, argv in children(pid).items() if RANK_MODULE in argv]


@pytest.mark.parametrize("arch,num_stages", [("llama", 1), ("llama", 2), ("qwen2", 1), ("qwen2", 2)])
def test_greedy_equals_transformers(models, references, tmp_path, arch, num_stages):
    model = models[arch]
    memory = None
    blocks = 96
    if (arch, num_stages) == ("llama", 1):  # the pool from a memory setting: the stage's whole KV
        config = load_config(model)
        block = kv_block_bytes(config.num_layers, 4, config.num_kv_heads, config.head_dim, torch.float32)
        memory, blocks = MemorySetting(kv_cache_memory=80 * block, max_model_len=256), None
    stack = start_stack(
        model,
        num_stages=num_stages,
        num_kv_blocks=blocks,
        block_size=4,
        log_dir=tmp_path,
        threads_per_worker=1,
        tensor_parallel_size=2,
        memory=memory,
        scheduler_args=("--max-num-batched-tokens", "32", "--max-num-seqs", "6"),
    )
    try:
        infos = stage_load_infos(stack.workers, {})
        assert [i.tensor_parallel_size for i in infos] == [2] * num_stages
        for worker in stack.workers:  # each stage: rank 0 (the worker) and its rank 1
            assert len(ranks_of(worker.process.pid)) == 1
        if memory is not None:
            assert stack.num_kv_blocks == 80
        work = workload()
        outputs = asyncio.run(generate_all(stack.scheduler_address, work))
    finally:
        stack.stop()
    assert all(not ranks_of(w.process.pid) for w in stack.workers)
    for (prompt, max_tokens), got in zip(work, outputs, strict=True):
        assert len(got) == max_tokens
        references[arch].compare(prompt, got)


def test_a_shape_that_does_not_divide_is_refused_at_start(models, tmp_path):
    done = subprocess.run(
        pagoda_command("serve", models["llama"], "--tensor-parallel-size", "3", "--log-dir", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "tensor_parallel_size: 3 does not divide num_attention_heads=4, num_key_value_heads=2" in done.stderr
    assert "sizes that divide its heads, KV heads and MLP: 1, 2" in done.stderr


# --- a killed rank -----------------------------------------------------------------------

NUM_REQUESTS = 12


@pytest.fixture(scope="module")
def serve_stack(models, tmp_path_factory):
    s = start_serve(
        models["llama"],
        tmp_path_factory.mktemp("tp-serve"),
        "--pipeline-parallel-size",
        "2",
        "--tensor-parallel-size",
        "2",
        "--num-kv-blocks",
        "256",
        "--block-size",
        "16",
        "--num-threads",
        "1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--max-restarts",
        "20",
    )
    yield s
    s.stop()


def run_all(stack, during=None):
    c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=180)

    def one(i):
        try:
            r = c.completions.create(
                model="tiny",
                prompt=f"Request {i}: " + "the quick brown fox " * (1 + i % 4),
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return ("ok", r.choices[0].token_ids)
        except (openai.APIError, openai.APIConnectionError) as exc:
            return ("error", f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(one, i) for i in range(NUM_REQUESTS)]
        if during is not None:
            time.sleep(0.3)
            during()
        return [f.result(timeout=300) for f in futures]


@pytest.mark.parametrize("stage", [1, 0])
def test_a_killed_rank_is_recovered_like_a_stage_failure(serve_stack, stage):
    baseline = run_all(serve_stack)
    assert all(o[0] == "ok" for o in baseline), baseline
    worker = serve_stack.service_pid("worker", stage)
    (rank,) = ranks_of(worker)
    outcomes = run_all(serve_stack, during=lambda: os.kill(rank, signal.SIGKILL))
    assert outcomes == baseline, "outputs differ from the undisturbed run"
    # the requests may all have finished before rank 0 saw its rank die: wait for the restart
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            restarted = serve_stack.service_pid("worker", stage)
        except LookupError:  # between the old process's exit and the new one's start
            restarted = worker
        if restarted != worker:
            break
        time.sleep(0.2)
    assert restarted != worker  # the stage was restarted whole
    serve_stack.wait_serving(60)
    assert len(ranks_of(restarted)) == 1
    assert serve_stack.kv_used_blocks() == 0
