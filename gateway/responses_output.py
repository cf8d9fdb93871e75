"""Responses API objects from the chat route's results (gateway/responses.py converts the
request): a whole chat response (`openai_format.chat_response`) as one `response` object,
and a chat stream's chunks (`streaming.chat_chunks`) as the Responses events.

A reply becomes output items in the order the chat reply holds its parts: a `reasoning` item
(`reasoning_content`, with `--reasoning-parser`), a `message` with one `output_text` part
(the content), a `function_call` per tool call. A reply with neither content nor calls still
has its (empty) message. The last item is `incomplete`, as the response is, when generation
stopped at `max_output_tokens` (or the context's end); every other item is `completed`.

Streamed, each item opens (`response.output_item.added`, then for text its
`response.content_part.added`) when its first delta comes and closes (`*.done`,
`response.content_part.done`, `response.output_item.done`) when the next item opens or the
reply ends; the stream starts with `response.created` and `response.in_progress` and ends with
`response.completed`, whose response has the status (`completed` or `incomplete`, as vLLM
streams it), or, after an error, with `error` and `response.failed`. Every event carries its
`sequence_number`, from 0.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- the response object -------------------------------------------------------------------


def response_head(response_id: str, model: str, request: dict[str, Any]) -> dict[str, Any]:
    """A response's fields known before generation, from the request (its fields by alias,
    as `ResponsesRequest.model_dump(by_alias=True)` gives them)."""
    text = request.get("text") or {}
    text_format = {k: v for k, v in (text.get("format") or {"type": "text"}).items() if v is not None}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": None,
        "store": request.get("store", True),
        "temperature": request.get("temperature"),
        "text": {"format": text_format},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "background": False,
        "metadata": request.get("metadata") or {},
        "user": request.get("user"),
        "usage": None,
    }


def usage_body(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Chat's usage (`openai_format.usage_body`) as the Responses API counts it."""
    chat_usage = chat_usage or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage.get("total_tokens", 0),
    }


def finished(
    head: dict[str, Any], output: list[dict[str, Any]], usage: dict[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    """The response once generation ended: `incomplete` (reason `max_output_tokens`) when it
    stopped at its length limit, else `completed`."""
    incomplete = finish_reason == "length"
    return {
        **head,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "completed_at": None if incomplete else int(time.time()),
        "output": output,
        "usage": usage,
    }


def message_item(text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def whole_response(head: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """The response of a chat response (`openai_format.chat_response`, one choice)."""
    choice = chat["choices"][0] if chat["choices"] else {"message": {}, "finish_reason": None}
    message, finish_reason = choice["message"], choice["finish_reason"]
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"], "completed"))
    if message.get("content") or not message.get("tool_calls"):
        output.append(message_item(message.get("content") or "", "completed"))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        output.append(function_call_item(call["id"], function["name"], function["arguments"], "completed"))
    response = finished(head, output, usage_body(chat.get("usage")), finish_reason)
    output[-1]["status"] = "incomplete" if response["status"] == "incomplete" else "completed"
    return response


# --- the events ----------------------------------------------------------------------------


class ResponseEvents:
    """One streamed response's events from its chat chunks, numbered from 0. `output` is the
    items so far; at most one is open (being streamed), and an item opens only after the one
    before it closed, so the output indices of the events only grow."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._num_events = 0
        self._open: int | None = None  # the output index of the item being streamed
        self._calls: dict[int, int] = {}  # a chat tool call's index -> its item's output index

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._event(kind, response={**self.head, "output": []})
            for kind in ("response.created", "response.in_progress")
        ]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (its usage, when it is the usage chunk)."""
        if chunk.get("usage") is not None and not chunk["choices"]:
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for piece in delta.get("tool_calls") or ():
                events += self._call(piece)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def closing(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The finished response, and the events that end the stream with it."""
        events: list[dict[str, Any]] = []
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self._add(message_item("", "in_progress"))
        response = finished(self.head, self.output, usage_body(self.usage), self.finish_reason)
        events += self._close(response["status"])
        return response, [*events, self._event("response.completed", response=response)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error mid-stream (`streaming.stream_error_body`'s `error`): the `error` event and
        `response.failed` with the output so far."""
        code, message = str(error.get("code")), str(error.get("message"))
        # the response's error code is one of OpenAI's few; the `error` event keeps ours
        kind = "rate_limit_exceeded" if error.get("type") == "rate_limit_error" else "server_error"
        response = {
            **self.head,
            "status": "failed",
            "error": {"code": kind, "message": message},
            "output": self.output,
            "usage": usage_body(self.usage),
        }
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event("response.failed", response=response),
        ]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self.output[self._open]["type"] != kind:
            events += self._add(
                message_item("", "in_progress") if kind == "message" else reasoning_item("", "in_progress")
            )
        item = self.output[self._open]
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        return [
            *events,
            self._event(
                _DELTA[kind], item_id=item["id"], output_index=self._open, content_index=0, delta=text, **extra
            ),
        ]

    def _call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta: a new call (it has an id) opens an item; arguments add to it."""
        function = piece.get("function") or {}
        events: list[dict[str, Any]] = []
        if piece.get("id"):
            events += self._add(function_call_item(piece["id"], function.get("name") or "", "", "in_progress"))
            self._calls[piece.get("index", 0)] = self._open
        index = self._calls.get(piece.get("index", 0))
        arguments = function.get("arguments") or ""
        if index is not None and arguments:
            item = self.output[index]
            item["arguments"] += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
                )
            )
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self._open = index = len(self.output)
        self.output.append(item)
        added = {**item, "content": []} if "content" in item else item
        events.append(self._event("response.output_item.added", output_index=index, item=copy.deepcopy(added)))
        if "content" in item:
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=copy.deepcopy(item["content"][0]),
                )
            )
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, item = self._open, self.output[self._open]
        self._open = None
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self._event(
                    _DONE[item["type"]],
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    **extra,
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=copy.deepcopy(part),
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        return events


def sse(event: dict[str, Any]) -> bytes:
    """One Responses event as a server-sent event, named by its type (as OpenAI sends them)."""
    data = json.dumps(event, ensure_ascii=False, allow_nan=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def response_events(
    head: dict[str, Any], chunks: AsyncIterator[dict[str, Any]], keep: Callable[[dict[str, Any]], None]
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response, from the chat stream's chunks (closing it closes
    them, which cancels the generation). `keep` gets the finished response before
    `response.completed` is sent, so that a client that reads it can continue it at once."""
    events = ResponseEvents(head)
    async with contextlib.aclosing(chunks):
        for event in events.opening():
            yield sse(event)
        async for chunk in chunks:
            if "error" in chunk:
                for event in events.failed(chunk["error"]):
                    yield sse(event)
                return
            for event in events.feed(chunk):
                yield sse(event)
    response, closing = events.closing()
    keep(response)
    for event in closing:
        yield sse(event)
