"""Cancel storms and overload (issue 16's chaos suite), against one `pagoda serve` stack with a
small capacity (4 running sequences, 16 queued):

- cancel storm: streaming requests over REST and over the public gRPC API, each abandoned by
  its client at a random point (seeded): afterwards no KV block is in use, no process was
  restarted, and a fixed greedy probe gives the same tokens as before;
- overload: many times the capacity at once: the excess is refused fast with 429 and
  `Retry-After` (never a cancellation the client did not ask for), every admitted request
  completes, a high-priority key's request is served ahead of the queue, and each process's
  memory stays under a stated bound.

Counts go to stdout (`pytest -s`) for the closing note.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from support.stack import profile, rss_bytes, start_serve

from services.pb import common_pb2, gateway_pb2, gateway_pb2_grpc

STORM = 60 if profile() == "quick" else 300
OVERLOAD_S = 6.0 if profile() == "quick" else 30.0
MAX_NUM_SEQS, MAX_QUEUE = 4, 16
STALL_S = 1.0  # --stream-stall-timeout: a client reading nothing this long is cut off
RSS_BOUND = 2 * 1024**3  # per process: model, KV pool and buffers of this tiny stack
KEYS = {"sk-batch": {"tenant": "batch", "priority": 10}, "sk-urgent": {"tenant": "urgent", "priority": -10}}


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("chaos-load")
    keys = logs / "keys.json"
    keys.write_text(json.dumps(KEYS))
    s = start_serve(
        model_factory(arch="llama"),
        logs,
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "256",
        "--num-threads",
        "1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-queue-len",
        str(MAX_QUEUE),
        "--scheduler-policy",
        "priority",
        "--api-keys-file",
        str(keys),
        "--stream-stall-timeout",
        str(STALL_S),
    )
    s.api_key = "sk-batch"
    yield s
    s.stop()


def client(stack, key="sk-batch"):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=120)


def probe(stack) -> list[int]:
    r = client(stack).completions.create(
        model="tiny",
        prompt="A fixed probe",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return r.choices[0].token_ids


def pids(stack) -> dict[str, int]:
    return {k: stack.service_pid(k) for k in ("gateway", "scheduler", "kvcache")} | {
        f"worker-{i}": stack.service_pid("worker", i) for i in (0, 1)
    }


async def _rest_abandoned(stack, rng: random.Random) -> str:
    """A streamed completion read for a few events, then the connection dropped."""
    body = json.dumps(
        {"model": "tiny", "prompt": "storm " * rng.randint(1, 20), "max_tokens": 64, "stream": True, "ignore_eos": True}
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    writer.write(
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-batch\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    await writer.drain()
    stop_after = rng.randint(0, 12)  # 0: before the first event
    events = 0
    try:
        while events < stop_after:
            line = await asyncio.wait_for(reader.readline(), 30)
            if not line:
                break
            events += line.startswith(b"data:")
    finally:
        writer.close()
    return "rest"


async def _grpc_abandoned(stack, rng: random.Random, stub) -> str:
    req = gateway_pb2.TextGenerateRequest(text="storm " * rng.randint(1, 20))
    req.options.sampling_params.max_tokens = 64
    req.options.sampling_params.ignore_eos = True
    call = stub.Generate(req, metadata=(("authorization", "Bearer sk-batch"),))
    stop_after = rng.randint(0, 12)
    try:
        n = 0
        async for _ in call:
            n += 1
            if n >= stop_after:
                break
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full queue is a fair answer
            raise
    finally:
        call.cancel()
    return "grpc"


def test_cancel_storm_leaves_nothing_behind(stack):
    before_pids, before = pids(stack), probe(stack)
    rng = random.Random(42)

    async def storm():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            stub = gateway_pb2_grpc.GenerationStub(channel)
            jobs = [
                _rest_abandoned(stack, random.Random(rng.random()))
                if i % 2
                else _grpc_abandoned(stack, random.Random(rng.random()), stub)
                for i in range(STORM)
            ]
            return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(storm())
    failures = [r for r in results if isinstance(r, BaseException)]
    deadline = time.time() + 20
    while stack.kv_used_blocks() and time.time() < deadline:
        time.sleep(0.2)
    used = stack.kv_used_blocks()
    print(
        f"\n[chaos] cancel storm: {STORM} streams ({STORM // 2} REST, {STORM - STORM // 2} gRPC) abandoned, "
        f"{len(failures)} client-side failures, {used} KV blocks in use afterwards"
    )
    assert failures == [], failures[:3]
    assert used == 0
    assert pids(stack) == before_pids, "no process died"
    assert probe(stack) == before


def test_overload_is_refused_fast_and_the_urgent_go_first(stack):
    outcomes: list[tuple[str, float, str | None]] = []
    lock = threading.Lock()
    stop = time.time() + OVERLOAD_S

    def hammer(i: int) -> None:
        c = client(stack)
        while time.time() < stop:
            start = time.time()
            try:
                c.completions.create(
                    model="tiny", prompt=f"load {i} " * 8, max_tokens=32, extra_body={"ignore_eos": True}
                )
                outcome = ("ok", time.time() - start, None)
            except openai.RateLimitError as exc:
                outcome = ("429", time.time() - start, exc.response.headers.get("retry-after"))
            except openai.APIError as exc:
                outcome = (f"error {getattr(exc, 'status_code', '')} {exc}"[:120], time.time() - start, None)
            with lock:
                outcomes.append(outcome)

    clients = 10 * (MAX_NUM_SEQS + MAX_QUEUE) // 4  # several times what runs and waits
    peak_rss: dict[str, int] = {}

    def sample_rss() -> None:
        while time.time() < stop:
            for name, pid in pids(stack).items():
                peak_rss[name] = max(peak_rss.get(name, 0), rss_bytes(pid))
            time.sleep(0.5)

    with ThreadPoolExecutor(clients + 2) as pool:
        pool.submit(sample_rss)
        for i in range(clients):
            pool.submit(hammer, i)
        time.sleep(OVERLOAD_S / 3)  # the queue is full now
        t0 = time.time()
        urgent = client(stack, "sk-urgent").completions.create(
            model="tiny", prompt="urgent", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(urgent))
        urgent_ttft = time.time() - t0
        for _ in urgent:
            pass
    ok = [d for kind, d, _ in outcomes if kind == "ok"]
    refused = [(d, ra) for kind, d, ra in outcomes if kind == "429"]
    other = [kind for kind, _, _ in outcomes if kind not in ("ok", "429")]
    print(
        f"\n[chaos] overload: {clients} clients for {OVERLOAD_S:.0f} s: {len(outcomes)} requests, {len(ok)} "
        f"completed (median {statistics.median(ok):.2f} s), {len(refused)} refused 429 (median "
        f"{statistics.median([d for d, _ in refused]) * 1000:.0f} ms), {len(other)} other; urgent key's "
        f"first token after {urgent_ttft:.2f} s; peak RSS MB { ({k: v >> 20 for k, v in peak_rss.items()}) }"
    )
    assert other == [], other[:5]
    assert refused and ok
    assert all(ra is not None and int(ra) >= 1 for _, ra in refused), "every 429 says when to come back"
    assert statistics.median([d for d, _ in refused]) < 1.0, "the excess is refused fast"
    assert urgent_ttft < statistics.median(ok), "the urgent request went ahead of the queue"
    assert len(peak_rss) == 5 and all(v < RSS_BOUND for v in peak_rss.values()), peak_rss
    deadline = time.time() + 20
    while stack.kv_used_blocks() and time.time() < deadline:
        time.sleep(0.2)
    assert stack.kv_used_blocks() == 0


def _read_all(sock, timeout_s: float = 30.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while not data.endswith(b"data: [DONE]\n\n") and not data.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def test_a_slow_consumer_stalls_nobody_and_is_cut_off(stack):
    """Clients that stop reading their streams (REST with a tiny receive window, gRPC with a
    fixed flow-control window) hold up no other request, the gateway's memory stays flat (it
    reads only a bounded window ahead of each client; a REST connection's kernel send buffer
    is capped), and after --stream-stall-timeout their requests are aborted downstream,
    blocks freed, while the connections are still open; a client that finally reads gets
    what was buffered, then finish reason "abort" on every choice."""
    import socket

    gateway = stack.service_pid("gateway")
    rss_before = rss_bytes(gateway)
    slow = []
    for i in range(2):  # 2 x 2 choices x 480 tokens with 20 alternatives each: ~850 KiB a request
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", stack.port))
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": f"slow {i}",
                "max_tokens": 480,
                "n": 2,
                "stream": True,
                "ignore_eos": True,
                "logprobs": 20,
            }
        )
        s.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-batch\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        slow.append(s)  # not read until the end
    channel = grpc.insecure_channel(
        f"127.0.0.1:{stack.grpc_port}",
        options=[
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 1024),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )
    req = gateway_pb2.TextGenerateRequest(text="slow grpc")
    # (2 choices, as the REST ones: ~1 MB in all, well past what gRPC's own buffers take in
    # besides the gateway's read-ahead; with one choice a fast run could finish within them)
    req.options.sampling_params.n = 2
    req.options.sampling_params.max_tokens = 480
    req.options.sampling_params.ignore_eos = True
    req.options.sampling_params.logprobs = 20
    slow_grpc = gateway_pb2_grpc.GenerationStub(channel).Generate(
        req, metadata=(("authorization", "Bearer sk-batch"),)
    )  # not read until the end
    try:
        started = time.time()
        with ThreadPoolExecutor(8) as pool:
            done = list(
                pool.map(
                    lambda i: client(stack, "sk-urgent").completions.create(
                        model="tiny", prompt=f"normal {i}", max_tokens=16, extra_body={"ignore_eos": True}
                    ),
                    range(8),
                )
            )
        elapsed = time.time() - started
        rss_after = rss_bytes(gateway)
        deadline = time.time() + 60
        while stack.kv_used_blocks() and time.time() < deadline:  # aborted: nobody read them
            time.sleep(0.2)
        freed_after = time.time() - started
        used = stack.kv_used_blocks()
        bodies = [_read_all(s) for s in slow]
        grpc_reasons = [c.finish_reason for m in slow_grpc for c in m.choices if c.finish_reason]
    finally:
        for s in slow:
            s.close()
        slow_grpc.cancel()
        channel.close()
    reasons = [
        [
            json.loads(line[6:])["choices"][0]["finish_reason"]
            for line in b.decode().split("\n")
            if line.startswith("data: {") and '"finish_reason":null' not in line.replace(" ", "")
        ]
        for b in bodies
    ]
    print(
        f"\n[chaos] slow consumers: 2 REST and 1 gRPC streams (n=2 each) unread, 8 other requests done in "
        f"{elapsed:.1f} s; gateway RSS {rss_before >> 20} -> {rss_after >> 20} MB; unread requests aborted, "
        f"blocks freed after {freed_after:.1f} s; REST bodies {[len(b) >> 10 for b in bodies]} KiB, finish "
        f"reasons {reasons}, gRPC {grpc_reasons}"
    )
    assert all(r.choices[0].finish_reason == "length" for r in done)
    assert elapsed < 30
    assert rss_after - rss_before < 200 * 1024**2
    assert used == 0
    assert reasons == [["abort", "abort"]] * 2
    assert all(b"data: [DONE]" in b for b in bodies)
    assert grpc_reasons == [common_pb2.FINISH_REASON_ABORT] * 2
