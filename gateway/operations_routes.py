"""What operators, probes and people ask the REST app (gateway/app.py) besides the APIs.

    GET  /health                200 only when the scheduler reports the whole chain serving
    GET  /version               the server's version
    GET  /metrics               Prometheus (pagoda:*)
    GET  /debug/memory          the KV service's statistics, through the scheduler
    GET  /debug/replicas        router mode: each replica's health, load and routing
    GET  /dashboard             the live dashboard (a page polling /dashboard/state)

`gw` is the app's `gateway.app.Gateway`. None of these is rate-limited or refused while the
gateway drains (`/health` says it is draining).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import grpc
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import dashboard
from gateway.generation import GenerationError
from gateway.protocol import error_responses

log = logging.getLogger(__name__)

_ERRORS = error_responses()


def add_operations_routes(app: FastAPI, gw: Any) -> None:
    """What operators and probes ask: health, version and Prometheus metrics."""

    @app.get("/health", tags=["Operations"], responses={503: {"description": "Some part of the chain is not serving."}})
    async def health() -> JSONResponse:
        """Ready only when the scheduler reports every stage and the KV service serving."""
        if gw.draining:
            return JSONResponse({"status": "draining", "detail": "the server is shutting down"}, 503)
        serving, detail = await gw.generator.health()
        if not serving:
            return JSONResponse({"status": "unavailable", "detail": detail}, 503)
        # an emulated stack says so: {"status": "ok", "device": "emulated:PROFILE"}
        return JSONResponse({"status": "ok", "device": detail} if detail else {"status": "ok"})

    @app.get("/version", tags=["Operations"])
    async def version() -> dict[str, str]:
        """The server's version, as vLLM's `/version` reports its own."""
        return {"version": _version()}

    @app.get(
        "/metrics",
        tags=["Operations"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    )
    async def metrics() -> Response:
        """Prometheus text, the one scrape target a dashboard needs (`pagoda:*`, after vLLM's
        `vllm:*`): requests by finish reason, tokens, TTFT, inter-token, per-output-token and
        end-to-end latency as clients see them, and the engine's running and waiting
        requests, KV usage, prefix-cache and preemption counters (read from the scheduler)."""
        try:
            gw.metrics.engine.stats = await gw.generator.stats(timeout_s=1.0)
        except Exception as exc:  # noqa: BLE001 - a scrape never fails: the engine shows as down
            log.debug("metrics: no statistics from the scheduler: %s", exc)
            gw.metrics.engine.stats = None
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def add_debug_routes(app: FastAPI, gw: Any) -> None:
    """What the scheduler and replicas hold, for people: the KV memory, the replicas and
    the live dashboard."""

    @app.get("/debug/memory", tags=["Operations"], responses={401: _ERRORS[401], 503: _ERRORS[503]})
    async def debug_memory(include_sequences: bool = False) -> dict[str, Any]:
        """The KV service's statistics as the scheduler last read them: used, free and
        cached blocks, peak, fragmentation, prefix hits (and per-sequence layouts); each
        stage's memory and the channel its hidden states take to the next stage."""
        try:
            stats = await gw.generator.stats(include_kv_sequences=include_sequences)
        except grpc.aio.AioRpcError as exc:
            raise GenerationError(exc.code(), exc.details() or exc.code().name) from exc
        return {
            "kv_address": stats.kv_address,
            "kv_health": _enum_name(stats.kv_health),
            "kv_cache": _plain(stats.kv_cache),
            "stages": [
                {
                    "stage_index": s.stage_index,
                    "layers": [s.load_info.layer_start, s.load_info.layer_end],
                    "weights_bytes": s.load_info.weights_bytes,
                    "quantization": s.load_info.quantization,
                    "expert_weights_bytes": s.load_info.expert_weights_bytes,
                    "kv_block_bytes": s.load_info.kv_block_bytes,
                    "kv_cache_dtype": _dtype_name(s.load_info.kv_cache_dtype),
                    "memory_budget_bytes": s.load_info.memory_budget_bytes,
                    "kv_groups": s.load_info.kv_groups,
                    "cpu": s.load_info.cpu,
                    # how its hidden states go to the next stage (issue 37): shm, nccl, grpc
                    "data_channel": s.stats.data_channel or s.load_info.data_channel,
                    # how its step messages go on: "unix" (a local socket) or "grpc"
                    "control_channel": s.stats.control_channel,
                }
                for s in stats.stages
            ],
        }

    @app.get("/debug/replicas", tags=["Operations"], responses={401: _ERRORS[401]})
    async def debug_replicas() -> dict[str, Any]:
        """Router mode (several schedulers): each replica's health, load and the requests
        routed there, the routing policy, and how often it fell back to routing by load."""
        rs, prefill = gw.generator.replicas, gw.generator.prefill
        out: dict[str, Any] = (
            {"routing": None, "replicas": gw.generator.replica_views()}
            if rs is None
            else {
                "routing": rs.policy,
                "replicas": rs.describe(),
                "fallbacks": rs.num_fallbacks,
                "retries": rs.num_retries,
                "index": None
                if rs.index is None
                else {"failing": rs.index.failing, "lookups": rs.index.num_lookups, "failures": rs.index.num_failures},
            }
        )
        if prefill is not None:  # P/D disaggregation (gateway/disaggregation.py): the prefill pool
            out["prefill"] = {
                "routing": prefill.replicas.policy,
                "replicas": prefill.replicas.describe(),
                **dataclasses.asdict(prefill.stats),
            }
        return out

    @app.get("/dashboard", tags=["Operations"], response_class=HTMLResponse)
    async def dashboard_page() -> HTMLResponse:
        """The live dashboard (docs/metrics.md): one page, no external assets, polling
        /dashboard/state. With API keys on, the page asks for one (or takes `#key=...`)."""
        return HTMLResponse(dashboard.page())

    @app.get("/dashboard/state", tags=["Operations"], responses={401: _ERRORS[401], 503: _ERRORS[503]})
    async def dashboard_state() -> dict[str, Any]:
        """What the dashboard shows, as JSON: requests and queues by tenant and priority,
        the KV block map, the stages' compute spans of the last seconds, token counters."""
        try:
            stats = await gw.generator.stats(include_kv_sequences=True, include_requests=True, include_timeline=True)
        except grpc.aio.AioRpcError as exc:
            raise GenerationError(exc.code(), exc.details() or exc.code().name) from exc
        return dashboard.state(stats, gw.limits.name)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagoda")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def _enum_name(value: int) -> str:
    from services.pb import common_pb2

    return common_pb2.HealthStatus.Name(value)


def _dtype_name(value: int) -> str:
    """A DType as the flags name it ("float32", "bfloat16"); "" when the stage did not say."""
    from services.pb import common_pb2

    name = common_pb2.DType.Name(value) if value in common_pb2.DType.values() else ""
    return {"DTYPE_FLOAT32": "float32", "DTYPE_BFLOAT16": "bfloat16", "DTYPE_FLOAT16": "float16"}.get(name, "")


def _plain(message: Any) -> dict[str, Any]:
    """A protobuf message as JSON-ready values (64-bit integers stay numbers)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.message_type is not None:
            out[fd.name] = [_plain(v) for v in value] if fd.is_repeated else _plain(value)
        elif fd.is_repeated or isinstance(value, bytes):  # bytes: one number per byte
            out[fd.name] = list(value)
        else:
            out[fd.name] = value
    return out
