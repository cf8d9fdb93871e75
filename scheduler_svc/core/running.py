"""The live requests and their lifecycle, as the planner drives it: queued (the waiting
queue), admitted (running, ranked by arrival and priority), preempted by recompute back to
the queue, finished or aborted; every transition traced as a decision.

A sequence's KV is dropped in the steps in flight (`InFlight`: the KV service hears the free)
and in what the stages hold (`StageView`) at once (`drop_kv`). Ranks decide preemption: the
lowest-ranked running request gives its blocks back (`pick_victim`).
"""

from __future__ import annotations

from scheduler_svc.core import forks
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import FinishReason, Request, RequestState, Sequence
from scheduler_svc.core.stage_view import StageView


class RunningSet:
    """Owns `running` (admission order), `requests` (every live request by id), the ranks and
    `decisions` (for scheduler tracing; drained by the engine).

    Invariants (`check_integrity`): a running request is PREFILLING or DECODING, has a rank,
    and is not in the queue; every running or queued request is in `requests`."""

    def __init__(self, queue: WaitingQueue, flight: InFlight, stages: StageView) -> None:
        self.queue = queue
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.decisions: list[dict] = []
        self.num_preemptions = 0
        self._rank: dict[str, tuple] = {}
        self._admission_counter = 0
        self._flight = flight
        self._stages = stages

    def add(self, request: Request) -> Request | None:
        """Queue a new request (QueueFull propagates). With the queue full, a more urgent
        request takes the place of the least urgent waiting one, which is returned (its
        caller refuses it as if it had come to a full queue)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        displaced = self.queue.displaceable(request)
        if displaced is not None:
            self.abort(displaced.request_id)
        self.queue.push(request)
        self.requests[request.request_id] = request
        self.trace("queued", request, prompt_tokens=len(request.prompt))
        return displaced

    def abort(self, request_id: str, now: float = 0.0) -> Request | None:
        """Abort a live request: out of the queue, or its sequences freed. None if unknown/ended."""
        request = self.requests.get(request_id)
        if request is None or not request.state.is_live:
            return None
        if request in self.queue:
            self.queue.remove(request)
        if request in self.running:
            self.running.remove(request)
        for seq in request.sequences:
            self.drop_kv(seq)
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.ABORT
        if request.state == RequestState.PREEMPTED:
            request.transition(RequestState.WAITING, now)
        request.transition(RequestState.ABORTED, now)
        request.finished_s = now
        del self.requests[request_id]
        self._rank.pop(request_id, None)
        self.trace("aborted", request)
        return request

    def finish_choice(self, request_id: str, index: int, now: float = 0.0) -> Request | None:
        """End one choice early (the gateway found a stop string in its text).

        Returns the request when that finished it as a whole (FINISHED), else None.
        """
        request = self.requests.get(request_id)
        if request is None or not request.state.is_live:
            return None
        seq = next((s for s in request.sequences if s.index == index), None)
        if seq is None or seq.is_finished:
            return None
        seq.finish_reason = FinishReason.STOP
        self.drop_kv(seq)
        self.trace("choice_stopped", request, index=index)
        if not request.all_finished:
            return None
        if request in self.queue:
            self.queue.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._rank.pop(request_id, None)
        del self.requests[request_id]
        request.finished_s = now
        if request.state == RequestState.DECODING:
            request.transition(RequestState.FINISHED, now)
        else:  # its last choices ended while it was waiting or recomputing
            if request.state == RequestState.PREEMPTED:
                request.transition(RequestState.WAITING, now)
            request.transition(RequestState.ABORTED, now)
        self.trace("finished", request, output_tokens=request.num_output_tokens)
        return request

    def admit(self, request: Request, now: float) -> None:
        self.queue.admit(request)
        request.transition(RequestState.PREFILLING, now)
        self.running.append(request)
        self._admission_counter += 1
        self._rank[request.request_id] = (
            request.priority if self.queue.policy == "priority" else 0,
            request.arrival_s,
            self._admission_counter,
        )
        self.trace("admitted", request, preemptions=request.num_preemptions)

    def pick_victim(self, exclude: Request, scheduled: dict) -> Request | None:
        """The lowest-ranked running request — possibly the starving one itself — or None when
        that one has work in flight (then the starving sequence waits a round).

        Ranks follow arrival (and priority under the priority policy), as in vLLM: the oldest
        request is never preempted for a newer one, so it always makes progress and
        preemption cannot ping-pong between two requests.
        """
        victim = max(self.running, key=lambda r: self._rank[r.request_id])
        if any(self._flight.is_busy(s.seq_id) for s in victim.sequences):
            return None
        return victim

    def preempt(self, request: Request, now: float, free: bool = True) -> None:
        for seq in request.sequences:
            if free:
                self.drop_kv(seq)
            else:
                seq.has_kv = False
                seq.drop_blocks()
            seq.num_computed = 0
            seq.kv_len = 0
        forks.undo_unforked(request)
        self.running.remove(request)
        self._rank.pop(request.request_id, None)
        request.transition(RequestState.PREEMPTED, now)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.trace("preempted", request, output_tokens=request.num_output_tokens)
        request.transition(RequestState.WAITING, now)
        self.queue.push(request)

    def drop_kv(self, seq: Sequence) -> None:
        if seq.has_kv:
            self._flight.free_at_kv((seq.seq_id,))
            self._stages.release(seq.seq_id)
        seq.has_kv = False
        seq.drop_blocks()

    def retire(self, request: Request, now: float) -> None:
        """A running request whose every choice finished: FINISHED, and forgotten."""
        request.transition(RequestState.FINISHED, now)
        request.finished_s = now
        self.running.remove(request)
        del self.requests[request.request_id]
        self._rank.pop(request.request_id, None)
        self.trace("finished", request, output_tokens=request.num_output_tokens)

    def trace(self, kind: str, request: Request | None, **fields) -> None:
        entry = {"event": kind}
        if request is not None:
            entry["request_id"] = request.request_id
            entry["tenant"] = request.tenant
        entry.update(fields)
        self.decisions.append(entry)

    def check_integrity(self) -> None:
        for request in self.running:
            assert request.state in (RequestState.PREFILLING, RequestState.DECODING), request.state
            assert request not in self.queue
            assert request.request_id in self._rank and self.requests.get(request.request_id) is request
