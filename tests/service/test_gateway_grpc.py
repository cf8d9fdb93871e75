"""The public gRPC API (`pagoda.v1.Generation`) over a real stack.

KV service, scheduler and two stage workers run as processes (one stack for the module); the
Generation servicer runs in this process on a grpc.aio server on port 0, with gRPC health and
server reflection as the gateway offers them, and the tests talk to it over a real channel
with the generated stub.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from support.reference import HFReference
from support.stack import kill_stack

from gateway.config import ApiKey, GatewayConfig
from gateway.core import TextGenerator
from gateway.grpc_api import SERVICE_NAME, add_generation_service
from services.grpc_utils import aio_channel, create_aio_server, set_serving
from services.pb import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.text import Tokenizer
from wiring.launcher import start_stack

T = TypeVar("T")
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir) -> HFReference:
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    s = start_stack(
        model_dir,
        num_stages=2,
        num_kv_blocks=256,
        block_size=16,
        log_dir=tmp_path_factory.mktemp("gateway-grpc-logs"),
        threads_per_worker=1,
    )
    yield s
    kill_stack(s)  # the graceful stop is not tested here


@pytest.fixture(scope="module")
def serve(stack, model_dir, tokenizer):
    """`serve(scenario, api_keys=...)` runs `await scenario(channel)` against a gateway gRPC
    server in this process (Generation + health + reflection) and returns its result."""
    max_model_len = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]

    def run(
        scenario: Callable[[grpc.aio.Channel], Awaitable[T]],
        api_keys: dict[str, ApiKey] | None = None,
        scheduler_address: str | None = None,
        metrics=None,
    ) -> T:
        address = scheduler_address or stack.scheduler_address

        async def main() -> T:
            config = GatewayConfig(
                model=model_dir, scheduler_address=address, served_model_names=("tiny",), api_keys=api_keys or {}
            )
            # a scheduler that is down for good: UNAVAILABLE after a short wait for a restart
            generator = TextGenerator(address, tokenizer, max_model_len, retry_unavailable_s=1.0)
            server, port, health = create_aio_server("127.0.0.1:0")
            names = add_generation_service(server, generator, config, metrics=metrics)
            reflection.enable_server_reflection([*names, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
            await server.start()
            for name in names:
                await set_serving(health, name, True)
            try:
                async with aio_channel(f"127.0.0.1:{port}") as channel:
                    return await scenario(channel)
            finally:
                await server.stop(None)
                await generator.close()

        return asyncio.run(main())

    return run


def text_request(
    prompt: str | list[int], *, max_tokens: int = 12, temperature: float = 0.0, **options
) -> gateway_pb2.TextGenerateRequest:
    req = gateway_pb2.TextGenerateRequest()
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    _set_options(req.options, max_tokens, temperature, options)
    return req


def _set_options(opts: gateway_pb2.TextGenerationOptions, max_tokens: int, temperature: float, options: dict) -> None:
    opts.sampling_params.max_tokens = max_tokens
    opts.sampling_params.temperature = temperature
    opts.sampling_params.ignore_eos = options.pop("ignore_eos", True)
    opts.stop.extend(options.pop("stop", ()))
    opts.priority = options.pop("priority", 0)
    for name, value in options.items():
        if isinstance(value, list):
            getattr(opts.sampling_params, name).extend(value)
        else:
            setattr(opts.sampling_params, name, value)


async def collect(call) -> tuple[dict[int, gateway_pb2.TextChoiceDelta], list]:
    """Each choice's deltas merged into one (text and token ids concatenated; finish fields of
    the last), and the raw messages."""
    merged: dict[int, gateway_pb2.TextChoiceDelta] = {}
    messages = []
    async for msg in call:
        messages.append(msg)
        for delta in msg.choices:
            choice = merged.setdefault(delta.index, gateway_pb2.TextChoiceDelta(index=delta.index))
            choice.text += delta.text
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason:
                choice.finish_reason = delta.finish_reason
                if delta.WhichOneof("stop_reason"):
                    setattr(choice, delta.WhichOneof("stop_reason"), getattr(delta, delta.WhichOneof("stop_reason")))
    return merged, messages


async def scheduler_stats(address: str, include_requests: bool = False) -> scheduler_pb2.GetStatsResponse:
    async with aio_channel(address) as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(include_requests=include_requests), timeout=5
        )


async def idle_stats(address: str, timeout_s: float = 10.0) -> scheduler_pb2.GetStatsResponse:
    """The scheduler's statistics once no request is waiting or running."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await scheduler_stats(address)
        if not (stats.num_running or stats.num_waiting):
            return stats
        assert asyncio.get_running_loop().time() < deadline, "the scheduler never became idle"
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------


