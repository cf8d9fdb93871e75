"""A hypothesis state machine drives the KV manager like a scheduler and a worker would.

The driver keeps a shadow of the workers' KV memory (slot -> token written and the
micro-batch that wrote it) and applies each step's copies and slot mappings to it, so the
checks are end to end: a prefix hit must hand back blocks that hold exactly the query's
tokens, and every sequence untouched by a failure must read back its own tokens.

Scheduler contract the driver keeps: a sequence is in at most one micro-batch in flight,
and is appended to or forked only when none holding it is in flight; micro-batches
complete or fail oldest first.

`GroupedKVCacheMachine` runs the same rules over KV groups (services/kv_layout.py): every
entry holds a page per sub-group, sliding sub-groups give pages back as their windows
move, and each sub-group must read back exactly the tokens its window can still see.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvcache_svc.core import Allocated, Append, Fork, KVCacheManager, NewSequence, NoBlocks, StepInput, StepOutput
from services.kv_layout import NULL_PAGE

KV_MACHINE_SETTINGS = settings(
    deadline=None,
    derandomize=True,
    max_examples=100,
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

NUM_BLOCKS = 16
BLOCK_SIZE = 4
# prompts start with one of a few shared prefixes over a tiny vocabulary, so that full
# blocks, partial hits and whole-prompt hits really recur
PREFIXES = ((), (1, 2, 3, 0), (1, 2, 3, 0, 3, 3, 2, 1), (1, 2, 3, 0, 3, 3, 2, 1, 0, 0, 1, 1), (2, 2, 2, 2, 1))
NAMESPACES = (None, "adapter-a")
GARBAGE = -1

EVENTS: Counter[str] = Counter()


def _record(name: str) -> None:
    EVENTS[name] += 1
    event(name)


def _entries(table: tuple) -> tuple[tuple[int, ...], ...]:
    return tuple(e if isinstance(e, tuple) else (e,) for e in table)


class KVCacheMachine(RuleBasedStateMachine):
    NUM_BLOCKS = NUM_BLOCKS
    GROUPS: tuple[int, ...] = (0,)  # each sub-group's window (0: full attention)

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(self.NUM_BLOCKS, BLOCK_SIZE, watermark=0.1, group_windows=self.GROUPS)
        self.tokens: dict[int, list[int]] = {}  # what each live sequence wrote, in order
        self.pending_prompt: dict[int, list[int]] = {}  # prompt left after a chunk
        self.tainted: set[int] = set()  # wrote in a failed micro-batch, or forked from one
        self.busy: dict[int, int] = {}  # seq_id -> micro-batch in flight holding it
        self.in_flight: list[tuple[int, list[int]]] = []  # (micro_batch_id, seq_ids), oldest first
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (token, micro_batch_id)
        # each live sequence's table as a receiver of the answers holds it (diffs applied)
        self.answered: dict[int, tuple[int, ...]] = {}
        self.seen_prompts: list[tuple[int, ...]] = []
        self.next_seq_id = 0
        self.next_micro_batch_id = 0

    # ---- applying a step the way a worker would ------------------------------------------

    def _step(self, step: StepInput) -> StepOutput:
        evictions = self.m.stats().num_evictions
        out = self.m.step(step)
        if self.m.stats().num_evictions > evictions:
            _record("eviction")
        if out.copies:
            _record("copy-on-write")
        bs = BLOCK_SIZE
        # copies read every source before any write, and before this step's tokens
        copied = {
            (c.dst_block_id, off): self.slots.get(c.src_block_id * bs + off) for c in out.copies for off in range(bs)
        }
        for (block_id, off), value in copied.items():
            if value is None:
                self.slots.pop(block_id * bs + off, None)
            else:
                self.slots[block_id * bs + off] = value
        return out

    def _write(self, result: Allocated, token_ids: list[int], micro_batch_id: int) -> None:
        assert result.num_new_tokens == len(token_ids)
        # the answer is a diff against the last one for this sequence (whole for a new one)
        table = result.applied_to(self.answered.get(result.seq_id, ()))
        # ... except for pages a window gave back since: a receiver keeps the old ids there
        # and never reads them
        held = _entries(self.m.block_table(result.seq_id))
        assert len(held) == len(table)
        for mine, theirs in zip(held, _entries(table), strict=True):
            assert all(a in (b, NULL_PAGE) for a, b in zip(mine, theirs, strict=True)), (held, table)
        self.answered[result.seq_id] = table
        start = result.num_computed_tokens
        for position, token in enumerate(token_ids, start):
            for page in _entries(table)[position // BLOCK_SIZE]:
                assert page != NULL_PAGE, (result, position)
                self.slots[page * BLOCK_SIZE + position % BLOCK_SIZE] = (token, micro_batch_id)

    def _read(self, seq_id: int, position: int, group: int = 0) -> int:
        page = _entries(self.m.block_table(seq_id))[position // BLOCK_SIZE][group]
        assert page != NULL_PAGE, (seq_id, position, group)
        return self.slots.get(page * BLOCK_SIZE + position % BLOCK_SIZE, (GARBAGE, -1))[0]

    def _visible(self, group: int, length: int) -> range:
        """The positions sub-group `group` must still hold for a next query at `length`."""
        window = self.GROUPS[group]
        return range(max(0, length - window + 1) if window else 0, length)

    def _new_micro_batch(self) -> int:
        self.next_micro_batch_id += 1
        return self.next_micro_batch_id

    def _idle(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.busy)

    # ---- rules ----------------------------------------------------------------------------

    def _add(self, prompt: list[int], namespace: str | None, chunk: int | None) -> None:
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        micro_batch_id = self._new_micro_batch()
        out = self._step(
            StepInput(new_sequences=[NewSequence(seq_id, prompt, namespace, chunk)], micro_batch_id=micro_batch_id)
        )
        self.in_flight.append((micro_batch_id, []))
        result = out.results[seq_id]
        if isinstance(result, NoBlocks):
            _record("no blocks")
            assert not self.m.has_sequence(seq_id)
            assert result.num_needed_blocks > result.num_free_blocks
            return
        computed = result.num_computed_tokens
        assert computed < len(prompt)
        if computed:
            _record("prefix hit")
            if computed == len(prompt) - 1 and len(prompt) % BLOCK_SIZE == 0:
                _record("whole-prompt hit")
            # the hit blocks hold exactly the query's tokens, written by completed work
            for group in range(len(self.GROUPS)):
                for position in self._visible(group, computed):
                    assert self._read(seq_id, position, group) == prompt[position], (position, prompt)
            for index in range(computed // BLOCK_SIZE):
                block_tokens = prompt[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                assert self.m.cached_token_ids(_entries(result.block_ids)[index][0]) == tuple(block_tokens)
        num_new = result.num_new_tokens
        self._write(result, prompt[computed : computed + num_new], micro_batch_id)
        self.tokens[seq_id] = prompt[: computed + num_new]
        self.pending_prompt[seq_id] = prompt[computed + num_new :]
        self.busy[seq_id] = micro_batch_id
        self.in_flight[-1][1].append(seq_id)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        namespace=st.sampled_from(NAMESPACES),
        chunk=st.none() | st.integers(1, 6),
    )
    def new_sequence(
        self, prefix: tuple[int, ...], suffix: list[int], namespace: str | None, chunk: int | None
    ) -> None:
        prompt = [*prefix, *suffix] or [0]
        self.seen_prompts.append(tuple(prompt))
        self._add(prompt, namespace, chunk)

    @precondition(lambda self: self.seen_prompts)
    @rule(data=st.data(), namespace=st.sampled_from(NAMESPACES))
    def reuse_prompt(self, data: st.DataObject, namespace: str | None) -> None:
        """A prompt seen before, possibly cut: whole-prompt and partial hits."""
        prompt = list(data.draw(st.sampled_from(self.seen_prompts)))
        cut = data.draw(st.integers(1, len(prompt)))
        self._add(prompt[:cut], namespace, None)

    @precondition(
        lambda self: (
            len(self.m.evictable_block_ids()) > self.m.watermark_blocks
            and self.m.stats().num_free_blocks < NUM_BLOCKS // 2
        )
    )
    @rule(data=st.data(), fresh_token=st.integers(10, 13))
    def overfill(self, data: st.DataObject, fresh_token: int) -> None:
        """One block more than is free, after the full blocks of a seen prompt (which may
        hit evictable blocks): forces an eviction that must spare the hit blocks."""
        base: tuple[int, ...] = ()
        if self.seen_prompts:
            base = data.draw(st.sampled_from(self.seen_prompts))
        base = base[: len(base) // BLOCK_SIZE * BLOCK_SIZE]
        num_entries = self.m.stats().num_free_blocks // len(self.GROUPS) + 1
        self._add([*base, *[fresh_token] * (num_entries * BLOCK_SIZE - 1)], None, None)

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(self._idle()))
        pending = self.pending_prompt[seq_id]
        # a decode's first token is this sequence's own, so forked relatives diverge
        token_ids = pending[: len(extra)] if pending else [100 + seq_id, *extra[1:]]
        # room held ahead for tokens not known yet (an asynchronous scheduler's placeholder
        # step), sometimes with no tokens at all
        lookahead = data.draw(st.sampled_from([0, 0, 1, 3, BLOCK_SIZE + 1]))
        if lookahead and data.draw(st.booleans()):
            token_ids = []
        before = (self.m.block_table(seq_id), self.m.num_tokens(seq_id))
        micro_batch_id = self._new_micro_batch()
        out = self._step(StepInput(appends=[Append(seq_id, token_ids, lookahead)], micro_batch_id=micro_batch_id))
        self.in_flight.append((micro_batch_id, []))
        result = out.results[seq_id]
        if isinstance(result, NoBlocks):
            _record("no blocks")
            assert (self.m.block_table(seq_id), self.m.num_tokens(seq_id)) == before
            return
        assert result.num_computed_tokens == len(self.tokens[seq_id])
        if lookahead:
            _record("lookahead")
            room = len(self.tokens[seq_id]) + len(token_ids) + lookahead
            # blocks held ahead past the room asked for go back (a verify step's rejected drafts)
            assert result.num_blocks == -(-room // BLOCK_SIZE), (before, result)
        self._write(result, token_ids, micro_batch_id)
        self.tokens[seq_id].extend(token_ids)
        self.pending_prompt[seq_id] = pending[len(token_ids) :] if pending else []
        self.busy[seq_id] = micro_batch_id
        self.in_flight[-1][1].append(seq_id)

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._idle()))
        child = self.next_seq_id
        self.next_seq_id += 1
        self.m.fork(parent, child)
        # the child shares the blocks with tokens, not a block held ahead
        num_shared = -(-self.m.num_tokens(parent) // BLOCK_SIZE)
        assert self.m.block_table(child) == self.m.block_table(parent)[:num_shared]
        self.tokens[child] = list(self.tokens[parent])
        self.pending_prompt[child] = list(self.pending_prompt[parent])
        if parent in self.tainted:
            self.tainted.add(child)

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def fork_and_decode(self, data: st.DataObject) -> None:
        """Parallel sampling: fork, then parent and child each append their own token in
        the same step (the later writer of a shared partial block gets a copy first)."""
        parent = data.draw(st.sampled_from(self._idle()))
        if self.pending_prompt[parent]:
            return  # still prefilling
        child = self.next_seq_id
        self.next_seq_id += 1
        micro_batch_id = self._new_micro_batch()
        order = data.draw(st.permutations([parent, child]))
        out = self._step(
            StepInput(
                forks=[Fork(parent, child)],
                appends=[Append(s, [100 + s]) for s in order],
                micro_batch_id=micro_batch_id,
            )
        )
        self.in_flight.append((micro_batch_id, []))
        self.tokens[child] = list(self.tokens[parent])
        self.pending_prompt[child] = []
        if parent in self.tainted:
            self.tainted.add(child)
        for seq_id in order:
            result = out.results[seq_id]
            if isinstance(result, NoBlocks):
                _record("no blocks")
                continue
            self._write(result, [100 + seq_id], micro_batch_id)
            self.tokens[seq_id].append(100 + seq_id)
            self.busy[seq_id] = micro_batch_id
            self.in_flight[-1][1].append(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """Any sequence, in flight or not (an abort)."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq_id)
        for table in (self.tokens, self.pending_prompt, self.busy, self.answered):
            table.pop(seq_id, None)
        self.tainted.discard(seq_id)

    @precondition(lambda self: self.in_flight)
    @rule(count=st.integers(1, 3))
    def complete(self, count: int) -> None:
        done, self.in_flight = self.in_flight[:count], self.in_flight[count:]
        self.m.complete([micro_batch_id for micro_batch_id, _ in done])
        for _, seq_ids in done:
            for seq_id in seq_ids:
                self.busy.pop(seq_id, None)

    @precondition(lambda self: self.in_flight)
    @rule()
    def fail(self) -> None:
        (micro_batch_id, seq_ids), *self.in_flight = self.in_flight
        self.m.fail([micro_batch_id])
        _record("failed micro-batch")
        # the KV this micro-batch wrote is garbage wherever nothing rewrote it since
        for slot, (_, writer) in list(self.slots.items()):
            if writer == micro_batch_id:
                self.slots[slot] = (GARBAGE, micro_batch_id)
        for seq_id in seq_ids:
            self.busy.pop(seq_id, None)
            if seq_id in self.tokens:
                self.tainted.add(seq_id)

    @rule()
    def free_everything(self) -> None:
        self._drain()
        self._check_all_free()

    def _drain(self) -> None:
        if self.in_flight:
            self.complete(len(self.in_flight))
        if self.tokens:
            self.m.step(StepInput(frees=sorted(self.tokens)))
        for table in (self.tokens, self.pending_prompt, self.busy, self.answered):
            table.clear()
        self.tainted.clear()

    def _check_all_free(self) -> None:
        stats = self.m.stats()
        assert stats.num_used_blocks == 0
        assert stats.num_free_blocks + stats.num_evictable_blocks == self.NUM_BLOCKS
        assert stats.num_evictable_blocks == stats.num_cached_blocks
        assert all(self.m.ref_count(b) == 0 for b in range(self.NUM_BLOCKS))
        self.m.check_integrity()

    # ---- invariants after every step -------------------------------------------------------

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.m.check_integrity()
        holders: Counter[int] = Counter()
        for seq_id in self.m.seq_ids():
            holders.update(self.m.pages(seq_id))
        for block_id in range(self.NUM_BLOCKS):
            assert self.m.ref_count(block_id) == holders[block_id], block_id
        used = set(holders)
        free = {b for start, n in self.m.free_extents() for b in range(start, start + n)}
        evictable = set(self.m.evictable_block_ids())
        assert not used & free and not used & evictable and not free & evictable
        # free here: nobody holds it, cached (evictable) or not
        assert len(used) + len(free) + len(evictable) == self.NUM_BLOCKS
        stats = self.m.stats()
        assert stats.num_used_blocks == len(used)
        assert stats.num_free_blocks + stats.num_evictable_blocks == len(free | evictable)

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        """Whatever is findable holds exactly the tokens it is found by."""
        for block_id in range(self.NUM_BLOCKS):
            cached = self.m.cached_token_ids(block_id)
            if cached is not None:
                held = [self.slots.get(block_id * BLOCK_SIZE + off, (GARBAGE, -1))[0] for off in range(BLOCK_SIZE)]
                assert tuple(held) == cached, (block_id, held, cached)

    @invariant()
    def sequences_read_back_their_tokens(self) -> None:
        assert sorted(self.m.seq_ids()) == sorted(self.tokens)
        for seq_id, token_ids in self.tokens.items():
            assert self.m.num_tokens(seq_id) == len(token_ids)
            if seq_id in self.tainted:
                continue
            for group in range(len(self.GROUPS)):
                for position in self._visible(group, len(token_ids)):
                    assert self._read(seq_id, position, group) == token_ids[position], (seq_id, position, group)

    def teardown(self) -> None:
        self._drain()
        self._check_all_free()


