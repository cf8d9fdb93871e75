"""How the scheduler talks to the KV-cache manager: one interface, two implementations.

`KVCacheClient` speaks the contract's types (services/kv_types.py: `StepInput`,
`StepOutput`; services/kv_stats.py: `KVCacheStats`) and raises its exceptions
(services/kv_errors.py), whether the manager lives in the scheduler's process
(kvcache_svc/client.py `InProcessKVCacheClient`, built by the wiring) or behind
`pagoda kvcache` (`GrpcKVCacheClient`, here). Both behave the same; one test suite runs
against both.

Errors: `SequenceNotFound` and `InvalidStepError` (the caller's fault; nothing changed),
`KVServiceUnavailable` (gRPC only: the service is down, slow or out of step with this
client — preempt everything and `reset()`). Running short of blocks is a `NoBlocks` result.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import NamedTuple, TypeVar

import grpc

from services.grpc_utils import DEFAULT_MAX_MESSAGE_BYTES, aio_channel
from services.kv_codec import (
    SEQ_ID_METADATA_KEY,
    BlockCopyMismatch,
    sequence_stats_from_pb,
    stats_from_pb,
    step_input_to_pb,
    step_output_from_pb,
)
from services.kv_errors import ImportUnavailable, InvalidStepError, KVCacheError, SequenceNotFound
from services.kv_stats import KVCacheStats, SequenceBlockStats
from services.kv_types import StepInput, StepOutput
from services.local_stream import LocalStreamError, LocalUnary, open_call
from services.pb import common_pb2, kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


class KVServiceUnavailable(Exception):
    """The KV service cannot be reached, did not answer in time, refuses work until a reset,
    or disagrees with this client about its state. Whether a mutating call that raised this
    was applied is unknown: preempt every running sequence and `reset()`."""


class KVServiceError(Exception):
    """The KV service answered with a status that is neither the caller's fault nor an
    outage (INTERNAL, UNKNOWN, ...): a bug on the service side."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        super().__init__(f"{code.name}: {details}")


def check_num_blocks(num_blocks: int) -> None:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise InvalidStepError(f"num_blocks must be an int, got {num_blocks!r}")
    if not 0 <= num_blocks < 2**32:
        raise InvalidStepError(f"num_blocks must be in [0, 2**32), got {num_blocks}")


class ImportPlan(NamedTuple):
    """What a decode replica pulls for a prompt (`KVCacheClient.import_plan`)."""

    indices: list[int]  # the prompt's blocks to pull
    keys: list[bytes]  # their prefix keys
    num_present: int  # leading blocks found without pulling
    num_held: int = 0  # blocks in the import level now, not loaded yet
    capacity: int = 0  # how many it holds


class KVCacheClient(abc.ABC):
    """The KV-cache manager as the scheduler sees it. Every method is a coroutine; calls
    take effect in the order they are awaited."""

    @abc.abstractmethod
    async def step(self, step_input: StepInput) -> StepOutput:
        """Apply one plan's bookkeeping (see `StepInput` for what and in which order).

        Validated whole first: `SequenceNotFound` / `InvalidStepError` with nothing applied.
        A sequence short of blocks gets `NoBlocks` and stays as it was; the others apply.
        Each `Allocated` carries its table as a diff against the last answer for that
        sequence (`Allocated.block_offset`; whole for one never answered).
        """

    @abc.abstractmethod
    async def fork(self, parent_seq_id: int, child_seq_ids: Iterable[int]) -> None:
        """Each child starts sharing all of the parent's blocks (parallel sampling).
        `SequenceNotFound` for an unknown parent, `InvalidStepError` for a child id in use."""

    @abc.abstractmethod
    async def free(self, seq_ids: Iterable[int]) -> int:
        """Drop the sequences' references; returns how many blocks nobody holds any more
        (cached ones stay findable until evicted). All or nothing: `SequenceNotFound` if
        any is unknown, `InvalidStepError` for a repeated id."""

    @abc.abstractmethod
    async def stats(self) -> KVCacheStats:
        """The memory monitor's numbers now."""

    @abc.abstractmethod
    async def sequence_stats(self) -> tuple[SequenceBlockStats, ...]:
        """How each live sequence's blocks lie, in the order the sequences were created."""

    @abc.abstractmethod
    async def stats_message(self, include_sequences: bool = False) -> kvcache_pb2.KVCacheStats:
        """The memory monitor as the wire message `pagoda.v1.KVCacheStats`, for a service
        that passes it on (the scheduler's GetStats): epoch, peak use, Step calls and, when
        asked, every live sequence's table."""

    @abc.abstractmethod
    async def reset(self) -> int:
        """Forget every sequence, micro-batch in flight and cached block (the workers' KV
        can no longer be trusted); returns how many sequences were dropped. Cumulative
        counters survive."""

    @abc.abstractmethod
    async def check_capacity(self, num_blocks: int) -> bool:
        """Whether `num_blocks` more blocks can be had and still leave the watermark."""

    @abc.abstractmethod
    async def epoch(self) -> int:
        """The manager's identity: it changes when the service restarts (its state lost)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection, if any; the client is unusable afterwards."""

    # P/D disaggregation, on a decode replica (the KV service's import level, issue 39); each
    # raises ImportUnavailable without one

    async def import_plan(self, namespace: str | None, token_ids: Sequence[int], num_blocks: int) -> ImportPlan:
        """The prompt's first `num_blocks` full blocks to pull, how many leading blocks are
        found without pulling, and the import level's fill."""
        raise ImportUnavailable("this KV client has no import level")

    async def commit_import(self, keys: Sequence[bytes]) -> None:
        """Every stage holds these keys' blocks now: they are found as tier hits."""
        raise ImportUnavailable("this KV client has no import level")

    async def forget_import(self, keys: Sequence[bytes]) -> None:
        """A pull failed: whatever a stage kept of these keys is dropped."""
        raise ImportUnavailable("this KV client has no import level")


