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

Tenant records are bounded (tenants are free-form strings). A tenant with nothing waiting
whose finish tag is not ahead of the virtual time is forgotten: a fresh record starts at
the virtual time, so it would rank the same. When nothing waits at all (the end of a busy
period, as in start-time fair queuing) the virtual time moves up to the largest finish tag,
so every record goes. Only if more than `max_idle_tenants` idle tenants are still ahead of
the virtual time (a saturated queue fed by ever new names) is the one nearest to it
forgotten early, which credits it at most its last request's cost over its weight.
Served-token counters outlive the records of configured tenants (`tenant_weights`) only.
"""

from __future__ import annotations

import bisect
import heapq
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


class WaitingQueue:
    """Requests waiting for admission, in service order. One owner; not thread-safe.

    Invariants: every tenant record either holds waiting entries or is idle with its finish
    tag ahead of the virtual time; at most `max_idle_tenants` records are idle.
    """

    def __init__(
        self,
        policy: str = "fcfs",
        tenant_weights: Mapping[str, float] | None = None,
        default_weight: float = 1.0,
        aging_rate: float = 0.0,
        max_len: int = 100_000,
        max_idle_tenants: int = 1024,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduler_policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        if max_idle_tenants < 0:
            raise ValueError(f"max_idle_tenants: must be >= 0, got {max_idle_tenants}")
        self.policy = policy
        self.tenant_weights = dict(tenant_weights or {})
        self.default_weight = default_weight
        self.aging_rate = aging_rate
        self.max_len = max_len
        self.max_idle_tenants = max_idle_tenants
        self._tenants: dict[str, _Tenant] = {}
        # (finish_tag, name) of tenants that went idle, smallest first; an entry whose tenant
        # has waiting requests again or a newer finish tag is stale and skipped when popped
        self._idle: list[tuple[float, str]] = []
        self._served_tokens: dict[str, int] = {}
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

    def displaceable(self, request: Request) -> Request | None:
        """With the queue full under the priority policy: the least urgent fresh waiting
        request, if `request` is more urgent than it (it then gives its place: a more
        urgent client is never refused for a less urgent one). None otherwise."""
        if self.policy != "priority" or len(self) < self.max_len or request.num_preemptions:
            return None
        entries = [e for t in self._tenants.values() for e in t.entries if not e[2].num_preemptions]
        if not entries:
            return None
        worst = max(entries, key=lambda e: (e[0], e[1]))[2]
        return worst if worst.priority > request.priority else None

    def remove(self, request: Request) -> bool:
        """Take a request out without charging its tenant (an abort). True if it was queued."""
        tenant = self._take(request)
        if tenant is None:
            return False
        self._settle(tenant)
        return True

    def admit(self, request: Request) -> None:
        """Take the request out for service and charge its tenant (virtual finish tag)."""
        tenant = self._take(request)
        if tenant is None:
            raise KeyError(f"request {request.request_id} is not queued")
        cost = _cost(request)
        start = max(self._virtual_time, tenant.finish_tag)
        tenant.finish_tag = start + cost / tenant.weight
        self._served_tokens[tenant.name] = self._served_tokens.get(tenant.name, 0) + cost
        self._virtual_time = start
        self._settle(tenant)

    def _take(self, request: Request) -> _Tenant | None:
        where = self._where.pop(request.request_id, None)
        if where is None:
            return None
        name, key, counter = where
        tenant = self._tenants[name]
        i = bisect.bisect_left(tenant.entries, (key, counter), key=lambda e: (e[0], e[1]))
        assert tenant.entries[i][2] is request
        del tenant.entries[i]
        return tenant

    def _settle(self, tenant: _Tenant) -> None:
        """Forget the tenant records that no longer change any ranking (see the module doc)."""
        if not self._where:
            # the end of a busy period: no history carries over, every record goes
            self._virtual_time = max([self._virtual_time] + [t.finish_tag for t in self._tenants.values()])
            for name in list(self._tenants):
                self._forget(name)
            self._idle.clear()
            return
        if not tenant.entries:
            heapq.heappush(self._idle, (tenant.finish_tag, tenant.name))
        while self._idle and self._idle[0][0] <= self._virtual_time:
            finish_tag, name = heapq.heappop(self._idle)
            if self._is_idle(name, finish_tag):
                self._forget(name)
        if len(self._idle) > self.max_idle_tenants:
            # the heap also holds entries of tenants busy again (or idle with a later tag):
            # drop those first, so that only more than max_idle_tenants real idle records
            # make the oldest go
            self._idle = list({(f, n) for f, n in self._idle if self._is_idle(n, f)})
            heapq.heapify(self._idle)
            while len(self._idle) > self.max_idle_tenants:
                self._forget(heapq.heappop(self._idle)[1])

    def _is_idle(self, name: str, finish_tag: float) -> bool:
        """Whether a heap entry still describes an idle record (nothing waiting, same tag)."""
        tenant = self._tenants.get(name)
        return tenant is not None and not tenant.entries and tenant.finish_tag == finish_tag

    def _forget(self, name: str) -> None:
        del self._tenants[name]
        if name not in self.tenant_weights:
            self._served_tokens.pop(name, None)

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
        """Tokens admitted per tenant: for ever for configured tenants, else while it has a record."""
        return dict(self._served_tokens)

    def check_integrity(self) -> None:
        total = 0
        for tenant in self._tenants.values():
            keys = [(e[0], e[1]) for e in tenant.entries]
            assert keys == sorted(keys), f"tenant {tenant.name!r} entries out of order"
            for key, counter, request in tenant.entries:
                assert self._where[request.request_id] == (tenant.name, key, counter)
            total += len(tenant.entries)
            assert tenant.entries or tenant.finish_tag > self._virtual_time, f"tenant {tenant.name!r} not pruned"
        assert total == len(self._where), "index and lists disagree"
        num_idle = sum(1 for t in self._tenants.values() if not t.entries)
        assert num_idle <= len(self._idle) <= self.max_idle_tenants, "idle tenants not bounded"
        for name in self._served_tokens:
            assert name in self._tenants or name in self.tenant_weights, f"served tokens of {name!r} kept"


def _cost(request: Request) -> int:
    """Tokens a request will be served: its prompt plus the most it can generate."""
    return len(request.prompt) + request.options.max_tokens * request.options.n
