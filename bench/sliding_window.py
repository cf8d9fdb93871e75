"""Benchmark: what one block table for all layers costs a sliding-window model (issue 33).

Pagoda's KV service keeps one logical block table per sequence for every layer (one
block id is the same slot range in every layer's pool), so a Gemma 3 sequence of C tokens
holds ceil(C / block_size) blocks in each of its layers, its sliding-window layers
included, which never read past their last `window` tokens. KV groups per attention type
(vLLM's hybrid KV-cache manager) would keep window / block_size + 1 blocks per sequence in
the sliding layers. This measures the first with the KV service's own manager (a sequence
of C tokens allocated, its statistics read) and computes the second, for Gemma-3-1B's shape
(26 layers, every sixth global, window 512, 1 KV head of 256) and a Gemma-3-shaped
SmolLM2-135M (30 layers, 3 KV heads of 64), at 8K and 32K tokens, float32 and bfloat16 KV.

    .venv/bin/python -m bench.sliding_window [--block-size 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # name: (layers, pattern: every n-th layer global, window, kv heads, head dim)
    "gemma-3-1b": (26, 6, 512, 1, 256),
    "gemma3-135m-shape": (30, 6, 512, 3, 64),
}


def blocks_held(tokens: int, block_size: int) -> int:
    """Blocks the KV service's manager holds for one sequence of `tokens` tokens."""
    from kvcache_svc.core.manager import KVCacheManager
    from kvcache_svc.core.types import NewSequence, StepInput

    manager = KVCacheManager(num_blocks=tokens // block_size + 8, block_size=block_size,
                             enable_prefix_caching=False)
    manager.step(StepInput(new_sequences=[NewSequence(1, list(range(tokens)))], micro_batch_id=1))
    return manager.stats().num_used_blocks


def main(argv: list[str] | None = None) -> int:
    import torch

    from worker_svc.memory import kv_block_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    bs = args.block_size
    print("| model | context | KV dtype | one table: blocks, MiB | KV groups: layer-blocks, MiB | one table / groups |")
    print("|---|---:|---|---:|---:|---:|")
    for name, (layers, pattern, window, kv_heads, head_dim) in SHAPES.items():
        num_global = sum(1 for i in range(layers) if (i + 1) % pattern == 0)
        for tokens in (8192, 32768):
            held = blocks_held(tokens, bs)
            for dtype in (torch.float32, torch.bfloat16):
                layer_block = kv_block_bytes(1, bs, kv_heads, head_dim, dtype)
                one_table = held * layers * layer_block
                grouped = (num_global * held + (layers - num_global) * min(held, window // bs + 1)) * layer_block
                print(f"| {name} | {tokens} | {str(dtype).split('.')[-1]} | {held} x {layers} layers, "
                      f"{one_table / 2**20:.0f} | {grouped // layer_block}, {grouped / 2**20:.0f} | "
                      f"{one_table / grouped:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
