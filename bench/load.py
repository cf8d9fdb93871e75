"""Load generators: closed loop at a concurrency, open loop with Poisson arrivals at a rate.

Both send requests of a workload in order and record what each client saw. Both call
`on_last_sent` once, right after the last request went out: the arms read the services'
counters there, so that the window for busy fraction and bubble is one in which work was
queued all along (after it, only the drain of the last requests remains).

Closed loop with `duration_s`: it keeps sending (in workload order) until the duration has
passed, then lets what is in flight finish; the number of requests it got through is what
the other arms of a comparison then run, so all arms do the same work.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from bench.stats import RequestRecord
from bench.workloads import BenchRequest


@dataclass
class LoadResult:
    """The records of one run (in send order) and its three moments (perf_counter seconds)."""

    records: list[RequestRecord]
    started_s: float
    last_sent_s: float
    ended_s: float
    mode: str = "closed"
    concurrency: int | None = None
    rate: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.ended_s - self.started_s


def _record(req: BenchRequest) -> RequestRecord:
    return RequestRecord(req.index, req.kind, req.num_prompt_tokens, req.max_tokens, time.perf_counter())


async def closed_loop(
    client,
    requests: Sequence[BenchRequest],
    concurrency: int,
    duration_s: float | None = None,
    on_last_sent: Callable[[], Awaitable[None]] | None = None,
) -> LoadResult:
    """`concurrency` clients, each sending its next request as soon as its last one finished.

    Without `duration_s` every request is sent; with it, sending stops once it has passed
    (or the requests run out)."""
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    records: list[RequestRecord] = []
    next_index = 0
    started = time.perf_counter()
    last_sent = started
    hook: asyncio.Task | None = None

    def stop_sending() -> None:
        nonlocal hook, last_sent
        if hook is None:
            last_sent = time.perf_counter()
            hook = asyncio.create_task(on_last_sent()) if on_last_sent else asyncio.create_task(asyncio.sleep(0))

    async def worker() -> None:
        nonlocal next_index
        while True:
            expired = duration_s is not None and time.perf_counter() - started >= duration_s
            if next_index >= len(requests) or expired:
                stop_sending()
                return
            req = requests[next_index]
            next_index += 1
            record = _record(req)
            records.append(record)
            if next_index == len(requests):
                stop_sending()
            await client.send(req, record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    ended = time.perf_counter()
    if hook is not None:
        await hook
    return LoadResult(records, started, last_sent, ended, "closed", concurrency=concurrency)


def poisson_arrivals(rate: float, num_requests: int, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of `num_requests` requests at `rate` per second, seeded."""
    if rate <= 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def open_loop(
    client,
    requests: Sequence[BenchRequest],
    rate: float,
    seed: int = 0,
    on_last_sent: Callable[[], Awaitable[None]] | None = None,
) -> LoadResult:
    """Each request sent at its Poisson arrival time, whether or not earlier ones finished."""
    arrivals = poisson_arrivals(rate, len(requests), seed)
    records: list[RequestRecord] = []
    tasks = []
    started = time.perf_counter()
    for req, at in zip(requests, arrivals, strict=True):
        delay = started + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = _record(req)
        records.append(record)
        tasks.append(asyncio.create_task(client.send(req, record)))
    last_sent = time.perf_counter()
    hook = asyncio.create_task(on_last_sent()) if on_last_sent else None
    await asyncio.gather(*tasks)
    ended = time.perf_counter()
    if hook is not None:
        await hook
    return LoadResult(records, started, last_sent, ended, "open", rate=rate)
