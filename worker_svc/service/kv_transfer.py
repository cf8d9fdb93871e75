"""P/D disaggregation's KV transfer on a stage (issue 39): `ExportBlocks` on a prefill replica's
stage, `PullBlocks` on a decode replica's (protos/pagoda/v1/worker.proto).

A prefill replica's scheduler keeps a finished prompt's sequence on its stages; the decode
replica's stage k pulls that sequence's blocks from the prefill replica's stage k (the same layer
split), each block this stage's layers' part, laid out as the KV tier's blocks
(`[2 * num_slot_pools, block_size, num_kv_heads, head_dim]`), and keeps them in its import area
(worker_svc/execution/kv_import.py) under the decode KV manager's keys, where a `TIER_LOAD`
takes them.

Export: the sequence's block table is the one the stage's persistent batch holds
(`runner.batch.seqs[seq_id].block_ids`, worker_svc/execution/batch.py). Blocks are copied out of
the pools on the compute thread, which owns the pools and the batch (so a step never writes a
block while it is read, and the table read is the one the steps see), a few at a time
(`EXPORT_READ_BYTES` per visit), then serialized and checksummed off it.

An emulated stage (`--device emulated:PROFILE`, worker_svc/execution/emulated.py) holds no KV
tensors, so its transfer moves no bytes and models their time instead: its export streams one
chunk per block with empty `data` (crc32 of b"") and the layout a real stage of the model's
layers would send (`emulated_layout`: every KV head, a tensor-parallel stage's ranks together),
after the same checks of the sequence and the indices; its pull takes only such chunks, of its
own layout (a real stage refuses them: DATA_LOSS, their length), then waits what the profile's
KV link takes for the blocks' bytes (`DeviceProfile.kv_transfer_time_s`, asyncio: the compute
thread never waits on it) and keeps the keys (worker_svc/execution/emulated_kv.py). Bytes
counted (the stage's statistics, the reply) are the modelled ones.

Pull, the status of each failure (nothing of a failed pull is kept):
- FAILED_PRECONDITION: no import area here (--kv-import-blocks 0); or the source cannot export
  (its FAILED_PRECONDITION: tensor parallel, KV groups; UNIMPLEMENTED: an older stage);
- INVALID_ARGUMENT: a malformed request, or a chunk whose dtype, shape or layers are not this
  stage's (the two replicas' layouts differ);
- RESOURCE_EXHAUSTED: the import area has no room (try later);
- DATA_LOSS: a chunk out of order, of the wrong length or checksum, or too few or too many (an
  emulated source's empty chunks on a real stage, a real source's bytes on an emulated one);
- NOT_FOUND, OUT_OF_RANGE: the source's, passed through (it holds no such sequence, e.g.
  released or restarted; an index past its table): compute the prompt here instead;
- DEADLINE_EXCEEDED: the pull (on an emulated stage, with its modelled wait) took longer than
  `timeout_s` (`DEFAULT_PULL_TIMEOUT_S`);
- UNAVAILABLE: the source is down or unreachable, or failed in any other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import NamedTuple

import grpc
import torch

from services.grpc_utils import DEFAULT_MAX_MESSAGE_BYTES, aio_channel
from services.pb import worker_pb2, worker_pb2_grpc
from worker_svc.checkpoints.convert import dtype_to_pb
from worker_svc.execution.emulated import EmulatedRunner
from worker_svc.execution.kv_tier import MAX_KEY_BYTES, ImportAreaFullError
from worker_svc.service.statistics import StageStatistics

log = logging.getLogger(__name__)

DEFAULT_PULL_TIMEOUT_S = 30.0
EXPORT_READ_BYTES = 4 << 20  # blocks copied per visit of the compute thread (at least one)
CHUNK_OVERHEAD_BYTES = 64 << 10  # a BlockChunk's fields and framing beyond its block's bytes
Code = grpc.StatusCode
# the source's status -> the pull's (module docstring); any other: UNAVAILABLE
_SOURCE_STATUS = {
    Code.DEADLINE_EXCEEDED: Code.DEADLINE_EXCEEDED,
    Code.NOT_FOUND: Code.NOT_FOUND,
    Code.OUT_OF_RANGE: Code.OUT_OF_RANGE,
    Code.FAILED_PRECONDITION: Code.FAILED_PRECONDITION,
    Code.UNIMPLEMENTED: Code.FAILED_PRECONDITION,
    Code.CANCELLED: Code.CANCELLED,
}


class TransferError(Exception):
    """A transfer that cannot go on, with the status it answers."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class BlockLayout(NamedTuple):
    """One block of a stage as it travels: its part of every K and V pool at one block id."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # [2 * num_slot_pools, block_size, num_kv_heads, head_dim]
    layer_start: int
    layer_end: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)} of layers [{self.layer_start}, {self.layer_end})"


def stage_pools(runner) -> list[torch.Tensor]:
    """The stage's pools in a block's order (K0, V0, K1, V1 ...; KVTierStore's); TransferError
    when its blocks cannot travel."""
    cache = getattr(runner, "kv_cache", None)
    if cache is None:
        raise TransferError(Code.FAILED_PRECONDITION, "this stage holds no KV tensors (an emulated device)")
    if getattr(runner, "tp", None) is not None:
        raise TransferError(Code.FAILED_PRECONDITION, "KV transfer needs --tensor-parallel-size 1")
    if getattr(runner, "num_kv_groups", 1) > 1:
        raise TransferError(Code.FAILED_PRECONDITION, "KV transfer needs one KV group")
    return [pool for pair in cache.slot_pools for pool in pair]


def stage_layout(runner) -> BlockLayout:
    pools = stage_pools(runner)
    shape = (len(pools), *pools[0].shape[1:])
    return BlockLayout(pools[0].dtype, tuple(int(n) for n in shape), runner.model.start, runner.model.end)


def emulated_layout(runner: EmulatedRunner) -> BlockLayout:
    """The block a real stage of the emulated stage's layers would send: K and V of each layer,
    every KV head (a tensor-parallel stage's ranks together), the stage's dtype; TransferError
    for a model with KV groups (as on a real stage)."""
    model = runner.model
    config = model.config
    if config.kv_layout.grouped:
        raise TransferError(Code.FAILED_PRECONDITION, "KV transfer needs one KV group")
    shape = (2 * model.num_local_layers, runner.block_size, config.num_kv_heads, config.head_dim)
    return BlockLayout(runner.kv_dtype, shape, model.start, model.end)


def encode_block(index: int, block: torch.Tensor, layout: BlockLayout) -> worker_pb2.BlockChunk:
    """A block copied out of the pools (on the CPU) -> its chunk."""
    data = block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return worker_pb2.BlockChunk(
        block_index=index,
        data=data,
        crc32=zlib.crc32(data),
        dtype=dtype_to_pb(layout.dtype),
        shape=layout.shape,
        layer_start=layout.layer_start,
        layer_end=layout.layer_end,
    )


def empty_chunk(index: int, layout: BlockLayout) -> worker_pb2.BlockChunk:
    """An emulated stage's chunk: the block's layout, no bytes."""
    return worker_pb2.BlockChunk(
        block_index=index,
        data=b"",
        crc32=zlib.crc32(b""),
        dtype=dtype_to_pb(layout.dtype),
        shape=layout.shape,
        layer_start=layout.layer_start,
        layer_end=layout.layer_end,
    )


def decode_chunk(chunk: worker_pb2.BlockChunk, index: int, layout: BlockLayout) -> torch.Tensor:
    """The chunk's block (a CPU tensor of `layout`, its own memory), after every check: the
    index asked for next, this stage's layout (else INVALID_ARGUMENT), its length and checksum
    (else DATA_LOSS)."""
    check_chunk_header(chunk, index, layout)
    where = f"block {index}"
    if len(chunk.data) != layout.nbytes:
        raise TransferError(Code.DATA_LOSS, f"{where}: {len(chunk.data)} bytes, expected {layout.nbytes}")
    if zlib.crc32(chunk.data) != chunk.crc32:
        raise TransferError(Code.DATA_LOSS, f"{where}: checksum mismatch")
    return torch.frombuffer(bytearray(chunk.data), dtype=layout.dtype).view(layout.shape)


def check_empty_chunk(chunk: worker_pb2.BlockChunk, index: int, layout: BlockLayout) -> None:
    """An emulated stage's check of a chunk: as `decode_chunk`'s, but of an emulated source's
    chunk, no bytes and the checksum of none (else DATA_LOSS)."""
    check_chunk_header(chunk, index, layout)
    if chunk.data or chunk.crc32 != zlib.crc32(b""):
        raise TransferError(
            Code.DATA_LOSS,
            f"block {index}: {len(chunk.data)} bytes: an emulated stage takes an emulated source's empty blocks only",
        )


def check_chunk_header(chunk: worker_pb2.BlockChunk, index: int, layout: BlockLayout) -> None:
    """The index asked for next (else DATA_LOSS) and this stage's layout (else INVALID_ARGUMENT)."""
    where = f"block {index}"
    if chunk.block_index != index:
        raise TransferError(Code.DATA_LOSS, f"{where}: the source sent block {chunk.block_index} in its place")
    theirs = (chunk.dtype, tuple(chunk.shape), chunk.layer_start, chunk.layer_end)
    if theirs != (dtype_to_pb(layout.dtype), layout.shape, layout.layer_start, layout.layer_end):
        raise TransferError(
            Code.INVALID_ARGUMENT,
            f"{where}: the source's block is dtype {chunk.dtype} {list(chunk.shape)} of layers "
            f"[{chunk.layer_start}, {chunk.layer_end}), this stage's {layout.describe()}",
        )


def check_pull(request: worker_pb2.PullBlocksRequest, import_blocks: int) -> float:
    """The pull's timeout in seconds; INVALID_ARGUMENT for a malformed request."""
    keys, indices = list(request.keys), list(request.block_indices)
    problem = ""
    if not request.source_address:
        problem = "source_address: required"
    elif not keys or len(keys) != len(indices):
        problem = f"keys and block_indices: one key per index, at least one ({len(keys)} and {len(indices)})"
    elif len(keys) > import_blocks:
        problem = f"{len(keys)} blocks: over the import area's {import_blocks} (--kv-import-blocks)"
    elif any(not 0 < len(k) <= MAX_KEY_BYTES for k in keys):
        problem = f"keys: each 1 to {MAX_KEY_BYTES} bytes"
    elif len(set(keys)) != len(keys):
        problem = "keys: a key named twice"
    elif not math.isfinite(request.timeout_s) or request.timeout_s < 0:
        problem = f"timeout_s: {request.timeout_s} (0: the stage's default)"
    if problem:
        raise TransferError(Code.INVALID_ARGUMENT, problem)
    return request.timeout_s or DEFAULT_PULL_TIMEOUT_S


class KVTransfer:
    """The stage's two transfer RPCs. The pools and the batch are read on `executor` (the
    compute thread); the import area is the runner's KV tier's (`runner.kv_tier.imports`)."""

    def __init__(self, runner, executor: Executor, stats: StageStatistics, max_message_bytes: int) -> None:
        self.runner, self.executor, self.stats = runner, executor, stats
        self.max_message_bytes = max_message_bytes

    # --- export (a prefill replica's stage) -----------------------------------------------

    async def export(self, request: worker_pb2.ExportBlocksRequest, context):
        """The chunks of the blocks asked for, in order (an async generator)."""
        emulated = isinstance(self.runner, EmulatedRunner)
        try:
            async for chunk in self._emulated_chunks(request) if emulated else self._chunks(request):
                yield chunk
        except TransferError as exc:
            await context.abort(exc.code, exc.message)

    async def _chunks(self, request: worker_pb2.ExportBlocksRequest) -> AsyncIterator[worker_pb2.BlockChunk]:
        layout = stage_layout(self.runner)
        if layout.nbytes + CHUNK_OVERHEAD_BYTES > self.max_message_bytes:
            raise TransferError(
                Code.FAILED_PRECONDITION,
                f"a block ({layout.nbytes} bytes) is over this stage's message limit ({self.max_message_bytes})",
            )
        loop, indices = asyncio.get_running_loop(), list(request.block_indices)
        await loop.run_in_executor(self.executor, self._read_blocks, request.seq_id, indices, True)
        per_visit = max(1, EXPORT_READ_BYTES // layout.nbytes)
        for at in range(0, len(indices), per_visit):
            group = indices[at : at + per_visit]
            blocks = await loop.run_in_executor(self.executor, self._read_blocks, request.seq_id, group, False)
            for index, block in zip(group, blocks, strict=True):
                chunk = await asyncio.to_thread(encode_block, index, block, layout)
                self.stats.exported(len(chunk.data))
                yield chunk

    async def _emulated_chunks(self, request: worker_pb2.ExportBlocksRequest) -> AsyncIterator[worker_pb2.BlockChunk]:
        """An emulated stage's export: the same checks, then one empty chunk per block."""
        layout, indices = emulated_layout(self.runner), list(request.block_indices)
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self._read_blocks, request.seq_id, indices, True
        )
        for index in indices:
            self.stats.exported(layout.nbytes)  # (the modelled bytes)
            yield empty_chunk(index, layout)

    def _read_blocks(self, seq_id: int, indices: list[int], check_only: bool) -> list[torch.Tensor]:
        """On the compute thread: the blocks at `indices` of the sequence's table, copied to the
        CPU (none when `check_only`); NOT_FOUND, OUT_OF_RANGE."""
        state = self.runner.batch.seqs.get(seq_id)
        if state is None:
            raise TransferError(Code.NOT_FOUND, f"seq_id: sequence {seq_id} is not held on this stage")
        table = state.block_ids
        past = [i for i in indices if i >= len(table)]
        if past:
            raise TransferError(
                Code.OUT_OF_RANGE, f"block_indices: {past[0]} is past sequence {seq_id}'s {len(table)} blocks"
            )
        if check_only:
            return []
        pools = stage_pools(self.runner)
        # one gather per block; .cpu() waits for the steps queued before on this thread's stream
        return [torch.stack([pool[table[i]] for pool in pools]).cpu() for i in indices]

    # --- pull (a decode replica's stage) --------------------------------------------------

    async def pull(self, request: worker_pb2.PullBlocksRequest, context) -> worker_pb2.PullBlocksReply:
        try:
            return await self._pull(request)
        except TransferError as exc:
            log.warning("pull of sequence %d from %s failed: %s", request.seq_id, request.source_address, exc)
            await context.abort(exc.code, exc.message)

    async def _pull(self, request: worker_pb2.PullBlocksRequest) -> worker_pb2.PullBlocksReply:
        started = time.perf_counter_ns()
        tier = getattr(self.runner, "kv_tier", None)
        if tier is None or not tier.import_blocks:
            raise TransferError(Code.FAILED_PRECONDITION, "this stage has no import area (--kv-import-blocks)")
        timeout_s = check_pull(request, tier.import_blocks)
        self._check_room(tier, list(request.keys))
        keys = list(request.keys)
        try:
            if isinstance(self.runner, EmulatedRunner):
                layout = emulated_layout(self.runner)
                await self._pull_emulated(request, layout, timeout_s)
                tier.put_keys(keys)
            else:
                layout = stage_layout(self.runner)
                blocks = await self._fetch(request, layout, timeout_s)
                tier.put_imported(list(zip(keys, blocks, strict=True)))
        except ImportAreaFullError as exc:
            raise TransferError(Code.RESOURCE_EXHAUSTED, str(exc)) from None
        num_bytes = len(keys) * layout.nbytes
        self.stats.imported(len(keys), num_bytes)
        return worker_pb2.PullBlocksReply(
            num_blocks=len(keys), num_bytes=num_bytes, elapsed_ns=time.perf_counter_ns() - started
        )

    async def _pull_emulated(self, request: worker_pb2.PullBlocksRequest, layout: BlockLayout, timeout_s: float):
        """An emulated stage's pull: the source's empty chunks checked, then the wait the
        profile's KV link takes for their modelled bytes (DEADLINE_EXCEEDED past `timeout_s`)."""
        began = time.monotonic()
        indices = list(request.block_indices)
        async with contextlib.aclosing(self._source_chunks(request, layout, timeout_s)) as chunks:
            async for at, chunk in chunks:
                check_empty_chunk(chunk, indices[at], layout)
        wait_s = self.runner.profile.kv_transfer_time_s(len(indices) * layout.nbytes)
        left_s = timeout_s - (time.monotonic() - began)
        if wait_s > left_s:
            await asyncio.sleep(max(0.0, left_s))
            raise TransferError(
                Code.DEADLINE_EXCEEDED, f"the modelled transfer takes {wait_s:.3f} s, past the pull's {timeout_s} s"
            )
        await asyncio.sleep(wait_s)

    @staticmethod
    def _check_room(tier, keys: list[bytes]) -> None:
        """RESOURCE_EXHAUSTED before any byte moves when the area has no room now (`put_imported`
        checks again at the end: loads may free room meanwhile, other pulls take it)."""
        tier.imports.sweep()
        new = sum(key not in tier.imports for key in keys)
        if tier.num_import_blocks + new > tier.import_blocks:
            raise TransferError(
                Code.RESOURCE_EXHAUSTED,
                f"the import area holds {tier.num_import_blocks} of {tier.import_blocks} blocks: "
                f"no room for {new} more (--kv-import-blocks)",
            )

    async def _fetch(
        self, request: worker_pb2.PullBlocksRequest, layout: BlockLayout, timeout_s: float
    ) -> list[torch.Tensor]:
        """Every block asked for from the source, checked (`decode_chunk`)."""
        indices, blocks = list(request.block_indices), []
        async with contextlib.aclosing(self._source_chunks(request, layout, timeout_s)) as chunks:
            async for at, chunk in chunks:
                blocks.append(await asyncio.to_thread(decode_chunk, chunk, indices[at], layout))
        return blocks

    async def _source_chunks(
        self, request: worker_pb2.PullBlocksRequest, layout: BlockLayout, timeout_s: float
    ) -> AsyncIterator[tuple[int, worker_pb2.BlockChunk]]:
        """(position, chunk) of each chunk the source streams, exactly as many as asked (else
        DATA_LOSS); the source's failures mapped (`_SOURCE_STATUS`)."""
        indices, address = list(request.block_indices), request.source_address
        channel = aio_channel(address, max(DEFAULT_MAX_MESSAGE_BYTES, layout.nbytes + CHUNK_OVERHEAD_BYTES))
        ask = worker_pb2.ExportBlocksRequest(seq_id=request.seq_id, block_indices=indices)
        call = worker_pb2_grpc.StageWorkerStub(channel).ExportBlocks(ask, timeout=timeout_s)
        received = 0
        try:
            async for chunk in call:
                if received == len(indices):
                    raise TransferError(Code.DATA_LOSS, f"the source sent more than the {len(indices)} blocks asked")
                yield received, chunk
                received += 1
        except grpc.aio.AioRpcError as exc:
            code = _SOURCE_STATUS.get(exc.code(), Code.UNAVAILABLE)
            raise TransferError(code, f"source {address}: {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()
            await channel.close()
        if received != len(indices):
            raise TransferError(Code.DATA_LOSS, f"the source sent {received} of the {len(indices)} blocks asked")
