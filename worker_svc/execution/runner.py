"""StageRunner: one pipeline stage's model slice, KV pools and (last stage) sampler.

`execute(plan, hidden)` validates the whole plan before touching any state, applies the
plan's releases and block copies, runs the stage's layers over the flattened batch, and
returns either the hidden states for the next stage or, on the last stage, the sampled
tokens (and the vectors of pooling sequences: worker_svc/execution/pooler.py). It owns its tensors;
callers run it from one thread.

KV groups (services/kv_layout.py): given the model's grouped layout (`layout`, what the KV
service was told), `num_blocks` counts pages, the pools are one per page slot the stage's
layers use, and each step's metadata carries every sub-group's tables. Without one (or
for a model whose layers do not group) a block id names a block in every layer, as always.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from services.kv_layout import KVLayout
from services.step import (
    PooledOutput,
    PositionLogprobs,
    SampledToken,
    ScoredPrompt,
    StageTiming,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from worker_svc.errors import InvalidPlanError, LoraNotLoadedError
from worker_svc.execution.batch import PersistentBatch, Row, StageShape
from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.execution.pooler import pool, pool_positions
from worker_svc.execution.sampler import Sampler
from worker_svc.execution.sampler_types import SamplerOutput, SampleRow
from worker_svc.execution.structured import GrammarBank
from worker_svc.kernels.attention import AttentionBackend, AttentionMetadata, get_backend
from worker_svc.kernels.attention_metadata import entry_table, paged_layout
from worker_svc.layers.moe import expert_weight_bytes
from worker_svc.models.stage import StageModel
from worker_svc.weights.lora import LoraBank, LoraStep, token_slots
from worker_svc.weights.quantization import weight_bytes


@dataclass
class StageResult:
    """What a stage hands on: hidden states (not last) or sampled tokens (last)."""

    step_id: int
    hidden: torch.Tensor | None = None  # [num_tokens, hidden_size]
    rows: list[Row] = field(default_factory=list)
    sampled_seq_ids: tuple[int, ...] = ()  # per sampled token (a verify row gives several)
    sampled_positions: tuple[int, ...] = ()  # per sampled token: its position in its sequence
    sampled: SamplerOutput | None = None
    logits: torch.Tensor | None = None  # [len(sampled_seq_ids), vocab] when asked for
    prompt_logprobs: list[ScoredPrompt] = field(default_factory=list)  # last stage
    pooled: list[PooledOutput] = field(default_factory=list)  # last stage: pooling sequences done
    proposals: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # last stage: draft model's
    compute_ns: int = 0

    def sampled_tokens(self) -> tuple[SampledToken, ...]:
        """The last stage's samples as the step contract's typed results."""
        out = self.sampled
        if out is None:
            return ()
        return tuple(
            SampledToken(seq_id, token, None if top is None else TokenLogprobs(logprob, top))
            for seq_id, token, logprob, top in zip(
                self.sampled_seq_ids, out.token_ids, out.logprobs, out.top_logprobs, strict=True
            )
        )

    def step_result(self, timings: tuple[StageTiming, ...] = ()) -> StepResult:
        return StepResult(
            self.step_id,
            self.sampled_tokens(),
            tuple(self.prompt_logprobs),
            timings,
            tuple(self.pooled),
            tuple(self.proposals),
        )


# Steps of at least this many tokens (prefill chunks, large batches) may take more threads
# than small ones (`StageRunner.step_threads`): on the real model at one core per thread, a
# 2,048-token prefill ran 1.5x faster on two threads, while a decode step of one sequence ran
# 1.75x faster on one (the one-call native decode step needs one thread; scripts and figures
# in docs/benchmarks.md)
LARGE_STEP_TOKENS = 128


class StageRunner:
    """Executes micro-batch plans for layers `[model.start, model.end)`."""

    def __init__(
        self,
        model: StageModel,
        num_blocks: int,
        block_size: int,
        backend: str | AttentionBackend = "torch",
        kv_dtype: torch.dtype | None = None,
        tp=None,
        step_threads: tuple[int, int] | None = None,
        drafter=None,
        lora: LoraBank | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        config = model.config
        if layout is not None and layout.grouped and layout != model.kv_layout:
            raise ValueError(
                f"KV layout {layout.spec()!r} is not the model's ({model.kv_layout.spec()!r}): "
                f"{model.kv_layout.describe()}"
            )
        # the step's KV sub-groups (1: one table for all layers)
        self.num_kv_groups = layout.num_groups if layout is not None else 1
        self.model = model
        # speculative decoding's draft model (last stage; worker_svc/drafter.DraftProposer):
        # after each step it proposes the next drafts of the sequences sampled
        self.drafter = drafter
        # multi-LoRA (--enable-lora): the adapters this stage holds for its layers; a step's
        # rows of adapters get their low-rank products (worker_svc/weights/lora.py)
        self.lora = lora
        self._lora_step: LoraStep | None = None  # the step being run's
        # rank 0 of a tensor-parallel stage (worker_svc.execution.tensor_parallel.TensorParallelGroup):
        # each step's model inputs go to the other ranks first
        self.tp = tp
        # (small, large): torch threads for steps under / from LARGE_STEP_TOKENS tokens
        # (WorkerConfig.step_threads); None: the process's setting for every step
        self.step_threads = step_threads
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
            layout=layout,
            layers=range(model.start, model.end),
        )
        self.sampler = Sampler(GrammarBank(model.source_dir, config.vocab_size)) if model.is_last else None
        # the KV tier below the pool (--kv-offload; worker_svc/execution/kv_tier.py): the KV
        # manager's moves between it and the pool, applied before each step's block copies
        self.kv_tier = None
        self.batch = PersistentBatch(
            StageShape(
                is_first=model.is_first,
                is_last=model.is_last,
                num_blocks=num_blocks,
                block_size=block_size,
                max_positions=config.max_position_embeddings,
                vocab_size=config.vocab_size,
                kv_windows=layout.windows if layout is not None else (0,),
            )
        )

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def device_name(self) -> str:
        """What the stage reports as its device (`StageLoadInfo.device`): "cpu", "cuda:0"."""
        return str(self.device)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache.pools[0][0].dtype

    @property
    def kv_block_bytes(self) -> int:
        """One block: K and V of every local layer (with KV groups, one page: of every slot
        the stage's layers use)."""
        return self.kv_cache.nbytes // self.kv_cache.num_blocks

    @property
    def weights_bytes(self) -> int:
        """The stage's weights as held (packed GGUF rows at their packed size)."""
        return weight_bytes(self.model)

    @property
    def expert_weights_bytes(self) -> int:
        """Of `weights_bytes`, the mixture-of-experts layers' experts'."""
        return expert_weight_bytes(self.model)

    def validate(self, plan: StepPlan, hidden: torch.Tensor | None) -> None:
        """Raise InvalidPlanError for anything malformed; changes nothing."""
        self._check_inputs(plan, hidden)
        self.batch.validate(plan)

    def _check_inputs(self, plan: StepPlan, hidden: torch.Tensor | None) -> None:
        check_stage_inputs(plan, hidden, self.model.is_first, self.model.config.hidden_size)
        if plan.tier_ops and self.kv_tier is None:  # its loads would leave garbage taken for computed KV
            raise InvalidPlanError(
                f"micro-batch {plan.step_id} moves KV blocks to or from a KV tier, but this stage has "
                "none: start every stage with the KV service's --kv-offload"
            )
        names = [(n.seq_id, n.lora_name) for n in plan.new_seqs if n.lora_name]
        if self.lora is not None:  # (an adapter unloaded under a sequence this stage holds)
            seqs = self.batch.seqs
            names += [
                (c.seq_id, seqs[c.seq_id].lora_name)
                for c in plan.cached_seqs
                if c.seq_id in seqs and seqs[c.seq_id].lora_name
            ]
        for seq_id, name in names:
            if self.lora is None or self.lora.slot_of(name) is None:
                have = "LoRA is off on this stage" if self.lora is None else f"it holds {list(self.lora.names)}"
                raise LoraNotLoadedError(
                    f"step {plan.step_id}, sequence {seq_id}: LoRA adapter {name!r} is not loaded ({have})"
                )

    def execute(self, plan: StepPlan, hidden: torch.Tensor | None = None, keep_logits: bool = False) -> StageResult:
        """Validate the plan whole (against the persistent batch), apply it, run the layers."""
        self._check_inputs(plan, hidden)
        started = time.perf_counter_ns()
        rows = self.batch.apply(plan)  # validates the plan whole before it changes anything
        if self.sampler is not None:
            if plan.reset:
                self.sampler.release(list(self.sampler.live_seq_ids))
            elif plan.finished_seq_ids:
                self.sampler.release(plan.finished_seq_ids)
            if plan.new_seqs:  # sent whole: any state under these ids is stale
                self.sampler.release([n.seq_id for n in plan.new_seqs])
        if self.drafter is not None:
            if plan.reset:
                self.drafter.reset()
            self.drafter.release(plan.finished_seq_ids)  # (a new one catches up by itself)
        if self.kv_tier is not None:
            if plan.reset:
                self.kv_tier.clear()
            if plan.tier_ops:  # a load that cannot be served raises TierMissError: the step fails
                self.kv_tier.apply(plan.tier_ops)

        self.kv_cache.copy_blocks(plan.block_copies)
        metadata, positions = self._metadata(rows)
        if self.model.is_first:
            ids = [t for r in rows for t in r.input_ids()]
            inputs = torch.tensor(ids, dtype=torch.long, device=self.device)
        else:
            inputs = hidden.to(device=self.device, dtype=self.dtype)
        result = StageResult(plan.step_id, rows=rows)
        self._lora_step = self._lora_of(rows)
        if not self.model.is_last:
            result.hidden = self._run_model(plan, inputs, positions, metadata)
        else:
            self._run_last(plan, inputs, positions, metadata, result, keep_logits)
        result.compute_ns = time.perf_counter_ns() - started
        return result

    def _run_last(
        self,
        plan: StepPlan,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        result: StageResult,
        keep_logits: bool,
    ) -> None:
        """The last stage: logits where rows sample or score the prompt, the final norm's
        output where pooling sequences pool; samples, scores and pooled vectors into `result`."""
        rows = result.rows
        sampled, ends, end = [], [], 0
        scored, score_indices = [], []
        for r in rows:
            if r.prompt_scoring is not None:
                offset = end + r.prompt_scoring.first_position - r.start
                scored.append(r)
                score_indices.extend(range(offset, offset + len(r.prompt_scoring.targets)))
            end += r.num_tokens
            if r.sample:  # (a verify row: every position from its last known token on)
                sampled.append(r)
                ends.extend(range(end - 1 - len(r.drafts), end))
        pooling, pool_indices = pool_positions(rows)
        # every row's every position sampled (a decode step): the logits of all rows, ungathered
        every_row = not score_indices and not pooling and len(ends) == end
        indices = None if every_row else torch.tensor(ends + score_indices, dtype=torch.long, device=self.device)
        if pooling:
            logits, normed = self._run_model(
                plan,
                inputs,
                positions,
                metadata,
                indices,
                torch.tensor(pool_indices, dtype=torch.long, device=self.device),
            )
            result.pooled = pool(normed, pooling)
        else:
            logits = self._run_model(plan, inputs, positions, metadata, indices)
        if scored:
            result.prompt_logprobs = _score_prompts(logits[len(ends) :], scored)
            logits = logits[: len(ends)]
        drafts = [r.drafts for r in sampled] if any(r.drafts for r in sampled) else None
        result.sampled = (
            self.sampler.sample(logits, [self._sample_row(r) for r in sampled], drafts)
            if sampled
            else SamplerOutput([], [], [])
        )
        per_row = result.sampled.per_row()
        result.sampled_seq_ids = tuple(r.seq_id for r, tokens in zip(sampled, per_row, strict=True) for _ in tokens)
        result.sampled_positions = tuple(
            r.known_end + j for r, tokens in zip(sampled, per_row, strict=True) for j in range(len(tokens))
        )
        self.batch.record_sampled(rows, per_row)
        if self.drafter is not None and sampled:
            k = self.drafter.num_speculative_tokens
            drafts = self.drafter.propose([(r.seq_id, r.state.token_ids, k) for r in sampled])
            result.proposals = [(r.seq_id, d) for r, d in zip(sampled, drafts, strict=True) if d]
        if keep_logits:
            result.logits = logits

    def _run_model(
        self,
        plan: StepPlan,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        pool_indices: torch.Tensor | None = None,
    ):
        """The model's output (`StageModel.forward`); with `pool_indices`, the last stage's
        (logits, final norm's output there) (`StageModel.forward_pooled`)."""
        if self.tp is None:
            if self.step_threads is not None:
                small, large = self.step_threads
                want = large if inputs.shape[0] >= LARGE_STEP_TOKENS else small
                if torch.get_num_threads() != want:
                    torch.set_num_threads(want)
            return self._forward(inputs, positions, metadata, logits_indices, pool_indices)
        try:  # the other ranks run the same layers on the same inputs, in step
            self.tp.send_step(plan.block_copies, inputs, positions, metadata)
            return self._forward(inputs, positions, metadata, logits_indices, pool_indices)
        except BaseException as exc:  # the ranks are out of step now: the stage must restart
            self.tp.abort(f"step {plan.step_id} failed among the ranks: {type(exc).__name__}: {exc}")
            raise

    def _forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor | None,
        pool_indices: torch.Tensor | None,
    ):
        args = (inputs, positions, self.kv_cache.pools, metadata, self.backend)
        lora = self._lora_step
        if pool_indices is None:
            return self.model(*args, logits_indices) if lora is None else self.model(*args, logits_indices, lora=lora)
        return self.model.forward_pooled(*args, logits_indices, pool_indices, lora=lora)

    def _lora_of(self, rows: list[Row]) -> LoraStep | None:
        """The step's adapter groups (None when every row is the base model's)."""
        if self.lora is None or not any(r.state.lora_name for r in rows):
            return None
        slots = [self.lora.slot_of(r.state.lora_name) if r.state.lora_name else -1 for r in rows]
        return LoraStep(self.lora, token_slots(slots, [r.num_tokens for r in rows], self.device))

    def _sample_row(self, row: Row) -> SampleRow:
        s = row.state
        history = None
        if s.sampling.needs_history:
            known = self.sampler.state(s.seq_id)
            if known is None or not known.has_history:
                history = (tuple(s.token_ids[: s.prompt_len]), tuple(s.token_ids[s.prompt_len :]))
        return SampleRow(s.seq_id, s.sampling, s.choice_index, s.num_output_tokens, s.entropy_seed, history)

    def _metadata(self, rows: list[Row]) -> tuple[AttentionMetadata, torch.Tensor]:
        """The step's layout. A verify row (speculative decoding) is laid out as one decode
        per position, each attending to the positions up to its own: causal attention, as
        one row of several tokens would be, but the step stays a batch of decodes, which
        the native decode step computes in one call (a 5-position verify step of one
        sequence on SmolLM2 Q4_1, context 200: 19.2 ms as a row, 14.7 ms as decodes; 1 position
        5.2 ms: `python -m bench.verify_step [--as-row]`, docs/benchmarks.md)."""
        spans = []
        for r in rows:
            blocks = r.state.block_ids if self.num_kv_groups == 1 else self._entry_table(r.state)
            if r.drafts:
                spans.extend((p, p + 1, blocks) for p in range(r.start, r.context_len))
            else:
                spans.append((r.start, r.context_len, blocks))
        return paged_layout(spans, self.block_size, self.device, self.num_kv_groups)

    def _entry_table(self, state) -> torch.Tensor:
        """KV groups: a sequence's table as a tensor, kept until the table changes."""
        if state.table is None:
            state.table = entry_table(state.block_ids, self.num_kv_groups)
        return state.table


