"""bench.vs_vllm's load on one running server: the same prompts for every arm, the bursts,
the requests alone and the streams, with every response checked to hold `max_tokens`.

`measure` fills an `ArmResult` phase by phase, so a failure keeps what was measured before it
and names the phase it happened in.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.clients import sse_chunks
from bench.machine import cpu_sample, foreign_cpu
from bench.server_process import Server
from bench.vs_vllm_arms import MODEL_NAME


@dataclass(frozen=True)
class LoadSpec:
    num_requests: int = 64
    prompt_len: int = 128
    max_tokens: int = 64
    seed: int = 0
    throughput_repeats: int = 3
    latency_repeats: int = 5
    stream_repeats: int = 3
    warmup_requests: int = 4
    request_timeout_s: float = 180.0
    concurrency: tuple[int, ...] = ()  # bursts of these many in flight; () = (num_requests,)
    single_prompt_len: int = 64  # single stream: prompt ids -> output tokens, streamed
    single_max_tokens: int = 128
    single_repeats: int = 3  # 0: no single-stream run

    @property
    def bursts(self) -> tuple[int, ...]:
        return self.concurrency or (self.num_requests,)


def make_prompts(spec: LoadSpec, count: int, stream: int, length: int | None = None) -> list[list[int]]:
    """`count` prompts of `length` (default `spec.prompt_len`) ids in [10, 8000); stream k of
    the seed, so every arm gets the same prompts and no prompt repeats within an arm (no
    prefix-cache hits)."""
    rng = random.Random(spec.seed * 1000 + stream)
    n = spec.prompt_len if length is None else length
    return [[rng.randrange(10, 8000) for _ in range(n)] for _ in range(count)]


@dataclass
class Reply:
    e2e_s: float
    completion_tokens: int
    finish_reason: str | None
    ttft_s: float | None = None
    itl_s: float | None = None


class Client:
    def __init__(self, base_url: str, spec: LoadSpec) -> None:
        import httpx2

        self.spec = spec
        self.url = f"{base_url}/v1/completions"
        n = max(spec.bursts) + 4
        self.http = httpx2.AsyncClient(
            timeout=httpx2.Timeout(spec.request_timeout_s),
            limits=httpx2.Limits(max_connections=n, max_keepalive_connections=n),
        )

    def body(self, prompt: list[int], stream: bool, max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens or self.spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, prompt: list[int], max_tokens: int | None = None) -> Reply:
        t0 = time.perf_counter()
        resp = await self.http.post(self.url, json=self.body(prompt, False, max_tokens))
        e2e = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        choices = data.get("choices") or [{}]
        return Reply(e2e, int((data.get("usage") or {}).get("completion_tokens", 0)), choices[0].get("finish_reason"))

    async def complete_streamed(self, prompt: list[int], max_tokens: int | None = None) -> Reply:
        t0 = time.perf_counter()
        arrivals: list[float] = []
        tokens = 0
        finish: str | None = None
        body = self.body(prompt, True, max_tokens)
        async for now, chunk in sse_chunks(self.http, self.url, body):
            for choice in chunk.get("choices") or ():
                arrivals.append(now)  # a chunk may hold an empty text (a partial character)
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens", 0))
        e2e = time.perf_counter() - t0
        tokens = tokens or len(arrivals)
        ttft = arrivals[0] - t0 if arrivals else None
        itl = (arrivals[-1] - arrivals[0]) / (tokens - 1) if arrivals and tokens > 1 else None
        return Reply(e2e, tokens, finish, ttft, itl)

    async def close(self) -> None:
        await self.http.aclose()


def check(replies: Sequence[Reply], max_tokens: int) -> None:
    bad = [r.completion_tokens for r in replies if r.completion_tokens != max_tokens]
    if bad:
        raise RuntimeError(
            f"{len(bad)} of {len(replies)} responses had completion_tokens {sorted(set(bad))}, not {max_tokens}"
        )


@dataclass
class ArmResult:
    arm: str  # the label, e.g. pagoda-q4_1
    command: list[str]
    kind: str = ""
    model: str = ""
    dtype: str | None = None  # the --dtype passed; None: the server's default
    startup_s: float | None = None
    throughput_tok_s: float | None = None  # median over the bursts at the first concurrency
    throughput_by_concurrency: dict[str, float] = field(default_factory=dict)  # "64" -> tok/s
    throughput_runs: list[dict[str, float | None]] = field(default_factory=list)
    latency_e2e_s: float | None = None  # median, one request alone
    latency_tpot_s: float | None = None  # latency_e2e_s / max_tokens
    latency_runs_s: list[float] = field(default_factory=list)
    ttft_s: float | None = None  # median, streamed
    itl_s: float | None = None  # median of per-request mean inter-token latency
    stream_runs: list[dict[str, float | None]] = field(default_factory=list)
    # single stream (spec.single_prompt_len -> spec.single_max_tokens, streamed), medians:
    single_decode_tok_s: float | None = None  # (tokens - 1) / (last chunk - first chunk)
    single_e2e_tok_s: float | None = None  # tokens / end-to-end (prefill included)
    single_ttft_s: float | None = None
    single_runs: list[dict[str, float | None]] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    error: str | None = None
    log: str = ""


class _Phase:
    """The phase of `measure` under way and when it began, for the message of a failure."""

    def __init__(self, name: str) -> None:
        self.begin(name)

    def begin(self, name: str) -> None:
        self.name, self.t0 = name, time.perf_counter()


async def measure(server: Server, spec: LoadSpec, result: ArmResult, say: Any) -> None:
    client = Client(server.base_url, spec)
    phase = _Phase("warm-up")
    try:
        await _warm_up(client, spec, server.name, say)
        await _throughput(client, server, spec, result, say, phase)
        if spec.latency_repeats > 0:
            phase.begin("latency")
            await _latency(client, spec, result, server.name, say)
        if spec.stream_repeats > 0:
            phase.begin("streamed latency")
            await _streamed_latency(client, spec, result)
        if spec.single_repeats > 0:
            phase.begin("single stream")
            await _single_stream(client, spec, result, server.name, say)
    except Exception as exc:
        raise RuntimeError(
            f"{phase.name}, after {time.perf_counter() - phase.t0:.0f}s: {type(exc).__name__}: {exc or '(no message)'}"
        ) from exc
    finally:
        await client.close()


async def _warm_up(client: Client, spec: LoadSpec, name: str, say: Any) -> None:
    warm = make_prompts(spec, spec.warmup_requests + 1, stream=0)
    check(await asyncio.gather(*(client.complete(p) for p in warm[:-1])), spec.max_tokens)
    check([await client.complete(warm[-1])], spec.max_tokens)
    say(f"  {name}: warmed up with {len(warm)} requests")


async def _throughput(
    client: Client, server: Server, spec: LoadSpec, result: ArmResult, say: Any, phase: _Phase
) -> None:
    """`spec.throughput_repeats` bursts at each concurrency: the median output tok/s of each."""
    for c in spec.bursts:
        tok_s: list[float] = []
        for i in range(spec.throughput_repeats):
            phase.begin(f"throughput burst {i + 1} at {c}")
            # the first concurrency keeps the streams of the old single-burst runs
            offset = 10 if c == spec.bursts[0] else 1000 + 10 * c
            run = await _burst(client, server, spec, make_prompts(spec, c, stream=offset + i))
            result.throughput_runs.append(run)
            tok_s.append(run["output_tok_s"])
            say(
                f"  {server.name}: burst {i + 1}: {c} x {spec.max_tokens} tokens "
                f"in {run['wall_s']:.2f}s = {run['output_tok_s']:,.0f} tok/s"
            )
        if tok_s:
            result.throughput_by_concurrency[str(c)] = statistics.median(tok_s)
    result.throughput_tok_s = result.throughput_by_concurrency.get(str(spec.bursts[0]))


async def _burst(client: Client, server: Server, spec: LoadSpec, prompts: list[list[int]]) -> dict[str, float | None]:
    """All `prompts` in flight at once; the burst's figures and the cores others used."""
    before = cpu_sample([os.getpid(), *server.pids()])
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(client.complete(p) for p in prompts))
    wall = time.perf_counter() - t0
    after = cpu_sample([os.getpid(), *server.pids()])
    check(replies, spec.max_tokens)
    tokens = sum(r.completion_tokens for r in replies)
    return {
        "concurrency": float(len(prompts)),
        "wall_s": wall,
        "completion_tokens": float(tokens),
        "output_tok_s": tokens / wall,
        "mean_request_s": statistics.fmean(r.e2e_s for r in replies),
        "foreign_cpu": foreign_cpu(before, after, os.cpu_count() or 1),
    }


