"""`POST /v1/embeddings`: OpenAI's embeddings, from the served decoder checkpoint.

Each input is tokenized (a string, with the model's special tokens) or taken as token ids,
and sent to the scheduler as one pooling request (`GenerateRequest.pooling`,
`services.pooling`): a prefill-only request, batched through the same scheduler, KV blocks
and stages as generation, whose last stage pools the final hidden states (after the model's
final norm: `--pooling-type` LAST, the last token's, or MEAN, the mean over every token) and
L2-normalizes the result, as vLLM's pooling runner does. The inputs of one request run
concurrently; a client that goes away (or one input's failure) cancels every scheduler call,
which aborts the requests and frees their blocks.

Bad input is a 400 naming the field: `input` (empty, outside the vocabulary, longer than
max_model_len), `dimensions` (the model has no Matryoshka representation to shorten),
`encoding_format`, any unknown field; a model this server does not serve is a 404.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway import streaming, validation
from gateway.core import TextGenerator
from gateway.errors import ApiError, invalid
from gateway.generation import GenerationError, GenerationParams, Usage
from gateway.metrics import GatewayMetrics
from gateway.protocol import INT32_MAX, INT32_MIN, Prompt, check_prompt, error_responses
from services.pb import scheduler_pb2
from services.pooling import Embedding, PoolingType, embedding_from_pb, embedding_values
from services.sampling import SamplingOptions
from services.text import Tokenizer

T = TypeVar("T")
MAX_INPUTS = 2048  # inputs in one request, as OpenAI's API allows
# what the rate limiter charges per input beyond its prompt (`Gateway.charge` counts prompt
# tokens plus max_tokens; nothing is generated, the one "token" is the vector)
_CHARGE = GenerationParams(sampling=SamplingOptions(max_tokens=1))
_RESPONSES = error_responses(400, 401, 404, 429, 503)


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings`, as OpenAI's API has it (and vLLM's `priority`)."""

    # an unknown field (another server's extra, a misspelling) is a 400 naming it, never ignored
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    input: Prompt = Field(
        description="A string, a list of strings, a list of token ids, or a list "
        f"of token-id lists; at most {MAX_INPUTS} inputs."
    )
    model: str | None = Field(None, description="The served model's name; default: it.")
    encoding_format: Literal["float", "base64"] = Field(
        "float",
        description="float: a list of numbers; base64: the little-endian float32 bytes, "
        "base64-encoded (what the openai SDK asks for).",
    )
    dimensions: int | None = Field(
        None, ge=1, description="Refused: the model has no Matryoshka representation to shorten its vectors to."
    )
    user: str | None = Field(None, max_length=256)
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX, description="vLLM: lower runs sooner.")

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return check_prompt(value)


# --- validation ------------------------------------------------------------------------


def check_dimensions(dimensions: int | None) -> None:
    if dimensions is not None:
        raise invalid(
            "dimensions",
            "this model does not support Matryoshka embeddings: its vectors have "
            "one size, which a request cannot change; omit dimensions",
        )


class InputError(ValueError):
    """An input refused: `index` (None: the inputs as a whole), why, and OpenAI's error code
    (`context_length_exceeded` for an input longer than the context)."""

    def __init__(self, index: int | None, reason: str, code: str | None = None) -> None:
        super().__init__(reason)
        self.index, self.reason, self.code = index, reason, code


def check_inputs(prompts: Sequence[Sequence[int]], vocab_size: int, max_model_len: int) -> None:
    """Every input's token ids: at most MAX_INPUTS inputs, each not empty, inside the
    vocabulary, at most max_model_len tokens (nothing is generated after it: an input may
    fill the context). InputError for the first that is not."""
    if len(prompts) > MAX_INPUTS:
        raise InputError(None, f"at most {MAX_INPUTS} inputs per request, got {len(prompts)}")
    for i, ids in enumerate(prompts):
        if not ids:
            raise InputError(i, "empty after tokenization")
        if max(ids) >= vocab_size:
            raise InputError(i, f"token id {max(ids)} is outside the vocabulary of {vocab_size} tokens")
        if len(ids) > max_model_len:
            raise InputError(
                i,
                f"this model's maximum context length is {max_model_len} tokens, but the input has {len(ids)}",
                "context_length_exceeded",
            )


def embedding_prompts(body: EmbeddingRequest, tokenizer: Tokenizer, limits: validation.ModelLimits) -> list[list[int]]:
    """Each input as token ids (a string tokenized with the model's special tokens),
    checked (`check_inputs`); a 400 naming `input` (and which one) otherwise."""
    value = body.input
    if not isinstance(value, str) and len(value) > MAX_INPUTS and not isinstance(value[0], int):
        raise invalid("input", f"at most {MAX_INPUTS} inputs per request, got {len(value)}")  # (before tokenizing)
    if isinstance(value, str):
        prompts = [tokenizer.encode(value)]
    elif all(isinstance(x, str) for x in value):
        prompts = [tokenizer.encode(x) for x in value]
    elif all(isinstance(x, int) for x in value):
        prompts = [list(value)]
    else:
        prompts = [list(x) for x in value]
    try:
        check_inputs(prompts, limits.vocab_size, limits.max_model_len)
    except InputError as exc:
        where = "input" if exc.index is None or len(prompts) == 1 else f"input[{exc.index}]"
        raise ApiError(400, f"{where}: {exc.reason}", "input", exc.code) from None
    return prompts


# --- the scheduler calls ---------------------------------------------------------------


