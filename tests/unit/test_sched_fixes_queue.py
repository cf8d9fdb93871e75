"""The hybrid queue forgets tenants that no longer change any ranking, so free-form tenant
names cannot grow it without bound, and forgetting them changes no admission order."""

from __future__ import annotations

import random

from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, SamplingOptions


def request(rid: str, tenant: str, num_prompt_tokens: int = 8, max_tokens: int = 8, arrival_s: float = 0.0) -> Request:
    return Request(rid, (7,) * num_prompt_tokens, SamplingOptions(max_tokens=max_tokens), arrival_s, tenant=tenant)


class UnprunedQueue(WaitingQueue):
    """The queue as it was: a record for every tenant ever seen, history for ever."""

    def _settle(self, tenant) -> None:
        pass

    def check_integrity(self) -> None:
        pass


def test_one_request_per_tenant_in_turn_leaves_no_records():
    q = WaitingQueue("hybrid", {"gold": 3.0})
    for i in range(5000):
        r = request(f"r{i}", f"user-{i}")
        q.push(r)
        assert q.ordered() == [r]
        q.admit(r)
        q.check_integrity()
        assert len(q._tenants) <= 1
    assert len(q._tenants) == 0 and not q._idle
    assert q.served_tokens_by_tenant() == {}  # counters of unconfigured tenants go with their records


def test_a_saturated_queue_of_ever_new_tenants_stays_bounded():
    q = WaitingQueue("hybrid", max_len=64)
    num_waiting, max_idle_tenants = 16, 1024  # the default bound on idle records
    for i in range(num_waiting):
        q.push(request(f"r{i}", f"user-{i}"))
    for i in range(num_waiting, 4000):
        q.admit(q.ordered(limit=1)[0])
        q.push(request(f"r{i}", f"user-{i}", num_prompt_tokens=1 + i % 13))
        q.check_integrity()
        assert len(q._tenants) <= num_waiting + max_idle_tenants
    assert len(q) == num_waiting


def test_one_off_tenants_beside_busy_ones_are_forgotten_exactly():
    """With tenants that stay backlogged the virtual time moves on, so one-off tenants fall
    behind it and go without the bound on idle records ever being needed."""
    q = WaitingQueue("hybrid", {"a": 3.0, "b": 1.0})
    counter = 0
    for step in range(3000):
        for tenant in ("a", "b"):
            while q.depth_by_tenant().get(tenant, 0) < 4:
                q.push(request(f"r{counter}", tenant))
                counter += 1
        q.push(request(f"r{counter}", f"user-{step}"))
        counter += 1
        for r in q.ordered(limit=2):
            q.admit(r)
        q.check_integrity()
        assert len(q._tenants) <= 2 + 8
    served = q.served_tokens_by_tenant()
    assert set(served) >= {"a", "b"} and len(served) <= 2 + 8
    assert 3 * 0.9 <= served["a"] / served["b"] <= 3 * 1.1


def test_configured_tenants_keep_their_served_tokens():
    q = WaitingQueue("hybrid", {"gold": 2.0})
    for i in range(3):
        r = request(f"r{i}", "gold")
        q.push(r)
        q.admit(r)
    assert "gold" not in q._tenants  # forgotten: nothing waits
    assert q.served_tokens_by_tenant() == {"gold": 3 * 16}


