"""A request's timeline as Chrome trace-event JSON, which Perfetto and chrome://tracing open.

The scheduler returns `TimelineEvent`s (wall-clock ns) on a request's last response; the
gateway adds its own spans. Each becomes a complete event (`"ph": "X"`, `ts` and `dur` in
µs). Processes are the parts of the system — gateway, scheduler, one per pipeline stage —
and threads within the scheduler are the request's choices, so that steps of different
choices in flight at once do not overlap on one track.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

GATEWAY_PID = 0
SCHEDULER_PID = 1
FIRST_STAGE_PID = 2


@dataclass(frozen=True)
class Span:
    """One interval the gateway itself recorded (wall-clock ns)."""

    name: str
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)


def _pid(event: Any) -> int:
    if event.HasField("stage_index"):
        return FIRST_STAGE_PID + event.stage_index
    return GATEWAY_PID if event.category == "gateway" else SCHEDULER_PID


def _complete(
    name: str, cat: str, pid: int, tid: int, start_ns: int, end_ns: int, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": start_ns / 1000,
        "dur": (end_ns - start_ns) / 1000,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def chrome_trace(request_id: str, events: Iterable[Any], spans: Sequence[Span] = ()) -> dict[str, Any]:
    """`{"traceEvents": [...]}` for the scheduler's TimelineEvent messages and the gateway's
    spans. Events that never ended (end before start, or no start) are left out."""
    trace: list[dict[str, Any]] = []
    pids: set[int] = {GATEWAY_PID}
    for span in spans:
        if span.end_ns >= span.start_ns > 0:
            trace.append(
                _complete(
                    span.name,
                    "gateway",
                    GATEWAY_PID,
                    0,
                    span.start_ns,
                    span.end_ns,
                    {"request_id": request_id, **span.args},
                )
            )
    for e in events:
        if not e.end_ns >= e.start_ns > 0:
            continue
        pid = _pid(e)
        pids.add(pid)
        tid = e.choice_index if e.HasField("choice_index") else 0
        args: dict[str, Any] = dict(e.args)
        if e.HasField("micro_batch_id"):
            args["micro_batch_id"] = e.micro_batch_id
        if e.HasField("choice_index"):
            args["choice_index"] = e.choice_index
        if e.num_tokens:
            args["num_tokens"] = e.num_tokens
        trace.append(_complete(e.name, e.category or "scheduler", pid, tid, e.start_ns, e.end_ns, args))
    trace.sort(key=lambda ev: (ev["ts"], ev["pid"]))
    names = {GATEWAY_PID: "gateway", SCHEDULER_PID: "scheduler"}
    meta = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"name": names.get(pid, f"stage {pid - FIRST_STAGE_PID}")},
        }
        for pid in sorted(pids)
    ]
    meta += [
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        for pid in sorted(pids)
    ]
    return {"traceEvents": meta + trace, "displayTimeUnit": "ms", "otherData": {"request_id": request_id}}
