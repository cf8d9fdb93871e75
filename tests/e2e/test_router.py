"""Prefix-aware routing across replicas (issue 13), through real processes: two replicas
(each a KV service publishing its prefix cache to a real Redis, a stage worker and a
scheduler) behind gateways in router mode.

- 8 groups of requests sharing 8 different 512-token prefixes, in shuffled order: the
  prefix hit rate read back from the replicas' KV statistics is at least 2x round-robin's,
  and the outputs (greedy) equal a single replica's;
- Redis killed mid-run: every request completes (routing by load); when Redis returns the
  publishers rewrite the index and routing by prefix resumes;
- one replica killed mid-run: what had streamed nothing is retried on the other, the
  router drains the dead one within 5 s, nothing hangs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from support.redis_server import RedisServer
from support.stack import kill_stack

from services.pb import scheduler_pb2, scheduler_pb2_grpc
from wiring.launcher import ServiceProcess, free_port, pagoda_command, start_stack

PREFIX_TOKENS = 512
GROUPS = 8
PER_GROUP = 8
MAX_TOKENS = 4
BLOCK = 16
# a replica's pool holds 4 of the 8 prefixes (32 blocks each) beside what runs: the two
# replicas' caches hold the working set once. One that sees all 8 (round-robin) keeps
# evicting them; one that sees its 4 keeps them
NUM_KV_BLOCKS = 140


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("router-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(model_dir, redis_server, tmp_path_factory):
    stacks = []
    try:
        for name in ("r0", "r1"):
            stacks.append(
                start_stack(
                    model_dir,
                    num_stages=1,
                    num_kv_blocks=NUM_KV_BLOCKS,
                    block_size=BLOCK,
                    log_dir=tmp_path_factory.mktemp(f"replica-{name}"),
                    threads_per_worker=1,
                    kvcache_args=("--replica-id", name, "--redis-url", redis_server.url),
                    scheduler_args=("--max-num-seqs", "8", "--max-model-len", "1024"),
                )
            )
        yield stacks
    finally:
        for s in stacks:
            kill_stack(s)  # the graceful stop is not tested here


def start_router(name, model_dir, replicas, log_dir, *args) -> ServiceProcess:
    port, grpc_port = free_port(), free_port()
    targets = ",".join(f"r{i}={s.scheduler_address}" for i, s in enumerate(replicas))
    gateway = ServiceProcess(
        name,
        pagoda_command(
            "gateway",
            "--model",
            model_dir,
            "--scheduler",
            targets,
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--max-model-len",
            "1024",
            "--served-model-name",
            "tiny",
            *args,
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=log_dir / f"{name}.log",
    )
    gateway.start()
    gateway.wait_healthy(60)
    gateway.port = port
    return gateway


@pytest.fixture(scope="module")
def routers(model_dir, replicas, redis_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("routers")
    started = {}
    try:
        started["prefix"] = start_router(
            "prefix", model_dir, replicas, logs, "--routing", "prefix", "--redis-url", redis_server.url
        )
        started["round-robin"] = start_router("round-robin", model_dir, replicas, logs, "--routing", "round-robin")
        yield started
    finally:
        for g in started.values():
            g.stop()


def workload(seed: int) -> list[list[int]]:
    """PER_GROUP rounds, each visiting the 8 groups once in a shuffled order (sessions that
    progress side by side), each request its group's prefix and a suffix of its own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 500) for _ in range(PREFIX_TOKENS)] for _ in range(GROUPS)]
    prompts = []
    for _ in range(PER_GROUP):
        order = list(range(GROUPS))
        rng.shuffle(order)
        prompts += [prefixes[g] + [rng.randrange(5, 500) for _ in range(rng.randint(3, 12))] for g in order]
    return prompts


def complete(port: int, prompt: list[int]) -> tuple[str, list[int]]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    try:
        r = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return "ok", r.choices[0].token_ids
    except (openai.APIError, openai.APIConnectionError) as exc:
        return "error", [type(exc).__name__]


