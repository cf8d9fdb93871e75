"""The REST gateway end to end: `pagoda gateway` in front of a real stack (KV service, 2 stage
workers, scheduler) on loopback, driven by the official `openai` client and plain HTTP.

One stack and one gateway for the module; a second, small gateway (API keys) shares the
stack and is also the one stopped with SIGTERM to check the drain.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import openai
import pytest
from support.reference import HFReference

from services.grpc_utils import aio_channel, check_health
from services.pb import kvcache_pb2, kvcache_pb2_grpc
from services.text import Tokenizer
from wiring.launcher import ServiceProcess, free_port, pagoda_command

NUM_KV_BLOCKS = 128
BLOCK_SIZE = 16
MAX_BODY_BYTES = 64 * 1024
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def start_gateway(name, model_dir, scheduler_address, log_dir, *args):
    port, grpc_port = free_port(), free_port()
    gateway = ServiceProcess(
        name,
        pagoda_command(
            "gateway",
            "--model",
            model_dir,
            "--scheduler",
            scheduler_address,
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            *args,
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=log_dir / f"{name}.log",
    )
    gateway.start()
    gateway.wait_healthy(60)  # the gateway's gRPC health: SERVING once the chain is
    gateway.port = port
    return gateway


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    """`pagoda serve` with PP=2, as a user starts it: one command, every service a process."""
    logs = tmp_path_factory.mktemp("gateway-stack-logs")
    port, grpc_port = free_port(), free_port()
    ready = logs / "ready.json"
    serve = ServiceProcess(
        "serve",
        pagoda_command(
            "serve",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--pipeline-parallel-size",
            "2",
            "--num-kv-blocks",
            str(NUM_KV_BLOCKS),
            "--block-size",
            str(BLOCK_SIZE),
            "--num-threads",
            "1",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--served-model-name",
            "tiny",
            "--max-body-bytes",
            str(MAX_BODY_BYTES),
            "--log-dir",
            str(logs),
            "--ready-file",
            str(ready),
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=logs / "serve.log",
        env={"PAGODA_SPANS_FILE": str(logs / "spans.jsonl")},  # every service writes its spans
    )
    serve.start()
    try:
        serve.wait_healthy(180)
        for _ in range(100):
            if ready.exists():
                break
            time.sleep(0.1)
        addresses = json.loads(ready.read_text())
    except Exception:
        serve.stop()
        raise
    gateway = SimpleNamespace(port=port, health_address=f"127.0.0.1:{grpc_port}")
    s = SimpleNamespace(
        serve=serve,
        gateway=gateway,
        logs=logs,
        scheduler_address=addresses["scheduler"],
        kvcache=SimpleNamespace(health_address=addresses["kvcache"]),
    )
    yield s
    serve.stop(60)
    assert serve.process.returncode == 0, "pagoda serve should shut down cleanly"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.gateway.port}/v1", api_key="none", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


def call(port, method, path, body=None, headers=None, raw=False):
    """(status, parsed JSON or text); `body` bytes are sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, (text if raw else json.loads(text))


def kv_stats(stack):
    _, memory = call(stack.gateway.port, "GET", "/debug/memory")
    return memory["kv_cache"]


def reset_kv_peak(stack):
    """The peak counts from now on (asked of the KV service itself: only tests reach past
    the scheduler)."""

    async def go():
        async with aio_channel(stack.kvcache.health_address) as channel:
            await kvcache_pb2_grpc.KVCacheStub(channel).Stats(kvcache_pb2.KVStatsRequest(reset_peak=True))

    asyncio.run(go())


def test_greedy_completions_equal_transformers(client, reference, tokenizer):
    prompts = [[5, 17, 300, 42], list(range(30, 70)), tokenizer.encode("The quick brown fox")]
    resp = client.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert resp.id.startswith("cmpl-") and len(resp.choices) == 3
    for choice, prompt in zip(resp.choices, prompts, strict=True):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) == 12
        assert choice.finish_reason == "length"
        assert reference.compare(prompt, extra["token_ids"]).tie_divergences == 0
        assert choice.text == tokenizer.decode(extra["token_ids"])
    assert resp.usage.prompt_tokens == sum(map(len, prompts)) and resp.usage.completion_tokens == 36

    scored = client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert sampled <= 0 and abs(sampled - max(top.values())) < 1e-4  # greedy: the most likely

    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert chat.id.startswith("chatcmpl-") and chat.choices[0].message.role == "assistant"
    prompt = tokenizer.encode_chat(messages)
    assert chat.model_extra["prompt_token_ids"] == prompt
    assert reference.compare(prompt, chat.choices[0].model_extra["token_ids"]).tie_divergences == 0


