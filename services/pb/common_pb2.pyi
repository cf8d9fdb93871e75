from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_WAITING: _ClassVar[RequestState]
    REQUEST_STATE_PREFILLING: _ClassVar[RequestState]
    REQUEST_STATE_DECODING: _ClassVar[RequestState]
    REQUEST_STATE_PREEMPTED: _ClassVar[RequestState]
    REQUEST_STATE_FINISHED: _ClassVar[RequestState]
    REQUEST_STATE_ABORTED: _ClassVar[RequestState]

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]

class HealthStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_STATUS_UNSPECIFIED: _ClassVar[HealthStatus]
    HEALTH_STATUS_SERVING: _ClassVar[HealthStatus]
    HEALTH_STATUS_STARTING: _ClassVar[HealthStatus]
    HEALTH_STATUS_NOT_SERVING: _ClassVar[HealthStatus]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_FLOAT8_E5M2: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_WAITING: RequestState
REQUEST_STATE_PREFILLING: RequestState
REQUEST_STATE_DECODING: RequestState
REQUEST_STATE_PREEMPTED: RequestState
REQUEST_STATE_FINISHED: RequestState
REQUEST_STATE_ABORTED: RequestState
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType
HEALTH_STATUS_UNSPECIFIED: HealthStatus
HEALTH_STATUS_SERVING: HealthStatus
HEALTH_STATUS_STARTING: HealthStatus
HEALTH_STATUS_NOT_SERVING: HealthStatus

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs", "logit_bias", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_completion_tokens", "num_cached_tokens", "num_preemptions")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_completion_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class TimelineEvent(_message.Message):
    __slots__ = ("name", "category", "stage_index", "start_ns", "end_ns", "micro_batch_id", "choice_index", "num_tokens", "args")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    category: str
    stage_index: int
    start_ns: int
    end_ns: int
    micro_batch_id: int
    choice_index: int
    num_tokens: int
    args: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., category: _Optional[str] = ..., stage_index: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., micro_batch_id: _Optional[int] = ..., choice_index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., args: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src_block_id", "dst_block_id")
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    src_block_id: int
    dst_block_id: int
    def __init__(self, src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ...) -> None: ...

class TierOp(_message.Message):
    __slots__ = ("kind", "key", "block_id")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TierOp.Kind]
        KIND_SAVE: _ClassVar[TierOp.Kind]
        KIND_LOAD: _ClassVar[TierOp.Kind]
        KIND_DEMOTE: _ClassVar[TierOp.Kind]
        KIND_DROP: _ClassVar[TierOp.Kind]
    KIND_UNSPECIFIED: TierOp.Kind
    KIND_SAVE: TierOp.Kind
    KIND_LOAD: TierOp.Kind
    KIND_DEMOTE: TierOp.Kind
    KIND_DROP: TierOp.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    kind: TierOp.Kind
    key: bytes
    block_id: int
    def __init__(self, kind: _Optional[_Union[TierOp.Kind, str]] = ..., key: _Optional[bytes] = ..., block_id: _Optional[int] = ...) -> None: ...

class ErrorStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class LocalEndpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalEndpointReply(_message.Message):
    __slots__ = ("local_socket", "local_token")
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    local_socket: str
    local_token: bytes
    def __init__(self, local_socket: _Optional[str] = ..., local_token: _Optional[bytes] = ...) -> None: ...