async def _latency(client: Client, spec: LoadSpec, result: ArmResult, name: str, say: Any) -> None:
    """One request alone, after one warm-up: the median end-to-end seconds."""
    lat_prompts = make_prompts(spec, spec.latency_repeats + 1, stream=100)
    check([await client.complete(lat_prompts[0])], spec.max_tokens)  # warm-up
    for p in lat_prompts[1:]:
        reply = await client.complete(p)
        check([reply], spec.max_tokens)
        result.latency_runs_s.append(reply.e2e_s)
    result.latency_e2e_s = statistics.median(result.latency_runs_s)
    result.latency_tpot_s = result.latency_e2e_s / spec.max_tokens
    say(f"  {name}: one request alone: median {result.latency_e2e_s:.3f}s")


async def _streamed_latency(client: Client, spec: LoadSpec, result: ArmResult) -> None:
    """One streamed request alone, after one warm-up: the median TTFT and inter-token time."""
    st_prompts = make_prompts(spec, spec.stream_repeats + 1, stream=200)
    check([await client.complete_streamed(st_prompts[0])], spec.max_tokens)  # warm-up
    streamed = [await client.complete_streamed(p) for p in st_prompts[1:]]
    check(streamed, spec.max_tokens)
    result.stream_runs = [{"e2e_s": r.e2e_s, "ttft_s": r.ttft_s, "itl_s": r.itl_s} for r in streamed]
    ttfts = [r.ttft_s for r in streamed if r.ttft_s is not None]
    itls = [r.itl_s for r in streamed if r.itl_s is not None]
    result.ttft_s = statistics.median(ttfts) if ttfts else None
    result.itl_s = statistics.median(itls) if itls else None


