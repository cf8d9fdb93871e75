from services.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataChannel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_CHANNEL_UNSPECIFIED: _ClassVar[DataChannel]
    DATA_CHANNEL_GRPC: _ClassVar[DataChannel]
    DATA_CHANNEL_SHM: _ClassVar[DataChannel]
    DATA_CHANNEL_NCCL: _ClassVar[DataChannel]
DATA_CHANNEL_UNSPECIFIED: DataChannel
DATA_CHANNEL_GRPC: DataChannel
DATA_CHANNEL_SHM: DataChannel
DATA_CHANNEL_NCCL: DataChannel

class ExportBlocksRequest(_message.Message):
    __slots__ = ("seq_id", "block_indices")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., block_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("block_index", "data", "crc32", "dtype", "shape", "layer_start", "layer_end")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    data: bytes
    crc32: int
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    def __init__(self, block_index: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("source_address", "seq_id", "block_indices", "keys", "timeout_s")
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    source_address: str
    seq_id: int
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    timeout_s: float
    def __init__(self, source_address: _Optional[str] = ..., seq_id: _Optional[int] = ..., block_indices: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PullBlocksReply(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "elapsed_ns")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    elapsed_ns: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., elapsed_ns: _Optional[int] = ...) -> None: ...

class DataPlaneOffer(_message.Message):
    __slots__ = ("sender_stage", "channel", "path", "token", "ring_id", "num_slots", "slot_bytes", "store_address", "backend", "device", "hostname")
    SENDER_STAGE_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RING_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    sender_stage: int
    channel: DataChannel
    path: str
    token: bytes
    ring_id: int
    num_slots: int
    slot_bytes: int
    store_address: str
    backend: str
    device: str
    hostname: str
    def __init__(self, sender_stage: _Optional[int] = ..., channel: _Optional[_Union[DataChannel, str]] = ..., path: _Optional[str] = ..., token: _Optional[bytes] = ..., ring_id: _Optional[int] = ..., num_slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., store_address: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., hostname: _Optional[str] = ...) -> None: ...

class DataPlaneReply(_message.Message):
    __slots__ = ("channel", "reason")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    channel: DataChannel
    reason: str
    def __init__(self, channel: _Optional[_Union[DataChannel, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class HiddenRef(_message.Message):
    __slots__ = ("ring_id", "slot", "seq", "dtype", "shape")
    RING_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ring_id: int
    slot: int
    seq: int
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ring_id: _Optional[int] = ..., slot: _Optional[int] = ..., seq: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class LoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_id", "drain_timeout_s")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_id: int
    drain_timeout_s: float
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_id: _Optional[int] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_id")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_id: int
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_id: _Optional[int] = ...) -> None: ...

class LoraAdapterReply(_message.Message):
    __slots__ = ("lora_names", "lora_adapters")
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, lora_names: _Optional[_Iterable[str]] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class SampledFeedback(_message.Message):
    __slots__ = ("micro_batch_id", "seq_ids", "positions", "token_ids")
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    micro_batch_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, micro_batch_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FeedbackAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("epoch", "seq_ids")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbandonReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("micro_batch_id", "stage_index", "block_copies", "finished_seq_ids", "reset", "hidden_states", "sent_ns", "new_seqs", "cached", "upstream_timings", "kv_groups", "hidden_ref", "tier_ops")
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_REF_FIELD_NUMBER: _ClassVar[int]
    TIER_OPS_FIELD_NUMBER: _ClassVar[int]
    micro_batch_id: int
    stage_index: int
    block_copies: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockCopy]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    reset: bool
    hidden_states: _common_pb2.Tensor
    sent_ns: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[StageNewSequence]
    cached: CachedSequences
    upstream_timings: _containers.RepeatedCompositeFieldContainer[StepTiming]
    kv_groups: int
    hidden_ref: HiddenRef
    tier_ops: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierOp]
    def __init__(self, micro_batch_id: _Optional[int] = ..., stage_index: _Optional[int] = ..., block_copies: _Optional[_Iterable[_Union[_common_pb2.BlockCopy, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., reset: _Optional[bool] = ..., hidden_states: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sent_ns: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[StageNewSequence, _Mapping]]] = ..., cached: _Optional[_Union[CachedSequences, _Mapping]] = ..., upstream_timings: _Optional[_Iterable[_Union[StepTiming, _Mapping]]] = ..., kv_groups: _Optional[int] = ..., hidden_ref: _Optional[_Union[HiddenRef, _Mapping]] = ..., tier_ops: _Optional[_Iterable[_Union[_common_pb2.TierOp, _Mapping]]] = ...) -> None: ...

class StageNewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "prompt_len", "num_computed", "num_scheduled", "block_ids", "params", "eos_token_ids", "choice_index", "entropy_seed", "request_id", "traceparent", "prompt_scoring", "pooling", "lora_name")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SCORING_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    num_computed: int
    num_scheduled: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    choice_index: int
    entropy_seed: int
    request_id: str
    traceparent: str
    prompt_scoring: PromptScoring
    pooling: _common_pb2.PoolingType
    lora_name: str
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., num_computed: _Optional[int] = ..., num_scheduled: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., choice_index: _Optional[int] = ..., entropy_seed: _Optional[int] = ..., request_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., prompt_scoring: _Optional[_Union[PromptScoring, _Mapping]] = ..., pooling: _Optional[_Union[_common_pb2.PoolingType, str]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class PromptScoring(_message.Message):
    __slots__ = ("first_position", "targets", "num_top")
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    targets: _containers.RepeatedScalarFieldContainer[int]
    num_top: int
    def __init__(self, first_position: _Optional[int] = ..., targets: _Optional[_Iterable[int]] = ..., num_top: _Optional[int] = ...) -> None: ...

class CachedSequences(_message.Message):
    __slots__ = ("seq_ids", "num_scheduled", "block_offsets", "num_block_ids", "block_ids", "num_new_token_ids", "new_token_ids", "prompt_scoring", "num_draft_token_ids", "draft_token_ids", "starts")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SCORING_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled: _containers.RepeatedScalarFieldContainer[int]
    block_offsets: _containers.RepeatedScalarFieldContainer[int]
    num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_scoring: _containers.RepeatedCompositeFieldContainer[IndexedPromptScoring]
    num_draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_scheduled: _Optional[_Iterable[int]] = ..., block_offsets: _Optional[_Iterable[int]] = ..., num_block_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_new_token_ids: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., prompt_scoring: _Optional[_Iterable[_Union[IndexedPromptScoring, _Mapping]]] = ..., num_draft_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[int]] = ...) -> None: ...

