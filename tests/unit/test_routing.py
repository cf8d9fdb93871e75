"""The router's choice (gateway/routing.py) and its parts: replica lists, the policies,
session affinity, and several replicas' statistics summed (issue 13)."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.replicas import ReplicaSet, merge_stats, parse_targets
from gateway.routing import NoReplica, ReplicaState, RoutedBlocks, choose, leading_hits, rendezvous
from services.pb import common_pb2, scheduler_pb2


def replicas(*loads, capacity=8):
    return [ReplicaState(f"r{i}", running=n, capacity=capacity) for i, n in enumerate(loads)]


def test_replica_lists():
    assert parse_targets("10.0.0.1:5") == [("r0", "10.0.0.1:5")]
    assert parse_targets("a=h:1, b=h:2") == [("a", "h:1"), ("b", "h:2")]
    assert parse_targets("h:1,h:2") == [("r0", "h:1"), ("r1", "h:2")]
    for bad, why in (("a=h:1,a=h:2", "given twice"), ("h:1,,h:2", "empty"), ("a=nohost", "HOST:PORT")):
        with pytest.raises(ValueError, match=why):
            parse_targets(bad)


def test_prefix_prefers_the_replica_holding_the_prompt_until_it_is_a_batch_busier():
    rs = replicas(3, 0)
    assert choose("prefix", rs, cached={"r0": 10, "r1": 0}, prompt_blocks=10).name == "r0"
    rs = replicas(12, 0)  # 1.5 batches busier: computing the prompt elsewhere is cheaper
    assert choose("prefix", rs, cached={"r0": 10, "r1": 0}, prompt_blocks=10).name == "r1"
    # a longer shared prefix beats a shorter one at equal load
    assert choose("prefix", replicas(1, 1), cached={"r0": 2, "r1": 7}, prompt_blocks=10).name == "r1"


def test_a_new_prefix_goes_where_it_evicts_least():
    rs = replicas(0, 0)
    rs[0].cache_fill = 0.6
    assert choose("prefix", rs, cached={"r0": 0, "r1": 0}, prompt_blocks=10).name == "r1"


def test_without_an_index_prefix_routes_by_load():
    assert choose("prefix", replicas(5, 2, 4), cached=None).name == "r1"
    assert choose("least-loaded", replicas(5, 2, 4)).name == "r1"


def test_round_robin_turns_and_skips_what_is_down_or_tried():
    rs = replicas(0, 0, 0)
    assert [choose("round-robin", rs, turn=t).name for t in range(4)] == ["r0", "r1", "r2", "r0"]
    rs[1].healthy = False
    assert {choose("round-robin", rs, turn=t).name for t in range(4)} == {"r0", "r2"}
    assert choose("round-robin", rs, exclude=frozenset({"r0"})).name == "r2"
    with pytest.raises(NoReplica, match="left to try"):
        choose("round-robin", rs, exclude=frozenset({"r0", "r2"}))
    with pytest.raises(ValueError, match="routing policy"):
        choose("random", rs)


def test_sessions_stick_and_move_only_when_their_replica_leaves():
    names = [f"r{i}" for i in range(8)]
    placed = {f"user-{k}": rendezvous(f"user-{k}", names) for k in range(400)}
    assert len(set(placed.values())) == 8  # spread over all
    rs = [ReplicaState(n) for n in names]
    for key, name in list(placed.items())[:20]:
        assert choose("prefix", rs, session=key, cached={n: 0 for n in names}, prompt_blocks=4).name == name
    rs[3].healthy = False
    for key, name in placed.items():
        now = choose("round-robin", rs, session=key).name
        assert now == name or name == "r3"  # only r3's sessions moved


def test_leading_hits_stop_at_the_first_miss():
    assert leading_hits([True, True, False, True]) == 2
    assert leading_hits([]) == 0


def test_tier_hits_carry_the_chain_at_their_weight():
    from gateway.routing import TIER_HIT_WEIGHT, leading_hits_with_tier

    pool, tier = [True, False, False, True], [False, True, True, False]
    assert leading_hits_with_tier(pool, tier) == 1 + 2 * TIER_HIT_WEIGHT + 1
    assert leading_hits_with_tier([False, True], [False, True]) == 0  # the chain breaks at the first miss
    assert leading_hits_with_tier([], []) == 0


def test_merged_statistics_sum_counts_and_recompute_the_hit_rate():
    a = scheduler_pb2.GetStatsResponse(
        num_waiting=2, num_running=3, num_generated_tokens=100, health=common_pb2.HEALTH_STATUS_NOT_SERVING
    )
    a.kv_cache.num_total_blocks, a.kv_cache.num_used_blocks = 100, 10
    a.kv_cache.num_prefix_query_tokens, a.kv_cache.num_prefix_hit_tokens = 100, 50
    a.config.block_size = 16
    b = scheduler_pb2.GetStatsResponse(
        num_waiting=1, num_running=1, num_generated_tokens=20, health=common_pb2.HEALTH_STATUS_SERVING
    )
    b.kv_cache.num_total_blocks, b.kv_cache.num_used_blocks = 100, 30
    b.kv_cache.num_prefix_query_tokens, b.kv_cache.num_prefix_hit_tokens = 300, 50
    m = merge_stats([a, b])
    assert (m.num_waiting, m.num_running, m.num_generated_tokens) == (3, 4, 120)
    assert (m.kv_cache.num_total_blocks, m.kv_cache.num_used_blocks) == (200, 40)
    assert m.kv_cache.prefix_hit_rate == pytest.approx(0.25)
    assert m.health == common_pb2.HEALTH_STATUS_SERVING and m.config.block_size == 16


def test_load_counts_what_ended_since_the_last_stats():
    r = ReplicaState("r0", waiting=1, running=3, capacity=8)
    assert r.load == 0.5
    r.finished_since_poll = 3  # the router saw 3 of them end after the poll
    assert r.load == 0.125
    r.in_flight = 2  # its own count is fresher when higher
    assert r.load == 0.25


def test_a_new_prefix_goes_where_fewer_prefixes_live():
    """Full caches all look alike: the share of the prefixes lately sent to each decides."""
    rs = replicas(0, 0)
    rs[0].cache_fill = rs[1].cache_fill = 0.95
    rs[0].prefix_share, rs[1].prefix_share = 0.6, 0.4
    assert choose("prefix", rs, cached={"r0": 0, "r1": 0}, prompt_blocks=32).name == "r1"
    # ... while the replica holding the prefix still wins
    assert choose("prefix", rs, cached={"r0": 32, "r1": 0}, prompt_blocks=32).name == "r0"


def test_routed_blocks_say_where_a_prompts_leading_blocks_went_lately():
    memory = RoutedBlocks(capacity=6)
    memory.remember([b"a", b"b", b"c"], "r0", now=0.0)
    assert memory.held([b"a", b"b", b"c", b"d"], now=1.0, max_age=5) == {"r0": 3}
    assert memory.held([b"a", b"x", b"c"], now=1.0, max_age=5) == {"r0": 1}  # a chain: stops at a miss
    assert memory.held([b"a", b"b"], now=9.0, max_age=5) == {}  # too old
    memory.remember([b"a", b"b"], "r1", now=2.0)  # the same prefix sent elsewhere since
    assert memory.held([b"a", b"b", b"c"], now=3.0, max_age=5) == {"r1": 2}
    memory.remember([b"p", b"q", b"r", b"s"], "r0", now=4.0)
    assert len(memory) == 6 and memory.held([b"c"], now=4.0, max_age=5) == {}  # the oldest went first


def test_prefix_routing_without_an_index_keeps_each_prefix_on_one_replica_and_spreads_them():
    """No Redis (or Redis unreachable): the router's memory of where it sent each prompt's
    blocks stands in, so each prefix's requests stay together and the prefixes split
    between the replicas instead of every replica computing and caching every prefix."""
    rs = ReplicaSet([("r0", "127.0.0.1:1"), ("r1", "127.0.0.1:2")], policy="prefix")
    for r in rs.replicas:
        r.state.healthy = True
    rng = random.Random(0)
    prefixes = [[rng.randrange(5, 500) for _ in range(64)] for _ in range(8)]
    where: dict[int, set[str]] = {g: set() for g in range(8)}

    async def route_all():
        for _ in range(4):
            for g in rng.sample(range(8), 8):
                replica, choice = await rs.pick(prefixes[g] + [rng.randrange(5, 500) for _ in range(5)])
                where[g].add(replica.name)

    asyncio.run(route_all())
    assert all(len(names) == 1 for names in where.values()), where
    assert sorted(r.num_routed for r in rs.replicas) == [16, 16]
    assert rs.num_fallbacks == 32