async def _single_stream(client: Client, spec: LoadSpec, result: ArmResult, name: str, say: Any) -> None:
    """One stream alone, `single_prompt_len` -> `single_max_tokens`: median decode tok/s."""
    n_out = spec.single_max_tokens
    ss_prompts = make_prompts(spec, spec.single_repeats + 1, stream=300, length=spec.single_prompt_len)
    check([await client.complete_streamed(ss_prompts[0], n_out)], n_out)  # warm-up
    singles = [await client.complete_streamed(p, n_out) for p in ss_prompts[1:]]
    check(singles, n_out)
    result.single_runs = [
        {
            "e2e_s": r.e2e_s,
            "ttft_s": r.ttft_s,
            "itl_s": r.itl_s,
            "completion_tokens": float(r.completion_tokens),
            "decode_tok_s": 1.0 / r.itl_s if r.itl_s else None,
            "e2e_tok_s": r.completion_tokens / r.e2e_s,
        }
        for r in singles
    ]
    dec = [float(r["decode_tok_s"]) for r in result.single_runs if r["decode_tok_s"]]
    result.single_decode_tok_s = statistics.median(dec) if dec else None
    result.single_e2e_tok_s = statistics.median(float(r["e2e_tok_s"] or 0.0) for r in result.single_runs)
    ttfts = [r.ttft_s for r in singles if r.ttft_s is not None]
    result.single_ttft_s = statistics.median(ttfts) if ttfts else None
    say(
        f"  {name}: single stream {spec.single_prompt_len} -> {n_out}: "
        f"decode {fmt(result.single_decode_tok_s, digits=1)} tok/s, "
        f"TTFT {fmt(result.single_ttft_s, 1e3, 1)} ms"
    )


def fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    """A figure for the table and the progress lines: `value * scale`, or "-" when missing."""
    return "-" if value is None else f"{value * scale:,.{digits}f}"
