"""A minimal stand-in for the scheduler, for tests of the runtime and the stage workers.

Not production code. `PlanBuilder` admits sequences at given steps and forms flattened
micro-batches that mix prefill chunks and decode tokens under a token budget (vLLM v1's
rule: every sequence catches its computed tokens up to its known tokens), never putting a
sequence in two micro-batches in flight. Blocks come from a shuffled free list, so block
tables are not contiguous, with reference counts so that forked sequences share blocks
and a partial last block is copied (copy-on-write, carried out by the stages).
`PipelineDriver` pushes plans through `StageRunner`s in one process, handing hidden states
along; `support.grpc_driver` does the same over real worker processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, StepPlan
from worker_svc.execution.runner import StageRunner


@dataclass
class DriverSeq:
    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    arrival_step: int = 0
    choice_index: int = 0
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new_tokens


@dataclass
class StepRecord:
    """What one forward pass held: per sequence, (seq_id, num_tokens, was_prefill)."""

    entries: list[tuple[int, int, bool]]

    @property
    def mixes_prefill_and_decode(self) -> bool:
        kinds = {prefill for _, _, prefill in self.entries}
        return kinds == {True, False}


Chunks = list[tuple[DriverSeq, int]]


class PlanBuilder:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        chunk_size: int | None = None,
        max_batched_tokens: int = 1 << 30,
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.max_batched_tokens = max_batched_tokens
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.refs: dict[int, int] = {}
        self.seqs: list[DriverSeq] = []
        self.records: list[StepRecord] = []
        self.step = 0
        self._next_mb = 0
        self._released: list[int] = []
        self._copies: list[tuple[int, int]] = []
        # seq_id -> (block table, tokens) the stages were sent: later steps send the changes
        self._sent: dict[int, tuple[tuple[int, ...], int]] = {}

    def add(self, seq: DriverSeq) -> None:
        self.seqs.append(seq)

    @property
    def all_done(self) -> bool:
        return all(s.done for s in self.seqs)

    def form_plan(self, busy: set[int] = frozenset()) -> tuple[StepPlan, Chunks] | None:
        """The next micro-batch from sequences not in flight (`busy`), or None."""
        live = [s for s in self.seqs if s.arrival_step <= self.step and not s.done and s.seq_id not in busy]
        self.step += 1
        budget = self.max_batched_tokens
        chunks: Chunks = []
        for s in sorted(live, key=lambda s: s.num_computed < len(s.prompt)):  # decodes first
            want = len(s.tokens) - s.num_computed
            if s.num_computed < len(s.prompt) and self.chunk_size is not None:
                want = min(want, self.chunk_size)
            n = min(want, budget)
            if n <= 0:
                continue
            chunks.append((s, n))
            budget -= n
        if not chunks:
            return None
        new_seqs, cached_seqs = [], []
        for s, n in chunks:
            ctx = s.num_computed + n
            while len(s.blocks) * self.block_size < ctx:
                block = self.free_blocks.pop()
                self.refs[block] = 1
                s.blocks.append(block)
            blocks, tokens = tuple(s.blocks), tuple(s.tokens)
            sent = self._sent.get(s.seq_id)
            if sent is None:
                new_seqs.append(
                    NewSeq(
                        s.seq_id, tokens, len(s.prompt), s.num_computed, n, blocks, s.params, s.choice_index, s.seq_id
                    )
                )
            else:
                held, known = sent
                offset = len(held) if blocks[: len(held)] == held else 0
                cached_seqs.append(CachedSeq(s.seq_id, n, offset, blocks[offset:], tokens[known:]))
            self._sent[s.seq_id] = (blocks, len(tokens))
        plan = StepPlan(
            self._next_mb,
            tuple(new_seqs),
            tuple(cached_seqs),
            finished_seq_ids=tuple(self._released),
            block_copies=tuple(self._copies),
        )
        for seq_id in self._released:
            self._sent.pop(seq_id, None)
        self._released, self._copies = [], []
        self._next_mb += 1
        self.records.append(StepRecord([(s.seq_id, n, s.num_computed < len(s.prompt)) for s, n in chunks]))
        return plan, chunks

    def complete(self, chunks: Chunks, seq_ids, token_ids) -> None:
        """Apply a micro-batch's result: computed tokens advance, sampled tokens append."""
        by_id = {s.seq_id: s for s, _ in chunks}
        for s, n in chunks:
            s.num_computed += n
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            by_id[seq_id].outputs.append(token)
        for s, _ in chunks:
            if s.done and s.blocks:
                self._free(s)

    def _free(self, s: DriverSeq) -> None:
        for block in s.blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                self.free_blocks.append(block)
        s.blocks = []
        self._released.append(s.seq_id)

    def fork(self, parent: DriverSeq, child_id: int, choice_index: int = 1) -> DriverSeq:
        """The child shares the parent's full blocks; a partial last block is copied."""
        child = DriverSeq(
            child_id,
            list(parent.prompt),
            parent.max_new_tokens,
            parent.params,
            parent.arrival_step,
            choice_index,
            list(parent.outputs),
            parent.num_computed,
            list(parent.blocks),
        )
        for block in child.blocks:
            self.refs[block] += 1
        if parent.num_computed % self.block_size and child.blocks:
            src = child.blocks[-1]
            dst = self.free_blocks.pop()
            self.refs[src] -= 1
            self.refs[dst] = 1
            child.blocks[-1] = dst
            self._copies.append((src, dst))
        self.seqs.append(child)
        return child


class PipelineDriver:
    """Runs plans through in-process StageRunners, one micro-batch at a time."""

    def __init__(
        self,
        runners: list[StageRunner],
        chunk_size: int | None = None,
        max_batched_tokens: int = 1 << 30,
        seed: int = 0,
    ) -> None:
        self.runners = runners
        self.builder = PlanBuilder(runners[0].block_size, runners[0].num_blocks, chunk_size, max_batched_tokens, seed)

    @property
    def records(self) -> list[StepRecord]:
        return self.builder.records

    def run(self, seqs: list[DriverSeq], max_steps: int = 10_000) -> list[list[int]]:
        for s in seqs:
            self.builder.add(s)
        while not self.builder.all_done:
            if self.builder.step >= max_steps:
                raise RuntimeError("driver did not finish")
            formed = self.builder.form_plan()
            if formed is None:
                continue
            plan, chunks = formed
            hidden, result = None, None
            for runner in self.runners:
                result = runner.execute(plan, hidden)
                hidden = result.hidden
            self.builder.complete(chunks, result.sampled_seq_ids, result.sampled.token_ids)
        return [s.outputs for s in seqs]
