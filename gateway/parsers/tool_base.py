"""What every tool-call parser shares: the result types, call ids, the JSON of `arguments`,
the walk over a reply's call section, and the streaming state machine.

A reply is read as plain text up to its *call section*, which begins at a format's marker
(`<tool_call>`, `[TOOL_CALLS]`, ...) anywhere, or at a format's leading character (`{`, `[`)
when that is the reply's first non-blank character. From there the section is a run of
*items* (one marker and what it introduces: one or more calls), with text between and after
them; that text is content. One malformed item makes the whole reply content, with no calls
(as vLLM's parsers answer when theirs fail): a parser never raises on model output.

Streaming gives the same answer as `extract` on the whole reply, whatever the deltas:
content before the section streams as it arrives, less any end that could begin a marker;
from the marker on, everything is held and `finish()` runs `extract` on the whole reply,
so calls come complete (one delta per call: id, name and all of its arguments) and a reply
cut short inside a call comes back as content. Calls usually end a generation, so holding
them costs a token or two; what a streamed call could not do is be taken back when a later
call turns out malformed. A format whose section begins at a leading character says early
when the text cannot be a call (`check_section`), so a JSON or bracketed answer streams.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.parsers.held import first_marker, held_suffix

JSON_BLANK = " \t\n\r"  # the whitespace JSON allows between tokens
MISTRAL_ID_CHARS = string.ascii_letters + string.digits

RawCall = tuple[str, str]  # (name, arguments as JSON text), before an id is given


def new_tool_call_id() -> str:
    """A call id as vLLM makes them: `chatcmpl-tool-` and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def new_mistral_tool_call_id() -> str:
    """Mistral's templates accept only 9 letters or digits as a call id (as vLLM makes them)."""
    return "".join(random.choices(MISTRAL_ID_CHARS, k=9))


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is a JSON object's text as the model wrote it ("{}" for
    none)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole reply read: its content (None when empty or blank) and its calls, in order."""

    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call at `index`: its first piece has `id` and `name`; the `arguments`
    of all its pieces, joined, are the call's `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """As an entry of a chunk's `delta.tool_calls`."""
        function: dict[str, Any] = {} if self.name is None else {"name": self.name}
        function["arguments"] = self.arguments
        head: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            head |= {"id": self.id, "type": "function"}
        return head | {"function": function}


@dataclass(frozen=True)
class StreamDelta:
    """What one delta of a streamed reply adds: content and/or pieces of calls."""

    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


NOTHING = StreamDelta()


def arguments_json(value: Any, written: str | None = None) -> str | None:
    """`value` as a call's `arguments`: a JSON object's text, "{}" for None, a JSON object
    written as a string decoded first; None when it is no JSON object (or holds NaN).
    `written`: the value's JSON text as the model wrote it, passed through as it is (the
    string's content, for an object written as a string); without it (a format that is not
    JSON) the object as compact text."""
    if isinstance(value, str):
        written = value.strip()
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if value is None:
        value, written = {}, None
    if not isinstance(value, dict):
        return None
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") cannot go out as UTF-8: escape it
        return json.dumps(value, separators=(",", ":"))
    except (ValueError, RecursionError):
        return None
    return text if written is None else written


Members = dict[str, tuple[Any, str]]  # a JSON object's members: key -> (value, its text as written)


def object_members(text: str, pos: int) -> tuple[Members, int] | None:
    """The JSON object at `pos` (blanks skipped): each member's value and its text as written
    (a later duplicate key wins, as `json.loads` reads it), and where the object ends; None
    when there is no whole object there."""
    decoder = json.JSONDecoder()
    pos = skip_blank(text, pos)
    if not text.startswith("{", pos):
        return None
    members: Members = {}
    pos = skip_blank(text, pos + 1)
    if text.startswith("}", pos):
        return members, pos + 1
    try:
        while True:
            key, pos = decoder.raw_decode(text, pos)
            pos = skip_blank(text, pos)
            if not isinstance(key, str) or not text.startswith(":", pos):
                return None
            start = skip_blank(text, pos + 1)
            value, end = decoder.raw_decode(text, start)
            members[key] = (value, text[start:end])
            pos = skip_blank(text, end)
            if text.startswith("}", pos):
                return members, pos + 1
            if not text.startswith(",", pos):
                return None
            pos = skip_blank(text, pos + 1)
    except (ValueError, RecursionError):
        return None


