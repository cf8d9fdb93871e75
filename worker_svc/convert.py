"""`pagoda.v1` worker messages <-> the stage's domain types (StagePlan, tensors, results).

The one place where generated protobuf classes meet the runtime: model code never sees them.
"""

from __future__ import annotations

import torch

from services.pb import common_pb2, worker_pb2
from services.sampling_pb import set_penalties, set_top_logprobs
from worker_svc.errors import InvalidPlanError
from worker_svc.plan import PromptScoring, SeqChunk, StagePlan
from worker_svc.sampler import SamplerOutput, SampleRow, SamplingParams

_TO_PB_DTYPE = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float8_e4m3fn: common_pb2.DTYPE_FLOAT8_E4M3FN,
    torch.int64: common_pb2.DTYPE_INT64,
    torch.int32: common_pb2.DTYPE_INT32,
}
_FROM_PB_DTYPE = {v: k for k, v in _TO_PB_DTYPE.items()}


def dtype_to_pb(dtype: torch.dtype) -> int:
    return _TO_PB_DTYPE[dtype]


def tensor_to_pb(t: torch.Tensor, out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """Raw little-endian bytes + dtype + shape; never pickle."""
    out = common_pb2.Tensor() if out is None else out
    t = t.detach().contiguous().cpu()
    out.dtype = _TO_PB_DTYPE[t.dtype]
    del out.shape[:]
    out.shape.extend(t.shape)
    out.data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return out


def tensor_from_pb(msg: common_pb2.Tensor) -> torch.Tensor:
    if msg.dtype not in _FROM_PB_DTYPE:
        raise InvalidPlanError(f"tensor dtype {common_pb2.DType.Name(msg.dtype) if msg.dtype in common_pb2.DType.values() else msg.dtype} is not supported")
    dtype = _FROM_PB_DTYPE[msg.dtype]
    shape = tuple(msg.shape)
    numel = 1
    for n in shape:
        if n < 0:
            raise InvalidPlanError(f"tensor shape {list(shape)} has a negative size")
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != numel * itemsize:
        raise InvalidPlanError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {numel * itemsize} bytes, got {len(msg.data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


_PARAMS_CACHE: dict[tuple[bytes, tuple[int, ...]], SamplingParams] = {}
_PARAMS_CACHE_SIZE = 4096


def cached_sampling_params(p: common_pb2.SamplingParams, eos_token_ids) -> SamplingParams:
    """Sequences of one request send the same parameters every step: build them once."""
    key = (p.SerializeToString(deterministic=True), tuple(eos_token_ids))
    params = _PARAMS_CACHE.get(key)
    if params is None:
        params = sampling_params_from_pb(p, key[1])
        if len(_PARAMS_CACHE) >= _PARAMS_CACHE_SIZE:
            _PARAMS_CACHE.clear()
        _PARAMS_CACHE[key] = params
    return params


def sampling_params_from_pb(p: common_pb2.SamplingParams, eos_token_ids) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=p.temperature if p.HasField("temperature") else 1.0,
            top_k=p.top_k or None,
            top_p=p.top_p if p.HasField("top_p") else 1.0,
            min_p=p.min_p,
            seed=p.seed if p.HasField("seed") else None,
            num_logprobs=p.logprobs if p.HasField("logprobs") else None,
            min_tokens=p.min_tokens,
            stop_token_ids=tuple(p.stop_token_ids),
            eos_token_ids=tuple(eos_token_ids),
            ignore_eos=p.ignore_eos,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
            logit_bias=tuple(p.logit_bias.items()),
        )
    except ValueError as exc:
        raise InvalidPlanError(f"sampling parameters: {exc}") from exc


def plan_from_pb(mb: worker_pb2.MicroBatch, is_first: bool) -> StagePlan:
    """Unflatten a MicroBatch; raises InvalidPlanError when its arrays disagree."""
    mb_id = mb.micro_batch_id
    n = len(mb.seq_ids)
    if not (len(mb.query_lens) == len(mb.context_lens) == len(mb.block_table_lens) == n):
        raise InvalidPlanError(
            f"micro-batch {mb_id}: per-sequence arrays differ in length "
            f"(seq_ids {n}, query_lens {len(mb.query_lens)}, context_lens {len(mb.context_lens)}, "
            f"block_table_lens {len(mb.block_table_lens)})"
        )
    if mb.sampling and len(mb.sampling) != n:
        raise InvalidPlanError(f"micro-batch {mb_id}: {len(mb.sampling)} sampling entries for {n} sequences")
    query_lens = list(mb.query_lens)
    context_lens = list(mb.context_lens)
    table_lens = list(mb.block_table_lens)
    num_tokens = sum(query_lens)
    if len(mb.slot_mapping) != num_tokens:
        raise InvalidPlanError(f"micro-batch {mb_id}: {len(mb.slot_mapping)} slots for {num_tokens} tokens")
    if is_first and len(mb.token_ids) != num_tokens:
        raise InvalidPlanError(f"micro-batch {mb_id}: {len(mb.token_ids)} token ids for {num_tokens} tokens")
    if len(mb.block_tables) != sum(table_lens):
        raise InvalidPlanError(
            f"micro-batch {mb_id}: block_tables holds {len(mb.block_tables)} ids, block_table_lens sum to {sum(table_lens)}"
        )
    positions = list(mb.positions)
    if positions and len(positions) != num_tokens:
        raise InvalidPlanError(f"micro-batch {mb_id}: {len(positions)} positions for {num_tokens} tokens")
    slots = list(mb.slot_mapping)
    tables = list(mb.block_tables)
    tokens = list(mb.token_ids) if is_first else []
    seqs = []
    tok = tab = 0
    for i in range(n):
        q, ctx, tl = query_lens[i], context_lens[i], table_lens[i]
        seq_id = mb.seq_ids[i]
        if positions and positions[tok : tok + q] != list(range(ctx - q, ctx)):
            raise InvalidPlanError(
                f"micro-batch {mb_id}, sequence {seq_id}: positions must be {ctx - q}..{ctx - 1}"
            )
        sample = None
        if mb.sampling and mb.sampling[i].sample:
            s = mb.sampling[i]
            try:
                sample = SampleRow(
                    seq_id=seq_id,
                    params=cached_sampling_params(s.params, s.eos_token_ids),
                    choice_index=s.choice_index,
                    output_position=s.output_position,
                    entropy_seed=s.entropy_seed,
                    history=(tuple(s.history_prompt_token_ids), tuple(s.history_output_token_ids))
                    if s.has_history else None,
                )
            except ValueError as exc:
                raise InvalidPlanError(f"micro-batch {mb_id}, sequence {seq_id}: {exc}") from exc
        scoring = None
        if mb.sampling and mb.sampling[i].prompt_targets:
            s = mb.sampling[i]
            scoring = PromptScoring(s.prompt_first_position, tuple(s.prompt_targets), s.prompt_num_top)
        seqs.append(
            SeqChunk(
                seq_id=seq_id,
                num_tokens=q,
                context_len=ctx,
                slot_mapping=tuple(slots[tok : tok + q]),
                block_table=tuple(tables[tab : tab + tl]),
                token_ids=tuple(tokens[tok : tok + q]) if is_first else (),
                sample=sample,
                prompt_scoring=scoring,
            )
        )
        tok += q
        tab += tl
    return StagePlan(
        micro_batch_id=mb_id,
        seqs=tuple(seqs),
        block_copies=tuple((c.src_block_id, c.dst_block_id) for c in mb.block_copies),
        released_seq_ids=tuple(mb.released_seq_ids),
        release_all=mb.release_all_sequences,
    )


def plan_to_pb(plan: StagePlan, stage_index: int = 0) -> worker_pb2.MicroBatch:
    """The scheduler's (or a test driver's) side: flatten a plan into a MicroBatch."""
    mb = worker_pb2.MicroBatch(micro_batch_id=plan.micro_batch_id, stage_index=stage_index)
    for s in plan.seqs:
        mb.seq_ids.append(s.seq_id)
        mb.query_lens.append(s.num_tokens)
        mb.context_lens.append(s.context_len)
        mb.block_table_lens.append(len(s.block_table))
        mb.block_tables.extend(s.block_table)
        mb.token_ids.extend(s.token_ids)
        mb.positions.extend(range(s.start_position, s.context_len))
        mb.slot_mapping.extend(s.slot_mapping)
        entry = mb.sampling.add()
        if s.prompt_scoring is not None:
            entry.prompt_targets.extend(s.prompt_scoring.targets)
            entry.prompt_first_position = s.prompt_scoring.first_position
            entry.prompt_num_top = s.prompt_scoring.num_top
        if s.sample is not None:
            r = s.sample
            entry.sample = True
            entry.choice_index = r.choice_index
            entry.output_position = r.output_position
            entry.entropy_seed = r.entropy_seed
            entry.eos_token_ids.extend(r.params.eos_token_ids)
            p = entry.params
            p.temperature = r.params.temperature
            p.top_p = r.params.top_p
            p.top_k = r.params.top_k or 0
            p.min_p = r.params.min_p
            if r.params.seed is not None:
                p.seed = r.params.seed
            if r.params.num_logprobs is not None:
                p.logprobs = r.params.num_logprobs
            p.min_tokens = r.params.min_tokens
            p.stop_token_ids.extend(r.params.stop_token_ids)
            p.ignore_eos = r.params.ignore_eos
            rp = r.params
            set_penalties(p, rp.presence_penalty, rp.frequency_penalty, rp.repetition_penalty,
                          rp.logit_bias)
            if r.history is not None:
                entry.has_history = True
                entry.history_prompt_token_ids.extend(r.history[0])
                entry.history_output_token_ids.extend(r.history[1])
    for src, dst in plan.block_copies:
        mb.block_copies.add(src_block_id=src, dst_block_id=dst)
    mb.released_seq_ids.extend(plan.released_seq_ids)
    mb.release_all_sequences = plan.release_all
    return mb


def sampled_to_pb(
    seq_ids: tuple[int, ...], out: SamplerOutput, done: worker_pb2.MicroBatchDone
) -> None:
    for i, seq_id in enumerate(seq_ids):
        entry = done.sampled.add(seq_id=seq_id, token_id=out.token_ids[i])
        # (rank 0: a sampled token's rank is not computed)
        set_top_logprobs(entry.logprobs, out.token_ids[i], out.logprobs[i], 0, out.top_logprobs[i] or ())


def prompt_logprobs_to_pb(scored, done: worker_pb2.MicroBatchDone) -> None:
    """StageResult.prompt_logprobs into MicroBatchDone.prompt_logprobs."""
    for seq_id, first_position, positions in scored:
        entry = done.prompt_logprobs.add(seq_id=seq_id, first_position=first_position)
        for target, logprob, rank, top in positions:
            set_top_logprobs(entry.positions.add(), target, logprob, rank, top)
