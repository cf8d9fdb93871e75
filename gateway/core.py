"""The gateway's core: text in, token ids to the scheduler, text deltas back out.

Both front doors — the OpenAI-compatible REST API and the public gRPC `Generation` API —
go through `TextGenerator`: it tokenizes (or applies the chat template), calls
`Scheduler.Generate`, detokenizes each choice incrementally (never splitting a multi-byte
character), finds stop strings across token boundaries and, as soon as one matches, aborts
that choice downstream. It speaks only the scheduler's protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import grpc

from gateway.replicas import NoReplica, Replica, ReplicaSet, merge_stats, parse_targets
from gateway.tools import ToolCalling
from services import telemetry
from services.grpc_utils import aio_channel
from services.pb import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.sampling import SamplingOptions
from services.sampling_pb import options_to_pb
from services.text import TextOutputProcessor, Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")
# how long a request that has streamed nothing waits for a restarting scheduler (pagoda
# serve brings one back within a few seconds; a scheduler gone for good is a 503 after this)
RETRY_UNAVAILABLE_S = 15.0
# a request's scheduler responses read ahead of its client: what the gateway holds for a
# client that stops reading (beside the socket's own buffers), whatever max_tokens is
READ_AHEAD = 64
# how long a client may leave a full read-ahead untouched before its request is aborted
STALL_TIMEOUT_S = 30.0

_FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


class GenerationError(Exception):
    """The scheduler refused or failed a request: carries its gRPC status for the HTTP mapping."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ConsumerStalled(Exception):
    """The client read nothing while its request's read-ahead stayed full for the stall
    timeout: the request was aborted downstream (its blocks freed)."""


_WAKE = object()


async def read_ahead(source: AsyncIterator[T], capacity: int, stall_s: float) -> AsyncIterator[T]:
    """`source`'s items, read into a buffer of at most `capacity` ahead of the consumer, so
    that the consumer's pace, not the source's, decides how much is held. When the buffer
    stays full for `stall_s` seconds (0: never) the source is closed at once (cancelling
    the call behind it) and, once the consumer has taken what the buffer holds,
    ConsumerStalled is raised. The source's own error is raised in its place in the order.
    Closing this iterator closes the source."""
    queue: asyncio.Queue = asyncio.Queue(capacity)
    outcome: list[BaseException | None] = []  # set when the source is done: None, or why not

    async def pump() -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    if queue.full() and stall_s:
                        try:
                            await asyncio.wait_for(queue.put(item), stall_s)
                        except TimeoutError:
                            outcome.append(ConsumerStalled())
                            return  # leaving the block closes the source
                    else:
                        await queue.put(item)
            outcome.append(None)
        except Exception as exc:  # the consumer raises it after the items before it
            outcome.append(exc)
        finally:
            if not queue.full():  # a consumer waiting on an empty queue wakes up
                queue.put_nowait(_WAKE)

    task = asyncio.create_task(pump())
    try:
        while True:
            if queue.empty() and outcome:
                if outcome[0] is not None:
                    raise outcome[0]
                return
            item = await queue.get()
            if item is not _WAKE:
                yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@dataclass(frozen=True)
class GenerationParams:
    """A request as the front doors validated it: its sampling, in the one type every layer
    shares (`SamplingOptions`; `max_tokens` None = the rest of the context), and what only
    the gateway acts on (stop strings, detokenization, routing)."""

    sampling: SamplingOptions = field(default_factory=lambda: SamplingOptions(max_tokens=None))
    stop: tuple[str, ...] = ()
    priority: int = 0
    tenant: str = ""
    debug_timeline: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # max_tokens 0: the prompt is computed (and scored when asked); the one token the engine
    # samples after it is not returned
    prompt_only: bool = False
    # chat with tools: how the output becomes tool calls (gateway.tools)
    tool_calling: ToolCalling | None = None
    # routing across replicas: requests with one session key go to one replica (`user`, or
    # the x-session-id header)
    session: str = ""


class TopToken(NamedTuple):
    """One of the likeliest tokens at a position. `token` is its decode on its own (U+FFFD where
    it holds only part of a character, special tokens spelled out); `token_bytes` the bytes it
    stands for, None where they are the UTF-8 of `token`."""

    token_id: int
    token: str
    logprob: float
    token_bytes: bytes | None = None


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the likeliest alternatives, most likely first
    (plain `(token_id, token, logprob)` tuples become `TopToken`s). `token` and `token_bytes`
    as in `TopToken`."""

    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: list[TopToken] = field(default_factory=list)
    token_bytes: bytes | None = None
    rank: int | None = None  # 1-based, where the scheduler sent it (prompt tokens)

    def __post_init__(self) -> None:
        self.top = [TopToken(*t) for t in self.top]


@dataclass
class ChoiceDelta:
    """New text of one choice; `finish_reason` set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # on each choice's first delta when params.sampling.prompt_logprobs was set: one entry per prompt
    # token, the first with logprob None (nothing precedes it)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Finished:
    """The end of a request's stream."""

    usage: Usage
    timeline: list = field(default_factory=list)