def array_texts(text: str, pos: int) -> tuple[list[str], int] | None:
    """Each item of the JSON array at `pos` (blanks skipped) as written, and where the array
    ends; None when there is no whole array there."""
    decoded = decode_json(text, pos)
    if decoded is None or not isinstance(decoded[0], list):
        return None
    decoder, pos, items = json.JSONDecoder(), skip_blank(text, skip_blank(text, pos) + 1), []
    try:
        while not text.startswith("]", pos):
            start = pos
            _, end = decoder.raw_decode(text, start)
            items.append(text[start:end])
            pos = skip_blank(text, end)
            pos = skip_blank(text, pos + 1) if text.startswith(",", pos) else pos
    except (ValueError, RecursionError):
        return None
    return items, decoded[1]


def json_call(members: Members | None, needs_arguments: bool = False) -> RawCall | None:
    """A `{"name": ..., "arguments" | "parameters": {...}}` object (`object_members`) as a call,
    its arguments as written; None when it is not one. Arguments may be absent (none) unless
    `needs_arguments`."""
    if members is None:
        return None
    name = members.get("name", (None, ""))[0]
    if not isinstance(name, str) or not name:
        return None
    key = "arguments" if "arguments" in members else "parameters"
    if needs_arguments and key not in members:
        return None
    arguments = arguments_json(*members.get(key, (None, None)))
    return None if arguments is None else (name, arguments)


def json_call_at(text: str, pos: int, needs_arguments: bool = False) -> tuple[RawCall | None, int] | None:
    """The call object at `pos` (`json_call`) and where it ends; None when no whole JSON value
    is there, (None, end) when it is not a call."""
    decoded = decode_json(text, pos)
    if decoded is None:
        return None
    found = object_members(text, pos)
    return (None if found is None else json_call(found[0], needs_arguments)), decoded[1]


def decode_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at `pos` (blanks skipped) and where it ends; None when there is none."""
    pos = skip_blank(text, pos)
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def skip_blank(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in JSON_BLANK:
        pos += 1
    return pos


def content_of(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    """Reads one model's tool-call syntax out of its reply. A subclass names its `markers`
    and `leading` character and parses one item; this class walks the section.

    `parallel_tool_calls=False` keeps the first call only; `new_id` makes call ids."""

    markers: ClassVar[tuple[str, ...]] = ()
    # every marker the format writes (`markers` and the others: `</tool_call>`, `[ARGS]`): a
    # tokenizer may make them special tokens, and a reply must be decoded with them kept
    marker_tokens: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[str | None] = None  # begins the section as the reply's first non-blank
    default_new_id: ClassVar[Callable[[], str]] = staticmethod(new_tool_call_id)

    def __init__(self, *, parallel_tool_calls: bool = True, new_id: Callable[[], str] | None = None) -> None:
        self.parallel_tool_calls = parallel_tool_calls
        self.new_id = new_id if new_id is not None else self.default_new_id

    def parse_item(self, text: str, pos: int) -> tuple[list[RawCall], int] | None:
        """The calls of the item that begins at `pos` (a marker, or the leading character)
        and where the item ends; None when it is malformed."""
        raise NotImplementedError

    def check_section(self, section: str, new_text: str) -> bool | None:
        """Streaming only: False when no continuation of `section` (the text from where the
        section began; `new_text` is its end that the last delta added) can parse, True once
        it surely stays held, None while undecided. False must be exact: `extract` fails on
        any reply that begins this way."""
        return True

    def section_start(self, text: str) -> int | None:
        body = text.lstrip()
        if self.leading is not None and body.startswith(self.leading):
            return len(text) - len(body)
        start = first_marker(text, self.markers)
        return None if start < 0 else start

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole reply; malformed calls: all of it as content."""
        start = self.section_start(text)
        parsed = None if start is None else self._read_section(text, start)
        if parsed is None:
            return ExtractedToolCalls(content_of(text), [])
        calls, pieces = parsed
        if not self.parallel_tool_calls:
            calls = calls[:1]
        content = "".join(piece for piece in pieces if piece.strip())
        return ExtractedToolCalls(content or None, [ToolCall(self.new_id(), name, args) for name, args in calls])

    def stream(self) -> ToolCallStream:
        """A streaming reader for one choice."""
        return ToolCallStream(self)

    def _read_section(self, text: str, start: int) -> tuple[list[RawCall], list[str]] | None:
        """The section's calls and the text around them (before it, between and after its
        items: content); None when an item is malformed."""
        calls: list[RawCall] = []
        pieces = [text[:start]]
        pos = start
        while pos < len(text):
            item = self.parse_item(text, pos)
            if item is None:
                return None
            found, pos = item
            calls += found
            following = first_marker(text, self.markers, pos)
            following = len(text) if following < 0 else following
            pieces.append(text[pos:following])
            pos = following
        return (calls, pieces) if calls else None


