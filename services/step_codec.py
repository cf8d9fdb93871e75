"""The step contract (`services.step`) <-> `pagoda.v1` worker messages: its one codec.

The scheduler's transport encodes plans and decodes results with it; a stage decodes plans
and encodes results with it; test drivers use it too. A new sequence's sampling rides in the
one sampling codec (`services.sampling_pb`). Decoding checks the message's shape (columns of
equal length, sampling parameters in range) and raises `PlanDecodeError` naming what is
wrong; whether a plan fits a stage's state is the stage's check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

from services.kv_layout import entries_of, flat_pages
from services.pb import common_pb2, worker_pb2
from services.pooling import PoolingType, embedding_from_pb, embedding_to_pb
from services.sampling_pb import options_to_pb, params_from_pb, set_top_logprobs
from services.step import (
    TIER_DEMOTE,
    TIER_DROP,
    TIER_LOAD,
    TIER_SAVE,
    CachedSeq,
    NewSeq,
    PooledOutput,
    PositionLogprobs,
    PromptScoring,
    SampledToken,
    ScoredPrompt,
    StageTiming,
    StepPlan,
    StepResult,
    TierOp,
    TokenLogprobs,
)


class PlanDecodeError(ValueError):
    """A MicroBatch whose fields disagree with each other."""


# --- plans --------------------------------------------------------------------------------


def _scoring_to_pb(s: PromptScoring, out: worker_pb2.PromptScoring) -> None:
    out.first_position = s.first_position
    out.targets.extend(s.targets)
    out.num_top = s.num_top


def _scoring_from_pb(m: worker_pb2.PromptScoring) -> PromptScoring:
    return PromptScoring(m.first_position, tuple(m.targets), m.num_top)


def plan_to_pb(plan: StepPlan, stage_index: int = 0) -> worker_pb2.MicroBatch:
    msg = worker_pb2.MicroBatch(
        micro_batch_id=plan.step_id, stage_index=stage_index, finished_seq_ids=plan.finished_seq_ids, reset=plan.reset
    )
    for src, dst in plan.block_copies:
        msg.block_copies.add(src_block_id=src, dst_block_id=dst)
    if plan.tier_ops:
        msg.tier_ops.extend(tier_ops_to_pb(plan.tier_ops))
    for n in plan.new_seqs:
        _new_seq_to_pb(n, msg.new_seqs.add())
    if plan.cached_seqs:
        _cached_to_pb(plan.cached_seqs, msg.cached)
    msg.kv_groups = _kv_groups(plan)
    return msg


def _kv_groups(plan: StepPlan) -> int:
    """Pages per table entry (services/kv_layout.py): 0 when entries are plain block ids."""
    for s in (*plan.new_seqs, *plan.cached_seqs):
        if s.block_ids:
            return len(s.block_ids[0]) if isinstance(s.block_ids[0], tuple) else 0
    return 0


def _new_seq_to_pb(n: NewSeq, m: worker_pb2.StageNewSequence) -> None:
    m.seq_id, m.token_ids[:], m.prompt_len, m.num_computed = n.seq_id, n.token_ids, n.prompt_len, n.num_computed
    m.num_scheduled, m.block_ids[:], m.eos_token_ids[:] = (
        n.num_scheduled,
        flat_pages(n.block_ids),
        n.sampling.eos_token_ids,
    )
    m.choice_index, m.entropy_seed, m.request_id, m.traceparent = (
        n.choice_index,
        n.entropy_seed,
        n.request_id,
        n.trace_context,
    )
    options_to_pb(n.sampling, m.params)  # (the view rides as its request's options do)
    if n.prompt_scoring is not None:
        _scoring_to_pb(n.prompt_scoring, m.prompt_scoring)
    if n.pooling is not None:
        m.pooling = n.pooling.to_pb()
    if n.lora_name:
        m.lora_name = n.lora_name


def _cached_to_pb(cached: tuple[CachedSeq, ...], c: worker_pb2.CachedSequences) -> None:
    """The cached sequences as columns; the optional ones only when some sequence has any."""
    c.seq_ids.extend([s.seq_id for s in cached])
    c.num_scheduled.extend([s.num_scheduled for s in cached])
    c.block_offsets.extend([s.block_offset for s in cached])
    c.num_block_ids.extend([len(s.block_ids) for s in cached])
    for s in cached:
        if s.block_ids:
            c.block_ids.extend(flat_pages(s.block_ids))
    if any(s.new_token_ids for s in cached):
        c.num_new_token_ids.extend([len(s.new_token_ids) for s in cached])
        for s in cached:
            c.new_token_ids.extend(s.new_token_ids)
    for i, s in enumerate(cached):
        if s.prompt_scoring is not None:
            _scoring_to_pb(s.prompt_scoring, c.prompt_scoring.add(index=i).scoring)
    if any(s.draft_token_ids for s in cached):
        c.num_draft_token_ids.extend([len(s.draft_token_ids) for s in cached])
        for s in cached:
            c.draft_token_ids.extend(s.draft_token_ids)
    if any(s.start >= 0 for s in cached):
        c.starts.extend([s.start for s in cached])


def plan_from_pb(msg: worker_pb2.MicroBatch) -> StepPlan:
    """Raises PlanDecodeError when the message's fields disagree."""
    step, groups = msg.micro_batch_id, msg.kv_groups
    return StepPlan(
        step,
        _new_seqs_from_pb(msg.new_seqs, step, groups),
        _cached_from_pb(msg.cached, step, groups),
        tuple(msg.finished_seq_ids),
        tuple((x.src_block_id, x.dst_block_id) for x in msg.block_copies),
        msg.reset,
        _tier_ops_of(msg) if msg.tier_ops else (),
    )