def test_greedy_text_stream_equals_transformers(serve, tokenizer, reference):
    prompts = ["The quick brown fox", [5, 17, 99, 260, 31, 7, 400, 12, 3, 88, 201, 19, 64]]

    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        results = []
        for prompt in prompts:
            call = stub.Generate(text_request(prompt, max_tokens=12, logprobs=2))
            choices, messages = await collect(call)
            results.append((choices, messages, await call.initial_metadata()))
        chat = stub.Chat(
            gateway_pb2.ChatRequest(
                model="tiny",
                messages=[gateway_pb2.ChatMessage(role="user", content="Hi there")],
                options=gateway_pb2.TextGenerationOptions(
                    sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
                ),
            )
        )
        results.append((*await collect(chat), await chat.initial_metadata()))
        return results

    results = serve(scenario)
    prompt_ids = [
        tokenizer.encode(prompts[0]),
        prompts[1],
        tokenizer.encode_chat([{"role": "user", "content": "Hi there"}]),
    ]
    for ids, (choices, messages, metadata), max_tokens in zip(prompt_ids, results, (12, 12, 8), strict=True):
        assert list(choices) == [0]
        choice = choices[0]
        out = list(choice.token_ids)
        assert len(out) == max_tokens
        reference.compare(ids, out)
        assert choice.text == tokenizer.decode(out)
        assert choice.finish_reason == common_pb2.FINISH_REASON_LENGTH
        # one request id on every message, also sent as initial metadata
        request_id = messages[0].request_id
        assert request_id and all(m.request_id == request_id for m in messages)
        assert dict(metadata)["x-request-id"] == request_id
        # the last message carries the finish reason and the usage
        last = messages[-1]
        assert last.HasField("usage") and not any(m.HasField("usage") for m in messages[:-1])
        assert [c.finish_reason for c in last.choices] == [common_pb2.FINISH_REASON_LENGTH]
        assert last.usage.num_prompt_tokens == len(ids)
        assert last.usage.num_completion_tokens == max_tokens
    logprobs = results[0][0][0].logprobs
    assert [lp.token_id for lp in logprobs] == list(results[0][0][0].token_ids)
    for lp in logprobs:  # greedy: the sampled token is the most likely one
        assert len(lp.top) == 2 and lp.top[0].token_id == lp.token_id
        assert lp.logprob == pytest.approx(lp.top[0].logprob) and lp.logprob <= 0
        assert lp.token == tokenizer.decode([lp.token_id], skip_special_tokens=False)


def test_two_seeded_choices_differ_and_reproduce(serve):
    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        runs = []
        for _ in range(2):
            call = stub.Generate(text_request("Once upon a time", max_tokens=16, temperature=1.0, n=2, seed=1234))
            runs.append(await collect(call))
        return runs

    (first, messages), (second, _) = serve(scenario)
    assert sorted(first) == [0, 1]
    assert all(len(c.token_ids) == 16 for c in first.values())
    assert list(first[0].token_ids) != list(first[1].token_ids)
    assert {i: list(c.token_ids) for i, c in first.items()} == {i: list(c.token_ids) for i, c in second.items()}
    assert messages[-1].usage.num_completion_tokens == 32