def test_kv_cache_state_machine() -> None:
    EVENTS.clear()
    run_state_machine_as_test(KVCacheMachine, settings=KV_MACHINE_SETTINGS)
    for name in ("prefix hit", "whole-prompt hit", "eviction", "copy-on-write", "no blocks", "lookahead"):
        assert EVENTS[name] > 0, (name, dict(EVENTS))


class GroupedKVCacheMachine(KVCacheMachine):
    """Two full-attention sub-groups and sliding ones of windows 5 and 9 (block size 4)."""

    NUM_BLOCKS = 64
    GROUPS = (0, 0, 5, 9)

    @invariant()
    def windows_give_pages_back(self) -> None:
        """A sliding sub-group holds no page of a block its window left at the last append."""
        for stats in self.m.sequence_stats():
            if stats.num_window_blocks < stats.num_blocks // 2:
                _record("window slid")


def test_grouped_kv_cache_state_machine() -> None:
    EVENTS.clear()
    run_state_machine_as_test(GroupedKVCacheMachine, settings=KV_MACHINE_SETTINGS)
    for name in (
        "prefix hit",
        "whole-prompt hit",
        "eviction",
        "copy-on-write",
        "no blocks",
        "lookahead",
        "window slid",
    ):
        assert EVENTS[name] > 0, (name, dict(EVENTS))
