"""How results flow back to an HTTP client: every prompt's stream merged, collected into a
whole response or sent as server-sent events, and cancelled when the client goes away.

Cancellation is the invariant here: however a response ends — finished, failed, or the
client gone before or during it — the iterators behind it are closed, which cancels their
scheduler calls, which abort the requests and free their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway import openai_format as fmt
from gateway import tools
from gateway.chat_parsing import ReplyParsing, ReplyStream, calls_finish_reason
from gateway.errors import error_body, status_for
from gateway.generation import ChoiceDelta, Finished, GenerationError, Usage
from gateway.tools import ToolCalling

log = logging.getLogger(__name__)
T = TypeVar("T")
Item = tuple[int, ChoiceDelta | Finished]  # (prompt index, what its stream produced)


class ClientGone(Exception):
    """The client disconnected before its response: nobody is left to answer."""


def add_usage(total: Usage, more: Usage) -> None:
    total.prompt_tokens += more.prompt_tokens
    total.completion_tokens += more.completion_tokens
    total.cached_tokens += more.cached_tokens
    total.preemptions += more.preemptions


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several streams as they come, tagged with the stream's index. The first
    error ends it; ending it (or cancelling its consumer) closes every stream. Each stream
    is read only a few items ahead of the consumer (its own read-ahead bounds the rest), so
    a client that stops reading holds the streams back instead of growing a queue here."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(4 * len(streams))
    end = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((i, item))
            await queue.put((i, end))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or ClientGone (and `awaitable` cancelled) if the client leaves
    first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


class EventStream(StreamingResponse):
    """Server-sent events whose generators are closed however the response ends (even
    before its body started), so that a client gone mid-stream cancels the generation
    behind it at once."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], items: AsyncIterator[Item], request_id: str) -> None:
        super().__init__(
            events, headers={"X-Request-Id": request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._closing = (events, items)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._closing:
                await stream.aclose()  # type: ignore[attr-defined]


async def guarded(request: Request, items: AsyncIterator[Item], awaitable: Awaitable[T]) -> T:
    """`awaitable` (which consumes `items`) unless the client leaves first; on any way out
    but a result, `items` is closed, which cancels its scheduler calls."""
    try:
        return await unless_disconnected(request, awaitable)
    except BaseException:
        await items.aclose()  # type: ignore[attr-defined]
        raise


async def first_item(request: Request, items: AsyncIterator[Item]) -> Item:
    """The first item, before the response starts, so that the scheduler's refusal becomes
    the HTTP status."""
    return await guarded(request, items, items.__anext__())


def stream_error_body(request_id: str, exc: Exception) -> dict[str, Any]:
    """An error mid-stream as OpenAI's error object (`{"error": {...}}`); a bug is logged."""
    if isinstance(exc, GenerationError):
        status = status_for(exc.code)
        return error_body(status, exc.message, None, exc.code.name.lower())
    log.exception("request %s failed mid-stream", request_id)
    return error_body(500, f"internal error (request {request_id})", None, "internal_error")


async def collect(items: AsyncIterator[Item], n: int) -> tuple[list[fmt.ChoiceResult], Usage, list[Finished]]:
    """A whole request's choices (in index order), its usage and its `Finished` items."""
    choices: dict[int, fmt.ChoiceResult] = {}
    usage, finished = Usage(), []
    async with contextlib.aclosing(items):
        async for prompt_index, item in items:
            if isinstance(item, ChoiceDelta):
                index = prompt_index * n + item.index
                choices.setdefault(index, fmt.ChoiceResult(index, prompt_index)).add(item)
            else:
                add_usage(usage, item.usage)
                finished.append(item)
    return [choices[i] for i in sorted(choices)], usage, finished


async def sse_events(payloads: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Chunks as server-sent events, then `[DONE]`; closing it closes `payloads`."""
    async with contextlib.aclosing(payloads):
        async for payload in payloads:
            yield fmt.sse(payload)
    yield fmt.sse("[DONE]")


async def _payloads(
    request_id: str,
    first: Item,
    items: AsyncIterator[Item],
    include_usage: bool,
    continuous_usage: bool,
    num_prompt_tokens: int,
    opening: list[dict[str, Any]],
    chunk: Callable[[int, ChoiceDelta], dict[str, Any] | None],
    final_usage: Callable[[Usage], dict[str, Any]],
) -> AsyncIterator[dict[str, Any]]:
    """The chunks shared by completions and chat: as `chunk` makes them, then the usage
    chunk if asked. An error mid-stream ends it as an error chunk (`stream_error_body`)."""
    usage, generated = Usage(), 0
    try:
        for payload in opening:
            yield payload
        item: Item | None = first
        while item is not None:
            prompt_index, x = item
            if isinstance(x, ChoiceDelta):
                generated += len(x.token_ids)
                payload = chunk(prompt_index, x)
                if payload is not None:
                    if continuous_usage:
                        payload["usage"] = fmt.usage_body(Usage(num_prompt_tokens, generated))
                    yield payload
            else:
                add_usage(usage, x.usage)
            item = await anext(items, None)
        if include_usage:
            yield final_usage(usage)
    except Exception as exc:  # the response has started: the error goes in the stream
        yield stream_error_body(request_id, exc)
    finally:
        await items.aclose()  # type: ignore[attr-defined]


def completion_events(
    request_id: str,
    created: int,
    model: str,
    first: Item,
    items: AsyncIterator[Item],
    n: int,
    want_logprobs: bool,
    want_token_ids: bool,
    options: Any,
    num_prompt_tokens: int,
    echo_texts: list[str] | None = None,
    num_top: int | None = None,
) -> AsyncIterator[bytes]:
    """`echo_texts` (per prompt): each choice's first chunk starts with its prompt."""
    # per choice: text offsets count every token so far, as the whole response's do (not the
    # text sent so far, which lags behind a held-back partial character or stop string)
    offsets: dict[int, fmt.TextOffsets] = {}

    def chunk(prompt_index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
        index = prompt_index * n + delta.index
        if echo_texts is not None and index not in offsets:
            delta = fmt.echoed(delta, echo_texts[prompt_index], num_top if want_logprobs else None)
        if not delta.text and delta.finish_reason is None and not (want_logprobs or want_token_ids):
            return None  # text held back (a partial character or a possible stop string)
        return fmt.completion_chunk(
            request_id,
            created,
            model,
            index,
            delta,
            want_logprobs,
            want_token_ids,
            offsets.setdefault(index, fmt.TextOffsets()),
        )

    return sse_events(
        _payloads(
            request_id,
            first,
            items,
            bool(options and options.include_usage),
            bool(options and options.include_usage and options.continuous_usage_stats),
            num_prompt_tokens,
            [],
            chunk,
            lambda usage: fmt.usage_chunk(request_id, created, model, "text_completion", usage),
        )
    )


class ParsedChoices:
    """Chat chunks of replies that the server's parsers read: each choice through its own
    `ReplyStream`, its deltas as `delta.reasoning_content`, `delta.content` and
    `delta.tool_calls`; the last chunk finishes "tool_calls" when the choice had calls.
    `chunk` makes a delta's chunk (its logprobs, token ids); `always`: send a chunk for every
    delta, even one whose text the parsers hold (its tokens' logprobs or ids are asked)."""

    def __init__(self, parsing: ReplyParsing, chunk: Callable[[ChoiceDelta], dict[str, Any]], always: bool) -> None:
        self._parsing = parsing
        self._chunk = chunk
        self._always = always
        self._streams: dict[int, ReplyStream] = {}

    def __call__(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        stream = self._streams.get(delta.index)
        if stream is None:
            stream = self._streams[delta.index] = self._parsing.stream()
        reply = stream.feed(delta.text)
        if delta.finish_reason is not None:
            reply = reply.then(stream.finish())
        body = self._parsing.delta_body(reply)
        if not body and delta.finish_reason is None and not self._always:
            return None
        payload = self._chunk(delta)
        choice = payload["choices"][0]
        choice["delta"] = body
        if delta.finish_reason is not None:
            choice["finish_reason"] = calls_finish_reason(stream.found_calls, delta.finish_reason)
        return payload


class ForcedCalls:
    """Chat chunks of forced tool calls: a named function's text is its arguments, streamed
    as tool-call deltas; "required" calls are held until a choice's output is complete, then
    sent in one chunk (`tools.message`). `chunk` makes a delta's chunk; `always`: send a chunk
    for every delta (its tokens' logprobs or ids are asked)."""

    def __init__(self, calling: ToolCalling, chunk: Callable[[ChoiceDelta], dict[str, Any]], always: bool) -> None:
        self._calling = calling
        self._chunk = chunk
        self._always = always
        self._held: dict[int, list[str]] = {}  # "required": each choice's output so far

    def __call__(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        payload = self._chunk(delta)
        choice = payload["choices"][0]
        if self._calling.name is not None:  # a named function: the text is its arguments
            choice["delta"] = (
                {"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]} if delta.text else {}
            )
            return payload
        self._held.setdefault(delta.index, []).append(delta.text)
        choice["delta"] = {}
        if delta.finish_reason is not None:
            message, choice["finish_reason"] = tools.message(
                self._calling, "".join(self._held.pop(delta.index)), delta.finish_reason
            )
            choice["delta"] = {k: v for k, v in message.items() if k != "role" and v is not None}
            for k, call in enumerate(choice["delta"].get("tool_calls", ())):
                call["index"] = k
        elif not self._always:
            return None
        return payload


def chat_events(
    request_id: str,
    created: int,
    model: str,
    first: Item,
    items: AsyncIterator[Item],
    n: int,
    want_logprobs: bool,
    want_token_ids: bool,
    options: Any,
    num_prompt_tokens: int,
    calling: ToolCalling | None = None,
    parsing: ReplyParsing | None = None,
) -> AsyncIterator[bytes]:
    """`chat_chunks` as server-sent events."""
    return sse_events(
        chat_chunks(
            request_id,
            created,
            model,
            first,
            items,
            n,
            want_logprobs,
            want_token_ids,
            options,
            num_prompt_tokens,
            calling,
            parsing,
        )
    )


def chat_chunks(
    request_id: str,
    created: int,
    model: str,
    first: Item,
    items: AsyncIterator[Item],
    n: int,
    want_logprobs: bool,
    want_token_ids: bool,
    options: Any,
    num_prompt_tokens: int,
    calling: ToolCalling | None = None,
    parsing: ReplyParsing | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """A chat stream's chunks (`chat.completion.chunk`; an error mid-stream ends it as an
    `{"error": ...}` chunk). `calling` (forced tool calls): a named function's arguments
    stream as tool-call deltas; "required" calls come in one chunk once a choice's output is
    complete (`ForcedCalls`). `parsing`: each choice's output streams as the server's parsers
    read it (reasoning, content and tool-call deltas: `ParsedChoices`). The Responses API
    (gateway/responses.py) reads these chunks too."""
    return _payloads(
        request_id,
        first,
        items,
        bool(options and options.include_usage),
        bool(options and options.include_usage and options.continuous_usage_stats),
        num_prompt_tokens,
        _chat_opening(request_id, created, model, n, calling),
        _chat_chunker(request_id, created, model, want_logprobs, want_token_ids, calling, parsing),
        lambda usage: fmt.usage_chunk(request_id, created, model, "chat.completion.chunk", usage),
    )


def _chat_opening(
    request_id: str, created: int, model: str, n: int, calling: ToolCalling | None
) -> list[dict[str, Any]]:
    """Each choice's first chunk (its role); a named function's call opens it."""
    opening = [fmt.chat_chunk(request_id, created, model, i, None, False, False) for i in range(n)]
    if calling is not None and calling.name is not None:
        for payload in opening:
            payload["choices"][0]["delta"] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "index": 0,
                        "id": tools.call_id(),
                        "type": "function",
                        "function": {"name": calling.name, "arguments": ""},
                    }
                ],
            }
    return opening


def _chat_chunker(
    request_id: str,
    created: int,
    model: str,
    want_logprobs: bool,
    want_token_ids: bool,
    calling: ToolCalling | None,
    parsing: ReplyParsing | None,
) -> Callable[[int, ChoiceDelta], dict[str, Any] | None]:
    """What makes a delta's chunk: the server's parsers (`parsing`), else the forced calls
    (`calling`), else the delta as it is; None: no chunk for it (its text is held back)."""
    always = want_logprobs or want_token_ids

    def plain(delta: ChoiceDelta) -> dict[str, Any]:
        return fmt.chat_chunk(request_id, created, model, delta.index, delta, want_logprobs, want_token_ids)

    if parsing is not None:
        parsed = ParsedChoices(parsing, plain, always)
        return lambda prompt_index, delta: parsed(delta)
    if calling is not None:
        forced = ForcedCalls(calling, plain, always)
        return lambda prompt_index, delta: forced(delta)

    def chunk(prompt_index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
        if not delta.text and delta.finish_reason is None and not always:
            return None
        return plain(delta)

    return chunk
