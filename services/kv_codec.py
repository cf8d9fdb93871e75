"""`pagoda.v1.KVCache` messages <-> the core's types, and domain errors -> gRPC status codes.

Generated protobuf classes stop here: the servicer and the gRPC client speak the core's
types (`StepInput`, `StepOutput`, `KVCacheStats`) on either side of these functions.

Where the wire and the core differ:
- Block tables travel as the core makes them (`Allocated`): `block_table_offset` (entries of
  the sequence's last answer that stay) and the block ids after them, so a decode step of a
  long sequence sends one block id at most, not its whole table. The receiver passes the
  diff on (the scheduler to the stages); nobody rebuilds tables from it on the way.
- No slot mapping is on the wire: a token's slot follows from its sequence's table and its
  position (`Allocated.slots`), and the stages derive it themselves.
- Per-sequence copies are not on the wire: each copy's destination is a fresh block in the
  new block ids of exactly the allocation that needed it, which is how they are matched up.
- `KVCacheStats.num_free_blocks` on the wire counts evictable blocks as free; the core's
  does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import grpc

from services.kv_errors import ImportUnavailable, InvalidStepError, KVCacheError, SequenceNotFound
from services.kv_layout import entries_of, flat_pages
from services.kv_stats import KVCacheStats, SequenceBlockStats
from services.kv_types import Allocated, Append, BlockCopy, Fork, NewSequence, NoBlocks, StepInput, StepOutput
from services.pb import common_pb2, kvcache_pb2
from services.step_codec import tier_ops_from_pb, tier_ops_to_pb

# The seq_id of a NOT_FOUND travels in the trailing metadata, so the client can rebuild the
# exception without parsing its message.
SEQ_ID_METADATA_KEY = "pagoda-seq-id"

STATUS_CODE_BY_ERROR: Mapping[type[KVCacheError], grpc.StatusCode] = {
    SequenceNotFound: grpc.StatusCode.NOT_FOUND,
    InvalidStepError: grpc.StatusCode.INVALID_ARGUMENT,
    ImportUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
}


class BlockCopyMismatch(ValueError):
    """A response's block copies do not match its allocations (or an allocation's status is
    unknown): the response is not one the service sends."""


def status_code_of(exc: KVCacheError) -> grpc.StatusCode:
    """The status a caller's error travels as (INVALID_ARGUMENT for any other KVCacheError)."""
    for error_type, code in STATUS_CODE_BY_ERROR.items():
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


# ---- StepRequest <-> StepInput ---------------------------------------------------------------


def _forks_to_pb(forks: Sequence[Fork]) -> list[kvcache_pb2.SequenceFork]:
    # consecutive forks of one parent share a message; flattening gives the same order back
    out: list[kvcache_pb2.SequenceFork] = []
    for fork in forks:
        if out and out[-1].parent_seq_id == fork.parent_seq_id:
            out[-1].child_seq_ids.append(fork.child_seq_id)
        else:
            out.append(kvcache_pb2.SequenceFork(parent_seq_id=fork.parent_seq_id, child_seq_ids=[fork.child_seq_id]))
    return out


def _new_sequence_to_pb(new: NewSequence) -> kvcache_pb2.NewSequence:
    msg = kvcache_pb2.NewSequence(seq_id=new.seq_id, token_ids=new.token_ids)
    if new.namespace is not None:
        msg.namespace = new.namespace
    if new.max_num_new_tokens is not None:
        msg.max_num_new_tokens = new.max_num_new_tokens
    msg.skip_prefix_cache = new.skip_prefix_cache
    return msg