def test_stop_string_cuts_the_text(serve, tokenizer):
    prompt = [5, 17, 99, 260, 31, 7, 400, 12, 3, 88, 201, 19, 64]

    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        full, _ = await collect(stub.Generate(text_request(prompt, max_tokens=24)))
        out = list(full[0].token_ids)
        stop, cut = _stop_string_across_tokens(tokenizer, prompt, out, full[0].text)
        stopped, messages = await collect(stub.Generate(text_request(prompt, max_tokens=24, stop=[stop])))
        return full[0].text, stop, cut, stopped[0], messages

    text, stop, cut, stopped, messages = serve(scenario)
    assert stopped.text == text[:cut]
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.stop_string == stop
    assert len(stopped.token_ids) < 24
    assert messages[-1].usage.num_completion_tokens < 24


def _stop_string_across_tokens(tokenizer: Tokenizer, prompt: list[int], out: list[int], text: str) -> tuple[str, int]:
    """A 4-character stop string spanning two generated tokens, first found where it is put,
    and where the text is cut for it."""
    ends = [len(tokenizer.decode(out[:k])) for k in range(1, len(out) + 1)]
    for end in ends[2:-4]:
        start = end - 2
        stop = text[start : start + 4]
        if len(stop) == 4 and text.find(stop) == start and "\ufffd" not in stop:
            return stop, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_bad_input_is_refused_naming_the_field(serve, stack):
    too_long = [5] * 4096
    cases = [
        (gateway_pb2.TextGenerateRequest(), "prompt"),
        (text_request(""), "text"),
        (text_request([]), "token_ids.ids"),
        (text_request([5, 10**6]), "token_ids.ids[1]"),
        (text_request("hi", temperature=-1.0), "options.sampling_params.temperature"),
        (text_request("hi", top_p=0.0), "options.sampling_params.top_p"),
        (text_request("hi", top_p=1.5), "options.sampling_params.top_p"),
        (text_request("hi", min_p=2.0), "options.sampling_params.min_p"),
        (text_request("hi", max_tokens=0), "options.sampling_params.max_tokens"),
        (text_request("hi", max_tokens=5000), "options.sampling_params.max_tokens"),
        (text_request("hi", max_tokens=4, min_tokens=5), "options.sampling_params.min_tokens"),
        (text_request("hi", n=1000), "options.sampling_params.n"),
        (text_request("hi", logprobs=1000), "options.sampling_params.logprobs"),
        (text_request("hi", stop_token_ids=[10**6]), "options.sampling_params.stop_token_ids[0]"),
        (text_request("hi", presence_penalty=2.5), "options.sampling_params.presence_penalty"),
        (text_request("hi", repetition_penalty=3.0), "options.sampling_params.repetition_penalty"),
        (text_request("hi", prompt_logprobs=1000), "options.sampling_params.prompt_logprobs"),
        (text_request("hi", stop=["ok", ""]), "options.stop[1]"),
        (text_request("hi", stop=["ab" * 100_000]), "options.stop"),  # issue 16: both front doors
        (text_request("hi", stop=["x"] * 10_000), "options.stop"),
        (text_request(too_long, max_tokens=1), "token_ids.ids"),
        (gateway_pb2.ChatRequest(), "messages"),
        (gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(content="hi")]), "messages[0].role"),
    ]

    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        before = await scheduler_stats(stack.scheduler_address)
        got = []
        for request, _ in cases:
            rpc = stub.Chat if isinstance(request, gateway_pb2.ChatRequest) else stub.Generate
            try:
                await collect(rpc(request))
                got.append(None)
            except grpc.aio.AioRpcError as exc:
                got.append((exc.code(), exc.details()))
        try:
            await collect(stub.Generate(gateway_pb2.TextGenerateRequest(model="nope", text="hi")))
            unknown_model = None
        except grpc.aio.AioRpcError as exc:
            unknown_model = (exc.code(), exc.details())
        after = await scheduler_stats(stack.scheduler_address)
        return got, unknown_model, before, after

    got, unknown_model, before, after = serve(scenario)
    for (request, field), result in zip(cases, got, strict=True):
        assert result is not None, f"{field}: accepted {request}"
        code, details = result
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, details)
        assert details.startswith(f"{field}: "), (field, details)
    assert unknown_model is not None and unknown_model[0] == grpc.StatusCode.NOT_FOUND
    assert unknown_model[1].startswith("model: ")
    # none of them reached the scheduler
    assert after.num_prompt_tokens == before.num_prompt_tokens
    assert (after.num_finished_requests, after.num_aborted_requests) == (
        before.num_finished_requests,
        before.num_aborted_requests,
    )


