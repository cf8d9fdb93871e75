"""Stages on separate hosts (issue 13), with Linux network namespaces standing in for hosts.

The test builds a private network of its own: a "switch" namespace holding a bridge, and
one namespace per service (KV service, scheduler, worker-0, worker-1, gateway) plus one
for the client, each joined to the bridge by a veth pair and given an address of the
test's own (10.213.13.0/24). Every service is a real process started with `ip netns exec`,
bound to its namespace's address, and finds the others only through the addresses on its
command line; each has its own HOME, TMPDIR and cache folder. Greedy output, through the
scheduler directly and through the gateway with the official `openai` client, must equal
`transformers`.

Where the client runs: in a namespace of its own, as a subprocess (`ip netns exec`) of
this file run as a script (`_client_main`), which prints what it got as JSON; the test
process compares that with `transformers`. The root namespace gets no interface, address
or route, so the test never touches the host's network, and nothing can reach a service
except over the bridge. The health waits run in the client's namespace too (the
addresses are reachable only from inside the private network).

Teardown: the services are stopped, then the namespaces deleted (which removes the veth
pairs), whether the tests passed or not. The services die with the test process however it
ends (PR_SET_PDEATHSIG, `PAGODA_DIE_WITH_PARENT`), and namespaces named after a pid that is
gone, left by a run that was killed, are deleted at the next run's start.

Isolation is checked as well: from the scheduler's namespace worker-0's address answers
but 127.0.0.1 on worker-0's port does not; every listening socket of every service is on
its own address (none on loopback or on all interfaces); and the connections each
service holds go to the addresses it was given. Skipped, saying why, only where the
namespaces cannot be made (no `ip`, or no CAP_SYS_ADMIN/CAP_NET_ADMIN: not root).

The checkpoint folder is one folder on this machine, read by every service; on real
hosts each stage, the scheduler and the gateway need their own copy (docs/multi-host.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from wiring.launcher import PARENT_ENV

THIS_FILE = Path(__file__).resolve()
REPO = THIS_FILE.parents[2]
SUBNET = "10.213.13"  # a /24 that exists only inside the test's namespaces
PREFIX = "pgdnt"  # namespaces are named pgdnt<pid>-<host>
NUM_KV_BLOCKS, BLOCK_SIZE = 128, 16
API_KEY = "sk-netns-test"
GATEWAY_REST_PORT = 8000

# host -> (last octet of its address, its gRPC port); distinct ports, so that a connection
# that went to the wrong host would show
HOSTS = {
    "kvcache": (2, 7001),
    "scheduler": (3, 7002),
    "worker-0": (4, 7003),
    "worker-1": (5, 7004),
    "gateway": (6, 7005),
    "client": (9, 0),
}


def addr(host: str) -> str:
    return f"{SUBNET}.{HOSTS[host][0]}"


def endpoint(host: str) -> str:
    return f"{addr(host)}:{HOSTS[host][1]}"


class NamespacesUnavailable(Exception):
    """This machine will not let the test make network namespaces."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


