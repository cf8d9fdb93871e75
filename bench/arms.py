"""The things a benchmark arm runs against: the full stack as processes, or the in-process engine.

    StackArm      KV service, stage workers and scheduler (`wiring.launcher.start_stack`) plus
                  a `pagoda gateway` process; load goes over HTTP to the gateway, counters are
                  read from the scheduler's GetStats
    InProcessArm  `wiring.local_engine.build_local_engine` in this process: no gRPC, no HTTP

Both are async context managers with a `client` (for `bench.load`) and `snapshot()`.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.clients import HttpClient, InProcessClient, SchedulerClient
from bench.stats import ServiceSnapshot
from services.defaults import BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS


@dataclass(frozen=True)
class EngineSettings:
    """One arm's engine configuration. `total_threads` torch threads in all, split evenly
    over the pipeline stages (PP=1: all on one stage; PP=2: half each)."""

    pipeline_parallel_size: int = 1
    async_scheduling: bool | None = None  # None: the server's default (async)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = MAX_NUM_SEQS
    num_kv_blocks: int = 2048
    block_size: int = BLOCK_SIZE
    total_threads: int = 2
    device: str | None = None  # the stages' --device (None: the server's default); "emulated:PROFILE" emulates

    def __post_init__(self) -> None:
        if self.total_threads < self.pipeline_parallel_size:
            raise ValueError(
                f"total_threads: {self.total_threads} cannot give each of {self.pipeline_parallel_size} stages a thread"
            )

    @property
    def is_async(self) -> bool:
        """The effective mode, as the scheduler resolves it."""
        if self.async_scheduling is None:
            return True  # SchedulerConfig.is_async
        return self.async_scheduling

    @property
    def threads_per_stage(self) -> int:
        return self.total_threads // self.pipeline_parallel_size

    def with_(self, **changes) -> EngineSettings:
        return replace(self, **changes)

    def service_flags(self) -> dict[str, list[str]]:
        """This arm's settings as `pagoda serve` takes them, then what serve passes on to each
        service (the settings schema: wiring/flags.py), so an arm's stack is what serve starts."""
        from wiring.cli import build_parser
        from wiring.flags import flag_args
        from wiring.serve import passed_flags, serve_settings

        declared = {b.setting.name: b.setting for b in serve_settings()}
        argv = ["serve"]
        for name in (
            "async_scheduling",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "max_num_batched_tokens",
            "max_num_seqs",
            "device",
        ):
            argv += flag_args(declared[name], getattr(self, name))
        args = build_parser().parse_args(argv)
        return {service: passed_flags(args, service) for service in ("scheduler", "worker", "kvcache")}

    def describe(self) -> str:
        return (
            f"PP={self.pipeline_parallel_size} x {self.threads_per_stage} thread(s), "
            f"{'async' if self.is_async else 'sync'}, "
            f"chunked prefill {'on' if self.enable_chunked_prefill else 'off'} "
            f"(budget {self.max_num_batched_tokens}), "
            f"prefix caching {'on' if self.enable_prefix_caching else 'off'}"
            + (f", device {self.device}" if self.device else "")
        )

    @property
    def device_label(self) -> str:
        """What a bench table's device column says: the --device given (an emulated one says
        "emulated:PROFILE"), else "cpu" (the stages' default on a machine without a GPU)."""
        return self.device or "cpu"


def gateway_available() -> bool:
    """Whether this checkout's `pagoda` has a `gateway` subcommand."""
    try:
        from wiring.cli import build_parser

        parser = build_parser()
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        return "gateway" in sub.choices
    except Exception:
        return False


