"""P/D disaggregation's KV transfer between stages (issue 39; worker_svc/service/kv_transfer.py):
two real stage gRPC servers in this process on loopback, a prefill stage and a decode stage
with an import area (`--kv-import-blocks`).

A prompt computed on the prefill stage is pulled into the decode stage's import area; a LOAD
of the pulled keys puts exactly the prefill stage's bytes into the decode stage's pool, and the
decode stage then computes the prompt's rest to the same token. Every failure answers its
documented status and keeps nothing; a source that sends a damaged, short or slow stream is a
fake server built on the same chunk codec.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.grpc_utils import aio_channel, create_aio_server
from services.pb import worker_pb2, worker_pb2_grpc
from services.sampling import SamplingParams
from services.step import TIER_LOAD, NewSeq, StepPlan, TierOp
from worker_svc.checkpoints.convert import dtype_to_pb
from worker_svc.config import WorkerConfig
from worker_svc.server import StageService
from worker_svc.service.kv_transfer import BlockLayout, TransferError, decode_chunk, encode_block, stage_layout
from worker_svc.service.loading import load_runner

BLOCK_SIZE = 16
NUM_BLOCKS = 32
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]  # 2 full blocks and 8 tokens
SEQ = 7
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@dataclass
class Stage:
    service: StageService
    server: grpc.aio.Server
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.StageWorkerStub

    @property
    def runner(self):
        return self.service.runner

    async def run(self, fn, *args):
        """On the stage's compute thread (the owner of its pools and batch)."""
        return await asyncio.get_running_loop().run_in_executor(self.service.compute.executor, fn, *args)

    def block(self, block_id: int) -> torch.Tensor:
        return torch.stack([p[block_id] for pair in self.runner.kv_cache.slot_pools for p in pair]).clone()

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.service.stop()


async def start_stage(model_dir: str, import_blocks: int = 0) -> Stage:
    config = WorkerConfig(
        model=model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_import_blocks=import_blocks, num_threads=1
    )
    runner, _, _ = load_runner(config)
    return await serve_servicer(StageService(config, runner))


async def serve_servicer(servicer) -> Stage:
    server, port, _ = create_aio_server("127.0.0.1:0")
    worker_pb2_grpc.add_StageWorkerServicer_to_server(servicer, server)
    await server.start()
    if isinstance(servicer, StageService):
        await servicer.start()
    address = f"127.0.0.1:{port}"
    channel = aio_channel(address)
    return Stage(servicer, server, address, channel, worker_pb2_grpc.StageWorkerStub(channel))


def prefill(seq_id: int, blocks: tuple[int, ...]) -> StepPlan:
    return StepPlan(1, (NewSeq(seq_id, tuple(PROMPT), len(PROMPT), 0, len(PROMPT), blocks, GREEDY),))


def key(i: int) -> bytes:
    return b"prefix-key-%02d" % i


def pull_request(source: str, indices: list[int], keys: list[bytes] | None = None, seq_id: int = SEQ, **kw):
    keys = [key(i) for i in indices] if keys is None else keys
    return worker_pb2.PullBlocksRequest(source_address=source, seq_id=seq_id, block_indices=indices, keys=keys, **kw)


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details()


async def exported(stub, seq_id: int, indices: list[int]) -> list[worker_pb2.BlockChunk]:
    return [c async for c in stub.ExportBlocks(worker_pb2.ExportBlocksRequest(seq_id=seq_id, block_indices=indices))]


@contextlib.asynccontextmanager
async def stages(model_dir: str, import_blocks: int = 8):
    """(prefill stage holding SEQ in blocks 3, 5, 9; decode stage with an import area)."""
    source, sink = await start_stage(model_dir), await start_stage(model_dir, import_blocks)
    try:
        await source.run(source.runner.execute, prefill(SEQ, (3, 5, 9)))
        yield source, sink
    finally:
        await source.stop()
        await sink.stop()


# ---------------------------------------------------------------------- the round trip