def _tier_ops_of(msg: worker_pb2.MicroBatch) -> tuple[TierOp, ...]:
    try:
        return tier_ops_from_pb(msg.tier_ops)
    except ValueError as e:
        raise PlanDecodeError(f"micro-batch {msg.micro_batch_id}: {e}") from None


def tier_ops_to_pb(ops: Sequence[TierOp]) -> list[common_pb2.TierOp]:
    return [common_pb2.TierOp(kind=op.kind, key=op.key, block_id=max(op.block_id, 0)) for op in ops]


def tier_ops_from_pb(ops: Iterable[common_pb2.TierOp]) -> tuple[TierOp, ...]:
    """Decode tier moves; an unknown kind or a move without its key is refused (ValueError)."""
    out = []
    for op in ops:
        if op.kind not in (TIER_SAVE, TIER_LOAD, TIER_DEMOTE, TIER_DROP) or not op.key:
            raise ValueError(f"tier_ops: a move of kind {op.kind} with a {len(op.key)}-byte key")
        out.append(TierOp(op.kind, op.key, op.block_id if op.kind in (TIER_SAVE, TIER_LOAD) else -1))
    return tuple(out)


def _new_seqs_from_pb(seqs: Iterable[worker_pb2.StageNewSequence], step: int, groups: int) -> tuple[NewSeq, ...]:
    new_seqs = []
    for m in seqs:
        try:
            sampling = params_from_pb(m.params, m.eos_token_ids)
        except ValueError as exc:
            raise PlanDecodeError(f"step {step}, sequence {m.seq_id}: sampling parameters: {exc}") from None
        try:
            pooling = PoolingType.from_pb(m.pooling)
            block_ids = entries_of(m.block_ids, groups)
        except ValueError as exc:
            raise PlanDecodeError(f"step {step}, sequence {m.seq_id}: {exc}") from None
        new_seqs.append(
            NewSeq(
                m.seq_id,
                tuple(m.token_ids),
                m.prompt_len,
                m.num_computed,
                m.num_scheduled,
                block_ids,
                sampling,
                m.choice_index,
                m.entropy_seed,
                m.request_id,
                m.traceparent,
                _scoring_from_pb(m.prompt_scoring) if m.HasField("prompt_scoring") else None,
                pooling,
                m.lora_name,
            )
        )
    return tuple(new_seqs)


