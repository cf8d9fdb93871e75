"""Per-key rate limits: the in-process token buckets under an injected clock, the REST
API's 429 (OpenAI's error, `Retry-After`), per-key and anonymous limits, the paths left
unlimited, and the public gRPC API's RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx2 as httpx
import pytest

from gateway.app import create_app
from gateway.config import ApiKey, GatewayConfig, load_api_keys
from gateway.generation import ChoiceDelta, Finished, Usage
from gateway.grpc_api import add_generation_service
from gateway.ratelimit import ANONYMOUS, InProcessBuckets, RateLimit, RateLimiter, RateLimitExceeded, key_id, token_cost
from services.grpc_utils import aio_channel, create_aio_server
from services.pb import gateway_pb2, gateway_pb2_grpc
from services.text import Tokenizer

MAX_MODEL_LEN = 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(rpm=None, tpm=None) -> tuple[RateLimiter, Clock]:
    clock = Clock()
    return RateLimiter(RateLimit(rpm, tpm), InProcessBuckets(clock)), clock


async def refused(lim: RateLimiter, tokens: int, bucket: str = "k", own: RateLimit | None = None) -> RateLimitExceeded:
    with pytest.raises(RateLimitExceeded) as info:
        await lim.admit(bucket, own, tokens)
    return info.value


# --- the buckets ----------------------------------------------------------------------------


def test_a_full_bucket_bursts_then_refuses_with_the_wait():
    async def main():
        lim, _ = limiter(rpm=3)
        for _ in range(3):
            await lim.admit("k", None, 10)
        exc = await refused(lim, 10)
        assert exc.kind == "requests"
        assert exc.retry_after_s == pytest.approx(20.0)  # one request per 20 s
        assert exc.retry_after_header == "20"
        assert "requests per min (RPM): Limit 3" in exc.message and "20s" in exc.message
        assert lim.refusals.labels("requests")._value.get() == 1

    asyncio.run(main())


def test_the_bucket_refills_continuously_and_caps_at_the_limit():
    async def main():
        lim, clock = limiter(tpm=600)  # 10 tokens per second
        await lim.admit("k", None, 600)
        exc = await refused(lim, 15)
        assert exc.kind == "tokens" and exc.retry_after_s == pytest.approx(1.5)
        assert exc.retry_after_header == "2"  # rounded up
        clock.now += 1.0
        exc = await refused(lim, 15)
        assert exc.retry_after_s == pytest.approx(0.5)
        clock.now += 0.5
        await lim.admit("k", None, 15)
        clock.now += 3600  # idle for an hour: full, not more
        await lim.admit("k", None, 600)
        await refused(lim, 1)

    asyncio.run(main())


def test_both_buckets_or_neither():
    async def main():
        lim, clock = limiter(rpm=2, tpm=100)
        await lim.admit("k", None, 90)
        for _ in range(3):  # refused by tokens: no request is taken either
            assert (await refused(lim, 20)).kind == "tokens"
        await lim.admit("k", None, 10)  # the second request still fits
        exc = await refused(lim, 1)  # now the requests bucket is empty, tokens untouched
        assert exc.kind == "requests"
        clock.now += 30  # one request back, 50 tokens back
        exc = await refused(lim, 60)  # refused by tokens: nothing taken
        assert exc.kind == "tokens" and exc.retry_after_s == pytest.approx(6.0)
        await lim.admit("k", None, 50)

    asyncio.run(main())


def test_the_longest_wait_names_the_limit_and_buckets_are_per_key():
    async def main():
        lim, _ = limiter(rpm=1, tpm=60)
        await lim.admit("a", None, 60)
        exc = await refused(lim, 30, "a")
        assert exc.kind == "requests" and exc.retry_after_s == pytest.approx(60.0)
        await lim.admit("b", None, 60)  # another key, its own buckets

    asyncio.run(main())


def test_a_request_larger_than_the_bucket_is_refused_without_retry_after():
    async def main():
        lim, _ = limiter(rpm=10, tpm=100)
        exc = await refused(lim, 101)
        assert exc.kind == "tokens" and exc.retry_after_s is None
        assert exc.retry_after_header is None
        assert "Request too large" in exc.message and "max_tokens" in exc.message
        await lim.admit("k", None, 100)  # and it took nothing

    asyncio.run(main())


def test_own_limits_override_the_defaults_per_kind():
    async def main():
        lim, _ = limiter(rpm=1, tpm=1000)
        own = RateLimit(requests_per_minute=5)
        assert lim.limit_for(own) == RateLimit(5, 1000)
        for _ in range(5):
            await lim.admit("k", own, 1)
        await refused(lim, 1, own=own)
        lim2, _ = limiter()
        for _ in range(100):  # neither own nor default limits: never refused
            await lim2.admit("k", RateLimit(), 10**9)

    asyncio.run(main())


def test_token_cost_and_key_ids():
    assert token_cost([10], 5, 1, 64) == 15
    assert token_cost([10], None, 1, 64) == 64  # unset max_tokens: the rest of the context
    assert token_cost([10, 20], 5, 3, 64) == 10 + 15 + 20 + 15
    assert key_id(None) == ANONYMOUS
    assert key_id("sk-a") == key_id("sk-a") != key_id("sk-b")
    assert "sk-a" not in key_id("sk-a") and len(key_id("sk-a")) == 32


def test_config_and_keys_file_carry_the_limits(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps({"sk-a": {"tenant": "t", "requests_per_minute": 5, "tokens_per_minute": 1000}, "sk-b": {}})
    )
    keys = load_api_keys(path)
    assert keys["sk-a"].rate_limit == RateLimit(5, 1000)
    assert keys["sk-b"].rate_limit == RateLimit()
    for bad in (0, -1, "5", True, 1.5):
        path.write_text(json.dumps({"sk-a": {"requests_per_minute": bad}}))
        with pytest.raises(ValueError, match="entry 0: requests_per_minute"):
            load_api_keys(path)
    base = {"model": "m", "scheduler_address": "s:1"}
    assert not GatewayConfig(**base).rate_limits_enabled
    assert GatewayConfig(**base, rate_limit_tpm=10).rate_limits_enabled
    assert GatewayConfig(**base, api_keys={"k": ApiKey(requests_per_minute=1)}).rate_limits_enabled
    with pytest.raises(ValueError, match="rate_limit_rpm|requests_per_minute"):
        GatewayConfig(**base, rate_limit_rpm=0)
    with pytest.raises(ValueError, match="redis_url"):
        GatewayConfig(**base, redis_url="localhost:6379")


def test_cli_flags_and_environment(monkeypatch):
    from wiring.cli import build_parser

    args = build_parser().parse_args(
        ["gateway", "--model", "m", "--scheduler", "s:1", "--rate-limit-rpm", "60", "--redis-url", "redis://r:6379/0"]
    )
    assert (args.rate_limit_rpm, args.rate_limit_tpm, args.redis_url) == (60, None, "redis://r:6379/0")
    monkeypatch.setenv("PAGODA_RATE_LIMIT_TPM", "5000")
    monkeypatch.setenv("PAGODA_RATE_LIMIT_RPM", "")  # compose's unset variable: no limit
    args = build_parser().parse_args(["gateway", "--model", "m", "--scheduler", "s:1"])
    assert (args.rate_limit_rpm, args.rate_limit_tpm, args.redis_url) == (None, 5000, None)


# --- the REST API ---------------------------------------------------------------------------


class FakeGenerator:
    """`TextGenerator`'s interface: one delta per choice, then usage; records each call."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = MAX_MODEL_LEN
        self.calls = 0

    async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
        self.calls += 1
        for i in range(params.sampling.n):
            yield ChoiceDelta(i, "hi", [1], [], finish_reason="length")
        yield Finished(Usage(len(prompt_ids), params.sampling.n))

    async def health(self, timeout_s: float = 2.0):
        return True, ""


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


