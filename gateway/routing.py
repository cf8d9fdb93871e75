"""Which replica serves a request: the router's scoring, pure Python (issue 13).

A replica is one scheduler with its KV service and stages. The gateway in router mode
(`pagoda gateway --scheduler r0=HOST:PORT,r1=...`) calls `choose` for each request with
what it knows of every replica: health and load from the replicas' stats (polled) and its
own count of requests in flight there; for the `prefix` policy also how many of the
prompt's leading full blocks each replica holds in its prefix cache (from the shared index
in Redis, gateway/kv_index.py, and `RoutedBlocks`, where the router sent them lately).
`pagoda simulate-routing` replays workloads through this same function.

Policies:
- `prefix` (default): the lowest cost, where cost = the share of the prompt's blocks the
  replica would have to compute (1 - cached / prompt blocks) + LOAD_WEIGHT x its load
  (requests waiting and running over its batch capacity) + KV_WEIGHT x the share of its KV
  pool in use + CACHE_WEIGHT x the share holding cached prefixes + SPREAD_WEIGHT x its
  share of the distinct prefixes (first blocks) this router sent out lately. A replica holding the
  whole prefix wins until it is about one full batch busier than an idle one (NVIDIA
  Dynamo's KV router weighs prefill blocks against active load the same way); a prefix no
  replica holds goes where it evicts least, so the replicas' caches split the prefixes
  between them instead of each holding all. Ties: lighter load, then rotation.
- `least-loaded`: the lowest load (and `prefix` when `cached` is None).
- `round-robin`: each healthy replica in turn.

Session affinity: a request with a session key (`user` in the body, or the
`x-session-id` header) goes to the same healthy replica every time (rendezvous hashing:
when a replica leaves, only its sessions move).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.defaults import ROUTING_POLICIES

POLICIES = ROUTING_POLICIES
LOAD_WEIGHT = 1.0
KV_WEIGHT = 0.25  # a nearly full KV pool preempts: a replica at 100% costs a quarter miss more
# the share of the prefixes this router sent out lately that went there: a prefix no replica
# holds goes where fewer live (caches full of old prefixes all look alike)
SPREAD_WEIGHT = 0.5
CACHE_WEIGHT = 0.5  # a pool full of cached prefixes evicts to take a new one (0.5 beat 0.25 in the simulator)


class NoReplica(Exception):
    """No healthy replica to send a request to."""


@dataclass
class ReplicaState:
    """What the router knows of one replica."""

    name: str
    healthy: bool = True
    waiting: int = 0  # from its last stats
    running: int = 0
    kv_usage: float = 0.0  # fraction of its KV blocks in use
    capacity: int = 256  # its max_num_seqs
    in_flight: int = 0  # requests this router sent there that have not ended
    finished_since_poll: int = 0  # of those, ended since its last stats were read
    cache_fill: float = 0.0  # fraction of its KV pool holding cached prefix blocks
    prefix_share: float = 0.0  # of the distinct prefixes this router sent out lately, the share sent here

    @property
    def load(self) -> float:
        """Requests there over its batch capacity: its last stats less what this router saw
        end there since (stats are up to a poll old), or the router's own count when that is
        higher."""
        stale = max(0, self.waiting + self.running - self.finished_since_poll)
        return max(stale, self.in_flight) / max(1, self.capacity)


@dataclass(frozen=True)
class Choice:
    name: str
    cached_blocks: int = 0  # of the prompt's full blocks, held there
    cost: float = 0.0


def rendezvous(key: str, names: Sequence[str]) -> str:
    """The replica a session key maps to: the highest hash of (key, replica)."""
    return max(names, key=lambda n: hashlib.blake2b(f"{key}\0{n}".encode(), digest_size=8).digest())


def cost(replica: ReplicaState, cached_blocks: int, prompt_blocks: int) -> float:
    miss = 1.0 - cached_blocks / prompt_blocks if prompt_blocks else 0.0
    return (
        miss
        + LOAD_WEIGHT * replica.load
        + KV_WEIGHT * replica.kv_usage
        + CACHE_WEIGHT * replica.cache_fill
        + SPREAD_WEIGHT * replica.prefix_share
    )


def choose(
    policy: str,
    replicas: Sequence[ReplicaState],
    turn: int = 0,
    cached: Mapping[str, int] | None = None,
    prompt_blocks: int = 0,
    session: str | None = None,
    exclude: frozenset[str] = frozenset(),
) -> Choice:
    """The replica for one request. `turn`: a counter the caller advances per request
    (rotation); `cached`: replica -> leading prompt blocks it holds (None: unknown, which
    makes `prefix` act as `least-loaded`); `exclude`: replicas already tried for it.
    NoReplica when none is healthy."""
    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    live = [r for r in replicas if r.healthy and r.name not in exclude]
    if not live:
        raise NoReplica("no healthy replica" + (" left to try" if exclude else ""))
    rotated = live[turn % len(live) :] + live[: turn % len(live)]
    if session:
        name = rendezvous(session, [r.name for r in live])
        return Choice(name, (cached or {}).get(name, 0))
    if policy == "round-robin":
        return Choice(rotated[0].name, (cached or {}).get(rotated[0].name, 0))
    if policy == "least-loaded" or cached is None:
        best = min(rotated, key=lambda r: (r.load, r.kv_usage))
        return Choice(best.name, 0, best.load)
    scored = [(cost(r, cached.get(r.name, 0), prompt_blocks), r.load, i, r) for i, r in enumerate(rotated)]
    c, _, _, best = min(scored, key=lambda s: s[:3])
    return Choice(best.name, cached.get(best.name, 0), c)


class RoutedBlocks:
    """The router's own memory of where it sent each prompt's full blocks lately (SGLang's
    router routes by such a memory alone). It covers what the shared index cannot say yet or
    at all: a prefix sent out moments ago that its replica has not published, and every
    prefix while Redis is unreachable, so one lookup that times out does not scatter a
    prefix's requests over replicas that each then compute and cache it.

    A block key maps to the replica it went to last; at most `capacity` keys, oldest first out."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._where: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def remember(self, keys: Sequence[bytes], name: str, now: float) -> None:
        for k in keys:
            self._where[k] = (name, now)
            self._where.move_to_end(k)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def held(self, keys: Sequence[bytes], now: float, max_age: float) -> dict[str, int]:
        """{replica: the prompt's leading blocks sent there within `max_age` seconds}: one
        replica at most (the leading run ends where the blocks went elsewhere)."""
        name, n = None, 0
        for k in keys:
            seen = self._where.get(k)
            if seen is None or now - seen[1] > max_age or (name is not None and seen[0] != name):
                break
            name, n = seen[0], n + 1
        return {name: n} if name is not None else {}


TIER_HIT_WEIGHT = 0.5  # a block in a replica's KV tier (a load) counts half a pool hit (no work at all)


def leading_hits_with_tier(pool: Sequence[bool], tier: Sequence[bool]) -> float:
    """A prompt's leading blocks a replica holds, those only in its KV tier weighted
    `TIER_HIT_WEIGHT`: the chain goes on through either, the pool's hits first."""
    n, hits = 0, 0.0
    for in_pool, in_tier in zip(pool, tier, strict=True):
        if in_pool:
            hits += 1.0
        elif in_tier:
            hits += TIER_HIT_WEIGHT
        else:
            break
        n += 1
    return hits


def leading_hits(flags: Sequence[bool]) -> int:
    """How many of a prompt's blocks, from the first, a replica holds (a chain: a block is
    usable only after all before it)."""
    n = 0
    for held in flags:
        if not held:
            break
        n += 1
    return n