def test_reflection_health_and_models(serve):
    async def scenario(channel):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = [
            r
            async for r in stub.ServerReflectionInfo(
                iter(
                    [
                        reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
                    ]
                )
            )
        ]
        health = health_pb2_grpc.HealthStub(channel)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
        generation = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        models = await gateway_pb2_grpc.GenerationStub(channel).ListModels(gateway_pb2.ListModelsRequest())
        return replies, overall, generation, models

    replies, overall, generation, models = serve(scenario)
    services = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME} <= services
    assert SERVICE_NAME == "pagoda.v1.Generation"
    assert replies[1].file_descriptor_response.file_descriptor_proto  # discoverable by tools
    assert overall.status == health_pb2.HealthCheckResponse.SERVING
    assert generation.status == health_pb2.HealthCheckResponse.SERVING
    assert [(m.id, m.owned_by, m.max_model_len) for m in models.models] == [("tiny", "pagoda", 4096)]


def test_api_keys(serve, stack):
    keys = {API_KEY: ApiKey(tenant="team-a", priority=1)}

    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        before = await scheduler_stats(stack.scheduler_address)
        codes = []
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)]:
            try:
                await collect(stub.Generate(text_request("hi", max_tokens=2), metadata=metadata))
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        middle = await scheduler_stats(stack.scheduler_address)
        good = (("authorization", f"Bearer {API_KEY}"),)
        choices, _ = await collect(stub.Generate(text_request("hi", max_tokens=2), metadata=good))
        models = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=good)
        # a live request runs under the key's tenant, never sooner than the key's class
        call = stub.Generate(text_request("hi", max_tokens=3000, priority=0), metadata=good)
        first = await call.read()
        live = await scheduler_stats(stack.scheduler_address, include_requests=True)
        call.cancel()
        await idle_stats(stack.scheduler_address)
        return codes, before, middle, choices, models, first.request_id, live

    codes, before, middle, choices, models, request_id, live = serve(scenario, api_keys=keys)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert middle.num_prompt_tokens == before.num_prompt_tokens  # nothing reached downstream
    assert len(choices[0].token_ids) == 2
    assert [m.id for m in models.models] == ["tiny"]
    summary = {r.request_id: (r.tenant, r.priority) for r in live.requests}
    assert summary[request_id] == ("team-a", 1)


def test_client_cancel_aborts_the_request_downstream(serve, stack):
    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        before = await idle_stats(stack.scheduler_address)
        call = stub.Generate(text_request("A long story", max_tokens=3000))
        first = await call.read()
        call.cancel()
        after = await idle_stats(stack.scheduler_address)
        return first, before, after

    first, before, after = serve(scenario)
    assert first.choices and first.request_id
    assert after.num_aborted_requests == before.num_aborted_requests + 1
    assert after.num_generated_tokens - before.num_generated_tokens < 3000


