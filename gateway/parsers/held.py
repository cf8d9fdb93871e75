"""Text a streaming parser must hold back: the end of what it has that could begin a marker.

A marker such as `<tool_call>` or `</think>` can arrive split over several deltas; until the
next delta says whether `<tool_c` becomes the marker, it is neither content nor a marker.
"""

from __future__ import annotations

from collections.abc import Iterable


def held_suffix(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of `text` are a proper beginning of one of `markers`
    (the longest such end; 0 when none), so must wait for the next delta."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


def first_marker(text: str, markers: Iterable[str], start: int = 0) -> int:
    """Where the earliest of `markers` begins in `text` from `start`; -1 when none does."""
    found = [i for i in (text.find(m, start) for m in markers) if i >= 0]
    return min(found, default=-1)