def kv_stats(stack):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), metadata=_token(), timeout=5
        )
    return stats.kv_cache.num_prefix_query_tokens, stats.kv_cache.num_prefix_hit_tokens


def _token():
    return (("x-pagoda-internal-token", os.environ["PAGODA_INTERNAL_TOKEN"]),)


def hit_rate(replicas, run) -> float:
    before = [kv_stats(s) for s in replicas]
    run()
    after = [kv_stats(s) for s in replicas]
    queried = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hit = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hit / queried


def replicas_view(port: int) -> list[dict]:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/replicas", timeout=5).read())["replicas"]


def direct(stack, prompt) -> list[int]:
    req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
    req.sampling_params.max_tokens, req.sampling_params.temperature = MAX_TOKENS, 0.0
    req.sampling_params.ignore_eos = True
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        return [
            t
            for r in scheduler_pb2_grpc.SchedulerStub(channel).Generate(req, metadata=_token(), timeout=60)
            for t in r.token_ids
        ]


def test_prefix_routing_hits_the_cache_twice_as_often_as_round_robin(replicas, routers):
    rates, outputs = {}, {}
    for seed, policy in enumerate(("round-robin", "prefix")):  # fresh prefixes per policy
        prompts = workload(seed)
        got = []
        rates[policy] = hit_rate(
            replicas, lambda p=prompts, g=got, port=routers[policy].port: g.extend(complete(port, x) for x in p)
        )
        assert all(kind == "ok" for kind, _ in got), got
        outputs[policy] = (prompts, [t for _, t in got])
    print(f"\n[router] prefix hit rate: prefix {rates['prefix']:.3f}, round-robin {rates['round-robin']:.3f}")
    assert rates["prefix"] >= 2 * rates["round-robin"], rates
    routed = {r["name"]: r["routed"] for r in replicas_view(routers["prefix"].port)}
    assert all(n > 0 for n in routed.values()), routed  # both replicas served
    prompts, tokens = outputs["prefix"]
    for prompt, got in zip(prompts, tokens, strict=True):  # as one replica alone says
        assert got == direct(replicas[0], prompt)


def test_requests_complete_without_redis_and_prefix_routing_resumes(replicas, routers, redis_server):
    port = routers["prefix"].port
    prompts = workload(7)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, port, p) for p in prompts[:16]]
        time.sleep(0.5)
        redis_server.proc.kill()  # mid-run
        redis_server.proc.wait()
        outcomes = [f.result(timeout=120) for f in futures]
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    more = [complete(port, p) for p in prompts[16:20]]  # no Redis at all now
    assert all(kind == "ok" for kind, _ in more)
    redis_server.restart()
    deadline = time.time() + 10
    while time.time() < deadline and not all(redis_server.client.exists(f"pagoda:kv:{{r{i}}}:alive") for i in range(2)):
        time.sleep(0.2)
    assert all(redis_server.client.scard(f"pagoda:kv:{{r{i}}}:blocks") > 0 for i in range(2))
    # prefix routing again: a new prefix's requests all go to the replica that took the first
    # (the groups above were routed by load, so both replicas may hold their prefixes)
    group = workload(8)[0][:PREFIX_TOKENS]
    time.sleep(1.2)  # past the router's pause after its last failed lookup (kv_index.RETRY_AFTER_S)
    before = {r["name"]: r["routed"] for r in replicas_view(port)}
    for i in range(4):
        assert complete(port, group + [7, 8, 9, i])[0] == "ok"
    after = {r["name"]: r["routed"] for r in replicas_view(port)}
    moved = {n: after[n] - before[n] for n in after}
    assert sorted(moved.values()) == [0, 4], moved


