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
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, NamedTuple

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

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
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


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser(name: str) -> ThinkReasoningParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; "
                         f"known: {', '.join(sorted(REASONING_PARSERS))}") from None


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
                text = body[len(START):]
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
            return ReasoningDelta(text[:end] or None, text[end + len(END):] or None)
        keep = held_suffix(text, (END,))
        self._held = text[len(text) - keep:]
        return ReasoningDelta(text[:len(text) - keep] or None, None)