def check_stage_inputs(plan: StepPlan, hidden: torch.Tensor | None, is_first: bool, hidden_size: int) -> None:
    """InvalidPlanError unless the first stage gets no hidden states and any other stage
    gets [plan.num_tokens, hidden_size] of them."""
    if is_first:
        if hidden is not None:
            raise InvalidPlanError(f"step {plan.step_id}: stage 0 takes token ids, not hidden states")
        return
    want = (plan.num_tokens, hidden_size)
    if hidden is None or tuple(hidden.shape) != want:
        got = None if hidden is None else tuple(hidden.shape)
        raise InvalidPlanError(f"step {plan.step_id}: hidden states of shape {got}, expected {want}")


SCORE_ROWS_PER_SLICE = 256  # bounds the float32 [rows, vocab] temporaries of prompt scoring


def _score_prompts(logits: torch.Tensor, scored: list[Row]) -> list[ScoredPrompt]:
    """Log-probabilities (raw logits) of each scored chunk's targets, their ranks and the
    most likely alternatives; `logits` rows are the chunks' scored positions, in order.
    Computed a slice of rows at a time, so a long chunk with a large vocabulary does not
    hold [positions, vocab] float32 copies at once."""
    targets = torch.tensor(
        [t for s in scored for t in s.prompt_scoring.targets], dtype=torch.long, device=logits.device
    )
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
            top = list(zip(ids_list[row][: p.num_top], values_list[row][: p.num_top], strict=True))
            positions.append(PositionLogprobs(target_list[row], lp_list[row], rank_list[row], top))
            row += 1
        out.append(ScoredPrompt(s.seq_id, p.first_position, tuple(positions)))
    return out