def make_client(tokenizer, **config):
    generator, clock = FakeGenerator(tokenizer), Clock()
    cfg = GatewayConfig(
        model=str(tokenizer.model_dir),
        scheduler_address="unused:1",
        served_model_names=("tiny",),
        max_model_len=MAX_MODEL_LEN,
        **config,
    )
    app = create_app(cfg, generator, rate_limit_clock=clock)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return client, generator, clock


async def post(client, path, body, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await client.post(path, json=body, headers=headers)


COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 5}


def test_no_limits_no_limiter(tokenizer):
    cfg = GatewayConfig(
        model=str(tokenizer.model_dir), scheduler_address="unused:1", api_keys={"sk-a": ApiKey(tenant="t")}
    )
    assert create_app(cfg, FakeGenerator(tokenizer)).state.gateway.limiter is None


def test_429_with_retry_after_and_openai_error(tokenizer):
    async def main():
        client, generator, clock = make_client(tokenizer, rate_limit_rpm=2)
        async with client:
            for path, body in (
                ("/v1/completions", COMPLETION),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
            ):
                assert (await post(client, path, body)).status_code == 200
            calls = generator.calls
            for path, body in (
                ("/v1/completions", COMPLETION),
                ("/v1/completions", {**COMPLETION, "stream": True}),
                ("/generate", {"prompt": "hi", "max_tokens": 5}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                r = await post(client, path, body)
                assert r.status_code == 429, (path, r.text)
                assert r.headers["retry-after"] == "30"
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
                assert "requests per min (RPM): Limit 2" in err["message"]
                assert "anonymous" in err["message"]
            assert generator.calls == calls  # nothing reached the scheduler
            for path in ("/health", "/metrics", "/v1/models"):  # never limited
                assert (await client.get(path)).status_code == 200, path
            assert (await post(client, "/tokenize", {"prompt": "hi"})).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'pagoda:rate_limit_refusals_total{limit="requests"} 4.0' in metrics
            assert (await post(client, "/v1/completions", {**COMPLETION, "n": 0})).status_code == 400
            clock.now += 30  # one request back
            assert (await post(client, "/generate", {"prompt": "hi", "max_tokens": 5})).status_code == 200
            assert (await post(client, "/generate", {"prompt": "hi"})).status_code == 429

    asyncio.run(main())


def test_one_key_limited_another_not(tokenizer):
    async def main():
        keys = {
            "sk-small": ApiKey(tenant="a", tokens_per_minute=20),
            "sk-free": ApiKey(tenant="b"),
            "sk-default": ApiKey(tenant="c"),
        }
        client, _, _ = make_client(tokenizer, api_keys=keys)
        async with client:
            ok = await post(client, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 10}, "sk-small")
            assert ok.status_code == 200
            r = await post(client, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 10}, "sk-small")
            assert r.status_code == 429 and r.headers["retry-after"] == "18"  # 9 tokens at 1/3 s
            assert "tokens per min (TPM): Limit 20" in r.json()["error"]["message"]
            assert "this API key" in r.json()["error"]["message"]
            for _ in range(5):
                r = await post(client, "/v1/completions", {"prompt": [1, 2, 3]}, "sk-free")
                assert r.status_code == 200
            # chat's max_tokens unset costs the whole context: over this key's bucket, for good
            r = await post(
                client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "sk-small"
            )
            assert r.status_code == 429 and "retry-after" not in r.headers
            assert r.headers["x-should-retry"] == "false"
            assert "Request too large" in r.json()["error"]["message"]

    asyncio.run(main())


