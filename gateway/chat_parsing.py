"""A chat reply read by the server's parsers: reasoning (`--reasoning-parser`) and automatic
tool calls (`--enable-auto-tool-choice --tool-call-parser NAME`, for `tool_choice: "auto"`),
each choice's text split into `reasoning_content`, `content` and `tool_calls`, whole
(`ReplyParsing.message`) or streamed (`ReplyParsing.stream()`, one `ReplyStream` per choice).

Reasoning is read first: its content is what the tool-call parser reads, so a model that
thinks, then calls, gives both. What a stream gives out begins what the whole reply gives
(each parser's own invariant, composed), so streamed and unstreamed answers agree.

The parsers read markers as text, so a reply is decoded with them kept even where the
tokenizer makes them special tokens (`[TOOL_CALLS]`, `<|python_tag|>`, all of gpt-oss's
Harmony markers): `kept_tokens` names them for the detokenizer, which still skips every other
special token.

Shapes, as vLLM returns them: `content` is None when empty; `reasoning_content` (and its
newer name `reasoning`) is there whenever a reasoning parser runs, unless the request sent
`include_reasoning: false`; `tool_calls` is there only when calls were found, and a reply
that found some and ended on its own (not cut by `max_tokens`) finishes "tool_calls".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ReasoningParser,
    ReasoningStream,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    reasoning_parser,
    tool_call_parser,
)

REASONING_FIELDS = ("reasoning_content", "reasoning")  # vLLM's name, and its newer one


@dataclass(frozen=True)
class ParsedReply:
    """A whole reply read: reasoning, content (None when empty) and the calls, in order."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ReplyDelta:
    """What one delta of a streamed reply adds to its reasoning, content and calls."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def then(self, other: ReplyDelta) -> ReplyDelta:
        """This delta followed by `other`, as one."""
        return ReplyDelta(
            _joined(self.reasoning, other.reasoning),
            _joined(self.content, other.content),
            self.tool_calls + other.tool_calls,
        )


def _joined(first: str | None, second: str | None) -> str | None:
    return (first or "") + (second or "") or None


@dataclass(frozen=True)
class ReplyParsing:
    """How one request's replies are read: `tool_parser` and `reasoning_parser` by their
    registered names (None: not read that way; at least one is set), `parallel_tool_calls`
    (False: the first call only) and `include_reasoning` (False: the reasoning is dropped)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True

    def __post_init__(self) -> None:
        if self.tool_parser is None and self.reasoning_parser is None:
            raise ValueError("reply parsing: needs a tool-call parser or a reasoning parser")
        if self.tool_parser is not None:
            tool_call_parser(self.tool_parser)  # ValueError naming the known ones
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)

    @property
    def kept_tokens(self) -> tuple[str, ...]:
        """The markers the replies must be decoded with, special tokens or not."""
        kept: tuple[str, ...] = ()
        if self.tool_parser is not None:
            kept += TOOL_CALL_PARSERS[self.tool_parser].marker_tokens
        if self.reasoning_parser is not None:
            kept += REASONING_PARSERS[self.reasoning_parser].marker_tokens
        return kept

    def parse(self, text: str) -> ParsedReply:
        """A whole reply's reasoning, content and calls."""
        reasoning, content = None, text or None
        if self.reasoning_parser is not None:
            reasoning, content = self._reasoning(self.reasoning_parser).extract(text)
        if self.tool_parser is None:
            return ParsedReply(reasoning, content)
        extracted = self._tools(self.tool_parser).extract(content or "")
        return ParsedReply(reasoning, extracted.content, tuple(extracted.calls))

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A choice's message (OpenAI's shape) and finish reason."""
        reply = self.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if self.shows_reasoning:
            message |= dict.fromkeys(REASONING_FIELDS, reply.reasoning)
        if reply.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
        return message, calls_finish_reason(bool(reply.tool_calls), finish_reason)

    def stream(self) -> ReplyStream:
        """A streaming reader for one choice."""
        return ReplyStream(
            None if self.reasoning_parser is None else self._reasoning(self.reasoning_parser).stream(),
            None if self.tool_parser is None else self._tools(self.tool_parser).stream(),
        )

    def delta_body(self, delta: ReplyDelta) -> dict[str, Any]:
        """A chunk's `delta`: what is new of the reasoning, content and calls ({}: nothing)."""
        body: dict[str, Any] = {}
        if delta.reasoning and self.shows_reasoning:
            body |= dict.fromkeys(REASONING_FIELDS, delta.reasoning)
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = [call.to_openai() for call in delta.tool_calls]
        return body

    @property
    def shows_reasoning(self) -> bool:
        return self.reasoning_parser is not None and self.include_reasoning

    def _reasoning(self, name: str) -> ReasoningParser:
        # gpt-oss's reasoning parser hands its calls on as Harmony only when they are read
        return reasoning_parser(name, tool_calls_follow=self.tool_parser is not None)

    def _tools(self, name: str) -> ToolParser:
        return tool_call_parser(name, parallel_tool_calls=self.parallel_tool_calls)


def calls_finish_reason(found_calls: bool, finish_reason: str | None) -> str | None:
    """ "tool_calls" when calls were found in a reply that ended on its own, else as it ended
    (a reply cut by max_tokens stays "length", as OpenAI reports it)."""
    return "tool_calls" if found_calls and finish_reason == "stop" else finish_reason


class ReplyStream:
    """One choice's reply read delta by delta: reasoning first, its content then through the
    tool-call parser (either may be None: not read). `found_calls` says whether calls were given."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self.found_calls = False

    def feed(self, text: str) -> ReplyDelta:
        if self._reasoning is None:
            return self._through_tools(None, text or None, last=False)
        reasoning, content = self._reasoning.feed(text)
        return self._through_tools(reasoning, content, last=False)

    def finish(self) -> ReplyDelta:
        """What was held: the rest of the reasoning or content, and the calls."""
        reasoning, content = (None, None) if self._reasoning is None else self._reasoning.finish()
        return self._through_tools(reasoning, content, last=True)

    def _through_tools(self, reasoning: str | None, content: str | None, last: bool) -> ReplyDelta:
        if self._tools is None:
            return ReplyDelta(reasoning, content)
        delta = self._tools.feed(content) if content else None
        out = ReplyDelta(reasoning, None if delta is None else delta.content, () if delta is None else delta.tool_calls)
        if last:
            rest = self._tools.finish()
            out = out.then(ReplyDelta(None, rest.content, rest.tool_calls))
        self.found_calls = self.found_calls or bool(out.tool_calls)
        return out
