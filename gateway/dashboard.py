"""The live dashboard: `GET /dashboard` (one static page, assets in the package, no build
step and nothing from a CDN) polling `GET /dashboard/state` (this module's JSON, read from
the scheduler's `GetStats` with its requests, the KV block map and the stages' recent
compute spans).

What the page shows: queue depth per tenant and priority, running and preempted requests,
the KV blocks as a map (free / used / shared / cached), the prefix-hit rate, every stage's
compute over the last seconds (the pipeline's bubbles are the gaps) and device (an emulated
one, `--device emulated:PROFILE`, in a banner too), tokens per second (from the
generated-token counter between two polls).
"""

from __future__ import annotations

from collections import Counter
from importlib.resources import files
from typing import Any

from gateway.replicas import emulated_device
from services.pb import common_pb2

TIMELINE_WINDOW_NS = 5_000_000_000  # the stage timeline covers the last five seconds
_WAITING = {common_pb2.REQUEST_STATE_WAITING, common_pb2.REQUEST_STATE_PREEMPTED}
_RUNNING = {common_pb2.REQUEST_STATE_PREFILLING, common_pb2.REQUEST_STATE_DECODING}


def page() -> str:
    """The dashboard's HTML, with its script and style inline."""
    return files("gateway").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def state(stats: Any, model: str) -> dict[str, Any]:
    """A `GetStatsResponse` (asked with requests, KV sequences and the timeline) as the
    page's JSON."""
    queues: Counter[tuple[str, int, str]] = Counter()
    for r in stats.requests:
        kind = "waiting" if r.state in _WAITING else "running" if r.state in _RUNNING else None
        if kind is not None:
            queues[(r.tenant, r.priority, kind)] += 1
    groups = sorted({(t, p) for t, p, _ in queues})
    kv = stats.kv_cache
    block_map = bytes(kv.block_map)
    since = stats.now_ns - TIMELINE_WINDOW_NS
    return {
        "model": model,
        "device": emulated_device(stats),  # "emulated:PROFILE" when the stages are emulated, else ""
        "health": common_pb2.HealthStatus.Name(stats.health).removeprefix("HEALTH_STATUS_").lower(),
        "health_detail": stats.health_detail,
        "now_ns": stats.now_ns,
        "uptime_s": stats.uptime_ns / 1e9,
        "requests": {
            "waiting": stats.num_waiting,
            "running": stats.num_running,
            "preempted": stats.num_preempted,
            "finished": stats.num_finished_requests,
            "aborted": stats.num_aborted_requests,
            "preemptions": stats.num_preemptions,
        },
        "queues": [
            {
                "tenant": t or "(default)",
                "priority": p,
                "waiting": queues[(t, p, "waiting")],
                "running": queues[(t, p, "running")],
            }
            for t, p in groups
        ],
        "tokens": {"prompt": stats.num_prompt_tokens, "generated": stats.num_generated_tokens},
        "speculation": {
            "drafts": stats.num_spec_drafts,
            "draft_tokens": stats.num_spec_draft_tokens,
            "accepted_tokens": stats.num_spec_accepted_tokens,
            "acceptance_rate": (
                stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens if stats.num_spec_draft_tokens else 0.0
            ),
        },
        "kv": {
            "total": kv.num_total_blocks,
            "block_size": kv.block_size,
            "used": block_map.count(1),
            "shared": block_map.count(2),
            "cached": block_map.count(3),
            "free": block_map.count(0),
            "prefix_hit_rate": kv.prefix_hit_rate,
            "prefix_hit_tokens": kv.num_prefix_hit_tokens,
            "prefix_query_tokens": kv.num_prefix_query_tokens,
            "map": block_map.hex(),  # one byte per block: 0 free, 1 used, 2 shared, 3 cached
        },
        "stages": [
            {
                "index": s.stage_index,
                "healthy": s.health == common_pb2.HEALTH_STATUS_SERVING,
                "busy_fraction": s.busy_fraction,
                "in_flight": s.num_in_flight,
                "micro_batches": s.stats.num_micro_batches,
                "device": s.load_info.device,
            }
            for s in stats.stages
        ],
        "timeline_window_ns": TIMELINE_WINDOW_NS,
        "timeline": [
            [s.stage_index, s.micro_batch_id, s.start_ns, s.end_ns] for s in stats.timeline if s.end_ns >= since
        ],
    }
