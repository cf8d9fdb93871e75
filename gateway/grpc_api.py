"""The public gRPC API, `pagoda.v1.Generation`: text in, streamed text deltas out.

A thin servicer over `TextGenerator`: authenticate -> validate -> convert -> generate ->
convert. Bad input is refused here with INVALID_ARGUMENT naming the field (`field: reason`)
and never reaches the scheduler; the scheduler's own refusals (`GenerationError`) pass
through with their status code. A client that cancels its stream closes the generate
iterator, which cancels the scheduler call and so aborts the request downstream. With rate
limits configured, Generate, Chat and Embed are charged once validated (gateway.ratelimit); a
refusal is RESOURCE_EXHAUSTED with the REST API's message and `retry-after` trailing metadata
(seconds, when retrying can help).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc

from gateway import embeddings
from gateway.config import ApiKey, GatewayConfig
from gateway.core import TextGenerator
from gateway.generation import ChoiceDelta, Finished, GenerationError, GenerationParams
from gateway.metrics import GatewayMetrics
from gateway.protocol import stop_limits
from gateway.ratelimit import ANONYMOUS, RateLimiter, RateLimitExceeded, key_id, key_salt, token_cost
from services import grammar
from services.admission import AdmissionError, Limits, admit
from services.generation_config import SamplingDefaults, sampling_defaults
from services.grammar import GrammarError
from services.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.pooling import PoolingType, embedding_to_pb
from services.sampling_pb import options_from_pb
from services.settings import lora_modules

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

_FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_NO_KEY = ApiKey()
_NO_DEFAULTS = SamplingDefaults()  # every field a request leaves unset is off


def add_generation_service(
    server: grpc.aio.Server,
    generator: TextGenerator,
    config: GatewayConfig,
    limiter: RateLimiter | None = None,
    metrics: GatewayMetrics | None = None,
    loras: dict[str, str] | None = None,
) -> list[str]:
    """Registers the Generation servicer on `server`; returns the full names of the services
    added, for the caller's reflection and health registration. `limiter`: the rate limiter
    to share with the REST API (None: the servicer builds its own when limits are configured);
    `metrics`: the REST API's, so that gRPC traffic counts in the same figures; `loras`: the
    REST API's LoRA adapters (name -> folder), shared so that one loaded at run time is
    served on both."""
    if limiter is None and config.rate_limits_enabled:
        limiter = RateLimiter.create(config.default_rate_limit, config.redis_url)
    gateway_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(generator, config, limiter, metrics, loras), server
    )
    return [SERVICE_NAME]


async def _abort_rate_limited(context: grpc.aio.ServicerContext, exc: RateLimitExceeded) -> None:
    retry_after = exc.retry_after_header
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message, (("retry-after", retry_after),) if retry_after else ()
    )


class RequestError(Exception):
    """A request refused at the gateway: the status code and the field it concerns."""

    def __init__(self, code: grpc.StatusCode, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.code = code
        self.field = field
        self.message = f"{field}: {reason}"


def _invalid(field: str, reason: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, field, reason)


def params_from_pb(
    options: gateway_pb2.TextGenerationOptions, key: ApiKey = _NO_KEY, defaults: SamplingDefaults = _NO_DEFAULTS
) -> GenerationParams:
    """Generation parameters read and checked on their own; RequestError naming the first bad
    field. The sampling fields are read by the codec every layer shares (`options_from_pb`),
    those left unset taking the model's `defaults` (as REST's); what depends on the prompt
    and the limits is `admit_prompt`'s."""
    sp = options.sampling_params
    where = "options.sampling_params"
    unset = {name: value for name, value in defaults.fields().items() if not sp.HasField(name)}
    try:
        sampling = dataclasses.replace(options_from_pb(sp), **unset)
    except ValueError as exc:
        field, _, why = str(exc).partition(": ")
        raise _invalid(f"{where}.{field}", why) from None
    if sampling.structured is not None:
        try:
            grammar.check(sampling.structured)
        except GrammarError as exc:
            raise _invalid(f"{where}.structured_output.{sampling.structured.kind}", str(exc)) from None
    try:
        stop_limits(list(options.stop))
    except ValueError as exc:
        raise _invalid("options.stop", str(exc)) from None
    for i, stop in enumerate(options.stop):
        if not stop:
            raise _invalid(f"options.stop[{i}]", "must not be empty")
    return GenerationParams(
        sampling=sampling,
        stop=tuple(options.stop),
        # the key's class is a floor: a client cannot jump ahead of what its key allows
        priority=max(options.priority, key.priority),
        tenant=key.tenant,
        debug_timeline=options.debug_timeline,
        skip_special_tokens=(options.skip_special_tokens if options.HasField("skip_special_tokens") else True),
        include_stop_str_in_output=options.include_stop_str_in_output,
    )


