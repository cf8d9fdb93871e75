"""`/v1/responses`: OpenAI's Responses API over the chat route's own path.

A request is converted into the chat completions request it means (`chat_request`): `input`
(a string, or a list of messages and `function_call` / `function_call_output` items) and
`instructions` (a system message first) into `messages`; the flat function tools into chat's
nested ones; `tool_choice`; `text.format` into `response_format`; `max_output_tokens` into
`max_completion_tokens`. That request then takes the chat route's steps: validation
(`gateway.validation`: the chat template, structured output, tool calling with
`--enable-auto-tool-choice --tool-call-parser`, `--reasoning-parser`), generation, and the
reading of the reply (`openai_format.chat_response`, `streaming.chat_chunks`), whose result
is converted back (`gateway/responses_output.py`). An error about a chat field names the
Responses field it came from (`messages` -> `input`, `response_format` -> `text.format`).

`store` (the default) keeps a response in this gateway's memory (`ResponseStore`: the last
`MAX_STORED_RESPONSES`, least recently used out, per API key) so that a later request can
continue it with `previous_response_id` (its input and output come before the new input;
its instructions do not, as OpenAI has it) and `GET /v1/responses/{id}` can read it back.
An unknown or evicted id is a 400 naming `previous_response_id`.

Fields whose meaning Pagoda cannot honour (`background`, built-in tools, `reasoning`,
`include`, `truncation: "auto"`, ...) are a 400 naming them, never ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway import openai_format as fmt
from gateway import responses_output as out
from gateway import streaming, validation
from gateway.errors import ApiError, from_validation_errors, invalid
from gateway.protocol import (
    ChatCompletionRequest,
    StreamOptions,
    StructuredOutputs,
    _SamplingFields,
    check_text,
    error_responses,
)

MAX_STORED_RESPONSES = 256
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512  # characters, as OpenAI's API bounds them
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
_ERRORS = error_responses(400, 401, 404, 429, 503, e404="No such model, or no such stored response.")


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = Field(None, description="Refused: not supported.")


class ResponsesRequest(_SamplingFields):
    """`POST /v1/responses`, as OpenAI's API has it, with vLLM's sampling and structured
    output extras (`top_k`, `guided_choice`, ...). Fields declared "Refused" are a 400 when set."""

    model: str | None = Field(None, description="The served model's name; default: it.")
    input: str | list[dict[str, Any]] = Field(
        description="A string (one user message), or a list of messages (role user, system, "
        "developer or assistant; content a string or `input_text` parts), `function_call` and "
        "`function_call_output` items."
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    tools: list[dict[str, Any]] | None = Field(
        None, description='Function tools, flat: {"type": "function", "name", "description", "parameters", "strict"}.'
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="'none', 'auto' (the default with tools; needs the server's "
        '--enable-auto-tool-choice), \'required\', or {"type": "function", "name": ...}.',
    )
    parallel_tool_calls: bool = True
    text: TextConfig | None = Field(None, description="`format`: text, json_object or json_schema.")
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    store: bool = Field(
        True,
        description=f"Keep the response (in memory, the last {MAX_STORED_RESPONSES}) for previous_response_id and GET.",
    )
    previous_response_id: str | None = Field(None, description="Continue a stored response.")
    metadata: dict[str, str] | None = Field(
        None,
        max_length=16,
        description=f"Returned as sent: keys of at most {MAX_METADATA_KEY} characters, values "
        f"of at most {MAX_METADATA_VALUE}, as OpenAI's API bounds them.",
    )
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored: prefixes are cached automatically.")
    service_tier: Literal["auto", "default"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # structured output, vLLM's spellings (docs/structured-output.md)
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI's, not supported
    background: bool | None = Field(None, description="Refused when true.")
    conversation: Any = Field(None, description="Refused: not supported.")
    prompt: Any = Field(None, description="Refused: not supported.")
    include: list[str] | None = Field(None, description="Refused when not empty.")
    reasoning: Any = Field(None, description="Refused: not supported.")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="'auto' refused.")
    top_logprobs: int | None = Field(None, description="Refused: not supported.")
    max_tool_calls: int | None = Field(None, description="Refused: not supported.")

    check_unicode = field_validator("input", "instructions")(check_text)

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(
                    f"a key may have at most {MAX_METADATA_KEY} characters, got {len(key)} ({key[:16]!r}...)"
                )
            if len(text) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"a value may have at most {MAX_METADATA_VALUE} characters, got {len(text)} (key {key!r})"
                )
        return value


_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("background", lambda v: bool(v), "background responses are not supported; send background: false"),
    ("conversation", lambda v: v is not None, "conversations are not supported; use previous_response_id"),
    ("prompt", lambda v: v is not None, "prompt templates are not supported; send input"),
    ("include", lambda v: bool(v), "no extra output can be included"),
    (
        "reasoning",
        lambda v: v is not None,
        "reasoning options are not supported: a reasoning model "
        "thinks as its template makes it (--reasoning-parser "
        "returns its thoughts)",
    ),
    ("truncation", lambda v: v == "auto", "'auto' is not supported: an input longer than the context is refused"),
    ("top_logprobs", lambda v: v is not None, "log-probabilities are not supported here; use /v1/chat/completions"),
    ("max_tool_calls", lambda v: v is not None, "not supported"),
)


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming the first field set that Pagoda cannot honour."""
    for name, is_set, why in _UNSUPPORTED:
        if is_set(getattr(body, name)):
            raise invalid(name, why)
    if body.text is not None and body.text.verbosity is not None:
        raise invalid("text.verbosity", "not supported")


