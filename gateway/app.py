"""The REST API: OpenAI-compatible completions and chat (with SSE streaming), `/generate`,
health, metrics and the KV memory monitor, as one FastAPI app over a `TextGenerator`.

    POST /v1/completions        prompt(s) -> text; stream: true for server-sent events
    POST /v1/chat/completions   messages through the model's chat template -> text
    POST /v1/embeddings         inputs -> pooled, normalized vectors (gateway/embeddings.py)
    POST /v1/responses          OpenAI's Responses API over the chat path (gateway/responses.py);
                                GET and DELETE /v1/responses/{id} for stored ones
    GET  /v1/models             the served model
    POST /tokenize              a text, or a conversation through the chat template -> token ids
    POST /detokenize            token ids -> text (vLLM's extras; no scheduler call)
    POST /generate              one prompt -> text, and its timeline as a Chrome trace
    GET  /health                200 only when the scheduler reports the whole chain serving
    GET  /metrics               Prometheus (pagoda:*)
    GET  /debug/memory          the KV service's statistics, through the scheduler
    GET  /dashboard             the live dashboard (a page polling /dashboard/state)
                                (these four and the like: gateway/operations_routes.py)

Bad input is refused (400, naming the field) before anything reaches the scheduler. A
client that goes away mid-request cancels it: the cancellation reaches the scheduler call,
which aborts the request and frees its blocks. With rate limits configured (gateway.ratelimit),
completions, chat and /generate are charged per API key once validated; a refusal is 429
with OpenAI's `rate_limit_exceeded` error and a `Retry-After` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import embeddings, responses, streaming, validation
from gateway import openai_format as fmt
from gateway.config import ApiKey, GatewayConfig
from gateway.core import TextGenerator
from gateway.errors import ApiError, body_parse_error, error_body, from_validation_errors, status_for
from gateway.generation import ChoiceDelta, GenerationError, GenerationParams, Usage
from gateway.lora_routes import add_lora_routes, refresh_loras
from gateway.metrics import GatewayMetrics
from gateway.middleware import GatewayMiddleware
from gateway.operations_routes import add_debug_routes, add_operations_routes
from gateway.protocol import (
    BODY_UNION_TAGS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerateRequest,
    TokenizeRequest,
    TokenizeResponse,
    error_responses,
)
from gateway.ratelimit import ANONYMOUS, RateLimiter, RateLimitExceeded, token_cost
from gateway.timeline import Span, chrome_trace

RETRY_AFTER_S = 1  # what a 429 for a full queue and a 503 tell clients to wait
log = logging.getLogger(__name__)

_ERRORS = error_responses()
_STREAMING = {
    200: {
        "description": "JSON, or server-sent events with `stream: true`.",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


class Gateway:
    """What the routes share. `draining` is set on shutdown: new generation requests get 503
    while those in flight finish. `limiter` is None unless some rate limit is configured."""

    def __init__(
        self, config: GatewayConfig, generator: TextGenerator, rate_limit_clock: Callable[[], float] | None = None
    ) -> None:
        self.config = config
        self.generator = generator
        self.tokenizer = generator.tokenizer
        self.limits = validation.ModelLimits.load(config, self.tokenizer)
        self.metrics = GatewayMetrics(config.model_name, self._lora_info if config.enable_lora else None)
        self.created = int(time.time())
        self.draining = False
        self.limiter: RateLimiter | None = None
        if config.rate_limits_enabled:
            self.limiter = RateLimiter.create(
                config.default_rate_limit, config.redis_url, self.metrics.registry, rate_limit_clock
            )

    def _lora_info(self) -> tuple[int, list[str]]:
        """(the adapters a stage holds at once, those loaded now) for the endpoint picker."""
        return self.config.max_loras, list(self.limits.loras)

    def admit(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica", code="shutting_down")

    async def charge(self, request: Request, prompts: Sequence[Sequence[int]], params: GenerationParams) -> None:
        """The request's rate-limit charge, once validated; RateLimitExceeded when refused."""
        if self.limiter is None:
            return
        tokens = token_cost(map(len, prompts), params.sampling.max_tokens, params.sampling.n, self.limits.max_model_len)
        grant = _api_key(request)
        # the bucket of the key the middleware authenticated (never a header read again here)
        bucket = getattr(request.state, "api_key_id", None) if self.config.api_keys else ANONYMOUS
        await self.limiter.admit(bucket or ANONYMOUS, grant.rate_limit if grant is not None else None, tokens)

    async def generation(
        self, request_id: str, prompts: Sequence[list[int]], params: GenerationParams, traceparent: str
    ) -> AsyncIterator[streaming.Item]:
        """Every prompt's stream merged, with the request's metrics. Closing it (or
        cancelling its consumer) cancels every scheduler call; the metrics then count the
        request as abandoned (`GatewayMetrics.serving`)."""
        usage = Usage()
        with self.metrics.serving(len(prompts) * params.sampling.n, sum(map(len, prompts))) as timer:
            ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
            streams = [
                self.generator.generate(p, params, rid, traceparent) for p, rid in zip(prompts, ids, strict=True)
            ]
            async with contextlib.aclosing(streaming.merged(streams)) as merged:
                async for i, item in merged:
                    if isinstance(item, ChoiceDelta):
                        timer.on_delta((i, item.index), len(item.token_ids), item.finish_reason)
                    else:
                        streaming.add_usage(usage, item.usage)
                    yield i, item
            timer.on_finished(usage.prompt_tokens, usage.completion_tokens)


