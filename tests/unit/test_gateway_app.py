"""The REST gateway over a fake scheduler: validation, errors, API keys, body limits, formats.

The app runs in-process (ASGI) over a `FakeGenerator` that records every call, so that a
test can assert that a refused request never reached the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import httpx2 as httpx
import pytest

from gateway import streaming
from gateway.app import create_app
from gateway.config import ApiKey, GatewayConfig, load_api_keys
from gateway.errors import _param_from_loc, status_for
from gateway.generation import ChoiceDelta, Finished, GenerationError, TokenLogprob, Usage
from gateway.timeline import Span, chrome_trace
from services.pb import common_pb2, scheduler_pb2
from services.text import Tokenizer

MAX_MODEL_LEN = 64


class FakeGenerator:
    """`TextGenerator`'s interface: two deltas per choice ("he", "llo"), then usage."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = MAX_MODEL_LEN
        self.calls: list[tuple[list[int], object, str]] = []
        self.error: GenerationError | None = None
        self.error_mid_stream: GenerationError | None = None
        self.healthy = (True, "")

    async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
        self.calls.append((list(prompt_ids), params, request_id))
        if self.error is not None:
            raise self.error
        for i in range(params.sampling.n):
            lps = (
                [TokenLogprob(1, "he", -0.5, [(1, "he", -0.5), (2, "x", -1.5)])]
                if params.sampling.logprobs is not None
                else []
            )
            yield ChoiceDelta(i, "he", [1], lps)
            if self.error_mid_stream is not None:
                raise self.error_mid_stream
            yield ChoiceDelta(i, "llo", [2], lps, finish_reason="length")
        yield Finished(Usage(len(prompt_ids), 2 * params.sampling.n))

    async def health(self, timeout_s: float = 2.0):
        return self.healthy

    async def stats(self, include_kv_sequences: bool = False, timeout_s: float = 2.0):
        resp = scheduler_pb2.GetStatsResponse(kv_address="kv:1", kv_health=common_pb2.HEALTH_STATUS_SERVING)
        resp.kv_cache.num_total_blocks, resp.kv_cache.num_peak_used_blocks = 64, 3
        resp.kv_cache.num_prefix_queries = 2**40  # 64-bit counters stay JSON numbers
        return resp


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


def make_client(tokenizer, **config):
    generator = FakeGenerator(tokenizer)
    config.setdefault("served_model_names", ("tiny",))
    cfg = GatewayConfig(
        model=str(tokenizer.model_dir), scheduler_address="unused:1", max_model_len=MAX_MODEL_LEN, **config
    )
    app = create_app(cfg, generator)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return client, generator


def run(coro):
    return asyncio.run(coro)


