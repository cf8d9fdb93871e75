"""The waiting queue: a dynamic priority queue with weighted fair queuing across tenants.

Policies:
- `fcfs`: arrival order.
- `priority`: a lower `priority` value runs sooner (as in vLLM), arrival order within one.
- `hybrid`: fair across tenants (start-time fair queuing: the tenant with the smallest
  virtual start tag goes next, each admission advancing its tenant's finish tag by the
  request's token cost divided by the tenant's weight), shortest prefill first within a
  tenant.

Aging: a request's rank improves linearly with its waiting time (`aging_rate` priority units,
or prompt tokens for `hybrid`, per second), so nothing starves. Since every waiting request
ages at the same rate, the order of two requests never changes while they wait: each key
is `base + aging_rate * arrival_s`, fixed at push time, and lists stay sorted.

A preempted request keeps its place ahead of its peers: it sorts before every request that
was never preempted (within its tenant for `hybrid`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_svc.core.request import Request

POLICIES = ("fcfs", "priority", "hybrid")


class QueueFull(Exception):
    """The queue is at its bound: RESOURCE_EXHAUSTED, try later."""


@dataclass
class _Tenant:
    name: str
    weight: float
    finish_tag: float = 0.0
    entries: list[tuple[tuple, int, Request]] = field(default_factory=list)  # sorted
    served_tokens: int = 0


class WaitingQueue:
    """Requests waiting for admission, in service order. One owner; not thread-safe."""

    def __init__(
        self,
        policy: str = "fcfs",
        tenant_weights: Mapping[str, float] | None = None,
        default_weight: float = 1.0,
        aging_rate: float = 0.0,
        max_len: int = 100_000,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduler_policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.tenant_weights = dict(tenant_weights or {})
        self.default_weight = default_weight
        self.aging_rate = aging_rate
        self.max_len = max_len
        self._tenants: dict[str, _Tenant] = {}
        self._where: dict[str, tuple[str, tuple, int]] = {}  # request_id -> (tenant, key, seq)
        self._counter = 0
        self._virtual_time = 0.0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._where

    def _tenant_of(self, request: Request) -> _Tenant:
        # fcfs and priority order every request in one list; hybrid keeps one per tenant
        name = request.tenant if self.policy == "hybrid" else ""
        tenant = self._tenants.get(name)
        if tenant is None:
            weight = self.tenant_weights.get(name, self.default_weight)
            tenant = _Tenant(name, weight, finish_tag=self._virtual_time)
            self._tenants[name] = tenant
        return tenant

    def _key(self, request: Request) -> tuple:
        fresh = 0 if request.num_preemptions else 1
        if self.policy == "fcfs":
            return (fresh, request.arrival_s)
        if self.policy == "priority":
            return (fresh, request.priority + self.aging_rate * request.arrival_s, request.arrival_s)
        prefill = len(request.prompt) + max((len(s.output) for s in request.sequences), default=0)
        return (fresh, prefill + self.aging_rate * request.arrival_s, request.arrival_s)

    def push(self, request: Request) -> None:
        """Add a request (new, or back from preemption); raises QueueFull at the bound."""
        if request.request_id in self._where:
            raise ValueError(f"request {request.request_id} is already queued")
        if len(self) >= self.max_len and not request.num_preemptions:
            raise QueueFull(f"the waiting queue is full ({self.max_len} requests)")
        tenant = self._tenant_of(request)
        key = self._key(request)
        self._counter += 1
        entry = (key, self._counter, request)
        bisect.insort(tenant.entries, entry, key=lambda e: (e[0], e[1]))
        self._where[request.request_id] = (tenant.name, key, self._counter)

    def remove(self, request: Request) -> bool:
        """Take a request out without charging its tenant (an abort). True if it was queued."""
        where = self._where.pop(request.request_id, None)
        if where is None:
            return False
        name, key, counter = where
        entries = self._tenants[name].entries
        i = bisect.bisect_left(entries, (key, counter), key=lambda e: (e[0], e[1]))
        assert entries[i][2] is request
        del entries[i]
        return True

    def admit(self, request: Request) -> None:
        """Take the request out for service and charge its tenant (virtual finish tag)."""
        name = self._where[request.request_id][0]
        self.remove(request)
        tenant = self._tenants[name]
        cost = _cost(request)
        start = max(self._virtual_time, tenant.finish_tag)
        tenant.finish_tag = start + cost / tenant.weight
        tenant.served_tokens += cost
        self._virtual_time = start

    def ordered(self, limit: int | None = None) -> list[Request]:
        """Up to `limit` requests in the order they would be admitted now (no change made)."""
        limit = len(self) if limit is None else min(limit, len(self))
        if self.policy != "hybrid" or len(self._tenants) <= 1:
            merged = [e[2] for t in self._tenants.values() for e in t.entries[:limit]]
            if len(self._tenants) > 1:
                merged.sort(key=lambda r: self._where[r.request_id][1:])
            return merged[:limit]
        # simulate start-time fair queuing across tenants
        heads = {name: 0 for name, t in self._tenants.items() if t.entries}
        finish = {name: self._tenants[name].finish_tag for name in heads}
        vtime = self._virtual_time
        out: list[Request] = []
        while heads and len(out) < limit:
            name = min(heads, key=lambda n: (max(vtime, finish[n]), self._tenants[n].entries[heads[n]][0]))
            tenant = self._tenants[name]
            request = tenant.entries[heads[name]][2]
            out.append(request)
            start = max(vtime, finish[name])
            finish[name] = start + _cost(request) / tenant.weight
            vtime = start
            heads[name] += 1
            if heads[name] >= len(tenant.entries):
                del heads[name]
        return out

    def depth_by_tenant(self) -> dict[str, int]:
        depth: dict[str, int] = {}
        for tenant in self._tenants.values():
            for _, _, request in tenant.entries:
                depth[request.tenant] = depth.get(request.tenant, 0) + 1
        return depth

    def served_tokens_by_tenant(self) -> dict[str, int]:
        return {name: t.served_tokens for name, t in self._tenants.items()}

    def check_integrity(self) -> None:
        total = 0
        for tenant in self._tenants.values():
            keys = [(e[0], e[1]) for e in tenant.entries]
            assert keys == sorted(keys), f"tenant {tenant.name!r} entries out of order"
            for key, counter, request in tenant.entries:
                assert self._where[request.request_id] == (tenant.name, key, counter)
            total += len(tenant.entries)
        assert total == len(self._where), "index and lists disagree"


def _cost(request: Request) -> int:
    """Tokens a request will be served: its prompt plus the most it can generate."""
    return len(request.prompt) + request.options.max_tokens * request.options.n
