"""The REST API's request bodies: OpenAI's completions and chat, plus vLLM's extra fields.

Pydantic checks types and the bounds that need no context (strictly: `"16"` is not a
number and `true` not an integer, as OpenAI's API has it), the sampling type's own bounds
(`services.sampling.RANGES`) where a field means what the type's field does;
`gateway.validation` checks what depends on the model and the configuration. Fields the gateway cannot honour are declared
anyway, so that a request that sets them is refused by name instead of being ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from services.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS_ENTRIES, RANGES

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 4096  # characters per stop string (REST and the public gRPC API alike)

TokenIds = list[Annotated[int, Field(ge=0)]]
Prompt = str | list[str] | TokenIds | list[TokenIds]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_text(value: Any) -> Any:
    """A string must be Unicode a tokenizer can encode: JSON's `\\ud800` escapes decode to a
    lone surrogate, which is not (it reached the tokenizer and failed as a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"not valid Unicode: a lone surrogate ({value[exc.start]!r}) at character {exc.start}"
            ) from None
    return value


def check_prompt(value: Any) -> Any:
    """One clear error for a malformed prompt instead of one per member of the union."""
    shape = "must be a string, a list of strings, a list of token ids (non-negative integers) or a list of such lists"
    if isinstance(value, str):
        return check_text(value)
    if not isinstance(value, list):
        raise ValueError(f"{shape}, got {type(value).__name__}")
    if not value:
        raise ValueError("must not be empty")
    if all(isinstance(x, str) for x in value):
        for x in value:
            check_text(x)
        return value
    if all(_is_token_id(x) for x in value):
        return value
    if all(isinstance(x, list) for x in value):
        for i, ids in enumerate(value):
            if not ids:
                raise ValueError(f"[{i}]: must not be empty")
            if not all(_is_token_id(t) for t in ids):
                raise ValueError(f"[{i}]: token ids must be non-negative integers")
        return value
    raise ValueError(shape)


def check_stop(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, str) and (not isinstance(value, list) or not all(isinstance(s, str) for s in value)):
        raise ValueError("must be a string or a list of strings")
    stop_limits([value] if isinstance(value, str) else value)
    for s in [value] if isinstance(value, str) else value:
        check_text(s)
    return value


