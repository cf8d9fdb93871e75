"""bench/planning_cpu.py: the planner driven in-process as the scheduler drives it."""

from __future__ import annotations

from bench.planning_cpu import run


def test_the_planner_is_driven_with_every_stage_busy_and_results_taken_in():
    r = run(pp=4, num_requests=8, num_micro_batches=200)
    assert r["micro_batches"] == 200
    assert r["rows_per_micro_batch"] == 2.0  # 8 requests spread over 4 micro-batches in flight
    assert 0 < r["kv_calls_per_micro_batch"] < 1  # decodes inside their blocks skip the KV service
    assert r["plan_ms"] > 0 and r["result_ms"] > 0
