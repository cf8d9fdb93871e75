"""The gateway's core: text in, token ids to the scheduler, text deltas back out.

Both front doors — the OpenAI-compatible REST API and the public gRPC `Generation` API —
go through `TextGenerator`: it tokenizes (or applies the chat template), calls
`Scheduler.Generate`, detokenizes each choice incrementally (never splitting a multi-byte
character), finds stop strings across token boundaries and, as soon as one matches, aborts
that choice downstream. It speaks only the scheduler's protocol.

The front doors' types (a generation's parameters, deltas, end and error) are in
gateway/generation.py, the read-ahead of a request's responses in gateway/read_ahead.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway.disaggregation import PrefillPool
from gateway.generation import ChoiceDelta, Finished, GenerationError, GenerationParams, TokenLogprob, TopToken, Usage
from gateway.read_ahead import ConsumerStalled, read_ahead
from gateway.replicas import NoReplica, Replica, ReplicaSet, emulated_device, merge_stats, parse_targets
from services import local_stream, telemetry
from services.grpc_utils import PIPELINE_DOWN, UNAVAILABLE_REASON_KEY
from services.pb import common_pb2, scheduler_pb2, worker_pb2
from services.sampling_pb import options_to_pb
from services.text import TextOutputProcessor, Tokenizer

log = logging.getLogger(__name__)
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


# how gRPC words a connection that ended under a call: the scheduler's process went away
# (and how a local stream words it: the gateway's stream on the scheduler's socket)
_CONNECTION_LOST = (
    local_stream.PEER_GONE,
    "Stream removed",
    "Socket closed",
    "Connection reset",
    "Broken pipe",
    "GOAWAY",
    "failed to connect",
    "Connection refused",
    "recvmsg",
    "End of TCP stream",
)


def pipeline_down(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a scheduler that is up says its pipeline stayed down (its trailer's reason)."""
    return dict(exc.trailing_metadata() or ()).get(UNAVAILABLE_REASON_KEY) == PIPELINE_DOWN


def scheduler_failure(code: grpc.StatusCode, details: str) -> GenerationError:
    """A failed scheduler call as the client is told it: the scheduler's own refusals as it
    words them; a connection lost under the call (its process died or restarted) in the
    API's terms, as UNAVAILABLE (503: retry), since gRPC's words for it ("Stream removed
    (Socket closed)") tell a client nothing."""
    if any(word in details for word in _CONNECTION_LOST):
        return GenerationError(
            grpc.StatusCode.UNAVAILABLE,
            "the connection to the scheduler was lost while the request ran (the scheduler "
            "stopped or restarted): the answer is incomplete; send the request again",
        )
    return GenerationError(code, details or code.name)


class _Backoff:
    """Waits of 0.2 s doubling up to 2 s, for at most `limit_s` from the first."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.deadline: float | None = None
        self.delay = 0.2

    async def wait(self) -> bool:
        """Sleep the next delay; False, without sleeping, when it would end past the limit."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.limit_s
        if now + self.delay > self.deadline:
            return False
        await asyncio.sleep(self.delay)
        self.delay = min(2.0, self.delay * 2)
        return True


@dataclass
class _Choices:
    """One request's choices as streamed so far: each one's detokenizer, the ended ones,
    and how many tokens each generated."""

    num_prompt_tokens: int
    processors: dict[int, TextOutputProcessor] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    # from the first response when asked; handed to each choice's first delta
    prompt_logprobs: list[TokenLogprob] | None = None

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, sum(self.completion_tokens.values()))