async def post(client, path, body, headers=None):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return await client.post(path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


LONG_PROMPT = list(range(5, 5 + MAX_MODEL_LEN))  # no room left to generate
BAD = [
    # (path, body, status, param)
    ("/v1/completions", b'{"prompt": "a", ', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1], "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),  # as OpenAI and vLLM
    ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0, "min_tokens": 1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": 5}}, 400, "guided_json"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "(ab"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "a", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "guided_grammar": "start: nope"}, 400, "guided_grammar"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    (
        "/v1/completions",
        {"prompt": "a", "guided_regex": "a", "guided_decoding_backend": "xgrammar"},
        400,
        "guided_decoding_backend",
    ),
    (
        "/v1/completions",
        {"prompt": "a", "structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
        400,
        "structured_outputs.regex",
    ),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"xml": "a"}}, 400, "structured_outputs.xml"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
        400,
        "response_format.type",
    ),
    # issue 16, defect 7: these were 500s
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"]}', 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": ["\ud800"]}, 400, "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages[0].content"),
    ("/generate", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "top_k": 2**32}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 2**32, "max_tokens": None}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "max_token": 5}, 400, "max_token"),  # a misspelling
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "guided_choice": ["x", ""]},
        400,
        "guided_choice",
    ),
    ("/v1/completions", {"prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.01}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["ab" * 100_000]}, 400, "stop"),  # issue 16
    ("/v1/completions", {"prompt": "a", "stop": "x" * 4097}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["x"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"7": -101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "a", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0]",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice.function.name",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "guided_regex": "a",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
        },
        400,
        "tool_choice",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 80}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": MAX_MODEL_LEN},
        400,
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "echo"),
    ("/generate", {"prompt": ""}, 400, "prompt"),
    ("/generate", {"prompt": "a", "debug_timeline": "yes"}, 400, "debug_timeline"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_is_refused_before_the_scheduler(tokenizer, path, body, status, param):
    async def go():
        client, generator = make_client(tokenizer)
        async with client:
            resp = await post(client, path, body)
        return resp, generator

    resp, generator = run(go())
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and (param is None or error["message"].startswith(param.split("[")[0]))
    assert generator.calls == []


def test_wrong_content_type_says_so(tokenizer):
    async def go():
        client, _ = make_client(tokenizer)
        async with client:
            return await client.post(
                "/v1/completions", content=b'{"prompt": "a"}', headers={"Content-Type": "text/plain"}
            )

    resp = run(go())
    assert resp.status_code == 400 and "Content-Type: application/json" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_scheduler_errors_map_to_http(tokenizer, code, status, stream):
    async def go():
        client, generator = make_client(tokenizer)
        generator.error = GenerationError(code, "scheduler says no")
        async with client:
            return await post(client, "/v1/completions", {"prompt": "a", "stream": stream})

    resp = run(go())
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["code"] == code.name.lower()
    assert ("scheduler says no" in error["message"]) == (status != 500)
    assert resp.headers["x-request-id"].startswith("cmpl-")
    assert status_for(code) == status


def test_completions_number_choices_across_prompts(tokenizer):
    async def go():
        client, generator = make_client(tokenizer)
        async with client:
            resp = await post(
                client, "/v1/completions", {"prompt": [[5, 6], [7]], "n": 2, "logprobs": 1, "return_token_ids": True}
            )
        return resp, generator

    resp, generator = run(go())
    body = resp.json()
    assert resp.status_code == 200 and body["id"].startswith("cmpl-") and body["model"] == "tiny"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[5, 6], [5, 6], [7], [7]]
    assert all(c["text"] == "hello" and c["token_ids"] == [1, 2] for c in body["choices"])
    assert body["choices"][0]["logprobs"]["tokens"] == ["he", "he"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 2]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    ids = {c[2] for c in generator.calls}
    assert len(ids) == 2 and all(i.startswith(body["id"]) for i in ids)


def test_defaults_and_vllm_extras_reach_the_scheduler(tokenizer):
    async def go():
        client, generator = make_client(tokenizer)
        async with client:
            await post(client, "/v1/completions", {"prompt": "hi"})
            await post(
                client,
                "/v1/completions",
                {
                    "prompt": "hi",
                    "max_tokens": 5,
                    "temperature": 0,
                    "top_p": 0.5,
                    "seed": -1,
                    "stop": "x",
                    "top_k": -1,
                    "min_p": 0.1,
                    "min_tokens": 2,
                    "ignore_eos": True,
                    "stop_token_ids": [3],
                    "priority": -4,
                    "user": "u",
                },
            )
            await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        return generator

    calls = run(go()).calls
    default, extras, chat = (c[1] for c in calls)
    d, x = default.sampling, extras.sampling  # the one sampling type every layer shares
    assert d.max_tokens == 16 and d.temperature == 1.0 and d.n == 1
    assert (x.max_tokens, x.temperature, x.top_p, x.seed, extras.stop) == (5, 0.0, 0.5, 2**64 - 1, ("x",))
    assert (x.top_k, x.min_p, x.min_tokens, x.ignore_eos) == (0, 0.1, 2, True)
    assert x.stop_token_ids == (3,) and extras.priority == -4
    assert chat.sampling.max_tokens is None  # chat: the rest of the context
    assert calls[2][0] == tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def _events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(e[len("data: ") :]) for e in text.split("\n\n") if e and e != "data: [DONE]"]


