from services.pb import common_pb2 as _common_pb2
from services.pb import kvcache_pb2 as _kvcache_pb2
from services.pb import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "tenant", "debug_timeline", "trace_context", "arrival_time_ns", "pooling", "lora_name", "kv_export", "kv_import")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEBUG_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORT_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    priority: int
    tenant: str
    debug_timeline: bool
    trace_context: _common_pb2.TraceContext
    arrival_time_ns: int
    pooling: _common_pb2.PoolingType
    lora_name: str
    kv_export: bool
    kv_import: KVTransfer
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., debug_timeline: _Optional[bool] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., arrival_time_ns: _Optional[int] = ..., pooling: _Optional[_Union[_common_pb2.PoolingType, str]] = ..., lora_name: _Optional[str] = ..., kv_export: _Optional[bool] = ..., kv_import: _Optional[_Union[KVTransfer, _Mapping]] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("stage_addresses", "seq_id", "num_blocks", "block_size")
    STAGE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    stage_addresses: _containers.RepeatedScalarFieldContainer[str]
    seq_id: int
    num_blocks: int
    block_size: int
    def __init__(self, stage_addresses: _Optional[_Iterable[str]] = ..., seq_id: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class StreamCommand(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    abort: AbortRequest
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class StreamEvents(_message.Message):
    __slots__ = ("responses", "failures")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    failures: _containers.RepeatedCompositeFieldContainer[RequestFailure]
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[RequestFailure, _Mapping]]] = ...) -> None: ...

