"""n > 1 forks alone (scheduler_svc/core/forks.py): how far a parent computes before its fork,
the slots a request reserves, when a fork is due, what it asks the KV service, and how the
forked choices join. The planner's use of them: tests/unit/test_planner.py (n > 1)."""

from __future__ import annotations

from scheduler_svc.core import forks
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.proposal import ProposalDraft
from scheduler_svc.core.request import FinishReason, Request, SamplingOptions
from services.kv_types import Append, Fork


def _request(prompt=(5, 6, 7, 8), n: int = 3) -> Request:
    request = Request("r", prompt, SamplingOptions(n=n, max_tokens=4), 0.0)
    request.sequences.append(forks.new_sequence(1, request, 0))
    return request


def test_a_parent_stops_before_the_last_prompt_token_until_it_forked():
    request = _request()
    parent = request.sequences[0]
    assert forks.target(parent) == 3 and forks.first_admission(request) == ([5, 6, 7], 1)
    assert forks.first_admission(_request(prompt=(5,))) == ([5], 3)  # nothing to share: all at once
    request.sequences += [forks.new_sequence(i, request, i - 1) for i in (2, 3)]
    assert forks.target(parent) == 4
    assert forks.reserved(request) == 3
    request.sequences[1].finish_reason = FinishReason.STOP
    assert forks.reserved(request) == 2


def test_a_fork_is_due_once_the_parent_computed_all_but_the_last_token_and_is_idle():
    request, flight = _request(), InFlight()
    parent = request.sequences[0]
    parent.has_kv, parent.num_computed = True, 2
    assert not forks.is_due(request, flight)
    parent.num_computed = 3
    assert forks.is_due(request, flight)
    flight.record(parent, 2, 1, False)
    assert not forks.is_due(request, flight)  # its step is in flight


def test_propose_and_apply_fork_every_other_choice_from_the_parent():
    request, flight = _request(), InFlight()
    parent = request.sequences[0]
    parent.has_kv, parent.num_computed, parent.kv_len = True, 3, 3
    draft = ProposalDraft(budget=8, seq_cap=4, next_seq_id=10)
    forks.propose(draft, [request], flight)
    assert draft.kv_forks == [Fork(1, 10), Fork(1, 11)]
    assert draft.appends == [Append(10, [8]), Append(11, [8]), Append(1, [8])]
    assert (draft.budget, draft.num_seqs) == (5, 3)
    proposal = draft.proposal(None, 1, skips_kv=False)
    joined = forks.apply(proposal, [request], flight)
    assert [(p.seq_id, [c.seq_id for c in ch]) for p, ch in joined] == [(1, [10, 11])]
    assert [(s.index, s.num_computed, s.kv_len, s.has_kv) for s in request.sequences[1:]] == [
        (1, 3, 3, True),
        (2, 3, 3, True),
    ]
    assert forks.entropy(request, 1) == request.sequences[1].entropy_seed != request.sequences[2].entropy_seed


def test_the_forks_of_a_parent_that_ended_meanwhile_are_freed():
    request, flight = _request(), InFlight()
    parent = request.sequences[0]
    parent.has_kv, parent.num_computed = True, 3
    draft = ProposalDraft(budget=8, seq_cap=4, next_seq_id=10)
    forks.propose(draft, [request], flight)
    parent.finish_reason = FinishReason.ABORT
    assert forks.apply(draft.proposal(None, 1, skips_kv=False), [request], flight) == []
    assert flight.pending_frees == [10, 11] and len(request.sequences) == 1
    request.sequences.append(forks.new_sequence(12, request, 1))
    forks.undo_unforked(request)  # preempted with its choices half forked: the fork comes again
    assert request.sequences == [parent]
