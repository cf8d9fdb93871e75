"""gpt-oss's Harmony output: a reply read as messages, and the `openai` tool-call parser.

gpt-oss writes its reply as Harmony messages, each a header, `<|message|>`, a body and an end:

    <|channel|>analysis<|message|>User asks 2+2.<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}<|call|>

(one line here per message; the model writes no newlines between them). The prompt ends with
`<|start|>assistant`, so the first header has no `<|start|>`. A header names the channel
(`analysis`: reasoning; `final`: the answer; `commentary`: tool calls and the preambles
before them), the recipient (`to=functions.NAME`, before or after the channel) and the
content type (`<|constrain|>json`, or a bare `json`). `<|return|>` and `<|call|>` end the
reply and are its stop tokens, so the gateway's text usually lacks them: the reply's end
ends its last message too.

Every marker is a special token; the parsers read them as text (`MARKERS`: the gateway
decodes with them kept) and no marker is ever part of what they give out. vLLM reads the
same messages from token ids with openai-harmony; the rules of what goes where are its:

- a message to `functions.NAME` (any channel) is a tool call, its body the arguments;
- the `analysis` channel, or a message to any other recipient (a built-in tool's), is
  reasoning;
- everything else (`final`, and `commentary` without a recipient, the preamble a model
  writes to the user before a call) is content.

The texts of several messages of one kind are joined with "\n" (vLLM's unstreamed answer).
Reading is lenient, never raising: a header cut short or broken by an end marker is dropped,
a stray `<|message|>` or `<|constrain|>` inside a body is dropped, and a `<|start|>` or
`<|channel|>` inside a body ends that message and begins the next.

`openai` (vLLM's `--tool-call-parser openai`): each call is given whole, with its id, once its
message ends (its end marker, the next message, or the reply's end). A call that the reply's
end cuts short (its JSON not whole) is no call and no content, as vLLM drops it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from itertools import pairwise
from typing import NamedTuple

from gateway.parsers.held import first_marker, held_suffix
from gateway.parsers.tool_base import ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta, ToolParser

START = "<|start|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
ENDS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, *ENDS)
HEADER_BREAKS = (MESSAGE, START, *ENDS)  # what ends (or restarts) a header
FUNCTIONS = "functions."
_LONGEST = max(len(m) for m in MARKERS)


class Route(Enum):
    """Where a message's body goes."""

    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"


@dataclass(frozen=True)
class HarmonyHeader:
    """A message's header: `raw` as written (without `<|start|>`), and what it names."""

    raw: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def function(self) -> str | None:
        """The function a tool call calls; None when the message is no call."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :] or None

    @property
    def route(self) -> Route:
        if self.function is not None:
            return Route.CALL
        if self.channel == "analysis" or self.recipient is not None:
            return Route.REASONING
        return Route.CONTENT


def parse_header(raw: str) -> HarmonyHeader:
    """`assistant<|channel|>commentary to=functions.f <|constrain|>json` and its variants
    (the recipient before the channel, a bare content type) read; a role is ignored."""
    words = raw.replace(CHANNEL, f" {CHANNEL} ").replace(CONSTRAIN, f" {CONSTRAIN} ").split()
    channel = recipient = content_type = None
    after_channel = False
    for before, word in pairwise([None, *words]):
        if word in (CHANNEL, CONSTRAIN):
            after_channel = after_channel or word == CHANNEL
        elif word.startswith("to="):
            recipient = word[3:] or None
        elif before == CHANNEL:
            channel = word
        elif before == CONSTRAIN or after_channel:
            content_type = word
    return HarmonyHeader(raw, channel, recipient, content_type)


class MessageStart(NamedTuple):
    header: HarmonyHeader


class BodyText(NamedTuple):
    text: str


class MessageEnd(NamedTuple):
    marker: str  # `<|end|>`, `<|return|>` or `<|call|>`; "" when the next message or the reply's end ended it


Event = MessageStart | BodyText | MessageEnd


class HarmonyReader:
    """A reply read into messages, delta by delta. Invariant: the events of any split of a
    reply (then `finish`) are those of the whole reply, but for body texts split apart;
    only a header (until its `<|message|>`) and a body's end that could begin a marker are
    held."""

    def __init__(self) -> None:
        self._in_body = False
        self._header = ""  # the header so far, while reading one
        self._held = ""  # a body's end that could begin a marker

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        text, self._held = self._held + delta, ""
        pos = 0
        while pos < len(text):
            pos = self._body(text, pos, events) if self._in_body else self._head(text, pos, events)
        return events

    def finish(self) -> list[Event]:
        """The last message's end (a header cut short is dropped)."""
        events: list[Event] = []
        if self._in_body:
            _add_text(events, self._held)
            events.append(MessageEnd(""))
        self._in_body, self._header, self._held = False, "", ""
        return events

    def _head(self, text: str, pos: int, events: list[Event]) -> int:
        """Reads a header from `text[pos:]`; returns where the body begins (the end of `text`
        when the header goes on)."""
        num_old = len(self._header)
        header = self._header + text[pos:]
        num_cut = 0  # characters dropped from the front of `header`
        start = max(0, num_old - _LONGEST)
        while True:
            i = first_marker(header, HEADER_BREAKS, start)
            if i < 0:
                self._header = header
                return len(text)
            marker = next(m for m in HEADER_BREAKS if header.startswith(m, i))
            after = i + len(marker)
            if marker == MESSAGE:
                events.append(MessageStart(parse_header(header[:i])))
                self._header, self._in_body = "", True
                return pos + num_cut + after - num_old
            header, num_cut, start = header[after:], num_cut + after, 0  # restarted, or broken

    def _body(self, text: str, pos: int, events: list[Event]) -> int:
        """Reads a body from `text[pos:]`; returns where it stopped reading."""
        i = first_marker(text, MARKERS, pos)
        if i < 0:
            end = len(text) - held_suffix(text[pos:], MARKERS)
            _add_text(events, text[pos:end])
            self._held = text[end:]
            return len(text)
        _add_text(events, text[pos:i])
        marker = next(m for m in MARKERS if text.startswith(m, i))
        if marker in (MESSAGE, CONSTRAIN):  # stray inside a body: dropped
            return i + len(marker)
        events.append(MessageEnd(marker if marker in ENDS else ""))
        self._in_body = False
        self._header = CHANNEL if marker == CHANNEL else ""  # a `<|channel|>` begins the next header
        return i + len(marker)


