"""A minimal stand-in for the scheduler, for tests of the model runtime: not production code.

It admits sequences at given steps, forms flattened micro-batches that mix prefill chunks
and decode tokens under a token budget (vLLM v1's rule: every sequence catches its
computed tokens up to its known tokens), allocates blocks from a shuffled free list so
that block tables are not contiguous, and pushes each plan through a chain of
`StageRunner`s in one process, handing hidden states along.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from worker_svc.plan import SeqChunk, StagePlan
from worker_svc.runner import StageRunner
from worker_svc.sampler import SampleRow, SamplingParams


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


class PipelineDriver:
    def __init__(
        self,
        runners: list[StageRunner],
        chunk_size: int | None = None,
        max_batched_tokens: int = 1 << 30,
        seed: int = 0,
    ) -> None:
        self.runners = runners
        self.block_size = runners[0].block_size
        self.chunk_size = chunk_size
        self.max_batched_tokens = max_batched_tokens
        self.free_blocks = list(range(runners[0].num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.records: list[StepRecord] = []
        self._next_mb = 0
        self._released: list[int] = []

    def run(self, seqs: list[DriverSeq], max_steps: int = 10_000) -> list[list[int]]:
        step = 0
        while not all(s.done for s in seqs):
            if step >= max_steps:
                raise RuntimeError("driver did not finish")
            live = [s for s in seqs if s.arrival_step <= step and not s.done]
            if live:
                self._step(live)
            step += 1
            for s in seqs:
                if s.done and s.blocks:
                    self.free_blocks.extend(s.blocks)
                    s.blocks = []
                    self._released.append(s.seq_id)
        return [s.outputs for s in seqs]

    def _step(self, live: list[DriverSeq]) -> None:
        budget = self.max_batched_tokens
        chunks: list[tuple[DriverSeq, int]] = []
        # decodes first, then prefill chunks
        for s in sorted(live, key=lambda s: s.num_computed < len(s.prompt)):
            want = len(s.tokens) - s.num_computed
            if s.num_computed < len(s.prompt) and self.chunk_size is not None:
                want = min(want, self.chunk_size)
            n = min(want, budget)
            if n <= 0:
                continue
            chunks.append((s, n))
            budget -= n
        plan_seqs = []
        for s, n in chunks:
            ctx = s.num_computed + n
            while len(s.blocks) * self.block_size < ctx:
                s.blocks.append(self.free_blocks.pop())
            start = s.num_computed
            slots = tuple(
                s.blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, ctx)
            )
            sample = None
            if ctx == len(s.tokens):
                sample = SampleRow(
                    seq_id=s.seq_id,
                    params=s.params,
                    choice_index=s.choice_index,
                    output_position=len(s.outputs),
                    entropy_seed=s.seq_id,
                )
            plan_seqs.append(
                SeqChunk(
                    seq_id=s.seq_id,
                    num_tokens=n,
                    context_len=ctx,
                    slot_mapping=slots,
                    block_table=tuple(s.blocks),
                    token_ids=tuple(s.tokens[start:ctx]),
                    sample=sample,
                )
            )
        plan = StagePlan(self._next_mb, tuple(plan_seqs), released_seq_ids=tuple(self._released))
        self._released = []
        self._next_mb += 1
        self.records.append(
            StepRecord([(s.seq_id, n, s.num_computed < len(s.prompt)) for s, n in chunks])
        )
        hidden = None
        result = None
        for runner in self.runners:
            first = runner.model.is_first
            stage_plan = plan if first else _without_tokens(plan)
            result = runner.execute(stage_plan, hidden)
            hidden = result.hidden
        by_id = {s.seq_id: s for s, _ in chunks}
        for s, n in chunks:
            s.num_computed += n
        for seq_id, token in zip(result.sampled_seq_ids, result.sampled.token_ids, strict=True):
            by_id[seq_id].outputs.append(token)


def _without_tokens(plan: StagePlan) -> StagePlan:
    """Later stages get hidden states, not token ids (as over the wire)."""
    seqs = tuple(
        SeqChunk(s.seq_id, s.num_tokens, s.context_len, s.slot_mapping, s.block_table, (), s.sample)
        for s in plan.seqs
    )
    return StagePlan(plan.micro_batch_id, seqs, plan.block_copies, plan.released_seq_ids)