# --- input -> chat messages ------------------------------------------------------------


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(where, f"must be a string, got {type(value).__name__}")
    try:
        return check_text(value)
    except ValueError as exc:
        raise invalid(where, str(exc)) from None


def _content(where: str, content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return _text(where, content)
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            continue
        if kind not in _TEXT_PARTS:
            raise invalid(f"{where}[{j}].type", f"only text parts (input_text) are supported, got {kind!r}")
        texts.append(_text(f"{where}[{j}].text", part.get("text")))
    return "\n".join(texts)


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
    return {"role": _ROLES[role], "content": _content(f"{where}.content", item.get("content"))}


def _call(where: str, item: dict[str, Any]) -> dict[str, Any]:
    """A `function_call` item as a chat tool call."""
    call_id, name = _text(f"{where}.call_id", item.get("call_id")), _text(f"{where}.name", item.get("name"))
    arguments = _text(f"{where}.arguments", item.get("arguments", ""))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(value: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Responses input as chat messages: a string is a user message; a `function_call` joins
    the assistant message before it (or starts one); a `function_call_output` is a tool
    message; a `reasoning` item (a model's earlier thoughts) is not rendered back, as chat
    templates drop them. A 400 naming the item otherwise."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(where, item))
        elif kind == "function_call":
            call = _call(where, item)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _text(f"{where}.call_id", item.get("call_id")),
                    "content": _content(f"{where}.output", item.get("output")),
                }
            )
        elif kind != "reasoning":
            raise invalid(
                f"{where}.type",
                f"{kind!r} items are not supported: send messages, function_call and function_call_output items",
            )
    return messages


# --- tools and formats -> chat's ----------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's (`{"type": "function", "function": {...}}`)."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise invalid(
                f"tools[{i}].type",
                f"{kind!r} tools are not supported: only function tools "
                "(built-in tools such as web_search run on OpenAI's servers)",
            )
        for key in tool:
            if key not in _TOOL_KEYS:
                raise invalid(
                    f"tools[{i}].{key}",
                    "not a field of a function tool (Responses' tools "
                    "are flat: type, name, description, parameters, strict)",
                )
        converted.append(
            {"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS[1:] if tool.get(k) is not None}}
        )
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`{"type": "function", "name": N}` as chat's named choice; strings as they are."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid(
        "tool_choice",
        "must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        '"name": ...} (built-in tools and allowed_tools are not supported)',
    )


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    spec = text.format if text is not None else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        for name in ("name", "schema_", "description"):
            if getattr(spec, name) is not None:
                raise invalid(f"text.format.{name.rstrip('_')}", "only with type json_schema")
        return {"type": "json_object"}
    if spec.schema_ is None:
        raise invalid("text.format.schema", "type json_schema needs its schema")
    schema = {
        "name": spec.name or "response",
        "schema": spec.schema_,
        "description": spec.description,
        "strict": spec.strict,
    }
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


_SAMPLING = tuple(_SamplingFields.model_fields)
_STRUCTURED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "chat_template_kwargs",
)


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completions request that `body` (after `history`, the messages of the
    response it continues) means."""
    messages = [*history, *input_messages(body.input)]
    if not messages:
        raise invalid("input", "no messages: send at least one (or a previous_response_id)")
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields = {
        **body.model_dump(include={*_SAMPLING, *_STRUCTURED}, exclude_none=True, by_alias=True),
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text),
        "user": body.user,
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # what the chat request checks beyond ours
        raise renamed(from_validation_errors(exc.errors())) from None


# --- chat's errors as the Responses fields -------------------------------------------------

_RENAMES = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
)
_TOOL_FIELD = re.compile(r"^(tools\[\d+\])\.function\.")


def response_param(param: str | None) -> str | None:
    """A chat request's field as the Responses request names it ("messages[2].content" ->
    "input": the indices differ once instructions and calls are merged)."""
    if param is None:
        return None
    if _TOOL_FIELD.match(param):
        return _TOOL_FIELD.sub(r"\1.", param)
    for old, new in _RENAMES:
        if param == old or param.startswith(old + "."):
            return new + param[len(old) :]
        if param.startswith(old + "["):
            return new
    return param


def renamed(exc: ApiError) -> ApiError:
    """`exc` naming the Responses field instead of the chat field."""
    param = response_param(exc.param)
    if param == exc.param:
        return exc
    message = exc.message
    if exc.param is not None and message.startswith(exc.param + ":"):
        message = param + message[len(exc.param) :]
    return ApiError(exc.status, message, param, exc.code)


@contextlib.contextmanager
def _responses_params() -> Iterator[None]:
    try:
        yield
    except ApiError as exc:
        raise renamed(exc) from None


# --- the store -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    """A finished response, whose `messages` (its input, history included, and its output, as
    chat messages; not its instructions) a later request continues; `owner`: the API key's id."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    owner: str | None


