"""One choice's output text: detokenization and stop strings together."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Literal, NamedTuple

from services.text.detokenizer import IncrementalDetokenizer
from services.text.stop import StopStringMatcher
from services.text.tokenizer import Tokenizer

__all__ = ["FinishReason", "TextDelta", "TextOutputProcessor"]

FinishReason = Literal["stop", "length"]


class TextDelta(NamedTuple):
    """What one call to `TextOutputProcessor` produced."""

    text: str  # new text to send to the client ("" when nothing became stable)
    finished: bool  # the choice is over; after a stop string, abort it downstream
    finish_reason: FinishReason | None  # set once finished
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any


class TextOutputProcessor:
    """Token ids in, text deltas out, for one choice of one request.

    Tokens go through an `IncrementalDetokenizer`, text through a `StopStringMatcher`. When a
    stop string matches, the choice is finished at once (`TextDelta.finished`, finish reason
    "stop"): the caller aborts it downstream and later tokens are ignored. Otherwise the
    caller ends it with `finish`, saying whether a stop token did ("stop") or not ("length").
    `keep_special_tokens`: special tokens decoded as text even when skipped otherwise (a
    parser's markers; `IncrementalDetokenizer`).
    Invariant: `text` is the concatenation of every delta's text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        prompt_token_ids: Sequence[int] = (),
        keep_special_tokens: Collection[str] = (),
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            prompt_token_ids=prompt_token_ids,
            keep_special_tokens=keep_special_tokens,
        )
        self._matcher = StopStringMatcher(stop, include_stop_str_in_output=include_stop_str_in_output)
        self._include_stop = include_stop_str_in_output
        self._token_ids: list[int] = []
        self._chunks: list[str] = []
        self._finish_reason: FinishReason | None = None
        self._stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        """Every token accepted (a copy): those pushed before the choice finished."""
        return list(self._token_ids)

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        """The stop string, or the stop token id, that finished the choice; else None."""
        return self._stop_reason

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Adds generated tokens; returns the text that became stable. A finished choice
        ignores them."""
        if self.finished:
            return self._delta("")
        ids = list(token_ids)
        self._token_ids.extend(ids)
        return self._delta(self._match(self._detokenizer.push(ids)))

    def finish(self, token_ids: Sequence[int] = (), *, stop_token_id: int | None = None) -> TextDelta:
        """Ends the choice with its last tokens, releasing any held-back text.

        `stop_token_id`: the stop token (eos or a requested stop id) that ended generation,
        None when it ended for length. When it is the last of `token_ids`, its text is left out
        (unless `include_stop_str_in_output`), as OpenAI and vLLM leave it out. A choice already
        finished by a stop string returns an empty delta.
        """
        if self.finished:
            return self._delta("")
        self._token_ids.extend(token_ids)
        visible = list(token_ids)
        if stop_token_id is not None and visible and visible[-1] == stop_token_id and not self._include_stop:
            visible.pop()
        text = self._match(self._detokenizer.push(visible) + self._detokenizer.flush())
        if not self.finished:
            text += self._matcher.finish()
            self._finish_reason = "length" if stop_token_id is None else "stop"
            self._stop_reason = stop_token_id
        return self._delta(text)

    def _match(self, text: str) -> str:
        released, stop = self._matcher.push(text)
        if stop is not None:
            self._finish_reason, self._stop_reason = "stop", stop
        return released

    def _delta(self, text: str) -> TextDelta:
        if text:
            self._chunks.append(text)
        return TextDelta(text, self.finished, self._finish_reason, self._stop_reason)