class RequestFailure(_message.Message):
    __slots__ = ("request_id", "code", "message", "pipeline_down")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DOWN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    pipeline_down: bool
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., pipeline_down: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finish_reason", "stop_token_id", "error_message", "usage", "timeline", "prompt_logprobs", "embedding", "kv_export")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    error_message: str
    usage: _common_pb2.Usage
    timeline: _containers.RepeatedCompositeFieldContainer[_common_pb2.TimelineEvent]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    embedding: _common_pb2.Tensor
    kv_export: KVTransfer
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., error_message: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timeline: _Optional[_Iterable[_Union[_common_pb2.TimelineEvent, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., embedding: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., kv_export: _Optional[_Union[KVTransfer, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("include_kv_sequences", "include_requests", "include_timeline")
    INCLUDE_KV_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    include_kv_sequences: bool
    include_requests: bool
    include_timeline: bool
    def __init__(self, include_kv_sequences: _Optional[bool] = ..., include_requests: _Optional[bool] = ..., include_timeline: _Optional[bool] = ...) -> None: ...

class StageSpan(_message.Message):
    __slots__ = ("stage_index", "micro_batch_id", "start_ns", "end_ns", "received_ns")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    micro_batch_id: int
    start_ns: int
    end_ns: int
    received_ns: int
    def __init__(self, stage_index: _Optional[int] = ..., micro_batch_id: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., received_ns: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "num_waiting", "num_running", "num_served_tokens", "weight")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    num_waiting: int
    num_running: int
    num_served_tokens: int
    weight: float
    def __init__(self, tenant: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_served_tokens: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class PipelineStageStats(_message.Message):
    __slots__ = ("stage_index", "address", "health", "load_info", "stats", "busy_fraction", "bubble_ns", "num_in_flight")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INFO_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    address: str
    health: _common_pb2.HealthStatus
    load_info: _worker_pb2.StageLoadInfo
    stats: _worker_pb2.StageStats
    busy_fraction: float
    bubble_ns: int
    num_in_flight: int
    def __init__(self, stage_index: _Optional[int] = ..., address: _Optional[str] = ..., health: _Optional[_Union[_common_pb2.HealthStatus, str]] = ..., load_info: _Optional[_Union[_worker_pb2.StageLoadInfo, _Mapping]] = ..., stats: _Optional[_Union[_worker_pb2.StageStats, _Mapping]] = ..., busy_fraction: _Optional[float] = ..., bubble_ns: _Optional[int] = ..., num_in_flight: _Optional[int] = ...) -> None: ...

class SchedulerConfig(_message.Message):
    __slots__ = ("model", "pipeline_parallel_size", "async_scheduling", "scheduler_policy", "max_num_batched_tokens", "max_num_seqs", "microbatch_size", "enable_chunked_prefill", "enable_prefix_caching", "preemption_mode", "block_size", "num_kv_blocks", "max_model_len", "scheduler_timeout_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_MODE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    pipeline_parallel_size: int
    async_scheduling: bool
    scheduler_policy: str
    max_num_batched_tokens: int
    max_num_seqs: int
    microbatch_size: str
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    preemption_mode: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    scheduler_timeout_ms: int
    def __init__(self, model: _Optional[str] = ..., pipeline_parallel_size: _Optional[int] = ..., async_scheduling: _Optional[bool] = ..., scheduler_policy: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., microbatch_size: _Optional[str] = ..., enable_chunked_prefill: _Optional[bool] = ..., enable_prefix_caching: _Optional[bool] = ..., preemption_mode: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., scheduler_timeout_ms: _Optional[int] = ...) -> None: ...

class RequestSummary(_message.Message):
    __slots__ = ("request_id", "state", "tenant", "priority", "num_prompt_tokens", "num_output_tokens", "num_preemptions", "arrival_time_ns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: _common_pb2.RequestState
    tenant: str
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    arrival_time_ns: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.RequestState, str]] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., arrival_time_ns: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("health", "health_detail", "epoch", "uptime_ns", "config", "num_waiting", "num_running", "num_preempted", "tenants", "num_preemptions", "num_finished_requests", "num_aborted_requests", "num_prompt_tokens", "num_generated_tokens", "num_micro_batches", "num_in_flight", "stages", "kv_address", "kv_health", "kv_cache", "requests", "timeline", "now_ns", "num_spec_drafts", "num_spec_draft_tokens", "num_spec_accepted_tokens", "num_spec_accepted_per_position", "disaggregation")
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_DETAIL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_NS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_HEALTH_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    NOW_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATION_FIELD_NUMBER: _ClassVar[int]
    health: _common_pb2.HealthStatus
    health_detail: str
    epoch: int
    uptime_ns: int
    config: SchedulerConfig
    num_waiting: int
    num_running: int
    num_preempted: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    num_preemptions: int
    num_finished_requests: int
    num_aborted_requests: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_micro_batches: int
    num_in_flight: int
    stages: _containers.RepeatedCompositeFieldContainer[PipelineStageStats]
    kv_address: str
    kv_health: _common_pb2.HealthStatus
    kv_cache: _kvcache_pb2.KVCacheStats
    requests: _containers.RepeatedCompositeFieldContainer[RequestSummary]
    timeline: _containers.RepeatedCompositeFieldContainer[StageSpan]
    now_ns: int
    num_spec_drafts: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    num_spec_accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    disaggregation: DisaggregationStats
    def __init__(self, health: _Optional[_Union[_common_pb2.HealthStatus, str]] = ..., health_detail: _Optional[str] = ..., epoch: _Optional[int] = ..., uptime_ns: _Optional[int] = ..., config: _Optional[_Union[SchedulerConfig, _Mapping]] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_preempted: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., num_preemptions: _Optional[int] = ..., num_finished_requests: _Optional[int] = ..., num_aborted_requests: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[PipelineStageStats, _Mapping]]] = ..., kv_address: _Optional[str] = ..., kv_health: _Optional[_Union[_common_pb2.HealthStatus, str]] = ..., kv_cache: _Optional[_Union[_kvcache_pb2.KVCacheStats, _Mapping]] = ..., requests: _Optional[_Iterable[_Union[RequestSummary, _Mapping]]] = ..., timeline: _Optional[_Iterable[_Union[StageSpan, _Mapping]]] = ..., now_ns: _Optional[int] = ..., num_spec_drafts: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., num_spec_accepted_per_position: _Optional[_Iterable[int]] = ..., disaggregation: _Optional[_Union[DisaggregationStats, _Mapping]] = ...) -> None: ...

class DisaggregationStats(_message.Message):
    __slots__ = ("num_held", "num_exports", "num_released", "num_expired", "num_import_requests", "num_imported", "num_import_failures", "num_imported_blocks", "num_imported_bytes", "import_seconds")
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMPORT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_held: int
    num_exports: int
    num_released: int
    num_expired: int
    num_import_requests: int
    num_imported: int
    num_import_failures: int
    num_imported_blocks: int
    num_imported_bytes: int
    import_seconds: float
    def __init__(self, num_held: _Optional[int] = ..., num_exports: _Optional[int] = ..., num_released: _Optional[int] = ..., num_expired: _Optional[int] = ..., num_import_requests: _Optional[int] = ..., num_imported: _Optional[int] = ..., num_import_failures: _Optional[int] = ..., num_imported_blocks: _Optional[int] = ..., num_imported_bytes: _Optional[int] = ..., import_seconds: _Optional[float] = ...) -> None: ...
