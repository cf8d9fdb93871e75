"""Per-API-key rate limits: requests per minute and tokens per minute, as token buckets.

Each key (or the one "anonymous" bucket when the gateway runs without keys) has up to two
buckets, one for requests and one for tokens. A bucket holds at most its per-minute limit
and refills continuously at limit/60 per second, so a quiet key may burst up to its whole
minute's budget and then runs at the steady rate. A request costs 1 request and
`prompt tokens + max_tokens` tokens (`max_tokens` unset: the rest of the context; with
`n` choices, `n * max_tokens`), charged once at admission, after validation. Both buckets
are checked and taken together: when either refuses, nothing is taken.

A request whose token cost exceeds the bucket's capacity could never be served; it is
refused at once with 429 and no `Retry-After` (as OpenAI answers "Request too large ... on
tokens per min"), saying to lower `max_tokens` or the prompt. It is a 429 and not a 400
because the request is valid: the same body fits under a key with a larger budget.

Backends:

- `InProcessBuckets` (default): a dict in this process, with an injectable clock. Every
  replica has its own budget.
- `RedisBuckets` (`--redis-url`): the buckets live in Redis and every gateway replica that
  points at the same Redis shares them. One Lua script checks and takes both buckets
  atomically; its keys, `pagoda:ratelimit:{<key id>}:requests` and `...:tokens` (one hash
  tag, so a cluster keeps them in one slot), expire once idle long enough to be full again,
  so idle keys vanish. The key id is a SHA-256 digest: raw API keys never reach Redis.
  Time is Redis's own clock (`TIME`) unless a clock is injected, so replicas whose clocks
  disagree still agree on the buckets.

  **Redis unreachable: fail open.** A request is served unlimited when Redis cannot be
  asked (connection refused, timeout, any Redis error): a rate limiter outage must not take
  the API down. Each request so admitted is counted (`pagoda:rate_limit_fail_open`), a
  warning is logged at most every `WARN_EVERY_S` seconds, and after a failure Redis is not
  asked again for `RETRY_AFTER_ERROR_S`; then one request at a time asks it (the others are
  served meanwhile), so that a dead or hung Redis costs requests no timeout each.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
KINDS = ("requests", "tokens")
_UNITS = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}
WARN_EVERY_S = 10.0
RETRY_AFTER_ERROR_S = 1.0
REDIS_TIMEOUT_S = 0.25


@dataclass(frozen=True)
class RateLimit:
    """A bucket owner's limits; None: that kind is not limited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer or unset, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def capacity(self, kind: str) -> int | None:
        return self.requests_per_minute if kind == "requests" else self.tokens_per_minute

    def or_else(self, default: RateLimit) -> RateLimit:
        """Each kind this limit leaves unset taken from `default`."""
        return RateLimit(
            self.requests_per_minute if self.requests_per_minute is not None else default.requests_per_minute,
            self.tokens_per_minute if self.tokens_per_minute is not None else default.tokens_per_minute,
        )


@dataclass(frozen=True)
class Decision:
    """A backend's answer. Refused: `waits` holds, for each refusing kind, the seconds until
    its bucket holds the cost."""

    allowed: bool
    waits: tuple[tuple[str, float], ...] = ()