def test_a_pulled_prompt_loads_exactly_the_prefill_stages_blocks(model_dir) -> None:
    async def go():
        async with stages(model_dir) as (source, sink):
            layout = stage_layout(sink.runner)
            reply = await sink.stub.PullBlocks(pull_request(source.address, [0, 1]))
            assert (reply.num_blocks, reply.num_bytes) == (2, 2 * layout.nbytes) and reply.elapsed_ns > 0
            tier = sink.runner.kv_tier
            assert tier.num_import_blocks == 2 and (tier.host_blocks, tier.disk_blocks) == (0, 0)
            # the decode stage's step: LOAD the pulled prefix, compute the prompt's rest
            rest = NewSeq(SEQ, tuple(PROMPT), len(PROMPT), 32, 8, (4, 6, 10), GREEDY)
            loads = (TierOp(TIER_LOAD, key(0), 4), TierOp(TIER_LOAD, key(1), 6))
            decoded = await sink.run(sink.runner.execute, StepPlan(1, (rest,), tier_ops=loads))
            for theirs, ours in ((3, 4), (5, 6)):
                assert source.block(theirs).abs().sum() > 0
                assert torch.equal(sink.block(ours), source.block(theirs))
            assert (tier.num_import_blocks, tier.num_loaded_import) == (0, 2)
            tier.check_integrity()
            stats = source.service.stats, sink.service.stats
            assert (stats[0].num_exported_blocks, stats[0].num_exported_bytes) == (2, 2 * layout.nbytes)
            assert (stats[1].num_imported_blocks, stats[1].num_imported_bytes) == (2, 2 * layout.nbytes)
            # the prefill stage's own token for the prompt, computed whole there
            whole = await source.run(source.runner.execute, prefill(SEQ + 1, (11, 12, 13)))
            return decoded.sampled_tokens(), whole.sampled_tokens()

    decoded, whole = asyncio.run(go())
    assert len(decoded) == 1 and [t.token_id for t in decoded] == [t.token_id for t in whole]


def test_export_streams_the_blocks_asked_in_order_with_their_layout(model_dir) -> None:
    async def go():
        async with stages(model_dir) as (source, _):
            chunks = await exported(source.stub, SEQ, [2, 0])
            layout = stage_layout(source.runner)
            assert [c.block_index for c in chunks] == [2, 0]
            assert torch.equal(decode_chunk(chunks[0], 2, layout), source.block(9))
            model = source.runner.model
            assert (chunks[0].layer_start, chunks[0].layer_end) == (model.start, model.end) == (0, 4)
            assert list(chunks[0].shape) == [8, BLOCK_SIZE, 2, 16]  # 4 layers' K and V, 2 KV heads, head_dim 16
            assert chunks[0].dtype == dtype_to_pb(torch.float32)
            assert await exported(source.stub, SEQ, []) == []

    asyncio.run(go())


# ---------------------------------------------------------------------- failures keep nothing


def test_each_failure_answers_its_status_and_keeps_nothing(model_dir) -> None:
    async def go():
        async with stages(model_dir, import_blocks=2) as (source, sink):
            found = {}
            found["export unknown"] = await status_of(exported(source.stub, 99, [0]))
            found["export past"] = await status_of(exported(source.stub, SEQ, [0, 3]))
            pull = sink.stub.PullBlocks
            found["no area"] = await status_of(source.stub.PullBlocks(pull_request(sink.address, [0])))
            found["unknown"] = await status_of(pull(pull_request(source.address, [0], seq_id=99)))
            found["past"] = await status_of(pull(pull_request(source.address, [0, 3])))
            found["ragged"] = await status_of(pull(pull_request(source.address, [0, 1], [key(0)])))
            found["empty"] = await status_of(pull(pull_request(source.address, [])))
            found["over area"] = await status_of(pull(pull_request(source.address, [0, 1, 2])))
            found["long key"] = await status_of(pull(pull_request(source.address, [0], [b"k" * 121])))
            found["twice"] = await status_of(pull(pull_request(source.address, [0, 1], [key(0), key(0)])))
            found["down"] = await status_of(pull(pull_request("127.0.0.1:1", [0])))
            assert sink.runner.kv_tier.num_import_blocks == 0
            await pull(pull_request(source.address, [0, 1]))  # fills the area
            found["full"] = await status_of(pull(pull_request(source.address, [2], [key(9)])))
            await pull(pull_request(source.address, [1, 0], [key(0), key(1)]))  # replaces: fits
            assert sorted(sink.runner.kv_tier.imports.keys()) == [key(0), key(1)]
            return found

    found = asyncio.run(go())
    expected = {
        "export unknown": (Code.NOT_FOUND, "sequence 99 is not held"),
        "export past": (Code.OUT_OF_RANGE, "3 is past sequence 7's 3 blocks"),
        "no area": (Code.FAILED_PRECONDITION, "no import area"),
        "unknown": (Code.NOT_FOUND, "sequence 99 is not held"),
        "past": (Code.OUT_OF_RANGE, "past sequence 7's"),
        "ragged": (Code.INVALID_ARGUMENT, "one key per index"),
        "empty": (Code.INVALID_ARGUMENT, "at least one"),
        "over area": (Code.INVALID_ARGUMENT, "over the import area's 2"),
        "long key": (Code.INVALID_ARGUMENT, "1 to 120 bytes"),
        "twice": (Code.INVALID_ARGUMENT, "named twice"),
        "down": (Code.UNAVAILABLE, "source 127.0.0.1:1"),
        "full": (Code.RESOURCE_EXHAUSTED, "no room for 1 more"),
    }
    for what, (code, text) in expected.items():
        assert found[what][0] == code and text in found[what][1], (what, found[what])