def test_streams_are_server_sent_events_with_usage(tokenizer):
    async def go():
        client, _ = make_client(tokenizer)
        async with client:
            a = await post(
                client,
                "/v1/completions",
                {"prompt": "a", "n": 2, "stream": True, "stream_options": {"include_usage": True}},
            )
            b = await post(
                client,
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True},
            )
        return a, b

    a, b = run(go())
    assert a.headers["content-type"].startswith("text/event-stream")
    events = _events(a.text)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    texts = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "hello", 1: "hello"}
    chat = _events(b.text)
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chat) == "hello"
    assert chat[-1]["choices"][0]["finish_reason"] == "length"
    assert chat[1]["choices"][0]["logprobs"]["content"][0]["token"] == "he"
    assert all("usage" not in e for e in chat)


def test_api_keys_guard_everything_but_health_and_metrics(tokenizer):
    keys = {"good-key": ApiKey(tenant="team-a", priority=2)}

    async def go():
        client, generator = make_client(tokenizer, api_keys=keys)
        async with client:
            missing = await post(client, "/v1/completions", b'{"not json')
            wrong = await post(client, "/v1/completions", {"prompt": "a"}, {"Authorization": "Bearer nope"})
            models = await client.get("/v1/models")
            ok = await post(
                client, "/v1/completions", {"prompt": "a", "priority": 1}, {"Authorization": "Bearer good-key"}
            )
            health = await client.get("/health")
            metrics = await client.get("/metrics")
        return missing, wrong, models, ok, health, metrics, generator

    missing, wrong, models, ok, health, metrics, generator = run(go())
    for resp in (missing, wrong, models):  # refused before the body is even parsed
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert ok.status_code == 200 and health.status_code == 200 and metrics.status_code == 200
    ((_, params, _),) = generator.calls
    assert params.tenant == "team-a" and params.priority == 2  # the key's class is a floor


def test_oversized_bodies_get_413(tokenizer):
    async def go():
        client, generator = make_client(tokenizer, max_body_bytes=2048)
        big = json.dumps({"prompt": "a" * 4000}).encode()

        async def chunks():
            for i in range(0, len(big), 512):
                yield big[i : i + 512]

        async with client:
            declared = await post(client, "/v1/completions", big)
            streamed = await client.post(
                "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
            )
        return declared, streamed, generator

    declared, streamed, generator = run(go())
    for resp in (declared, streamed):
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert generator.calls == []


def test_the_model_is_served_under_the_model_string_as_vllm_does(tokenizer):
    """No --served-model-name: clients send the --model string (what vLLM serves it as) or the
    folder's name; /v1/models lists both and each can be retrieved (names may be paths)."""
    path = str(tokenizer.model_dir)
    folder = tokenizer.model_dir.name

    async def go():
        client, _ = make_client(tokenizer, served_model_names=())
        async with client:
            by_path = await post(client, "/v1/completions", {"prompt": "a", "model": path, "max_tokens": 2})
            by_folder = await post(
                client,
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "a"}], "model": folder, "max_tokens": 2},
            )
            other = await post(client, "/v1/completions", {"prompt": "a", "model": "gpt-4"})
            models = await client.get("/v1/models")
            one = await client.get(f"/v1/models/{path}")
            missing = await client.get("/v1/models/gpt-4")
        return by_path, by_folder, other, models, one, missing

    by_path, by_folder, other, models, one, missing = run(go())
    assert by_path.status_code == 200 and by_path.json()["model"] == path
    assert by_folder.status_code == 200 and by_folder.json()["model"] == path  # the first name
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    assert [m["id"] for m in models.json()["data"]] == [path, folder]
    assert one.status_code == 200 and one.json()["id"] == path and missing.status_code == 404