class RateLimitExceeded(Exception):
    """A refusal: which limit, the message for the client and, unless retrying cannot
    help (`retry_after_s` None: the request is larger than the bucket), when to retry."""

    def __init__(self, kind: str, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str | None:
        """`Retry-After` in whole seconds, rounded up (at least 1)."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


def token_cost(prompt_lens: Iterable[int], max_tokens: int | None, n: int, max_model_len: int) -> int:
    """What a request may use: each prompt plus `n` times what it may generate (`max_tokens`,
    or the rest of the context when unset)."""
    total = 0
    for length in prompt_lens:
        generate = max_tokens if max_tokens is not None else max(0, max_model_len - length)
        total += length + n * generate
    return total


def redacted_url(url: str) -> str:
    """A Redis URL with its password (if any) replaced, fit for logs and error messages."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))


def key_salt(api_keys: Iterable[str]) -> bytes:
    """A secret every replica loading the same keys file derives alike, keying `key_id`:
    without the keys file, a stored id cannot be checked against guessed keys offline."""
    digest = hashlib.sha256(b"pagoda-ratelimit-salt\0")
    for key in sorted(api_keys):
        digest.update(hashlib.sha256(key.encode()).digest())
    return digest.digest()


def key_id(api_key: str | None, salt: bytes = b"") -> str:
    """The bucket id of a raw API key (None: the anonymous bucket): an HMAC keyed with
    `salt` (`key_salt` of the configured keys), so that the key itself is kept nowhere,
    Redis included; the same on every replica."""
    if api_key is None:
        return ANONYMOUS
    return hmac.new(b"pagoda-ratelimit\0" + salt, api_key.encode(), hashlib.sha256).hexdigest()[:32]


# --- the bucket arithmetic ------------------------------------------------------------------


def refill(level: float, updated_s: float, capacity: int, now_s: float) -> float:
    """The bucket's level at `now_s`: refilled at capacity/60 per second, capped."""
    return min(float(capacity), level + max(0.0, now_s - updated_s) * capacity / 60.0)


def wait_s(level: float, cost: int, capacity: int) -> float:
    """Seconds until a bucket at `level` holds `cost` (0: it does now)."""
    return 0.0 if level >= cost else (cost - level) * 60.0 / capacity


class Buckets(Protocol):
    async def take(self, bucket: str, limit: RateLimit, costs: Mapping[str, int]) -> Decision:
        """Takes `costs[kind]` from each limited kind's bucket, all or nothing."""
        ...

    async def close(self) -> None: ...


class InProcessBuckets:
    """The buckets in a dict: `(bucket, kind) -> (level, updated_s)`. Synchronous inside,
    so asyncio needs no lock; `clock` (seconds, monotonic) is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[tuple[str, str], tuple[float, float]] = {}

    def take_now(self, bucket: str, limit: RateLimit, costs: Mapping[str, int]) -> Decision:
        now = self.clock()
        levels: dict[str, float] = {}
        waits = []
        for kind in KINDS:
            capacity = limit.capacity(kind)
            if capacity is None:
                continue
            level, updated = self._state.get((bucket, kind), (float(capacity), now))
            levels[kind] = refill(level, updated, capacity, now)
            wait = wait_s(levels[kind], costs[kind], capacity)
            if wait > 0:
                waits.append((kind, wait))
        if waits:
            return Decision(False, tuple(waits))
        for kind, level in levels.items():
            self._state[(bucket, kind)] = (level - costs[kind], now)
        return Decision(True)

    async def take(self, bucket: str, limit: RateLimit, costs: Mapping[str, int]) -> Decision:
        return self.take_now(bucket, limit, costs)

    async def close(self) -> None:
        pass


# KEYS: the requests and the tokens bucket (hashes: level, ts).
# ARGV: now in seconds ("" = Redis's TIME), each bucket's capacity (0 = not limited), each
# cost, the keys' TTL in ms. Returns {1} when taken, else {0, wait_requests, wait_tokens}
# (strings: Redis truncates Lua numbers to integers).
_TAKE_LUA = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local levels, stamps, waits, refused = {}, {}, {'0', '0'}, false
for i = 1, 2 do
  local cap = tonumber(ARGV[1 + i])
  if cap > 0 then
    local cost = tonumber(ARGV[3 + i])
    local s = redis.call('HMGET', KEYS[i], 'level', 'ts')
    local level, ts = tonumber(s[1]), tonumber(s[2])
    if level == nil or ts == nil then level, ts = cap, now end
    if now > ts then level = math.min(cap, level + (now - ts) * cap / 60) end
    levels[i], stamps[i] = level, math.max(ts, now)
    if level < cost then
      refused = true
      waits[i] = tostring((cost - level) * 60 / cap)
    end
  end
end
if refused then return {0, waits[1], waits[2]} end
for i = 1, 2 do
  if levels[i] then
    redis.call('HSET', KEYS[i], 'level', string.format('%.6f', levels[i] - tonumber(ARGV[3 + i])),
               'ts', string.format('%.6f', stamps[i]))
    redis.call('PEXPIRE', KEYS[i], ARGV[6])
  end
end
return {1}
"""


class RedisBuckets:
    """The buckets in Redis, shared by every replica using the same Redis; fails open (see
    the module's docstring). `clock` None: Redis's own time."""

    TTL_MS = 61_000  # an idle bucket is full again after 60 s: then it may as well not exist

    def __init__(
        self,
        url: str,
        clock: Callable[[], float] | None = None,
        on_error: Callable[[], None] | None = None,
        timeout_s: float = REDIS_TIMEOUT_S,
    ) -> None:
        import redis.asyncio as aioredis  # only with --redis-url
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        self.url = url
        self.clock = clock
        self._client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self._client.register_script(_TAKE_LUA)  # EVALSHA, loading on a miss
        self._on_error = on_error
        self._errors = (RedisError, OSError, asyncio.TimeoutError)
        self._unreachable = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)
        self._skip_until = 0.0
        self._failing = False  # from a failure until Redis answers again
        self._probing = False  # a request is finding out whether Redis is back
        self._last_warning = -math.inf

    @staticmethod
    def redis_keys(bucket: str) -> list[str]:
        return [f"pagoda:ratelimit:{{{bucket}}}:{kind}" for kind in KINDS]

    async def take(self, bucket: str, limit: RateLimit, costs: Mapping[str, int]) -> Decision:
        now = time.monotonic()
        # failing open: Redis failed a moment ago, or while it has not answered since, one
        # request at a time finds out whether it is back (the others do not wait for it)
        if now < self._skip_until or (self._failing and self._probing):
            if self._on_error is not None:
                self._on_error()
            return Decision(True)
        probe = self._failing
        self._probing = self._probing or probe
        args: list[Any] = ["" if self.clock is None else repr(self.clock())]
        args += [limit.capacity(kind) or 0 for kind in KINDS]
        args += [costs[kind] for kind in KINDS]
        args.append(self.TTL_MS)
        try:
            reply = await self._script(keys=self.redis_keys(bucket), args=args)
        except self._errors as exc:
            self._failed(exc)
            return Decision(True)
        finally:
            if probe:
                self._probing = False
        self._failing = False
        if int(reply[0]) == 1:
            return Decision(True)
        waits = tuple((kind, float(w)) for kind, w in zip(KINDS, reply[1:], strict=True) if float(w) > 0)
        return Decision(False, waits)

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._failing = True
        self._skip_until = now + RETRY_AFTER_ERROR_S
        if self._on_error is not None:
            self._on_error()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            # a refused command (READONLY replica, NOPERM, OOM) will not heal by waiting: say so
            unreachable = isinstance(exc, self._unreachable)
            log.log(
                logging.WARNING if unreachable else logging.ERROR,
                "rate limits: Redis at %s %s (%r); serving without limits until it answers again",
                redacted_url(self.url),
                "is unreachable" if unreachable else "refused the rate-limit script",
                exc,
            )

    async def close(self) -> None:
        await self._client.aclose()


