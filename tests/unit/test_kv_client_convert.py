"""`services.kv_codec`: steps, results and statistics survive the wire exactly."""

from __future__ import annotations

import random

import pytest

from kvcache_svc.core import Allocated, Append, Fork, InvalidStepError, KVCacheManager, NewSequence, StepInput
from services.kv_codec import (
    BlockCopyMismatch,
    stats_from_pb,
    stats_to_pb,
    step_input_from_pb,
    step_input_to_pb,
    step_output_from_pb,
    step_output_to_pb,
)
from services.pb import common_pb2, kvcache_pb2


def plain(step: StepInput) -> StepInput:
    """Token ids as tuples, so decoded steps compare equal to what was encoded."""
    return StepInput(
        new_sequences=tuple(
            NewSequence(n.seq_id, tuple(n.token_ids), n.namespace, n.max_num_new_tokens, n.skip_prefix_cache)
            for n in step.new_sequences
        ),
        appends=tuple(Append(a.seq_id, tuple(a.token_ids), a.num_lookahead_slots) for a in step.appends),
        forks=tuple(step.forks),
        frees=tuple(step.frees),
        completed_micro_batch_ids=tuple(step.completed_micro_batch_ids),
        failed_micro_batch_ids=tuple(step.failed_micro_batch_ids),
        micro_batch_id=step.micro_batch_id,
    )


def test_a_step_round_trips_with_presence_and_fork_order():
    step = plain(
        StepInput(
            new_sequences=[
                NewSequence(5, (1, 2, 3), namespace="", max_num_new_tokens=2),
                NewSequence(6, (4,)),
                NewSequence(12, (4, 5), skip_prefix_cache=True),
            ],
            appends=[Append(1, (9, 8)), Append(3, (), num_lookahead_slots=1), Append(4, (7,), 2)],
            forks=[Fork(1, 2), Fork(1, 3), Fork(4, 7), Fork(1, 8)],
            frees=(10, 11),
            completed_micro_batch_ids=(3,),
            failed_micro_batch_ids=(4,),
            micro_batch_id=0,
        )
    )
    request = step_input_to_pb(step)
    assert [len(f.child_seq_ids) for f in request.forks] == [2, 1, 1]
    assert request.HasField("micro_batch_id") and request.new_sequences[0].HasField("namespace")
    assert not request.new_sequences[1].HasField("namespace")
    decoded = step_input_from_pb(kvcache_pb2.StepRequest.FromString(request.SerializeToString()))
    assert plain(decoded) == step
    assert step_input_from_pb(step_input_to_pb(StepInput(frees=[1]))).micro_batch_id is None


@pytest.mark.parametrize(
    "step",
    [
        StepInput(new_sequences=[NewSequence(1, [2**32])], micro_batch_id=1),
        StepInput(new_sequences=[NewSequence(-1, [1])], micro_batch_id=1),
        StepInput(frees=[True]),
        StepInput(appends=[Append(1, "abc")], micro_batch_id=1),
        StepInput(micro_batch_id=2**64),
    ],
)
def test_what_the_wire_cannot_carry_is_an_invalid_step(step):
    with pytest.raises(InvalidStepError):
        step_input_to_pb(step)


def test_results_round_trip_as_table_deltas():
    """Random steps on a real manager: encode each result and get the very same result back;
    a receiver applying each diff to the last answer it got holds the manager's tables (fork
    children start from nothing: their first answer is whole)."""
    rng = random.Random(3)
    m = KVCacheManager(64, 4, watermark=0.0)
    tables: dict[int, tuple[int, ...]] = {}
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(2)]
    next_id, num_copies, num_deltas = 0, 0, 0
    for mb in range(1, 120):
        live = list(m.seq_ids())
        frees = rng.sample(live, min(len(live), rng.choice([0, 0, 1])))
        forks = []
        if live and rng.random() < 0.3:
            parent = rng.choice([s for s in live if s not in frees] or [None])
            if parent is not None:
                forks = [Fork(parent, next_id)]
                next_id += 1
        writers = [s for s in live if s not in frees] + [f.child_seq_id for f in forks]
        appends = [Append(s, [rng.randrange(50)] * rng.choice([1, 1, 3])) for s in writers if rng.random() < 0.6]
        news = [NewSequence(next_id, rng.choice(prefixes) + [rng.randrange(50)] * rng.randrange(3))]
        next_id += 1
        step = StepInput(
            new_sequences=news,
            appends=appends,
            forks=forks,
            frees=frees,
            completed_micro_batch_ids=[mb - 1] if mb > 1 else [],
            micro_batch_id=mb,
        )
        output = m.step(step)
        response = step_output_to_pb(output)
        for seq_id in frees:
            del tables[seq_id]
        decoded = step_output_from_pb(kvcache_pb2.StepResponse.FromString(response.SerializeToString()))
        assert decoded == output
        num_copies += len(output.copies)
        num_deltas += sum(0 < a.block_table_offset for a in response.allocations)
        for seq_id, result in output.results.items():
            if isinstance(result, Allocated):
                tables[seq_id] = result.applied_to(tables.get(seq_id, ()))
                assert tables[seq_id] == m.block_table(seq_id)
        if len(tables) > 12:
            m.step(StepInput(frees=list(tables)))
            tables.clear()
    assert num_copies > 3 and num_deltas > 30


def test_a_delta_that_does_not_fit_is_refused():
    response = kvcache_pb2.StepResponse(
        allocations=[
            kvcache_pb2.SequenceAllocation(
                seq_id=1, status=kvcache_pb2.ALLOCATION_STATUS_OK, block_table_offset=2, block_ids=[5]
            )
        ]
    )
    result = step_output_from_pb(response).results[1]
    assert (result.block_offset, result.block_ids, result.num_blocks) == (2, (5,), 3)
    with pytest.raises(ValueError):
        result.applied_to((0,))
    assert result.applied_to((0, 1, 2)) == (0, 1, 5)


def test_a_block_copy_of_no_allocation_is_a_mismatch():
    response = kvcache_pb2.StepResponse(
        allocations=[
            kvcache_pb2.SequenceAllocation(
                seq_id=1, status=kvcache_pb2.ALLOCATION_STATUS_OK, block_table_offset=1, block_ids=[5]
            )
        ],
        block_copies=[common_pb2.BlockCopy(src_block_id=3, dst_block_id=6)],
    )
    with pytest.raises(BlockCopyMismatch):
        step_output_from_pb(response)


def test_stats_round_trip():
    m = KVCacheManager(32, 4, watermark=0.1)
    m.step(StepInput(new_sequences=[NewSequence(1, range(10))], micro_batch_id=1))
    m.step(StepInput(new_sequences=[NewSequence(2, range(9))], completed_micro_batch_ids=[1], micro_batch_id=2))
    m.free(1)
    stats = m.stats()
    msg = stats_to_pb(stats, epoch=7, num_peak_used_blocks=5, num_steps=2, enable_prefix_caching=True)
    assert msg.num_free_blocks == stats.num_free_blocks + stats.num_evictable_blocks
    assert stats_from_pb(kvcache_pb2.KVCacheStats.FromString(msg.SerializeToString())) == stats