def _echo_texts(prompt: Any, prompts: Sequence[list[int]], tokenizer: Any) -> list[str]:
    """Each prompt's text for `echo`: as sent when it was text, else its tokens decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]


def _api_key(request: Request) -> ApiKey | None:
    return getattr(request.state, "api_key", None)


SESSION_HEADER = "x-session-id"


def _with_session(params: GenerationParams, body, request: Request) -> GenerationParams:
    """Router mode's session affinity: the x-session-id header, else the body's `user`; and
    the LoRA adapter the body's `model` names."""
    session = request.headers.get(SESSION_HEADER) or body.user or ""
    lora = request.app.state.gateway.limits.lora_name(body.model)
    if session or lora:
        return dataclasses.replace(params, session=session[:256], lora_name=lora)
    return params


def create_app(
    config: GatewayConfig, generator: TextGenerator, rate_limit_clock: Callable[[], float] | None = None
) -> FastAPI:
    """The REST API over `generator`. The app's `state.gateway` is the shared `Gateway`;
    `rate_limit_clock` (seconds) replaces the rate limiter's clock in tests."""
    gw = Gateway(config, generator, rate_limit_clock)
    app = FastAPI(
        title="Pagoda",
        version="0.1.0",
        summary="OpenAI-compatible LLM serving: completions, chat, streaming, health and metrics.",
    )
    app.state.gateway = gw
    app.add_middleware(
        GatewayMiddleware,
        api_keys=config.api_keys,
        max_body_bytes=config.max_body_bytes,
        on_refused=gw.metrics.error,
        metrics_require_key=config.metrics_require_key,
    )
    _add_error_handlers(app, gw)
    _add_model_routes(app, gw)
    _add_completion_routes(app, gw)
    embeddings.add_routes(app, gw)
    responses.add_routes(app, gw)
    _add_vllm_routes(app, gw)
    _add_pagoda_routes(app, gw)
    add_lora_routes(app, gw)
    add_operations_routes(app, gw)
    add_debug_routes(app, gw)
    return app


def _add_model_routes(app: FastAPI, gw: Gateway) -> None:
    """OpenAI's models: the served model under each name it answers to, and the adapters."""

    @app.get("/v1/models", tags=["OpenAI"], responses={401: _ERRORS[401]})
    async def list_models() -> dict[str, Any]:
        """The served model, as OpenAI lists models: one entry per name it answers to."""
        await refresh_loras(gw)  # (the scheduler drops an adapter a restarted stage lost)
        return {"object": "list", "data": [_model_card(gw, name) for name in (*gw.limits.names, *gw.limits.loras)]}

    @app.get(
        "/v1/models/{model:path}",
        tags=["OpenAI"],  # (names may be paths)
        responses={401: _ERRORS[401], 404: {"model": ErrorResponse, "description": "No such model."}},
    )
    async def retrieve_model(model: str) -> dict[str, Any]:
        await refresh_loras(gw)
        if model not in gw.limits.names and model not in gw.limits.loras:
            raise ApiError(404, f"model: the model {model!r} does not exist", "model", "model_not_found")
        return _model_card(gw, model)


def _model_card(gw: Gateway, name: str) -> dict[str, Any]:
    # root: the served name, not where the checkpoint lies on the server's disk; a LoRA
    # adapter's root is its folder (as given to --lora-modules or the load call) and its parent
    # the base model, as vLLM lists them
    card = {
        "id": name,
        "object": "model",
        "created": gw.created,
        "owned_by": "pagoda",
        "root": gw.limits.name,
        "max_model_len": gw.limits.max_model_len,
        # what a request that leaves a sampling field out gets (--generation-config)
        "sampling_defaults": gw.limits.sampling_defaults.to_json(),
    }
    if name in gw.limits.loras:
        card.update(root=gw.limits.loras[name], parent=gw.limits.name)
    return card


