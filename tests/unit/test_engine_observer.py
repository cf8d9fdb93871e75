"""The engine's observer records exactly what the engine's points report: trace file lines,
GetStats counts, metrics, per-request timelines and spans. Driven directly with stand-ins
for the planner and its micro-batches, no model, no event loop."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.request import Request, SamplingOptions
from scheduler_svc.engine import Engine
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.observer import EngineObserver
from services import telemetry
from services.step import StageTiming, StepResult


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def planner() -> SimpleNamespace:
    return SimpleNamespace(
        decisions=[], num_preemptions=0, in_flight={}, num_prefix_query_tokens=0, num_prefix_hit_tokens=0
    )


def micro_batch(mb_id: int, *steps: tuple[Request, int, int]) -> SimpleNamespace:
    """A stand-in MicroBatch: (request, choice index, tokens) per sequence."""
    seqs = [SimpleNamespace(seq=SimpleNamespace(request=r, index=i), num_tokens=n) for r, i, n in steps]
    return SimpleNamespace(micro_batch_id=mb_id, num_tokens=sum(n for _, _, n in steps), seqs=seqs)


def update(request: Request, index: int, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(seq=SimpleNamespace(request=request, index=index), new_token_ids=tokens)


def request(request_id: str, n: int = 1, debug_timeline: bool = False, arrival_s: float = 100.0) -> Request:
    return Request(request_id, (1, 2, 3), SamplingOptions(n=n, max_tokens=4), arrival_s, debug_timeline=debug_timeline)


def value(metrics: SchedulerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_trace_file_has_the_decisions_and_the_engines_events_in_order(tmp_path):
    clock, p = Clock(), planner()
    path = tmp_path / "trace.jsonl"
    observer = EngineObserver(p, SchedulerMetrics("m"), clock, str(path))
    r = request("a")
    observer.request_admitted(r)
    p.decisions.append({"event": "admitted", "request_id": "a"})
    p.in_flight = {7: None}
    clock.now = 101.0
    observer.micro_batch_planned(micro_batch(7, (r, 0, 3)))
    assert p.decisions == []  # drained
    p.decisions.append({"event": "finished", "request_id": "a", "t": 5.0})  # a time of its own stays
    observer.micro_batch_returned(StepResult(7, timings=(StageTiming(0, 10, 11, 12),)), now=102.0)
    observer.micro_batch_planned(None)  # nothing planned, nothing new to trace
    observer.request_finished(r, "abort", "aborted")
    p.decisions.append({"event": "preempted", "request_id": "b"})
    observer.pipeline_reset("stage 0: gone", [request("b")])
    observer.pipeline_recovered([2, 3])
    observer.close()
    traced = lines(path)
    for line in traced:  # wall-clock stamps, to line up with the stages' timings
        if line["event"] in ("dispatched", "result"):
            assert line.pop("wall_ns") > 0
    assert traced == [
        {"event": "admitted", "request_id": "a", "t": 101.0},
        {"event": "dispatched", "micro_batch_id": 7, "num_tokens": 3, "in_flight": 1, "t": 101.0},
        {"event": "result", "micro_batch_id": 7, "t": 102.0, "stages": [[0, 10, 11, 12]]},
        {"event": "finished", "request_id": "a", "t": 5.0},
        {"event": "aborted", "request_id": "a", "t": 101.0},
        {"event": "preempted", "request_id": "b", "t": 101.0},
        {"event": "reset", "reason": "stage 0: gone", "preempted": ["b"], "t": 101.0},
        {"event": "recovered", "epochs": [2, 3], "t": 101.0},
    ]


def test_without_a_trace_file_the_decisions_are_dropped():
    p = planner()
    observer = EngineObserver(p, SchedulerMetrics("m"), Clock())
    p.decisions.append({"event": "queued"})
    observer.micro_batch_failed(3)
    assert p.decisions == []


def test_counts_and_metrics_follow_how_each_request_ended():
    clock, metrics = Clock(), SchedulerMetrics("m")
    observer = EngineObserver(planner(), metrics, clock)
    for rid in "abcdef":
        observer.request_admitted(request(rid))
    clock.now = 102.5
    observer.request_finished(request("a"), "length", "finished")
    observer.request_finished(request("b"), "stop", "finished")
    observer.request_finished(request("c"), "abort", "aborted")
    observer.request_finished(request("d"), "abort", "displaced")
    observer.request_finished(request("e"), "error", "error")
    observer.request_finished(request("f"), None, "error")  # at shutdown: not counted
    assert (observer.num_finished, observer.num_aborted, observer.num_prompt_tokens) == (2, 3, 18)
    assert value(metrics, "pagoda:prompt_tokens_total") == 18
    assert [
        value(metrics, "pagoda:request_success_total", finished_reason=reason)
        for reason in ("length", "stop", "abort", "error")
    ] == [1, 1, 2, 1]
    assert value(metrics, "pagoda:e2e_request_latency_seconds_count") == 5
    assert value(metrics, "pagoda:e2e_request_latency_seconds_sum") == pytest.approx(5 * 2.5)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_counters_move_as_the_kv_answers_come(caching):
    """Counted when the planner took the KV service's answers in, not when the KV service's
    statistics are read next: a scrape right after a request sees its lookup."""
    metrics, p = SchedulerMetrics("m"), planner()
    observer = EngineObserver(p, metrics, Clock(), prefix_caching=caching)
    p.num_prefix_query_tokens, p.num_prefix_hit_tokens = 40, 16
    observer.micro_batch_planned(None)  # (even a step that planned nothing took answers in)
    p.num_prefix_query_tokens, p.num_prefix_hit_tokens = 50, 16
    observer.micro_batch_planned(micro_batch(1, (request("a"), 0, 3)))
    observer.micro_batch_planned(None)  # nothing new: counted once
    expected = (50, 16) if caching else (0, 0)
    assert (
        value(metrics, "pagoda:prefix_cache_queries_total"),
        value(metrics, "pagoda:prefix_cache_hits_total"),
    ) == expected


def test_token_latencies_per_choice_and_preemptions_once():
    clock, metrics, p = Clock(), SchedulerMetrics("m"), planner()
    observer = EngineObserver(p, metrics, clock)
    r = request("a", n=2)
    observer.request_admitted(r)
    clock.now = 100.5
    p.num_preemptions = 2
    observer.micro_batch_planned(micro_batch(1, (r, 0, 3)))
    observer.micro_batch_planned(micro_batch(2, (r, 0, 1)))  # no new preemption, no second queue time
    clock.now = 101.0
    observer.tokens_delivered(update(r, 0, [5]))
    observer.tokens_delivered(update(r, 1, [6, 7]))
    clock.now = 101.25
    observer.tokens_delivered(update(r, 0, [8]))
    observer.tokens_delivered(update(r, 1, []))  # a finish without tokens
    observer.tokens_delivered(update(request("gone"), 0, [9]))  # not live: counted in GetStats only
    assert observer.num_generated_tokens == 5 and observer.num_micro_batches == 2
    assert value(metrics, "pagoda:generation_tokens_total") == 4
    assert value(metrics, "pagoda:time_to_first_token_seconds_count") == 1
    assert value(metrics, "pagoda:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(metrics, "pagoda:inter_token_latency_seconds_count") == 1
    assert value(metrics, "pagoda:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert value(metrics, "pagoda:request_queue_time_seconds_count") == 1
    assert value(metrics, "pagoda:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "pagoda:num_preemptions_total") == 2
    assert value(metrics, "pagoda:micro_batch_num_tokens_count") == 2


def test_a_timeline_has_queued_steps_and_stage_compute_when_asked_for():
    observer = EngineObserver(planner(), SchedulerMetrics("m"), Clock())
    asked, other = request("a", n=2, debug_timeline=True), request("b")
    observer.request_admitted(asked)
    observer.request_admitted(other)
    observer.micro_batch_planned(micro_batch(1, (asked, 0, 3), (asked, 1, 3), (other, 0, 3)))
    observer.micro_batch_planned(micro_batch(2, (asked, 0, 1)))
    timings = (StageTiming(0, 5, 10, 20), StageTiming(1, 0, 0, 0), StageTiming(2, 25, 30, 40))
    observer.micro_batch_returned(StepResult(1, timings=timings), now=0.0)
    assert list(observer.recent_spans) == [(0, 1, 10, 20, 5), (2, 1, 30, 40, 25)]
    timeline = observer.request_finished(asked, "stop", "finished")
    assert [(e["name"], e.get("micro_batch_id"), e.get("choice_index"), e["end_ns"] > 0) for e in timeline] == [
        ("queued", None, None, True),
        ("step", 1, 0, True),
        ("step", 1, 1, True),
        ("step", 2, 0, False),
        ("stage 0 compute", 1, None, True),
        ("stage 2 compute", 1, None, True),
    ]
    assert timeline[-1] == {
        "name": "stage 2 compute",
        "category": "stage",
        "micro_batch_id": 1,
        "stage_index": 2,
        "start_ns": 30,
        "end_ns": 40,
    }
    assert observer.request_finished(other, "stop", "finished") == []
    assert observer.request_finished(asked, "stop", "finished") == []  # once only


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "enabled", lambda: True)
    monkeypatch.setattr(telemetry, "tracer", provider.get_tracer)
    return exporter


def test_spans_of_a_request_its_time_queued_and_its_steps(spans):
    observer = EngineObserver(planner(), SchedulerMetrics("m"), Clock())
    r, forgotten = request("a"), request("f")
    observer.request_admitted(r)
    observer.request_admitted(forgotten)
    assert r.trace_context.startswith("00-")  # the stages' spans hang under the request's
    observer.micro_batch_planned(micro_batch(1, (r, 0, 3), (forgotten, 0, 3)))
    observer.micro_batch_planned(micro_batch(2, (r, 0, 1)))
    observer.request_forgotten("f")
    observer.micro_batch_returned(StepResult(1), now=0.0)
    observer.micro_batch_failed(2)  # its step span never ends
    observer.request_finished(r, "abort", "displaced")
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    got = sorted(
        (
            (s.name, by_id[s.parent.span_id].name if s.parent and s.parent.span_id in by_id else "", dict(s.attributes))
            for s in finished
        ),
        key=lambda g: g[:2],
    )
    assert got == [
        ("scheduler.queued", "", {}),  # the forgotten request's (its own span never ends)
        ("scheduler.queued", "scheduler.request", {}),
        (
            "scheduler.request",
            "",
            {
                "pagoda.request_id": "a",
                "pagoda.num_prompt_tokens": 3,
                "pagoda.n": 1,
                "pagoda.outcome": "displaced",
                "pagoda.num_output_tokens": 0,
            },
        ),
        ("scheduler.step", "scheduler.request", {"pagoda.micro_batch_id": 1}),
    ]


def test_the_engine_reads_what_its_observer_keeps():
    engine = Engine(SchedulerConfig(block_size=16, num_kv_blocks=64), kv=None, transport=None)
    metrics = SchedulerMetrics("m")
    engine.metrics = metrics  # (a test's way of reading an engine's metrics)
    assert engine.observer.metrics is metrics and engine.metrics is metrics
    assert engine.recent_spans is engine.observer.recent_spans
    assert (engine.num_micro_batches, engine.num_recoveries, engine.active_ns) == (0, 0, 0)
    engine.submit(request("a"))
    assert engine.summary()["num_prompt_tokens"] == 3 and value(metrics, "pagoda:prompt_tokens_total") == 3
