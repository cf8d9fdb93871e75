"""The gateway as a router: several replicas (each a scheduler with its KV service and
stages) behind one front door (issue 13).

`pagoda gateway --scheduler r0=HOST:PORT,r1=HOST:PORT --routing prefix --redis-url URL`:
each request goes to one replica, chosen by `gateway.routing.choose` from

- each replica's health and load, from its scheduler's `GetStats` polled every `POLL_S`
  (a replica that does not answer within `POLL_TIMEOUT_S`, or reports itself not serving,
  is drained at once: nothing new goes there until it answers serving again), and this
  gateway's own count of requests in flight there;
- for `prefix`, how much of the prompt each replica holds in its prefix cache, from the
  KV services' shared index in Redis (gateway/kv_index.py), and where this router sent the
  prompt's blocks lately (`routing.RoutedBlocks`): within `INDEX_LAG_S` of sending them
  (not published yet) beside the index, and alone without Redis or while it is unreachable.

A call that fails UNAVAILABLE before anything streamed (the replica died or is
restarting) marks that replica down and is sent to another at once; each replica is tried
once per request, after which the request waits for one to come back (`TextGenerator`).

One scheduler (`--scheduler HOST:PORT`) is a replica set of one: it routes nothing and is
not polled (its calls say whether it serves, and `/health` asks it), so its one member is
every request's choice until the request has tried it; a request it failed so backs off
and tries it again through the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import FieldDescriptor

from gateway.kv_index import MAX_BLOCKS
from gateway.routing import POLICIES, Choice, NoReplica, ReplicaState, RoutedBlocks, choose
from gateway.scheduler_stream import SchedulerStream
from services.defaults import BLOCK_SIZE
from services.grpc_utils import aio_channel
from services.pb import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.prefix_hash import block_keys

log = logging.getLogger(__name__)

POLL_S = 0.5
PREFIX_WINDOW_S = 300.0  # how long a prefix sent out counts in its replica's share
PREFIX_MEMORY = 4096
# how long blocks this router sent somewhere count as held there though the index does not
# show them yet (a KV service publishes what it cached within milliseconds when well)
INDEX_LAG_S = 2.0
POLL_TIMEOUT_S = 1.0


def parse_targets(text: str) -> list[tuple[str, str]]:
    """`HOST:PORT` (one replica, named r0) or `NAME=HOST:PORT,NAME=HOST:PORT,...`; names
    default to r0, r1, ... by position. ValueError naming what is wrong."""
    out: list[tuple[str, str]] = []
    for i, item in enumerate(p.strip() for p in text.split(",")):
        if not item:
            raise ValueError(f"scheduler: empty address in {text!r}")
        name, _, address = item.rpartition("=")
        name = name or f"r{i}"
        if ":" not in address:
            raise ValueError(f"scheduler: {address!r} is not HOST:PORT")
        if any(name == n for n, _ in out):
            raise ValueError(f"scheduler: replica name {name!r} given twice")
        out.append((name, address))
    return out


@dataclass
class Replica:
    """One replica as the router sees it."""

    name: str
    address: str
    state: ReplicaState = field(init=False)
    stub: scheduler_pb2_grpc.SchedulerStub | None = None
    channel: grpc.aio.Channel | None = None
    namespace: str | None = None  # its scheduler's model: the prefix cache's namespace
    block_size: int = BLOCK_SIZE
    num_blocks: int = 0  # its KV pool
    last_stats: scheduler_pb2.GetStatsResponse | None = None
    why_down: str = "not polled yet"
    num_routed: int = 0
    stream: SchedulerStream | None = None  # every request to it rides one stream (issue 37)

    def __post_init__(self) -> None:
        self.state = ReplicaState(self.name, healthy=False)

    def connect(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self.stub is None:
            self.channel = aio_channel(self.address)
            self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        return self.stub

    def generate(self, request: scheduler_pb2.GenerateRequest, metadata=None):
        """`request` on this replica: on its one stream (gateway/scheduler_stream.py), or as a
        `Generate` call of its own where the scheduler has no stream (or a stand-in stub)."""
        stub = self.connect()
        if not hasattr(stub, "GenerateStream") or (self.stream is not None and self.stream.unsupported):
            return stub.Generate(request, metadata=metadata)
        if self.stream is None:
            self.stream = SchedulerStream(stub)
        return self.stream.generate(request)


class ReplicaSet:
    """The replicas behind one gateway, their health and load, and the choice per request.
    A set of one (`routes` False) is neither polled nor routed: see the module's docstring."""

    def __init__(self, targets: Sequence[tuple[str, str]], policy: str = "prefix", redis_url: str = "") -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.replicas = [Replica(name, address) for name, address in targets]
        self.routes = len(self.replicas) > 1
        self.policy = policy
        self.index = None
        if redis_url and policy == "prefix" and self.routes:
            from gateway.kv_index import KVIndex

            self.index = KVIndex(redis_url)
        self._turn = itertools.count()
        # the first block of each prompt sent out lately -> (replica, when): how the distinct
        # prefixes spread over the replicas (a prefix nobody holds goes where fewer live)
        self._prefixes: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self.routed_blocks = RoutedBlocks()  # where each prompt's blocks went lately
        self._task: asyncio.Task | None = None
        self.num_fallbacks = 0  # prefix routing done by load (no index)
        self.num_retries = 0  # calls made again after one failed UNAVAILABLE before streaming

    def by_name(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    # --- health and load ---------------------------------------------------------------

    def start(self) -> None:
        """Poll the replicas' health and load (a set of one is not polled)."""
        if self._task is None and self.routes:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever(), name="replica-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for r in self.replicas:
            if r.stream is not None:
                await r.stream.close()
            if r.channel is not None:
                await r.channel.close()
        if self.index is not None:
            await self.index.close()

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(POLL_S)

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, r: Replica) -> None:
        try:
            stats = await r.connect().GetStats(scheduler_pb2.GetStatsRequest(), timeout=POLL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.mark_down(r, f"{exc.code().name}: {exc.details()}")
            return
        s = r.state
        serving = (
            stats.health == common_pb2.HEALTH_STATUS_SERVING and stats.kv_health == common_pb2.HEALTH_STATUS_SERVING
        )
        if serving and not s.healthy:
            log.info("replica %s at %s serving", r.name, r.address)
        elif not serving:
            self.mark_down(r, stats.health_detail or "not serving")
        s.healthy = serving
        s.waiting, s.running, s.finished_since_poll = stats.num_waiting, stats.num_running, 0
        kv = stats.kv_cache
        s.kv_usage = kv.num_used_blocks / kv.num_total_blocks if kv.num_total_blocks else 0.0
        r.num_blocks = kv.num_total_blocks
        s.capacity = stats.config.max_num_seqs or s.capacity
        r.namespace = stats.config.model or None
        r.block_size = stats.config.block_size or r.block_size
        r.last_stats = stats

    def mark_down(self, r: Replica, why: str) -> None:
        if r.state.healthy:
            log.warning("replica %s at %s drained: %s", r.name, r.address, why)
        r.state.healthy = False
        r.why_down = why

    @property
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state.healthy]

    # --- choosing ----------------------------------------------------------------------

    async def pick(
        self, prompt_ids: Sequence[int], session: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> tuple[Replica, Choice]:
        """The replica for a request (NoReplica when none is healthy). A set of one's member
        is the choice, whatever its state, until the request has tried it."""
        if not self.routes:
            [only] = self.replicas
            if only.name in exclude:
                raise NoReplica("no replica left to try")
            only.num_routed += 1
            return only, Choice(only.name)
        live = [r for r in self.replicas if r.state.healthy and r.name not in exclude]
        cached, prompt_blocks, keys = None, 0, []
        now = time.monotonic()
        if self.policy == "prefix" and live:
            keys = block_keys(prompt_ids, live[0].block_size, live[0].namespace, MAX_BLOCKS)
        if self.policy == "prefix" and not session and len(live) > 1:
            found = None
            if self.index is not None:
                found = await self.index.cached_blocks(
                    [(r.name, r.namespace) for r in live], prompt_ids, live[0].block_size, {live[0].namespace: keys}
                )
            if found is None:  # no index, or Redis cannot say now: what this router sent where
                self.num_fallbacks += 1
                cached, prompt_blocks = self.routed_blocks.held(keys, now, PREFIX_WINDOW_S), len(keys)
            else:  # the index, and what this router sent out too lately to be published
                cached, prompt_blocks, sizes = found
                for name, n in self.routed_blocks.held(keys, now, INDEX_LAG_S).items():
                    cached[name] = max(cached.get(name, 0), n)
                for r in live:
                    r.state.cache_fill = sizes[r.name] / r.num_blocks if r.num_blocks else 0.0
        if keys:
            self._spread(live)
        choice = choose(
            self.policy, [r.state for r in self.replicas], next(self._turn), cached, prompt_blocks, session, exclude
        )
        replica = self.by_name(choice.name)
        replica.num_routed += 1
        if keys:
            self._prefixes[keys[0]] = (replica.name, now)
            self._prefixes.move_to_end(keys[0])
            self.routed_blocks.remember(keys, replica.name, now)
        return replica, choice

    def _spread(self, live: list[Replica]) -> None:
        """Each live replica's share of the distinct prefixes sent out in the last
        PREFIX_WINDOW_S (at most PREFIX_MEMORY of them)."""
        now = time.monotonic()
        while self._prefixes and (
            len(self._prefixes) > PREFIX_MEMORY or now - next(iter(self._prefixes.values()))[1] > PREFIX_WINDOW_S
        ):
            self._prefixes.popitem(last=False)
        counts = Counter(name for name, _ in self._prefixes.values())
        total = max(1, len(self._prefixes))
        for r in live:
            r.state.prefix_share = counts.get(r.name, 0) / total

    @contextlib.contextmanager
    def in_flight(self, r: Replica):
        r.state.in_flight += 1
        try:
            yield
        finally:
            r.state.in_flight -= 1
            r.state.finished_since_poll += 1

    # --- views -------------------------------------------------------------------------

    def describe(self) -> list[dict]:
        return [
            {
                "name": r.name,
                "address": r.address,
                "healthy": r.state.healthy,
                "why_down": "" if r.state.healthy else r.why_down,
                "waiting": r.state.waiting,
                "running": r.state.running,
                "in_flight": r.state.in_flight,
                "kv_usage": round(r.state.kv_usage, 4),
                "routed": r.num_routed,
                # its request stream: "unix" (the scheduler's local socket), "grpc", or "" (none opened yet)
                "stream": r.stream.channel if r.stream is not None else "",
            }
            for r in self.replicas
        ]


_SUMMED = (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64)


def _add_counts(into, other) -> None:
    for f in into.DESCRIPTOR.fields:
        if (
            f.type in _SUMMED
            and not f.is_repeated
            and f.name != "epoch"
            and not f.name.endswith("_ns")
            and f.name not in ("block_size", "watermark_blocks")
        ):
            setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))