def step_input_to_pb(step: StepInput) -> kvcache_pb2.StepRequest:
    """Encode a step. Raises `InvalidStepError` for what the wire cannot carry: negative or
    too large ids and counts, token ids of 2**32 or more, values that are not ints."""
    try:
        request = kvcache_pb2.StepRequest(
            completed_micro_batch_ids=step.completed_micro_batch_ids,
            failed_micro_batch_ids=step.failed_micro_batch_ids,
            free_seq_ids=step.frees,
            forks=_forks_to_pb(step.forks),
            new_sequences=[_new_sequence_to_pb(new) for new in step.new_sequences],
            appends=[
                kvcache_pb2.AppendSlots(
                    seq_id=a.seq_id,
                    token_ids=a.token_ids,
                    num_new_tokens=len(a.token_ids),
                    num_lookahead_slots=a.num_lookahead_slots,
                )
                for a in step.appends
            ],
        )
        if step.micro_batch_id is not None:
            request.micro_batch_id = step.micro_batch_id
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidStepError(f"the step cannot be encoded: {exc}") from None
    return request


def _new_sequence_from_pb(msg: kvcache_pb2.NewSequence) -> NewSequence:
    return NewSequence(
        seq_id=msg.seq_id,
        token_ids=msg.token_ids,
        namespace=msg.namespace if msg.HasField("namespace") else None,
        max_num_new_tokens=(msg.max_num_new_tokens if msg.HasField("max_num_new_tokens") else None),
        skip_prefix_cache=msg.skip_prefix_cache,
    )


def _append_from_pb(msg: kvcache_pb2.AppendSlots) -> Append:
    if msg.num_new_tokens not in (0, len(msg.token_ids)):
        raise InvalidStepError(
            f"append to {msg.seq_id}: num_new_tokens {msg.num_new_tokens} is not the number "
            f"of token_ids ({len(msg.token_ids)})"
        )
    return Append(seq_id=msg.seq_id, token_ids=msg.token_ids, num_lookahead_slots=msg.num_lookahead_slots)


def step_input_from_pb(request: kvcache_pb2.StepRequest) -> StepInput:
    """Decode a step (the core validates it). Raises `InvalidStepError` for what the core
    does not support. The token ids stay protobuf containers: the core only reads them."""
    return StepInput(
        new_sequences=tuple(_new_sequence_from_pb(n) for n in request.new_sequences),
        appends=tuple(_append_from_pb(a) for a in request.appends),
        forks=forks_from_pb(request.forks),
        frees=tuple(request.free_seq_ids),
        completed_micro_batch_ids=tuple(request.completed_micro_batch_ids),
        failed_micro_batch_ids=tuple(request.failed_micro_batch_ids),
        micro_batch_id=request.micro_batch_id if request.HasField("micro_batch_id") else None,
    )


def forks_from_pb(forks: Iterable[kvcache_pb2.SequenceFork]) -> tuple[Fork, ...]:
    return tuple(Fork(f.parent_seq_id, child) for f in forks for child in f.child_seq_ids)


# ---- StepOutput <-> StepResponse -------------------------------------------------------------


def capacity_to_pb(num_blocks: int, num_available_blocks: int, num_evictable_blocks: int) -> kvcache_pb2.KVCapacity:
    return kvcache_pb2.KVCapacity(
        num_total_blocks=num_blocks, num_free_blocks=num_available_blocks, num_evictable_blocks=num_evictable_blocks
    )


def step_output_to_pb(
    output: StepOutput, capacity: kvcache_pb2.KVCapacity | None = None, kv_groups: int = 1
) -> kvcache_pb2.StepResponse:
    """Encode a step's result; each table goes as the core's diff (`Allocated.block_offset`),
    entries of `kv_groups` pages flattened."""
    allocations = []
    for seq_id, result in output.results.items():
        if isinstance(result, NoBlocks):
            allocations.append(
                kvcache_pb2.SequenceAllocation(
                    seq_id=seq_id,
                    status=kvcache_pb2.ALLOCATION_STATUS_NO_BLOCKS,
                    num_needed_blocks=result.num_needed_blocks,
                    num_free_blocks=result.num_free_blocks,
                )
            )
            continue
        allocations.append(
            kvcache_pb2.SequenceAllocation(
                seq_id=seq_id,
                status=kvcache_pb2.ALLOCATION_STATUS_OK,
                num_computed_tokens=result.num_computed_tokens,
                num_new_tokens=result.num_new_tokens,
                block_table_offset=result.block_offset,
                block_ids=flat_pages(result.block_ids),
            )
        )
    return kvcache_pb2.StepResponse(
        kv_groups=kv_groups if kv_groups > 1 else 0,
        allocations=allocations,
        block_copies=[
            common_pb2.BlockCopy(src_block_id=c.src_block_id, dst_block_id=c.dst_block_id) for c in output.copies
        ],
        capacity=capacity,
        tier_ops=tier_ops_to_pb(output.tier_ops),
    )


