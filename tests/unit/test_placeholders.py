"""Asynchronous scheduling's placeholder decodes alone (scheduler_svc/core/placeholders.py):
when a sequence may have one, what it asks the KV service, and which still go after the KV
service answered. The planner's use of them: tests/unit/test_planner_state.py and
test_kv_state_machine.py (async)."""

from __future__ import annotations

from scheduler_svc.core import forks
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.placeholders import PlaceholderPolicy
from scheduler_svc.core.proposal import Placeholder, ProposalDraft
from scheduler_svc.core.request import Request, SamplingOptions
from scheduler_svc.core.speculation_policy import SpeculationPolicy
from services.kv_types import Allocated, Append, StepOutput


def _setup(pp: int = 1, num_blocks: int = 2, max_tokens: int = 10):
    """One sequence of 5 tokens (4 prompt, 1 output) at block size 4, its step computing
    token 4 in flight."""
    flight = InFlight()
    policy = PlaceholderPolicy(True, pp, 4, 100, flight, SpeculationPolicy())
    request = Request("r", (5, 6, 7, 8), SamplingOptions(max_tokens=max_tokens), 0.0)
    seq = forks.new_sequence(1, request, 0)
    request.sequences.append(seq)
    seq.output.append(9)
    seq.has_kv, seq.num_computed, seq.kv_len, seq.num_blocks = True, 4, 4, num_blocks
    flight.record(seq, 4, 1, True)
    return policy, flight, request, seq


def test_a_sequence_whose_one_step_samples_its_next_token_may_have_one():
    policy, flight, request, seq = _setup()
    assert policy.active and not policy.last and policy.ready(seq, [request])
    flight.record(seq, 5, 1, True)  # its placeholder step is planned already: not another
    assert not policy.ready(seq, [request])
    _, _, request, seq = _setup(max_tokens=2)
    assert not policy.ready(seq, [request])  # that step may be its last by length


def test_several_stages_need_the_feedback_and_put_them_last():
    policy, _, request, seq = _setup(pp=2)
    assert policy.last and not policy.active
    policy.feedback = True
    assert policy.active and policy.ready(seq, [request])
    assert not PlaceholderPolicy(False, 1, 4, 100, InFlight(), SpeculationPolicy()).active


def test_a_placeholder_inside_its_blocks_asks_nothing_one_that_starts_a_block_asks_it_ahead():
    policy, _, request, seq = _setup(num_blocks=2)
    draft = ProposalDraft(budget=8, seq_cap=4, next_seq_id=10)
    policy.propose(draft, [request])
    assert draft.placeholders == [Placeholder(seq, 5, False)] and not draft.appends
    policy, flight, request, seq = _setup(num_blocks=1)
    seq.output.clear()
    seq.num_computed, seq.kv_len = 3, 3
    flight.reset()
    flight.record(seq, 3, 1, True)  # computes token 3: its next, 4, starts block 1
    draft = ProposalDraft(budget=8, seq_cap=4, next_seq_id=10)
    policy.propose(draft, [request])
    assert draft.placeholders == [Placeholder(seq, 4, True)]
    assert draft.appends == [Append(1, [8], num_lookahead_slots=1)]
    proposal = draft.proposal(None, 1, skips_kv=False)
    assert policy.steps(proposal) == []  # no block yet: later
    policy.take_blocks(proposal, StepOutput({1: Allocated(1, (7,), 1, 3, (), block_offset=1)}, ()))
    assert (seq.num_blocks, seq.kv_len) == (2, 4) and policy.steps(proposal) == [(seq, 4)]