def merge_stats(replies: Sequence[scheduler_pb2.GetStatsResponse]) -> scheduler_pb2.GetStatsResponse:
    """Several replicas' statistics as one: counts and counters summed (the KV pool's too),
    the prefix hit rate recomputed, serving when one replica is; the rest (configuration,
    stages, timeline) is the first's. One reply is itself."""
    if len(replies) == 1:
        return replies[0]
    out = scheduler_pb2.GetStatsResponse()
    out.CopyFrom(replies[0])
    for other in replies[1:]:
        _add_counts(out, other)
        _add_counts(out.kv_cache, other.kv_cache)
        _add_counts(out.disaggregation, other.disaggregation)
        out.tenants.extend(other.tenants)
        out.requests.extend(other.requests)
    kv = out.kv_cache
    kv.prefix_hit_rate = kv.num_prefix_hit_tokens / kv.num_prefix_query_tokens if kv.num_prefix_query_tokens else 0.0
    for name in ("health", "kv_health"):
        if any(getattr(r, name) == common_pb2.HEALTH_STATUS_SERVING for r in replies):
            setattr(out, name, common_pb2.HEALTH_STATUS_SERVING)
    return out


EMULATED_PREFIX = "emulated:"  # a stage's device when its compute is a modelled wait (--device emulated:PROFILE)


def emulated_device(stats: scheduler_pb2.GetStatsResponse) -> str:
    """The emulated device(s) the stages report ("emulated:PROFILE", several joined by ", "),
    or "" when every stage computes on a real one: what /health, /metrics and the dashboard
    say, so that an emulated stack is never taken for a real one."""
    devices = {s.load_info.device for s in stats.stages if s.load_info.device.startswith(EMULATED_PREFIX)}
    return ", ".join(sorted(devices))


__all__ = ["NoReplica", "Replica", "ReplicaSet", "emulated_device", "merge_stats", "parse_targets"]
