"""The planner's two halves around the KV service's round trip: `propose` changes nothing (it
may be asked again, and its answer may never come), `finalize` takes the ids it used, once."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvcache_svc.core import KVCacheManager
from scheduler_svc.core.planner import Planner, PlannerConfig
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, SamplingOptions
from services.kv_types import StepOutput
from services.step import SampledToken


def _snapshot(planner: Planner) -> str:
    """Everything the planner and its queue hold, requests and their sequences included."""
    return repr(vars(planner)) + repr(vars(planner.queue))


def _drive(seed: int, counts: dict[str, int]) -> None:
    """A random workload, two steps in flight; every proposal is checked on the way."""
    rng = random.Random(seed)
    planner = Planner(
        PlannerConfig(
            max_num_batched_tokens=rng.choice([8, 16, 32]),
            max_num_seqs=4,
            block_size=4,
            max_in_flight=2,
            async_decode=seed % 2 == 1,
        ),
        WaitingQueue(),
    )
    kv = KVCacheManager(rng.choice([14, 24]), 4)
    for i in range(8):
        prompt = tuple(rng.randrange(5, 500) for _ in range(rng.randint(1, 20)))
        planner.add(
            Request(f"r{i}", prompt, SamplingOptions(n=rng.choice([1, 2]), max_tokens=rng.randint(1, 8)), arrival_s=0.0)
        )
    in_flight = []
    next_seq_id = None
    for step in range(500):
        if not planner.requests and not planner.has_pending_kv_work and not in_flight:
            return
        while len(planner.in_flight) < 2:
            before = _snapshot(planner)
            proposal = planner.propose()
            assert _snapshot(planner) == before
            assert planner.propose() == proposal  # the same question twice, the same proposal
            if next_seq_id is not None:
                assert proposal.seq_ids.start == next_seq_id  # the ids the last one used are taken
            next_seq_id = proposal.seq_ids.stop
            for name in ("placeholders", "chunks", "forks", "readmissions", "admissions"):
                counts[name] += len(getattr(proposal, name))
            output = StepOutput({}, ()) if proposal.skips_kv else kv.step(proposal.step_input)
            mb = planner.finalize(proposal, output, float(step))
            if proposal.seq_ids or proposal.has_work:
                with pytest.raises(RuntimeError):
                    planner.finalize(proposal, output, float(step))
            if mb is None:
                break
            in_flight.append(mb)
        if in_flight:
            mb = in_flight.pop(0)
            sampled = [SampledToken(s.seq_id, rng.randrange(5, 500)) for s in mb.seqs if s.sample]
            planner.on_result(mb.micro_batch_id, sampled, float(step))
        planner.check_integrity()
        kv.check_integrity()
    raise AssertionError(f"seed {seed}: did not finish")


def test_propose_changes_nothing_and_finalize_takes_its_ids_once():
    counts = dict.fromkeys(("placeholders", "chunks", "forks", "readmissions", "admissions"), 0)
    for seed in range(16):
        _drive(seed, counts)
    # every phase of `propose` was exercised
    assert all(counts[name] > 0 for name in ("placeholders", "chunks", "forks", "admissions")), counts


def test_a_proposal_is_immutable():
    planner = Planner(PlannerConfig(block_size=4), WaitingQueue())
    planner.add(Request("r", (5, 6, 7), SamplingOptions(max_tokens=2), arrival_s=0.0))
    proposal = planner.propose()
    assert len(proposal.admissions) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        proposal.micro_batch_id = 7  # type: ignore[misc]
    with pytest.raises(AttributeError):
        proposal.admissions.append(proposal.admissions[0])  # type: ignore[attr-defined]


def test_a_proposal_that_was_never_answered_leaves_its_ids_to_the_next():
    """The KV service failed (the engine resets everything): nothing of the proposal stays."""
    planner = Planner(PlannerConfig(block_size=4), WaitingQueue())
    planner.add(Request("r", (5, 6, 7), SamplingOptions(max_tokens=2), arrival_s=0.0))
    first = planner.propose()
    planner.reset_all()
    again = planner.propose()
    assert (again.seq_ids, again.micro_batch_id) == (first.seq_ids, first.micro_batch_id)
    mb = planner.finalize(again, KVCacheManager(16, 4).step(again.step_input))
    assert mb is not None and [s.seq_id for s in mb.seqs] == list(first.seq_ids)