class FakeSource(worker_pb2_grpc.StageWorkerServicer):
    """A prefill stage that misbehaves: its chunks are the decode stage's layout, of `how`."""

    def __init__(self, layout: BlockLayout, how: str) -> None:
        self.layout, self.how = layout, how

    async def ExportBlocks(self, request, context):
        for n, index in enumerate(request.block_indices):
            block = torch.full(self.layout.shape, float(index), dtype=self.layout.dtype)
            chunk = encode_block(index, block, self.layout)
            if self.how == "damaged" and n == 1:
                chunk.data = chunk.data[:100] + bytes([chunk.data[100] ^ 1]) + chunk.data[101:]
            if self.how == "short" and n == 1:
                return
            if self.how == "slow":
                await asyncio.sleep(5)
            if self.how == "other layers":
                chunk.layer_end += 1
            if self.how == "reordered":
                chunk.block_index = request.block_indices[-1 - n]
            yield chunk
        if self.how == "long":
            yield encode_block(0, torch.zeros(self.layout.shape, dtype=self.layout.dtype), self.layout)


@pytest.mark.parametrize(
    "how, code, text",
    [
        ("damaged", Code.DATA_LOSS, "block 1: checksum mismatch"),
        ("short", Code.DATA_LOSS, "sent 1 of the 3 blocks"),
        ("long", Code.DATA_LOSS, "more than the 3 blocks"),
        ("reordered", Code.DATA_LOSS, "sent block 2 in its place"),
        ("other layers", Code.INVALID_ARGUMENT, "this stage's torch.float32"),
        ("slow", Code.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    ],
)
def test_a_bad_source_stream_keeps_nothing(model_dir, how: str, code: grpc.StatusCode, text: str) -> None:
    async def go():
        sink = await start_stage(model_dir, import_blocks=8)
        fake = await serve_servicer(FakeSource(stage_layout(sink.runner), how))
        try:
            found = await status_of(sink.stub.PullBlocks(pull_request(fake.address, [0, 1, 2], timeout_s=0.5)))
            assert sink.runner.kv_tier.num_import_blocks == 0
            if how == "damaged":  # the same source, undamaged, is taken whole
                fake.service.how = ""
                await sink.stub.PullBlocks(pull_request(fake.address, [0, 1, 2]))
                assert torch.equal(sink.runner.kv_tier.imports.pop(key(2)), torch.full(fake.service.layout.shape, 2.0))
            return found
        finally:
            await fake.channel.close()
            await fake.server.stop(None)
            await sink.stop()

    found_code, details = asyncio.run(go())
    assert found_code == code and text in details, details


# ---------------------------------------------------------------------- the chunk check


LAYOUT = BlockLayout(torch.bfloat16, (4, 2, 1, 8), 3, 5)


def test_a_chunk_round_trips_bit_exactly() -> None:
    block = torch.randn(LAYOUT.shape).to(torch.bfloat16)
    block[0, 0, 0, 0] = float("nan")
    chunk = encode_block(6, block, LAYOUT)
    assert len(chunk.data) == LAYOUT.nbytes == 4 * 2 * 8 * 2
    back = decode_chunk(worker_pb2.BlockChunk.FromString(chunk.SerializeToString()), 6, LAYOUT)
    assert torch.equal(back.view(torch.int16), block.view(torch.int16))


@pytest.mark.parametrize(
    "change, code",
    [
        (lambda c: setattr(c, "crc32", c.crc32 ^ 1), Code.DATA_LOSS),
        (lambda c: setattr(c, "data", c.data[:-2]), Code.DATA_LOSS),
        (lambda c: setattr(c, "block_index", 5), Code.DATA_LOSS),
        (lambda c: setattr(c, "dtype", dtype_to_pb(torch.float16)), Code.INVALID_ARGUMENT),
        (lambda c: c.shape.__setitem__(2, 2), Code.INVALID_ARGUMENT),
        (lambda c: setattr(c, "layer_start", 2), Code.INVALID_ARGUMENT),
    ],
)
def test_a_tampered_chunk_is_refused(change, code: grpc.StatusCode) -> None:
    chunk = encode_block(6, torch.ones(LAYOUT.shape, dtype=torch.bfloat16), LAYOUT)
    change(chunk)
    with pytest.raises(TransferError) as caught:
        decode_chunk(chunk, 6, LAYOUT)
    assert caught.value.code == code


@pytest.mark.parametrize(
    "runner, reason",
    [
        (SimpleNamespace(model=None), "no KV tensors"),  # an emulated device
        (SimpleNamespace(kv_cache=object(), tp=object(), num_kv_groups=1), "tensor-parallel-size 1"),
        (SimpleNamespace(kv_cache=object(), tp=None, num_kv_groups=2), "one KV group"),
    ],
)
def test_a_stage_whose_blocks_cannot_travel_says_so(runner, reason: str) -> None:
    with pytest.raises(TransferError, match=reason) as caught:
        stage_layout(runner)
    assert caught.value.code == Code.FAILED_PRECONDITION