class StackArm:
    """The full stack as local processes. `driver="http"` sends load through a gateway process;
    `driver="grpc"` straight to the scheduler (when there is no gateway)."""

    def __init__(
        self, model_dir: str, settings: EngineSettings, log_dir: Path, driver: str = "http", concurrency: int = 16
    ) -> None:
        self.model_dir = model_dir
        self.settings = settings
        self.log_dir = log_dir
        self.driver = driver
        self.concurrency = concurrency
        self.stack = None
        self.gateway = None
        self.client = None
        self.stats: SchedulerClient | None = None
        self.model_name = ""
        self.startup_s = 0.0

    async def __aenter__(self) -> StackArm:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.close()  # stop whatever did start: no orphans when a service fails
            raise

    async def _start(self) -> None:
        from wiring.launcher import ServiceProcess, free_port, pagoda_command, start_stack

        t0 = time.perf_counter()
        s = self.settings
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {"TOKENIZERS_PARALLELISM": "false"}
        flags = s.service_flags()
        self.stack = await asyncio.to_thread(
            start_stack,
            self.model_dir,
            num_stages=s.pipeline_parallel_size,
            num_kv_blocks=s.num_kv_blocks,
            block_size=s.block_size,
            log_dir=self.log_dir,
            scheduler_args=flags["scheduler"],
            worker_args=flags["worker"],
            kvcache_args=flags["kvcache"],
            env=env,
            threads_per_worker=s.threads_per_stage,
        )
        self.stats = SchedulerClient(self.stack.scheduler_address)
        if self.driver == "http":
            port, grpc_port = free_port(), free_port()
            self.gateway = ServiceProcess(
                "gateway",
                pagoda_command(
                    "gateway",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--grpc-port",
                    str(grpc_port),
                    "--scheduler",
                    self.stack.scheduler_address,
                    "--model",
                    self.model_dir,
                ),
                f"127.0.0.1:{grpc_port}",
                env=env,
                log_path=self.log_dir / "gateway.log",
            )
            self.gateway.start()
            await asyncio.to_thread(self.gateway.wait_healthy, 120)
            client = HttpClient(f"http://127.0.0.1:{port}", "", self.concurrency)
            await _wait_http_health(client)
            models = await client.get_json("/v1/models")
            client.model = models["data"][0]["id"]
            self.model_name = client.model
            self.client = client
        else:
            self.client = self.stats
        self.startup_s = time.perf_counter() - t0

    async def snapshot(self) -> ServiceSnapshot:
        return await self.stats.snapshot()

    def pids(self) -> list[int]:
        """This process and every service process of the arm (for `bench.machine`)."""
        procs = [*(self.stack.processes if self.stack else []), *([self.gateway] if self.gateway else [])]
        return [os.getpid(), *(p.process.pid for p in procs if p.process is not None)]

    async def close(self) -> None:
        if self.client is not None and self.client is not self.stats:
            await self.client.close()
        if self.stats is not None:
            await self.stats.close()
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop, 10.0)
        if self.stack is not None:
            await asyncio.to_thread(self.stack.stop, 10.0)
        self.client = self.stats = self.gateway = self.stack = None


async def _wait_http_health(client: HttpClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.get_json("/health")
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


class InProcessArm:
    """Every part in this process (`build_local_engine`), with `total_threads` torch threads."""

    def __init__(self, model_dir: str, settings: EngineSettings) -> None:
        self.model_dir = model_dir
        self.settings = settings
        self.engine = None
        self.client: InProcessClient | None = None
        self.driver = "in-process"
        self.startup_s = 0.0
        self._threads = None

    async def __aenter__(self) -> InProcessArm:
        import torch

        from scheduler_svc.config import SchedulerConfig
        from wiring.local_engine import build_local_engine

        t0 = time.perf_counter()
        s = self.settings
        self._threads = torch.get_num_threads()
        torch.set_num_threads(s.total_threads)
        config = SchedulerConfig(
            model=self.model_dir,
            pipeline_parallel_size=s.pipeline_parallel_size,
            async_scheduling=s.async_scheduling,
            enable_chunked_prefill=s.enable_chunked_prefill,
            enable_prefix_caching=s.enable_prefix_caching,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            num_kv_blocks=s.num_kv_blocks,
            block_size=s.block_size,
            max_model_len=_max_model_len(self.model_dir),
        )
        try:
            self.engine = await asyncio.to_thread(
                build_local_engine, self.model_dir, config, s.num_kv_blocks, "auto", s.device
            )
            await self.engine.start()
        except BaseException:
            torch.set_num_threads(self._threads)
            raise
        self.client = InProcessClient(self.engine)
        self.startup_s = time.perf_counter() - t0
        return self

    async def snapshot(self) -> ServiceSnapshot:
        return await self.client.snapshot()

    def pids(self) -> list[int]:
        return [os.getpid()]

    async def __aexit__(self, *exc) -> None:
        import torch

        if self.engine is not None:
            await self.engine.stop()
        if self._threads:
            torch.set_num_threads(self._threads)


def _max_model_len(model_dir: str) -> int:
    import json

    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 4096))
    except (OSError, ValueError):
        return 4096


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