def test_a_second_authorization_header_cannot_pick_another_bucket(tokenizer):
    """Found in review: the middleware authenticated the last Authorization header and the
    charge read the first, so junk first headers each got a fresh bucket."""

    async def main():
        client, _, _ = make_client(tokenizer, api_keys={"sk-a": ApiKey(requests_per_minute=1)})
        async with client:
            assert (await post(client, "/v1/completions", COMPLETION, "sk-a")).status_code == 200
            assert (await post(client, "/v1/completions", COMPLETION, "sk-a")).status_code == 429
            two = await client.post(
                "/v1/completions",
                json=COMPLETION,
                headers=[("Authorization", "Bearer junk0"), ("Authorization", "Bearer sk-a")],
            )
            assert two.status_code == 400 and "more than one Authorization" in two.text

    asyncio.run(main())


def test_bucket_ids_are_keyed_by_the_configured_keys():
    from gateway.ratelimit import key_salt

    salt = key_salt(["sk-a", "sk-b"])
    assert key_salt(["sk-b", "sk-a"]) == salt != key_salt(["sk-a"])
    assert key_id("sk-a", salt) != key_id("sk-a") and len(key_id("sk-a", salt)) == 32


def test_default_limits_apply_to_keys_without_their_own(tokenizer):
    async def main():
        keys = {"sk-a": ApiKey(), "sk-b": ApiKey(requests_per_minute=3)}
        client, _, _ = make_client(tokenizer, api_keys=keys, rate_limit_rpm=1)
        async with client:
            assert (await post(client, "/generate", {"prompt": "x", "max_tokens": 1}, "sk-a")).status_code == 200
            assert (await post(client, "/generate", {"prompt": "x", "max_tokens": 1}, "sk-a")).status_code == 429
            for _ in range(3):
                assert (await post(client, "/generate", {"prompt": "x", "max_tokens": 1}, "sk-b")).status_code == 200
            assert (await post(client, "/generate", {"prompt": "x", "max_tokens": 1}, "sk-b")).status_code == 429

    asyncio.run(main())


