"""The router's view of which replica holds which prefix: the KV services' index in Redis.

Each KV service started with `--replica-id NAME --redis-url URL` keeps the keys of its
cached blocks in a Redis set, with a heartbeat (kvcache_svc/publisher.py). For a prompt the
router computes the same hash chain over its full blocks (services/prefix_hash.py, with the
replica's namespace: its scheduler's model) and asks, in one pipelined round trip, which
of those keys each live replica holds; the leading run of hits is what that replica would
not have to compute.

Redis being down or slow (`timeout_s`) is not an error: `cached_blocks` returns None and
the router falls back to least-loaded; after a failure Redis is left alone for
`RETRY_AFTER_S` (requests do not each wait for a timeout), then one lookup tries again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from gateway.routing import leading_hits_with_tier
from services.kv_index_schema import replica_keys
from services.prefix_hash import block_keys

log = logging.getLogger(__name__)

MAX_BLOCKS = 512  # a prompt's leading blocks looked up (beyond them the scores barely differ)
RETRY_AFTER_S = 1.0


class KVIndex:
    def __init__(self, url: str, timeout_s: float = 0.1) -> None:
        import redis.asyncio as aioredis  # only with --redis-url

        self.url = url
        self._client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._skip_until = 0.0
        self.failing = False
        self.num_lookups = 0
        self.num_failures = 0

    async def close(self) -> None:
        await self._client.aclose()

    async def cached_blocks(
        self,
        replicas: Sequence[tuple[str, str | None]],
        token_ids: Sequence[int],
        block_size: int,
        known: Mapping[str | None, list[bytes]] | None = None,
    ) -> tuple[dict[str, float], int, dict[str, int]] | None:
        """({replica: leading blocks of the prompt it holds, those only in its KV tier counted
        at `TIER_HIT_WEIGHT`}, the prompt's full blocks,
        {replica: blocks in its prefix cache}) for the replicas (name, namespace) whose
        heartbeat is live (0 for the others); None when Redis cannot say now. `known`: the
        prompt's block keys (up to MAX_BLOCKS) the caller already has, by namespace."""
        from redis.exceptions import RedisError

        now = time.monotonic()
        if now < self._skip_until:
            return None
        by_namespace: dict[str | None, list[bytes]] = dict(known or {})
        for _, namespace in replicas:
            if namespace not in by_namespace:
                by_namespace[namespace] = block_keys(token_ids, block_size, namespace, MAX_BLOCKS)
        prompt_blocks = max((len(k) for k in by_namespace.values()), default=0)
        pipe = self._client.pipeline(transaction=False)
        for name, namespace in replicas:
            keys = replica_keys(name)
            blocks, alive = keys.blocks, keys.alive
            pipe.exists(alive)
            pipe.scard(blocks)
            if prompt_blocks:
                pipe.smismember(blocks, by_namespace[namespace])
                pipe.smismember(keys.tier, by_namespace[namespace])
        self.num_lookups += 1
        try:
            replies = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            self.num_failures += 1
            self._skip_until = now + RETRY_AFTER_S
            if not self.failing:
                log.warning(
                    "prefix index in Redis unreachable (%s: %s): routing by load until it is back",
                    type(exc).__name__,
                    exc,
                )
            self.failing = True
            return None
        if self.failing:
            log.info("prefix index in Redis reachable again: routing by prefix")
        self.failing = False
        out, sizes, per = {}, {}, 4 if prompt_blocks else 2
        for i, (name, _) in enumerate(replicas):
            alive, size = replies[per * i], replies[per * i + 1]
            pool = [bool(f) for f in replies[per * i + 2]] if prompt_blocks else []
            tier = [bool(f) for f in replies[per * i + 3]] if prompt_blocks else []
            # the block holding the prompt's last token is computed, never loaded from a tier
            tier = [f and j < (len(token_ids) - 1) // block_size for j, f in enumerate(tier)]
            out[name] = leading_hits_with_tier(pool, tier) if alive else 0
            sizes[name] = size if alive else 0
        return out, prompt_blocks, sizes
