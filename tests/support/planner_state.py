"""The planner's bookkeeping that outlives nothing when it is idle: what tests check is left
behind after every request ended (read from the planner's parts, not through hooks in it)."""

from __future__ import annotations

from scheduler_svc.core.planner import Planner


def leftover_state(planner: Planner) -> dict[str, object]:
    """The non-empty tables among those that must be empty once every request ended: request
    ranks, completion guards and busy counts of the steps in flight."""
    tables = {
        "rank": planner._requests._rank,
        "completion_guard": planner._flight.completion_guard,
        "busy": planner._flight.busy,
    }
    return {name: table for name, table in tables.items() if table}
