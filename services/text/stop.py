"""Stop strings found in streamed text, across however the text was split into deltas."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["StopMatch", "StopStringMatcher"]


class StopMatch(NamedTuple):
    """What one `StopStringMatcher.push` releases."""

    text: str  # text that can be shown: it is not, and can never become, part of a stop
    stop: str | None  # the stop string that just matched; the output ends with `text`


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas (OpenAI's `stop`).

    It holds back the longest suffix of the text that is a proper prefix of some stop string,
    since the next delta may complete it; everything before that is released. On a match the
    text is cut just before the stop string (or after it, with `include_stop_str_in_output`)
    and the matcher is done: later pushes release nothing.

    "First" means the stop whose last character comes earliest in the text, and of those the
    one that starts earliest: the one a reader going character by character would see first.
    So the released text and the stop found do not depend on how the text was split into
    deltas. Invariant: released text + held-back text == text pushed (before a match).
    """

    def __init__(self, stop: Iterable[str], *, include_stop_str_in_output: bool = False) -> None:
        stops = tuple(dict.fromkeys(stop))
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
        self._stops = stops
        self._include_stop = include_stop_str_in_output
        self._max_held = max((len(s) for s in stops), default=1) - 1
        self._proper_prefixes = frozenset(s[:i] for s in stops for i in range(1, len(s)))
        self._held = ""
        self._matched: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    @property
    def held_text(self) -> str:
        """Text pushed but not yet released: the start of a possible stop string."""
        return self._held

    def push(self, text: str) -> StopMatch:
        """Adds a delta; returns the text now safe to release and the stop string if one just
        matched."""
        if self._matched is not None or not text:
            return StopMatch("", None)
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self._matched = stop
            return StopMatch(buffer[:start + len(stop) if self._include_stop else start], stop)
        num_held = self._num_held(buffer)
        self._held = buffer[len(buffer) - num_held:]
        return StopMatch(buffer[:len(buffer) - num_held], None)

    def finish(self) -> str:
        """At the end of the text: releases what was held back (it can match nothing now)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_held(self, buffer: str) -> int:
        for n in range(min(self._max_held, len(buffer)), 0, -1):
            if buffer[-n:] in self._proper_prefixes:
                return n
        return 0
