"""From a parsed request body to what the scheduler is asked: prompts as token ids and
`GenerationParams` (for /tokenize and /detokenize, the ids themselves), or an `ApiError`
(400) naming the field.

Pure and synchronous: the model's limits (`ModelLimits`), the configuration and the
tokenizer in, values out. Everything a request can get wrong is caught here, so that bad
input never reaches the scheduler.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gateway.chat_parsing import ReplyParsing
from gateway.config import ApiKey, GatewayConfig
from gateway.errors import ApiError, invalid
from gateway.generation import GenerationParams
from gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    ResponseFormat,
    StructuredOutputs,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    _OpenAIFields,
    _SamplingFields,
)
from gateway.tools import chooses_auto, declared_tools, tool_calling
from services import grammar
from services import settings as shared
from services.admission import AdmissionError, Limits, admit
from services.generation_config import SamplingDefaults, sampling_defaults
from services.sampling import SamplingOptions, StructuredOutput
from services.text import Tokenizer

UINT64 = 2**64
# encode_chat's own arguments: a request's chat_template_kwargs may not set them
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "tools",
        "documents",
        "chat_template",
        "add_special_tokens",
        "continue_final_message",
        "tokenize",
    }
)


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served name, the context length, and the
    model's vocabulary (its embedding rows, which may exceed the tokenizer's)."""

    name: str  # the served name responses report
    max_model_len: int
    vocab_size: int
    names: tuple[str, ...] = ()  # every name a request may use (default: `name`)
    # multi-LoRA: adapter name -> its folder, loaded on the stages (--lora-modules, and those
    # loaded at run time); a request's `model` may name one
    loras: dict[str, str] = field(default_factory=dict)
    # the sampling of the fields a request leaves out (--generation-config)
    sampling_defaults: SamplingDefaults = SamplingDefaults()

    def lora_name(self, requested: str | None) -> str:
        """The adapter a request runs under: its `model` when that names one, else ""."""
        return requested if requested is not None and requested in self.loras else ""

    def served_name(self, requested: str | None) -> str:
        """The `model` a response reports: the adapter's name when the request named one (as
        vLLM reports it), else the base model's served name."""
        return self.lora_name(requested) or self.name

    def __post_init__(self) -> None:
        if not self.names:
            object.__setattr__(self, "names", (self.name,))

    @classmethod
    def load(cls, config: GatewayConfig, tokenizer: Tokenizer) -> ModelLimits:
        vocab_size = tokenizer.vocab_size
        try:
            model_config = json.loads((Path(config.model) / "config.json").read_text())
            vocab_size = max(vocab_size, int(model_config.get("vocab_size") or 0))
        except (OSError, ValueError, TypeError):
            pass  # a tokenizer-only directory: the tokenizer's vocabulary is the bound
        defaults = sampling_defaults(config.model, config.generation_config, config.override_generation_config)
        return cls(
            config.model_name,
            config.max_model_len,
            vocab_size,
            config.model_names,
            dict(shared.lora_modules(config.lora_modules)),
            defaults,
        )


def check_model(requested: str | None, limits: ModelLimits) -> None:
    """A model this server does not serve is 404 `model_not_found`, as OpenAI and vLLM
    answer it (the openai SDK raises NotFoundError)."""
    if requested is not None and requested not in limits.names and requested not in limits.loras:
        served = " or ".join(repr(n) for n in (*limits.names, *limits.loras))
        raise ApiError(
            404,
            f"model: the model {requested!r} does not exist; this server serves {served} (see GET /v1/models)",
            "model",
            "model_not_found",
        )


# --- prompts -----------------------------------------------------------------------------


def completion_prompts(
    req: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits, config: GatewayConfig
) -> list[list[int]]:
    """Each prompt of a completions request as token ids (a string is tokenized with the
    model's special tokens, as vLLM and transformers do)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt)]
    elif all(isinstance(x, str) for x in prompt):
        prompts = [tokenizer.encode(x) for x in prompt]
    elif all(isinstance(x, int) for x in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(x) for x in prompt]
    if len(prompts) > config.max_num_prompts:
        raise invalid("prompt", f"at most {config.max_num_prompts} prompts per request, got {len(prompts)}")
    for i, ids in enumerate(prompts):
        check_prompt_ids(ids, limits, "prompt", i if len(prompts) > 1 else None)
    return prompts


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, limits: ModelLimits) -> list[int]:
    """The conversation through the model's chat template, as token ids."""
    ids = _chat_ids(
        req.messages,
        req.add_generation_prompt,
        req.chat_template_kwargs,
        tokenizer,
        tools=req.tools,
        continue_final_message=req.continue_final_message,
    )
    check_prompt_ids(ids, limits, "messages")
    return ids