def test_forgetting_tenants_changes_no_admission_order():
    """While something waits (no busy period ends) and the bound on idle tenants is not hit,
    the queue ranks exactly as one that keeps every record."""
    rng = random.Random(7)
    weights = {f"t{i}": rng.choice([0.5, 1.0, 2.0, 3.0]) for i in range(12)}
    pruned = WaitingQueue("hybrid", weights, default_weight=1.0, aging_rate=2.0)
    reference = UnprunedQueue("hybrid", weights, default_weight=1.0, aging_rate=2.0)
    tenants = [*weights, *(f"x{i}" for i in range(20))]
    live: list[str] = []
    queued: dict[int, dict[str, Request]] = {id(pruned): {}, id(reference): {}}
    counter = 0
    num_pruned_steps = 0

    def push(tenant: str) -> None:
        nonlocal counter
        counter += 1
        size, max_tokens = rng.randint(1, 40), rng.randint(1, 16)
        for q in (pruned, reference):
            r = request(f"r{counter}", tenant, size, max_tokens, arrival_s=counter * 0.01)
            q.push(r)
            queued[id(q)][r.request_id] = r
        live.append(f"r{counter}")

    push("anchor")  # never admitted: the queue is never empty
    anchor = live.pop()
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 or len(live) < 2:
            push(rng.choice(tenants))
            continue
        expected = [r.request_id for r in reference.ordered()]
        assert [r.request_id for r in pruned.ordered()] == expected
        if op < 0.9:  # admit the head, or now and then a later one (it did not fit the budget)
            rid = expected[0] if rng.random() < 0.8 else rng.choice(live)
            if rid == anchor:
                continue
            for q in (pruned, reference):
                q.admit(queued[id(q)].pop(rid))
        else:  # abort
            rid = rng.choice(live)
            for q in (pruned, reference):
                assert q.remove(queued[id(q)].pop(rid))
        live.remove(rid)
        pruned.check_integrity()
        num_pruned_steps += len(pruned._tenants) < len(reference._tenants)
    assert [r.request_id for r in pruned.ordered()] == [r.request_id for r in reference.ordered()]
    assert num_pruned_steps > 100


def test_the_idle_bound_counts_only_idle_records():
    """A tenant busy again leaves a stale entry in the idle heap: it must not count toward
    max_idle_tenants (found in review: B was forgotten with only B and C idle)."""
    q = WaitingQueue("hybrid", max_idle_tenants=2)
    q.push(request("z", "Z"))  # keeps the queue from emptying
    a1 = request("a1", "A", num_prompt_tokens=500)
    q.push(a1)
    q.admit(a1)  # A idle, far ahead of the virtual time
    q.push(request("a2", "A"))  # A busy again: its heap entry is stale
    for name in ("B", "C"):
        r = request(f"{name.lower()}1", name, num_prompt_tokens=200)
        q.push(r)
        q.admit(r)
        q.check_integrity()
    assert {"B", "C"} <= set(q._tenants)  # both idle records kept: exactly two idle


def test_an_aborted_request_does_not_count_its_idle_tenant_twice():
    """Found in review: an idle tenant whose new request is removed was pushed into the idle
    heap a second time and counted twice against max_idle_tenants."""
    q = WaitingQueue("hybrid", max_idle_tenants=2)
    q.push(request("z", "Z"))  # keeps the queue from emptying
    a1 = request("a1", "A", num_prompt_tokens=100)
    q.push(a1)
    q.admit(a1)  # A idle, ahead of the virtual time
    a2 = request("a2", "A")
    q.push(a2)
    q.remove(a2)  # an abort: A idle again, same tag
    b1 = request("b1", "B", num_prompt_tokens=100)
    q.push(b1)
    q.admit(b1)
    q.check_integrity()
    assert {"A", "B"} <= set(q._tenants)  # two idle records: both kept


def test_a_full_priority_queue_lets_a_more_urgent_request_in():
    """Overload (issue 16): the least urgent waiting request gives its place to a more urgent
    one (it is refused as a full queue refuses); an equally or less urgent one is refused."""
    import pytest

    from scheduler_svc.core.queue import QueueFull

    def _req(rid: str, priority: int) -> Request:
        return Request(rid, (7,) * 8, SamplingOptions(max_tokens=8), 0.0, priority=priority)

    q = WaitingQueue(policy="priority", max_len=2)
    calm, lazy = _req("calm", priority=0), _req("lazy", priority=5)
    q.push(calm)
    q.push(lazy)
    assert q.displaceable(_req("same", priority=5)) is None
    with pytest.raises(QueueFull):
        q.push(_req("same", priority=5))
    assert q.displaceable(_req("urgent", priority=-3)) is lazy
    assert WaitingQueue(policy="fcfs", max_len=1).displaceable(_req("x", priority=-9)) is None