def test_metrics_scrape_survives_a_scheduler_that_does_not_answer(tokenizer):
    async def go():
        client, generator = make_client(tokenizer)

        async def down(*args, **kwargs):
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "the scheduler is down")

        generator.stats = down
        async with client:
            return await client.get("/metrics")

    metrics = run(go())
    assert metrics.status_code == 200
    assert 'pagoda:engine_up{model_name="tiny"} 0.0' in metrics.text
    assert "pagoda:num_requests_running" not in metrics.text  # no stale engine figures


def test_metrics_can_require_a_key(tokenizer):
    """Issue 16, defect 11: /metrics is open to scrapers by default; a setting closes it."""

    async def go(require):
        client, _ = make_client(tokenizer, api_keys={"sk-a": ApiKey()}, metrics_require_key=require)
        async with client:
            return (await client.get("/metrics")).status_code, (
                await client.get("/metrics", headers={"Authorization": "Bearer sk-a"})
            ).status_code

    assert run(go(False)) == (200, 200)
    assert run(go(True)) == (401, 200)


def test_version_is_open_as_vllms(tokenizer):
    async def go():
        client, _ = make_client(tokenizer, api_keys={"sk-a": ApiKey()})
        async with client:
            return await client.get("/version"), await client.get("/v1/models")

    version, models = run(go())
    assert version.status_code == 200 and version.json()["version"]
    assert models.status_code == 401  # the API itself still needs a key


def test_health_models_memory_metrics_and_openapi(tokenizer):
    async def go():
        client, generator = make_client(tokenizer)
        async with client:
            ok = await client.get("/health")
            generator.healthy = (False, "stage 1 is down")
            down = await client.get("/health")
            models = await client.get("/v1/models")
            memory = await client.get("/debug/memory")
            await post(client, "/v1/completions", {"prompt": "a"})
            await post(client, "/v1/completions", {"prompt": "a", "n": 0})
            metrics = await client.get("/metrics")
            openapi = await client.get("/openapi.json")
        return ok, down, models, memory, metrics, openapi

    ok, down, models, memory, metrics, openapi = run(go())
    assert ok.status_code == 200 and down.status_code == 503 and "stage 1" in down.json()["detail"]
    assert models.json()["data"][0]["id"] == "tiny"
    assert models.json()["data"][0]["root"] == "tiny"  # not the checkpoint's path on disk
    kv = memory.json()["kv_cache"]
    assert kv["num_peak_used_blocks"] == 3 and kv["num_prefix_queries"] == 2**40
    text = metrics.text
    for name in (
        'pagoda:request_success_total{finished_reason="length"',
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:inter_token_latency_seconds_bucket",
        "pagoda:e2e_request_latency_seconds_bucket",
        "pagoda:request_errors_total",
        "pagoda:time_per_output_token_seconds_bucket",
        # the engine's figures, from the scheduler at scrape time: one scrape target
        "pagoda:engine_up",
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prefix_cache_queries_total",
        "pagoda:prefix_cache_hits_total",
        "pagoda:num_preemptions_total",
    ):
        assert name.split("{")[0] in text, name
    assert 'pagoda:engine_up{model_name="tiny"} 1.0' in text
    assert 'pagoda:prefix_cache_queries_total{model_name="tiny"}' in text  # a counter, as vLLM's
    paths = openapi.json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/generate",
        "/health",
        "/metrics",
        "/debug/memory",
    ):
        assert path in paths


def test_param_names_from_pydantic_locations():
    assert _param_from_loc(("body", "temperature")) == "temperature"
    assert _param_from_loc(("body", "messages", 0, "content", "list[TextContentPart]", 1)) == "messages[0].content"
    assert _param_from_loc(("body", "prompt", "list[constrained-int]", 1)) == "prompt"
    assert _param_from_loc(("body",)) is None


