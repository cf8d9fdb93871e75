"""Step deadlines: when a micro-batch in flight is late enough to ask whether its stage is
hung, and how large the next steps may be after one was late.

A slow step is not a hung stage (issue 34: a bfloat16 GEMM without BF16 units once made a
2,048-token step last past the fixed 60 s deadline; everything was preempted, the same step
was planned again, and so on for ever). So:

- a micro-batch's deadline scales with its planned work: `timeout_s`, or `slack` times the
  time its tokens take at the recent rate (the stages' compute seconds over tokens, both
  averaged over recent steps), whichever is longer;
- past it, the engine asks the stages for their progress (their compute loops tick per
  layer, and say which step they compute): stages that ticked recently are working, and
  every late step's deadline moves on by its allowance; otherwise a stage is hung, and the
  pipeline is reset as after a crash;
- the step to blame is the one being computed, when it is late itself (a step queued
  behind it is late only for waiting), else the late step when nothing better is known:
  the token cap (`token_cap`) drops below its size and the size becomes a ceiling the cap
  never reaches again (for the engine's life), so that no step is planned again at a size
  that was late. Below the ceiling the cap doubles back after each step that took under a
  quarter of the base timeout.

Pure: no asyncio, no grpc; times in seconds from the caller's clock.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKEN_CAP = 1  # a step of one token always fits a plan; the cap never goes below it


@dataclass
class _Step:
    num_tokens: int
    dispatched_s: float
    deadline_s: float
    extensions: int = 0


class StepDeadlines:
    """Invariants: every tracked micro-batch's deadline is at least `timeout_s` after its
    dispatch; `MIN_TOKEN_CAP <= token_cap <= max_tokens`; the cap is below `ceiling`, the
    smallest size that was late (when any was)."""

    def __init__(self, timeout_s: float, max_tokens: int, slack: float = 4.0, rate_weight: float = 0.2) -> None:
        if timeout_s <= 0 or max_tokens < 1 or slack < 1 or not 0 < rate_weight <= 1:
            raise ValueError("StepDeadlines: timeout_s > 0, max_tokens >= 1, slack >= 1, 0 < rate_weight <= 1")
        self.timeout_s, self.max_tokens, self.slack, self.rate_weight = timeout_s, max_tokens, slack, rate_weight
        self.token_cap = max_tokens
        self.ceiling: int | None = None  # the smallest step size that was late
        self._ewma_s: float | None = None  # the stages' compute seconds a step, recent ones weighted most
        self._ewma_tokens = 0.0  # and its tokens, weighted alike
        self.num_late = 0  # steps that passed their deadline
        self.num_extended = 0  # of them, steps whose stages were still working
        self._steps: dict[int, _Step] = {}

    @property
    def s_per_token(self) -> float | None:
        """Seconds a token takes at the recent rate (None before the first result)."""
        if self._ewma_s is None or self._ewma_tokens <= 0:
            return None
        return self._ewma_s / self._ewma_tokens

    def allowance_s(self, num_tokens: int) -> float:
        """How long a step of `num_tokens` may take before its stages are asked."""
        expected = (self.s_per_token or 0.0) * num_tokens
        return max(self.timeout_s, self.slack * expected)

    def dispatched(self, mb_id: int, num_tokens: int, now_s: float) -> None:
        self._steps[mb_id] = _Step(num_tokens, now_s, now_s + self.allowance_s(num_tokens))

    def returned(self, mb_id: int, now_s: float, compute_s: float | None = None) -> None:
        """A step's result: the rate learns from it (from `compute_s`, the stages' compute
        time, when known: the time in flight also counts the steps queued ahead of it), and
        a quick step lets the cap grow."""
        step = self._steps.pop(mb_id, None)
        if step is None or step.num_tokens <= 0:
            return
        took = max(0.0, now_s - step.dispatched_s)
        spent, w = took if compute_s is None else compute_s, self.rate_weight
        if self._ewma_s is None:
            self._ewma_s, self._ewma_tokens = spent, float(step.num_tokens)
        else:
            self._ewma_s = (1 - w) * self._ewma_s + w * spent
            self._ewma_tokens = (1 - w) * self._ewma_tokens + w * step.num_tokens
        if took < self.timeout_s / 4 and step.num_tokens * 2 > self.token_cap:
            limit = self.max_tokens if self.ceiling is None else max(MIN_TOKEN_CAP, self.ceiling - 1)
            self.token_cap = max(self.token_cap, min(limit, self.token_cap * 2))

    def forget(self, mb_id: int) -> None:
        """A step that failed or was reset: no result will come."""
        self._steps.pop(mb_id, None)

    def clear(self) -> None:
        self._steps.clear()

    def overdue(self, now_s: float) -> tuple[int, float] | None:
        """(micro-batch id, seconds in flight) of the oldest step past its deadline, or None."""
        late = [(mb_id, s) for mb_id, s in self._steps.items() if now_s > s.deadline_s]
        if not late:
            return None
        mb_id, step = min(late, key=lambda item: item[1].dispatched_s)
        return mb_id, now_s - step.dispatched_s

    def late(self, mb_id: int, working: bool, now_s: float, computing: tuple[int, ...] = ()) -> list[int]:
        """The stages were asked about `mb_id`, past its deadline: `working` moves every late
        step's deadline on by its allowance. The step to blame (module docstring; `computing`
        are the steps the stages said they compute) lowers the cap below its size and below
        what its time suggests fits half the base timeout. Returns the blamed steps' ids."""
        if mb_id not in self._steps:
            return []
        late_ids = [i for i, st in self._steps.items() if now_s > st.deadline_s]
        blamed = [i for i in computing if i in late_ids] or ([] if computing else [mb_id])
        self.num_late += 1
        if working:
            self.num_extended += 1
            for i in late_ids:
                step = self._steps[i]
                step.extensions += 1
                step.deadline_s = now_s + self.allowance_s(step.num_tokens)
        for i in blamed:
            step = self._steps[i]
            took = max(now_s - step.dispatched_s, 1e-9)
            fits = int(step.num_tokens * self.timeout_s / took / 2)  # half of what the base timeout held
            self.ceiling = step.num_tokens if self.ceiling is None else min(self.ceiling, step.num_tokens)
            self.token_cap = max(MIN_TOKEN_CAP, min(self.token_cap, step.num_tokens // 2, fits))
        return blamed

    def num_tokens(self, mb_id: int) -> int | None:
        step = self._steps.get(mb_id)
        return None if step is None else step.num_tokens

    def check_integrity(self) -> None:
        assert MIN_TOKEN_CAP <= self.token_cap <= self.max_tokens, self.token_cap
        assert self.ceiling is None or self.token_cap < self.ceiling or self.ceiling <= MIN_TOKEN_CAP, self.ceiling
        for step in self._steps.values():
            assert step.deadline_s >= step.dispatched_s + self.timeout_s - 1e-9, step
