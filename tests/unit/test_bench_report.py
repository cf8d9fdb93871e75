"""`bench.compare`, `bench.report`, `bench.plots.gantt_window` and the `pagoda bench` plan:
ratios, read-back checks, rendering."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.cli import add_bench_arguments, build_plan
from bench.compare import COMPARISONS, RunResult, compare, token_checks
from bench.plots import gantt_window
from bench.report import render_markdown
from bench.runner import ModelResults
from bench.stats import RequestRecord, ServiceMetrics, StageWindow, client_metrics


def services(config=None, generated=100, hits=0, peak=2, stages=1):
    return ServiceMetrics(
        stages=tuple(StageWindow(i, 0.8, 0.2, 10, peak) for i in range(stages)),
        num_preemptions=0,
        num_generated_tokens=generated,
        num_prompt_tokens=500,
        num_micro_batches=20,
        prefix_query_tokens=400,
        prefix_hit_tokens=hits,
        kv_internal_fragmentation=0.1,
        kv_external_fragmentation=0.0,
        kv_peak_used_blocks=30,
        kv_total_blocks=100,
        config={
            "async_scheduling": True,
            "pipeline_parallel_size": stages,
            "num_stages": stages,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,
            "kv_enable_prefix_caching": True,
            "max_num_batched_tokens": 2048,
            "kv_address": "127.0.0.1:1",
            **(config or {}),
        },
    )


def run(arm, duration=1.0, tokens=100, svc=None, workload="mixed", driver="http", extra=None, mode="closed"):
    recs = [RequestRecord(i, "long", 8, tokens // 4, 0.0, [0.1, 0.2], tokens // 4, duration) for i in range(4)]
    return RunResult(
        "tiny",
        workload,
        arm,
        "settings",
        driver,
        mode,
        4,
        tokens,
        client_metrics(recs, duration),
        svc,
        concurrency=16,
        extra=extra or {},
    )


def test_async_comparison_ratio_and_checks():
    a = run("async", duration=1.0, svc=services())
    b = run("pagoda", duration=2.0, svc=services({"async_scheduling": False}, peak=1))
    c = compare(COMPARISONS["b"], a, b)
    assert c.ratio == pytest.approx(2.0) and c.throughput_ratio == pytest.approx(2.0)
    assert c.ok, [k for k in c.checks if not k.ok]
    same = compare(COMPARISONS["b"], a, run("pagoda", svc=services()))
    assert not same.ok
    assert [k.what for k in same.checks if not k.ok] == ["async flag differs", "micro-batches overlap only when async"]


def test_token_checks_catch_missing_tokens():
    short = run("pagoda", svc=services(generated=99))
    failed = [k.what for k in token_checks(short) if not k.ok]
    assert failed == ["pagoda: output tokens (services)"]


def test_prefix_comparison_needs_hits_only_when_on():
    on = run("pagoda", workload="shared-prefix", svc=services(hits=320))
    off_cfg = {"enable_prefix_caching": False, "kv_enable_prefix_caching": False}
    assert compare(COMPARISONS["f"], on, run("prefix-off", workload="shared-prefix", svc=services(off_cfg))).ok
    leaky = run("prefix-off", workload="shared-prefix", svc=services(off_cfg, hits=16))
    assert not compare(COMPARISONS["f"], on, leaky).ok


def test_pp_comparison_reads_stages_and_threads():
    pp2 = run("pp2", svc=services(stages=2), extra={"threads_per_stage": 1})
    pp1 = run("pagoda", svc=services(), extra={"threads_per_stage": 2})
    assert compare(COMPARISONS["c"], pp2, pp1).ok
    assert not compare(COMPARISONS["c"], run("pp2", svc=services(stages=2), extra={"threads_per_stage": 2}), pp1).ok


def test_chunked_comparison_uses_long_decode_itl():
    on = run("chunked-on", svc=services({"max_num_batched_tokens": 64}))
    off = run("chunked-off", svc=services({"enable_chunked_prefill": False}))
    c = compare(COMPARISONS["e"], on, off)
    assert c.ok and c.metric == "itl_p99_long_ms" and not c.higher_is_better


def results_dict():
    m = ModelResults("tiny", "/models/tiny", 250_000)
    a = run("async", svc=services())
    b = run("pagoda", duration=2.0, svc=services({"async_scheduling": False}, peak=1))
    hf = run("transformers", duration=0.5, driver="transformers", extra={"num_batches": 1}, mode="static-batch")
    m.runs = [a, b, hf]
    m.comparisons = [compare(COMPARISONS["b"], a, b), compare(COMPARISONS["a"], b, hf)]
    return {
        "meta": {
            "command": "pagoda bench --quick",
            "machine": {"cpu": "Test CPU", "usable_cores": 2, "memory_gib": 8, "python": "3.11", "torch": "2"},
            "started": "now",
            "elapsed_s": 12.0,
            "driver_note": "HTTP",
            "total_threads": 2,
            "notes": ["quick"],
        },
        "models": [json.loads(json.dumps(m.to_dict()))],
    }


def test_markdown_has_the_comparison_table_and_every_run():
    md = render_markdown(results_dict(), ["bench/results/gantt_tiny.png"])
    assert "| tiny | (b) async vs sync scheduling | mixed |" in md
    assert "**2.00x**" in md and "**0.25x**" in md
    assert md.count("| tiny/mixed/") == 3
    assert "static batches of 16" in md and "Test CPU, 2 usable core(s)" in md
    assert "`bench/results/gantt_tiny.png`" in md
    assert "ok: async flag differs" in md and "FAILED" not in md


def test_markdown_shows_failed_checks():
    results = results_dict()
    results["models"][0]["comparisons"][0]["checks"][0]["ok"] = False
    assert "FAILED: async flag differs" in render_markdown(results)


def test_gantt_window_takes_the_middle():
    events = [{"stage": 0, "micro_batch_id": i, "start_ns": i * 100, "end_ns": i * 100 + 50} for i in range(11)]
    picked, lo, hi = gantt_window(events, 200e-9)
    assert (lo, hi) == (425, 625)
    assert [e["micro_batch_id"] for e in picked] == [4, 5, 6]
    assert gantt_window([], 1.0) == ([], 0, 0)


def plan_for(*argv):
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return build_plan(p.parse_args(list(argv)))


def test_quick_plan_runs_everything_on_tiny_and_abd_on_25m():
    plan = plan_for("--quick", "--threads", "2")
    assert [(m.preset, m.comparisons) for m in plan.models] == [
        ("tiny", ("a", "b", "c", "d", "e", "f")),
        ("25m", ("a", "b", "d")),
    ]
    assert plan.duration_s == 20.0 and plan.shape.long_output == 128 and plan.total_threads == 2
    assert plan.models[0].sweep and not plan.models[1].sweep
    full = plan_for("--models", "25m", "--comparisons", "b,c", "--threads", "4")
    assert full.models[0].comparisons == ("b", "c") and full.shape.long_output == 512


def test_plan_rejects_unknown_names():
    with pytest.raises(ValueError, match="comparisons"):
        plan_for("--comparisons", "z")
    with pytest.raises(ValueError, match="models"):
        plan_for("--models", "huge")
    with pytest.raises(ValueError, match="even"):
        plan_for("--threads", "3")
    assert plan_for("--threads", "3", "--comparisons", "a,b").total_threads == 3


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plots import write_plots

    results = results_dict()
    m = results["models"][0]
    for r in m["runs"]:
        r["extra"]["quantiles"] = {"ttft_ms": [1.0, 2.0, 3.0], "itl_ms": [0.5, 1.0, 4.0]}
    m["gantt"] = {
        "settings": "PP=2",
        "events": [
            {
                "stage": s,
                "micro_batch_id": i,
                "start_ns": i * 10**7 + s * 10**6,
                "end_ns": i * 10**7 + s * 10**6 + 5 * 10**6,
            }
            for i in range(20)
            for s in (0, 1)
        ],
    }
    names = sorted(p.name for p in write_plots(results, tmp_path))
    assert names == ["gantt_tiny.png", "gantt_tiny.trace.json", "latency_tiny.png", "throughput_vs_concurrency.png"]
    trace = json.loads((tmp_path / "gantt_tiny.trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 40
