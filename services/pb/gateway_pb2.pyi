from services.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptTokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TextGenerationOptions(_message.Message):
    __slots__ = ("sampling_params", "stop", "priority", "include_stop_str_in_output", "skip_special_tokens", "debug_timeline", "user")
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEBUG_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sampling_params: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    priority: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    debug_timeline: bool
    user: str
    def __init__(self, sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., priority: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., debug_timeline: _Optional[bool] = ..., user: _Optional[str] = ...) -> None: ...

class TextGenerateRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: PromptTokenIds
    options: TextGenerationOptions
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[PromptTokenIds, _Mapping]] = ..., options: _Optional[_Union[TextGenerationOptions, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    options: TextGenerationOptions
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., options: _Optional[_Union[TextGenerationOptions, _Mapping]] = ...) -> None: ...

class TextTokenAlternative(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TextTokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TextTokenAlternative]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TextTokenAlternative, _Mapping]]] = ...) -> None: ...

class TextChoiceDelta(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_string", "stop_token_id", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TextTokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_string: str
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TextTokenLogprob]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TextTokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TextTokenLogprob, _Mapping]]] = ...) -> None: ...

class TextGenerateResponse(_message.Message):
    __slots__ = ("request_id", "choices", "usage", "timeline")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[TextChoiceDelta]
    usage: _common_pb2.Usage
    timeline: _containers.RepeatedCompositeFieldContainer[_common_pb2.TimelineEvent]
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[TextChoiceDelta, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timeline: _Optional[_Iterable[_Union[_common_pb2.TimelineEvent, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "owned_by", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    owned_by: str
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., owned_by: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model", "texts", "token_ids", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[PromptTokenIds]
    priority: int
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[PromptTokenIds, _Mapping]]] = ..., priority: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embeddings", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    usage: _common_pb2.Usage
    def __init__(self, request_id: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...
