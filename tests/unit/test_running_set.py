"""The running set alone (scheduler_svc/core/running.py): requests queued, admitted in rank
order, preempted back to the queue, aborted; each transition traced. The planner's use of it:
tests/unit/test_planner.py (preemption, aborts, stop strings)."""

from __future__ import annotations

from scheduler_svc.core import forks
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import FinishReason, Request, RequestState, SamplingOptions
from scheduler_svc.core.running import RunningSet
from scheduler_svc.core.stage_view import StageView


def _running(*ids: str) -> RunningSet:
    requests = RunningSet(WaitingQueue(), InFlight(), StageView(track_tokens=False))
    for i, request_id in enumerate(ids):
        requests.add(Request(request_id, (1, 2, 3), SamplingOptions(), float(i)))
    return requests


def test_the_newest_admitted_request_is_the_victim_and_waits_again_ahead():
    requests = _running("a", "b")
    for request in list(requests.queue.ordered(limit=8)):
        requests.admit(request, 1.0)
    requests.check_integrity()
    victim = requests.pick_victim(exclude=requests.running[0], scheduled={})
    assert victim is requests.requests["b"]
    requests.preempt(victim, 2.0)
    requests.check_integrity()
    assert [r.request_id for r in requests.running] == ["a"] and victim.state == RequestState.WAITING
    assert requests.num_preemptions == 1 and victim in requests.queue
    assert [d["event"] for d in requests.decisions] == ["queued", "queued", "admitted", "admitted", "preempted"]


def test_an_abort_or_the_last_choice_stopping_ends_a_request_wherever_it_is():
    requests = _running("a", "b")
    aborted = requests.abort("a", 1.0)
    assert aborted.state == RequestState.ABORTED and "a" not in requests.requests
    assert requests.abort("a") is None  # ended already
    b = requests.requests["b"]
    requests.admit(b, 1.0)
    b.sequences.append(forks.new_sequence(1, b, 0))
    b.transition(RequestState.DECODING, 2.0)
    assert requests.finish_choice("b", 0, 3.0) is b
    assert b.state == RequestState.FINISHED and b.sequences[0].finish_reason == FinishReason.STOP
    assert not requests.running and not requests.requests
    requests.check_integrity()
