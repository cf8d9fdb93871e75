"""How the load generator talks to a server: one `send` per request, filling its record.

    HttpClient        the gateway's OpenAI-compatible `POST /v1/completions`, streaming (SSE)
    SchedulerClient   the scheduler's `Generate` over gRPC (the Gantt run's debug timelines)
    InProcessClient   the in-process engine's `submit` (no gRPC, no HTTP)

Every request asks for greedy decoding with `ignore_eos` and `max_tokens` set, so output
lengths are exact. A chunk's arrival time is taken when the client has parsed it.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field

from bench.stats import RequestRecord, ServiceSnapshot, StageCounters
from bench.workloads import BenchRequest

_ids = itertools.count()


def _request_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}-{uuid.uuid4().hex[:8]}"


def parse_sse_line(line: str) -> dict | None | str:
    """One SSE line: the JSON object of a `data:` line, "[DONE]", or None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    if not data:
        return None
    return json.loads(data)


async def sse_chunks(http, url: str, body: dict):
    """POST `body` to `url` as a stream; yields (arrival time, chunk) for each `data:` object
    until "[DONE]". RuntimeError on a status other than 200 or a chunk carrying an error."""
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            chunk = parse_sse_line(line)
            if chunk == "[DONE]":
                return
            if chunk is None:
                continue
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {chunk['error']}")
            yield time.perf_counter(), chunk


def apply_chunk(record: RequestRecord, chunk: dict, now_s: float) -> None:
    """Fold one streamed completion chunk into `record`: a chunk carrying text is one arrival;
    `usage` (the stream's last chunk) gives the token count; an `error` fails the record."""
    if chunk.get("error"):
        err = chunk["error"]
        record.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    if any(c.get("text") for c in chunk.get("choices") or ()):
        record.chunk_times.append(now_s)
    usage = chunk.get("usage")
    if usage:
        record.num_output_tokens = int(usage.get("completion_tokens", 0))


