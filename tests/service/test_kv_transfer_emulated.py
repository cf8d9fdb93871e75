"""P/D disaggregation between emulated stages (issue 39; worker_svc/service/kv_transfer.py): two
real stage gRPC servers in this process on loopback, each `--device emulated:PROFILE` over a
config-only LLaMA-2-70B-shaped model, a prefill stage and a decode stage with an import area.

The decode stage pulls the prefill stage's sequence: no bytes travel, the pull lasts at least
the profile's KV link time for the blocks' modelled bytes, and a TIER_LOAD then takes the keys.
A real stage and an emulated one refuse each other's chunks (DATA_LOSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import pytest
from test_kv_transfer import (
    GREEDY,
    PROMPT,
    SEQ,
    exported,
    key,
    prefill,
    pull_request,
    serve_servicer,
    start_stage,
    status_of,
)

from services.device_profile import load_profile, profile_to_dict
from services.step import TIER_LOAD, NewSeq, StepPlan, TierOp
from worker_svc.config import WorkerConfig
from worker_svc.execution.emulated import build_emulated_runner
from worker_svc.server import StageService
from worker_svc.service.kv_transfer import emulated_layout

LAYERS = 4
BLOCK_BYTES = 2 * LAYERS * 16 * 8 * 128 * 2  # K and V x 4 layers x 16 slots x 8 KV heads x 128 x bfloat16
RATE = 3 * BLOCK_BYTES / 0.25  # three blocks in 0.25 s
Code = grpc.StatusCode


@pytest.fixture
def emulated_setup(tmp_path) -> tuple[str, str]:
    """(a config-only model folder, a profile file with fast steps and a slow KV link)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = profile_to_dict(load_profile("a100-80gb-llama2-70b-tp8"))
    profile.update(name="fast-steps-slow-link", kv_transfer_bytes_per_s=RATE)
    profile["step"] = {field: 0.0 for field in profile["step"]}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    return str(tmp_path), str(tmp_path / "profile.json")


async def start_emulated(model: str, profile: str, import_blocks: int = 0):
    config = WorkerConfig(
        model=model, device=f"emulated:{profile}", num_kv_blocks=32, block_size=16, kv_import_blocks=import_blocks
    )
    return await serve_servicer(StageService(config, build_emulated_runner(config)))


@contextlib.asynccontextmanager
async def emulated_stages(model: str, profile: str, import_blocks: int = 8):
    source = await start_emulated(model, profile)
    sink = await start_emulated(model, profile, import_blocks)
    try:
        await source.run(source.runner.execute, prefill(SEQ, (3, 5, 9)))
        yield source, sink
    finally:
        await source.stop()
        await sink.stop()


def test_an_emulated_pull_moves_no_bytes_and_lasts_the_modelled_link_time(emulated_setup) -> None:
    async def go():
        async with emulated_stages(*emulated_setup) as (source, sink):
            chunks = await exported(source.stub, SEQ, [2, 0])
            assert [(c.block_index, c.data, c.crc32) for c in chunks] == [(2, b"", 0), (0, b"", 0)]
            assert list(chunks[0].shape) == [2 * LAYERS, 16, 8, 128] and chunks[0].layer_end == LAYERS
            began = time.perf_counter()
            reply = await sink.stub.PullBlocks(pull_request(source.address, [0, 1, 2]))
            took = time.perf_counter() - began
            tier = sink.runner.kv_tier
            assert (
                (reply.num_blocks, reply.num_bytes)
                == (3, 3 * BLOCK_BYTES)
                == (3, 3 * emulated_layout(sink.runner).nbytes)
            )
            assert tier.num_import_blocks == 3 and reply.elapsed_ns >= 0.25e9
            stats = source.service.stats, sink.service.stats
            assert stats[0].num_exported_bytes == 5 * BLOCK_BYTES  # (the two exported above, the three pulled)
            assert (stats[1].num_imported_blocks, stats[1].num_imported_bytes) == (3, 3 * BLOCK_BYTES)
            # the decode stage's step: LOAD the first two pulled blocks, compute the prompt's rest
            rest = NewSeq(SEQ, tuple(PROMPT), len(PROMPT), 32, 8, (4, 6, 10), GREEDY)
            loads = (TierOp(TIER_LOAD, key(0), 4), TierOp(TIER_LOAD, key(1), 6))
            result = await sink.run(sink.runner.execute, StepPlan(1, (rest,), tier_ops=loads))
            assert len(result.sampled_tokens()) == 1
            assert (tier.num_import_blocks, tier.num_loaded_import) == (1, 2)
            tier.check_integrity()
            return took

    took = asyncio.run(go())
    assert took >= 3 * BLOCK_BYTES / RATE == 0.25


def test_emulated_failures_answer_the_real_statuses_and_keep_nothing(emulated_setup) -> None:
    async def go():
        async with emulated_stages(*emulated_setup, import_blocks=2) as (source, sink):
            found = {
                "export unknown": await status_of(exported(source.stub, 99, [0])),
                "export past": await status_of(exported(source.stub, SEQ, [0, 3])),
                "no area": await status_of(source.stub.PullBlocks(pull_request(sink.address, [0]))),
                "unknown": await status_of(sink.stub.PullBlocks(pull_request(source.address, [0], seq_id=99))),
                "over area": await status_of(sink.stub.PullBlocks(pull_request(source.address, [0, 1, 2]))),
                "late": await status_of(sink.stub.PullBlocks(pull_request(source.address, [0, 1], timeout_s=0.1))),
            }
            assert sink.runner.kv_tier.num_import_blocks == 0
            return found

    found = asyncio.run(go())
    expected = {
        "export unknown": (Code.NOT_FOUND, "sequence 99 is not held"),
        "export past": (Code.OUT_OF_RANGE, "3 is past sequence 7's 3 blocks"),
        "no area": (Code.FAILED_PRECONDITION, "no import area"),
        "unknown": (Code.NOT_FOUND, "sequence 99 is not held"),
        "over area": (Code.INVALID_ARGUMENT, "over the import area's 2"),
        "late": (Code.DEADLINE_EXCEEDED, "the modelled transfer takes 0.167 s"),
    }
    for what, (code, text) in expected.items():
        assert found[what][0] == code and text in found[what][1], (what, found[what])


def test_a_real_stage_and_an_emulated_one_refuse_each_others_chunks(model_factory) -> None:
    """Over the same (tiny, float32) model both have one layout: the header passes, the bytes do not."""
    model = model_factory(arch="llama")

    async def go():
        real_source, real_sink = await start_stage(model), await start_stage(model, import_blocks=8)
        fake_source = await start_emulated(model, "a100-80gb-llama2-70b-tp8")
        fake_sink = await start_emulated(model, "a100-80gb-llama2-70b-tp8", import_blocks=8)
        try:
            for stage in (real_source, fake_source):
                await stage.run(stage.runner.execute, prefill(SEQ, (3, 5, 9)))
            return (
                await status_of(real_sink.stub.PullBlocks(pull_request(fake_source.address, [0]))),
                await status_of(fake_sink.stub.PullBlocks(pull_request(real_source.address, [0]))),
                real_sink.runner.kv_tier.num_import_blocks + fake_sink.runner.kv_tier.num_import_blocks,
            )
        finally:
            for stage in (real_source, real_sink, fake_source, fake_sink):
                await stage.stop()

    from_emulated, from_real, kept = asyncio.run(go())
    assert from_emulated[0] == Code.DATA_LOSS and "0 bytes, expected" in from_emulated[1]
    assert from_real[0] == Code.DATA_LOSS and "empty blocks only" in from_real[1]
    assert kept == 0
