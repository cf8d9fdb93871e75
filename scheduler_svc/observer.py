"""What the engine records about its work, behind the few points where that work happens.

The engine (`scheduler_svc.engine`) calls one `EngineObserver` when a request is admitted,
gets tokens and finishes, when the planner has planned a step, when a micro-batch comes
back or fails, and when the pipeline is reset and recovers. The observer keeps everything
that is recorded from those points, so the engine's control flow carries none of it:

- the Prometheus metrics (`SchedulerMetrics`) and the `GetStats` counts;
- the OpenTelemetry spans: `scheduler.request` per request, `scheduler.queued` and one
  `scheduler.step` per micro-batch under it (when tracing is on);
- each request's timeline, when it asked for one (`debug_timeline`): queued, its steps and
  the stages' compute in them;
- the pipeline's recent stage spans, for the dashboard (`GetStats include_timeline`);
- the scheduler trace file (`SchedulerConfig.trace_file`): the planner's decisions and the
  engine's events (dispatched, result, aborted, reset, recovered), one JSON line each.

It belongs to the engine's task: every hook is a plain synchronous call from it.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from opentelemetry import trace

from services import telemetry

if TYPE_CHECKING:
    from scheduler_svc.core.planner import MicroBatch, Planner, ScheduledSeq, SeqUpdate
    from scheduler_svc.core.request import Request
    from scheduler_svc.metrics import SchedulerMetrics
    from services.step import StepResult

RECENT_SPANS = 4096

# how a request ended, as its span says: "finished" counts as finished in GetStats, the
# others as aborted
Outcome = Literal["finished", "aborted", "error", "displaced"]


@dataclass
class _Watched:
    """What is recorded about one request while the engine serves it."""

    arrival_ns: int
    timeline: list[dict] | None  # None unless the request asked for one
    span: trace.Span | None = None  # its OpenTelemetry span, when tracing is on
    step_spans: dict[int, int] = field(default_factory=dict)  # micro_batch_id -> start ns
    scheduled: bool = False
    first_token_s: float | None = None
    last_token_s: dict[int, float] = field(default_factory=dict)  # choice index -> when


class EngineObserver:
    """Metrics, spans, timelines, the trace file and the GetStats counts of one engine.

    Reads the planner's decisions (draining them into the trace file), its preemption
    count and its steps in flight; changes nothing else of it.
    """

    def __init__(
        self,
        planner: Planner,
        metrics: SchedulerMetrics,
        clock: Callable[[], float],
        trace_file: str | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self._planner = planner
        # (stage index, micro-batch id, compute start ns, end ns) of the last steps: the
        # pipeline's timeline for the dashboard (GetStats include_timeline)
        self.recent_spans: deque[tuple[int, int, int, int, int]] = deque(maxlen=RECENT_SPANS)
        # counts for GetStats
        self.num_micro_batches = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_recoveries = 0
        self.active_ns = 0  # wall time with at least one live request: the stages' chance to work
        self._tick_ns = time.monotonic_ns()
        self._requests: dict[str, _Watched] = {}
        self._mb_requests: dict[int, list[str]] = {}  # micro_batch_id -> its requests (tracing on)
        self._seen_preemptions = 0
        # the prefix-cache counters move with the KV service's answers (when it caches)
        self._prefix_caching = prefix_caching
        self._seen_prefix = (0, 0)
        self._tracing = telemetry.enabled()
        self.num_late_steps = 0  # steps past their deadline (core/deadlines.py)
        self._tracer = telemetry.tracer("pagoda.scheduler")
        self._trace_file = open(trace_file, "a") if trace_file else None  # noqa: SIM115

    def close(self) -> None:
        if self._trace_file:
            self._trace_file.close()

    def mark_time(self, busy: bool) -> None:
        """Time passes: since the last mark it counts as active if a request was live (`busy`)."""
        now = time.monotonic_ns()
        if busy:
            self.active_ns += now - self._tick_ns
        self._tick_ns = now

    # --- requests ------------------------------------------------------------------------

    def request_admitted(self, request: Request) -> None:
        """A request is queued: its span starts (the stages' spans will hang under it, so
        `request.trace_context` names it from now on) and its prompt tokens count."""
        watched = _Watched(time.time_ns(), [] if request.debug_timeline else None)
        if self._tracing:
            watched.span = self._tracer.start_span(
                "scheduler.request",
                context=telemetry.context_from(request.trace_context),
                start_time=watched.arrival_ns,
                attributes={
                    "pagoda.request_id": request.request_id,
                    "pagoda.num_prompt_tokens": len(request.prompt),
                    "pagoda.n": request.options.n,
                },
            )
            request.trace_context = telemetry.traceparent_of(watched.span)
        self._requests[request.request_id] = watched
        self.num_prompt_tokens += len(request.prompt)
        self.metrics.on_arrival(len(request.prompt))

    def tokens_delivered(self, update: SeqUpdate) -> None:
        """A sequence's new tokens go to its client: time to first token, between tokens."""
        num_tokens = len(update.new_token_ids)
        self.num_generated_tokens += num_tokens
        request = update.seq.request
        watched = self._requests.get(request.request_id)
        if watched is None or not num_tokens:
            return
        now = self.clock()
        self.metrics.on_tokens(num_tokens)
        if watched.first_token_s is None:
            watched.first_token_s = now
            self.metrics.on_first_token(now - request.arrival_s)
        previous = watched.last_token_s.get(update.seq.index)
        if previous is not None:
            self.metrics.on_inter_token(now - previous)
        watched.last_token_s[update.seq.index] = now

    def request_finished(self, request: Request, reason: str | None, outcome: Outcome) -> list[dict]:
        """A request ended: counted under finish `reason` (None: not counted, as at shutdown),
        its span ended with `outcome`. Returns its timeline (empty unless it asked for one)."""
        if reason is not None:
            if outcome == "finished":
                self.num_finished += 1
            else:
                self.num_aborted += 1
            if outcome == "aborted":
                self._trace({"event": "aborted", "request_id": request.request_id})
            self.metrics.on_finished(reason, self.clock() - request.arrival_s)
        watched = self._requests.pop(request.request_id, None)
        if watched is None:
            return []
        if watched.span is not None:
            watched.span.set_attribute("pagoda.outcome", outcome)
            watched.span.set_attribute("pagoda.num_output_tokens", request.num_output_tokens)
            watched.span.end()
        return list(watched.timeline) if watched.timeline is not None else []

    def request_forgotten(self, request_id: str) -> None:
        """The engine let go of a request the planner no longer knew: nothing more is recorded
        about it (its span is left open, as nothing ended it)."""
        self._requests.pop(request_id, None)

    # --- micro-batches -------------------------------------------------------------------

    def micro_batch_planned(self, mb: MicroBatch | None) -> None:
        """The planner planned a step (`mb`, or None when nothing fit): its decisions are
        traced, and a micro-batch about to be sent is counted, traced as dispatched and
        opens a step on each of its requests (the first one ends their time queued)."""
        self._trace_decisions()
        self._note_prefix_lookups()
        if mb is None:
            return
        mb_id = mb.micro_batch_id
        self.num_micro_batches += 1
        self.metrics.on_micro_batch(mb.num_tokens)
        self._note_preemptions()
        now_ns = time.time_ns()
        if self._tracing:
            self._mb_requests[mb_id] = list({s.seq.request.request_id for s in mb.seqs})
        self._trace(
            {
                "event": "dispatched",
                "micro_batch_id": mb_id,
                "num_tokens": mb.num_tokens,
                "in_flight": len(self._planner.in_flight),
                "t": self.clock(),
                "wall_ns": now_ns,
            }
        )
        for s in mb.seqs:
            watched = self._requests.get(s.seq.request.request_id)
            if watched is not None:
                self._step_started(watched, s, mb_id, now_ns)

    def micro_batch_returned(self, result: StepResult, now: float) -> None:
        """A micro-batch's result arrived (at `now`) and the planner took it in: traced with
        the planner's decisions; the stages' compute spans and the requests' steps end."""
        mb_id = result.step_id
        self._trace(
            {
                "event": "result",
                "micro_batch_id": mb_id,
                "t": now,
                "wall_ns": time.time_ns(),
                "stages": [
                    [t.stage_index, t.received_ns, t.compute_start_ns, t.compute_end_ns] for t in result.timings
                ],
            }
        )
        self._trace_decisions()
        now_ns = time.time_ns()
        computed = [t for t in result.timings if t.compute_start_ns]
        for t in computed:
            self.recent_spans.append((t.stage_index, mb_id, t.compute_start_ns, t.compute_end_ns, t.received_ns))
        for request_id in self._mb_requests.pop(mb_id, ()):
            watched = self._requests.get(request_id)
            if watched is not None and watched.span is not None and mb_id in watched.step_spans:
                self._child_span(
                    watched, "scheduler.step", watched.step_spans.pop(mb_id), now_ns, {"pagoda.micro_batch_id": mb_id}
                )
        for watched in self._requests.values():
            if watched.timeline is not None:
                _end_steps_on_timeline(watched.timeline, mb_id, now_ns, computed)

    def micro_batch_failed(self, mb_id: int) -> None:
        """A micro-batch failed and the planner handled it: its step spans will not end; the
        planner's decisions are traced."""
        self._mb_requests.pop(mb_id, None)
        self._trace_decisions()

    # --- the pipeline --------------------------------------------------------------------

    def pipeline_reset(self, detail: str, preempted: Sequence[Request]) -> None:
        """Everything in flight was dropped (`detail` says why) and `preempted` preempted."""
        self._mb_requests.clear()
        for watched in self._requests.values():
            watched.step_spans.clear()
        self._trace_decisions()
        self._trace({"event": "reset", "reason": detail, "preempted": [r.request_id for r in preempted]})

    def step_late(
        self, mb_id: int, num_tokens: int, working: bool, token_cap: int, detail: str, blamed: dict[int, int]
    ) -> None:
        """A step passed its deadline: its stages were `working` (waited on) or hung (reset);
        `blamed` (id -> tokens) are the steps too large for it, and later steps hold at most
        `token_cap` tokens."""
        self.num_late_steps += 1
        self._trace(
            {
                "event": "late",
                "micro_batch_id": mb_id,
                "num_tokens": num_tokens,
                "working": working,
                "token_cap": token_cap,
                "blamed": sorted(blamed.items()),
                "detail": detail,
                "t": self.clock(),
                "wall_ns": time.time_ns(),
            }
        )

    def pipeline_recovered(self, epochs: list[int]) -> None:
        """The stages and the KV service answer again, the stages at these epochs."""
        self.num_recoveries += 1
        self._trace({"event": "recovered", "epochs": epochs})

    # --- helpers -------------------------------------------------------------------------

    def _step_started(self, watched: _Watched, s: ScheduledSeq, mb_id: int, now_ns: int) -> None:
        if watched.span is not None:
            watched.step_spans[mb_id] = now_ns
        if not watched.scheduled:
            watched.scheduled = True
            self.metrics.on_scheduled(self.clock() - s.seq.request.arrival_s)
            if watched.span is not None:
                self._child_span(watched, "scheduler.queued", watched.arrival_ns, now_ns, {})
            if watched.timeline is not None:
                watched.timeline.append(
                    {"name": "queued", "category": "scheduler", "start_ns": watched.arrival_ns, "end_ns": now_ns}
                )
        if watched.timeline is not None:
            watched.timeline.append(
                {
                    "name": "step",
                    "category": "scheduler",
                    "micro_batch_id": mb_id,
                    "choice_index": s.seq.index,
                    "num_tokens": s.num_tokens,
                    "start_ns": now_ns,
                    "end_ns": 0,
                }
            )

    def _child_span(self, watched: _Watched, name: str, start_ns: int, end_ns: int, attributes: dict) -> None:
        span = self._tracer.start_span(
            name, context=trace.set_span_in_context(watched.span), start_time=start_ns, attributes=attributes
        )
        span.end(end_time=end_ns)

    def _note_prefix_lookups(self) -> None:
        totals = (self._planner.num_prefix_query_tokens, self._planner.num_prefix_hit_tokens)
        if self._prefix_caching and totals != self._seen_prefix:
            self.metrics.on_prefix_lookups(totals[0] - self._seen_prefix[0], totals[1] - self._seen_prefix[1])
        self._seen_prefix = totals

    def _note_preemptions(self) -> None:
        delta = self._planner.num_preemptions - self._seen_preemptions
        if delta:
            self.metrics.on_preempted(delta)
            self._seen_preemptions = self._planner.num_preemptions

    def _trace_decisions(self) -> None:
        """The planner's decisions since the last call, into the trace file (dropped without one)."""
        decisions = self._planner.decisions
        if not decisions:
            return
        if self._trace_file:
            now = self.clock()
            for d in decisions:
                d.setdefault("t", now)
                self._trace_file.write(json.dumps(d) + "\n")
            self._trace_file.flush()
        decisions.clear()

    def _trace(self, entry: dict) -> None:
        if self._trace_file:
            entry.setdefault("t", self.clock())
            self._trace_file.write(json.dumps(entry) + "\n")
            self._trace_file.flush()


def _end_steps_on_timeline(timeline: list[dict], mb_id: int, now_ns: int, computed: list) -> None:
    """A request's steps in micro-batch `mb_id` end at `now_ns`, and the stages' compute in
    it (`computed`: their timings) joins its timeline; nothing if it had no step there."""
    steps = [e for e in timeline if e.get("micro_batch_id") == mb_id and e["name"] == "step"]
    if not steps:
        return
    for e in steps:
        e["end_ns"] = now_ns
    for t in computed:
        timeline.append(
            {
                "name": f"stage {t.stage_index} compute",
                "category": "stage",
                "micro_batch_id": mb_id,
                "stage_index": t.stage_index,
                "start_ns": t.compute_start_ns,
                "end_ns": t.compute_end_ns,
            }
        )