def test_timeline_is_a_chrome_trace():
    e = scheduler_pb2.GenerateResponse().timeline.add(
        name="stage 1 compute", category="stage", start_ns=2_000_000, end_ns=5_000_000, stage_index=1
    )
    e.micro_batch_id = 7
    step = scheduler_pb2.GenerateResponse().timeline.add(
        name="step", category="scheduler", start_ns=1_000_000, end_ns=0
    )  # never ended
    trace = chrome_trace("gen-1", [e, step], [Span("request", 500_000, 6_000_000)])
    complete = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert [t["name"] for t in complete] == ["request", "stage 1 compute"]
    stage = complete[1]
    assert (stage["ts"], stage["dur"], stage["pid"]) == (2000.0, 3000.0, 3)
    assert stage["args"]["micro_batch_id"] == 7
    names = {t["args"]["name"] for t in trace["traceEvents"] if t["name"] == "process_name"}
    assert names == {"gateway", "stage 1"}


def test_config_and_api_keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": {"tenant": "a", "priority": 1}, "k2": {}}))
    assert load_api_keys(path) == {"k1": ApiKey("a", 1), "k2": ApiKey()}
    path.write_text(json.dumps({"k1": {"tenant": 3}}))
    with pytest.raises(ValueError, match="tenant must be a string"):
        load_api_keys(path)
    with pytest.raises(ValueError, match="api_keys"):
        GatewayConfig(model="m", scheduler_address="s:1", host="0.0.0.0")
    # as vLLM: the --model string, and (Pagoda) the folder's name; or the names given
    config = GatewayConfig(model="/x/tiny", scheduler_address="s:1")
    assert config.model_names == ("/x/tiny", "tiny") and config.model_name == "/x/tiny"
    assert GatewayConfig(model="tiny", scheduler_address="s:1").model_names == ("tiny",)
    assert GatewayConfig(model="/x/tiny", scheduler_address="s:1", served_model_names=("a", "b")).model_names == (
        "a",
        "b",
    )


def test_the_gateway_imports_no_backend():
    code = (
        "import sys, gateway.server; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'worker_svc', 'kvcache_svc', 'scheduler_svc')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ending_a_merged_stream_closes_every_stream():
    closed = []

    async def endless(i):
        try:
            while True:
                yield i
                await asyncio.sleep(0.001)
        finally:
            closed.append(i)

    async def failing():
        try:
            yield "x"
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "down")
        finally:
            closed.append("failing")

    async def go():
        merged = streaming.merged([endless(0), endless(1)])
        got = {(await anext(merged))[0] for _ in range(6)}
        await merged.aclose()
        with pytest.raises(GenerationError):
            async for _ in streaming.merged([endless(2), failing()]):
                pass
        return got

    assert run(go()) == {0, 1}
    assert sorted(map(str, closed)) == ["0", "1", "2", "failing"]


def test_an_error_mid_stream_is_an_error_event(tokenizer):
    async def go():
        client, generator = make_client(tokenizer)
        generator.error_mid_stream = GenerationError(grpc.StatusCode.UNAVAILABLE, "stage 0 is down")
        async with client:
            return await post(client, "/v1/completions", {"prompt": "a", "stream": True})

    resp = run(go())
    assert resp.status_code == 200  # the response had started
    events = _events(resp.text)
    assert events[0]["choices"][0]["text"] == "he"
    assert events[-1]["error"]["code"] == "unavailable" and "stage 0" in events[-1]["error"]["message"]


def test_max_completion_tokens_is_chats_name_for_max_tokens(tokenizer):
    hi = [{"role": "user", "content": "hi"}]

    async def go():
        client, generator = make_client(tokenizer)
        async with client:
            replies = [
                await post(client, "/v1/chat/completions", {"messages": hi, **limits})
                for limits in (
                    {"max_completion_tokens": 7},
                    {"max_tokens": 5},
                    {"max_tokens": 6, "max_completion_tokens": 6},
                    {"max_tokens": 5, "max_completion_tokens": 9},
                )
            ]
        return replies, generator

    (new, old, same, differ), generator = run(go())
    assert [r.status_code for r in (new, old, same)] == [200, 200, 200]
    assert [params.sampling.max_tokens for _, params, _ in generator.calls] == [7, 5, 6]
    assert differ.status_code == 400  # ... and never reached the scheduler
    assert differ.json()["error"]["param"] == "max_completion_tokens"
    assert "max_tokens=5" in differ.json()["error"]["message"]