def admit_prompt(field: str, num_prompt_tokens: int, params: GenerationParams, limits: Limits) -> None:
    """The one admission check (`services.admission`): the prompt (`field`) and max_tokens
    must fit in the model's context, n and logprobs within the gateway's bounds, token ids in
    the vocabulary. The scheduler resolves an unset max_tokens."""
    try:
        admit(params.sampling, limits, num_prompt_tokens)
    except AdmissionError as exc:
        raise _invalid(field if exc.field == "prompt" else f"options.sampling_params.{exc.path}", exc.reason) from None


def response_from_delta(request_id: str, delta: ChoiceDelta) -> gateway_pb2.TextGenerateResponse:
    msg = gateway_pb2.TextGenerateResponse(request_id=request_id)
    choice = msg.choices.add(index=delta.index, text=delta.text, token_ids=delta.token_ids)
    for lp in delta.logprobs:
        entry = choice.logprobs.add(token_id=lp.token_id, token=lp.token, logprob=lp.logprob)
        for t in lp.top:
            entry.top.add(token_id=t.token_id, token=t.token, logprob=t.logprob)
    for lp in (delta.prompt_logprobs or [])[1:]:  # the first prompt token has none
        entry = choice.prompt_logprobs.add(token_id=lp.token_id, token=lp.token, logprob=lp.logprob)
        for t in lp.top:
            entry.top.add(token_id=t.token_id, token=t.token, logprob=t.logprob)
    if delta.finish_reason is not None:
        choice.finish_reason = _FINISH_REASONS.get(delta.finish_reason, common_pb2.FINISH_REASON_ERROR)
    if isinstance(delta.stop_reason, str):
        choice.stop_string = delta.stop_reason
    elif delta.stop_token_id is not None:  # EOS too, which REST reports as null (vLLM)
        choice.stop_token_id = delta.stop_token_id
    return msg


