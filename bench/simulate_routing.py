"""`pagoda simulate-routing`: the router's policies against simulated replicas (issue 13).

    pagoda simulate-routing --replicas 4,32,128 --json routing.json

A discrete-event simulation in pure Python (no model, no torch, deterministic for a seed)
that replays one synthetic multi-tenant workload through each routing policy of
`gateway.routing` and prints, per (replicas, policy), the prefix-cache hit rate, the load
imbalance, fairness across tenants, TTFT and latency, and throughput. Routing decisions
are the real router's: `gateway.routing.choose` with `ReplicaState`s, fed as the gateway
feeds it; block keys are `services.prefix_hash.block_keys`.

The workload. `--tenants` tenants send `weight_t = skew^-t` of the traffic. The shared
prefixes (system prompts, few-shot headers; `--prefixes-per-replica` x replicas of them,
because a bigger fleet serves more applications, or a fixed `--prefixes`) are dealt to the
tenants in turn; a tenant picks among its own with Zipf(`--zipf`) popularity. A prompt is a
prefix (512-2048 tokens, random token ids, fixed per prefix) plus a suffix unique to the
request (16-512 tokens); the output is 16-512 tokens; all uniform. Arrivals are Poisson at
`--load` x the fleet's capacity, where capacity is what the replicas would sustain with no
prefix cache at full batch (so `--load 0.8` is 80% of the cold capacity, and every cache
hit makes a replica's share lighter than that).

A replica is a continuous-batching engine stepped one iteration at a time: each step
admits waiting requests FIFO while fewer than `--max-num-seqs` run and their KV blocks fit,
gives every decoding request one token and spends the rest of `--max-batched-tokens` on
prefill chunks, FIFO (chunked prefill, as vLLM v1), and takes
`decode_step_ms + decode_ms_per_seq x decoding + prefill_ms_per_token x prefill tokens`
(steps that only decode are advanced together up to the next arrival or finish: the same
result in fewer events).
Its KV pool has `--cache-blocks` blocks: a running request holds blocks for its whole
prompt and output from admission (no preemption: admission waits for room); the full
blocks of finished requests stay cached and evictable, least recently used first, tails
before heads (the KV service's order), and a new request reuses its prompt's leading
cached blocks (computing at least its last prompt token, as vLLM does).

The router. Each replica's `ReplicaState` takes waiting, running and KV usage from stats
polled every `--poll-ms` (stale between polls) and the router's own in-flight count
(fresh), as gateway/replicas.py does. For `prefix` it gets the leading cached blocks per
replica, and each replica's cache fill, from an index of block key -> replicas built from
the replicas' cache events (Redis in gateway/kv_index.py): `--index exact` applies each
event at once (a KV-event stream with no lag), `--index polled` at each stats poll.
`session` (optional) is session affinity: `choose` with a per-user session key.

Metrics, over the requests after the warm-up: the prefix hit rate is cached prompt tokens
over prompt tokens (its ceiling, the shared prefixes' share of prompt tokens, is printed
below the table); a replica's occupancy is its time-averaged number of requests, waiting
or running (the load the router weighs), and the imbalance is max/mean and the coefficient
of variation of occupancy across replicas; fairness is Jain's index over the tenants' mean
slowdown, where a request's slowdown is its latency over the same request's alone on an
idle replica with a cold cache (below 1 when it hits), with the worst tenant's mean in
parentheses; TTFT and latency count from arrival, in simulated seconds; throughput is
output tokens per simulated second.

Simplifications: one engine step is one formula (no attention cost growing with context,
no CUDA graphs, no stage pipelining); a request reserves KV for its whole output at
admission, so nothing is preempted; one router, and it and the network add no time; all
replicas are healthy and share one namespace; output blocks are never cached (no
multi-turn); the prefix's block keys come from `block_keys` once per prefix (the hash
chain makes them the same in every prompt that starts with it), and a request's blocks
past its prefix, which no other prompt can share, are one cache entry of that many blocks,
evicted whole, cached when it finishes and left out of the index (they can never hit); the
first `--warmup` of the requests (cold caches) are simulated but not measured.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from bench import stats
from bench.sim_replica import Replica
from bench.sim_workload import Request, SimConfig, Workload, make_workload
from gateway import routing

# the simulator reports nearest-rank percentiles: always one of the measured values
percentile = functools.partial(stats.percentile, method="nearest-rank")

SESSION = "session"  # session affinity: choose() with a session key per user


class _RouterIndex:
    """The router's view of which replicas cache each block key. Only `prefix` reads it: with
    `exact` it follows every change at once, with `polled` the changes wait for the next poll;
    for the other policies the replicas report no changes (`listener` is None)."""

    def __init__(self, policy: str, config: SimConfig) -> None:
        self.holders: dict[bytes, set[int]] = {}
        self.pending: list[tuple[bytes, int, bool]] = []
        self.live = policy == "prefix" and config.index == "exact"
        self.follows = policy == "prefix" and config.index == "polled"

    def listener(self) -> Callable[[bytes, int, bool], None] | None:
        return self.apply if self.live else self.defer if self.follows else None

    def apply(self, key: bytes, replica: int, cached: bool) -> None:
        if cached:
            self.holders.setdefault(key, set()).add(replica)
        else:
            holders = self.holders.get(key)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self.holders[key]

    def defer(self, key: bytes, replica: int, cached: bool) -> None:
        self.pending.append((key, replica, cached))

    def flush(self) -> None:
        """Apply the changes deferred since the last poll."""
        for event in self.pending:
            self.apply(*event)
        self.pending.clear()

    def cached_blocks(self, keys: list[bytes], states: list[routing.ReplicaState]) -> dict[str, int]:
        """Per replica holding the first of `keys`: how many of them it holds from the start."""
        holders = self.holders.get(keys[0], ()) if keys else ()
        return {states[r].name: routing.leading_hits([r in self.holders.get(k, ()) for k in keys]) for r in holders}


ARRIVAL, STEP, POLL = 0, 1, 2  # the kinds of the simulation's events


class _Simulation:
    """One policy's replay of a workload: a queue of events (arrivals, the ends of the replicas'
    steps, the router's polls of their load) over the replicas and the router's view of them
    (`states`, as `routing.choose` reads them)."""

    def __init__(self, policy: str, workload: Workload, config: SimConfig, check: bool) -> None:
        n = workload.num_replicas
        self.policy, self.workload, self.config, self.check = policy, workload, config, check
        self.choose_policy = "prefix" if policy == SESSION else policy
        self.index = _RouterIndex(policy, config)
        self.replicas = [Replica(i, config, self.index.listener()) for i in range(n)]
        self.states = [routing.ReplicaState(f"r{i}", capacity=config.max_num_seqs) for i in range(n)]
        self.by_name = {s.name: i for i, s in enumerate(self.states)}
        self.requests = [replace(r) for r in workload.requests]  # fresh per policy
        # (time, order, kind, request or replica, the replica's plan version for STEP)
        self.events = [(r.arrival_s, i, ARRIVAL, i, 0) for i, r in enumerate(self.requests)]
        heapq.heapify(self.events)
        self.seq = len(self.events)
        heapq.heappush(self.events, (0.0, self.seq, POLL, 0, 0))
        self.left = len(self.requests)

    def keys_of(self, request: Request) -> list[bytes]:
        return self.workload.prefix_keys[request.prefix]

    def _push(self, time_s: float, kind: int, what: int, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time_s, self.seq, kind, what, version))

    def run(self) -> None:
        while self.events:
            now, _, kind, what, version = heapq.heappop(self.events)
            if kind == POLL:
                self._poll(now)
                continue
            if kind == ARRIVAL:
                replica = self._arrive(now, what)
            else:
                replica = self._step_ended(now, what, version)
            if replica is not None:
                self._start_step(now, replica)

    def _poll(self, now: float) -> None:
        """The router reads every replica's load (and, with a polled index, the cache changes)."""
        self.index.flush()
        for replica, state in zip(self.replicas, self.states, strict=True):
            state.waiting, state.running = len(replica.waiting), replica.num_running
            state.kv_usage = replica.kv_usage
            if self.index.follows:
                state.cache_fill = replica.cache_fill
        if self.left:
            self._push(now + self.config.poll_ms / 1000, POLL, 0)

    def _arrive(self, now: float, i: int) -> Replica | None:
        """Route request `i`; its replica when that one is idle and must start a step."""
        request = self.requests[i]
        keys = self.keys_of(request)[: request.prefix_blocks]
        cached = self.index.cached_blocks(keys, self.states) if self.policy == "prefix" else None
        session = f"{request.tenant}/{request.user}" if self.policy == SESSION else None
        choice = routing.choose(
            self.choose_policy,
            self.states,
            turn=request.id,
            cached=cached,
            prompt_blocks=request.prompt_blocks,
            session=session,
        )
        target = self.by_name[choice.name]
        self.states[target].in_flight += 1
        replica = self.replicas[target]
        replica.num_requests += 1
        replica.waiting.append(request)
        if not replica.stepping:
            return replica
        end = replica.interrupt(now)
        if end is not None:
            self._push(end, STEP, target, replica.version)
        return None

    def _step_ended(self, now: float, i: int, version: int) -> Replica | None:
        """Replica `i`'s steps end (unless replanned since): it, to start the next."""
        replica = self.replicas[i]
        if version != replica.version:
            return None
        done = replica.end_step(now, self.keys_of)
        self.states[replica.index].in_flight -= len(done)
        self.left -= len(done)
        return replica

    def _start_step(self, now: float, replica: Replica) -> None:
        end = replica.start_step(now, self.keys_of)
        if self.index.live:  # its cache changes only in steps
            self.states[replica.index].cache_fill = replica.cache_fill
        if self.check:
            replica.check_integrity()
        if end is not None:
            self._push(end, STEP, replica.index, replica.version)