async def embed_prompt(
    generator: TextGenerator,
    prompt_ids: Sequence[int],
    pooling: PoolingType,
    request_id: str,
    priority: int = 0,
    tenant: str = "",
    traceparent: str = "",
    session: str = "",
    lora_name: str = "",
) -> tuple[Embedding, Usage]:
    """One input's vector and usage, from one pooling request (under LoRA adapter
    `lora_name`, "" for the base model); GenerationError when the scheduler refuses or fails
    it. Cancelling it cancels the scheduler call (the request is aborted and its blocks
    freed)."""
    request = scheduler_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_ids),
        priority=priority,
        tenant=tenant,
        arrival_time_ns=time.time_ns(),
        pooling=pooling.to_pb(),
        lora_name=lora_name,
    )
    request.sampling_params.n = 1
    if traceparent:
        request.trace_context.traceparent = traceparent
    metadata = (("traceparent", traceparent),) if traceparent else None
    # the gateway's one retry loop (replicas, a scheduler restarting before anything came)
    responses = generator.scheduler_responses(request, metadata, session)
    try:
        async for resp in responses:
            if not resp.HasField("usage"):
                continue
            if not resp.HasField("embedding"):
                raise GenerationError(grpc.StatusCode.INTERNAL, f"request {request_id} ended without its vector")
            usage = Usage(resp.usage.num_prompt_tokens, 0, resp.usage.num_cached_tokens, resp.usage.num_preemptions)
            return embedding_from_pb(resp.embedding), usage
        raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"request {request_id}: the scheduler's stream ended early")
    except grpc.aio.AioRpcError as exc:
        raise GenerationError(exc.code(), exc.details() or exc.code().name) from exc
    finally:
        await responses.aclose()


async def embed_all(
    generator: TextGenerator, prompts: Sequence[Sequence[int]], pooling: PoolingType, request_id: str, **kwargs: Any
) -> list[tuple[Embedding, Usage]]:
    """Every input at once, in order. The first failure (or a cancellation) cancels the
    others, so no scheduler request outlives the call."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    tasks = [
        asyncio.ensure_future(embed_prompt(generator, p, pooling, rid, **kwargs))
        for p, rid in zip(prompts, ids, strict=True)
    ]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve_embeddings(
    generator: TextGenerator,
    metrics: GatewayMetrics | None,
    prompts: Sequence[Sequence[int]],
    pooling: PoolingType,
    request_id: str,
    guard: Callable[[Awaitable[T]], Awaitable[T]] | None = None,
    **kwargs: Any,
) -> list[tuple[Embedding, Usage]]:
    """`embed_all` for a front door, counted in the gateway's metrics as a request of one
    choice per input (REST and gRPC alike): finished "stop", or "abort" when the client
    went away (a cancelled call, or `guard`'s ClientGone). `guard` wraps the work (REST:
    cancel it when the client disconnects)."""
    num_prompt_tokens = sum(map(len, prompts))
    serving = metrics.serving(len(prompts), num_prompt_tokens) if metrics is not None else contextlib.nullcontext()
    with serving as timer:
        work = embed_all(generator, prompts, pooling, request_id, **kwargs)
        try:
            results = await (guard(work) if guard is not None else work)
        except streaming.ClientGone:  # its scheduler calls are cancelled: counted as aborts
            if timer is not None:
                timer.on_abandoned(len(prompts), num_prompt_tokens)
            raise
        if timer is not None:
            for _ in results:
                timer.on_choice_finished("stop")
            timer.on_finished(num_prompt_tokens, 0)
    return results


# --- the response ----------------------------------------------------------------------


def embedding_response(
    request_id: str, model: str, vectors: Sequence[Embedding], usage: Usage, encoding_format: str
) -> dict[str, Any]:
    """OpenAI's `CreateEmbeddingResponse` (with vLLM's `id` and `created`)."""
    if encoding_format == "base64":
        data = [base64.b64encode(v).decode("ascii") for v in vectors]
    else:
        data = [embedding_values(v) for v in vectors]
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


def add_routes(app: FastAPI, gw: Any) -> None:
    """`POST /v1/embeddings` on the REST app (`gw`: its `gateway.app.Gateway`)."""

    @app.post("/v1/embeddings", tags=["OpenAI"], responses=_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        """Each input's vector: the final hidden states pooled (`--pooling-type`) and
        L2-normalized, as `float`s or `base64` float32."""
        gw.admit()
        request_id = f"embd-{uuid.uuid4().hex}"
        request.state.request_id = request_id
        validation.check_model(body.model, gw.limits)
        check_dimensions(body.dimensions)
        prompts = await asyncio.to_thread(embedding_prompts, body, gw.tokenizer, gw.limits)
        await gw.charge(request, prompts, _CHARGE)
        key = getattr(request.state, "api_key", None)
        # an API key's priority class is a floor, as for generation (gateway.validation)
        priority = body.priority if key is None else max(body.priority, key.priority)
        lora = gw.limits.lora_name(body.model)  # (the adapter's vector, as vLLM's)
        results = await serve_embeddings(
            gw.generator,
            gw.metrics,
            prompts,
            PoolingType(gw.config.pooling_type),
            request_id,
            lambda work: streaming.unless_disconnected(request, work),
            priority=priority,
            tenant=key.tenant if key is not None else "",
            traceparent=request.headers.get("traceparent", ""),
            session=(request.headers.get("x-session-id") or body.user or "")[:256],
            lora_name=lora,
        )
        usage = Usage(sum(u.prompt_tokens for _, u in results))
        payload = embedding_response(
            request_id, lora or gw.limits.name, [v for v, _ in results], usage, body.encoding_format
        )
        return JSONResponse(payload, headers={"X-Request-Id": request_id})