def test_penalties_and_logit_bias_through_the_stack_equal_the_reference(client, reference, stack):
    """OpenAI's presence/frequency penalties and logit_bias, vLLM's repetition_penalty, over
    HTTP and gRPC to two stages: greedy output equals transformers' processed logits."""
    from support.penalties import check_greedy

    prompt = list(range(40, 60))
    cases = [
        {"frequency_penalty": 1.2, "presence_penalty": 0.3, "logit_bias": {"77": 4.0, "12": -100}},
        {"extra_body": {"repetition_penalty": 1.4}},
    ]
    for case in cases:
        extra = {"ignore_eos": True, "return_token_ids": True, **case.get("extra_body", {})}
        kwargs = {k: v for k, v in case.items() if k != "extra_body"}
        resp = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra, **kwargs
        )
        got = resp.choices[0].model_extra["token_ids"]
        assert len(got) == 16 and 12 not in got
        check_greedy(
            reference.model,
            prompt,
            got,
            presence=case.get("presence_penalty", 0.0),
            frequency=case.get("frequency_penalty", 0.0),
            repetition=extra.get("repetition_penalty", 1.0),
            logit_bias={int(k): v for k, v in case.get("logit_bias", {}).items()},
        )
    plain = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert plain.choices[0].model_extra["token_ids"] != got  # the penalty changed the output