class RateLimiter:
    """Admission by key: `await admit(bucket, limit, prompt_tokens...)` returns, or raises
    RateLimitExceeded. One per gateway process, shared by REST and gRPC."""

    def __init__(self, default: RateLimit, buckets: Buckets, registry: CollectorRegistry | None = None) -> None:
        self.default = default
        self.buckets = buckets
        registry = registry if registry is not None else CollectorRegistry()
        self.refusals = Counter(
            "pagoda:rate_limit_refusals",
            "Requests refused by a rate limit, by the limit that refused.",
            ["limit"],
            registry=registry,
        )
        self.fail_open = Counter(
            "pagoda:rate_limit_fail_open",
            "Requests admitted unchecked because the rate limits' Redis was unreachable.",
            registry=registry,
        )

    @classmethod
    def create(
        cls,
        default: RateLimit,
        redis_url: str = "",
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] | None = None,
    ) -> RateLimiter:
        limiter = cls(default, InProcessBuckets(), registry)
        if redis_url:
            limiter.buckets = RedisBuckets(redis_url, clock, limiter.fail_open.inc)
        elif clock is not None:
            limiter.buckets = InProcessBuckets(clock)
        return limiter

    def limit_for(self, own: RateLimit | None) -> RateLimit:
        return (own or RateLimit()).or_else(self.default)

    async def admit(self, bucket: str, own: RateLimit | None, tokens: int) -> None:
        """Charges 1 request and `tokens` tokens to `bucket` under its own limits (falling
        back to the defaults per kind), or raises RateLimitExceeded taking nothing."""
        limit = self.limit_for(own)
        if not limit.enabled:
            return
        who = "this API key" if bucket != ANONYMOUS else "anonymous use"
        capacity = limit.tokens_per_minute
        if capacity is not None and tokens > capacity:
            self.refusals.labels("tokens").inc()
            raise RateLimitExceeded(
                "tokens",
                f"Request too large for {who} on tokens per min (TPM): Limit {capacity}, "
                f"Requested {tokens} (the prompt plus max_tokens, or the rest of the context "
                f"when max_tokens is unset). Lower max_tokens or shorten the prompt.",
                None,
            )
        costs = {"requests": 1, "tokens": tokens}
        decision = await self.buckets.take(bucket, limit, costs)
        if decision.allowed:
            return
        kind, wait = max(decision.waits, key=lambda kw: kw[1])
        self.refusals.labels(kind).inc()
        raise RateLimitExceeded(
            kind,
            f"Rate limit reached for {who} on {_UNITS[kind]}: Limit {limit.capacity(kind)}, "
            f"Requested {costs[kind]}. Please try again in {wait:.3g}s.",
            wait,
        )

    async def close(self) -> None:
        await self.buckets.close()