def _add_text(events: list[Event], text: str) -> None:
    if text:
        events.append(BodyText(text))


def read_messages(text: str) -> list[Event]:
    """A whole reply's events."""
    reader = HarmonyReader()
    return reader.feed(text) + reader.finish()


class Joined:
    """One field (reasoning or content) made of several messages' texts: "\\n" between two
    messages that have any text, given before the second one's first text."""

    def __init__(self) -> None:
        self._any = False
        self._in_message = False

    def next_message(self) -> None:
        self._in_message = False

    def add(self, text: str) -> str:
        if not text:
            return ""
        separator = "\n" if self._any and not self._in_message else ""
        self._any = self._in_message = True
        return separator + text


def raw_message_part(event: Event) -> str:
    """The event written back as Harmony (a header after `<|start|>`): what a reasoning
    parser hands on to the tool-call parser."""
    if isinstance(event, MessageStart):
        return f"{START}{event.header.raw}{MESSAGE}"
    return event.text if isinstance(event, BodyText) else event.marker


def _is_whole(arguments: str, content_type: str | None) -> bool:
    """Whether a call's body that the reply's end (not its `<|call|>`) ended is complete."""
    if content_type is not None and "json" not in content_type:
        return bool(arguments)
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        return False
    return True


class HarmonyToolParser(ToolParser):
    """vLLM's `openai`: gpt-oss's calls to `functions.NAME`; see the module's docstring."""

    marker_tokens = MARKERS

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.stream()
        deltas = (stream.feed(text), stream.finish())
        content = "".join(d.content or "" for d in deltas)
        calls = [ToolCall(c.id or "", c.name or "", c.arguments) for d in deltas for c in d.tool_calls]
        return ExtractedToolCalls(content or None, calls)

    def stream(self) -> HarmonyToolCallStream:  # (a ToolCallStream's feed and finish)
        return HarmonyToolCallStream(self)


class HarmonyToolCallStream:
    """One choice's reply read delta by delta: content as it comes, each call whole at its
    message's end. Invariant: what the deltas give, joined, is what `extract` gives."""

    def __init__(self, parser: HarmonyToolParser) -> None:
        self._parser = parser
        self._reader = HarmonyReader()
        self._content = Joined()
        self._header: HarmonyHeader | None = None  # the message being read
        self._arguments: list[str] = []  # the body so far, when it is a call
        self._num_calls = 0
        self._finished = False

    def feed(self, delta: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("feed after finish")
        return self._read(self._reader.feed(delta))

    def finish(self) -> StreamDelta:
        if self._finished:
            raise RuntimeError("finish twice")
        self._finished = True
        return self._read(self._reader.finish())

    def _read(self, events: list[Event]) -> StreamDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for event in events:
            if isinstance(event, MessageStart):
                self._header, self._arguments = event.header, []
                self._content.next_message()
                continue
            route = None if self._header is None else self._header.route
            if isinstance(event, BodyText):
                if route is Route.CONTENT:
                    content.append(self._content.add(event.text))
                elif route is Route.CALL:
                    self._arguments.append(event.text)
            elif route is Route.CALL and self._header is not None:
                call = self._close_call(self._header, event.marker)
                calls += [] if call is None else [call]
        return StreamDelta("".join(content) or None, tuple(calls))

    def _close_call(self, header: HarmonyHeader, end_marker: str) -> ToolCallDelta | None:
        """The call whose message `end_marker` ended ("": the next message or the reply's
        end); None when it was cut short, or is a second call where only one is wanted."""
        arguments = "".join(self._arguments).strip()
        cut_short = not end_marker and not _is_whole(arguments, header.content_type)
        if cut_short or (self._num_calls and not self._parser.parallel_tool_calls):
            return None
        call = ToolCallDelta(self._num_calls, self._parser.new_id(), header.function or "", arguments or "{}")
        self._num_calls += 1
        return call
