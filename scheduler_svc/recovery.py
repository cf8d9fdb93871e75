"""How the engine meets failure: a step that failed on a stage, a stage or the KV service
gone (the pipeline is reset and reconnected), a step past its deadline (the stages are asked
whether they still work on it: a slow one is waited for, a hung one is failed as after a
crash), a request that failed too often (it ends with an error instead of being recomputed).

`FailureHandling` is a part of `Engine` (scheduler_svc/engine.py), not an object of its own:
its methods run on the engine's loop task and change the engine's state, named below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.deadlines import StepDeadlines
from scheduler_svc.core.planner import Planner
from scheduler_svc.events import ErrorEvent, KVClient, ProgressReport, StageInfo, StageTransport
from scheduler_svc.observer import EngineObserver, Outcome
from scheduler_svc.outputs import LiveRequest

log = logging.getLogger(__name__)
# how long the stages have to answer whether they work on a late step (a throttled process
# answers late too; one that does not answer in this long is taken for hung)
PROGRESS_ASK_TIMEOUT_S = 5.0
# a stage computing a step is working while its last tick (one a layer) is younger than the
# step timeout or this, whichever is longer: one layer of a large step on a throttled CPU can
# take seconds; a stage that does not answer at all is hung at once
PROGRESS_MIN_AGE_S = 30.0


class FailureHandling:
    """The engine's failure handling. While `healthy` is False nothing is dispatched; the
    loop calls `_recover` until the stages and the KV service answer again."""

    # the engine's state this part reads and changes (Engine.__init__ sets each)
    config: SchedulerConfig
    planner: Planner
    observer: EngineObserver
    kv: KVClient
    transport: StageTransport
    clock: Callable[[], float]
    stages: list[StageInfo]
    healthy: bool
    health_detail: str
    _live: dict[str, LiveRequest]
    _events: asyncio.Queue
    _generation: int
    _deadlines: StepDeadlines
    _asking: bool
    _unhealthy_since: float | None

    if TYPE_CHECKING:  # the engine's own, which this part calls

        async def _connect(self) -> None: ...
        def _background(self, coro) -> None: ...
        def _handle(self, item: tuple[int, object] | None) -> None: ...
        def _finish(
            self, live: LiveRequest, reason: str | None, outcome: Outcome, error: tuple[str, str] | None = None
        ) -> None: ...

    def _on_error(self, event: ErrorEvent) -> None:
        """A micro-batch failed on a stage: its requests are recomputed, and one that failed
        `max_request_failures` times ends with an error. A stage gone down resets everything."""
        if event.micro_batch_id not in self.planner.in_flight:
            return
        log.warning(
            "micro-batch %d failed on stage %d: %s %s",
            event.micro_batch_id,
            event.stage_index,
            event.code,
            event.message,
        )
        self._deadlines.forget(event.micro_batch_id)
        # a stage gone, or one whose LoRA adapters are out of step with the registry's (it
        # lost one: FAILED_PRECONDITION): the reconnect puts the adapters right, and no
        # request of the step is failed for it
        if event.code in ("UNAVAILABLE", "FAILED_PRECONDITION"):
            self._mark_unhealthy(f"stage {event.stage_index}: {event.message}")
            return
        if self.planner.feedback:  # no token comes from this step: later steps must not wait
            seq_ids = [s.seq_id for s in self.planner.in_flight[event.micro_batch_id].seqs]
            self._background(self.transport.abandon(seq_ids))
        now = self.clock()
        failed = [r.request_id for r in self.planner.on_failure(event.micro_batch_id, now)]
        self._count_failures(failed, ("INTERNAL", f"stage {event.stage_index}: {event.code} {event.message}"))
        self.observer.micro_batch_failed(event.micro_batch_id)

    def _check_step_deadline(self) -> None:
        """A step past its deadline (scaled to its planned work) makes the engine ask the
        stages whether they are still working (their compute loops tick per layer): a slow
        step is waited for, a stage that neither answers nor ticks (SIGSTOP, a livelock) is
        hung, and the pipeline is failed and recovered as after a crash. Either way no
        later step is planned at the late one's size (core/deadlines.py)."""
        if not self.healthy or self._asking:
            return
        overdue = self._deadlines.overdue(time.monotonic())
        if overdue is None:
            return
        self._asking = True
        self._background(self._ask_progress(overdue[0], self._generation))

    async def _ask_progress(self, mb_id: int, generation: int) -> None:
        try:
            stats = await self.transport.stage_stats(timeout_s=PROGRESS_ASK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - an unanswered question: not working
            stats = [{"stage_index": -1, "healthy": False, "error": str(exc)}]
        working, detail, computing = progress_verdict(stats, self.config.step_timeout_s)
        self._events.put_nowait((generation, ProgressReport(mb_id, working, detail, computing)))

    def _on_progress(self, report: ProgressReport) -> None:
        self._asking = False
        mb_id = report.micro_batch_id
        size = self._deadlines.num_tokens(mb_id)
        if size is None or mb_id not in self.planner.in_flight or not self.healthy:
            return  # it came back (or everything was reset) meanwhile
        blamed = {
            i: self._deadlines.num_tokens(i)
            for i in self._deadlines.late(mb_id, report.working, time.monotonic(), report.computing)
        }
        cap = self._deadlines.token_cap
        self.planner.cap_step_tokens(cap)
        self.observer.step_late(mb_id, size, report.working, cap, report.detail, blamed)
        if report.working:
            log.warning(
                "micro-batch %d (%d tokens) is past its deadline but its stages are working (%s): "
                "waiting on; later steps hold at most %d tokens",
                mb_id,
                size,
                report.detail,
                cap,
            )
            return
        self._fail_requests_of(
            mb_id,
            (
                "DEADLINE_EXCEEDED",
                f"a step of {size} tokens holding this request did "
                f"not finish on a stage that stopped working ({report.detail})",
            ),
        )
        self._mark_unhealthy(
            f"step deadline: micro-batch {mb_id} ({size} tokens) not finished and its stages "
            f"not working: {report.detail}: a stage is hung"
        )

    def _fail_requests_of(self, mb_id: int, error: tuple[str, str]) -> None:
        """Each request of a failed step counts a failure (`_count_failures`)."""
        requests = {s.seq.request.request_id for s in self.planner.in_flight[mb_id].seqs}
        self._count_failures(requests, error)

    def _count_failures(self, request_ids, error: tuple[str, str]) -> None:
        """Each request counts a failure; one at `max_request_failures` ends with `error`
        instead of being recomputed again."""
        now = self.clock()
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue
            live.failures += 1
            if live.failures >= self.config.max_request_failures:
                self.planner.abort(request_id, now)
                self._live.pop(request_id, None)
                self._finish(live, "error", "error", error)

    def _mark_unhealthy(self, detail: str) -> None:
        if self.healthy:
            log.warning("pipeline unhealthy: %s; preempting everything running", detail)
        self.healthy = False
        self.health_detail = detail
        if self._unhealthy_since is None:
            self._unhealthy_since = self.clock()
        hit = self.planner.reset_all(self.clock())
        self._deadlines.clear()
        self.observer.pipeline_reset(detail, hit)
        self._fail_exports(f"pipeline unavailable: {detail}")

    def _fail_exports(self, message: str) -> None:
        """P/D: a prefill replica's requests (kv_export) fail at once when its pipeline goes
        (their gateway has the decode replica compute the prompt), not after recovery."""
        for live in [live for live in self._live.values() if live.request.export_kv]:
            self.planner.abort(live.request.request_id, self.clock())
            self._live.pop(live.request.request_id, None)
            self._finish(live, "error", "error", ("UNAVAILABLE", message))

    async def _recover(self) -> None:
        """Wait until the chain and the KV service answer again (new epochs), then continue.

        Events queued meanwhile are handled before anything is dispatched: those of older
        connections and results of reset micro-batches are dropped, but the new connection's
        (a stage that went down again) count, and recovery goes on.
        """
        while not self.healthy:
            waited = self.clock() - (self._unhealthy_since or self.clock())
            if waited > self.config.recovery_timeout_s:
                for live in list(self._live.values()):
                    self.planner.abort(live.request.request_id, self.clock())
                    self._live.pop(live.request.request_id, None)
                    self._finish(live, "error", "error", ("UNAVAILABLE", f"pipeline unavailable: {self.health_detail}"))
                self._unhealthy_since = self.clock()
            try:
                await self.kv.reset()
                await self._connect()
                log.info("pipeline healthy again (epochs %s)", [s.epoch for s in self.stages])
                self.observer.pipeline_recovered([s.epoch for s in self.stages])
            except Exception as exc:  # not yet
                self.health_detail = f"recovering: {exc}"
                await asyncio.sleep(0.5)
                continue
            while self.healthy and not self._events.empty():
                self._handle(self._events.get_nowait())


def progress_verdict(stats: list[dict], timeout_s: float) -> tuple[bool, str, tuple[int, ...]]:
    """Whether the stages, as `stage_stats` answered, are working on their steps: every one
    answered; each one computing ticked within `timeout_s` (PROGRESS_MIN_AGE_S at the
    least); and when none is computing (a step between stages, or queued), one ticked
    within it. An in-process stage reports no progress: it works while it answers. Returns
    (working, what was seen, the micro-batches being computed)."""
    max_age_s = max(timeout_s, PROGRESS_MIN_AGE_S)
    seen, answered, ids, youngest_s, opaque = [], True, [], None, False
    for st in stats:
        i = st.get("stage_index")
        if not st.get("healthy"):
            seen.append(f"stage {i} did not answer ({st.get('error', '')})")
            answered = False
            continue
        pb = st.get("stats")
        if pb is None or not hasattr(pb, "computing_micro_batch_id"):
            opaque = True
            continue
        age_s = pb.progress_age_ns / 1e9
        youngest_s = age_s if youngest_s is None else min(youngest_s, age_s)
        if pb.computing_micro_batch_id:
            ids.append(pb.computing_micro_batch_id)
            seen.append(
                f"stage {i} computing micro-batch {pb.computing_micro_batch_id}, last progress {age_s:.1f} s ago"
            )
            answered &= age_s < max_age_s
    if answered and not ids and not opaque:
        seen.append("no stage computing" + ("" if youngest_s is None else f", last progress {youngest_s:.1f} s ago"))
        answered = youngest_s is not None and youngest_s < max_age_s
    return answered, "; ".join(seen) or "no stage answered", tuple(ids)