def step_output_from_pb(response: kvcache_pb2.StepResponse) -> StepOutput:
    """Decode a step's result. Raises `BlockCopyMismatch` when a block copy's destination is
    not a new block of exactly one allocation."""
    copies = tuple(BlockCopy(c.src_block_id, c.dst_block_id) for c in response.block_copies)
    copy_by_dst = {c.dst_block_id: c for c in copies}
    if len(copy_by_dst) != len(copies):
        raise BlockCopyMismatch("two block copies share a destination")
    results: dict[int, Allocated | NoBlocks] = {}
    num_matched = 0
    for alloc in response.allocations:
        seq_id = alloc.seq_id
        if alloc.status == kvcache_pb2.ALLOCATION_STATUS_NO_BLOCKS:
            results[seq_id] = NoBlocks(seq_id, alloc.num_needed_blocks, alloc.num_free_blocks)
            continue
        if alloc.status != kvcache_pb2.ALLOCATION_STATUS_OK:
            raise BlockCopyMismatch(f"sequence {seq_id}: allocation status {alloc.status}")
        new_ids = tuple(alloc.block_ids)
        own = tuple(copy_by_dst[b] for b in new_ids if b in copy_by_dst)
        num_matched += len(own)
        try:
            entries = entries_of(new_ids, response.kv_groups)
        except ValueError as e:
            raise BlockCopyMismatch(f"sequence {seq_id}: {e}") from None
        results[seq_id] = Allocated(
            seq_id, entries, alloc.num_new_tokens, alloc.num_computed_tokens, own, alloc.block_table_offset
        )
    if num_matched != len(copies):
        raise BlockCopyMismatch("a block copy belongs to no allocation")
    try:
        tier_ops = tier_ops_from_pb(response.tier_ops)
    except ValueError as e:
        raise BlockCopyMismatch(str(e)) from None
    return StepOutput(results=results, copies=copies, tier_ops=tier_ops)


# ---- statistics ------------------------------------------------------------------------------


