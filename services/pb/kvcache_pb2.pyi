from services.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AllocationStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATION_STATUS_UNSPECIFIED: _ClassVar[AllocationStatus]
    ALLOCATION_STATUS_OK: _ClassVar[AllocationStatus]
    ALLOCATION_STATUS_NO_BLOCKS: _ClassVar[AllocationStatus]
ALLOCATION_STATUS_UNSPECIFIED: AllocationStatus
ALLOCATION_STATUS_OK: AllocationStatus
ALLOCATION_STATUS_NO_BLOCKS: AllocationStatus

class ImportPrefixRequest(_message.Message):
    __slots__ = ("phase", "namespace", "token_ids", "num_blocks", "keys")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[ImportPrefixRequest.Phase]
        PHASE_PLAN: _ClassVar[ImportPrefixRequest.Phase]
        PHASE_COMMIT: _ClassVar[ImportPrefixRequest.Phase]
        PHASE_FORGET: _ClassVar[ImportPrefixRequest.Phase]
    PHASE_UNSPECIFIED: ImportPrefixRequest.Phase
    PHASE_PLAN: ImportPrefixRequest.Phase
    PHASE_COMMIT: ImportPrefixRequest.Phase
    PHASE_FORGET: ImportPrefixRequest.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    phase: ImportPrefixRequest.Phase
    namespace: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, phase: _Optional[_Union[ImportPrefixRequest.Phase, str]] = ..., namespace: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ImportPrefixResponse(_message.Message):
    __slots__ = ("block_indices", "keys", "num_present", "num_held", "capacity")
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_present: int
    num_held: int
    capacity: int
    def __init__(self, block_indices: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ..., num_present: _Optional[int] = ..., num_held: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("micro_batch_id", "completed_micro_batch_ids", "failed_micro_batch_ids", "free_seq_ids", "forks", "new_sequences", "appends", "watermark_blocks")
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_MICRO_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_MICRO_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    micro_batch_id: int
    completed_micro_batch_ids: _containers.RepeatedScalarFieldContainer[int]
    failed_micro_batch_ids: _containers.RepeatedScalarFieldContainer[int]
    free_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    forks: _containers.RepeatedCompositeFieldContainer[SequenceFork]
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    appends: _containers.RepeatedCompositeFieldContainer[AppendSlots]
    watermark_blocks: int
    def __init__(self, micro_batch_id: _Optional[int] = ..., completed_micro_batch_ids: _Optional[_Iterable[int]] = ..., failed_micro_batch_ids: _Optional[_Iterable[int]] = ..., free_seq_ids: _Optional[_Iterable[int]] = ..., forks: _Optional[_Iterable[_Union[SequenceFork, _Mapping]]] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., appends: _Optional[_Iterable[_Union[AppendSlots, _Mapping]]] = ..., watermark_blocks: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "namespace", "max_num_new_tokens", "skip_prefix_cache")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    max_num_new_tokens: int
    skip_prefix_cache: bool
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ..., max_num_new_tokens: _Optional[int] = ..., skip_prefix_cache: _Optional[bool] = ...) -> None: ...

class AppendSlots(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_new_tokens", "num_lookahead_slots")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: int
    num_lookahead_slots: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[int] = ..., num_lookahead_slots: _Optional[int] = ...) -> None: ...