class TextGenerator:
    """The gateway's one client of the scheduler, shared by every request of one event loop
    (REST and gRPC alike). Its channel opens on first use and closes with `close`."""

    def __init__(self, scheduler_address: str, tokenizer: Tokenizer, max_model_len: int,
                 retry_unavailable_s: float = RETRY_UNAVAILABLE_S,
                 stall_timeout_s: float = STALL_TIMEOUT_S, routing: str = "prefix",
                 redis_url: str = "") -> None:
        self.retry_unavailable_s = retry_unavailable_s
        self.stall_timeout_s = stall_timeout_s
        self._tracing = telemetry.enabled()
        self._tracer = telemetry.tracer("pagoda.gateway")
        targets = parse_targets(scheduler_address)
        # several replicas: this gateway routes (gateway/replicas.py); one: it is that one's
        self.replicas = ReplicaSet(targets, routing, redis_url) if len(targets) > 1 else None
        self._placed: dict[str, Replica] = {}  # request id -> the replica it runs on
        self.scheduler_address = targets[0][1] if self.replicas is None else scheduler_address
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._background: set[asyncio.Task] = set()
        self._tokens: dict[int, tuple[str, bytes]] = {}  # token id -> (text, bytes)

    def _connect(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            self._channel = aio_channel(self.scheduler_address)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None
        if self.replicas is not None:
            await self.replicas.close()

    def start(self) -> None:
        """In the event loop that serves: start watching the replicas (router mode)."""
        if self.replicas is not None:
            self.replicas.start()

    async def stats(self, include_kv_sequences: bool = False, timeout_s: float = 2.0,
                    include_requests: bool = False, include_timeline: bool = False):
        """The scheduler's statistics; in router mode the serving replicas' summed
        (`merge_stats`)."""
        request = scheduler_pb2.GetStatsRequest(include_kv_sequences=include_kv_sequences,
                                                include_requests=include_requests,
                                                include_timeline=include_timeline)
        if self.replicas is None:
            return await self._connect().GetStats(request, timeout=timeout_s)
        live = self.replicas.healthy or self.replicas.replicas
        replies = await asyncio.gather(*(r.connect().GetStats(request, timeout=timeout_s) for r in live),
                                       return_exceptions=True)
        got = [r for r in replies if not isinstance(r, BaseException)]
        if not got:
            raise next(r for r in replies if isinstance(r, BaseException))
        return merge_stats(got)

    async def health(self, timeout_s: float = 2.0) -> tuple[bool, str]:
        """(serving, why not): the whole chain as the scheduler reports it. Serving only when
        the scheduler says SERVING and so does its view of the KV service. In router mode:
        serving while one replica is (as last polled)."""
        if self.replicas is not None:
            if self.replicas.healthy:
                return True, ""
            return False, "no replica is serving: " + "; ".join(
                f"{r.name} ({r.address}): {r.why_down}" for r in self.replicas.replicas)
        try:
            stats = await self.stats(timeout_s=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return False, f"scheduler {self.scheduler_address}: {exc.code().name}: {exc.details()}"
        if stats.health != common_pb2.HEALTH_STATUS_SERVING:
            return False, stats.health_detail or "the scheduler is not serving"
        if stats.kv_health != common_pb2.HEALTH_STATUS_SERVING:
            return False, stats.health_detail or "the KV service is not serving"
        return True, ""

    async def abort(self, request_id: str, index: int | None = None) -> None:
        req = scheduler_pb2.AbortRequest(request_id=request_id)
        if index is not None:
            req.index = index
        if self.replicas is None:
            stub = self._connect()
        else:
            replica = self._placed.get(request_id)
            if replica is None:
                return
            stub = replica.connect()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Abort(req, timeout=2.0)

    def _request(self, request_id: str, prompt_ids: Sequence[int], p: GenerationParams,
                 traceparent: str = "") -> scheduler_pb2.GenerateRequest:
        req = scheduler_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=list(prompt_ids), priority=p.priority,
            tenant=p.tenant, debug_timeline=p.debug_timeline, arrival_time_ns=time.time_ns(),
        )
        if traceparent:
            req.trace_context.traceparent = traceparent
        options_to_pb(p.sampling, req.sampling_params)
        return req

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        request_id: str | None = None,
        traceparent: str = "",
    ) -> AsyncIterator[ChoiceDelta | Finished]:
        """Stream text deltas per choice, then one `Finished`. Raises GenerationError.

        Closing the iterator early (a client that went away) cancels the scheduler call,
        which aborts the request downstream and frees its blocks.
        """
        request_id = request_id or uuid.uuid4().hex
        span = None
        if self._tracing:  # the request's root span here; the scheduler's and stages' hang below
            span = self._tracer.start_span(
                "gateway.request", context=telemetry.context_from(traceparent),
                attributes={"pagoda.request_id": request_id, "pagoda.num_prompt_tokens": len(prompt_ids)},
            )
            traceparent = telemetry.traceparent_of(span)
        metadata = (("traceparent", traceparent),) if traceparent else None
        request = self._request(request_id, prompt_ids, params, traceparent)
        # read ahead of the client, within bounds: a client that stops reading for good is
        # aborted with finish reason "abort" (what it owed is then final)
        responses = read_ahead(self._responses(request, metadata, params.session), READ_AHEAD,
                               self.stall_timeout_s)
        processors: dict[int, TextOutputProcessor] = {}
        done: set[int] = set()
        completion_tokens: dict[int, int] = {}
        prompt_logprobs = None  # from the first response; handed to each choice's first delta
        try:
            async for resp in responses:
                if params.sampling.prompt_logprobs is not None and prompt_logprobs is None:
                    # the first response carries them (none for a one-token prompt)
                    text, token_bytes = self._token(prompt_ids[0])
                    head = TokenLogprob(prompt_ids[0], text, None, token_bytes=token_bytes)
                    prompt_logprobs = [head, *self._logprobs(resp.prompt_logprobs, prompt_ids[1:])]
                index = resp.index
                if index not in done:
                    proc = processors.get(index)
                    if proc is None:
                        proc = processors[index] = TextOutputProcessor(
                            self.tokenizer, stop=params.stop,
                            skip_special_tokens=params.skip_special_tokens,
                            include_stop_str_in_output=params.include_stop_str_in_output,
                            prompt_token_ids=list(prompt_ids),
                        )
                    first = index not in completion_tokens
                    delta = self._choice_delta(resp, proc, params)
                    completion_tokens[index] = 0 if params.prompt_only else (
                        completion_tokens.get(index, 0) + len(resp.token_ids))
                    if params.prompt_only and delta is not None:  # nothing generated is returned
                        delta = ChoiceDelta(index, "", [], [], "length" if delta.finish_reason else None)
                    if first and params.sampling.prompt_logprobs is not None:
                        delta = delta or ChoiceDelta(index, "", [])
                        delta.prompt_logprobs = prompt_logprobs
                    if delta is not None:
                        if delta.finish_reason is not None:
                            done.add(index)
                            if resp.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED \
                                    and params.sampling.n > 1 and len(done) < params.sampling.n:
                                # a stop string matched: end this choice downstream now
                                self._in_background(self.abort(request_id, index))
                        yield delta
                if resp.HasField("usage"):
                    finished = self._finished(resp)
                    if params.prompt_only:
                        finished.usage.completion_tokens = 0
                    yield finished
                    return
                if len(done) == params.sampling.n:
                    # every choice ended at the gateway (stop strings): tell the scheduler so
                    # (it counts a stop, as here, where a cancelled call counts an abort), then
                    # the finally below cancels what is left
                    await self.abort(request_id, index)
                    yield Finished(Usage(len(prompt_ids), sum(completion_tokens.values())))
                    return
        except ConsumerStalled:
            log.warning("request %s: the client read nothing for %.0f s with %d responses waiting; "
                        "aborted", request_id, self.stall_timeout_s, READ_AHEAD)
            for index in range(params.sampling.n):
                if index not in done:
                    yield ChoiceDelta(index, "", [], [], "abort")
            yield Finished(Usage(len(prompt_ids), sum(completion_tokens.values())))
        except grpc.aio.AioRpcError as exc:
            raise GenerationError(exc.code(), exc.details() or exc.code().name) from exc
        finally:
            await responses.aclose()  # cancels the scheduler call, which aborts the request
            if span is not None:
                span.end()

    async def _responses(self, request, metadata, session: str = "") -> AsyncIterator:
        """The scheduler's responses to `request`; closing this iterator cancels the call
        (the scheduler aborts the request and frees its blocks). A call that fails
        UNAVAILABLE before its first response (the scheduler restarting: `pagoda serve`
        brings it back) is made again, backing off, for up to `retry_unavailable_s`: a
        request that had streamed nothing completes instead of failing. Once anything came,
        a failure is final (the client has part of an answer), as is an unavailable pipeline
        behind a live scheduler. In router mode each attempt goes to the replica chosen
        then; one that fails it so is drained, and the request goes at once to a replica
        not tried yet (its pipeline being down included), waiting only when none is left."""
        deadline, delay = None, 0.2
        tried: set[str] = set()
        while True:
            replica = None
            if self.replicas is None:
                stub = self._connect()
            else:
                try:
                    replica, _ = await self.replicas.pick(request.prompt_token_ids, session or None,
                                                          frozenset(tried))
                except NoReplica as exc:
                    now = time.monotonic()
                    deadline = deadline or now + self.retry_unavailable_s
                    if now + delay > deadline:
                        raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"{exc}: {self._down()}") from None
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
                    tried.clear()  # those the health poll saw come back may be tried again
                    continue
                stub = replica.connect()
                self._placed[request.request_id] = replica
            call = stub.Generate(request, metadata=metadata)
            received = False
            try:
                with contextlib.nullcontext() if replica is None else self.replicas.in_flight(replica):
                    async for resp in call:
                        received = True
                        yield resp
                return
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                if received or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                if replica is not None:
                    self.replicas.mark_down(replica, f"{exc.code().name}: {details}")
                    tried.add(replica.name)
                    self.replicas.num_retries += 1
                    log.info("request %s: replica %s unavailable before anything streamed (%s); "
                             "another is tried", request.request_id, replica.name, details)
                    continue
                if "pipeline unavailable" in details:
                    raise
                now = time.monotonic()
                deadline = deadline or now + self.retry_unavailable_s
                if now + delay > deadline:
                    raise
                log.info("request %s: scheduler unavailable before anything streamed (%s); retrying",
                         request.request_id, details)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
            finally:
                if not call.done():
                    call.cancel()
                if replica is not None and self._placed.get(request.request_id) is replica:
                    del self._placed[request.request_id]

    def _down(self) -> str:
        return "; ".join(f"{r.name}: {r.why_down}" for r in self.replicas.replicas if not r.state.healthy)

    def _choice_delta(self, resp, proc: TextOutputProcessor,
                      params: GenerationParams) -> ChoiceDelta | None:
        """The text one response adds to its choice; None when it adds nothing."""
        token_ids = list(resp.token_ids)
        logprobs = self._logprobs(resp.logprobs, token_ids) if params.sampling.logprobs is not None else []
        scheduler_reason = _FINISH_NAMES.get(resp.finish_reason)
        if scheduler_reason is None:
            delta = proc.push(token_ids)
        else:
            stop_id = resp.stop_token_id if resp.HasField("stop_token_id") else None
            delta = proc.push(token_ids) if stop_id is None else proc.push(token_ids[:-1])
            if not delta.finished:
                tail = proc.finish(token_ids[-1:] if stop_id is not None else (), stop_token_id=stop_id)
                delta = type(delta)(delta.text + tail.text, True, tail.finish_reason, tail.stop_reason)
        if delta.finished:
            reason = scheduler_reason if scheduler_reason in ("abort", "error") else delta.finish_reason
            return ChoiceDelta(resp.index, delta.text, token_ids, logprobs, reason, delta.stop_reason)
        if delta.text or token_ids:
            return ChoiceDelta(resp.index, delta.text, token_ids, logprobs)
        return None

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # held until done, so it is not collected mid-flight
        task.add_done_callback(self._background.discard)

    def _finished(self, resp) -> Finished:
        u = resp.usage
        return Finished(
            Usage(u.num_prompt_tokens, u.num_completion_tokens, u.num_cached_tokens, u.num_preemptions),
            list(resp.timeline),
        )

    def _logprobs(self, entries, token_ids: Sequence[int]) -> list[TokenLogprob]:
        """TopLogprobs messages of these tokens as the formatters take them."""
        out = []
        for tid, lp in zip(token_ids, entries, strict=False):
            top = [TopToken(t.token_id, self._token(t.token_id)[0], t.logprob,
                            self._token(t.token_id)[1]) for t in lp.top]
            text, token_bytes = self._token(tid)
            out.append(TokenLogprob(tid, text, lp.sampled.logprob, top, token_bytes,
                                    lp.sampled.rank or None))
        return out

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and bytes, decoded once (a scored prompt asks for thousands; the
        cache holds at most the vocabulary). The text is its bytes when they are UTF-8 on
        their own (a SentencePiece word keeps its leading space), else its lone decode."""
        entry = self._tokens.get(token_id)
        if entry is None:
            raw = self.tokenizer.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            entry = self._tokens[token_id] = (text, raw)
        return entry

    def _token_text(self, token_id: int) -> str:
        return self._token(token_id)[0]
