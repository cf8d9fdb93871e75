"""A stage's compute progress, for telling a slow step from a hung stage.

The compute thread ticks (`tick`) after every decoder layer and at each step's start and
end; the event loop reads the count and the last tick's time to answer the scheduler's
statistics (`StageStats.num_progress_ticks`, `progress_age_ns`, `computing_micro_batch_id`).
Plain attribute writes and reads of ints: atomic under the GIL, so no lock.
"""

from __future__ import annotations

import time


class StageProgress:
    """Invariant: `num_ticks` never decreases; `last_tick_ns` is the monotonic time of the
    latest tick (the start before the first)."""

    def __init__(self) -> None:
        self.num_ticks = 0
        self.last_tick_ns = time.monotonic_ns()
        self.micro_batch_id = 0  # the step being computed, 0 when none

    def tick(self) -> None:
        self.num_ticks += 1
        self.last_tick_ns = time.monotonic_ns()

    def step_started(self, micro_batch_id: int) -> None:
        self.micro_batch_id = micro_batch_id
        self.tick()

    def step_ended(self) -> None:
        self.micro_batch_id = 0
        self.tick()

    def age_ns(self) -> int:
        return time.monotonic_ns() - self.last_tick_ns