class PrivateNetwork:
    """The namespaces, the bridge and the veth pairs; `close` removes them all (deleting a
    namespace removes the veth end inside it, and with it its peer)."""

    def __init__(self, hosts: list[str]) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.namespaces = {h: f"{self.tag}-{h}" for h in hosts}
        self.made: list[str] = []

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)

    def create(self) -> None:
        if shutil.which("ip") is None:
            raise NamespacesUnavailable("no `ip` binary (iproute2) to make network namespaces with")
        _remove_stale_namespaces()
        try:
            self._add_namespace(self.switch)
        except RuntimeError as exc:
            raise NamespacesUnavailable(
                f"cannot create a network namespace (needs root: CAP_SYS_ADMIN and CAP_NET_ADMIN): {exc}"
            ) from exc
        sw = self.switch
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for host, ns in self.namespaces.items():
            self._add_namespace(ns)
            port = f"v-{host}"  # in the switch namespace: no clash with the host's interfaces
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def command(self, host: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def run(self, host: str, *argv: str, timeout: float = 30) -> str:
        done = subprocess.run(self.command(host, *argv), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} in {host}'s namespace failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return done.stdout

    def close(self) -> None:
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.made.clear()


def _remove_stale_namespaces() -> None:
    """Namespaces an earlier run left behind when it was killed (its pid is gone)."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-.+", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _ip("netns", "del", name, check=False)


def _base_env() -> dict[str, str]:
    """The test's environment (with PAGODA_INTERNAL_TOKEN, set by conftest.py), without
    proxy settings: gRPC and httpx would send the private addresses to a proxy."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    assert env.get("PAGODA_INTERNAL_TOKEN"), "conftest.py sets the stack's secret"
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Service:
    name: str  # also its host (namespace)
    argv: list[str]  # `pagoda` arguments
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None

    def start(self, net: PrivateNetwork) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                net.command(self.name, sys.executable, "-m", "wiring.cli", *self.argv),
                env=self.env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        if self.alive:  # `ip netns exec` execs: the pid is pagoda's, its group all it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (unless `terminate` sent it), then SIGKILL after `grace_s`."""
        self.terminate()
        if self.process is None:
            return
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"\n--- {self.name} ({self.log_path}) ---\n{text[-2000:]}"


@dataclass
class Stack:
    net: PrivateNetwork
    services: dict[str, Service]
    model_dir: str
    reference: object = None
    env: dict[str, str] = field(default_factory=dict)

    def client(self, host: str, command: str, payload: object, timeout: float = 120) -> dict:
        """This file's `_client_main` run inside `host`'s namespace; its JSON answer."""
        out = self.net.run(host, sys.executable, str(THIS_FILE), command, json.dumps(payload), timeout=timeout)
        return json.loads(out.strip().splitlines()[-1])

    def wait_healthy(self, names: list[str], timeout: float) -> None:
        """From the client's namespace, until every service in `names` is SERVING; fails at
        once, with its log, when one exits."""
        targets = {n: endpoint(n) for n in names}
        probe = subprocess.Popen(
            self.net.command(
                "client", sys.executable, str(THIS_FILE), "wait", json.dumps({"addresses": targets, "timeout": timeout})
            ),
            env=self.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            while probe.poll() is None:
                dead = [s for s in self.services.values() if not s.alive]
                if dead:
                    raise RuntimeError(
                        "exited before serving: "
                        + "".join(f"{s.name} (code {s.process.returncode}){s.log_tail()}" for s in dead)
                    )
                time.sleep(0.2)
            out = probe.stdout.read()
            if probe.returncode != 0:
                raise RuntimeError(
                    f"not healthy after {timeout}s:\n{out}" + "".join(s.log_tail() for s in self.services.values())
                )
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.wait()

    def stop(self) -> None:
        order = [self.services[n] for n in ("gateway", "scheduler", "worker-0", "worker-1", "kvcache")]
        for service in order:  # all at once: their shutdowns overlap
            service.terminate()
        for service in order:
            service.stop()


@pytest.fixture(scope="module")
def network():
    net = PrivateNetwork(list(HOSTS))
    try:
        net.create()
    except NamespacesUnavailable as exc:
        net.close()
        pytest.skip(str(exc))
    except BaseException:
        net.close()
        raise
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def stack(network, model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("netns")
    env = _base_env()
    kv_layout = ["--block-size", str(BLOCK_SIZE)]
    blocks = ["--num-kv-blocks", str(NUM_KV_BLOCKS), *kv_layout]
    argvs = {
        "kvcache": [
            "kvcache",
            "--host",
            addr("kvcache"),
            "--port",
            str(HOSTS["kvcache"][1]),
            "--num-blocks",
            str(NUM_KV_BLOCKS),
            *kv_layout,
        ],
        "worker-0": [
            "worker",
            "--model",
            model_dir,
            "--stage",
            "0",
            "--num-stages",
            "2",
            "--host",
            addr("worker-0"),
            "--port",
            str(HOSTS["worker-0"][1]),
            "--next",
            endpoint("worker-1"),
            *blocks,
            "--num-threads",
            "1",
        ],
        "worker-1": [
            "worker",
            "--model",
            model_dir,
            "--stage",
            "1",
            "--num-stages",
            "2",
            "--host",
            addr("worker-1"),
            "--port",
            str(HOSTS["worker-1"][1]),
            "--feedback",
            endpoint("worker-0"),
            *blocks,
            "--num-threads",
            "1",
        ],
        "scheduler": [
            "scheduler",
            "--model",
            model_dir,
            "--host",
            addr("scheduler"),
            "--port",
            str(HOSTS["scheduler"][1]),
            "--kvcache",
            endpoint("kvcache"),
            "--stages",
            f"{endpoint('worker-0')},{endpoint('worker-1')}",
            "--pipeline-parallel-size",
            "2",
            *blocks,
        ],
        "gateway": [
            "gateway",
            "--model",
            model_dir,
            "--scheduler",
            endpoint("scheduler"),
            "--host",
            addr("gateway"),
            "--port",
            str(GATEWAY_REST_PORT),
            "--grpc-port",
            str(HOSTS["gateway"][1]),
            "--api-key",
            API_KEY,
        ],
    }
    services = {}
    for name, argv in argvs.items():
        home = root / name  # a "host" of its own: no file shared but the checkpoint
        (home / "tmp").mkdir(parents=True)
        service_env = {
            **env,
            "HOME": str(home),
            "TMPDIR": str(home / "tmp"),
            "XDG_CACHE_HOME": str(home / "cache"),
            PARENT_ENV: str(os.getpid()),
        }  # killed with this process, however it ends
        services[name] = Service(name, argv, service_env, root / f"{name}.log")
    s = Stack(network, services, model_dir, env=env)
    try:
        for name in ("kvcache", "worker-1", "worker-0", "scheduler", "gateway"):
            services[name].start(network)
        from support.reference import HFReference

        s.reference = HFReference(model_dir)  # loads while the services start
        # the scheduler serves once it reached the KV service and both stages, the gateway
        # once it reached the scheduler: so everything, each over the bridge
        s.wait_healthy(list(services), timeout=150)
        yield s
    finally:
        s.stop()


SCHEDULER_WORK = [
    ([5, 17, 300, 42], 12),
    (list(range(30, 70)), 16),
    ([7, 7, 7, 100, 200], 10),
    ([(i * 37) % 500 + 5 for i in range(90)], 12),
]
GATEWAY_PROMPTS, GATEWAY_MAX_TOKENS = [[11, 12, 13, 14, 15], list(range(100, 133))], 10


def test_greedy_across_namespaces_equals_transformers(stack):
    got = stack.client(
        "client",
        "generate",
        {
            "scheduler": endpoint("scheduler"),
            "work": SCHEDULER_WORK,
            "gateway": f"http://{addr('gateway')}:{GATEWAY_REST_PORT}/v1",
            "api_key": API_KEY,
            "model": stack.model_dir,
            "prompts": GATEWAY_PROMPTS,
            "max_tokens": GATEWAY_MAX_TOKENS,
        },
    )
    for (prompt, max_tokens), (tokens, finish) in zip(SCHEDULER_WORK, got["scheduler"], strict=True):
        assert len(tokens) == max_tokens and finish == "FINISH_REASON_LENGTH"
        assert stack.reference.compare(prompt, tokens).tie_divergences == 0
    for prompt, choice in zip(GATEWAY_PROMPTS, got["gateway"], strict=True):
        assert choice["prompt_token_ids"] == prompt and choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == GATEWAY_MAX_TOKENS
        assert stack.reference.compare(prompt, choice["token_ids"]).tie_divergences == 0
    # the last stage fed the first its sampled tokens, worker-1 to worker-0 over the bridge
    assert got["feedback_connected"]
    # beyond loopback the stack's secret is what keeps strangers out
    assert got["without_token"] == "UNAUTHENTICATED"
    # the connections that served these requests: each service's go to the addresses on
    # its command line, none to loopback
    want = {
        "scheduler": {"kvcache", "worker-0", "worker-1"},
        "worker-0": {"worker-1"},
        "worker-1": {"worker-0"},
        "gateway": {"scheduler"},
    }
    for name, peers in want.items():
        connected = {peer for _, peer in _sockets(stack.net, name, "-tnH", "state", "established")}
        assert {endpoint(p) for p in peers} <= connected, (name, connected)
        assert not any(p.startswith("127.") for p in connected), (name, connected)


def test_nothing_goes_over_loopback(stack):
    port0 = HOSTS["worker-0"][1]
    reach = stack.client(
        "scheduler",
        "reach",
        [[addr("worker-0"), port0], ["127.0.0.1", port0], ["127.0.0.1", HOSTS["scheduler"][1]]],
        timeout=30,
    )
    assert reach == {
        f"{addr('worker-0')}:{port0}": "ok",
        f"127.0.0.1:{port0}": "ECONNREFUSED",
        f"127.0.0.1:{HOSTS['scheduler'][1]}": "ECONNREFUSED",
    }

    for name in stack.services:  # every listener on the service's own address
        listening = {local for local, _ in _sockets(stack.net, name, "-ltunH")}
        assert listening and {a.rsplit(":", 1)[0] for a in listening} == {addr(name)}, (name, listening)

    # and the host's own network was never touched
    host = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
    assert f"{SUBNET}." not in host


def _sockets(net: PrivateNetwork, host: str, *ss_args: str) -> list[tuple[str, str]]:
    """(local, peer) of the sockets `ss` lists in `host`'s namespace (peer "" for a
    listener), IPv4-mapped IPv6 addresses as the IPv4 ones they are (gRPC's sockets are
    dual-stack: [::ffff:10.213.13.2]:7001 is 10.213.13.2:7001)."""

    def plain(address: str) -> str:
        return re.sub(r"^\[::ffff:([0-9.]+)\]", r"\1", address)

    pairs = []
    for line in net.run(host, "ss", *ss_args).splitlines():
        fields = line.split()
        if len(fields) >= 4:
            peer = fields[-1] if "*" not in fields[-1] else ""
            pairs.append((plain(fields[-2]), plain(peer)))
    return pairs


# --- the client side: this file run as a script inside a namespace -------------------


def _client_wait(payload: dict) -> int:
    from services.grpc_utils import check_health

    pending = dict(payload["addresses"])
    deadline = time.monotonic() + payload["timeout"]
    while pending and time.monotonic() < deadline:
        for name, address in list(pending.items()):
            if check_health(address, timeout_s=1.0):
                print(f"healthy {name} at {address}", flush=True)
                del pending[name]
        time.sleep(0.2)
    if pending:
        print(f"not serving: {pending}", flush=True)
        return 1
    return 0


def _client_generate(payload: dict) -> dict:
    import asyncio

    import grpc
    import httpx
    import openai

    from services.grpc_utils import aio_channel
    from services.pb import common_pb2, scheduler_pb2, scheduler_pb2_grpc

    async def one(stub, prompt, max_tokens):
        req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
        req.sampling_params.max_tokens = max_tokens
        req.sampling_params.temperature = 0.0
        req.sampling_params.ignore_eos = True
        tokens, finish = [], 0
        async for resp in stub.Generate(req, timeout=120):
            tokens.extend(resp.token_ids)
            finish = resp.finish_reason or finish
        return tokens, common_pb2.FinishReason.Name(finish)

    async def direct():
        async with aio_channel(payload["scheduler"]) as channel:  # the secret, from the env
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            results = await asyncio.gather(*(one(stub, p, m) for p, m in payload["work"]))
            stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
        async with grpc.aio.insecure_channel(payload["scheduler"]) as bare:
            try:
                await scheduler_pb2_grpc.SchedulerStub(bare).GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
                refused = "OK"
            except grpc.aio.AioRpcError as exc:
                refused = exc.code().name
        return results, stats, refused

    results, stats, refused = asyncio.run(direct())
    client = openai.OpenAI(
        base_url=payload["gateway"],
        api_key=payload["api_key"],
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=120),
    )
    resp = client.completions.create(
        model=payload["model"],
        prompt=payload["prompts"],
        max_tokens=payload["max_tokens"],
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choices = [
        {
            "prompt_token_ids": c.model_extra["prompt_token_ids"],
            "token_ids": c.model_extra["token_ids"],
            "finish_reason": c.finish_reason,
        }
        for c in sorted(resp.choices, key=lambda c: c.index)
    ]
    return {
        "scheduler": results,
        "gateway": choices,
        "without_token": refused,
        "feedback_connected": stats.stages[0].load_info.feedback_connected,
    }


def _client_reach(targets: list) -> dict:
    import errno
    import socket

    out = {}
    for host, port in targets:
        try:
            socket.create_connection((host, port), timeout=3).close()
            out[f"{host}:{port}"] = "ok"
        except OSError as exc:
            out[f"{host}:{port}"] = errno.errorcode.get(exc.errno, str(exc)) if exc.errno else str(exc)
    return out


def _client_main(argv: list[str]) -> int:
    command, payload = argv[0], json.loads(argv[1])
    if command == "wait":
        return _client_wait(payload)
    result = _client_generate(payload) if command == "generate" else _client_reach(payload)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_client_main(sys.argv[1:]))
