"""Speculative decoding in the planner: which draft tokens a decoding sequence's next step
verifies (services/speculative.py; the step contract: services/step.py `CachedSeq`).

n-gram (prompt lookup, vLLM's "ngram"): the sequence's last `n` tokens, for `n` from
`prompt_lookup_max` down to `prompt_lookup_min`, are looked up among its earlier tokens
(prompt and output); the tokens that followed their latest earlier occurrence are the drafts.
Each sequence keeps an index of its n-grams (`Drafts`), extended by the tokens it gained
since the last lookup: a lookup costs a few dictionary probes, not a scan of the context.

Drafts from elsewhere (a draft model on the last stage) are handed in with the step that
proposed them (`Drafts.offered`) and used by the next step if they still follow the tokens.

Backing off: a sequence whose verify step kept none of its drafts skips drafting for its next
1, 2, 4 ... 16 decode steps (reset by a step that keeps any), so a load with nothing to copy
soon decodes as without speculation (one position per step, asynchronous placeholder steps).

The planner reaches all of this through `SpeculationPolicy` (speculation_policy.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_BACKOFF_STEPS = 16


@dataclass
class Drafts:
    """One sequence's drafting state (kept across preemption: its tokens only grow)."""

    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)  # n -> n-gram -> latest start
    indexed: dict[int, int] = field(default_factory=dict)  # n -> n-grams starting before this are indexed
    skip: int = 0  # decode steps left without drafting
    misses: int = 0  # verify steps in a row that kept no draft
    offered: tuple[int, tuple[int, ...]] | None = None  # (at num_tokens, drafts) from a draft model

    def lookup(self, tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram (`lookup_max` ... `lookup_min` tokens) that occurred before; () if none."""
        return self.lookup_in(len(tokens), lambda start, end: tokens[start:end], k, lookup_min, lookup_max)

    def lookup_in(
        self, length: int, tokens: Callable[[int, int], list[int]], k: int, lookup_min: int, lookup_max: int
    ) -> tuple[int, ...]:
        """`lookup` over a sequence of `length` tokens read through `tokens(start, end)`: only the
        tokens not indexed yet and the suffix are read, not the whole context at every step."""
        start = min(min(self.indexed.get(n, 0) for n in range(lookup_min, lookup_max + 1)), max(0, length - lookup_max))
        window = tokens(start, length)  # tokens start ... length - 1
        for n in range(lookup_min, lookup_max + 1):  # index n-grams ending before the suffix's last token
            table = self.tables.setdefault(n, {})
            for i in range(self.indexed.get(n, 0), length - n):
                table[tuple(window[i - start : i - start + n])] = i
            self.indexed[n] = max(self.indexed.get(n, 0), length - n)
        for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
            i = self.tables[n].get(tuple(window[length - n - start :]))
            if i is not None:
                return tuple(tokens(i + n, min(i + n + k, length)))
        return ()

    def take_turn(self) -> bool:
        """Whether this decode step may draft (False while backing off)."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        """A verify step came back: back off after one that kept nothing."""
        if num_drafts and not num_accepted:
            self.misses += 1
            self.skip = min(MAX_BACKOFF_STEPS, 2 ** (self.misses - 1))
        elif num_accepted:
            self.misses = 0


@dataclass
class SpecStats:
    """Counted as verify steps come back (vLLM's meanings): `num_drafts` verify steps,
    `num_draft_tokens` tokens proposed in them, `num_accepted_tokens` of those kept;
    `accepted_per_position[j]` how often the draft at position j was kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