def _cached_from_pb(c: worker_pb2.CachedSequences, step: int, groups: int) -> tuple[CachedSeq, ...]:
    """The cached columns as sequences, once `_cached_counts` found them consistent."""
    n = len(c.seq_ids)
    block_counts, token_counts, draft_counts, starts = _cached_counts(c, step, groups, n)
    scoring: dict[int, PromptScoring] = {}
    for entry in c.prompt_scoring:
        if entry.index >= n or entry.index in scoring:
            raise PlanDecodeError(f"step {step}: prompt scoring for cached index {entry.index} of {n}")
        scoring[entry.index] = _scoring_from_pb(entry.scoring)
    ids, blocks, tokens = list(c.seq_ids), list(c.block_ids), list(c.new_token_ids)
    num_scheduled, offsets = list(c.num_scheduled), list(c.block_offsets)
    drafts = list(c.draft_token_ids)
    cached = []
    b = t = d = 0
    for i in range(n):
        nb = block_counts[i] * max(1, groups)
        nt = token_counts[i] if token_counts else 0
        nd = draft_counts[i] if draft_counts else 0
        cached.append(
            CachedSeq(
                ids[i],
                num_scheduled[i],
                offsets[i],
                entries_of(blocks[b : b + nb], groups),
                tuple(tokens[t : t + nt]),
                scoring.get(i),
                tuple(drafts[d : d + nd]),
                max(-1, starts[i]) if starts else -1,
            )
        )
        b += nb
        t += nt
        d += nd
    return tuple(cached)


