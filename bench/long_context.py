"""A very long prompt through the stack (issue 14): a tiny Llama made with
`max_position_embeddings` past the prompt and llama3 rope scaling, its KV pool sized from
memory (`--gpu-memory-utilization`), one prompt of `--tokens` tokens (chunked prefill over
the stages), greedy, `--new-tokens` generated.

Reports the time to the first token and the whole request, each process's peak resident
memory (VmHWM), the KV blocks the request held, and for each stage its peak against what the
sizing predicts: the memory held after loading (weights, torch), the profile's peak
activations (with what a chunk at max_model_len adds), and the whole pool (resident from
the start: it is allocated zeroed).

    python -m bench.long_context --tokens 131072 --out bench/results/long_context.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.grpc_utils import INTERNAL_TOKEN_ENV, aio_channel  # noqa: E402
from services.pb import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from wiring.launcher import MemorySetting, stage_load_infos, start_stack  # noqa: E402
from wiring.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402

ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4096,
}


def status_bytes(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


async def run(address: str, prompt: list[int], new_tokens: int, on_first) -> dict:
    async with aio_channel(address, 64 << 20) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
        req.sampling_params.max_tokens = new_tokens
        req.sampling_params.temperature = 0.0
        req.sampling_params.ignore_eos = True
        started, first, tokens = time.perf_counter(), None, []
        async for resp in stub.Generate(req, timeout=3600):
            if resp.token_ids and first is None:
                first = time.perf_counter() - started
                await on_first()
            tokens += resp.token_ids
        return {"ttft_s": first, "e2e_s": time.perf_counter() - started, "tokens": tokens}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    p.add_argument(
        "--memory-share",
        type=float,
        default=None,
        help="--gpu-memory-utilization (default: about 1.5 GiB per stage of this machine's memory)",
    )
    p.add_argument("--out", type=Path)
    return p.parse_args()


def stage_memory(infos, held_blocks: int, peaks: dict[str, int]) -> list[dict]:
    """Each stage's peak resident memory against what the sizing predicts."""
    mib = 1 << 20
    stages = []
    for info in infos:
        kv = held_blocks * info.kv_block_bytes
        pool = info.num_kv_blocks * info.kv_block_bytes  # resident whole: torch.zeros writes every page
        predicted = info.memory_baseline_bytes + info.activation_peak_bytes + pool
        peak = peaks[f"worker-{info.stage_index}"]
        stages.append(
            {
                "stage": info.stage_index,
                "baseline_mib": info.memory_baseline_bytes / mib,
                "weights_mib": info.weights_bytes / mib,
                "activation_mib": info.activation_peak_bytes / mib,
                "kv_used_mib": kv / mib,
                "pool_blocks": info.num_kv_blocks,
                "pool_mib": pool / mib,
                "predicted_mib": predicted / mib,
                "peak_mib": peak / mib,
                "peak_over_predicted": peak / predicted,
            }
        )
    return stages


def main() -> int:
    args = parse_args()
    os.environ.setdefault(INTERNAL_TOKEN_ENV, "bench-long-context")
    work = Path(tempfile.mkdtemp(prefix="pagoda-long-"))
    max_len = args.tokens + args.new_tokens + 64
    model = make_tiny_model(
        work / "model", TinyModelSpec(arch="llama", max_position_embeddings=max_len, rope_scaling=ROPE)
    )
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = args.memory_share or min(1.0, args.stages * 1.5 * (1 << 30) / total)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(args.tokens)]
    t0 = time.perf_counter()
    stack = start_stack(
        str(model),
        num_stages=args.stages,
        num_kv_blocks=None,
        log_dir=work,
        threads_per_worker=1,
        memory=MemorySetting(gpu_memory_utilization=share, max_model_len=max_len),
        scheduler_args=("--max-model-len", str(max_len), "--max-num-batched-tokens", str(args.chunk)),
    )
    startup = time.perf_counter() - t0
    try:
        infos = stage_load_infos(stack.workers, {})
        pids = {p.name: p.process.pid for p in stack.processes}
        held = {}

        async def on_first() -> None:  # the prompt's blocks, while the request holds them
            async with aio_channel(stack.scheduler_address) as channel:
                stats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest())
                held["blocks"] = stats.kv_cache.num_used_blocks

        result = asyncio.run(run(stack.scheduler_address, prompt, args.new_tokens, on_first))
        peaks = {name: status_bytes(pid, "VmHWM") for name, pid in pids.items()}
    finally:
        stack.stop()
    mib = 1 << 20
    stages = stage_memory(infos, held["blocks"], peaks)
    report = {
        "tokens": args.tokens,
        "new_tokens": args.new_tokens,
        "stages": args.stages,
        "chunk": args.chunk,
        "startup_s": startup,
        "ttft_s": result["ttft_s"],
        "e2e_s": result["e2e_s"],
        "generated": len(result["tokens"]),
        "kv_blocks_held": held["blocks"],
        "pool_blocks": stack.num_kv_blocks,
        "peak_rss_mib": {k: v / mib for k, v in peaks.items()},
        "per_stage": stages,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