class HttpClient:
    """Streams `POST {base_url}/v1/completions` with the prompt as token ids."""

    def __init__(
        self, base_url: str, model: str, concurrency: int, timeout_s: float = 600.0, ignore_eos: bool = True
    ) -> None:
        import httpx2

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.ignore_eos = ignore_eos  # vLLM's extra: every max_tokens token is generated
        self._http = httpx2.AsyncClient(
            timeout=httpx2.Timeout(timeout_s),
            limits=httpx2.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4),
        )

    def body(self, req: BenchRequest) -> dict:
        body = {
            "model": self.model,
            "prompt": list(req.prompt_ids),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # (left out otherwise: servers without vLLM's extras refuse it)
            body["ignore_eos"] = True
        return body

    async def send(self, req: BenchRequest, record: RequestRecord) -> None:
        try:
            async with self._http.stream("POST", f"{self.base_url}/v1/completions", json=self.body(req)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    record.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return
                async for line in resp.aiter_lines():
                    item = parse_sse_line(line)
                    if item is None:
                        continue
                    if item == "[DONE]":
                        break
                    apply_chunk(record, item, time.perf_counter())
                    if record.error:
                        return
            if not record.num_output_tokens:  # no usage chunk: count the chunks
                record.num_output_tokens = len(record.chunk_times)
            record.done_s = time.perf_counter()
        except Exception as exc:  # a failed request is recorded, not fatal
            record.error = f"{type(exc).__name__}: {exc}"

    async def get_json(self, path: str) -> dict:
        resp = await self._http.get(f"{self.base_url}{path}")
        resp.raise_for_status()
        return resp.json()

    async def close(self) -> None:
        await self._http.aclose()


@dataclass
class SchedulerClient:
    """`pagoda.v1.Scheduler/Generate`, token ids both ways; keeps timelines when asked."""

    address: str
    debug_timeline: bool = False
    timeline_events: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from services.grpc_utils import aio_channel
        from services.pb import scheduler_pb2_grpc

        self._channel = aio_channel(self.address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def send(self, req: BenchRequest, record: RequestRecord) -> None:
        import grpc

        from services.pb import common_pb2, scheduler_pb2

        msg = scheduler_pb2.GenerateRequest(
            request_id=_request_id("bench"),
            prompt_token_ids=req.prompt_ids,
            sampling_params=common_pb2.SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True),
            debug_timeline=self.debug_timeline,
        )
        try:
            async for resp in self._stub.Generate(msg):
                if resp.token_ids:
                    record.chunk_times.append(time.perf_counter())
                    record.num_output_tokens += len(resp.token_ids)
                if resp.error_message:
                    record.error = resp.error_message
                for e in resp.timeline:
                    self.timeline_events.append(e)
            if record.error is None:
                record.done_s = time.perf_counter()
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"

    async def stats(self):
        from services.pb import scheduler_pb2

        return await self._stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10.0)

    async def snapshot(self) -> ServiceSnapshot:
        return snapshot_from_pb(await self.stats())

    async def close(self) -> None:
        await self._channel.close()


class InProcessClient:
    """Submits straight to an in-process `scheduler_svc.engine.Engine`."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def send(self, req: BenchRequest, record: RequestRecord) -> None:
        from scheduler_svc.core.request import Request, SamplingOptions

        options = SamplingOptions(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            async for out in self.engine.submit(Request(_request_id("bench"), req.prompt_ids, options, 0.0)):
                n = sum(len(d.token_ids) for d in out.deltas)
                if n:
                    record.chunk_times.append(time.perf_counter())
                    record.num_output_tokens += n
                if out.error is not None:
                    record.error = f"{out.error[0]}: {out.error[1]}"
            if record.error is None:
                record.done_s = time.perf_counter()
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"

    async def snapshot(self) -> ServiceSnapshot:
        engine = self.engine
        kv = await engine.kv.stats_message()
        s = engine.summary()
        cfg = engine.config
        busy = getattr(engine.transport, "busy_ns", [])
        return ServiceSnapshot(
            t_ns=time.perf_counter_ns(),
            config={
                **_config_dict(cfg),
                "kv_enable_prefix_caching": kv.enable_prefix_caching,
                "kv_address": "in-process",
                "num_stages": len(busy),
            },
            stages=tuple(StageCounters(i, b, 0, address="in-process") for i, b in enumerate(busy)),
            num_preemptions=s["num_preemptions"],
            num_generated_tokens=s["num_generated_tokens"],
            num_prompt_tokens=s["num_prompt_tokens"],
            num_micro_batches=s["num_micro_batches"],
            num_finished_requests=s["num_finished"],
            **_kv_fields(kv),
            transport="in-process",
        )

    async def close(self) -> None:
        pass


def _config_dict(cfg) -> dict:
    return {
        "pipeline_parallel_size": int(cfg.pipeline_parallel_size),
        # the effective mode: the scheduler's GetStats reports it; a SchedulerConfig resolves it
        "async_scheduling": bool(cfg.is_async if hasattr(cfg, "is_async") else cfg.async_scheduling),
        "enable_chunked_prefill": bool(cfg.enable_chunked_prefill),
        "enable_prefix_caching": bool(cfg.enable_prefix_caching),
        "max_num_batched_tokens": int(cfg.max_num_batched_tokens),
        "max_num_seqs": int(cfg.max_num_seqs),
        "num_kv_blocks": int(cfg.num_kv_blocks or 0),
        "block_size": int(cfg.block_size),
    }


def _kv_fields(kv) -> dict:
    return {
        "kv_num_prefix_query_tokens": kv.num_prefix_query_tokens,
        "kv_num_prefix_hit_tokens": kv.num_prefix_hit_tokens,
        "kv_internal_fragmentation": kv.internal_fragmentation,
        "kv_external_fragmentation": kv.external_fragmentation,
        "kv_num_used_blocks": kv.num_used_blocks,
        "kv_num_total_blocks": kv.num_total_blocks,
        "kv_num_peak_used_blocks": kv.num_peak_used_blocks,
    }


def snapshot_from_pb(resp) -> ServiceSnapshot:
    """A `ServiceSnapshot` of the scheduler's `GetStatsResponse`."""
    stages = tuple(
        StageCounters(
            s.stage_index,
            s.stats.busy_ns,
            s.stats.idle_ns,
            s.stats.num_micro_batches,
            s.stats.peak_in_flight,
            s.address,
        )
        for s in resp.stages
    )
    return ServiceSnapshot(
        t_ns=time.perf_counter_ns(),
        config={
            **_config_dict(resp.config),
            "kv_enable_prefix_caching": resp.kv_cache.enable_prefix_caching,
            "kv_address": resp.kv_address,
            "num_stages": len(stages),
        },
        stages=stages,
        num_preemptions=resp.num_preemptions,
        num_generated_tokens=resp.num_generated_tokens,
        num_prompt_tokens=resp.num_prompt_tokens,
        num_micro_batches=resp.num_micro_batches,
        num_finished_requests=resp.num_finished_requests,
        **_kv_fields(resp.kv_cache),
    )
