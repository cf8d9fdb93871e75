"""Speculative decoding as the planner sees it: the one place that decides which drafts a
decode step verifies (the drafting state itself, n-gram index and back-off: speculation.py).

The planner asks at four named points and knows nothing else of drafting:

    policy.drafts(seq, budget, running)          propose: the drafts a decode step verifies
    policy.waits_for_drafts(seq, running)        propose: no placeholder step, drafts instead
    policy.verified(seq, record, num_sampled)    on_result: the verify step's kept drafts
    policy.offer(seq, drafts)                    on_result: a draft model's next drafts

A new draft method is a branch of `_candidates` here (and of `waits_for_drafts`).
"""

from __future__ import annotations

from collections.abc import Sized

from scheduler_svc.core import pooling
from scheduler_svc.core.in_flight import ScheduledSeq
from scheduler_svc.core.request import Sequence
from scheduler_svc.core.speculation import Drafts, SpecStats


class SpeculationPolicy:
    """Speculative decoding as the planner sees it: up to `num_speculative_tokens` drafts per
    decode step ("ngram": looked up in the sequence's own tokens; "draft_model": what the last
    stage offered with the step before), none for pooling requests or while more than
    `max_batch` requests run. `stats` counts the verify steps that came back.

    Each sequence's drafting state lives on it (`Sequence.drafts`, made on first use); the
    policy holds only its settings and the counters."""

    def __init__(
        self,
        num_speculative_tokens: int = 0,
        method: str = "ngram",
        lookup_min: int = 1,
        lookup_max: int = 1,
        max_batch: int | None = None,
        max_model_len: int = 1 << 31,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.method = method
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def max_lookahead(self) -> int:
        """Slots the KV service may hold past a sequence's told tokens: a verify step's drafts,
        or a placeholder step's one."""
        return max(1, self.num_speculative_tokens)

    def drafts(self, seq: Sequence, budget: int, running: Sized) -> tuple[int, ...]:
        """The drafts a decoding sequence's next step verifies, within the step's token
        `budget`, its `max_tokens` and the context length; () for none (this takes the
        sequence's turn: a sequence backing off counts down)."""
        if not self._drafts_now(seq, running):
            return ()
        k = min(
            self.num_speculative_tokens,
            budget,
            seq.request.options.max_tokens - len(seq.output) - 1,
            self.max_model_len - seq.num_tokens,
        )
        if k <= 0:
            return ()
        state = self._state(seq)
        if not state.take_turn():
            return ()
        return self._candidates(seq, state, k)

    def waits_for_drafts(self, seq: Sequence, running: Sized) -> bool:
        """Whether this sequence's next step should rather wait for the token in flight and
        verify drafts than be a placeholder step (which cannot carry drafts: they follow the
        token it takes): while its tokens continue an earlier n-gram (or the draft model
        offered drafts) and it is not backing off."""
        if not self.num_speculative_tokens or not self._drafts_now(seq, running):
            return False  # (asked of every placeholder candidate: off at once when off)
        state = self._state(seq)
        if state.skip:
            return False
        if self.method != "ngram":
            return state.offered is not None
        return bool(self._candidates(seq, state, 1))

    def verified(self, seq: Sequence, record: ScheduledSeq, num_sampled: int) -> None:
        """A verify step came back with `num_sampled` tokens for `seq`: the drafts it kept and
        one more. The sequence stands after those drafts; the counters count them."""
        accepted = max(0, num_sampled - 1)
        seq.num_computed = record.context_len - record.num_drafts + accepted
        self.stats.add(record.num_drafts, accepted)
        if seq.drafts is not None:
            seq.drafts.verified(record.num_drafts, accepted)

    def offer(self, seq: Sequence, drafts: tuple[int, ...]) -> None:
        """A draft model proposed `drafts` to follow the sequence's tokens as they stand."""
        seq.drafts = seq.drafts or Drafts()
        seq.drafts.offered = (seq.num_tokens, drafts)

    def _drafts_now(self, seq: Sequence, running: Sized) -> bool:
        """Whether the sequence may draft at all now (not a pooling request, and the batch
        limit, vLLM's disable_by_batch_size over running requests, not passed)."""
        if not self.num_speculative_tokens or pooling.never_samples(seq.request):
            return False
        return self.max_batch is None or len(running) <= self.max_batch

    @staticmethod
    def _state(seq: Sequence) -> Drafts:
        """The sequence's drafting state, made on first use."""
        if seq.drafts is None:
            seq.drafts = Drafts()
        return seq.drafts

    def _candidates(self, seq: Sequence, state: Drafts, k: int) -> tuple[int, ...]:
        """Up to `k` drafts to follow the sequence's tokens, by the policy's method."""
        if self.method != "ngram":
            offered = state.offered
            return offered[1][:k] if offered is not None and offered[0] == seq.num_tokens else ()
        return state.lookup_in(seq.num_tokens, seq.tokens, k, self.lookup_min, self.lookup_max)
