"""Faults under load (issue 16's chaos suite): `pagoda serve` at PP=2 with greedy requests in
flight, and one process at a time killed (SIGKILL) or hung (SIGSTOP):

- a stage worker or the KV service: every request completes, each output identical to an
  undisturbed run's;
- the scheduler: requests that had streamed nothing complete (the gateway retries them),
  those that had streamed end with a clean error, nothing hangs, and the blocks the dead
  scheduler held are released;
- the gateway: its clients see their connections end, nothing hangs, the stack serves again;
- a hung worker (SIGSTOP for 10 s): the scheduler's step deadline notices, and requests
  complete once it runs again.

Each scenario reports its counts (requests, completed, errors, recovery seconds) on stdout
(`pytest -s`), which the issue's closing note quotes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.stack import profile, start_serve

NUM_REQUESTS = 32 if profile() == "quick" else 128
MAX_TOKENS = 48 if profile() == "quick" else 96
STEP_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    s = start_serve(
        model_factory(arch="llama"),
        tmp_path_factory.mktemp("chaos-faults"),
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "512",
        "--block-size",
        "16",
        "--num-threads",
        "1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--max-restarts",
        "20",
        "--step-timeout-s",
        str(STEP_TIMEOUT_S),
    )
    yield s
    s.stop()


def prompts():
    return [f"Request {i}: " + "the quick brown fox " * (1 + i % 5) for i in range(NUM_REQUESTS)]


def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


def run_all(stack, during=None, delay_s: float = 0.3, stream: bool = False):
    """All requests at once (greedy); `during()` runs `delay_s` into them, once they run: the
    first token streamed (`stream`), else the stack holding KV blocks. Returns each outcome:
    ("ok", token ids) or ("error", what, tokens streamed before it)."""
    c = client(stack)
    streamed = threading.Event()

    def one(prompt):
        got = []
        try:
            if stream:
                for chunk in c.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                ):
                    for choice in chunk.choices:
                        got += getattr(choice, "token_ids", None) or []
                    if got:
                        streamed.set()
                return ("ok", got)
            r = c.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return ("ok", r.choices[0].token_ids)
        except (openai.APIError, openai.APIConnectionError) as exc:
            return ("error", type(exc).__name__, len(got))

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(one, p) for p in prompts()]
        if during is not None:
            time.sleep(delay_s)
            if stream:  # a token out: the burst runs (statistics can lag a loaded machine)
                assert streamed.wait(60), "no token streamed within 60 s"
            else:
                wait_running(stack, futures)
            during()
        return [f.result(timeout=300) for f in futures]


def wait_running(stack, futures, timeout_s: float = 10.0) -> None:
    """Until the stack holds KV blocks for the burst (its requests are running), so a fault
    lands mid-burst however fast the machine serves it (a fixed delay was sometimes past the
    end of the whole burst)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and not all(f.done() for f in futures):
        if stack.kv_used_blocks():
            return
        time.sleep(0.01)


@pytest.fixture(scope="module")
def baseline(stack):
    outcomes = run_all(stack)
    assert all(kind == "ok" for kind, *_ in outcomes)
    return [tokens for _, tokens in outcomes]


def report(name, outcomes, recovery_s=None, leaked=None):
    """recovery_s: from the fault until every request had its answer and /health said ok."""
    ok = sum(o[0] == "ok" for o in outcomes)
    print(
        f"\n[chaos] {name}: {len(outcomes)} requests, {ok} completed, {len(outcomes) - ok} errors"
        + (f", all answered and serving after {recovery_s:.1f} s" if recovery_s is not None else "")
        + (f", {leaked} KV blocks held afterwards" if leaked is not None else "")
    )


@pytest.mark.parametrize("kind", ["worker-1", "worker-0", "kvcache"])
def test_killed_worker_or_kv_service_changes_no_output(stack, baseline, kind):
    service, stage = (kind.split("-")[0], int(kind.split("-")[1])) if kind.startswith("worker") else (kind, None)
    victim = stack.service_pid(service, stage)
    killed = []
    # killed once a token has streamed: mid-burst however fast or loaded the machine
    kill = lambda: (os.kill(victim, signal.SIGKILL), killed.append(time.time()))  # noqa: E731
    outcomes = run_all(stack, during=kill, delay_s=0.0, stream=True)
    stack.wait_serving(60)
    recovery = time.time() - killed[0]
    report(f"SIGKILL {kind}", outcomes, recovery, stack.kv_used_blocks())
    assert [o[0] for o in outcomes] == ["ok"] * NUM_REQUESTS, outcomes
    assert [o[1] for o in outcomes] == baseline, "outputs differ from the undisturbed run"
    assert restarted(stack, service, stage, victim, 60)
    assert stack.kv_used_blocks() == 0
    # the stages hand hidden states on through their shared-memory ring (issue 37; another
    # channel when the run forces one), a new one offered after a stage's restart
    channel = {"grpc": "grpc", "nccl": "gloo"}.get(os.environ.get("PAGODA_STAGE_CHANNEL", ""), "shm")
    # (the burst can end before the kill is noticed: one more request crosses the restarted
    # chain, and the stages are listed once the scheduler has reconnected)
    one_more = client(stack).completions.create(model="tiny", prompt=prompts()[0], max_tokens=4, temperature=0)
    assert one_more.choices[0].text is not None
    deadline, stages = time.time() + 60, []
    while time.time() < deadline and [st["data_channel"] for st in stages] != [channel, ""]:
        time.sleep(0.2)
        stages = stack.get("/debug/memory")["stages"]
    assert [st["data_channel"] for st in stages] == [channel, ""]
    # and the micro-batches through the next stage's local socket, reopened after the restart
    assert stages[0]["control_channel"] == ("grpc" if channel == "grpc" else "unix")


