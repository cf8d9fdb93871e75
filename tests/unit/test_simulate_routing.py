"""`pagoda simulate-routing`: the router's policies against simulated replicas
(bench/simulate_routing.py), on a small shared-prefix workload that runs in seconds."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace

import pytest

from bench import simulate_routing as sim
from gateway import routing
from services.prefix_hash import block_keys

# short prompts, small KV pools: 8 prefixes per replica, more than one replica's pool holds
SMALL = sim.SimConfig(
    requests_per_replica=80,
    prefixes_per_replica=8,
    prefix_tokens=(256, 512),
    suffix_tokens=(16, 64),
    output_tokens=(8, 64),
    cache_blocks=512,
    max_num_seqs=16,
    max_batched_tokens=512,
    seed=1,
)
SMALL_ARGS = [
    "--requests",
    "80",
    "--prefixes-per-replica",
    "8",
    "--prefix-tokens",
    "256-512",
    "--suffix-tokens",
    "16-64",
    "--output-tokens",
    "8-64",
    "--cache-blocks",
    "512",
    "--max-num-seqs",
    "16",
    "--max-batched-tokens",
    "512",
    "--seed",
    "1",
]

_results: dict[tuple[int, str], dict] = {}


def result(num_replicas: int, policy: str) -> dict:
    """Metrics of SMALL, computed once per (replicas, policy) for the whole module."""
    if (num_replicas, policy) not in _results:
        _results[num_replicas, policy] = sim.simulate(policy, sim.make_workload(SMALL, num_replicas), SMALL)
    return _results[num_replicas, policy]


def test_same_seed_same_results_other_seed_other_results():
    again = sim.simulate("prefix", sim.make_workload(SMALL, 4), SMALL)
    assert again == result(4, "prefix")
    other = replace(SMALL, seed=2)
    assert sim.simulate("prefix", sim.make_workload(other, 4), other) != again


@pytest.mark.parametrize("num_replicas", [4, 32])
def test_prefix_policy_beats_round_robin_on_hits_by_a_wide_margin(num_replicas):
    prefix, rr = result(num_replicas, "prefix"), result(num_replicas, "round-robin")
    assert prefix["hit_rate"] > rr["hit_rate"] + 0.2, (prefix["hit_rate"], rr["hit_rate"])
    assert prefix["hit_rate"] <= prefix["shared_share"]  # only shared prefixes can hit
    assert prefix["ttft_mean_s"] < rr["ttft_mean_s"]


@pytest.mark.parametrize("num_replicas", [4, 32])
def test_least_loaded_balances_at_least_as_well_as_prefix(num_replicas):
    ll, prefix = result(num_replicas, "least-loaded"), result(num_replicas, "prefix")
    assert ll["occupancy_cv"] <= prefix["occupancy_cv"] + 0.01
    assert ll["occupancy_max_mean"] <= prefix["occupancy_max_mean"] + 0.05
    assert ll["occupancy_max_mean"] < 1.2


def test_round_robin_hit_rate_collapses_as_the_fleet_grows():
    # each replica sees every prefix of a fleet-sized working set through a replica-sized cache
    small, large = result(4, "round-robin")["hit_rate"], result(32, "round-robin")["hit_rate"]
    assert large < 0.6 * small, (small, large)
    assert abs(result(32, "prefix")["hit_rate"] - result(4, "prefix")["hit_rate"]) < 0.05


def test_every_request_is_routed_by_the_routers_choose(monkeypatch):
    calls = []
    real = routing.choose

    def counting(policy, replicas, *args, **kwargs):
        calls.append((policy, len(replicas), kwargs.get("cached") is not None))
        return real(policy, replicas, *args, **kwargs)

    monkeypatch.setattr(routing, "choose", counting)
    workload = sim.make_workload(SMALL, 4)
    for policy in routing.POLICIES:
        calls.clear()
        sim.simulate(policy, workload, SMALL)
        assert len(calls) == len(workload.requests)
        assert all(c == (policy, 4, policy == "prefix") for c in calls)


def test_the_routers_load_weight_steers_the_prefix_policy(monkeypatch):
    workload = sim.make_workload(SMALL, 8)
    by_weight = {}
    for weight in (0.0, 1.0, 4.0):
        monkeypatch.setattr(routing, "LOAD_WEIGHT", weight)
        by_weight[weight] = sim.simulate("prefix", workload, SMALL)
    cv = [by_weight[w]["occupancy_cv"] for w in (0.0, 1.0, 4.0)]
    assert cv[0] > cv[1] > cv[2]  # load counts more: better balanced ...
    assert by_weight[4.0]["hit_rate"] < by_weight[0.0]["hit_rate"] - 0.02  # ... and fewer hits


def test_the_router_sees_each_replicas_cache_fill(monkeypatch):
    workload = sim.make_workload(SMALL, 8)
    monkeypatch.setattr(routing, "CACHE_WEIGHT", 0.0)
    blind = sim.simulate("prefix", workload, SMALL)
    monkeypatch.setattr(routing, "CACHE_WEIGHT", 4.0)  # fuller caches repel new prefixes
    assert sim.simulate("prefix", workload, SMALL)["occupancy_cv"] > blind["occupancy_cv"] + 0.05


@pytest.mark.parametrize("policy", [*routing.POLICIES, sim.SESSION])
@pytest.mark.parametrize("index", ["exact", "polled"])
def test_kv_pools_stay_consistent_and_every_request_finishes(policy, index):
    config = replace(SMALL, index=index, requests_per_replica=40)
    workload = sim.make_workload(config, 3)
    metrics = sim.simulate(policy, workload, config, check=True)  # check_integrity after each event
    assert metrics["requests"] == len(workload.requests) == 120
    assert 0 <= metrics["hit_rate"] <= metrics["shared_share"] < 1
    assert 0 < metrics["ttft_mean_s"] <= metrics["latency_mean_s"]
    assert 1 / config.tenants <= metrics["jain_slowdown"] <= 1


def test_prefix_keys_are_the_leading_keys_of_every_prompt_that_starts_with_it():
    workload = sim.make_workload(SMALL, 4)
    rng = random.Random(0)
    for request in workload.requests[:20]:
        prefix = list(workload.prefix_token_ids[request.prefix])
        prompt = prefix + [rng.randrange(65536) for _ in range(request.prompt_tokens - len(prefix))]
        keys = block_keys(prompt, SMALL.block_size)
        assert len(keys) == request.prompt_blocks
        assert keys[: request.prefix_blocks] == workload.prefix_keys[request.prefix][: request.prefix_blocks]


def test_workload_shape():
    workload = sim.make_workload(SMALL, 4)
    requests = workload.requests
    assert len(requests) == 320 and len(workload.prefix_keys) == 32
    assert all(a.arrival_s < b.arrival_s for a, b in zip(requests, requests[1:], strict=False))
    per_tenant = [sum(r.tenant == t for r in requests) for t in range(SMALL.tenants)]
    assert per_tenant[0] > per_tenant[1] > per_tenant[3]  # weights 8:4:2:1
    assert all(r.prefix % SMALL.tenants == r.tenant for r in requests)  # a tenant's own prefixes
    rate = len(requests) / requests[-1].arrival_s
    assert rate == pytest.approx(SMALL.load * SMALL.capacity_per_replica * 4, rel=0.2)


def test_metrics_helpers():
    assert sim.jain([2.0, 2.0, 2.0]) == 1.0
    assert sim.jain([1.0, 0.0, 0.0, 0.0]) == 0.25
    assert sim.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert sim.percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


@pytest.mark.parametrize(
    "bad",
    [
        dict(load=0),
        dict(index="lagging"),
        dict(cache_blocks=10),
        dict(prefix_tokens=(10, 5)),
        dict(warmup=1.0),
        dict(tenants=0),
    ],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        replace(SMALL, **bad)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_prints_a_row_per_replicas_and_policy(capsys, tmp_path):
    out = tmp_path / "routing.json"
    assert sim.run(_parse([*SMALL_ARGS, "--replicas", "2,4", "--json", str(out)])) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| replicas |"))
    rows = [line.split("|")[1:3] for line in lines[header + 2 :] if line.startswith("|")]
    assert [(n.strip(), p.strip()) for n, p in rows] == [(str(n), p) for n in (2, 4) for p in routing.POLICIES]
    saved = json.loads(out.read_text())
    assert [(m["replicas"], m["policy"]) for m in saved["results"]] == [
        (n, p) for n in (2, 4) for p in routing.POLICIES
    ]
    assert saved["config"]["cache_blocks"] == 512


def test_cli_options_and_refusals(capsys):
    args = _parse(["--replicas", "4", "--policies", "round-robin,session", "--index", "polled"])
    assert args.replicas == [4] and args.policies == ["round-robin", "session"]
    assert sim.config_from_args(args).index == "polled"
    with pytest.raises(SystemExit):
        _parse(["--policies", "random"])
    with pytest.raises(SystemExit):
        _parse(["--replicas", "0"])
    assert sim.run(_parse(["--load", "-1"])) == 2
    assert "load must be positive" in capsys.readouterr().err