def test_chat_streaming_matches_the_whole_response_and_reports_usage(client):
    args = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    stream = client.completions.create(
        model="tiny", prompt="abc", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    completion = client.completions.create(
        model="tiny", prompt="abc", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == completion.choices[0].text


def test_seeds_reproduce_and_n2_choices_differ_and_share_the_prompt(client, stack):
    prompt = list(range(100, 200))  # 100 tokens: 6 full blocks and a partial one
    args = dict(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=1.0,
        n=2,
        seed=1234,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    reset_kv_peak(stack)
    first = client.completions.create(**args)
    peak = kv_stats(stack)["num_peak_used_blocks"]
    prompt_blocks = -(-len(prompt) // BLOCK_SIZE)
    assert 0 < peak < 2 * prompt_blocks  # the two choices share the prompt's blocks
    again = client.completions.create(**args)
    texts = [c.model_extra["token_ids"] for c in first.choices]
    assert texts == [c.model_extra["token_ids"] for c in again.choices]
    assert texts[0] != texts[1]
    other = client.completions.create(**{**args, "seed": 99})
    assert [c.model_extra["token_ids"] for c in other.choices] != texts


def _stop_spanning_two_tokens(tokenizer, token_ids):
    """A 2-character stop string made of the last character of token k and the first of
    token k+1, occurring first there; (stop, index in the text, k)."""
    text = tokenizer.decode(token_ids)
    for k in range(1, len(token_ids) - 6):
        boundary = len(tokenizer.decode(token_ids[:k]))
        if boundary < 1 or len(tokenizer.decode(token_ids[: k + 1])) <= boundary:
            continue
        stop = text[boundary - 1 : boundary + 1]
        if (
            len(stop) == 2
            and stop.isprintable()
            and "\ufffd" not in stop
            and text.find(stop) == boundary - 1
            and tokenizer.decode(token_ids[:k]) == text[:boundary]
        ):
            return stop, boundary - 1, k
    return None


def test_stop_string_spanning_two_tokens(client, tokenizer):
    for seed_prompt in ([11, 12, 13], [40, 41, 42, 43], [7, 300, 9], [200, 201]):
        greedy = client.completions.create(
            model="tiny",
            prompt=seed_prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        token_ids = greedy.choices[0].model_extra["token_ids"]
        found = _stop_spanning_two_tokens(tokenizer, token_ids)
        if found:
            break
    assert found, "no greedy output with a stop string across two tokens"
    stop, at, _ = found
    resp = client.completions.create(
        model="tiny", prompt=seed_prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == tokenizer.decode(token_ids)[:at]
    assert resp.usage.completion_tokens < 24


def test_generate_returns_text_and_a_chrome_trace(stack, tokenizer):
    status, body = call(
        stack.gateway.port,
        "POST",
        "/generate",
        {"prompt": "Hi there", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "debug_timeline": True},
    )
    assert status == 200 and body["id"].startswith("gen-") and len(body["token_ids"]) == 5
    assert body["text"] == tokenizer.decode(body["token_ids"])
    events = body["timeline"]["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in complete)
    # one trace process per pipeline stage, each with the request's steps: a prefill and one
    # step per further token (stages report as compute ends, ahead of the hand-off)
    per_stage = {}
    for e in complete:
        if e["cat"] == "stage":
            per_stage[e["pid"]] = per_stage.get(e["pid"], 0) + 1
    assert set(per_stage) == {2, 3}, per_stage
    assert per_stage[3] >= 5 and per_stage[2] >= 4, per_stage
    assert {"request", "queued"} <= {e["name"] for e in complete}
    status, plain = call(stack.gateway.port, "POST", "/generate", {"prompt": "Hi there", "max_tokens": 2})
    assert status == 200 and "timeline" not in plain


def test_health_models_metrics_and_reflection(stack):
    port = stack.gateway.port
    assert call(port, "GET", "/health") == (200, {"status": "ok"})
    status, models = call(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    status, text = call(port, "GET", "/metrics", raw=True)
    assert status == 200
    for name in (
        "pagoda:request_success_total",
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:inter_token_latency_seconds_bucket",
        "pagoda:e2e_request_latency_seconds_bucket",
    ):
        assert name in text
    status, openapi = call(port, "GET", "/openapi.json")
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/health"} <= set(openapi["paths"])

    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(stack.gateway.health_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
        # grpc.reflection.v1 answers too (grpcurl asks it first)
        v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="pagoda.v1.Generation"),
        ]
        v1_replies = list(v1(iter(requests), timeout=30))
    assert {
        "pagoda.v1.Generation",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert names == {s.name for s in v1_replies[0].list_services_response.service}
    assert v1_replies[1].file_descriptor_response.file_descriptor_proto  # the service's .proto

    # the public gRPC API takes no larger request than REST does (issue 16: it took 64 MiB)
    from services.pb import gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(stack.gateway.health_address) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(gateway_pb2.TextGenerateRequest(text="a" * (MAX_BODY_BYTES + 1)), timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _chunked(port, path, body: bytes):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(
        "POST",
        path,
        iter([body[i : i + 4096] for i in range(0, len(body), 4096)]),
        {"Content-Type": "application/json"},
        encode_chunked=True,
    )
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


LONG = list(range(5, 5 + MAX_MODEL_LEN))
BAD = [
    # (path, body, status, param): each refused with an OpenAI error object naming the field
    ("/v1/completions", b'{"prompt": "a", ', 400, None),
    ("/v1/completions", b"not json at all", 400, None),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a " * 2000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "bogus_field": 1}, 400, "bogus_field"),
    ("/v1/completions", {"prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
    ("/generate", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/generate", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "a" * (MAX_BODY_BYTES + 10)}).encode(), 413, None),
]


def test_bad_input_gets_an_openai_error_naming_the_field(stack):
    port = stack.gateway.port
    failures = []
    for path, body, status, param in BAD:
        got_status, got = call(port, "POST", path, body)
        error = got.get("error", {}) if isinstance(got, dict) else {}
        if (got_status, error.get("param"), error.get("type")) != (
            status,
            param,
            "invalid_request_error",
        ) or not error.get("message"):
            failures.append((path, str(body)[:80], got_status, got))
    assert not failures, failures
    status, body = _chunked(port, "/v1/completions", json.dumps({"prompt": "b" * (MAX_BODY_BYTES * 3 // 2)}).encode())
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, _ = call(port, "GET", "/health")
    assert status == 200


def _wait_used_blocks(stack, done, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not done(used := kv_stats(stack)["num_used_blocks"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


def _num_aborted(port) -> float:
    """The gateway's count of choices that ended "abort" (issue 28: a client that left)."""
    _, text = call(port, "GET", "/metrics", raw=True)
    found = re.search(r'^pagoda:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(stack, stream):
    aborted = _num_aborted(stack.gateway.port)
    conn = http.client.HTTPConnection("127.0.0.1", stack.gateway.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {"prompt": list(range(10, 90)), "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True, "stream": stream}
        ),
        {"Content-Type": "application/json"},
    )
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        events = 0
        while events < 5:
            events += resp.fp.readline().startswith(b"data: ")
    during = _wait_used_blocks(stack, lambda used: used > 0)
    conn.sock.shutdown(2)
    conn.close()
    assert during > 0
    assert _wait_used_blocks(stack, lambda used: used == 0) == 0
    deadline = time.monotonic() + 5
    while _num_aborted(stack.gateway.port) == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _num_aborted(stack.gateway.port) == aborted + 1  # and the gateway's metrics count it


def test_api_keys_rate_limits_in_redis_and_a_graceful_drain(stack, model_dir, tmp_path):
    from support.redis_server import RedisServer

    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"sk-good": {"tenant": "team-a", "priority": 1}, "sk-limited": {"requests_per_minute": 1}})
    )
    redis_server = RedisServer(tmp_path)
    gateway = start_gateway(
        "gateway-keys",
        model_dir,
        stack.scheduler_address,
        stack.logs,
        "--api-keys-file",
        str(keys),
        "--grace-period",
        "20",
        "--redis-url",
        redis_server.url,
    )
    try:
        # a key's rate limit, its bucket in Redis (the process's own flags and keys file)
        limited = openai.OpenAI(
            base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="sk-limited", max_retries=0, timeout=60
        )
        name = Path(model_dir).name
        assert limited.completions.create(model=name, prompt="a", max_tokens=2).choices
        with pytest.raises(openai.RateLimitError) as refused:
            limited.completions.create(model=name, prompt="a", max_tokens=2)
        assert int(refused.value.response.headers["retry-after"]) > 0
        assert redis_server.client.keys("pagoda:ratelimit:*")

        base = f"http://127.0.0.1:{gateway.port}/v1"
        for key in (None, "sk-wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            status, body = call(gateway.port, "POST", "/v1/completions", {"prompt": "a"}, headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base, api_key="sk-good", max_retries=0, timeout=60)
        assert good.completions.create(model=Path(model_dir).name, prompt="a", max_tokens=3).choices[0].finish_reason
        assert call(gateway.port, "GET", "/health")[0] == 200  # no key needed

        # SIGTERM mid-stream: the stream finishes, then the process exits; nothing new gets in
        stream = good.completions.create(
            model=Path(model_dir).name,
            prompt="a",
            max_tokens=300,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        gateway.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while check_health(gateway.health_address, timeout_s=0.5) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not check_health(gateway.health_address, timeout_s=0.5)
        assert gateway.process.poll() is None  # still draining: the stream is in flight
        rest = list(stream)
        assert first.choices and rest[-1].choices[0].finish_reason == "length"
        assert gateway.process.wait(timeout=20) == 0
        with pytest.raises(ConnectionRefusedError):
            call(gateway.port, "GET", "/health")
    finally:
        gateway.stop()
        redis_server.stop()


def test_one_trace_links_gateway_scheduler_and_both_stages(stack, client):
    """OpenTelemetry: the gateway's span is the root; the scheduler's and each stage's hang under it."""
    client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    path = stack.logs / "spans.jsonl"
    for _ in range(50):
        spans = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        roots = [sp for sp in spans if sp["name"] == "gateway.request"]
        if roots:
            trace_id = roots[-1]["trace_id"]
            mine = [sp for sp in spans if sp["trace_id"] == trace_id]
            if {"gateway", "scheduler", "worker-0", "worker-1"} <= {sp["service"] for sp in mine}:
                break
        time.sleep(0.1)
    root = roots[-1]
    by_name = {}
    for sp in mine:
        by_name.setdefault(sp["name"], []).append(sp)
    # (the root's own parent is the client's span when its HTTP request carried a traceparent)
    assert by_name["scheduler.request"][0]["parent_span_id"] == root["span_id"]
    sched_id = by_name["scheduler.request"][0]["span_id"]
    for name in ("stage0.compute", "stage1.compute"):
        assert by_name[name] and all(sp["parent_span_id"] == sched_id for sp in by_name[name])


def test_generated_grpc_client_against_the_served_gateway(stack, reference):
    """The public gRPC API of the `pagoda serve` gateway, through a generated stub."""
    from services.pb import gateway_pb2, gateway_pb2_grpc

    prompt = [5, 17, 300, 42, 9, 11]

    async def go():
        async with aio_channel(stack.gateway.health_address) as channel:
            stub = gateway_pb2_grpc.GenerationStub(channel)
            req = gateway_pb2.TextGenerateRequest(model="tiny")
            req.token_ids.ids.extend(prompt)
            req.options.sampling_params.max_tokens = 10
            req.options.sampling_params.temperature = 0.0
            req.options.sampling_params.ignore_eos = True
            ids, text, usage = [], "", None
            async for msg in stub.Generate(req):
                for delta in msg.choices:
                    ids.extend(delta.token_ids)
                    text += delta.text
                if msg.HasField("usage"):
                    usage = msg.usage
            return ids, text, usage

    ids, text, usage = asyncio.run(go())
    assert len(ids) == 10 and usage.num_completion_tokens == 10
    assert reference.compare(prompt, ids).tie_divergences == 0


def test_logprob_tokens_name_their_bytes_and_stream_as_whole(stack, tokenizer):
    """Alternatives that decode to U+FFFD (parts of characters) keep their own keys, labelled
    by their bytes; chat entries carry the bytes; streamed and whole responses agree."""
    port, prompt = stack.gateway.port, [5, 17, 300, 42]  # under a block: no prefix hit
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 20,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, whole = call(port, "POST", "/v1/completions", body)
    assert status == 200
    lp, ids = whole["choices"][0]["logprobs"], whole["choices"][0]["token_ids"]
    assert all(len(top) == 20 for top in lp["top_logprobs"])  # greedy: the sampled one among them
    # positions offering several parts of characters: each once U+FFFD, one key for them all
    assert any(sum(key.startswith("bytes:\\x") for key in top) >= 2 for top in lp["top_logprobs"])
    assert lp["tokens"] == [_label(tokenizer.token_bytes(token_id)) for token_id in ids]
    status, text = call(port, "POST", "/v1/completions", {**body, "stream": True}, raw=True)
    assert status == 200
    streamed = {key: [] for key in lp}
    for event in text.split("\n\n"):
        if event and event != "data: [DONE]":
            for choice in json.loads(event[len("data: ") :])["choices"]:
                for key in streamed:
                    streamed[key] += (choice["logprobs"] or {}).get(key, [])
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert [list(top) for top in streamed["top_logprobs"]] == [list(top) for top in lp["top_logprobs"]]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)

    status, chat = call(
        port,
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 20,
            "ignore_eos": True,
        },
    )
    assert status == 200
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert all(e["token"] == _label(bytes(e["bytes"])) for e in [entry, *entry["top_logprobs"]])
        assert len({e["token"] for e in entry["top_logprobs"]}) == 20


def _label(raw: bytes) -> str:
    """A token's text in OpenAI's log-probabilities: its text, or its bytes where they are not
    UTF-8 on their own."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_tokenize_is_what_chat_sends_and_detokenize_reverses_it(stack):
    port, messages = stack.gateway.port, [{"role": "user", "content": "Hi there"}]
    status, chat = call(
        port,
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_completion_tokens": 2, "temperature": 0, "return_token_ids": True},
    )
    assert status == 200 and chat["usage"]["completion_tokens"] <= 2
    status, tokens = call(port, "POST", "/tokenize", {"model": "tiny", "messages": messages})
    assert status == 200 and tokens["tokens"] == chat["prompt_token_ids"]
    assert tokens["count"] == chat["usage"]["prompt_tokens"] and tokens["max_model_len"] == MAX_MODEL_LEN
    status, text = call(port, "POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and text["prompt"].startswith("<|im_start|>user\nHi there")
    status, error = call(port, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and error["error"]["param"] == "tokens"


def test_echo_with_logprobs_and_prompt_logprobs_score_the_prompt(client, reference, tokenizer):
    """What evaluation harnesses send (lm-eval's loglikelihood: echo, logprobs, max_tokens 1):
    the prompt's tokens come back first with their log-probabilities, equal to transformers'."""
    import torch

    prompt = [5, 17, 300, 42, 99, 7, 256, 311, 40]
    with torch.no_grad():
        logits = reference.model(input_ids=torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert abs(lp.token_logprobs[i] - float(want[i - 1, prompt[i]])) < 1e-4
        assert len(lp.top_logprobs[i]) >= 2
    assert choice.text.startswith(tokenizer.decode(prompt, skip_special_tokens=False))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    # max_tokens 0 (lm-eval's scoring request, as vLLM takes it): the prompt alone, scored
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    only = scored.choices[0]
    assert only.text == tokenizer.decode(prompt, skip_special_tokens=False)
    assert only.logprobs.tokens == lp.tokens[: len(prompt)] and only.logprobs.token_logprobs[0] is None
    assert only.logprobs.token_logprobs[1:] == lp.token_logprobs[1 : len(prompt)]
    assert only.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(prompt)
    empty = client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert empty.choices[0].text == "" and empty.usage.completion_tokens == 0

    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert text == whole.choices[0].text and tokens == whole.choices[0].logprobs.tokens

    vllm = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    scored = vllm.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    for i in range(1, len(prompt)):
        entry = scored[i][str(prompt[i])]
        assert abs(entry["logprob"] - float(want[i - 1, prompt[i]])) < 1e-4 and entry["rank"] >= 1
        assert len(scored[i]) >= 3
    assert (
        vllm.choices[0].text
        == client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).choices[0].text
    )  # echo off

    # echoed prompt tokens carry as many alternatives as the generated ones (logprobs=1),
    # even when prompt_logprobs asked for more
    both = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 5},
    )
    assert all(len(top) <= 2 for top in both.choices[0].logprobs.top_logprobs[1:])
    assert len(both.choices[0].model_extra["prompt_logprobs"][1]) >= 5
    # ...and the other way round: prompt_logprobs=0 gives the prompt token alone
    other = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=5,
        extra_body={"prompt_logprobs": 0},
    )
    assert all(len(e) == 1 for e in other.choices[0].model_extra["prompt_logprobs"][1:])
    assert len(other.choices[0].logprobs.top_logprobs[1]) >= 5
    # a one-token prompt: its token comes back, with nothing to score it by
    one = client.completions.create(
        model="tiny", prompt=[65], max_tokens=1, temperature=0, echo=True, logprobs=1, extra_body={"prompt_logprobs": 1}
    )
    lp = one.choices[0].logprobs
    assert len(lp.tokens) == 2 and lp.token_logprobs[0] is None and lp.token_logprobs[1] is not None
    assert one.choices[0].model_extra["prompt_logprobs"] == [None]


def test_chat_prompt_logprobs_score_the_templated_prompt(client, reference, tokenizer):
    import torch

    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    prompt = tokenizer.encode_chat(messages)
    scored = chat.model_extra["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    with torch.no_grad():
        want = torch.log_softmax(reference.model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    for i in range(1, len(prompt)):
        assert abs(scored[i][str(prompt[i])]["logprob"] - float(want[i - 1, prompt[i]])) < 1e-4


def test_pagoda_bench_compares_two_openai_servers_in_one_table(stack, model_dir, tmp_path):
    """`pagoda bench --base-url` drives any OpenAI-compatible server: here `pagoda serve`'s
    gateway and a second gateway, in one command, into one table and serving.json."""
    import subprocess

    second = start_gateway(
        "gateway-bench", model_dir, stack.scheduler_address, stack.logs, "--served-model-name", "tiny"
    )
    try:
        done = subprocess.run(
            pagoda_command(
                "bench",
                "--base-url",
                f"serve=http://127.0.0.1:{stack.gateway.port}",
                "--base-url",
                f"second=http://127.0.0.1:{second.port}/v1",
                "--model",
                "tiny",
                "--tokenizer",
                model_dir,
                "--workload",
                "short",
                "--num-requests",
                "6",
                "--concurrency",
                "3",
                "--out",
                str(tmp_path),
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        wrong = subprocess.run(
            pagoda_command(
                "bench",
                "--base-url",
                f"http://127.0.0.1:{second.port}",
                "--model",
                "nope",
                "--tokenizer",
                model_dir,
                "--num-requests",
                "2",
                "--out",
                str(tmp_path / "wrong"),
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        second.stop()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "serving.json").read_text())
    assert [s["label"] for s in result["servers"]] == ["serve", "second"]
    for s in result["servers"]:
        assert s["completed"] == 6 and s["failed"] == 0 and s["total_output_tokens"] == 6 * 4
        assert s["output_throughput"] > 0 and s["median_ttft_ms"] > 0 and s["request_goodput"] > 0
    assert "| serve |" in done.stdout and "| second |" in done.stdout
    assert (tmp_path / "serving.md").read_text().count("| s") >= 2
    assert wrong.returncode == 1 and "not 'nope'" in wrong.stderr