def test_scheduler_errors_pass_through_with_their_code(serve):
    async def scenario(channel):
        try:
            await collect(
                gateway_pb2_grpc.GenerationStub(channel).Generate(text_request("hi", max_tokens=2), timeout=10)
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    with socket.socket() as s:  # a port nothing listens on: the scheduler is down
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
        assert serve(scenario, scheduler_address=dead) == grpc.StatusCode.UNAVAILABLE


def test_prompt_logprobs_score_the_prompt(serve, reference):
    import torch

    prompt = [5, 17, 99, 260, 31, 7, 400, 12]

    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        return await collect(stub.Generate(text_request(prompt, max_tokens=2, prompt_logprobs=2)))

    (choices, messages) = serve(scenario)
    firsts = [d for m in messages for d in m.choices if d.prompt_logprobs]
    assert len(firsts) == 1
    scored = firsts[0].prompt_logprobs
    with torch.no_grad():
        want = torch.log_softmax(reference.model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    assert [e.token_id for e in scored] == prompt[1:]
    for i, e in enumerate(scored):
        assert e.logprob == pytest.approx(float(want[i, prompt[i + 1]]), abs=1e-4)
        assert len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob


def test_tokenization_runs_off_the_event_loop(serve, tokenizer, monkeypatch):
    """Issue 16, defect 4: a multi-megabyte text took seconds to tokenize on the event loop,
    stalling every other call; prompts are tokenized in a worker thread."""
    import threading

    threads = []
    for name in ("encode", "encode_chat"):
        original = getattr(tokenizer, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            threads.append((_name, threading.current_thread()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, spy)

    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        await collect(stub.Generate(text_request("Hello there", max_tokens=2)))
        await collect(
            stub.Chat(
                gateway_pb2.ChatRequest(
                    messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
                    options=gateway_pb2.TextGenerationOptions(
                        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
                    ),
                )
            )
        )
        return threading.current_thread()

    loop_thread = serve(scenario)
    assert {name for name, _ in threads} == {"encode", "encode_chat"}
    assert all(thread is not loop_thread for _, thread in threads), threads


def test_grpc_requests_count_in_the_gateways_metrics(serve):
    """REST and gRPC traffic in the same figures (issue 15): one Generate shows in the
    request, token and latency metrics the REST API updates."""
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics("tiny")

    async def scenario(channel):
        await collect(gateway_pb2_grpc.GenerationStub(channel).Generate(text_request("Hello", max_tokens=5)))

    serve(scenario, metrics=metrics)
    text = generate_latest(metrics.registry).decode()
    assert 'pagoda:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    assert 'pagoda:generation_tokens_total{model_name="tiny"} 5.0' in text
    assert 'pagoda:time_to_first_token_seconds_count{model_name="tiny"} 1.0' in text
    assert 'pagoda:api_requests_in_flight{model_name="tiny"} 0.0' in text


def test_structured_output_through_the_grpc_api(serve):
    """`SamplingParams.structured_output` at the public gRPC API: a JSON schema and a choice
    constrain the output; an invalid schema is INVALID_ARGUMENT naming the field."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }

    def request(**kind):
        req = text_request("Answer in JSON", max_tokens=60, ignore_eos=False)
        for name, value in kind.items():
            if name == "choice":
                req.options.sampling_params.structured_output.choice.choices.extend(value)
            else:
                setattr(req.options.sampling_params.structured_output, name, value)
        return req

    async def scenario(channel):
        stub = gateway_pb2_grpc.GenerationStub(channel)
        as_json, _ = await collect(stub.Generate(request(json_schema=json.dumps(schema))))
        picked, _ = await collect(stub.Generate(request(choice=["left", "right"])))
        try:
            await collect(stub.Generate(request(json_schema='{"type": 5}')))
        except grpc.aio.AioRpcError as exc:
            return as_json[0], picked[0], (exc.code(), exc.details())
        return as_json[0], picked[0], None

    as_json, picked, refused = serve(scenario)
    value = json.loads(as_json.text)
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 9 and isinstance(value["ok"], bool)
    assert as_json.finish_reason == common_pb2.FINISH_REASON_STOP
    assert picked.text in ("left", "right")
    assert refused is not None and refused[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.structured_output.json_schema" in refused[1]