class SequenceFork(_message.Message):
    __slots__ = ("parent_seq_id", "child_seq_ids")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parent_seq_id: _Optional[int] = ..., child_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceAllocation(_message.Message):
    __slots__ = ("seq_id", "status", "num_computed_tokens", "num_new_tokens", "block_table_offset", "block_ids", "num_needed_blocks", "num_free_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEEDED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    status: AllocationStatus
    num_computed_tokens: int
    num_new_tokens: int
    block_table_offset: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_needed_blocks: int
    num_free_blocks: int
    def __init__(self, seq_id: _Optional[int] = ..., status: _Optional[_Union[AllocationStatus, str]] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., block_table_offset: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_needed_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ...) -> None: ...

class KVCapacity(_message.Message):
    __slots__ = ("num_total_blocks", "num_free_blocks", "num_evictable_blocks")
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_total_blocks: int
    num_free_blocks: int
    num_evictable_blocks: int
    def __init__(self, num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_evictable_blocks: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("allocations", "block_copies", "capacity", "kv_groups", "tier_ops")
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIER_OPS_FIELD_NUMBER: _ClassVar[int]
    allocations: _containers.RepeatedCompositeFieldContainer[SequenceAllocation]
    block_copies: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockCopy]
    capacity: KVCapacity
    kv_groups: int
    tier_ops: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierOp]
    def __init__(self, allocations: _Optional[_Iterable[_Union[SequenceAllocation, _Mapping]]] = ..., block_copies: _Optional[_Iterable[_Union[_common_pb2.BlockCopy, _Mapping]]] = ..., capacity: _Optional[_Union[KVCapacity, _Mapping]] = ..., kv_groups: _Optional[int] = ..., tier_ops: _Optional[_Iterable[_Union[_common_pb2.TierOp, _Mapping]]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("forks",)
    FORKS_FIELD_NUMBER: _ClassVar[int]
    forks: _containers.RepeatedCompositeFieldContainer[SequenceFork]
    def __init__(self, forks: _Optional[_Iterable[_Union[SequenceFork, _Mapping]]] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("capacity",)
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    capacity: KVCapacity
    def __init__(self, capacity: _Optional[_Union[KVCapacity, _Mapping]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_released_blocks", "capacity")
    NUM_RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    num_released_blocks: int
    capacity: KVCapacity
    def __init__(self, num_released_blocks: _Optional[int] = ..., capacity: _Optional[_Union[KVCapacity, _Mapping]] = ...) -> None: ...

class KVStatsRequest(_message.Message):
    __slots__ = ("include_sequences", "reset_peak")
    INCLUDE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RESET_PEAK_FIELD_NUMBER: _ClassVar[int]
    include_sequences: bool
    reset_peak: bool
    def __init__(self, include_sequences: _Optional[bool] = ..., reset_peak: _Optional[bool] = ...) -> None: ...

class SequenceBlocks(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "num_blocks", "num_shared_blocks", "num_extents", "block_ids", "num_window_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    num_blocks: int
    num_shared_blocks: int
    num_extents: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_window_blocks: int
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_shared_blocks: _Optional[int] = ..., num_extents: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_window_blocks: _Optional[int] = ...) -> None: ...

class KVCacheStats(_message.Message):
    __slots__ = ("epoch", "block_size", "num_total_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "num_evictable_blocks", "num_peak_used_blocks", "num_used_slots", "internal_fragmentation", "external_fragmentation", "largest_free_extent_blocks", "num_prefix_queries", "num_prefix_query_tokens", "num_prefix_hit_tokens", "prefix_hit_rate", "num_evictions", "num_copy_on_writes", "num_sequences", "enable_prefix_caching", "num_steps", "sequences", "watermark_blocks", "num_free_extents", "num_prefix_hits", "num_resets", "block_map", "group_windows", "num_window_blocks", "num_slid_blocks", "tier_host_capacity_blocks", "tier_host_blocks", "tier_disk_capacity_blocks", "tier_disk_blocks", "num_tier_hit_tokens", "num_tier_saves", "num_tier_loads", "num_tier_demotions", "num_tier_drops")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PEAK_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_EXTENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPY_ON_WRITES_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MAP_FIELD_NUMBER: _ClassVar[int]
    GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLID_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_SAVES_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_DROPS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_evictable_blocks: int
    num_peak_used_blocks: int
    num_used_slots: int
    internal_fragmentation: float
    external_fragmentation: float
    largest_free_extent_blocks: int
    num_prefix_queries: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    prefix_hit_rate: float
    num_evictions: int
    num_copy_on_writes: int
    num_sequences: int
    enable_prefix_caching: bool
    num_steps: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceBlocks]
    watermark_blocks: int
    num_free_extents: int
    num_prefix_hits: int
    num_resets: int
    block_map: bytes
    group_windows: _containers.RepeatedScalarFieldContainer[int]
    num_window_blocks: int
    num_slid_blocks: int
    tier_host_capacity_blocks: int
    tier_host_blocks: int
    tier_disk_capacity_blocks: int
    tier_disk_blocks: int
    num_tier_hit_tokens: int
    num_tier_saves: int
    num_tier_loads: int
    num_tier_demotions: int
    num_tier_drops: int
    def __init__(self, epoch: _Optional[int] = ..., block_size: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_evictable_blocks: _Optional[int] = ..., num_peak_used_blocks: _Optional[int] = ..., num_used_slots: _Optional[int] = ..., internal_fragmentation: _Optional[float] = ..., external_fragmentation: _Optional[float] = ..., largest_free_extent_blocks: _Optional[int] = ..., num_prefix_queries: _Optional[int] = ..., num_prefix_query_tokens: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., num_evictions: _Optional[int] = ..., num_copy_on_writes: _Optional[int] = ..., num_sequences: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., num_steps: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceBlocks, _Mapping]]] = ..., watermark_blocks: _Optional[int] = ..., num_free_extents: _Optional[int] = ..., num_prefix_hits: _Optional[int] = ..., num_resets: _Optional[int] = ..., block_map: _Optional[bytes] = ..., group_windows: _Optional[_Iterable[int]] = ..., num_window_blocks: _Optional[int] = ..., num_slid_blocks: _Optional[int] = ..., tier_host_capacity_blocks: _Optional[int] = ..., tier_host_blocks: _Optional[int] = ..., tier_disk_capacity_blocks: _Optional[int] = ..., tier_disk_blocks: _Optional[int] = ..., num_tier_hit_tokens: _Optional[int] = ..., num_tier_saves: _Optional[int] = ..., num_tier_loads: _Optional[int] = ..., num_tier_demotions: _Optional[int] = ..., num_tier_drops: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("keep_prefix_cache",)
    KEEP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    keep_prefix_cache: bool
    def __init__(self, keep_prefix_cache: _Optional[bool] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("num_dropped_sequences", "capacity")
    NUM_DROPPED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    num_dropped_sequences: int
    capacity: KVCapacity
    def __init__(self, num_dropped_sequences: _Optional[int] = ..., capacity: _Optional[_Union[KVCapacity, _Mapping]] = ...) -> None: ...

class CheckCapacityRequest(_message.Message):
    __slots__ = ("num_blocks", "watermark_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    watermark_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., watermark_blocks: _Optional[int] = ...) -> None: ...

class CheckCapacityResponse(_message.Message):
    __slots__ = ("can_allocate", "capacity")
    CAN_ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    can_allocate: bool
    capacity: KVCapacity
    def __init__(self, can_allocate: _Optional[bool] = ..., capacity: _Optional[_Union[KVCapacity, _Mapping]] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("after_sequence_number", "epoch")
    AFTER_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    after_sequence_number: int
    epoch: int
    def __init__(self, after_sequence_number: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class EventsSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EventsSnapshotResponse(_message.Message):
    __slots__ = ("epoch", "sequence_number", "block_size", "blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    sequence_number: int
    block_size: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlocksStored]
    def __init__(self, epoch: _Optional[int] = ..., sequence_number: _Optional[int] = ..., block_size: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlocksStored, _Mapping]]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence_number", "epoch", "blocks_stored", "blocks_removed", "all_blocks_cleared")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    epoch: int
    blocks_stored: BlocksStored
    blocks_removed: BlocksRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, sequence_number: _Optional[int] = ..., epoch: _Optional[int] = ..., blocks_stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., blocks_removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("block_keys", "parent_block_key", "token_ids", "block_size", "namespace", "medium")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    namespace: str
    medium: str
    def __init__(self, block_keys: _Optional[_Iterable[bytes]] = ..., parent_block_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., namespace: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_keys", "medium")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_keys: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
