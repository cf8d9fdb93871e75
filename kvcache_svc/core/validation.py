"""Whole-step validation: every check runs before anything is applied, and nothing mutates."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from services.kv_errors import InvalidStepError, SequenceNotFound
from services.kv_types import StepInput

MAX_ID = 2**64 - 1  # ids travel as uint64


class ValidNewSequence(NamedTuple):
    seq_id: int
    token_bytes: bytes
    num_tokens: int
    namespace: str | None
    max_num_new_tokens: int | None
    skip_prefix_cache: bool = False


class ValidAppend(NamedTuple):
    seq_id: int
    token_bytes: bytes
    num_tokens: int
    num_lookahead_slots: int = 0


MAX_LOOKAHEAD_SLOTS = 64  # room held past the known tokens of one sequence, at most


@dataclass(frozen=True, slots=True)
class ValidStep:
    """A step that passed validation, with token ids already packed for hashing."""

    failed_micro_batch_ids: tuple[int, ...]
    completed_micro_batch_ids: tuple[int, ...]
    frees: tuple[int, ...]
    forks: tuple[tuple[int, int], ...]
    appends: tuple[ValidAppend, ...]
    new_sequences: tuple[ValidNewSequence, ...]
    micro_batch_id: int | None


def _check_id(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        raise InvalidStepError(f"{what} must be an integer in [0, 2**64), got {value!r}")
    return value


def _check_unique(ids: Sequence[int], what: str) -> None:
    if len(set(ids)) != len(ids):
        raise InvalidStepError(f"duplicate {what}")


def _pack(token_ids: object, what: str, allow_empty: bool = False) -> tuple[bytes, int]:
    # any sequence of ints: lists, tuples, ranges, protobuf repeated fields, numpy arrays
    if isinstance(token_ids, str | bytes | bytearray | memoryview | Mapping) or not hasattr(token_ids, "__getitem__"):
        raise InvalidStepError(f"{what}: token ids must be a sequence of ints")
    try:
        packed = array("q", token_ids)  # type: ignore[arg-type]
    except (TypeError, OverflowError, ValueError) as exc:
        raise InvalidStepError(f"{what}: token ids must be int64s ({exc})") from None
    if not packed:
        if allow_empty:
            return b"", 0
        raise InvalidStepError(f"{what}: no token ids")
    if min(packed) < 0:
        raise InvalidStepError(f"{what}: negative token id")
    if sys.byteorder != "little":  # keys hash little-endian int64s, as pack_token_ids does
        packed.byteswap()
    return packed.tobytes(), len(packed)


def validate_step(
    step: StepInput,
    seq_num_tokens: Mapping[int, int],
    in_flight_micro_batch_ids: Collection[int],
    max_tokens_per_sequence: int,
) -> ValidStep:
    """Check `step` against the current state (`seq_num_tokens`: live sequences and their
    lengths). Raises `SequenceNotFound` or `InvalidStepError`; reads, never writes.

    The parts are checked in the order a step applies them: micro-batches, frees, forks,
    new sequences, appends; each later part sees what the earlier ones free or create."""
    failed, completed, micro_batch_id = _validate_micro_batches(step, in_flight_micro_batch_ids)
    frees = _validate_frees(step.frees, seq_num_tokens)
    freed = set(frees)
    forks, child_lengths = _validate_forks(step.forks, seq_num_tokens, freed)
    new_sequences: list[ValidNewSequence] = []
    new_ids: set[int] = set()
    for new in step.new_sequences:
        valid = _validate_new_sequence(new, seq_num_tokens, child_lengths, new_ids, max_tokens_per_sequence)
        new_ids.add(valid.seq_id)
        new_sequences.append(valid)
    appends: list[ValidAppend] = []
    appended: set[int] = set()
    for append in step.appends:
        valid_append = _validate_append(
            append, seq_num_tokens, child_lengths, appended, new_ids, freed, max_tokens_per_sequence
        )
        appended.add(valid_append.seq_id)
        appends.append(valid_append)
    return ValidStep(
        failed_micro_batch_ids=failed,
        completed_micro_batch_ids=completed,
        frees=frees,
        forks=forks,
        appends=tuple(appends),
        new_sequences=tuple(new_sequences),
        micro_batch_id=micro_batch_id,
    )


def _validate_micro_batches(
    step: StepInput, in_flight: Collection[int]
) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """(failed, completed, new micro-batch id): the ones ending must be in flight, once each;
    the new one must not be (unless it ends in this step), and a step that writes tokens needs one."""
    failed = tuple(_check_id(m, "failed micro-batch id") for m in step.failed_micro_batch_ids)
    completed = tuple(_check_id(m, "completed micro-batch id") for m in step.completed_micro_batch_ids)
    _check_unique(failed + completed, "micro-batch id in completed/failed")
    for m in failed + completed:
        if m not in in_flight:
            raise InvalidStepError(f"micro-batch {m} is not in flight")
    micro_batch_id = step.micro_batch_id
    if micro_batch_id is not None:
        _check_id(micro_batch_id, "micro_batch_id")
        if micro_batch_id in in_flight and micro_batch_id not in failed + completed:
            raise InvalidStepError(f"micro-batch {micro_batch_id} is already in flight")
    elif step.appends or step.new_sequences:
        raise InvalidStepError("a step that writes tokens needs a micro_batch_id")
    return failed, completed, micro_batch_id


def _validate_frees(seq_ids: Sequence[object], seq_num_tokens: Mapping[int, int]) -> tuple[int, ...]:
    """Freed sequences: live, once each."""
    frees = tuple(_check_id(s, "freed seq_id") for s in seq_ids)
    _check_unique(frees, "seq_id in frees")
    for seq_id in frees:
        if seq_id not in seq_num_tokens:
            raise SequenceNotFound(seq_id, "cannot free it")
    return frees


def _validate_forks(
    step_forks: Sequence, seq_num_tokens: Mapping[int, int], freed: Collection[int]
) -> tuple[tuple[tuple[int, int], ...], dict[int, int]]:
    """(forks as (parent, child), each child's length): a parent is live, not freed and not a
    child of this step; a child is new."""
    forks: list[tuple[int, int]] = []
    child_lengths: dict[int, int] = {}
    for fork in step_forks:
        parent = _check_id(fork.parent_seq_id, "fork parent_seq_id")
        child = _check_id(fork.child_seq_id, "fork child_seq_id")
        if parent in child_lengths:
            raise InvalidStepError(f"fork parent {parent} is forked in the same step")
        if parent not in seq_num_tokens:
            raise SequenceNotFound(parent, "cannot fork it")
        if parent in freed:
            raise InvalidStepError(f"sequence {parent} is freed and forked in one step")
        if child in seq_num_tokens or child in child_lengths:
            raise InvalidStepError(f"fork child {child} already exists")
        child_lengths[child] = seq_num_tokens[parent]
        forks.append((parent, child))
    return tuple(forks), child_lengths


def _validate_new_sequence(
    new,
    seq_num_tokens: Mapping[int, int],
    child_lengths: Mapping[int, int],
    new_ids: Collection[int],
    max_tokens_per_sequence: int,
) -> ValidNewSequence:
    """One new sequence: an id no live, forked or earlier new sequence has, and a prompt the
    pool can hold."""
    seq_id = _check_id(new.seq_id, "new seq_id")
    if seq_id in seq_num_tokens or seq_id in child_lengths or seq_id in new_ids:
        raise InvalidStepError(f"new sequence {seq_id} already exists")
    token_bytes, num_tokens = _pack(new.token_ids, f"new sequence {seq_id}")
    if num_tokens > max_tokens_per_sequence:
        raise InvalidStepError(
            f"new sequence {seq_id}: {num_tokens} tokens exceed the pool's {max_tokens_per_sequence}"
        )
    if new.namespace is not None and not isinstance(new.namespace, str):
        raise InvalidStepError(f"new sequence {seq_id}: namespace must be a string")
    max_new = new.max_num_new_tokens
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise InvalidStepError(f"new sequence {seq_id}: max_num_new_tokens must be >= 1")
    if not isinstance(new.skip_prefix_cache, bool):
        raise InvalidStepError(f"new sequence {seq_id}: skip_prefix_cache must be a bool")
    return ValidNewSequence(seq_id, token_bytes, num_tokens, new.namespace, max_new, new.skip_prefix_cache)


def _validate_append(
    append,
    seq_num_tokens: Mapping[int, int],
    child_lengths: Mapping[int, int],
    appended: Collection[int],
    new_ids: Collection[int],
    freed: Collection[int],
    max_tokens_per_sequence: int,
) -> ValidAppend:
    """One append: to a live or forked sequence, once, not new or freed in this step, within
    the lookahead limit and the pool's length."""
    seq_id = _check_id(append.seq_id, "appended seq_id")
    if seq_id in appended:
        raise InvalidStepError(f"sequence {seq_id} appended twice")
    if seq_id in new_ids:
        raise InvalidStepError(f"sequence {seq_id} is new and appended in one step")
    if seq_id in freed:
        raise InvalidStepError(f"sequence {seq_id} is freed and appended in one step")
    length = seq_num_tokens.get(seq_id, child_lengths.get(seq_id))
    if length is None:
        raise SequenceNotFound(seq_id, "cannot append to it")
    lookahead = append.num_lookahead_slots
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 0 <= lookahead <= MAX_LOOKAHEAD_SLOTS:
        raise InvalidStepError(f"append to {seq_id}: num_lookahead_slots must be in [0, {MAX_LOOKAHEAD_SLOTS}]")
    token_bytes, num_tokens = _pack(append.token_ids, f"append to {seq_id}", allow_empty=lookahead > 0)
    if length + num_tokens + lookahead > max_tokens_per_sequence:
        raise InvalidStepError(
            f"sequence {seq_id}: {length + num_tokens + lookahead} tokens exceed the pool's {max_tokens_per_sequence}"
        )
    return ValidAppend(seq_id, token_bytes, num_tokens, lookahead)