class ToolCallStream:
    """Reads one choice's reply delta by delta; `feed` and `finish` give what each adds.

    Invariant: the content given so far is a beginning of `extract(reply).content`, and
    nothing of a call is given before `finish`."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._deltas: list[str] = []  # the whole reply so far
        self._pending = ""  # before the section: text not given yet (blank, or a marker's start)
        self._num_sent = 0  # characters given as content so far
        self._section: str | None = None  # the section so far, while undecided
        self._in_section = False
        self._released = False  # the section cannot parse: all content from here on
        self._finished = False

    def feed(self, delta: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("feed after finish")
        if not delta:
            return NOTHING
        if self._released:
            return self._send(delta)
        self._deltas.append(delta)
        if self._in_section:
            return self._grow_section(delta)
        return self._read_content(self._pending + delta)

    def finish(self) -> StreamDelta:
        """The rest: held content, and the calls when the reply has a well-formed section."""
        if self._finished:
            raise RuntimeError("finish twice")
        self._finished = True
        if self._released:
            return NOTHING
        if not self._in_section:
            held, self._pending = self._pending, ""
            return self._send(held) if (self._num_sent or held.strip()) else NOTHING
        result = self._parser.extract("".join(self._deltas))
        rest = (result.content or "")[self._num_sent :]
        pieces = tuple(ToolCallDelta(i, call.id, call.name, call.arguments) for i, call in enumerate(result.calls))
        return StreamDelta(rest or None, pieces)

    def _send(self, text: str) -> StreamDelta:
        self._num_sent += len(text)
        return StreamDelta(text or None)

    def _read_content(self, text: str) -> StreamDelta:
        """Before the section (`text`: all not given yet): give what cannot begin it; hold a
        blank start (a reply may be all blank: no content) and any end that could begin a
        marker."""
        started = self._num_sent > 0
        if not started and not text.strip():
            self._pending = text
            return NOTHING
        start = self._section_start(text, started)
        if start is not None:
            before = text[:start]
            self._pending = "" if (started or before.strip()) else before
            sent = NOTHING if self._pending else self._send(before)
            return self._merge(sent, self._open_section(text[start:]))
        keep = held_suffix(text, self._parser.markers)
        ready = text[: len(text) - keep]
        if not started and not ready.strip():
            self._pending = text
            return NOTHING
        self._pending = text[len(ready) :]
        return self._send(ready)

    def _section_start(self, text: str, started: bool) -> int | None:
        if not started:  # `text` is the whole reply so far: its leading character counts
            return self._parser.section_start(text)
        start = first_marker(text, self._parser.markers)
        return None if start < 0 else start

    def _open_section(self, section: str) -> StreamDelta:
        self._in_section = True
        self._section = ""
        return self._grow_section(section)

    def _grow_section(self, delta: str) -> StreamDelta:
        if self._section is None:  # decided: held to the end
            return NOTHING
        self._section += delta
        verdict = self._parser.check_section(self._section, delta)
        if verdict is None:
            return NOTHING
        section, self._section = self._section, None
        if verdict:
            return NOTHING
        self._released = True  # not a call: what was held goes out as content
        held, self._pending = self._pending, ""
        return self._send(held + section)

    @staticmethod
    def _merge(first: StreamDelta, second: StreamDelta) -> StreamDelta:
        content = (first.content or "") + (second.content or "")
        return StreamDelta(content or None, first.tool_calls + second.tool_calls)
