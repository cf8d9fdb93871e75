"""Stop strings found in streamed text, across however the text was split into deltas."""

from __future__ import annotations

from array import array
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
        # One Knuth-Morris-Pratt automaton per stop string: memory and time linear in the
        # stop strings' and the text's lengths (a set of every prefix was quadratic: one
        # stop string of 200,000 characters took gigabytes; issue 16).
        self._failures = [_failure(s) for s in stops]
        self._states = [0] * len(stops)  # per stop: longest prefix of it the text ends with
        self._held = ""
        self._matched: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

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
        offset = len(self._held)  # the automata have read the held text already
        stops, failures, states = self._stops, self._failures, self._states
        for i in range(len(text)):
            ch = text[i]
            done: str | None = None
            for k, stop in enumerate(stops):
                state, failure = states[k], failures[k]
                while state and stop[state] != ch:
                    state = failure[state - 1]
                if stop[state] == ch:
                    state += 1
                if state == len(stop):
                    # ends here; of the stops ending at this character the longest starts first
                    if done is None or len(stop) > len(done):
                        done = stop
                    state = failure[state - 1]
                states[k] = state
            if done is not None:
                end = offset + i + 1
                start = end - len(done)
                self._held, self._matched = "", done
                return StopMatch(buffer[: end if self._include_stop else start], done)
        num_held = min(max(states, default=0), len(buffer))
        self._held = buffer[len(buffer) - num_held :]
        return StopMatch(buffer[: len(buffer) - num_held], None)

    def finish(self) -> str:
        """At the end of the text: releases what was held back (it can match nothing now)."""
        held, self._held = self._held, ""
        return held


def _failure(s: str) -> array:
    """KMP's failure function: out[i] = the longest proper prefix of s[:i + 1] that is also
    its suffix (4 bytes per character)."""
    out = array("i", bytes(4 * len(s)))
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        if s[i] == s[k]:
            k += 1
        out[i] = k
    return out
