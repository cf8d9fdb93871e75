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

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import dashboard, embeddings, responses, streaming, validation
from gateway import openai_format as fmt
from gateway.config import ApiKey, GatewayConfig
from gateway.core import TextGenerator
from gateway.errors import ApiError, body_parse_error, error_body, from_validation_errors, status_for
from gateway.generation import ChoiceDelta, GenerationError, GenerationParams, Usage
from gateway.lora_routes import add_lora_routes, refresh_loras
from gateway.metrics import GatewayMetrics
from gateway.middleware import GatewayMiddleware
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
    _add_openai_routes(app, gw)
    embeddings.add_routes(app, gw)
    responses.add_routes(app, gw)
    _add_vllm_routes(app, gw)
    _add_pagoda_routes(app, gw)
    add_lora_routes(app, gw)
    _add_operations_routes(app, gw)
    _add_debug_routes(app, gw)
    return app


def _add_openai_routes(app: FastAPI, gw: Gateway) -> None:
    """OpenAI's API: the models, completions and chat completions."""

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


def _add_operations_routes(app: FastAPI, gw: Gateway) -> None:
    """What operators and probes ask: health, version and Prometheus metrics."""

    @app.get("/health", tags=["Operations"], responses={503: {"description": "Some part of the chain is not serving."}})
    async def health() -> JSONResponse:
        """Ready only when the scheduler reports every stage and the KV service serving."""
        if gw.draining:
            return JSONResponse({"status": "draining", "detail": "the server is shutting down"}, 503)
        serving, detail = await gw.generator.health()
        if not serving:
            return JSONResponse({"status": "unavailable", "detail": detail}, 503)
        # an emulated stack says so: {"status": "ok", "device": "emulated:PROFILE"}
        return JSONResponse({"status": "ok", "device": detail} if detail else {"status": "ok"})

    @app.get("/version", tags=["Operations"])
    async def version() -> dict[str, str]:
        """The server's version, as vLLM's `/version` reports its own."""
        return {"version": _version()}

    @app.get(
        "/metrics",
        tags=["Operations"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    )
    async def metrics() -> Response:
        """Prometheus text, the one scrape target a dashboard needs (`pagoda:*`, after vLLM's
        `vllm:*`): requests by finish reason, tokens, TTFT, inter-token, per-output-token and
        end-to-end latency as clients see them, and the engine's running and waiting
        requests, KV usage, prefix-cache and preemption counters (read from the scheduler)."""
        try:
            gw.metrics.engine.stats = await gw.generator.stats(timeout_s=1.0)
        except Exception as exc:  # noqa: BLE001 - a scrape never fails: the engine shows as down
            log.debug("metrics: no statistics from the scheduler: %s", exc)
            gw.metrics.engine.stats = None
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_debug_routes(app: FastAPI, gw: Gateway) -> None:
    """What the scheduler and replicas hold, for people: the KV memory, the replicas and
    the live dashboard."""

    @app.get("/debug/memory", tags=["Operations"], responses={401: _ERRORS[401], 503: _ERRORS[503]})
    async def debug_memory(include_sequences: bool = False) -> dict[str, Any]:
        """The KV service's statistics as the scheduler last read them: used, free and
        cached blocks, peak, fragmentation, prefix hits (and per-sequence layouts); each
        stage's memory and the channel its hidden states take to the next stage."""
        try:
            stats = await gw.generator.stats(include_kv_sequences=include_sequences)
        except grpc.aio.AioRpcError as exc:
            raise GenerationError(exc.code(), exc.details() or exc.code().name) from exc
        return {
            "kv_address": stats.kv_address,
            "kv_health": _enum_name(stats.kv_health),
            "kv_cache": _plain(stats.kv_cache),
            "stages": [
                {
                    "stage_index": s.stage_index,
                    "layers": [s.load_info.layer_start, s.load_info.layer_end],
                    "weights_bytes": s.load_info.weights_bytes,
                    "quantization": s.load_info.quantization,
                    "expert_weights_bytes": s.load_info.expert_weights_bytes,
                    "kv_block_bytes": s.load_info.kv_block_bytes,
                    "kv_cache_dtype": _dtype_name(s.load_info.kv_cache_dtype),
                    "memory_budget_bytes": s.load_info.memory_budget_bytes,
                    "kv_groups": s.load_info.kv_groups,
                    "cpu": s.load_info.cpu,
                    # how its hidden states go to the next stage (issue 37): shm, nccl, grpc
                    "data_channel": s.stats.data_channel or s.load_info.data_channel,
                }
                for s in stats.stages
            ],
        }

    @app.get("/debug/replicas", tags=["Operations"], responses={401: _ERRORS[401]})
    async def debug_replicas() -> dict[str, Any]:
        """Router mode (several schedulers): each replica's health, load and the requests
        routed there, the routing policy, and how often it fell back to routing by load."""
        rs = gw.generator.replicas
        if rs is None:
            return {"routing": None, "replicas": [{"name": "r0", "address": gw.generator.scheduler_address}]}
        index = rs.index
        return {
            "routing": rs.policy,
            "replicas": rs.describe(),
            "fallbacks": rs.num_fallbacks,
            "retries": rs.num_retries,
            "index": None
            if index is None
            else {"failing": index.failing, "lookups": index.num_lookups, "failures": index.num_failures},
        }

    @app.get("/dashboard", tags=["Operations"], response_class=HTMLResponse)
    async def dashboard_page() -> HTMLResponse:
        """The live dashboard (docs/metrics.md): one page, no external assets, polling
        /dashboard/state. With API keys on, the page asks for one (or takes `#key=...`)."""
        return HTMLResponse(dashboard.page())

    @app.get("/dashboard/state", tags=["Operations"], responses={401: _ERRORS[401], 503: _ERRORS[503]})
    async def dashboard_state() -> dict[str, Any]:
        """What the dashboard shows, as JSON: requests and queues by tenant and priority,
        the KV block map, the stages' compute spans of the last seconds, token counters."""
        try:
            stats = await gw.generator.stats(include_kv_sequences=True, include_requests=True, include_timeline=True)
        except grpc.aio.AioRpcError as exc:
            raise GenerationError(exc.code(), exc.details() or exc.code().name) from exc
        return dashboard.state(stats, gw.limits.name)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagoda")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


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


def _enum_name(value: int) -> str:
    from services.pb import common_pb2

    return common_pb2.HealthStatus.Name(value)


def _dtype_name(value: int) -> str:
    """A DType as the flags name it ("float32", "bfloat16"); "" when the stage did not say."""
    from services.pb import common_pb2

    name = common_pb2.DType.Name(value) if value in common_pb2.DType.values() else ""
    return {"DTYPE_FLOAT32": "float32", "DTYPE_BFLOAT16": "bfloat16", "DTYPE_FLOAT16": "float16"}.get(name, "")


def _plain(message: Any) -> dict[str, Any]:
    """A protobuf message as JSON-ready values (64-bit integers stay numbers)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.message_type is not None:
            out[fd.name] = [_plain(v) for v in value] if fd.is_repeated else _plain(value)
        elif fd.is_repeated or isinstance(value, bytes):  # bytes: one number per byte
            out[fd.name] = list(value)
        else:
            out[fd.name] = value
    return out


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
