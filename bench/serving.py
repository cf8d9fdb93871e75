"""`pagoda bench --base-url URL [--base-url URL ...]`: drive any OpenAI-compatible server
(Pagoda, vLLM, ...) with the harness's workloads and compare them in one table, as `vllm
bench serve` measures one server.

    pagoda bench --base-url pagoda=http://127.0.0.1:8000 --base-url vllm=http://127.0.0.1:8001 \
        --model tiny --tokenizer /models/tiny --workload mixed --num-requests 64 --concurrency 16

Each server gets the same requests (token-id prompts made from the tokenizer's vocabulary,
greedy, `ignore_eos` unless `--no-ignore-eos`), streamed through `POST /v1/completions`,
one server at a time: a short warm-up, then a closed loop of `--concurrency` clients.
Reported per server: request and output-token throughput, TTFT, TPOT and ITL (mean, p50,
p99) and goodput (requests per second that met both SLOs, `--slo-ttft-ms` and
`--slo-tpot-ms`), under the key names of vLLM's bench results; with ratios to the first
server. Writes `serving.json` and `serving.md` into `--out`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.clients import HttpClient
from bench.load import closed_loop
from bench.stats import RequestRecord, client_metrics
from bench.workloads import FULL_SHAPE, QUICK_SHAPE, WORKLOAD_NAMES, BenchRequest, make_workload, token_space_of

WARMUP_REQUESTS = 4


@dataclass(frozen=True)
class Target:
    label: str
    base_url: str  # the server's root: http://host:port (a trailing /v1 is dropped)

    @classmethod
    def parse(cls, text: str) -> Target:
        """`LABEL=URL` or `URL` (labelled by its host and port)."""
        label, sep, url = text.partition("=")
        if not sep or "://" in label:
            label, url = "", text
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url: {text!r} is not an http(s) URL")
        return cls(label or url.split("://", 1)[1], url)


class _Progress:
    """`label: done/total` on stderr: redrawn in place on a terminal, every quarter otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self._tty = label, total, 0, sys.stderr.isatty()
        self._shown_quarter = -1

    def step(self) -> None:
        self.done += 1
        if self._tty:
            width = 30
            filled = width * self.done // max(1, self.total)
            print(
                f"\r  {self.label}: [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}",
                end="" if self.done < self.total else "\n",
                file=sys.stderr,
                flush=True,
            )
        elif (quarter := 4 * self.done // max(1, self.total)) > self._shown_quarter:
            self._shown_quarter = quarter
            print(f"  {self.label}: {self.done}/{self.total} requests", file=sys.stderr, flush=True)


class _Counted:
    """A client whose every finished request moves the progress line."""

    def __init__(self, client: HttpClient, progress: _Progress) -> None:
        self.client, self.progress = client, progress

    async def send(self, req: BenchRequest, record: RequestRecord) -> None:
        await self.client.send(req, record)
        self.progress.step()


async def measure(
    target: Target,
    model: str,
    requests: list[BenchRequest],
    concurrency: int,
    ignore_eos: bool,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
) -> dict[str, Any]:
    client = HttpClient(target.base_url, model, concurrency, ignore_eos=ignore_eos)
    try:
        listed = await client.get_json("/v1/models")
        names = [m.get("id") for m in listed.get("data", [])]
        if model not in names:
            raise ValueError(f"{target.label} serves {names}, not {model!r} (--model)")
        warm = list(requests[:WARMUP_REQUESTS])
        await closed_loop(client, warm, min(concurrency, len(warm)))
        progress = _Progress(target.label, len(requests))
        result = await closed_loop(_Counted(client, progress), requests, concurrency)
    finally:
        await client.close()
    records = result.records
    metrics = client_metrics(records, result.duration_s)
    good = [
        r
        for r in records
        if r.ok
        and r.ttft_s is not None
        and r.ttft_s * 1000 <= slo_ttft_ms
        and (r.tpot_s is None or r.tpot_s * 1000 <= slo_tpot_ms)
    ]
    errors = sorted({r.error for r in records if r.error})[:5]
    return {
        "label": target.label,
        "base_url": target.base_url,
        "model": model,
        # the key names of vLLM's `bench serve` results
        "completed": metrics.num_requests,
        "failed": metrics.num_failed,
        "duration": metrics.duration_s,
        "total_input_tokens": metrics.num_prompt_tokens,
        "total_output_tokens": metrics.num_output_tokens,
        "request_throughput": metrics.requests_per_s,
        "output_throughput": metrics.output_tokens_per_s,
        "request_goodput": len(good) / metrics.duration_s if metrics.duration_s > 0 else 0.0,
        **{
            f"{stat}_{name}_ms": getattr(getattr(metrics, name), f"{stat}_ms" if stat != "median" else "p50_ms")
            for name in ("ttft", "tpot", "itl")
            for stat in ("mean", "median", "p99")
        },
        "errors": errors,
    }


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(servers: list[dict[str, Any]]) -> str:
    base = servers[0]
    head = (
        "| server | done | failed | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms "
        "| goodput req/s | tok/s vs first | TTFT p50 vs first |"
    )
    rows = [head, "|" + "---|" * 11]
    for s in servers:
        tput = s["output_throughput"] / base["output_throughput"] if base["output_throughput"] else None
        ttft = s["median_ttft_ms"] / base["median_ttft_ms"] if s["median_ttft_ms"] and base["median_ttft_ms"] else None
        rows.append(
            f"| {s['label']} | {s['completed']} | {s['failed']} | {_f(s['request_throughput'], 2)} "
            f"| {_f(s['output_throughput'])} | {_f(s['median_ttft_ms'])} / {_f(s['p99_ttft_ms'])} "
            f"| {_f(s['median_tpot_ms'], 2)} | {_f(s['median_itl_ms'], 2)} / {_f(s['p99_itl_ms'], 2)} "
            f"| {_f(s['request_goodput'], 2)} | {_f(tput, 2)}x | {_f(ttft, 2)}x |"
        )
    return "\n".join(rows)


def _check(args) -> tuple[list[Target], str]:
    """The servers and the tokenizer's folder, or ValueError on a bad flag."""
    targets = [Target.parse(t) for t in args.base_url]
    if not args.model:
        raise ValueError("--model: the name to send as `model` is required with --base-url")
    tokenizer_dir = args.tokenizer or args.model
    if (
        not Path(tokenizer_dir, "tokenizer.json").is_file()
        and not Path(tokenizer_dir, "tokenizer_config.json").is_file()
    ):
        raise ValueError(f"--tokenizer: {tokenizer_dir} holds no tokenizer (give the model's folder)")
    if args.workload not in WORKLOAD_NAMES:
        raise ValueError(f"--workload: one of {', '.join(WORKLOAD_NAMES)}")
    if len({t.label for t in targets}) != len(targets):
        raise ValueError("--base-url: two servers with the same label (use LABEL=URL)")
    return targets, tokenizer_dir


def _write(args, started: str, requests: list[BenchRequest], servers: list[dict[str, Any]]) -> str:
    """serving.json and serving.md into --out; returns the table."""
    md = table(servers)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(
        json.dumps(
            {
                "started": started,
                "workload": args.workload,
                "num_prompts": len(requests),
                "concurrency": args.concurrency,
                "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
                "ignore_eos": args.ignore_eos,
                "servers": servers,
            },
            indent=2,
        )
    )
    (args.out / "serving.md").write_text(
        f"# pagoda bench --base-url ({started})\n\nWorkload `{args.workload}`, {len(requests)} requests, "
        f"{args.concurrency} clients, model `{args.model}`; goodput: TTFT <= {args.slo_ttft_ms:g} ms and "
        f"TPOT <= {args.slo_tpot_ms:g} ms.\n\n{md}\n"
    )
    return md


def run(args) -> int:
    from services.text import Tokenizer

    try:
        targets, tokenizer_dir = _check(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    space = token_space_of(Tokenizer(tokenizer_dir))
    requests = make_workload(
        args.workload, args.num_requests, space, QUICK_SHAPE if args.quick else FULL_SHAPE, args.seed
    )
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(
        f"pagoda bench: {len(targets)} server(s), workload {args.workload}, {len(requests)} requests, "
        f"concurrency {args.concurrency}, model {args.model!r}",
        flush=True,
    )
    servers = []
    for target in targets:
        try:
            servers.append(
                asyncio.run(
                    measure(
                        target,
                        args.model,
                        requests,
                        args.concurrency,
                        args.ignore_eos,
                        args.slo_ttft_ms,
                        args.slo_tpot_ms,
                    )
                )
            )
        except Exception as exc:  # a server that cannot be reached or refuses: say which
            print(f"error: {target.label} ({target.base_url}): {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    md = _write(args, started, requests, servers)
    print("\n" + md)
    print(f"\nwrote {args.out / 'serving.json'} and {args.out / 'serving.md'}")
    failed = [s["label"] for s in servers if s["failed"]]
    if failed:
        print(
            f"pagoda bench: requests failed on {', '.join(failed)}: "
            + "; ".join(e for s in servers for e in s["errors"]),
            file=sys.stderr,
        )
        return 3
    return 0