def restarted(stack, service, stage, victim, timeout_s):
    """Whether a new process serves in the victim's place within `timeout_s` (on a loaded
    machine the requests can all finish before the death is noticed and the restart made)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if stack.service_pid(service, stage) != victim:
                return True
        except LookupError:  # dead, not yet restarted
            pass
        time.sleep(0.2)
    return False


def test_killed_scheduler_retries_what_had_not_streamed(stack, baseline):
    """Killed before any request reached it: the gateway retries them all on the restarted
    scheduler, and they complete with the undisturbed outputs."""
    victim = stack.service_pid("scheduler")
    os.kill(victim, signal.SIGKILL)
    started = time.time()
    outcomes = run_all(stack)
    report("SIGKILL scheduler, then requests", outcomes, time.time() - started, stack.kv_used_blocks())
    assert [o[0] for o in outcomes] == ["ok"] * NUM_REQUESTS, outcomes
    assert [o[1] for o in outcomes] == baseline


def test_killed_scheduler_mid_stream_fails_cleanly_and_frees_blocks(stack):
    victim = stack.service_pid("scheduler")
    began = time.time()
    outcomes = run_all(stack, during=lambda: os.kill(victim, signal.SIGKILL), delay_s=0.0, stream=True)
    elapsed = time.time() - began
    stack.wait_serving(60)
    recovery = time.time() - began
    leaked = stack.kv_used_blocks()
    report("SIGKILL scheduler mid-stream", outcomes, recovery, leaked)
    assert any(o[0] == "error" for o in outcomes)  # those that had streamed: a clean error
    assert elapsed < 120  # nothing hung
    assert leaked == 0  # the restarted scheduler released the dead one's sequences
    after = run_all(stack)
    assert all(o[0] == "ok" for o in after)


def test_killed_gateway_ends_connections_and_comes_back(stack):
    victim = stack.service_pid("gateway")
    killed = []
    outcomes = run_all(stack, during=lambda: (os.kill(victim, signal.SIGKILL), killed.append(time.time())), stream=True)
    stack.wait_serving(60)
    recovery = time.time() - killed[0]
    deadline = time.time() + 30
    while stack.kv_used_blocks() and time.time() < deadline:  # the aborts reach the scheduler
        time.sleep(0.2)
    report("SIGKILL gateway", outcomes, recovery, stack.kv_used_blocks())
    assert stack.kv_used_blocks() == 0
    assert all(o[0] == "ok" for o in run_all(stack))


def test_a_burst_of_2000_requests_completes_without_cancellations(stack):
    """Issue 16, defect 5: 2,000 concurrent completions lost ~150 as HTTP 499 "CANCELLED"
    (gRPC core cancelled calls the scheduler had not picked up within 1 s). Every request
    completes now; none is cancelled that its client did not cancel.

    It runs before the hung-worker scenario (pytest keeps the file's order): the step that a
    hung stage makes late caps the scheduler's later steps below its size (16 tokens) for
    the engine's life (scheduler_svc/core/deadlines.py): after it, the 2,000 requests took
    64-90 s at 15 tokens a step instead of ~12 s. The property (no call cancelled while over
    1,000 wait to be picked up) does not depend on the step size."""
    import asyncio
    from collections import Counter

    import aiohttp

    n = 2000

    async def burst():
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
        ) as session:

            async def one(i):
                async with session.post(
                    f"{stack.url}/v1/completions", json={"model": "tiny", "prompt": f"burst {i}", "max_tokens": 8}
                ) as r:
                    await r.read()
                    return r.status

            return await asyncio.gather(*(one(i) for i in range(n)))

    began = time.time()
    statuses = Counter(asyncio.run(burst()))
    print(f"\n[chaos] burst: {n} concurrent completions in {time.time() - began:.1f} s: {dict(statuses)}")
    assert statuses == {200: n}
    assert stack.kv_used_blocks() == 0


def test_hung_worker_is_noticed_by_the_step_deadline(stack, baseline):
    victim = stack.service_pid("worker", 1)

    def hang(seen: list) -> None:
        os.kill(victim, signal.SIGSTOP)
        threading.Timer(10.0, os.kill, (victim, signal.SIGCONT)).start()
        time.sleep(0.5)
        # the statistics still answer while a stage is hung (its call is bounded, not serial);
        # blocks held then: the burst was under way when the stage stopped
        seen.append(stack.get("/debug/memory"))

    seen: list[dict] = []
    began = time.time()
    # stopped once a token has streamed: mid-burst however fast the machine (in a CI run, the
    # statistics polled for held blocks read none in three bursts until each had ended)
    outcomes = run_all(stack, during=lambda: hang(seen), delay_s=0.0, stream=True)
    assert seen, "/debug/memory answered during the hang"
    report("SIGSTOP worker-1 for 10 s", outcomes, time.time() - began, stack.kv_used_blocks())
    assert [o[0] for o in outcomes] == ["ok"] * NUM_REQUESTS, outcomes
    assert [o[1] for o in outcomes] == baseline
    assert seen[0]["kv_health"] == "HEALTH_STATUS_SERVING", seen[0]
    assert seen[0]["kv_cache"].get("num_used_blocks"), f"KV blocks held mid-burst: {seen[0]['kv_cache']}"
    assert time.time() - began > 9.0, "the burst waited for the stopped stage"
    log = (stack.logs / "scheduler.log").read_text()
    assert "step deadline" in log, "the scheduler noticed the hung stage by its deadline"