def _chat_ids(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
    tokenizer: Tokenizer,
    add_special_tokens: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """What chat completions and /tokenize share: each message as the template sees it, the
    template applied."""
    if continue_final_message and add_generation_prompt:
        raise invalid(
            "continue_final_message",
            "not with add_generation_prompt: true (the model "
            "continues the last message instead of starting a "
            "new one); send add_generation_prompt: false",
        )
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise invalid("chat_template_kwargs", f"may not set {', '.join(reserved)}")
    try:
        as_parts = tokenizer.chat_template_reads_content_parts(tools or None)
        plain_messages = [_template_message(i, message, as_parts) for i, message in enumerate(messages)]
        return tokenizer.encode_chat(
            plain_messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
            add_special_tokens=add_special_tokens,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except ValueError as exc:  # ChatTemplateError: no template, or the template refused
        raise invalid("messages", str(exc)) from exc


def _template_message(i: int, message: ChatMessage, as_parts: bool) -> dict[str, Any]:
    """A message as vLLM hands it to the chat template: text parts as a list of
    `{"type": "text", "text": ...}` for a template that loops over them (`as_parts`, vLLM's
    "openai" content format), else joined by newlines ("string"); a null or missing content ""
    (templates concatenate it: `'...' + message['content']`), an assistant's `tool_calls` with
    each call's arguments as an object, a tool message's `tool_call_id`."""
    plain = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for j, part in enumerate(message.content):
            if part.type != "text":
                raise invalid(f"messages[{i}].content[{j}]", f"only text parts are supported, got type {part.type!r}")
            if not isinstance(part.text, str):
                raise invalid(
                    f"messages[{i}].content[{j}].text", 'a text part needs its text: {"type": "text", "text": "..."}'
                )
            texts.append(part.text)
        plain["content"] = [{"type": "text", "text": text} for text in texts] if as_parts else "\n".join(texts)
    plain.setdefault("content", "")
    if message.tool_calls is not None:
        plain["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    return plain


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call with its `arguments` (OpenAI's JSON text) as the object they
    encode, as vLLM passes them and templates expect (`arguments | tojson`); none is {}. Text
    that is not a JSON object is left as sent."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return call
        if not isinstance(arguments, dict):
            return call
    elif not arguments:
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def generate_prompt(req: GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits) -> list[int]:
    ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    check_prompt_ids(ids, limits, "prompt")
    return ids


def check_prompt_ids(ids: Sequence[int], limits: ModelLimits, param: str, index: int | None = None) -> None:
    where = param if index is None else f"{param}[{index}]"
    if not ids:
        raise invalid(param, f"{'the prompt' if index is None else where} is empty after tokenization")
    too_big = max(ids)
    if too_big >= limits.vocab_size:
        raise invalid(param, f"token id {too_big} is outside the vocabulary of {limits.vocab_size} tokens")
    if len(ids) >= limits.max_model_len:
        raise invalid(
            param,
            f"this model's maximum context length is {limits.max_model_len} "
            f"tokens, but {'the prompt' if index is None else where} has "
            f"{len(ids)} (at least one token must be left to generate)",
            "context_length_exceeded",
        )


def tokenize_ids(req: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer) -> list[int]:
    """`/tokenize`: a text as completions encode it, or a conversation as chat completions
    render and encode it. Not bounded by the context length: the count is the answer."""
    if isinstance(req, TokenizeCompletionRequest):
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    if req.chat_template is not None:
        raise invalid("chat_template", "not supported: the model's own template is used")
    if req.tools:
        declared_tools(req.tools)
    return _chat_ids(
        req.messages,
        req.add_generation_prompt,
        req.chat_template_kwargs,
        tokenizer,
        req.add_special_tokens,
        req.tools,
        req.continue_final_message,
    )


def detokenize_ids(req: DetokenizeRequest, limits: ModelLimits) -> list[int]:
    """`/detokenize`'s ids, each inside the model's vocabulary."""
    ids = list(req.tokens)
    if ids and max(ids) >= limits.vocab_size:
        raise invalid("tokens", f"token id {max(ids)} is outside the vocabulary of {limits.vocab_size} tokens")
    return ids


# --- sampling ----------------------------------------------------------------------------


def _logit_bias(value: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as strings) -> (id, bias) pairs, which `SamplingOptions`
    bounds and the admission check holds to the vocabulary."""
    pairs = []
    for key, bias in (value or {}).items():
        try:
            pairs.append((int(key), bias))
        except ValueError:
            raise invalid("logit_bias", f"keys must be token ids, got {key!r}") from None
    return tuple(pairs)


GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")
_Found = list[tuple[str, StructuredOutput]]  # (the field that set it, what it set), in field order


def structured_output(req: _OpenAIFields) -> StructuredOutput | None:
    """The request's structured output, from whichever of OpenAI's and vLLM's spellings it
    used (at most one), compiled once to check it: a 400 naming the field otherwise."""
    found = [
        *_from_response_format(req.response_format),
        *_from_structured_outputs(req.structured_outputs),
        *_from_guided(req),
    ]
    backend = req.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise invalid(
            "guided_decoding_backend",
            f"{backend!r} is not available; Pagoda's structured "
            f"output runs on llguidance ({', '.join(GRAMMAR_BACKENDS)})",
        )
    if len(found) > 1:
        raise invalid(found[1][0], f"only one structured output per request; {found[0][0]} is set too")
    if not found:
        return None
    param, spec = found[0]
    try:
        grammar.check(spec)
    except grammar.GrammarError as exc:
        raise invalid(param, str(exc)) from None
    return spec


def _spec(param: str, kind: str, spec: Any = "", choices: Any = ()) -> tuple[str, StructuredOutput]:
    """One field's structured output, as `StructuredOutput` checks it: a 400 naming `param`
    otherwise. A JSON schema given as an object is sent as its JSON text."""
    if kind == "json_schema" and isinstance(spec, dict):
        spec = json.dumps(spec)
    try:
        return param, StructuredOutput(kind, spec, tuple(choices))
    except ValueError as exc:
        raise invalid(param, str(exc).partition(": ")[2]) from None


def _from_response_format(rf: ResponseFormat | None) -> _Found:
    """OpenAI's spelling: `response_format` (type text: none)."""
    if rf is None or rf.type == "text":
        return []
    if rf.type == "json_object":
        if rf.json_schema is not None:
            raise invalid("response_format.json_schema", "only with type json_schema")
        return [_spec("response_format", "json_object")]
    if rf.json_schema is None:
        raise invalid("response_format.json_schema", "type json_schema needs json_schema.schema")
    return [_spec("response_format.json_schema.schema", "json_schema", rf.json_schema.schema_)]


def _from_structured_outputs(so: StructuredOutputs | None) -> _Found:
    """vLLM's spelling: `structured_outputs.{json, regex, choice, grammar, json_object}`."""
    if so is None:
        return []
    found: _Found = []
    for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar)):
        if value is not None:
            kind = {"json": "json_schema"}.get(name, name)
            if name == "choice":
                found.append(_spec(f"structured_outputs.{name}", kind, choices=value))
            else:
                found.append(_spec(f"structured_outputs.{name}", kind, value))
    if so.json_object:
        found.append(_spec("structured_outputs.json_object", "json_object"))
    return found


def _from_guided(req: _OpenAIFields) -> _Found:
    """vLLM's older spelling: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`."""
    found: _Found = []
    if req.guided_json is not None:
        found.append(_spec("guided_json", "json_schema", req.guided_json))
    if req.guided_regex is not None:
        found.append(_spec("guided_regex", "regex", req.guided_regex))
    if req.guided_choice is not None:
        found.append(_spec("guided_choice", "choice", choices=req.guided_choice))
    if req.guided_grammar is not None:
        found.append(_spec("guided_grammar", "grammar", req.guided_grammar))
    return found


def _refuse_unsupported(req: _SamplingFields) -> None:
    if isinstance(req, _OpenAIFields):
        if req.prompt_logprobs is not None and req.stream:
            raise invalid("prompt_logprobs", "not available with stream: true")
        if req.stream_options is not None and not req.stream:
            raise invalid("stream_options", "only allowed with stream: true")


def _admit(
    options: SamplingOptions,
    prompts: Sequence[Sequence[int]],
    limits: ModelLimits,
    config: GatewayConfig | None,
    names: dict[str, str],
) -> None:
    """The one admission check (`services.admission`): max_tokens within the context the
    longest prompt leaves, n and logprobs within the configuration (`config`; None: the
    endpoint has neither), token ids in the vocabulary. A 400 naming the field as the
    endpoint spells it (`names`: a `SamplingOptions` field -> its parameter)."""
    bounds = Limits(
        limits.max_model_len,
        limits.vocab_size,
        config.max_n if config else None,
        config.max_logprobs if config else None,
    )
    try:
        admit(options, bounds, max(len(p) for p in prompts))
    except AdmissionError as exc:
        raise invalid(
            names.get(exc.field, exc.field), exc.reason, "context_length_exceeded" if exc.context_length else None
        ) from None


def _sampling(
    req: _SamplingFields,
    prompts: Sequence[Sequence[int]],
    limits: ModelLimits,
    config: GatewayConfig | None,
    key: ApiKey | None,
    names: dict[str, str] | None = None,
    **sampling: Any,
) -> GenerationParams:
    """The request's sampling as the one type every layer shares (`SamplingOptions`, which
    checks each value and names the field), admitted (`_admit`), plus what only the gateway
    acts on; `sampling` sets the fields each endpoint spells its own way (max_tokens, n,
    logprobs, prompt_logprobs, structured), `names` how it names them."""
    names = names or {}
    _refuse_unsupported(req)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise invalid("stop", "stop strings must not be empty")
    # An API key's priority class is a floor: a request may lower its own urgency (a larger
    # number), never raise it above what its key grants.
    priority = req.priority if key is None else max(req.priority, key.priority)
    # a field the request leaves out takes the model's default (--generation-config), else off
    default = limits.sampling_defaults
    try:
        options = SamplingOptions(
            temperature=_first(req.temperature, default.temperature, 1.0),
            top_p=_first(req.top_p, default.top_p, 1.0),
            top_k=max(0, _first(req.top_k, default.top_k, 0)),  # (a request's -1 is off)
            min_p=_first(req.min_p, default.min_p, 0.0),
            seed=None if req.seed is None else req.seed % UINT64,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_first(req.repetition_penalty, default.repetition_penalty, 1.0),
            logit_bias=_logit_bias(req.logit_bias),
            **sampling,
        )
    except ValueError as exc:
        field, _, why = str(exc).partition(": ")
        raise invalid(names.get(field, field), why) from None
    _admit(options, prompts, limits, config, names)
    return GenerationParams(
        sampling=options,
        stop=stop,
        priority=priority,
        tenant=key.tenant if key is not None else "",
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    return next(v for v in values if v is not None)


def completion_params(
    req: CompletionRequest,
    prompts: Sequence[Sequence[int]],
    limits: ModelLimits,
    config: GatewayConfig,
    key: ApiKey | None = None,
) -> GenerationParams:
    if req.suffix:
        raise invalid("suffix", "not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise invalid("best_of", "not supported (only best_of == n)")
    # echo with logprobs reports the prompt's tokens too: scored with as many alternatives
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    if req.max_tokens == 0:  # the prompt only: one token is computed after it, not returned
        if req.min_tokens:
            raise invalid("min_tokens", "must be 0 with max_tokens 0")
        params = _sampling(
            req,
            prompts,
            limits,
            config,
            key,
            max_tokens=1,
            n=req.n,
            logprobs=req.logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        return replace(params, prompt_only=True)
    return _sampling(
        req,
        prompts,
        limits,
        config,
        key,
        max_tokens=req.max_tokens,
        n=req.n,
        logprobs=req.logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured_output(req),
    )


def chat_params(
    req: ChatCompletionRequest,
    prompt: Sequence[int],
    limits: ModelLimits,
    config: GatewayConfig,
    key: ApiKey | None = None,
) -> GenerationParams:
    if req.echo:
        raise invalid("echo", "echoing the prompt is not supported; leave echo false")
    calling, tool_output = tool_calling(
        req.tools, req.tool_choice, req.parallel_tool_calls, auto=config.enable_auto_tool_choice
    )
    structured = structured_output(req)
    if tool_output is not None and structured is not None:
        raise invalid(
            "tool_choice", "a tool call is already structured output; drop response_format and the guided_* fields"
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    if (
        req.max_completion_tokens is not None
        and req.max_tokens is not None
        and req.max_completion_tokens != req.max_tokens
    ):
        raise invalid(
            "max_completion_tokens",
            f"{req.max_completion_tokens} differs from "
            f"max_tokens={req.max_tokens}, its deprecated name; "
            "send only max_completion_tokens",
        )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling(
        req,
        [prompt],
        limits,
        config,
        key,
        {"max_tokens": param, "logprobs": "top_logprobs"},
        max_tokens=max_tokens,
        n=req.n,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        structured=structured or tool_output,
    )
    return replace(
        params,
        tool_calling=calling,
        reply_parsing=_reply_parsing(req, config, constrained=bool(structured or tool_output)),
    )


def _reply_parsing(req: ChatCompletionRequest, config: GatewayConfig, constrained: bool) -> ReplyParsing | None:
    """How the server's parsers read this request's replies (None: not at all): for tool
    calls when the model chooses ("auto", with --enable-auto-tool-choice), for reasoning with
    --reasoning-parser unless the output is constrained (a grammar holds it from its first
    token: it has no thinking part to split off)."""
    tools = (
        config.tool_call_parser if config.enable_auto_tool_choice and chooses_auto(req.tools, req.tool_choice) else None
    )
    reasoning = None if constrained else config.reasoning_parser
    if tools is None and reasoning is None:
        return None
    return ReplyParsing(tools, reasoning, req.parallel_tool_calls, req.include_reasoning)


def generate_params(
    req: GenerateRequest, prompt: Sequence[int], limits: ModelLimits, key: ApiKey | None = None
) -> GenerationParams:
    params = _sampling(req, [prompt], limits, None, key, max_tokens=req.max_tokens)
    return replace(params, debug_timeline=req.debug_timeline)