class IndexedPromptScoring(_message.Message):
    __slots__ = ("index", "scoring")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    index: int
    scoring: PromptScoring
    def __init__(self, index: _Optional[int] = ..., scoring: _Optional[_Union[PromptScoring, _Mapping]] = ...) -> None: ...

class ForwardSummary(_message.Message):
    __slots__ = ("num_micro_batches",)
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    num_micro_batches: int
    def __init__(self, num_micro_batches: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("stage_index", "epoch", "ready", "done")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    epoch: int
    ready: StageLoadInfo
    done: MicroBatchDone
    def __init__(self, stage_index: _Optional[int] = ..., epoch: _Optional[int] = ..., ready: _Optional[_Union[StageLoadInfo, _Mapping]] = ..., done: _Optional[_Union[MicroBatchDone, _Mapping]] = ...) -> None: ...

class MicroBatchDone(_message.Message):
    __slots__ = ("micro_batch_id", "error", "timing", "sampled", "num_block_copies_applied", "prompt_logprobs", "pooled", "upstream_timings", "proposal_seq_ids", "num_proposal_tokens", "proposal_token_ids", "sampled_seq_ids", "sampled_token_ids")
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_COPIES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    micro_batch_id: int
    error: _common_pb2.ErrorStatus
    timing: StepTiming
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    num_block_copies_applied: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    pooled: _containers.RepeatedCompositeFieldContainer[PooledOutput]
    upstream_timings: _containers.RepeatedCompositeFieldContainer[StepTiming]
    proposal_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_proposal_tokens: _containers.RepeatedScalarFieldContainer[int]
    proposal_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, micro_batch_id: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.ErrorStatus, _Mapping]] = ..., timing: _Optional[_Union[StepTiming, _Mapping]] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., num_block_copies_applied: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., pooled: _Optional[_Iterable[_Union[PooledOutput, _Mapping]]] = ..., upstream_timings: _Optional[_Iterable[_Union[StepTiming, _Mapping]]] = ..., proposal_seq_ids: _Optional[_Iterable[int]] = ..., num_proposal_tokens: _Optional[_Iterable[int]] = ..., proposal_token_ids: _Optional[_Iterable[int]] = ..., sampled_seq_ids: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("seq_id", "embedding")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    embedding: _common_pb2.Tensor
    def __init__(self, seq_id: _Optional[int] = ..., embedding: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "positions")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    positions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprobs: _common_pb2.TopLogprobs
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("sent_ns", "received_ns", "compute_start_ns", "compute_end_ns", "forwarded_ns", "num_seqs", "num_tokens", "stage_index")
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_START_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_END_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    sent_ns: int
    received_ns: int
    compute_start_ns: int
    compute_end_ns: int
    forwarded_ns: int
    num_seqs: int
    num_tokens: int
    stage_index: int
    def __init__(self, sent_ns: _Optional[int] = ..., received_ns: _Optional[int] = ..., compute_start_ns: _Optional[int] = ..., compute_end_ns: _Optional[int] = ..., forwarded_ns: _Optional[int] = ..., num_seqs: _Optional[int] = ..., num_tokens: _Optional[int] = ..., stage_index: _Optional[int] = ...) -> None: ...

class LoadInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageLoadInfo(_message.Message):
    __slots__ = ("stage_index", "num_stages", "layer_start", "layer_end", "num_layers", "num_kv_blocks", "block_size", "dtype", "kv_cache_dtype", "model", "epoch", "max_num_batched_tokens", "hidden_size", "vocab_size", "max_message_bytes", "next_address", "num_threads", "device", "quantization", "feedback_address", "feedback_connected", "kv_block_bytes", "memory_total_bytes", "memory_budget_bytes", "memory_baseline_bytes", "weights_bytes", "activation_peak_bytes", "tensor_parallel_size", "cpu", "lora_adapters", "kv_groups", "expert_weights_bytes", "data_channel", "local_socket", "local_token")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BASELINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int
    num_layers: int
    num_kv_blocks: int
    block_size: int
    dtype: _common_pb2.DType
    kv_cache_dtype: _common_pb2.DType
    model: str
    epoch: int
    max_num_batched_tokens: int
    hidden_size: int
    vocab_size: int
    max_message_bytes: int
    next_address: str
    num_threads: int
    device: str
    quantization: str
    feedback_address: str
    feedback_connected: bool
    kv_block_bytes: int
    memory_total_bytes: int
    memory_budget_bytes: int
    memory_baseline_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    tensor_parallel_size: int
    cpu: str
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    kv_groups: str
    expert_weights_bytes: int
    data_channel: str
    local_socket: str
    local_token: bytes
    def __init__(self, stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., kv_cache_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., model: _Optional[str] = ..., epoch: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., next_address: _Optional[str] = ..., num_threads: _Optional[int] = ..., device: _Optional[str] = ..., quantization: _Optional[str] = ..., feedback_address: _Optional[str] = ..., feedback_connected: _Optional[bool] = ..., kv_block_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., memory_baseline_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., activation_peak_bytes: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., cpu: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., kv_groups: _Optional[str] = ..., expert_weights_bytes: _Optional[int] = ..., data_channel: _Optional[str] = ..., local_socket: _Optional[str] = ..., local_token: _Optional[bytes] = ...) -> None: ...

class StageStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("stage_index", "epoch", "busy_ns", "idle_ns", "num_micro_batches", "num_failed_micro_batches", "num_tokens", "num_in_flight", "peak_in_flight", "num_block_copies", "num_received_bytes", "num_sent_bytes", "uptime_ns", "num_fed_tokens", "num_feedback_waits", "num_abandoned", "num_progress_ticks", "progress_age_ns", "computing_micro_batch_id", "cpu", "data_channel", "upstream_channel", "num_ring_full_waits", "num_shm_sent", "num_grpc_sent", "num_p2p_sent", "control_channel", "num_local_streams")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    IDLE_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PEAK_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_FED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FEEDBACK_WAITS_FIELD_NUMBER: _ClassVar[int]
    NUM_ABANDONED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROGRESS_TICKS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_AGE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTING_MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    NUM_RING_FULL_WAITS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHM_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_GRPC_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_P2P_SENT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_STREAMS_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    epoch: int
    busy_ns: int
    idle_ns: int
    num_micro_batches: int
    num_failed_micro_batches: int
    num_tokens: int
    num_in_flight: int
    peak_in_flight: int
    num_block_copies: int
    num_received_bytes: int
    num_sent_bytes: int
    uptime_ns: int
    num_fed_tokens: int
    num_feedback_waits: int
    num_abandoned: int
    num_progress_ticks: int
    progress_age_ns: int
    computing_micro_batch_id: int
    cpu: str
    data_channel: str
    upstream_channel: str
    num_ring_full_waits: int
    num_shm_sent: int
    num_grpc_sent: int
    num_p2p_sent: int
    control_channel: str
    num_local_streams: int
    def __init__(self, stage_index: _Optional[int] = ..., epoch: _Optional[int] = ..., busy_ns: _Optional[int] = ..., idle_ns: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., num_failed_micro_batches: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., peak_in_flight: _Optional[int] = ..., num_block_copies: _Optional[int] = ..., num_received_bytes: _Optional[int] = ..., num_sent_bytes: _Optional[int] = ..., uptime_ns: _Optional[int] = ..., num_fed_tokens: _Optional[int] = ..., num_feedback_waits: _Optional[int] = ..., num_abandoned: _Optional[int] = ..., num_progress_ticks: _Optional[int] = ..., progress_age_ns: _Optional[int] = ..., computing_micro_batch_id: _Optional[int] = ..., cpu: _Optional[str] = ..., data_channel: _Optional[str] = ..., upstream_channel: _Optional[str] = ..., num_ring_full_waits: _Optional[int] = ..., num_shm_sent: _Optional[int] = ..., num_grpc_sent: _Optional[int] = ..., num_p2p_sent: _Optional[int] = ..., control_channel: _Optional[str] = ..., num_local_streams: _Optional[int] = ...) -> None: ...

class StageHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageHealth(_message.Message):
    __slots__ = ("status", "stage_index", "epoch", "downstream_connected", "device")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.HealthStatus
    stage_index: int
    epoch: int
    downstream_connected: bool
    device: str
    def __init__(self, status: _Optional[_Union[_common_pb2.HealthStatus, str]] = ..., stage_index: _Optional[int] = ..., epoch: _Optional[int] = ..., downstream_connected: _Optional[bool] = ..., device: _Optional[str] = ...) -> None: ...