# --- the public gRPC API --------------------------------------------------------------------


def test_grpc_resource_exhausted(tokenizer):
    async def main():
        generator, clock = FakeGenerator(tokenizer), Clock()
        config = GatewayConfig(
            model=str(tokenizer.model_dir),
            scheduler_address="unused:1",
            served_model_names=("tiny",),
            max_model_len=MAX_MODEL_LEN,
            api_keys={"sk-a": ApiKey(requests_per_minute=1)},
        )
        lim = RateLimiter.create(config.default_rate_limit, clock=clock)
        server, port, _ = create_aio_server("127.0.0.1:0")
        add_generation_service(server, generator, config, lim)
        await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}") as channel:
                stub = gateway_pb2_grpc.GenerationStub(channel)
                meta = (("authorization", "Bearer sk-a"),)
                req = gateway_pb2.TextGenerateRequest(text="hi")
                req.options.sampling_params.max_tokens = 4
                assert [m async for m in stub.Generate(req, metadata=meta)]
                chat = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
                for call in (stub.Generate(req, metadata=meta), stub.Chat(chat, metadata=meta)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        _ = [m async for m in call]
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "requests per min (RPM): Limit 1" in info.value.details()
                    assert dict(info.value.trailing_metadata())["retry-after"] == "60"
                assert generator.calls == 1
                clock.now += 60
                assert [m async for m in stub.Generate(req, metadata=meta)]
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_serve_refuses_a_zero_limit_and_bad_environment_values():
    import subprocess
    import sys

    def pagoda(*args, env=None):
        import os

        return subprocess.run(
            [sys.executable, "-m", "wiring.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **(env or {})},
        )

    zero = pagoda("serve", "--rate-limit-rpm", "0")
    assert zero.returncode == 2 and "positive integer" in zero.stderr
    bad = pagoda("worker", "--help", env={"PAGODA_RATE_LIMIT_RPM": "0"})
    assert bad.returncode != 0 and "PAGODA_RATE_LIMIT_RPM" in bad.stderr and "Traceback" not in bad.stderr


def test_redis_passwords_stay_out_of_messages():
    from gateway.ratelimit import redacted_url

    assert redacted_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted_url("rediss://user:pw@host:1/2") == "rediss://user:***@host:1/2"
    assert redacted_url("redis://redis:6379/0") == "redis://redis:6379/0"
    with pytest.raises(ValueError) as exc:
        GatewayConfig(model="m", scheduler_address="x:1", redis_url="http://:s3cret@h:1")
    assert "s3cret" not in str(exc.value)