def test_a_killed_replica_is_drained_and_its_unstreamed_requests_retried(replicas, routers, redis_server):
    port = routers["round-robin"].port  # half the requests land on the victim
    victim = replicas[1]
    prompts = workload(11)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, port, p) for p in prompts[:16]]
        time.sleep(0.3)
        killed = time.time()
        for p in victim.processes:
            os.killpg(p.process.pid, signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in futures]  # nothing hangs
    done = [o for o in outcomes if o[0] == "ok"]
    assert len(done) >= 8, outcomes  # the survivor's, and the victim's unstreamed ones retried
    deadline = killed + 5
    while time.time() < deadline and any(r["healthy"] for r in replicas_view(port) if r["name"] == "r1"):
        time.sleep(0.1)
    view = {r["name"]: r for r in replicas_view(port)}
    assert not view["r1"]["healthy"] and view["r0"]["healthy"], view
    after = [complete(port, p) for p in prompts[16:24]]
    assert all(kind == "ok" for kind, _ in after), after
    # its entry in the prefix index dies with its heartbeat: the liveness key at once, the
    # block set within its TTL
    from kvcache_svc.publisher import ALIVE_TTL_S, INDEX_TTL_S

    while time.time() < killed + ALIVE_TTL_S + 2 and redis_server.client.exists("pagoda:kv:{r1}:alive"):
        time.sleep(0.2)
    assert not redis_server.client.exists("pagoda:kv:{r1}:alive")
    assert 0 < redis_server.client.ttl("pagoda:kv:{r1}:blocks") <= INDEX_TTL_S
    assert redis_server.client.exists("pagoda:kv:{r0}:alive")


def test_serve_runs_replicas_behind_a_router_in_one_command(model_dir, tmp_path):
    """`pagoda serve --replicas 2`: two backends, a private redis-server for the prefix
    index, the gateway routing; one prompt's requests stay on one replica; nothing is left
    running after it stops."""
    from support.stack import children, start_serve

    stack = start_serve(
        model_dir,
        tmp_path,
        "--replicas",
        "2",
        "--num-threads",
        "1",
        "--num-kv-blocks",
        "128",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "1024",
    )
    try:
        assert [r["name"] for r in stack.ready["replicas"]] == ["r0", "r1"] and stack.ready["redis"]
        prompt = workload(3)[0]
        assert all(complete(stack.port, prompt)[0] == "ok" for _ in range(3))
        routed = sorted(r["routed"] for r in replicas_view(stack.port))
        assert routed == [0, 3], routed
        # a session sticks to one replica, whatever its prompts
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=60)
        before = {r["name"]: r["routed"] for r in replicas_view(stack.port)}
        for i in range(4):
            client.completions.create(model="tiny", prompt=workload(20 + i)[0], max_tokens=2, user="alice")
        moved = sorted(r["routed"] - before[r["name"]] for r in replicas_view(stack.port))
        assert moved == [0, 4], moved
        # the front door's statistics are the replicas' summed
        assert stack.get("/debug/memory")["kv_cache"]["num_total_blocks"] == 2 * 128
        pids = list(children(stack.serve.process.pid))
    finally:
        stack.stop_gracefully()  # what is asserted: its own stop leaves nothing running
    time.sleep(1)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read()]


def test_a_request_whose_replica_refuses_it_unstreamed_goes_to_another(model_dir, replicas):
    """The retry path itself, made certain: the router believes a replica at a dead address
    serving (as in the moment before its health poll notices), sends a request there first,
    is refused UNAVAILABLE before anything streamed, drains it and sends the request to the
    live replica, where it completes."""
    import asyncio

    from gateway.core import TextGenerator
    from gateway.generation import Finished, GenerationParams
    from services.sampling import SamplingOptions
    from services.text import Tokenizer

    dead = f"127.0.0.1:{free_port()}"
    generator = TextGenerator(
        f"dead={dead},live={replicas[0].scheduler_address}", Tokenizer(model_dir), 1024, routing="round-robin"
    )
    for r in generator.replicas.replicas:
        r.state.healthy = True  # not polled: the router's belief before the poll

    async def go():
        params = GenerationParams(sampling=SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True))
        items = [i async for i in generator.generate(workload(5)[0], params)]
        await generator.close()
        return items

    items = asyncio.run(go())
    assert isinstance(items[-1], Finished) and items[-1].usage.completion_tokens == 3
    rs = generator.replicas
    assert rs.num_retries == 1 and not rs.by_name("dead").state.healthy
    assert rs.by_name("live").num_routed == 1
