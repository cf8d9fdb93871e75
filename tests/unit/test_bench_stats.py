"""`bench.stats`, `bench.load` and `bench.clients` parsing: percentiles, records, counter
deltas, the load generators (against a fake client), SSE chunks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.clients import apply_chunk, parse_sse_line
from bench.load import closed_loop, open_loop, poisson_arrivals
from bench.stats import (
    LatencySummary,
    RequestRecord,
    ServiceSnapshot,
    StageCounters,
    client_metrics,
    percentile,
    quantiles_ms,
    ratio,
    service_metrics,
)
from bench.workloads import TokenSpace, make_workload


def test_percentile_known_values():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # order does not matter
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


def test_latency_summary_in_ms():
    s = LatencySummary.of([0.010, 0.020, 0.030])
    assert (s.count, s.mean_ms, s.p50_ms) == (3, pytest.approx(20.0), pytest.approx(20.0))
    assert s.p99_ms == pytest.approx(29.8)
    empty = LatencySummary.of([])
    assert empty.count == 0 and empty.p50_ms is None and empty.mean_ms is None


def test_quantiles_ms():
    q = quantiles_ms([0.001 * i for i in range(1, 101)])
    assert len(q) == 101 and q[0] == 1.0 and q[-1] == 100.0 and q == sorted(q)
    assert quantiles_ms([]) == []


def record(index=0, kind="short", sent=0.0, chunks=(0.1, 0.15, 0.35), tokens=3, done=0.4, error=None):
    return RequestRecord(index, kind, 8, tokens, sent, list(chunks), tokens, done, error)


def test_record_ttft_itl_tpot():
    r = record()
    assert r.ttft_s == pytest.approx(0.1)
    assert r.itls_s == pytest.approx([0.05, 0.2])
    assert r.latency_s == pytest.approx(0.4)
    assert r.tpot_s == pytest.approx((0.4 - 0.1) / 2)
    assert record(chunks=(), tokens=0).ttft_s is None


def test_client_metrics_throughput_and_failures():
    records = [
        record(0, sent=0.0, done=0.4),
        record(1, "long", sent=0.5, chunks=(0.6, 0.7, 0.9), done=1.0),
        record(2, error="HTTP 503"),
    ]
    m = client_metrics(records)
    assert m.num_requests == 2 and m.num_failed == 1
    assert m.duration_s == pytest.approx(1.0)
    assert m.num_output_tokens == 6 and m.output_tokens_per_s == pytest.approx(6.0)
    assert m.requests_per_s == pytest.approx(2.0)
    assert m.ttft.count == 2 and m.itl.count == 4
    assert set(m.itl_by_kind) == {"short", "long"}
    assert client_metrics(records, duration_s=2.0).output_tokens_per_s == pytest.approx(3.0)


def snap(t_s, busy, idle, **kw):
    stages = tuple(StageCounters(i, b, d) for i, (b, d) in enumerate(zip(busy, idle, strict=True)))
    return ServiceSnapshot(int(t_s * 1e9), {"async_scheduling": True}, stages, **kw)


def test_service_metrics_busy_and_bubble_over_the_loaded_window():
    start = snap(
        0, [0, 0], [0, 0], num_generated_tokens=10, kv_num_prefix_query_tokens=100, kv_num_prefix_hit_tokens=10
    )
    loaded = snap(2, [int(1.5e9), int(1e9)], [int(0.5e9), int(1e9)], kv_internal_fragmentation=0.25)
    end = snap(
        3,
        [int(2e9), int(1.2e9)],
        [int(1e9), int(1.8e9)],
        num_generated_tokens=110,
        num_preemptions=2,
        kv_num_prefix_query_tokens=300,
        kv_num_prefix_hit_tokens=110,
    )
    m = service_metrics(start, loaded, end)
    assert [s.busy_fraction for s in m.stages] == pytest.approx([0.75, 0.5])
    assert [s.bubble_fraction for s in m.stages] == pytest.approx([0.25, 0.5])
    assert m.mean_busy_fraction == pytest.approx(0.625)
    assert m.num_generated_tokens == 100 and m.num_preemptions == 2
    assert m.prefix_hit_tokens == 100 and m.prefix_hit_rate == pytest.approx(0.5)
    assert m.kv_internal_fragmentation == 0.25  # as it stood under load
    assert m.to_dict()["prefix_hit_rate"] == pytest.approx(0.5)
    assert m.tokens_per_micro_batch == 0.0  # no micro-batch counted in these snapshots


def test_service_metrics_without_idle_counters_uses_the_window():
    m = service_metrics(snap(0, [0], [0]), snap(2, [int(0.5e9)], [0]), snap(3, [int(0.6e9)], [0]))
    assert m.stages[0].busy_fraction == pytest.approx(0.25)
    assert m.stages[0].bubble_fraction == pytest.approx(0.75)


def test_ratio():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0) is None


# --- load generators ----------------------------------------------------------------------------


class FakeClient:
    """Answers every request with `max_tokens` chunks, `step_s` apart; counts concurrency."""

    def __init__(self, step_s=0.001):
        self.step_s = step_s
        self.outstanding = 0
        self.peak = 0
        self.sent = []

    async def send(self, req, rec):
        self.sent.append(req.index)
        self.outstanding += 1
        self.peak = max(self.peak, self.outstanding)
        loop = asyncio.get_running_loop()
        for _ in range(req.max_tokens):
            await asyncio.sleep(self.step_s)
            rec.chunk_times.append(loop.time())
            rec.num_output_tokens += 1
        rec.done_s = rec.sent_s + 1
        self.outstanding -= 1


SPACE = TokenSpace(64, frozenset({0}))


def test_closed_loop_keeps_concurrency_and_sends_in_order():
    reqs = make_workload("short", 10, SPACE)
    client, hooks = FakeClient(), []

    async def hook():
        hooks.append(len(client.sent))

    res = asyncio.run(closed_loop(client, reqs, 3, on_last_sent=hook))
    assert client.sent == list(range(10)) and [r.index for r in res.records] == list(range(10))
    assert client.peak == 3
    assert hooks == [10]
    assert res.started_s <= res.last_sent_s <= res.ended_s
    assert all(r.num_output_tokens == 4 for r in res.records)


def test_closed_loop_with_a_duration_stops_sending_and_drains():
    reqs = make_workload("short", 10_000, SPACE)
    client = FakeClient(step_s=0.002)
    res = asyncio.run(closed_loop(client, reqs, 4, duration_s=0.05))
    n = len(res.records)
    assert 4 <= n < 10_000
    assert client.sent == list(range(n)) and all(r.done_s is not None for r in res.records)


def test_open_loop_sends_at_poisson_times():
    arrivals = poisson_arrivals(100.0, 2000, seed=1)
    assert arrivals == poisson_arrivals(100.0, 2000, seed=1) and arrivals == sorted(arrivals)
    assert arrivals[-1] / 2000 == pytest.approx(0.01, rel=0.1)
    with pytest.raises(ValueError):
        poisson_arrivals(0, 1)
    client = FakeClient()
    res = asyncio.run(open_loop(client, make_workload("short", 5, SPACE), rate=200.0))
    assert client.sent == list(range(5)) and res.mode == "open" and res.rate == 200.0


# --- SSE ----------------------------------------------------------------------------------------


def test_sse_lines_and_chunks():
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("") is None
    chunk = parse_sse_line('data: {"choices": [{"index": 0, "text": "ab"}]}')
    rec = RequestRecord(0, "short", 4, 2, 0.0)
    apply_chunk(rec, chunk, 0.5)
    apply_chunk(rec, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, 0.6)
    apply_chunk(rec, {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}, 0.7)
    assert rec.chunk_times == [0.5] and rec.num_output_tokens == 2 and rec.error is None
    apply_chunk(rec, {"error": {"message": "boom"}}, 0.8)
    assert rec.error == "boom"


def test_foreign_cpu_share():
    import os

    from bench.machine import CpuSample, cpu_sample, foreign_cpu

    hz = os.sysconf("SC_CLK_TCK")
    before, after = CpuSample(0, 0, 10.0), CpuSample(3 * hz, 2 * hz, 12.0)  # 3 s busy, 2 s ours, 2 s x 2 cores
    assert foreign_cpu(before, after, 2) == pytest.approx(0.25)
    assert foreign_cpu(before, CpuSample(0, 5 * hz, 12.0), 2) == 0.0  # clamped
    assert foreign_cpu(None, after, 2) is None and foreign_cpu(after, before, 2) is None
    sample = cpu_sample([os.getpid()])
    assert sample is None or sample.busy_ticks >= 0


class _Stream:
    """An httpx-like streamed response: a status and its lines."""

    def __init__(self, status: int, lines: list[str]) -> None:
        self.status_code, self.lines = status, lines

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def aread(self) -> bytes:
        return "\n".join(self.lines).encode()

    async def aiter_lines(self):
        for line in self.lines:
            yield line


class _Http:
    def __init__(self, status: int, lines: list[str]) -> None:
        self.response = _Stream(status, lines)

    def stream(self, method: str, url: str, json: dict) -> _Stream:
        assert method == "POST" and json == {"x": 1}
        return self.response


def test_sse_chunks_yields_each_object_until_done_and_raises_on_errors():
    import asyncio

    from bench.clients import sse_chunks

    async def collect(http) -> list[dict]:
        return [chunk async for _, chunk in sse_chunks(http, "u", {"x": 1})]

    lines = [
        ": keep-alive",
        'data: {"choices": [{"text": "a"}]}',
        "",
        'data: {"usage": {"completion_tokens": 1}}',
        "data: [DONE]",
        'data: {"choices": [{"text": "after"}]}',
    ]
    assert asyncio.run(collect(_Http(200, lines))) == [
        {"choices": [{"text": "a"}]},
        {"usage": {"completion_tokens": 1}},
    ]
    with pytest.raises(RuntimeError, match="HTTP 503: busy"):
        asyncio.run(collect(_Http(503, ["busy"])))
    with pytest.raises(RuntimeError, match="stream error"):
        asyncio.run(collect(_Http(200, ['data: {"error": {"message": "bad"}}'])))