def _model_vocab_size(model_dir: Path, tokenizer_vocab_size: int) -> int:
    """Token ids a prompt may hold: the model's embedding rows, which can exceed the
    tokenizer's vocabulary (padded embeddings)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        return max(int(config.get("vocab_size") or 0), tokenizer_vocab_size)
    except (OSError, ValueError, TypeError):
        return tokenizer_vocab_size


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    """`pagoda.v1.Generation` on one `TextGenerator`. Holds no per-request state: each call
    owns its generate iterator and closes it however the call ends."""

    def __init__(
        self,
        generator: TextGenerator,
        config: GatewayConfig,
        limiter: RateLimiter | None = None,
        metrics: GatewayMetrics | None = None,
        loras: dict[str, str] | None = None,
    ) -> None:
        self.generator = generator
        self.metrics = metrics
        self.config = config
        self.limiter = limiter
        self._key_salt: bytes | None = None  # keys the rate-limit bucket ids (key_salt)
        tokenizer = generator.tokenizer
        self.model_names = config.model_names
        self.loras = loras if loras is not None else dict(lora_modules(config.lora_modules))
        # the sampling of the fields a request leaves unset (--generation-config), as REST's
        self.sampling_defaults = sampling_defaults(
            config.model, config.generation_config, config.override_generation_config
        )
        self.limits = Limits(
            vocab_size=_model_vocab_size(tokenizer.model_dir, tokenizer.vocab_size),
            max_model_len=config.max_model_len,
            max_n=config.max_n,
            max_logprobs=config.max_logprobs,
        )

    # --- RPCs ------------------------------------------------------------------------------

    async def Generate(
        self, request: gateway_pb2.TextGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.TextGenerateResponse]:
        try:
            key, bucket = self._authenticate(context)
            self._check_model(request.model)
            params = self._with_lora(params_from_pb(request.options, key, self.sampling_defaults), request.model)
            # tokenizing a large text takes seconds: off the event loop (issue 16, defect 4)
            field, prompt_ids = await asyncio.to_thread(self._prompt_ids, request)
            admit_prompt(field, len(prompt_ids), params, self.limits)
            await self._charge(bucket, key, prompt_ids, params)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        except RateLimitExceeded as exc:
            await _abort_rate_limited(context, exc)
        async for msg in self._stream(prompt_ids, params, context):
            yield msg

    async def Chat(
        self, request: gateway_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.TextGenerateResponse]:
        try:
            key, bucket = self._authenticate(context)
            self._check_model(request.model)
            params = self._with_lora(params_from_pb(request.options, key, self.sampling_defaults), request.model)
            prompt_ids = await asyncio.to_thread(self._chat_prompt_ids, request.messages)
            admit_prompt("messages", len(prompt_ids), params, self.limits)
            await self._charge(bucket, key, prompt_ids, params)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        except RateLimitExceeded as exc:
            await _abort_rate_limited(context, exc)
        async for msg in self._stream(prompt_ids, params, context):
            yield msg

    async def Embed(
        self, request: gateway_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.EmbedResponse:
        """REST's /v1/embeddings (gateway/embeddings.py): one pooling request per input."""
        try:
            key, bucket = self._authenticate(context)
            self._check_model(request.model)
            prompts = await asyncio.to_thread(self._embed_inputs, request)
            if self.limiter is not None:  # prompt tokens and one per input (the vector)
                await self.limiter.admit(bucket, key.rate_limit, sum(len(p) + 1 for p in prompts))
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        except RateLimitExceeded as exc:
            await _abort_rate_limited(context, exc)
        request_id = f"grpc-{uuid.uuid4().hex}"
        metadata = dict(context.invocation_metadata() or ())
        try:
            results = await embeddings.serve_embeddings(
                self.generator,
                self.metrics,
                prompts,
                PoolingType(self.config.pooling_type),
                request_id,
                priority=max(request.priority, key.priority),
                tenant=key.tenant,
                traceparent=str(metadata.get("traceparent", "")),
                lora_name=request.model if request.model in self.loras else "",
            )
        except GenerationError as exc:
            retry = exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
            await context.abort(exc.code, exc.message, (("retry-after", "1"),) if retry else ())
        reply = gateway_pb2.EmbedResponse(request_id=request_id)
        for vector, _ in results:
            embedding_to_pb(vector, reply.embeddings.add())
        reply.usage.num_prompt_tokens = sum(u.prompt_tokens for _, u in results)
        return reply

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        try:
            self._authenticate(context)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.ModelCard(id=name, owned_by="pagoda", max_model_len=self.limits.max_model_len)
                for name in self.model_names
            ]
        )

    # --- steps -----------------------------------------------------------------------------

    def _authenticate(self, context: grpc.aio.ServicerContext) -> tuple[ApiKey, str]:
        """The key's grant and its rate-limit bucket (ANONYMOUS without keys)."""
        if not self.config.api_keys:
            return _NO_KEY, ANONYMOUS
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization",
                "missing API key; send `authorization: Bearer <key>` metadata",
            )
        token = token.strip()
        found = None
        for candidate, grant in self.config.api_keys.items():  # constant time per key
            if hmac.compare_digest(candidate.encode(), token.encode()):
                found = grant
        if found is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "authorization", "invalid API key")
        if self._key_salt is None:
            self._key_salt = key_salt(self.config.api_keys)
        return found, key_id(token, self._key_salt)

    async def _charge(self, bucket: str, key: ApiKey, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        if self.limiter is None:
            return
        tokens = token_cost([len(prompt_ids)], params.sampling.max_tokens, params.sampling.n, self.limits.max_model_len)
        await self.limiter.admit(bucket, key.rate_limit, tokens)

    def _check_model(self, model: str) -> None:
        if model and model not in self.model_names and model not in self.loras:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                "model",
                f"{model!r} is not served here; this gateway serves "
                + " or ".join(repr(n) for n in (*self.model_names, *self.loras)),
            )

    def _with_lora(self, params: GenerationParams, model: str) -> GenerationParams:
        """The LoRA adapter a request's `model` names, if it names one."""
        return dataclasses.replace(params, lora_name=model) if model in self.loras else params

    def _prompt_ids(self, request: gateway_pb2.TextGenerateRequest) -> tuple[str, list[int]]:
        which = request.WhichOneof("prompt")
        if which == "text":
            if not request.text:
                raise _invalid("text", "must not be empty")
            return "text", self.generator.tokenizer.encode(request.text)
        if which == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise _invalid("token_ids.ids", "must not be empty")
            for i, token_id in enumerate(ids):
                if token_id >= self.limits.vocab_size:
                    raise _invalid(
                        f"token_ids.ids[{i}]",
                        f"token id {token_id} is outside the vocabulary of {self.limits.vocab_size}",
                    )
            return "token_ids.ids", ids
        raise _invalid("prompt", "set one of text or token_ids")

    def _embed_inputs(self, request: gateway_pb2.EmbedRequest) -> list[list[int]]:
        """The inputs as token ids, checked as REST checks them (`embeddings.check_inputs`)."""
        if bool(request.texts) == bool(request.token_ids):
            raise _invalid("texts", "set one of texts or token_ids, with at least one input")
        if request.texts:
            field = "texts"
            prompts = [self.generator.tokenizer.encode(text) for text in request.texts]
        else:
            field = "token_ids"
            prompts = [list(p.ids) for p in request.token_ids]
        try:
            embeddings.check_inputs(prompts, self.limits.vocab_size, self.limits.max_model_len)
        except embeddings.InputError as exc:
            raise _invalid(field if exc.index is None else f"{field}[{exc.index}]", exc.reason) from None
        return prompts

    def _chat_prompt_ids(self, messages: Sequence[gateway_pb2.ChatMessage]) -> list[int]:
        if not messages:
            raise _invalid("messages", "must not be empty")
        conversation = []
        for i, m in enumerate(messages):
            if not m.role:
                raise _invalid(f"messages[{i}].role", "must not be empty")
            message = {"role": m.role, "content": m.content}
            if m.name:
                message["name"] = m.name
            conversation.append(message)
        try:
            return self.generator.tokenizer.encode_chat(conversation)
        except ValueError as exc:  # no template, or the template refused the conversation
            raise _invalid("messages", str(exc)) from exc

    async def _stream(
        self, prompt_ids: list[int], params: GenerationParams, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.TextGenerateResponse]:
        request_id = f"grpc-{uuid.uuid4().hex}"
        metadata = dict(context.invocation_metadata() or ())
        await context.send_initial_metadata((("x-request-id", request_id),))
        events = self.generator.generate(prompt_ids, params, request_id, str(metadata.get("traceparent", "")))
        serving = (
            self.metrics.serving(params.sampling.n, len(prompt_ids))
            if self.metrics is not None
            else contextlib.nullcontext()
        )
        # A choice's last delta waits for the next event, so that when it is the request's
        # last the usage rides on the same message.
        held: gateway_pb2.TextGenerateResponse | None = None
        try:
            with serving as timer:
                async with contextlib.aclosing(events):  # a cancelled call aborts downstream
                    async for event in events:
                        if timer is not None:  # the same figures as REST requests
                            if isinstance(event, Finished):
                                timer.on_finished(event.usage.prompt_tokens, event.usage.completion_tokens)
                            else:
                                timer.on_delta((0, event.index), len(event.token_ids), event.finish_reason)
                        if isinstance(event, Finished):
                            msg = held or gateway_pb2.TextGenerateResponse(request_id=request_id)
                            held = None
                            u = event.usage
                            msg.usage.CopyFrom(
                                common_pb2.Usage(
                                    num_prompt_tokens=u.prompt_tokens,
                                    num_completion_tokens=u.completion_tokens,
                                    num_cached_tokens=u.cached_tokens,
                                    num_preemptions=u.preemptions,
                                )
                            )
                            msg.timeline.extend(event.timeline)
                            yield msg
                            continue
                        if held is not None:
                            yield held
                            held = None
                        msg = response_from_delta(request_id, event)
                        if event.finish_reason is None:
                            yield msg
                        else:
                            held = msg
            if held is not None:
                yield held
        except GenerationError as exc:  # a full queue or a recovering pipeline: come back soon
            retry = exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
            await context.abort(exc.code, exc.message, (("retry-after", "1"),) if retry else ())
        except Exception:  # a bug: log it with the request id; the caller sees INTERNAL
            log.exception("request %s failed", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request {request_id})")
