"""A KV service's prefix cache, published to Redis for routers (issue 13).

`pagoda kvcache --replica-id r0 --redis-url redis://...` runs this beside the service, in
its process: it follows the service's KV events (kvcache_svc/events.py) and keeps, under its
own replica's keys (`services/kv_index_schema.py`),

- `blocks`: a set of the keys of every block in the replica's prefix cache (the index a router
  asks: "how many of this prompt's leading blocks does r0 hold?");
- `events`: the events themselves, a stream trimmed to about `STREAM_MAXLEN` entries (for
  other consumers, and to see what happened);
- `alive`: the heartbeat, expiring `ALIVE_TTL_S` after the last one. The block set expires
  `INDEX_TTL_S` after the last heartbeat: a replica that stops publishing drops out of the
  index by itself.

Memory in Redis is bounded by the replica's cache size (one 32-byte member per cached
block), the trimmed stream and the TTLs. Whenever the publisher (re)connects, or falls
behind its event feed, it rewrites the set from a snapshot of the cache, so an index that
Redis lost (a restart) or that missed events is whole again within a heartbeat.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from kvcache_svc.events import Cleared, Event, EventLog, Removed, Stored
from services.kv_index_schema import replica_keys

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
ALIVE_TTL_S = 5
INDEX_TTL_S = 15
STREAM_MAXLEN = 10_000
_CHUNK = 1024  # members per SADD


class RedisPublisher:
    """Follows `log` and keeps this replica's index in Redis; reconnects for ever."""

    def __init__(
        self,
        url: str,
        replica: str,
        log_: EventLog,
        snapshot: Callable[[], list[Stored]],
        block_size: int,
        timeout_s: float = 1.0,
    ) -> None:
        import redis.asyncio as aioredis

        self.replica = replica
        self.keys = replica_keys(replica)
        self._log = log_
        self._snapshot = snapshot
        self._block_size = block_size
        self._client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._task: asyncio.Task | None = None
        self.num_resyncs = 0
        self.num_published = 0
        self.connected = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-publisher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()

    async def _run(self) -> None:
        from redis.exceptions import RedisError

        failing_since = None
        while True:
            queue = self._log.subscribe()
            try:
                synced = await self._resync()
                if failing_since is not None:
                    log.info(
                        "KV index in Redis rewritten for %s after %.1f s without Redis",
                        self.replica,
                        time.monotonic() - failing_since,
                    )
                failing_since = None
                self.connected = True
                await self._follow(queue, synced)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                self.connected = False
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning(
                        "KV index in Redis for %s not kept: %s: %s (retrying)", self.replica, type(exc).__name__, exc
                    )
                await asyncio.sleep(HEARTBEAT_S)
            finally:
                self._log.unsubscribe(queue)

    async def _resync(self) -> int:
        """Rewrite the block set from the cache as it is; returns the sequence number it
        reflects (later events in the queue are applied on top)."""
        seq = self._log.last_sequence_number
        snapshot = self._snapshot()
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self.keys.blocks, self.keys.tier)
        for name, tier in ((self.keys.blocks, False), (self.keys.tier, True)):
            keys = [k for s in snapshot if bool(s.medium) == tier for k in s.keys]
            for i in range(0, len(keys), _CHUNK):
                pipe.sadd(name, *keys[i : i + _CHUNK])
        self._heartbeat(pipe, seq)
        await pipe.execute()
        self.num_resyncs += 1
        return seq

    def _heartbeat(self, pipe, seq: int) -> None:
        alive = json.dumps({"epoch": self._log.epoch, "sequence_number": seq, "block_size": self._block_size})
        pipe.set(self.keys.alive, alive, ex=ALIVE_TTL_S)
        pipe.expire(self.keys.blocks, INDEX_TTL_S)
        pipe.expire(self.keys.tier, INDEX_TTL_S)

    async def _follow(self, queue: asyncio.Queue, synced: int) -> None:
        seq = synced
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
            except TimeoutError:
                pipe = self._client.pipeline(transaction=False)
                self._heartbeat(pipe, seq)
                await pipe.execute()
                continue
            if event is None:  # fell behind the feed: start over from a snapshot
                return
            batch = [event]
            while not queue.empty() and len(batch) < 256:
                nxt = queue.get_nowait()
                if nxt is None:
                    return
                batch.append(nxt)
            batch = [e for e in batch if e.sequence_number > seq]
            if not batch:
                continue
            pipe = self._client.pipeline(transaction=True)
            for e in batch:
                self._apply(pipe, e)
            seq = batch[-1].sequence_number
            self._heartbeat(pipe, seq)
            await pipe.execute()
            self.num_published += len(batch)

    def _apply(self, pipe, event: Event) -> None:
        change, blocks = event.change, self.keys.blocks
        fields: dict[str, str | bytes] = {"seq": str(event.sequence_number), "epoch": str(event.epoch)}
        if isinstance(change, Stored):
            pipe.sadd(self.keys.tier if change.medium else blocks, *change.keys)
            fields.update(
                type="stored", keys=b"".join(change.keys), parent=change.parent_key, tokens=len(change.token_ids)
            )
        elif isinstance(change, Removed):
            pipe.srem(self.keys.tier if change.medium else blocks, *change.keys)
            fields.update(type="removed", keys=b"".join(change.keys))
        elif isinstance(change, Cleared):
            pipe.delete(blocks, self.keys.tier)
            fields.update(type="cleared")
        if isinstance(change, (Stored, Removed)) and change.medium:
            fields["medium"] = change.medium
        pipe.xadd(self.keys.events, fields, maxlen=STREAM_MAXLEN, approximate=True)