class GrpcKVCacheClient(KVCacheClient):
    """`pagoda.v1.KVCache` over one channel. Create it inside the event loop that uses it.

    Mutating calls run one at a time, in the order they are awaited. After a mutating call
    raised `KVServiceUnavailable` (applied or not: unknown) mutating calls keep raising it
    until `reset()` succeeds.

    Token ids travel as uint32: a token id of 2**32 or more is an `InvalidStepError` here
    (the in-process client takes any int64).
    """

    def __init__(
        self, address: str, *, timeout_s: float | None = 10.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._channel = aio_channel(address, max_message_bytes)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        self._out_of_step: str | None = None
        self._mutating = asyncio.Lock()  # one mutating call at a time, in order
        self._max_message_bytes = max_message_bytes
        # Step on the service's local socket when it offers one on this host (issue 37)
        self._local_step: LocalUnary | None = None
        self._local_ask_at = 0.0  # when to ask for it (again); inf: never (not offered)
        self.step_channel = "grpc"  # how the last Step went: "unix" or "grpc"

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the channel connects; `KVServiceUnavailable` if it does not in time."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise KVServiceUnavailable(f"{self.address} not reachable in {timeout_s} s") from None

    async def _call(self, rpc: Callable[..., Awaitable[T]], request) -> T:
        try:
            return await rpc(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error_from(exc) from None

    def _error_from(self, exc: grpc.aio.AioRpcError) -> Exception:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.NOT_FOUND:
            metadata = dict(exc.trailing_metadata() or ())
            seq_id = metadata.get(SEQ_ID_METADATA_KEY)
            if seq_id is None or not str(seq_id).isdigit():
                return KVCacheError(details)
            error = SequenceNotFound(int(seq_id))
            error.args = (details,)  # the service's message, word for word
            return error
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidStepError(details)
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return ImportUnavailable(details)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return KVServiceUnavailable(f"{self.address}: {code.name}: {details}")
        return KVServiceError(code, details)

    async def _mutate(self, rpc: Callable[..., Awaitable[T]], request) -> T:
        """A call that changes the service's state; hold `_mutating` around it."""
        if self._out_of_step is not None:
            raise KVServiceUnavailable(f"reset() first: {self._out_of_step}")
        try:
            return await self._call(rpc, request)
        except KVServiceUnavailable as exc:
            self._out_of_step = str(exc)  # applied or not: unknown
            raise

    async def _step_rpc(self) -> Callable[..., Awaitable[kvcache_pb2.StepResponse]]:
        """Step's call: on the service's local socket once one answers (this host), else gRPC.
        Asked for once, again after a `reset()`; a socket offered that does not answer is
        tried again 5 s later."""
        if self._local_step is None and time.monotonic() >= self._local_ask_at:
            self._local_ask_at = time.monotonic() + 5.0
            try:
                offer = await self._stub.LocalEndpoint(common_pb2.LocalEndpointRequest(), timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older service
                    self._local_ask_at = math.inf
                offer = None
            if offer is not None and not offer.local_socket:
                self._local_ask_at = math.inf  # it takes Step over gRPC only
            elif offer is not None:
                unary = LocalUnary(
                    functools.partial(
                        open_call,
                        offer.local_socket,
                        offer.local_token,
                        "Step",
                        response_type=kvcache_pb2.StepResponse,
                        max_message_bytes=self._max_message_bytes,
                    )
                )
                try:
                    await unary.connect()
                    self._local_step = unary
                except LocalStreamError as exc:  # (another host): gRPC
                    log.info("no local Step stream to the KV service at %s: %s", self.address, exc.details())
        self.step_channel = "grpc" if self._local_step is None else "unix"
        return self._local_step or self._stub.Step

    async def step(self, step_input: StepInput) -> StepOutput:
        request = step_input_to_pb(step_input)
        async with self._mutating:
            response = await self._mutate(await self._step_rpc(), request)
            try:
                return step_output_from_pb(response)
            except BlockCopyMismatch as exc:
                self._out_of_step = f"a response the service does not send: {exc}"
                raise KVServiceUnavailable(self._out_of_step) from None

    async def fork(self, parent_seq_id: int, child_seq_ids: Iterable[int]) -> None:
        children = tuple(child_seq_ids)
        try:
            request = kvcache_pb2.ForkRequest(
                forks=[kvcache_pb2.SequenceFork(parent_seq_id=parent_seq_id, child_seq_ids=children)]
            )
        except (TypeError, ValueError) as exc:
            raise InvalidStepError(f"the fork cannot be encoded: {exc}") from None
        async with self._mutating:
            await self._mutate(self._stub.Fork, request)

    async def free(self, seq_ids: Iterable[int]) -> int:
        ids = tuple(seq_ids)
        try:
            request = kvcache_pb2.FreeRequest(seq_ids=ids)
        except (TypeError, ValueError) as exc:
            raise InvalidStepError(f"the free cannot be encoded: {exc}") from None
        async with self._mutating:
            response = await self._mutate(self._stub.Free, request)
            return response.num_released_blocks

    async def _stats(self, include_sequences: bool) -> kvcache_pb2.KVCacheStats:
        request = kvcache_pb2.KVStatsRequest(include_sequences=include_sequences)
        return await self._call(self._stub.Stats, request)

    async def stats(self) -> KVCacheStats:
        return stats_from_pb(await self._stats(include_sequences=False))

    async def sequence_stats(self) -> tuple[SequenceBlockStats, ...]:
        return sequence_stats_from_pb(await self._stats(include_sequences=True))

    async def stats_message(self, include_sequences: bool = False) -> kvcache_pb2.KVCacheStats:
        return await self._stats(include_sequences)

    async def reset(self) -> int:
        async with self._mutating:
            response = await self._call(self._stub.Reset, kvcache_pb2.ResetRequest())
            self._out_of_step = None
            if self._local_step is not None:  # (the service may be another process now: ask again)
                self._local_step.close()
                self._local_step, self._local_ask_at = None, 0.0
            return response.num_dropped_sequences

    async def check_capacity(self, num_blocks: int) -> bool:
        check_num_blocks(num_blocks)
        request = kvcache_pb2.CheckCapacityRequest(num_blocks=num_blocks)
        return (await self._call(self._stub.CheckCapacity, request)).can_allocate

    async def epoch(self) -> int:
        return (await self._stats(include_sequences=False)).epoch

    async def import_plan(self, namespace: str | None, token_ids: Sequence[int], num_blocks: int) -> ImportPlan:
        request = kvcache_pb2.ImportPrefixRequest(
            phase=kvcache_pb2.ImportPrefixRequest.PHASE_PLAN,
            namespace=namespace,
            token_ids=token_ids,
            num_blocks=num_blocks,
        )
        reply = await self._call(self._stub.ImportPrefix, request)
        return ImportPlan(
            list(reply.block_indices), list(reply.keys), reply.num_present, reply.num_held, reply.capacity
        )

    async def commit_import(self, keys: Sequence[bytes]) -> None:
        request = kvcache_pb2.ImportPrefixRequest(phase=kvcache_pb2.ImportPrefixRequest.PHASE_COMMIT, keys=keys)
        async with self._mutating:  # ordered with the steps
            await self._call(self._stub.ImportPrefix, request)

    async def forget_import(self, keys: Sequence[bytes]) -> None:
        request = kvcache_pb2.ImportPrefixRequest(phase=kvcache_pb2.ImportPrefixRequest.PHASE_FORGET, keys=keys)
        async with self._mutating:
            await self._call(self._stub.ImportPrefix, request)

    async def close(self) -> None:
        if self._local_step is not None:
            self._local_step.close()
        await self._channel.close()