class ResponseStore:
    """The last `capacity` stored responses, least recently used out. Owned by the event loop
    of the app that made it (no locks: every call runs on that loop). A response is found
    only by the API key that made it (`owner`; None when keys are off)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        response_id = entry.response["id"]
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._entries[response_id]
        return True


def _history(store: ResponseStore, previous_id: str | None, owner: str | None) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    entry = store.get(previous_id, owner)
    if entry is None:
        raise invalid(
            "previous_response_id",
            f"no stored response {previous_id!r}: responses are "
            f"kept in this server's memory (the last {store.capacity}, with store: true), "
            "so it is unknown, expired, or was not stored; send the whole input instead",
        )
    return entry.messages


def _stored(
    store: ResponseStore, body: ResponsesRequest, messages: list[dict[str, Any]], owner: str | None
) -> Callable[[dict[str, Any]], None]:
    """What keeps a finished response (nothing unless `store`)."""

    def keep(response: dict[str, Any]) -> None:
        if body.store:
            conversation = messages[1:] if body.instructions is not None else messages
            store.put(StoredResponse(response, [*conversation, *input_messages(response["output"])], owner))

    return keep


# --- the routes ----------------------------------------------------------------------------


def _owner(request: Request) -> str | None:
    return getattr(request.state, "api_key_id", None)


async def _create(gw: Any, store: ResponseStore, body: ResponsesRequest, request: Request) -> Any:
    gw.admit()
    response_id = f"resp_{uuid.uuid4().hex}"
    request.state.request_id = response_id
    validation.check_model(body.model, gw.limits)
    refuse_unsupported(body)
    owner, key = _owner(request), getattr(request.state, "api_key", None)
    with _responses_params():
        chat = chat_request(body, _history(store, body.previous_response_id, owner))
        prompt = await asyncio.to_thread(validation.chat_prompt, chat, gw.tokenizer, gw.limits)
        params = validation.chat_params(chat, prompt, gw.limits, gw.config, key)
    session = (request.headers.get("x-session-id") or body.user or "")[:256]
    params = dataclasses.replace(params, session=session, lora_name=gw.limits.lora_name(body.model))
    model = gw.limits.served_name(body.model)  # an adapter's name, as chat reports it
    await gw.charge(request, [prompt], params)
    items = gw.generation(response_id, [prompt], params, request.headers.get("traceparent", ""))
    head = out.response_head(response_id, model, body.model_dump(by_alias=True))
    keep = _stored(store, body, [m.model_dump(exclude_none=True) for m in chat.messages], owner)
    if body.stream:
        first = await streaming.first_item(request, items)
        chunks = streaming.chat_chunks(
            response_id,
            head["created_at"],
            model,
            first,
            items,
            1,
            False,
            False,
            StreamOptions(include_usage=True),
            len(prompt),
            params.tool_calling,
            params.reply_parsing,
        )
        return streaming.EventStream(out.response_events(head, chunks, keep), items, response_id)
    choices, usage, _ = await streaming.guarded(request, items, streaming.collect(items, 1))
    chat_body = fmt.chat_response(
        response_id,
        head["created_at"],
        model,
        choices,
        usage,
        False,
        None,
        None,
        params.tool_calling,
        params.reply_parsing,
    )
    response = out.whole_response(head, chat_body)
    keep(response)
    return JSONResponse(response, headers={"X-Request-Id": response_id})


def add_routes(app: FastAPI, gw: Any) -> ResponseStore:
    """`/v1/responses` on the REST app (`gw`: its `gateway.app.Gateway`); the store it keeps."""
    store = ResponseStore()
    streamed = {
        200: {
            "description": "A response, or server-sent Responses events with `stream: true`.",
            "content": {"application/json": {}, "text/event-stream": {}},
        }
    }

    @app.post("/v1/responses", tags=["OpenAI"], responses={**streamed, **_ERRORS})
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        """A model response to `input` (and `instructions`), through the chat template; with
        tools, structured output (`text.format`) and streaming as OpenAI's Responses API."""
        return await _create(gw, store, body, request)

    @app.get("/v1/responses/{response_id}", tags=["OpenAI"], responses=_ERRORS)
    async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
        """A stored response (this server keeps the last few hundred, in memory)."""
        entry = store.get(response_id, _owner(request))
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @app.delete("/v1/responses/{response_id}", tags=["OpenAI"], responses=_ERRORS)
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        """Forget a stored response."""
        if not store.delete(response_id, _owner(request)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return store


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"response_id: no stored response {response_id!r} (unknown, expired, or not stored)",
        "response_id",
        "not_found",
    )
