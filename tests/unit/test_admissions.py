"""Admissions alone (scheduler_svc/core/admissions.py): which waiting requests and which
running sequences that lost their KV the next micro-batch asks the KV service for. The
planner's use of them: tests/unit/test_planner.py."""

from __future__ import annotations

from scheduler_svc.core import admissions, forks
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.proposal import ProposalDraft
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, SamplingOptions


def _queue(*prompts, n: int = 1) -> WaitingQueue:
    queue = WaitingQueue()
    for i, prompt in enumerate(prompts):
        queue.push(Request(f"r{i}", tuple(prompt), SamplingOptions(n=n), float(i)))
    return queue


def _asked(draft: ProposalDraft) -> list[tuple[int, list[int], int, str | None]]:
    return [(s.seq_id, list(s.token_ids), s.max_num_new_tokens, s.namespace) for s in draft.new_sequences]


def test_waiting_requests_come_in_queue_order_and_the_first_that_does_not_fit_stops_the_rest():
    queue = _queue([1, 2, 3], [4, 5, 6, 7, 8, 9], [7])
    draft = ProposalDraft(budget=6, seq_cap=4, next_seq_id=10)
    admissions.propose_admissions(draft, queue, [], 8, False, "m")
    assert _asked(draft) == [(10, [1, 2, 3], 3, "m")]  # the second does not fit whole: no overtaking
    draft = ProposalDraft(budget=6, seq_cap=4, next_seq_id=10)
    admissions.propose_admissions(draft, queue, [], 8, True, "m")
    assert _asked(draft) == [(10, [1, 2, 3], 3, "m"), (11, [4, 5, 6, 7, 8, 9], 3, "m")]  # chunked
    assert [a.request.request_id for a in draft.admissions] == ["r0", "r1"] and draft.budget == 0


def test_an_n_request_prefills_all_but_its_last_prompt_token_and_reserves_every_choice():
    draft = ProposalDraft(budget=16, seq_cap=8, next_seq_id=1)
    admissions.propose_admissions(draft, _queue([1, 2, 3], n=3), [], 8, True, None)
    assert _asked(draft) == [(1, [1, 2], 2, None)]
    draft = ProposalDraft(budget=16, seq_cap=8, next_seq_id=1)
    admissions.propose_admissions(draft, _queue([1, 2, 3], [4, 5], n=3), [], 5, True, None)
    assert len(draft.admissions) == 1  # the second's three choices pass max_num_seqs


def test_a_running_sequence_that_lost_its_kv_comes_back_under_a_fresh_id():
    request = Request("r", (1, 2, 3), SamplingOptions(), 0.0)
    seq = forks.new_sequence(4, request, 0)
    request.sequences.append(seq)
    seq.output.extend([9, 8])
    draft = ProposalDraft(budget=4, seq_cap=4, next_seq_id=10)
    admissions.propose_readmissions(draft, [request], InFlight(), None)
    assert _asked(draft) == [(10, [1, 2, 3, 9, 8], 4, None)]  # chunked whatever the setting
    assert draft.readmissions[0].seq is seq and draft.readmissions[0].new_seq_id == 10


def test_an_admission_after_one_that_got_no_block_gives_its_blocks_back():
    from scheduler_svc.core.running import RunningSet
    from scheduler_svc.core.stage_view import StageView
    from services.kv_types import Allocated, NoBlocks, StepOutput

    queue, flight = _queue([1, 2], [3, 4]), InFlight()
    requests = RunningSet(queue, flight, StageView(track_tokens=False))
    for request in queue.ordered(limit=8):
        requests.requests[request.request_id] = request
    draft = ProposalDraft(budget=8, seq_cap=4, next_seq_id=10)
    admissions.propose_admissions(draft, queue, [], 8, True, None)
    output = StepOutput({10: NoBlocks(10, 1, 0), 11: Allocated(11, (5,), 2, 0, ())}, ())
    scheduled: admissions.Allocations = {}
    admissions.apply_admissions(draft.proposal(None, 1, skips_kv=False), output, requests, flight, scheduled, 1.0)
    assert not scheduled and not requests.running and flight.pending_frees == [11]  # no overtaking
    output = StepOutput({10: Allocated(10, (5,), 2, 0, ()), 11: Allocated(11, (6,), 2, 0, ())}, ())
    admissions.apply_admissions(draft.proposal(None, 1, skips_kv=False), output, requests, flight, scheduled, 1.0)
    assert sorted(scheduled) == [10, 11] and [r.request_id for r in requests.running] == ["r0", "r1"]
    requests.check_integrity()