def _add_completion_routes(app: FastAPI, gw: Gateway) -> None:
    """OpenAI's completions and chat completions: each request validated and charged, then
    answered as one JSON body or as server-sent events (`_completion_reply`, `_chat_reply`)."""

    @app.post("/v1/completions", tags=["OpenAI"], responses={**_STREAMING, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completions of one or more prompts (strings or token ids); `n` choices each."""
        gw.admit()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        request.state.request_id = request_id
        validation.check_model(body.model, gw.limits)
        prompts = await asyncio.to_thread(validation.completion_prompts, body, gw.tokenizer, gw.limits, gw.config)
        params = _with_session(
            validation.completion_params(body, prompts, gw.limits, gw.config, _api_key(request)), body, request
        )
        await gw.charge(request, prompts, params)
        items = gw.generation(request_id, prompts, params, request.headers.get("traceparent", ""))
        return await _completion_reply(gw, body, request, request_id, prompts, items)

    @app.post("/v1/chat/completions", tags=["OpenAI"], responses={**_STREAMING, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """A conversation's next message, through the model's chat template."""
        gw.admit()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        request.state.request_id = request_id
        validation.check_model(body.model, gw.limits)
        prompt = await asyncio.to_thread(validation.chat_prompt, body, gw.tokenizer, gw.limits)
        params = _with_session(
            validation.chat_params(body, prompt, gw.limits, gw.config, _api_key(request)), body, request
        )
        await gw.charge(request, [prompt], params)
        items = gw.generation(request_id, [prompt], params, request.headers.get("traceparent", ""))
        return await _chat_reply(gw, body, request, request_id, prompt, params, items)


async def _completion_reply(
    gw: Gateway,
    body: CompletionRequest,
    request: Request,
    request_id: str,
    prompts: Sequence[list[int]],
    items: AsyncIterator[streaming.Item],
) -> Response:
    """A completion's answer: its events with `stream`, else its whole body."""
    model, created = gw.limits.served_name(body.model), int(time.time())
    want_logprobs = body.logprobs is not None
    echo_texts = _echo_texts(body.prompt, prompts, gw.tokenizer) if body.echo else None
    if body.stream:
        first = await streaming.first_item(request, items)
        return streaming.EventStream(
            streaming.completion_events(
                request_id,
                created,
                model,
                first,
                items,
                body.n,
                want_logprobs,
                body.return_token_ids,
                body.stream_options,
                sum(map(len, prompts)),
                echo_texts,
                body.logprobs,
            ),
            items,
            request_id,
        )
    choices, usage, _ = await streaming.guarded(request, items, streaming.collect(items, body.n))
    payload = fmt.completion_response(
        request_id,
        created,
        model,
        choices,
        usage,
        want_logprobs,
        prompts if body.return_token_ids else None,
        echo_texts,
        body.prompt_logprobs,
        body.logprobs,
    )
    return JSONResponse(payload, headers={"X-Request-Id": request_id})


async def _chat_reply(
    gw: Gateway,
    body: ChatCompletionRequest,
    request: Request,
    request_id: str,
    prompt: list[int],
    params: GenerationParams,
    items: AsyncIterator[streaming.Item],
) -> Response:
    """A chat completion's answer: its events with `stream`, else its whole body."""
    model, created = gw.limits.served_name(body.model), int(time.time())
    if body.stream:
        first = await streaming.first_item(request, items)
        return streaming.EventStream(
            streaming.chat_events(
                request_id,
                created,
                model,
                first,
                items,
                body.n,
                body.logprobs,
                body.return_token_ids,
                body.stream_options,
                len(prompt),
                params.tool_calling,
                params.reply_parsing,
            ),
            items,
            request_id,
        )
    choices, usage, _ = await streaming.guarded(request, items, streaming.collect(items, body.n))
    payload = fmt.chat_response(
        request_id,
        created,
        model,
        choices,
        usage,
        body.logprobs,
        prompt if body.return_token_ids else None,
        body.prompt_logprobs,
        params.tool_calling,
        params.reply_parsing,
    )
    return JSONResponse(payload, headers={"X-Request-Id": request_id})


def _add_vllm_routes(app: FastAPI, gw: Gateway) -> None:
    """vLLM's extras: tokenize and detokenize (no scheduler call)."""

    @app.post(
        "/tokenize",
        tags=["vLLM"],
        response_model_exclude_none=True,
        responses={k: _ERRORS[k] for k in (400, 401, 404, 413)},
    )
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """A text's token ids as completions would send them (`prompt`), or a conversation's
        as chat completions would (`messages`: the same chat template). No length limit:
        compare `count` with `max_model_len`."""
        validation.check_model(body.model, gw.limits)
        ids = await asyncio.to_thread(validation.tokenize_ids, body, gw.tokenizer)
        token_strs = None
        if body.return_token_strs:
            token_strs = [gw.tokenizer.id_to_token(i) or "" for i in ids]
        return TokenizeResponse(
            count=len(ids), max_model_len=gw.limits.max_model_len, tokens=ids, token_strs=token_strs
        )

    @app.post("/detokenize", tags=["vLLM"], responses={k: _ERRORS[k] for k in (400, 401, 404, 413)})
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids back to text, special tokens included (as vLLM decodes them)."""
        validation.check_model(body.model, gw.limits)
        ids = validation.detokenize_ids(body, gw.limits)
        text = await asyncio.to_thread(gw.tokenizer.decode, ids, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)


def _add_pagoda_routes(app: FastAPI, gw: Gateway) -> None:
    """Pagoda's own: `/generate`, one prompt with its timeline."""

    @app.post("/generate", tags=["Pagoda"], responses={k: v for k, v in _ERRORS.items() if k != 404})
    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        """One prompt, one choice: the text and its token ids, and with `debug_timeline`
        the request's timeline as Chrome trace-event JSON (open it in Perfetto)."""
        start_ns = time.time_ns()
        gw.admit()
        request_id = f"gen-{uuid.uuid4().hex}"
        request.state.request_id = request_id
        prompt = await asyncio.to_thread(validation.generate_prompt, body, gw.tokenizer, gw.limits)
        params = validation.generate_params(body, prompt, gw.limits, _api_key(request))
        await gw.charge(request, [prompt], params)
        tokenized_ns = time.time_ns()
        items = gw.generation(request_id, [prompt], params, request.headers.get("traceparent", ""))
        choices, usage, finished = await streaming.guarded(request, items, streaming.collect(items, 1))
        end_ns = time.time_ns()
        choice = choices[0]
        payload: dict[str, Any] = {
            "id": request_id,
            "model": gw.limits.name,
            "text": choice.text,
            "token_ids": choice.token_ids,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "usage": fmt.usage_body(usage),
        }
        if body.debug_timeline:
            spans = [
                Span("request", start_ns, end_ns, {"prompt_tokens": len(prompt)}),
                Span("tokenize", start_ns, tokenized_ns),
            ]
            timeline = finished[0].timeline if finished else []
            payload["timeline"] = chrome_trace(request_id, timeline, spans)
        return JSONResponse(payload, headers={"X-Request-Id": request_id})


def _without_union_tag(error: dict[str, Any]) -> dict[str, Any]:
    """('body', 'tokenize-chat', 'messages', 0) -> ('body', 'messages', 0): the tag of the
    body's union member is not a field, and the error names the field."""
    loc = tuple(error.get("loc", ()))
    if loc[:1] == ("body",) and len(loc) > 1 and loc[1] in BODY_UNION_TAGS:
        return {**error, "loc": loc[:1] + loc[2:]}
    return error


def _add_error_handlers(app: FastAPI, gw: Gateway) -> None:
    def respond(
        request: Request, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> JSONResponse:
        gw.metrics.error(status)
        headers = dict(headers or {})
        request_id = getattr(request.state, "request_id", None)
        if request_id:
            headers["X-Request-Id"] = request_id
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_without_union_tag(e) for e in exc.errors()]
        err = from_validation_errors(errors, request.headers.get("content-type", ""))
        return respond(request, err.status, err.body())

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(request, exc.status, exc.body())

    @app.exception_handler(RateLimitExceeded)
    async def on_rate_limited(request: Request, exc: RateLimitExceeded) -> JSONResponse:
        retry_after = exc.retry_after_header
        # a request larger than its bucket never fits: tell clients (the openai SDK reads
        # x-should-retry) not to retry it
        headers = {"Retry-After": retry_after} if retry_after else {"x-should-retry": "false"}
        return respond(request, 429, error_body(429, exc.message, None, "rate_limit_exceeded"), headers)

    @app.exception_handler(GenerationError)
    async def on_generation_error(request: Request, exc: GenerationError) -> JSONResponse:
        status = status_for(exc.code)
        request_id = getattr(request.state, "request_id", "-")
        if status >= 500:
            log.error("request %s: scheduler %s: %s", request_id, exc.code.name, exc.message)
        message = exc.message if status != 500 else f"internal error (request {request_id})"
        # a full queue (429) or a pipeline recovering (503): come back shortly, as clients
        # (the openai SDK among them) retry when told
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
        return respond(request, status, error_body(status, message, None, exc.code.name.lower()), headers)

    @app.exception_handler(streaming.ClientGone)
    async def on_client_gone(request: Request, exc: streaming.ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's "error parsing the body" keeps why in its cause: say it, naming the body
        unparsed = body_parse_error(exc.__cause__) if exc.status_code == 400 else None
        if unparsed is not None:
            return respond(request, unparsed.status, unparsed.body())
        return respond(request, exc.status_code, error_body(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", "-")
        log.exception("request %s: unexpected error", request_id)
        return respond(request, 500, error_body(500, f"internal error (request {request_id})", None, "internal_error"))