def stats_to_pb(
    stats: KVCacheStats,
    *,
    epoch: int,
    num_peak_used_blocks: int,
    num_steps: int,
    enable_prefix_caching: bool,
    sequences: Iterable[tuple[SequenceBlockStats, Sequence[int]]] = (),
    block_map: bytes = b"",
) -> kvcache_pb2.KVCacheStats:
    """The memory monitor's message; `sequences` pairs each sequence's stats with its table,
    `block_map` is every block's state (both only in the detailed view)."""
    return kvcache_pb2.KVCacheStats(
        epoch=epoch,
        block_size=stats.block_size,
        num_total_blocks=stats.num_blocks,
        num_free_blocks=stats.num_free_blocks + stats.num_evictable_blocks,
        num_used_blocks=stats.num_used_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_evictable_blocks=stats.num_evictable_blocks,
        num_peak_used_blocks=num_peak_used_blocks,
        num_used_slots=stats.num_used_slots,
        internal_fragmentation=stats.internal_fragmentation,
        external_fragmentation=stats.external_fragmentation,
        largest_free_extent_blocks=stats.largest_free_extent,
        num_prefix_queries=stats.num_prefix_queries,
        num_prefix_query_tokens=stats.num_prefix_query_tokens,
        num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
        prefix_hit_rate=stats.prefix_hit_rate,
        num_evictions=stats.num_evictions,
        num_copy_on_writes=stats.num_copy_on_write,
        num_sequences=stats.num_sequences,
        enable_prefix_caching=enable_prefix_caching,
        num_steps=num_steps,
        sequences=[
            kvcache_pb2.SequenceBlocks(
                seq_id=s.seq_id,
                num_tokens=s.num_tokens,
                num_blocks=s.num_blocks,
                num_shared_blocks=s.num_shared_blocks,
                num_extents=s.num_extents,
                block_ids=block_ids,
                num_window_blocks=s.num_window_blocks,
            )
            for s, block_ids in sequences
        ],
        watermark_blocks=stats.watermark_blocks,
        num_free_extents=stats.num_free_extents,
        num_prefix_hits=stats.num_prefix_hits,
        num_resets=stats.num_resets,
        block_map=block_map,
        group_windows=stats.group_windows,
        num_window_blocks=stats.num_window_blocks,
        num_slid_blocks=stats.num_slid_blocks,
        tier_host_capacity_blocks=stats.tier_host_capacity,
        tier_host_blocks=stats.tier_host_blocks,
        tier_disk_capacity_blocks=stats.tier_disk_capacity,
        tier_disk_blocks=stats.tier_disk_blocks,
        num_tier_hit_tokens=stats.num_tier_hit_tokens,
        num_tier_saves=stats.num_tier_saves,
        num_tier_loads=stats.num_tier_loads,
        num_tier_demotions=stats.num_tier_demotions,
        num_tier_drops=stats.num_tier_drops,
    )


def stats_from_pb(msg: kvcache_pb2.KVCacheStats) -> KVCacheStats:
    return KVCacheStats(
        num_blocks=msg.num_total_blocks,
        block_size=msg.block_size,
        num_used_blocks=msg.num_used_blocks,
        num_free_blocks=msg.num_free_blocks - msg.num_evictable_blocks,
        num_evictable_blocks=msg.num_evictable_blocks,
        num_cached_blocks=msg.num_cached_blocks,
        watermark_blocks=msg.watermark_blocks,
        num_sequences=msg.num_sequences,
        num_used_slots=msg.num_used_slots,
        num_free_extents=msg.num_free_extents,
        largest_free_extent=msg.largest_free_extent_blocks,
        internal_fragmentation=msg.internal_fragmentation,
        external_fragmentation=msg.external_fragmentation,
        num_prefix_queries=msg.num_prefix_queries,
        num_prefix_hits=msg.num_prefix_hits,
        num_prefix_query_tokens=msg.num_prefix_query_tokens,
        num_prefix_hit_tokens=msg.num_prefix_hit_tokens,
        prefix_hit_rate=msg.prefix_hit_rate,
        num_evictions=msg.num_evictions,
        num_copy_on_write=msg.num_copy_on_writes,
        num_resets=msg.num_resets,
        group_windows=tuple(msg.group_windows) or (0,),
        num_window_blocks=msg.num_window_blocks,
        num_slid_blocks=msg.num_slid_blocks,
        tier_host_capacity=msg.tier_host_capacity_blocks,
        tier_host_blocks=msg.tier_host_blocks,
        tier_disk_capacity=msg.tier_disk_capacity_blocks,
        tier_disk_blocks=msg.tier_disk_blocks,
        num_tier_hit_tokens=msg.num_tier_hit_tokens,
        num_tier_saves=msg.num_tier_saves,
        num_tier_loads=msg.num_tier_loads,
        num_tier_demotions=msg.num_tier_demotions,
        num_tier_drops=msg.num_tier_drops,
    )


def sequence_stats_from_pb(msg: kvcache_pb2.KVCacheStats) -> tuple[SequenceBlockStats, ...]:
    return tuple(
        SequenceBlockStats(
            seq_id=s.seq_id,
            num_tokens=s.num_tokens,
            num_blocks=s.num_blocks,
            num_extents=s.num_extents,
            num_shared_blocks=s.num_shared_blocks,
            num_window_blocks=s.num_window_blocks,
        )
        for s in msg.sequences
    )
