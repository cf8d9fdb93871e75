"""A step is validated whole: a bad one raises a domain error and changes nothing."""

from __future__ import annotations

import pytest

from kvcache_svc.core import (
    Append,
    Fork,
    InvalidStepError,
    KVCacheError,
    KVCacheManager,
    NewSequence,
    SequenceNotFound,
    StepInput,
)


def snapshot(m: KVCacheManager) -> tuple[object, ...]:
    """Everything observable about the manager's state."""
    return (
        {s: (m.block_table(s), m.num_tokens(s)) for s in m.seq_ids()},
        [m.ref_count(b) for b in range(m.num_blocks)],
        m.free_extents(),
        m.evictable_block_ids(),
        {b: m.cached_token_ids(b) for b in range(m.num_blocks)},
        m.in_flight_micro_batch_ids(),
        m.stats(),
    )


def _bad_steps() -> list[tuple[str, StepInput, type[KVCacheError]]]:
    ok_new = NewSequence(9, [1, 2, 3])
    return [
        (
            "unknown append",
            StepInput(new_sequences=[ok_new], appends=[Append(42, [1])], micro_batch_id=5),
            SequenceNotFound,
        ),
        ("unknown free", StepInput(frees=[1, 42]), SequenceNotFound),
        ("unknown fork parent", StepInput(forks=[Fork(42, 43)]), SequenceNotFound),
        ("duplicate new", StepInput(new_sequences=[ok_new, NewSequence(9, [1])], micro_batch_id=5), InvalidStepError),
        ("new seq exists", StepInput(new_sequences=[NewSequence(1, [1])], micro_batch_id=5), InvalidStepError),
        ("appended twice", StepInput(appends=[Append(1, [1]), Append(1, [2])], micro_batch_id=5), InvalidStepError),
        ("freed twice", StepInput(frees=[1, 1]), InvalidStepError),
        ("freed and appended", StepInput(frees=[1], appends=[Append(1, [1])], micro_batch_id=5), InvalidStepError),
        ("freed and forked", StepInput(frees=[1], forks=[Fork(1, 7)]), InvalidStepError),
        ("fork child exists", StepInput(forks=[Fork(1, 2)]), InvalidStepError),
        (
            "new and appended",
            StepInput(new_sequences=[ok_new], appends=[Append(9, [1])], micro_batch_id=5),
            InvalidStepError,
        ),
        ("no tokens", StepInput(appends=[Append(1, [])], micro_batch_id=5), InvalidStepError),
        ("negative token", StepInput(appends=[Append(1, [3, -1])], micro_batch_id=5), InvalidStepError),
        ("float token", StepInput(appends=[Append(1, [3, 1.5])], micro_batch_id=5), InvalidStepError),
        ("huge token", StepInput(appends=[Append(1, [2**63])], micro_batch_id=5), InvalidStepError),
        ("dict tokens", StepInput(appends=[Append(1, {1: 2})], micro_batch_id=5), InvalidStepError),
        ("iterator tokens", StepInput(appends=[Append(1, iter([1, 2]))], micro_batch_id=5), InvalidStepError),
        ("string tokens", StepInput(new_sequences=[NewSequence(9, "abc")], micro_batch_id=5), InvalidStepError),
        ("longer than the pool", StepInput(appends=[Append(1, [0] * 64)], micro_batch_id=5), InvalidStepError),
        ("negative seq id", StepInput(new_sequences=[NewSequence(-1, [1])], micro_batch_id=5), InvalidStepError),
        ("bool seq id", StepInput(frees=[True]), InvalidStepError),
        ("zero chunk", StepInput(new_sequences=[NewSequence(9, [1], None, 0)], micro_batch_id=5), InvalidStepError),
        ("writes without micro-batch", StepInput(new_sequences=[ok_new]), InvalidStepError),
        ("micro-batch in flight", StepInput(new_sequences=[ok_new], micro_batch_id=0), InvalidStepError),
        ("unknown completion", StepInput(completed_micro_batch_ids=[0, 77]), InvalidStepError),
        (
            "completed and failed",
            StepInput(completed_micro_batch_ids=[0], failed_micro_batch_ids=[0]),
            InvalidStepError,
        ),
    ]


@pytest.mark.parametrize(("name", "bad", "error"), _bad_steps(), ids=[b[0] for b in _bad_steps()])
def test_invalid_step_changes_nothing(name: str, bad: StepInput, error: type[KVCacheError]) -> None:
    m = KVCacheManager(16, 4, watermark=0.0)
    # micro-batch 0 stays in flight
    m.step(StepInput(new_sequences=[NewSequence(1, list(range(6)))], micro_batch_id=0))
    m.fork(1, 2)
    before = snapshot(m)
    with pytest.raises(error):
        m.step(bad)
    assert snapshot(m) == before
    m.check_integrity()
