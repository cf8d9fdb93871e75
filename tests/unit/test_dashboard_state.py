"""`/dashboard/state` from a scheduler's statistics (gateway.dashboard.state), and the page
it feeds: one file, nothing from outside the package."""

from __future__ import annotations

import re

from gateway import dashboard
from services.pb import common_pb2, scheduler_pb2


def test_state_groups_queues_and_counts_the_block_map():
    stats = scheduler_pb2.GetStatsResponse(
        health=common_pb2.HEALTH_STATUS_SERVING,
        now_ns=10_000_000_000,
        num_running=2,
        num_waiting=2,
        num_generated_tokens=77,
    )
    for tenant, priority, state in [
        ("a", 0, common_pb2.REQUEST_STATE_WAITING),
        ("a", 0, common_pb2.REQUEST_STATE_PREEMPTED),
        ("a", 0, common_pb2.REQUEST_STATE_DECODING),
        ("", 5, common_pb2.REQUEST_STATE_PREFILLING),
    ]:
        stats.requests.add(tenant=tenant, priority=priority, state=state)
    stats.kv_cache.num_total_blocks = 6
    stats.kv_cache.block_map = bytes([0, 1, 1, 2, 3, 0])
    stats.stages.add(stage_index=0, health=common_pb2.HEALTH_STATUS_SERVING, busy_fraction=0.5)
    old = stats.timeline.add(stage_index=0, micro_batch_id=1, start_ns=1, end_ns=2)  # outside the window
    recent = stats.timeline.add(stage_index=0, micro_batch_id=2, start_ns=9_000_000_000, end_ns=9_100_000_000)
    state = dashboard.state(stats, "tiny")
    assert state["health"] == "serving"
    assert state["queues"] == [
        {"tenant": "(default)", "priority": 5, "waiting": 0, "running": 1},
        {"tenant": "a", "priority": 0, "waiting": 2, "running": 1},
    ]
    kv = state["kv"]
    assert (kv["free"], kv["used"], kv["shared"], kv["cached"]) == (2, 2, 1, 1) and kv["map"] == "000101020300"
    assert state["timeline"] == [[0, 2, recent.start_ns, recent.end_ns]] and old.end_ns < 5_000_000_000
    assert state["tokens"]["generated"] == 77


def test_the_page_loads_nothing_from_outside():
    html = dashboard.page()
    assert "/dashboard/state" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "no CDN, no external asset"