def _cached_counts(
    c: worker_pb2.CachedSequences, step: int, groups: int, n: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The per-sequence counts of the cached columns (blocks, new tokens, drafts) and their
    starts, checked against the columns they count; PlanDecodeError naming the first that
    disagrees."""
    if not (len(c.num_scheduled) == len(c.block_offsets) == len(c.num_block_ids) == n):
        raise PlanDecodeError(
            f"step {step}: cached columns differ in length (seq_ids {n}, num_scheduled "
            f"{len(c.num_scheduled)}, block_offsets {len(c.block_offsets)}, num_block_ids {len(c.num_block_ids)})"
        )
    block_counts = list(c.num_block_ids)
    if sum(block_counts) * max(1, groups) != len(c.block_ids):
        raise PlanDecodeError(
            f"step {step}: num_block_ids sum to {sum(block_counts)} entries of {max(1, groups)}, "
            f"block_ids holds {len(c.block_ids)}"
        )
    token_counts = list(c.num_new_token_ids)
    if token_counts and len(token_counts) != n:
        raise PlanDecodeError(f"step {step}: {len(token_counts)} num_new_token_ids for {n} cached sequences")
    if sum(token_counts) != len(c.new_token_ids):
        raise PlanDecodeError(
            f"step {step}: num_new_token_ids sum to {sum(token_counts)}, new_token_ids holds {len(c.new_token_ids)}"
        )
    draft_counts = list(c.num_draft_token_ids)
    if draft_counts and len(draft_counts) != n:
        raise PlanDecodeError(f"step {step}: {len(draft_counts)} num_draft_token_ids for {n} cached sequences")
    if sum(draft_counts) != len(c.draft_token_ids):
        raise PlanDecodeError(
            f"step {step}: num_draft_token_ids sum to {sum(draft_counts)}, draft_token_ids holds "
            f"{len(c.draft_token_ids)}"
        )
    starts = list(c.starts)
    if starts and len(starts) != n:
        raise PlanDecodeError(f"step {step}: {len(starts)} starts for {n} cached sequences")
    return block_counts, token_counts, draft_counts, starts


# --- results ------------------------------------------------------------------------------


def result_to_pb(result: StepResult, done: worker_pb2.MicroBatchDone) -> None:
    """The last stage's samples, scored prompt positions and pooled vectors into its
    MicroBatchDone; the samples as two columns when none carries logprobs."""
    if all(s.logprobs is None for s in result.sampled):
        done.sampled_seq_ids.extend([s.seq_id for s in result.sampled])
        done.sampled_token_ids.extend([s.token_id for s in result.sampled])
    else:
        for s in result.sampled:
            entry = done.sampled.add(seq_id=s.seq_id, token_id=s.token_id)
            if s.logprobs is not None:  # (rank 0: a sampled token's rank is not computed)
                set_top_logprobs(entry.logprobs, s.token_id, s.logprobs.logprob, 0, s.logprobs.top)
    for p in result.prompt_logprobs:
        entry = done.prompt_logprobs.add(seq_id=p.seq_id, first_position=p.first_position)
        for pos in p.positions:
            set_top_logprobs(entry.positions.add(), pos.token_id, pos.logprob, pos.rank, pos.top)
    for pooled in result.pooled:
        embedding_to_pb(pooled.embedding, done.pooled.add(seq_id=pooled.seq_id).embedding)
    for seq_id, tokens in result.proposals:
        done.proposal_seq_ids.append(seq_id)
        done.num_proposal_tokens.append(len(tokens))
        done.proposal_token_ids.extend(tokens)


def result_from_pb(done: worker_pb2.MicroBatchDone, timings: tuple[StageTiming, ...] = ()) -> StepResult:
    """Raises PlanDecodeError when the sampled columns disagree (a buggy stage)."""
    sampled = _sampled_from_pb(done)
    prompt = tuple(
        ScoredPrompt(
            p.seq_id,
            p.first_position,
            tuple(
                PositionLogprobs(
                    x.sampled.token_id, x.sampled.logprob, x.sampled.rank, [(t.token_id, t.logprob) for t in x.top]
                )
                for x in p.positions
            ),
        )
        for p in done.prompt_logprobs
    )
    pooled = tuple(PooledOutput(p.seq_id, embedding_from_pb(p.embedding)) for p in done.pooled)
    return StepResult(done.micro_batch_id, sampled, prompt, timings, pooled, _proposals_from_pb(done))


def _sampled_from_pb(done: worker_pb2.MicroBatchDone) -> tuple[SampledToken, ...]:
    if done.sampled_seq_ids or done.sampled_token_ids:
        ids, tokens = done.sampled_seq_ids, done.sampled_token_ids
        if len(ids) != len(tokens) or done.sampled:
            raise PlanDecodeError(
                f"micro-batch {done.micro_batch_id}: {len(ids)} sampled sequences, {len(tokens)} tokens"
                + (", and sampled rows beside them" if done.sampled else "")
            )
        return tuple(map(SampledToken, list(ids), list(tokens), repeat(None, len(ids))))
    return tuple(
        SampledToken(
            s.seq_id,
            s.token_id,
            TokenLogprobs(s.logprobs.sampled.logprob, [(t.token_id, t.logprob) for t in s.logprobs.top])
            if s.HasField("logprobs")
            else None,
        )
        for s in done.sampled
    )


def _proposals_from_pb(done: worker_pb2.MicroBatchDone) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The draft model's proposals; malformed columns (a buggy stage) give none: drafts are
    only ever a hint, verified before anything is kept."""
    counts, tokens = list(done.num_proposal_tokens), list(done.proposal_token_ids)
    if len(counts) != len(done.proposal_seq_ids) or sum(counts) != len(tokens):
        return ()
    out, at = [], 0
    for seq_id, n in zip(done.proposal_seq_ids, counts, strict=True):
        out.append((seq_id, tuple(tokens[at : at + n])))
        at += n
    return tuple(out)