class TextGenerator:
    """The gateway's one client of the scheduler, shared by every request of one event loop
    (REST and gRPC alike). Its channels open on first use and close with `close`.

    The schedulers are a `ReplicaSet`: several replicas this gateway routes between, or
    one scheduler as a set of one (gateway/replicas.py); either way a request goes through
    the one retry loop of `scheduler_responses`."""

    def __init__(
        self,
        scheduler_address: str,
        tokenizer: Tokenizer,
        max_model_len: int,
        retry_unavailable_s: float = RETRY_UNAVAILABLE_S,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        routing: str = "prefix",
        redis_url: str = "",
        default_seed: int | None = None,
        prefill_address: str = "",
    ) -> None:
        self.retry_unavailable_s = retry_unavailable_s
        self.default_seed = default_seed  # the seed of a request that sends none (--seed)
        self.stall_timeout_s = stall_timeout_s
        self._tracing = telemetry.enabled()
        self._tracer = telemetry.tracer("pagoda.gateway")
        targets = parse_targets(scheduler_address)
        # P/D disaggregation: the prefill replicas (gateway/disaggregation.py), routed by
        # `routing`, and the decode replicas by load; None: aggregated
        self.prefill = PrefillPool(parse_targets(prefill_address), routing, redis_url) if prefill_address else None
        self._replicas = ReplicaSet(targets, "least-loaded" if prefill_address else routing, redis_url)
        self._placed: dict[str, Replica] = {}  # request id -> the replica it runs on
        self.scheduler_address = scheduler_address if self._replicas.routes else targets[0][1]
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._background: set[asyncio.Task] = set()
        self._tokens: dict[int, tuple[str, bytes]] = {}  # token id -> (text, bytes)

    @property
    def replicas(self) -> ReplicaSet | None:
        """The replicas this gateway routes between (router mode); None with one scheduler
        (a set of one: nothing to route)."""
        return self._replicas if self._replicas.routes else None

    def replica_views(self) -> list[dict]:
        """The one scheduler this gateway sends to (not routed, not polled), as /debug/replicas
        lists it: its address and how its request stream goes."""
        r = self._replicas.replicas[0]
        return [{"name": r.name, "address": r.address, "stream": r.stream.channel if r.stream is not None else ""}]

    async def close(self) -> None:
        await self._replicas.close()
        if self.prefill is not None:
            await self.prefill.close()

    async def lora_adapter(self, load: bool, name: str, path: str, timeout_s: float = 180.0) -> dict[str, str]:
        """Loads (unloads) a LoRA adapter on every replica's stages, through its scheduler;
        grpc.aio.AioRpcError with the first refusal. Returns the adapters the (first)
        scheduler serves after it: name -> folder."""
        request = worker_pb2.LoraAdapterRequest(lora_name=name, lora_path=path)
        served = None
        for replica in self._replicas.replicas:
            stub = replica.connect()
            reply = await (stub.LoadLoraAdapter if load else stub.UnloadLoraAdapter)(request, timeout=timeout_s)
            served = served if served is not None else {a.lora_name: a.lora_path for a in reply.lora_adapters}
        return served or {}

    async def lora_adapters(self, timeout_s: float = 2.0) -> dict[str, str]:
        """The LoRA adapters the scheduler serves now (the first replica's that answers):
        name -> folder; grpc.aio.AioRpcError when none answers."""
        replicas = self._replicas.healthy or self._replicas.replicas
        for i, replica in enumerate(replicas):
            try:
                reply = await replica.connect().ListLoraAdapters(
                    scheduler_pb2.ListLoraAdaptersRequest(), timeout=timeout_s
                )
                return {a.lora_name: a.lora_path for a in reply.lora_adapters}
            except grpc.aio.AioRpcError:
                if i == len(replicas) - 1:
                    raise
        return {}

    def start(self) -> None:
        """In the event loop that serves: start watching the replicas (router mode)."""
        self._replicas.start()
        if self.prefill is not None:
            self.prefill.start()

    async def stats(
        self,
        include_kv_sequences: bool = False,
        timeout_s: float = 2.0,
        include_requests: bool = False,
        include_timeline: bool = False,
    ):
        """The scheduler's statistics; in router mode the serving replicas' summed
        (`merge_stats`)."""
        request = scheduler_pb2.GetStatsRequest(
            include_kv_sequences=include_kv_sequences,
            include_requests=include_requests,
            include_timeline=include_timeline,
        )
        # the replicas serving as last polled; all when none is, as in a set of one (never polled)
        live = self._replicas.healthy or self._replicas.replicas
        replies = await asyncio.gather(
            *(r.connect().GetStats(request, timeout=timeout_s) for r in live), return_exceptions=True
        )
        got = [r for r in replies if not isinstance(r, BaseException)]
        if not got:
            raise next(r for r in replies if isinstance(r, BaseException))
        return merge_stats(got)

    async def health(self, timeout_s: float = 2.0) -> tuple[bool, str]:
        """(serving, detail): the whole chain as the scheduler reports it. Serving only when
        the scheduler says SERVING and so does its view of the KV service. In router mode:
        serving while one replica is (as last polled). `detail` says why not; when serving,
        it names the emulated device the stages run on ("emulated:PROFILE"), else is empty."""
        if self._replicas.routes:
            if self._replicas.healthy:
                return True, ""
            return False, "no replica is serving: " + "; ".join(
                f"{r.name} ({r.address}): {r.why_down}" for r in self._replicas.replicas
            )
        try:  # one scheduler, not polled: asked now
            stats = await self.stats(timeout_s=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return False, f"scheduler {self.scheduler_address}: {exc.code().name}: {exc.details()}"
        if stats.health != common_pb2.HEALTH_STATUS_SERVING:
            return False, stats.health_detail or "the scheduler is not serving"
        if stats.kv_health != common_pb2.HEALTH_STATUS_SERVING:
            return False, stats.health_detail or "the KV service is not serving"
        return True, emulated_device(stats)

    async def abort(self, request_id: str, index: int | None = None) -> None:
        req = scheduler_pb2.AbortRequest(request_id=request_id)
        if index is not None:
            req.index = index
        replica = self._placed.get(request_id)
        if replica is None and not self._replicas.routes:
            replica = self._replicas.replicas[0]  # one scheduler: where every request runs (or ran)
        if replica is None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await replica.connect().Abort(req, timeout=2.0)

    def _request(
        self, request_id: str, prompt_ids: Sequence[int], p: GenerationParams, traceparent: str = ""
    ) -> scheduler_pb2.GenerateRequest:
        req = scheduler_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_ids),
            priority=p.priority,
            tenant=p.tenant,
            debug_timeline=p.debug_timeline,
            arrival_time_ns=time.time_ns(),
        )
        if traceparent:
            req.trace_context.traceparent = traceparent
        if p.lora_name:
            req.lora_name = p.lora_name
        options_to_pb(p.sampling, req.sampling_params)
        if p.sampling.seed is None and self.default_seed is not None:
            req.sampling_params.seed = self.default_seed % 2**64
        return req

    async def generate(
        self, prompt_ids: Sequence[int], params: GenerationParams, request_id: str | None = None, traceparent: str = ""
    ) -> AsyncIterator[ChoiceDelta | Finished]:
        """Stream text deltas per choice, then one `Finished`. Raises GenerationError.

        Closing the iterator early (a client that went away) cancels the scheduler call,
        which aborts the request downstream and frees its blocks.
        """
        request_id = request_id or uuid.uuid4().hex
        span, traceparent = self._start_span(request_id, len(prompt_ids), traceparent)
        metadata = (("traceparent", traceparent),) if traceparent else None
        request = self._request(request_id, prompt_ids, params, traceparent)
        # read ahead of the client, within bounds: a client that stops reading for good is
        # aborted with finish reason "abort" (what it owed is then final)
        responses = read_ahead(self._responses(request, metadata, params.session), READ_AHEAD, self.stall_timeout_s)
        choices = _Choices(len(prompt_ids))
        try:
            async for resp in responses:
                delta = self._on_response(resp, request, params, choices)
                if delta is not None:
                    yield delta
                if resp.HasField("usage"):
                    finished = self._finished(resp)
                    if params.prompt_only:
                        finished.usage.completion_tokens = 0
                    yield finished
                    return
                if len(choices.done) == params.sampling.n:
                    # every choice ended at the gateway (stop strings): tell the scheduler so
                    # (it counts a stop, as here, where a cancelled call counts an abort), then
                    # the finally below cancels what is left
                    await self.abort(request_id, resp.index)
                    yield Finished(choices.usage())
                    return
        except ConsumerStalled:
            log.warning(
                "request %s: the client read nothing for %.0f s with %d responses waiting; aborted",
                request_id,
                self.stall_timeout_s,
                READ_AHEAD,
            )
            for index in range(params.sampling.n):
                if index not in choices.done:
                    yield ChoiceDelta(index, "", [], [], "abort")
            yield Finished(choices.usage())
        except grpc.aio.AioRpcError as exc:
            raise scheduler_failure(exc.code(), exc.details() or "") from exc
        finally:
            await responses.aclose()  # cancels the scheduler call, which aborts the request
            if span is not None:
                span.end()

    def _start_span(self, request_id: str, num_prompt_tokens: int, traceparent: str) -> tuple[Any, str]:
        """(the request's root span, its traceparent) when tracing: the scheduler's and the
        stages' spans hang below it. (None, `traceparent`) otherwise."""
        if not self._tracing:
            return None, traceparent
        span = self._tracer.start_span(
            "gateway.request",
            context=telemetry.context_from(traceparent),
            attributes={"pagoda.request_id": request_id, "pagoda.num_prompt_tokens": num_prompt_tokens},
        )
        return span, telemetry.traceparent_of(span)

    def _on_response(
        self, resp, request: scheduler_pb2.GenerateRequest, params: GenerationParams, choices: _Choices
    ) -> ChoiceDelta | None:
        """What one scheduler response adds to its choice (None: nothing, or the choice had
        ended at the gateway). A choice that a stop string ends while others go on is
        aborted downstream."""
        prompt_ids = request.prompt_token_ids
        if params.sampling.prompt_logprobs is not None and choices.prompt_logprobs is None:
            # the first response carries them (none for a one-token prompt)
            text, token_bytes = self._token(prompt_ids[0])
            head = TokenLogprob(prompt_ids[0], text, None, token_bytes=token_bytes)
            choices.prompt_logprobs = [head, *self._logprobs(resp.prompt_logprobs, prompt_ids[1:])]
        index = resp.index
        if index in choices.done:
            return None
        proc = choices.processors.get(index)
        if proc is None:
            proc = choices.processors[index] = TextOutputProcessor(
                self.tokenizer,
                stop=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
                prompt_token_ids=list(prompt_ids),
                keep_special_tokens=params.reply_parsing.kept_tokens if params.reply_parsing else (),
            )
        first = index not in choices.completion_tokens
        delta = self._choice_delta(resp, proc, params)
        choices.completion_tokens[index] = (
            0 if params.prompt_only else (choices.completion_tokens.get(index, 0) + len(resp.token_ids))
        )
        if params.prompt_only and delta is not None:  # nothing generated is returned
            delta = ChoiceDelta(index, "", [], [], "length" if delta.finish_reason else None)
        if first and params.sampling.prompt_logprobs is not None:
            delta = delta or ChoiceDelta(index, "", [])
            delta.prompt_logprobs = choices.prompt_logprobs
        if delta is not None and delta.finish_reason is not None:
            choices.done.add(index)
            if (
                resp.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
                and params.sampling.n > 1
                and len(choices.done) < params.sampling.n
            ):
                # a stop string matched: end this choice downstream now
                self._in_background(self.abort(request.request_id, index))
        return delta

    async def _responses(self, request, metadata, session: str) -> AsyncIterator:
        """The decode (or only) replicas' responses; with P/D, the prompt computed on a prefill
        replica first, whose hold on its blocks ends once the decode side has answered."""
        held = None
        if self.prefill is not None and self.prefill.wanted(request):
            held = await self.prefill.prefill(request, metadata, session)
            if held is not None:
                request.kv_import.CopyFrom(held[1])
        try:
            async for resp in self.scheduler_responses(request, metadata, session):
                if held is not None:
                    self._in_background(self.prefill.release(held[0], request.request_id))
                    held = None
                yield resp
        finally:
            if held is not None:
                self._in_background(self.prefill.release(held[0], request.request_id))

    async def scheduler_responses(self, request, metadata, session: str = "") -> AsyncIterator:
        """The scheduler's responses to `request`; closing this iterator cancels the call
        (the scheduler aborts the request and frees its blocks). Each attempt goes to the
        replica `ReplicaSet.pick` chooses then. A call that fails UNAVAILABLE before its
        first response (the replica died or is restarting: `pagoda serve` brings it back)
        drains that replica, and the request goes at once to one not tried yet (its pipeline
        being down included); when none is left it waits, backing off, for up to
        `retry_unavailable_s`: a request that had streamed nothing completes instead of
        failing. With one scheduler (a set of one) that is: back off, then call it again.
        Once anything came, a failure is final (the client has part of an answer), as is an
        unavailable pipeline behind a lone scheduler that is up."""
        backoff = _Backoff(self.retry_unavailable_s)
        tried: set[str] = set()
        failure: grpc.aio.AioRpcError | None = None  # the last call's, failed UNAVAILABLE unstreamed
        while True:
            try:
                replica, _ = await self._replicas.pick(request.prompt_token_ids, session or None, frozenset(tried))
            except NoReplica as exc:
                if not await backoff.wait():
                    raise self._unavailable(exc, failure) from None
                tried.clear()  # those the health poll saw come back (a set of one's: its one) again
                continue
            self._placed[request.request_id] = replica
            call = replica.generate(request, metadata)
            received = False
            try:
                with self._replicas.in_flight(replica):
                    async for resp in call:
                        received = True
                        yield resp
                return
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                if (
                    received
                    or exc.code() != grpc.StatusCode.UNAVAILABLE
                    or (pipeline_down(exc) and not self._replicas.routes)
                ):
                    raise
                failure = exc
                self._replicas.mark_down(replica, f"{exc.code().name}: {details}")
                tried.add(replica.name)
                self._replicas.num_retries += 1
                log.info(
                    "request %s: replica %s (%s) unavailable before anything streamed (%s); retrying",
                    request.request_id,
                    replica.name,
                    replica.address,
                    details,
                )
            finally:
                if not call.done():
                    call.cancel()
                if self._placed.get(request.request_id) is replica:
                    del self._placed[request.request_id]

    def _unavailable(self, exc: NoReplica, failure: grpc.aio.AioRpcError | None) -> GenerationError:
        """Why a request that waited for a replica out fails: one scheduler's own error, or
        the replicas' (each one's last reason)."""
        if failure is not None and not self._replicas.routes:
            return GenerationError(failure.code(), failure.details() or failure.code().name)
        return GenerationError(grpc.StatusCode.UNAVAILABLE, f"{exc}: {self._down()}")

    def _down(self) -> str:
        return "; ".join(f"{r.name}: {r.why_down}" for r in self._replicas.replicas if not r.state.healthy)

    def _choice_delta(self, resp, proc: TextOutputProcessor, params: GenerationParams) -> ChoiceDelta | None:
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
            stop_token_id = delta.stop_reason if isinstance(delta.stop_reason, int) else None
            stop_reason = delta.stop_reason
            if stop_token_id is not None and stop_token_id not in params.sampling.stop_token_ids:
                stop_reason = None  # the model's EOS: null, as vLLM reports it
            return ChoiceDelta(
                resp.index, delta.text, token_ids, logprobs, reason, stop_reason, stop_token_id=stop_token_id
            )
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
            top = [
                TopToken(t.token_id, self._token(t.token_id)[0], t.logprob, self._token(t.token_id)[1]) for t in lp.top
            ]
            text, token_bytes = self._token(tid)
            out.append(TokenLogprob(tid, text, lp.sampled.logprob, top, token_bytes, lp.sampled.rank or None))
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
