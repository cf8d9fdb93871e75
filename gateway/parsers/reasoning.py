"""Reasoning output: a reply's `<think>...</think>` part as `reasoning_content`, the rest as
content, whole (`extract`) or streamed (`stream()` per choice, `feed` and `finish`).

`deepseek_r1` (DeepSeek R1 and its distills, QwQ, and any model whose chat template ends
the prompt with `<think>`), as vLLM's `deepseek_r1` parser: the opening `<think>` is
optional, because many templates put it in the prompt; everything up to the first
`</think>` is reasoning, the rest content. With no `</think>` at all the whole reply is
reasoning and content is None: the model was cut short while thinking (vLLM's choice,
followed here).

`qwen3` (Qwen3 with a template where the model writes `<think>` itself): the reply must
begin with `<think>` (blanks before it allowed), else it is all content, as with
`enable_thinking=False`; after it, as `deepseek_r1`. vLLM's older `qwen3` parser gave a
reply with `<think>` but no `</think>` back as content when whole, yet streamed it as
reasoning; here both say reasoning, as vLLM's newer `qwen3` parser does. For templates that
put `<think>` in the prompt (Qwen3-2507 thinking, Qwen3.5), use `deepseek_r1`.

`<think>` counts only at the start of a reply; elsewhere it is text. An empty reasoning or
content is None; neither is stripped (vLLM keeps the blanks after `</think>` too).

`openai_gptoss` (gpt-oss, vLLM's name): the reply is Harmony messages (gateway/parsers/harmony.py);
the analysis channel is reasoning, the final channel and commentary preambles are content.
Its calls are Harmony messages too: when a tool-call parser reads the content after it
(`tool_calls_follow`), the content is the reply's messages other than reasoning, written
back as Harmony for that parser (`openai`) to read; otherwise a call's arguments are content,
as vLLM gives them without a tool-call parser.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, NamedTuple

from gateway.parsers.harmony import (
    MARKERS,
    BodyText,
    Event,
    HarmonyReader,
    Joined,
    MessageStart,
    Route,
    raw_message_part,
)
from gateway.parsers.held import held_suffix

START = "<think>"
END = "</think>"


class ReasoningDelta(NamedTuple):
    """What one delta adds to the reasoning and to the content (None: nothing)."""

    reasoning: str | None
    content: str | None


NONE = ReasoningDelta(None, None)


class ThinkReasoningParser:
    """`<think>reasoning</think>content`; `start_required` says whether a reply without the
    opening tag is all content (True) or reasoning up to `</think>` (False)."""

    start_required: ClassVar[bool] = False
    # the tags, which a tokenizer may make special tokens: a reply is decoded with them kept
    marker_tokens: ClassVar[tuple[str, ...]] = (START, END)

    def __init__(self, *, tool_calls_follow: bool = False) -> None:
        pass  # a `<think>` reply's calls are in its content as written, read or not

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START) :]
        elif self.start_required:
            return None, text or None
        else:
            body = text
        reasoning, end, content = body.partition(END)
        return reasoning or None, (content or None) if end else None

    def stream(self) -> ReasoningStream:
        """A streaming reader for one choice."""
        return ReasoningStream(self.start_required)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """vLLM's `deepseek_r1`: `<think>` optional, no `</think>` means all reasoning."""

    start_required = False


class Qwen3ReasoningParser(ThinkReasoningParser):
    """`<think>` must open the reply, else all content."""

    start_required = True


class GptOssReasoningParser:
    """gpt-oss's Harmony reply: analysis is reasoning, the rest content (the module's docstring)."""

    marker_tokens: ClassVar[tuple[str, ...]] = MARKERS

    def __init__(self, *, tool_calls_follow: bool = False) -> None:
        self.tool_calls_follow = tool_calls_follow

    def extract(self, text: str) -> tuple[str | None, str | None]:
        stream = self.stream()
        first, last = stream.feed(text), stream.finish()
        return (
            (first.reasoning or "") + (last.reasoning or "") or None,
            (first.content or "") + (last.content or "") or None,
        )

    def stream(self) -> GptOssReasoningStream:
        return GptOssReasoningStream(self.tool_calls_follow)


class GptOssReasoningStream:
    """Reads one choice's Harmony reply delta by delta. Invariant: what the deltas give,
    joined, is what `extract` gives; only what `HarmonyReader` holds is held."""

    def __init__(self, tool_calls_follow: bool) -> None:
        self._raw_rest = tool_calls_follow  # content: the messages other than reasoning, as Harmony
        self._reader = HarmonyReader()
        self._route: Route | None = None  # the message being read
        self._reasoning = Joined()
        self._content = Joined()

    def feed(self, delta: str) -> ReasoningDelta:
        return self._read(self._reader.feed(delta))

    def finish(self) -> ReasoningDelta:
        return self._read(self._reader.finish())

    def _read(self, events: list[Event]) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        for event in events:
            if isinstance(event, MessageStart):
                self._route = event.header.route
                self._reasoning.next_message()
                self._content.next_message()
            if self._route is Route.REASONING:
                if isinstance(event, BodyText):
                    reasoning.append(self._reasoning.add(event.text))
            elif self._raw_rest:
                content.append(raw_message_part(event))
            elif isinstance(event, BodyText):
                content.append(self._content.add(event.text))
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)


ReasoningParser = ThinkReasoningParser | GptOssReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser(name: str, *, tool_calls_follow: bool = False) -> ReasoningParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise.
    `tool_calls_follow`: a tool-call parser reads the content (it matters to `openai_gptoss`)."""
    try:
        return REASONING_PARSERS[name](tool_calls_follow=tool_calls_follow)
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


class _Phase(Enum):
    OPENING = "opening"  # before the first non-blank text: is it `<think>`?
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """Reads one choice's reply delta by delta. Invariant: the reasoning and content given
    so far begin `extract(reply)`'s; only a blank start or the start of a tag is held."""

    def __init__(self, start_required: bool) -> None:
        self._start_required = start_required
        self._phase = _Phase.OPENING
        self._held = ""

    def feed(self, delta: str) -> ReasoningDelta:
        if self._phase is _Phase.CONTENT:
            return ReasoningDelta(None, delta or None)
        text, self._held = self._held + delta, ""
        if self._phase is _Phase.OPENING:
            body = text.lstrip()
            if len(body) < len(START) and START.startswith(body):
                self._held = text  # blank, or the start of `<think>`: wait
                return NONE
            if body.startswith(START):
                text = body[len(START) :]
            elif self._start_required:
                self._phase = _Phase.CONTENT
                return ReasoningDelta(None, text or None)
            self._phase = _Phase.REASONING
        return self._read_reasoning(text)

    def finish(self) -> ReasoningDelta:
        """The rest that was held: reasoning, unless the reply has no required `<think>`."""
        held, self._held = self._held, ""
        if self._phase is _Phase.OPENING and self._start_required:
            return ReasoningDelta(None, held or None)
        return ReasoningDelta(held or None, None)

    def _read_reasoning(self, text: str) -> ReasoningDelta:
        end = text.find(END)
        if end >= 0:
            self._phase = _Phase.CONTENT
            return ReasoningDelta(text[:end] or None, text[end + len(END) :] or None)
        keep = held_suffix(text, (END,))
        self._held = text[len(text) - keep :]
        return ReasoningDelta(text[: len(text) - keep] or None, None)