def simulate(policy: str, workload: Workload, config: SimConfig, check: bool = False) -> dict:
    """Replay `workload` through `policy` (one of routing.POLICIES, or "session"); its metrics."""
    sim = _Simulation(policy, workload, config, check)
    sim.run()
    return measure(policy, sim.requests, sim.replicas, config)


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values and any(values) else 1.0


def _spread(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if not mean:
        return 1.0, 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return max(values) / mean, std / mean


def measure(policy: str, requests: list[Request], replicas: list[Replica], config: SimConfig) -> dict:
    measured = requests[int(len(requests) * config.warmup) :]
    prompt_tokens = sum(r.prompt_tokens for r in measured)
    start, end = measured[0].arrival_s, max(r.finish_s for r in measured)
    ttft = sorted(r.first_token_s - r.arrival_s for r in measured)
    latency = sorted(r.finish_s - r.arrival_s for r in measured)
    slowdown: dict[int, list[float]] = {}
    for r in measured:
        ideal_s = config.ideal_s(r.prompt_tokens, r.output_tokens)
        slowdown.setdefault(r.tenant, []).append((r.finish_s - r.arrival_s) / ideal_s)
    tenant_slowdown = [sum(v) / len(v) for _, v in sorted(slowdown.items())]
    makespan = max(r.finish_s for r in requests)
    occupancy_max, occupancy_cv = _spread([r.occupancy_s / makespan for r in replicas])
    requests_max, requests_cv = _spread([float(r.num_requests) for r in replicas])
    return {
        "replicas": len(replicas),
        "policy": policy,
        "requests": len(requests),
        "measured": len(measured),
        "hit_rate": sum(r.cached_tokens for r in measured) / prompt_tokens,
        "shared_share": sum(r.prefix_blocks for r in measured) * config.block_size / prompt_tokens,
        "occupancy_max_mean": occupancy_max,
        "occupancy_cv": occupancy_cv,
        "requests_max_mean": requests_max,
        "requests_cv": requests_cv,
        "busy_max_mean": _spread([r.busy_s for r in replicas])[0],
        "jain_slowdown": jain(tenant_slowdown),
        "tenant_mean_slowdown": tenant_slowdown,
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p99_s": percentile(ttft, 99),
        "latency_mean_s": sum(latency) / len(latency),
        "latency_p99_s": percentile(latency, 99),
        "output_tokens_per_s": sum(r.output_tokens for r in measured) / (end - start),
        "requests_per_s": len(measured) / (end - start),
    }


HEADER = (
    "| replicas | policy | prefix hit rate | occupancy max/mean | occupancy CV "
    "| Jain, tenants' slowdown (worst) | TTFT mean / p99 (s) | latency mean / p99 (s) "
    "| output tok/s |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(m: dict) -> str:
    return (
        f"| {m['replicas']} | {m['policy']} | {m['hit_rate']:.1%} | {m['occupancy_max_mean']:.2f} "
        f"| {m['occupancy_cv']:.2f} | {m['jain_slowdown']:.3f} ({max(m['tenant_mean_slowdown']):.2f}) "
        f"| {m['ttft_mean_s']:.2f} / {m['ttft_p99_s']:.2f} "
        f"| {m['latency_mean_s']:.2f} / {m['latency_p99_s']:.2f} "
        f"| {m['output_tokens_per_s']:,.0f} |"
    )


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(",", " ").split()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        return int(low), int(high or low)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH tokens, got {text!r}") from exc


def _policies(text: str) -> list[str]:
    names = [x for x in text.replace(",", " ").split() if x]
    bad = [x for x in names if x not in (*routing.POLICIES, SESSION)]
    if bad or not names:
        known = ", ".join((*routing.POLICIES, SESSION))
        raise argparse.ArgumentTypeError(f"policies are {known}, got {text!r}")
    return names


_OPTIONS = (  # flag, SimConfig field, type, help
    ("--requests", "requests_per_replica", int, "requests per replica"),
    ("--load", "load", float, "arrival rate over the fleet's capacity with no prefix cache"),
    ("--tenants", "tenants", int, "tenants"),
    ("--tenant-skew", "tenant_skew", float, "each tenant sends 1/skew of the traffic of the one before"),
    ("--prefixes-per-replica", "prefixes_per_replica", int, "shared prefixes per replica in the fleet"),
    ("--prefixes", "prefixes", int, "a fixed number of shared prefixes instead"),
    ("--zipf", "zipf", float, "Zipf exponent of a tenant's prefixes' popularity"),
    ("--users-per-tenant", "users_per_tenant", int, f"session keys per tenant, for {SESSION!r}"),
    ("--prefix-tokens", "prefix_tokens", "range", "a shared prefix's length, uniform"),
    ("--suffix-tokens", "suffix_tokens", "range", "a prompt's own suffix's length, uniform"),
    ("--output-tokens", "output_tokens", "range", "output length, uniform"),
    ("--block-size", "block_size", int, "tokens per KV block"),
    ("--cache-blocks", "cache_blocks", int, "each replica's KV pool in blocks, running and cached"),
    ("--max-num-seqs", "max_num_seqs", int, "each replica's batch capacity"),
    ("--max-batched-tokens", "max_batched_tokens", int, "tokens per step, decode and prefill chunks"),
    ("--prefill-ms-per-token", "prefill_ms_per_token", float, "step time per prefill token"),
    ("--decode-step-ms", "decode_step_ms", float, "fixed time of a step"),
    ("--decode-ms-per-seq", "decode_ms_per_seq", float, "step time per decoding request"),
    ("--poll-ms", "poll_ms", float, "the router's stats poll interval, simulated"),
    ("--warmup", "warmup", float, "the share of the first requests left out of the metrics"),
    ("--seed", "seed", int, "the workload's random seed"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = SimConfig()
    p.add_argument(
        "--replicas", type=_ints, default=[4, 32, 128], help="replica counts, comma-separated (default: 4,32,128)"
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=list(routing.POLICIES),
        help=f"routing policies, comma-separated, of {', '.join(routing.POLICIES)} and "
        f"{SESSION} (default: {','.join(routing.POLICIES)})",
    )
    for flag, name, kind, text in _OPTIONS:
        value = getattr(defaults, name)
        shown = f"{value[0]}-{value[1]}" if isinstance(value, tuple) else value
        p.add_argument(
            flag, type=_range if kind == "range" else kind, default=value, dest=name, help=f"{text} (default: {shown})"
        )
    p.add_argument(
        "--index",
        choices=["exact", "polled"],
        default=defaults.index,
        help=f"the router's prefix index: each cache event at once, or at each stats poll (default: {defaults.index})",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(**{k: v for k, v in vars(args).items() if k in SimConfig.__dataclass_fields__})


def describe(config: SimConfig) -> str:
    c = config
    prefixes = c.prefixes or f"{c.prefixes_per_replica} per replica"
    return (
        f"Simulated: {c.requests_per_replica} requests per replica, Poisson at {c.load:.0%} of the cold "
        f"capacity ({c.capacity_per_replica:.2f} requests/s per replica); {c.tenants} tenants (skew "
        f"{c.tenant_skew:g}), shared prefixes {prefixes} (Zipf {c.zipf:g}) of {c.prefix_tokens[0]}-"
        f"{c.prefix_tokens[1]} tokens, suffixes {c.suffix_tokens[0]}-{c.suffix_tokens[1]}, outputs "
        f"{c.output_tokens[0]}-{c.output_tokens[1]}; per replica {c.cache_blocks} KV blocks of "
        f"{c.block_size}, max_num_seqs {c.max_num_seqs}, {c.max_batched_tokens} tokens per step, a step "
        f"{c.decode_step_ms:g} ms + {c.decode_ms_per_seq:g} ms per decoding request + "
        f"{c.prefill_ms_per_token:g} ms per prefill token; stats polled every {c.poll_ms:g} ms, "
        f"{c.index} prefix index; first {c.warmup:.0%} of requests not measured; seed {c.seed}."
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results, timings = [], {}
    print(describe(config) + "\n")
    print(HEADER)
    for num_replicas in args.replicas:
        started = time.perf_counter()
        workload = make_workload(config, num_replicas)
        for policy in args.policies:
            metrics = simulate(policy, workload, config)
            results.append(metrics)
            print(table_row(metrics), flush=True)
        timings[num_replicas] = time.perf_counter() - started
    shared = {m["replicas"]: m["shared_share"] for m in results}
    print(
        "\nThe hit rate's ceiling, the shared prefixes' share of prompt tokens: "
        + ", ".join(f"{share:.1%} ({n} replicas)" for n, share in shared.items())
        + "."
    )
    print("wall time: " + ", ".join(f"{n} replicas {s:.1f} s" for n, s in timings.items()), file=sys.stderr)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"config": asdict(config), "results": results, "wall_s": {str(k): v for k, v in timings.items()}},
                indent=2,
            )
            + "\n"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda simulate-routing", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
