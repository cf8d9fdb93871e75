"""StageRunner: one pipeline stage's model slice, KV pools and (last stage) sampler.

`execute(plan, hidden)` validates the whole plan before touching any state, applies the
plan's releases and block copies, runs the stage's layers over the flattened batch, and
returns either the hidden states for the next stage or, on the last stage, the sampled
tokens. It owns its tensors; callers run it from one thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from worker_svc.attention import AttentionBackend, AttentionMetadata, get_backend
from worker_svc.errors import InvalidPlanError
from worker_svc.kv_cache import PagedKVCache
from worker_svc.model import StageModel
from worker_svc.plan import StagePlan
from worker_svc.sampler import Sampler, SamplerOutput

# one scored prompt position: (target token id, its logprob, its 1-based rank, alternatives)
PositionLogprobs = tuple[int, float, int, list[tuple[int, float]]]
MAX_PROMPT_NUM_TOP = 20


@dataclass
class StageResult:
    """What a stage hands on: hidden states (not last) or sampled tokens (last)."""

    micro_batch_id: int
    hidden: torch.Tensor | None = None  # [num_tokens, hidden_size]
    sampled_seq_ids: tuple[int, ...] = ()
    sampled: SamplerOutput | None = None
    logits: torch.Tensor | None = None  # [len(sampled_seq_ids), vocab] when asked for
    # last stage, prompt scoring: (seq_id, first_position, per position
    # (target id, logprob, rank, [(id, logprob) most likely first]))
    prompt_logprobs: list[tuple[int, int, list[PositionLogprobs]]] = field(default_factory=list)
    compute_ns: int = 0


class StageRunner:
    """Executes micro-batch plans for layers `[model.start, model.end)`."""

    def __init__(
        self,
        model: StageModel,
        num_blocks: int,
        block_size: int,
        backend: str | AttentionBackend = "torch",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        config = model.config
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.kv_cache = PagedKVCache(
            model.num_local_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            kv_dtype or self.dtype,
            self.device,
        )
        self.sampler = Sampler() if model.is_last else None

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def validate(self, plan: StagePlan, hidden: torch.Tensor | None) -> None:
        """Raise InvalidPlanError for anything malformed; changes nothing."""
        config, bs, nb = self.model.config, self.block_size, self.num_blocks
        if not plan.seqs:
            raise InvalidPlanError(f"micro-batch {plan.micro_batch_id}: no sequences")
        seen: set[int] = set()
        for s in plan.seqs:
            where = f"micro-batch {plan.micro_batch_id}, sequence {s.seq_id}"
            if s.seq_id in seen:
                raise InvalidPlanError(f"{where}: appears twice")
            seen.add(s.seq_id)
            if s.num_tokens < 1 or s.context_len < s.num_tokens:
                raise InvalidPlanError(
                    f"{where}: num_tokens={s.num_tokens}, context_len={s.context_len}: "
                    "need 1 <= num_tokens <= context_len"
                )
            if s.context_len > config.max_position_embeddings:
                raise InvalidPlanError(
                    f"{where}: context_len {s.context_len} exceeds max_position_embeddings "
                    f"{config.max_position_embeddings}"
                )
            if len(s.slot_mapping) != s.num_tokens:
                raise InvalidPlanError(
                    f"{where}: slot_mapping has {len(s.slot_mapping)} entries for {s.num_tokens} tokens"
                )
            needed_blocks = -(-s.context_len // bs)
            if len(s.block_table) < needed_blocks:
                raise InvalidPlanError(
                    f"{where}: block_table has {len(s.block_table)} blocks, context needs {needed_blocks}"
                )
            bad = [b for b in s.block_table[:needed_blocks] if not 0 <= b < nb]
            if bad:
                raise InvalidPlanError(f"{where}: block id {bad[0]} out of range [0, {nb})")
            for j, slot in enumerate(s.slot_mapping):
                pos = s.start_position + j
                expected = s.block_table[pos // bs] * bs + pos % bs
                if slot != expected:
                    raise InvalidPlanError(
                        f"{where}: slot {slot} for position {pos} disagrees with the block table "
                        f"(expected {expected}; slots must lie in [0, {self.kv_cache.num_slots}))"
                    )
            if s.sample is not None and s.sample.seq_id != s.seq_id:
                raise InvalidPlanError(f"{where}: sampling row names sequence {s.sample.seq_id}")
            p = s.prompt_scoring
            if p is not None and (
                    not p.targets or p.first_position < s.start_position
                    or p.first_position + len(p.targets) > s.context_len
                    or not 0 <= p.num_top <= MAX_PROMPT_NUM_TOP
                    or any(not 0 <= t < config.vocab_size for t in p.targets)):
                raise InvalidPlanError(
                    f"{where}: prompt scoring of {len(p.targets)} targets from position "
                    f"{p.first_position} (top {p.num_top}) does not fit its new tokens "
                    f"{s.start_position}..{s.context_len - 1} and vocabulary")
            if self.model.is_first:
                if len(s.token_ids) != s.num_tokens:
                    raise InvalidPlanError(
                        f"{where}: {len(s.token_ids)} token ids for {s.num_tokens} tokens (stage 0 needs them)"
                    )
                if any(not 0 <= t < config.vocab_size for t in s.token_ids):
                    raise InvalidPlanError(f"{where}: token id outside [0, {config.vocab_size})")
        for src, dst in plan.block_copies:
            if not (0 <= src < nb and 0 <= dst < nb) or src == dst:
                raise InvalidPlanError(
                    f"micro-batch {plan.micro_batch_id}: block copy {src}->{dst} invalid for {nb} blocks"
                )
        if self.model.is_first:
            if hidden is not None:
                raise InvalidPlanError(f"micro-batch {plan.micro_batch_id}: stage 0 takes token ids, not hidden states")
        else:
            want = (plan.num_tokens, config.hidden_size)
            if hidden is None or tuple(hidden.shape) != want:
                got = None if hidden is None else tuple(hidden.shape)
                raise InvalidPlanError(
                    f"micro-batch {plan.micro_batch_id}: hidden states of shape {got}, expected {want}"
                )

    def execute(
        self, plan: StagePlan, hidden: torch.Tensor | None = None, keep_logits: bool = False
    ) -> StageResult:
        self.validate(plan, hidden)
        started = time.perf_counter_ns()
        if self.sampler is not None:
            if plan.release_all:
                self.sampler.release(list(self.sampler.live_seq_ids))
            elif plan.released_seq_ids:
                self.sampler.release(plan.released_seq_ids)
        self.kv_cache.copy_blocks(plan.block_copies)
        metadata, positions = self._metadata(plan)
        if self.model.is_first:
            ids = [t for s in plan.seqs for t in s.token_ids]
            inputs = torch.tensor(ids, dtype=torch.long, device=self.device)
        else:
            inputs = hidden.to(device=self.device, dtype=self.dtype)
        result = StageResult(plan.micro_batch_id)
        if not self.model.is_last:
            result.hidden = self.model(inputs, positions, self.kv_cache.pools, metadata, self.backend)
        else:
            rows, ends, end = [], [], 0
            scored, score_indices = [], []
            for s in plan.seqs:
                if s.prompt_scoring is not None:
                    offset = end + s.prompt_scoring.first_position - s.start_position
                    scored.append(s)
                    score_indices.extend(range(offset, offset + len(s.prompt_scoring.targets)))
                end += s.num_tokens
                if s.sample is not None:
                    rows.append(s)
                    ends.append(end - 1)
            indices = torch.tensor(ends + score_indices, dtype=torch.long, device=self.device)
            logits = self.model(
                inputs, positions, self.kv_cache.pools, metadata, self.backend, logits_indices=indices
            )
            if scored:
                result.prompt_logprobs = _score_prompts(logits[len(rows):], scored)
                logits = logits[: len(rows)]
            result.sampled_seq_ids = tuple(s.seq_id for s in rows)
            result.sampled = (
                self.sampler.sample(logits, [s.sample for s in rows])
                if rows
                else SamplerOutput([], [], [])
            )
            if keep_logits:
                result.logits = logits
        result.compute_ns = time.perf_counter_ns() - started
        return result

    def _metadata(self, plan: StagePlan) -> tuple[AttentionMetadata, torch.Tensor]:
        device = self.device
        starts, positions, slots = [0], [], []
        for s in plan.seqs:
            starts.append(starts[-1] + s.num_tokens)
            positions.extend(range(s.start_position, s.context_len))
            slots.extend(s.slot_mapping)
        bs = self.block_size
        max_blocks = max(-(-s.context_len // bs) for s in plan.seqs)
        rows = []
        for s in plan.seqs:
            n = -(-s.context_len // bs)
            rows.append(list(s.block_table[:n]) + [0] * (max_blocks - n))  # padding: block 0
        table = torch.tensor(rows, dtype=torch.long)
        context_lens = tuple(s.context_len for s in plan.seqs)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
            block_tables=table.to(device),
            query_start_loc_list=tuple(starts),
            context_lens_list=context_lens,
        )
        return metadata, torch.tensor(positions, dtype=torch.long, device=device)


SCORE_ROWS_PER_SLICE = 256  # bounds the float32 [rows, vocab] temporaries of prompt scoring


def _score_prompts(logits: torch.Tensor, scored) -> list[tuple[int, int, list[PositionLogprobs]]]:
    """Log-probabilities (raw logits) of each scored chunk's targets, their ranks and the
    most likely alternatives; `logits` rows are the chunks' scored positions, in order.
    Computed a slice of rows at a time, so a long chunk with a large vocabulary does not
    hold [positions, vocab] float32 copies at once."""
    targets = torch.tensor([t for s in scored for t in s.prompt_scoring.targets],
                           dtype=torch.long, device=logits.device)
    most = min(max(s.prompt_scoring.num_top for s in scored), logits.shape[1])
    target_list, lp_list, rank_list, values_list, ids_list = targets.tolist(), [], [], [], []
    for start in range(0, logits.shape[0], SCORE_ROWS_PER_SLICE):
        part = slice(start, start + SCORE_ROWS_PER_SLICE)
        logprobs = torch.log_softmax(logits[part].float(), dim=-1)  # [rows, vocab]
        target_lp = logprobs.gather(1, targets[part, None])  # [rows, 1]
        rank_list += ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
        lp_list += target_lp[:, 0].tolist()
        if most:
            values, ids = logprobs.topk(most, dim=-1)
            values_list += values.tolist()
            ids_list += ids.tolist()
        else:
            values_list += [[] for _ in range(logprobs.shape[0])]
            ids_list += [[] for _ in range(logprobs.shape[0])]
    out, row = [], 0
    for s in scored:
        p = s.prompt_scoring
        positions = []
        for _ in p.targets:
            top = list(zip(ids_list[row][:p.num_top], values_list[row][:p.num_top], strict=True))
            positions.append((target_list[row], lp_list[row], rank_list[row], top))
            row += 1
        out.append((s.seq_id, p.first_position, positions))
    return out