def stop_limits(stops: list[str]) -> None:
    """The limits on stop strings, for both front doors; ValueError saying which."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for s in stops:
        if len(s) > MAX_STOP_LENGTH:
            raise ValueError(f"a stop string may have at most {MAX_STOP_LENGTH} characters, got {len(s)}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = Field(False, description="Send a last chunk with the usage (choices empty).")
    continuous_usage_stats: bool = Field(False, description="vLLM: usage on every chunk.")


class _SamplingFields(BaseModel):
    """What completions, chat and /generate share."""

    # an unknown field (another server's extra, a misspelling) is a 400 naming it, never ignored
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    # a sampling field left out (or null) takes the model's default (GET /v1/models lists them)
    temperature: float | None = Field(None, **RANGES["temperature"].bounds, description="0 is greedy.")
    top_p: float | None = Field(None, **RANGES["top_p"].bounds)
    seed: int | None = Field(
        None, ge=-(2**63), lt=RANGES["seed"].lt, description="A negative seed wraps around to an unsigned one."
    )
    stop: str | list[str] | None = Field(None, description="Stop strings, cut from the text.")
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, lt=RANGES["top_k"].lt, description="-1 or 0: off.")
    min_p: float | None = Field(None, **RANGES["min_p"].bounds)
    min_tokens: int = Field(0, **RANGES["min_tokens"].bounds)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX, description="Lower runs sooner.")
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(
        None, **RANGES["presence_penalty"].bounds, description="Subtracted once from each generated token's logit."
    )
    frequency_penalty: float | None = Field(
        None, **RANGES["frequency_penalty"].bounds, description="Subtracted per occurrence in the output so far."
    )
    repetition_penalty: float | None = Field(
        None,
        **RANGES["repetition_penalty"].bounds,
        description="vLLM/transformers: divides positive "
        "logits (multiplies negative ones) of tokens in the prompt or output; 1 is off.",
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description=f"Token id (as a string) -> bias in [{LOGIT_BIAS_RANGE.ge:g}, "
        f"{LOGIT_BIAS_RANGE.le:g}]; at most {MAX_LOGIT_BIAS_ENTRIES}.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        return check_stop(value)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`, as OpenAI's API has it."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON Schema the output follows.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="A JSON Schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark or GBNF grammar.")
    json_object: bool | None = None


class _OpenAIFields(_SamplingFields):
    model: str | None = Field(None, description="The served model's name; default: it.")
    n: int = Field(1, **RANGES["n"].bounds, description="Choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    return_token_ids: bool = Field(False, description="vLLM: the prompt's and each choice's token ids.")
    prompt_logprobs: int | None = Field(
        None,
        **RANGES["prompt_logprobs"].bounds,
        description="vLLM: each prompt token's log-probability given the ones before "
        "it, with this many alternatives (not with stream). Served without the prefix cache.",
    )
    # structured output (docs/structured-output.md): at most one of these
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI: text, json_object, or json_schema with its schema."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM: one of json, regex, choice, grammar, json_object."
    )
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM: a JSON Schema.")
    guided_regex: str | None = Field(None, description="vLLM: a regular expression.")
    guided_choice: list[str] | None = Field(None, description="vLLM: the output is one of these.")
    guided_grammar: str | None = Field(None, description="vLLM: a Lark or GBNF grammar.")
    guided_decoding_backend: str | None = Field(
        None, description="vLLM: only 'auto', 'guidance' or 'llguidance' (what Pagoda uses)."
    )


class CompletionRequest(_OpenAIFields):
    """`POST /v1/completions`."""

    prompt: Prompt
    max_tokens: int | None = Field(
        16,
        ge=0,
        lt=RANGES["max_tokens"].lt,
        description="null: the rest of the context; 0: only the prompt "
        "(with echo and logprobs: scored, as evaluation harnesses ask).",
    )
    logprobs: int | None = Field(None, **RANGES["logprobs"].bounds, description="Alternatives per token.")
    echo: bool = Field(
        False,
        description="The prompt before each choice's text (and, with "
        "logprobs, its tokens' log-probabilities, the first null).",
    )
    best_of: int | None = Field(None, ge=1, description="Only None or n.")
    suffix: str | None = Field(None, description="Refused: not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return check_prompt(value)


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None

    check_unicode = field_validator("text")(check_text)


class ChatMessage(BaseModel):
    """One message, as the chat template sees it (gateway.validation): a null or missing
    `content` is "" (the openai SDK sends `content: null` beside an assistant's
    `tool_calls`), as vLLM renders it."""

    model_config = ConfigDict(strict=True, extra="allow")  # templates may read more keys

    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None,
        description="An assistant's calls, given to the template with each call's "
        "`arguments` as an object (as vLLM and transformers' templates expect).",
    )
    tool_call_id: str | None = Field(None, description="A tool message's answer to this call.")

    check_unicode = field_validator("role", "content", "name", "tool_call_id")(check_text)


class ChatCompletionRequest(_OpenAIFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        None, **RANGES["max_tokens"].bounds, description="Deprecated name of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(
        None, **RANGES["max_tokens"].bounds, description="Default: the rest of the context."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **RANGES["logprobs"].bounds)
    tools: list[dict[str, Any]] | None = Field(
        None, description="Functions the model may call (given to the chat template); see tool_choice."
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="'none', 'auto' (the default with tools: the reply is parsed for calls; needs the "
        "server's --enable-auto-tool-choice and --tool-call-parser, else refused), 'required' (a list of "
        'calls), or {"type": "function", "function": {"name": ...}} (docs/structured-output.md).',
    )
    parallel_tool_calls: bool = Field(
        True, description="false: at most one call ('auto': the first the reply holds; 'required': exactly one)."
    )
    include_reasoning: bool = Field(
        True,
        description="vLLM: with the server's --reasoning-parser, false "
        "drops the reasoning (reasoning_content) from the reply.",
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False,
        description="vLLM: the last message is continued (a prefill of the answer): no "
        "end of turn after it; needs add_generation_prompt false.",
    )
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = Field(False, description="Refused: not supported.")


class GenerateRequest(_SamplingFields):
    """`POST /generate`: one prompt, one choice, the text back (and the timeline if asked)."""

    prompt: str | TokenIds
    max_tokens: int | None = Field(16, **RANGES["max_tokens"].bounds, description="null: the rest of the context.")
    debug_timeline: bool = Field(False, description="Return the request's Chrome trace.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and all(_is_token_id(x) for x in value)):
            if not value:
                raise ValueError("must not be empty")
            return check_text(value)
        raise ValueError("must be a string or a list of token ids (non-negative integers)")


class TokenizeCompletionRequest(BaseModel):
    """`POST /tokenize` of a text (vLLM's TokenizeCompletionRequest)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = Field(None, description="The served model's name; default: it.")
    prompt: str
    add_special_tokens: bool = Field(
        True, description="Add the tokenizer's own special tokens (e.g. a BOS), as completions do."
    )

    check_unicode = field_validator("prompt")(check_text)
    return_token_strs: bool = Field(False, description="Also return each token's vocabulary entry.")


class TokenizeChatRequest(BaseModel):
    """`POST /tokenize` of a conversation, through the chat template exactly as
    `/v1/chat/completions` applies it (vLLM's TokenizeChatRequest)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = Field(None, description="The served model's name; default: it.")
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = Field(
        None,
        description="null: as /v1/chat/completions (the BOS the tokenizer adds, unless the "
        "template already wrote one); false: the rendered text alone; true: plus whatever the "
        "tokenizer adds.",
    )
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = Field(False, description="Also return each token's vocabulary entry.")
    continue_final_message: bool = Field(
        False, description="As /v1/chat/completions: the last message is continued; needs add_generation_prompt false."
    )
    chat_template: str | None = Field(None, description="Refused: the model's own template is used.")
    tools: list[dict[str, Any]] | None = Field(
        None, description="Given to the chat template, as /v1/chat/completions does."
    )


# A discriminated union's tag shows in the location of its errors, after "body"; these tags
# are not identifiers, so that they can never be mistaken for a field (the app drops them).
BODY_UNION_TAGS = frozenset({"tokenize-prompt", "tokenize-chat"})


def _tokenize_kind(value: Any) -> str:
    """A body with `messages` is a conversation; anything else is checked as a text."""
    is_chat = (isinstance(value, dict) and "messages" in value) or isinstance(value, TokenizeChatRequest)
    return "tokenize-chat" if is_chat else "tokenize-prompt"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("tokenize-prompt")] | Annotated[TokenizeChatRequest, Tag("tokenize-chat")],
    Discriminator(_tokenize_kind),
]


class TokenizeResponse(BaseModel):
    count: int = Field(description="Number of tokens.")
    max_model_len: int = Field(description="The model's context length, in tokens.")
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="With return_token_strs: each token's vocabulary entry.")


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids back to text (special tokens kept, as vLLM does)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = Field(None, description="The served model's name; default: it.")
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error or server_error")
    param: str | None = Field(None, description="The request field the error is about.")
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every refusal and failure, as OpenAI shapes it."""

    error: ErrorDetail


# what each refusal means, for the OpenAPI description of every route
ERROR_DESCRIPTIONS = {
    400: "Invalid request; `param` names the field.",
    401: "Missing or wrong API key.",
    404: "No such model (`model_not_found`).",
    413: "Body over the size limit.",
    429: "A rate limit of the API key was reached (see `Retry-After`), or the scheduler's queue is full; retry later.",
    503: "The backend is down or the server is draining.",
}


def error_responses(*codes: int, **notes: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route refusing with `codes` (default: all of
    ERROR_DESCRIPTIONS); `notes`: a route's own description of a code (`e404="..."`)."""
    return {
        code: {"model": ErrorResponse, "description": notes.get(f"e{code}", ERROR_DESCRIPTIONS[code])}
        for code in codes or ERROR_DESCRIPTIONS
    }
