"""Benchmark: what KV groups save a sliding-window model, against one table (issue 33).

With one block table per sequence for every layer (one block id the same slot range in
every layer's pool) a Gemma 3 sequence of C tokens holds ceil(C / block_size) blocks in
each of its layers, its sliding-window layers included, which never read past their last
`window` tokens. With KV groups (services/kv_layout.py, the KV service's manager given the
layout's `group_windows`) the sliding sub-groups give back what their window left. Both are
measured with the KV service's own manager: a sequence of C tokens prefilled in chunks of
2,048 and decoded 16 tokens further, its pages read from the manager's statistics, for
Gemma-3-1B's shape (26 layers, every sixth global, window 512, 1 KV head of 256) and a
Gemma-3-shaped SmolLM2-135M (30 layers, 3 KV heads of 64), at 8K and 32K tokens.

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


def pages_held(tokens: int, block_size: int, windows: tuple[int, ...]) -> int:
    """Pages the KV service's manager holds for one sequence of `tokens` tokens (prefilled in
    chunks, then decoded) under the KV groups `windows`."""
    from kvcache_svc.core.manager import KVCacheManager
    from services.kv_types import Append, NewSequence, StepInput

    prompt, chunk = list(range(tokens - 16)), 2048
    manager = KVCacheManager(
        num_blocks=len(windows) * (tokens // block_size + 8),
        block_size=block_size,
        enable_prefix_caching=False,
        group_windows=windows,
    )
    manager.step(StepInput(new_sequences=[NewSequence(1, prompt, max_num_new_tokens=chunk)], micro_batch_id=1))
    step = 1
    for start in range(chunk, len(prompt), chunk):
        step += 1
        manager.step(StepInput(appends=[Append(1, prompt[start : start + chunk])], micro_batch_id=step))
    for t in range(16):
        step += 1
        manager.step(StepInput(appends=[Append(1, [t])], micro_batch_id=step))
    return manager.stats().num_used_blocks


def main(argv: list[str] | None = None) -> int:
    import torch

    from services.kv_layout import kv_layout
    from worker_svc.execution.memory import kv_block_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    bs = args.block_size
    print(
        "| model | context | KV dtype | one table: pages x layers, MiB | KV groups: pages x layers, MiB "
        "| one table / groups |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for name, (layers, pattern, window, kv_heads, head_dim) in SHAPES.items():
        layout = kv_layout([None if (i + 1) % pattern == 0 else window for i in range(layers)])
        for tokens in (8192, 32768):
            one = pages_held(tokens, bs, (0,))
            grouped = pages_held(tokens, bs, layout.windows)
            for dtype in (torch.float32, torch.bfloat16):
                layer_block = kv_block_bytes(1, bs, kv_heads, head_dim, dtype)
                one_bytes, grouped_bytes = one * layers * layer_block, grouped * layout.layers_per_page * layer_block
                print(
                    f"| {name} | {tokens} | {str(dtype).split('.')[-1]} | {one} x {layers}, "
                    f"{one_bytes / 2**20:.0f} | {grouped} x {layout.layers_per_page} ({layout.num_groups} groups), "
                    f"{grouped_bytes / 2**20:.0f} | {one_bytes / grouped_bytes:.2f}x |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
