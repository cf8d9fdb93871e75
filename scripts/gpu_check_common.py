"""What scripts/gpu_check.py's parts share: the device a part runs on, its environment, the
failure that carries a part's figures, a timer, a paged batch for the attention kernels and a
greedy driver for one stage (PP=1). Imports torch and worker_svc only inside its functions,
so that the driver can choose Triton's mode before anything imports triton.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


class CheckFailed(Exception):
    """A part ran but its figures miss a bound; carries what it measured."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "grpc_imported": "grpc" in sys.modules,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_count=torch.cuda.device_count(),
        )
    return env


def device_for(smoke: bool):
    import torch

    from worker_svc.execution.device import resolve_device

    torch.manual_seed(0)
    if smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        return resolve_device("cpu")
    return resolve_device("cuda")  # ValueError, naming the cause, where there is none


def check_no_grpc() -> None:
    if "grpc" in sys.modules:
        raise RuntimeError("a worker_svc module imported grpc: the GPU image may not have it")


def timed(fn, iterations: int, device) -> float:
    """Mean seconds per call (after one warm-up call)."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iterations
    started = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - started) / iterations


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- a paged batch for the attention kernels ------------------------------------------------


def paged_batch(device, chunks, block_size, num_heads, num_kv_heads, head_dim, dtype, shuffle=True, seed=0):
    """A flattened batch over a paged pool: chunks are (num_new, context_len) per sequence.

    Returns q, k_pool, v_pool (random everywhere), the new tokens' k and v, and metadata.
    Each sequence's blocks are a random (or consecutive) set of the pool's blocks.
    """
    import torch

    from worker_svc.kernels.attention import AttentionMetadata

    g = torch.Generator(device=device).manual_seed(seed)
    needed = [-(-ctx // block_size) for _, ctx in chunks]
    num_blocks = sum(needed) + 1
    order = (
        torch.randperm(num_blocks, device=device, generator=g) if shuffle else torch.arange(num_blocks, device=device)
    )
    max_blocks = max(needed)
    table = torch.zeros((len(chunks), max_blocks), dtype=torch.long, device=device)
    slots, starts, first = [], [0], 0
    for i, ((num_new, ctx), n) in enumerate(zip(chunks, needed, strict=True)):
        table[i, :n] = order[first : first + n]
        first += n
        pos = torch.arange(ctx - num_new, ctx, device=device)
        slots.append(table[i, pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + num_new)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.empty(size, device=device, dtype=dtype).normal_(generator=g)

    context_lens = tuple(ctx for _, ctx in chunks)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        block_tables=table,
        query_start_loc_list=tuple(starts),
        context_lens_list=context_lens,
    )
    num_tokens = starts[-1]
    return (
        rand(num_tokens, num_heads, head_dim),
        rand(*shape),
        rand(*shape),
        rand(num_tokens, num_kv_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        metadata,
    )


# --- a greedy driver for one stage (PP=1) --------------------------------------------------


class GreedyBatch:
    """Drives one StageRunner (the whole model) over a batch: chunked prefill, then decode.

    Sequence i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq).
    """

    def __init__(self, runner, prompts: list[list[int]], blocks_per_seq: int) -> None:
        from services.sampling import SamplingParams

        self.runner = runner
        self.prompts = prompts
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
        self.logits: list[list[Any]] = [[] for _ in prompts]  # per sampled step, when kept
        self.greedy = SamplingParams(temperature=0.0)
        self._step = 0

    def outputs(self) -> list[list[int]]:
        return [t[len(p) :] for t, p in zip(self.tokens, self.prompts, strict=True)]

    def step(self, chunk: int, keep_logits: bool = False) -> int:
        """One forward pass over every sequence; returns the number of tokens it computed."""
        from services.step import CachedSeq, NewSeq, StepPlan

        new, cached = [], []
        for i, t in enumerate(self.tokens):
            n = min(len(t) - self.computed[i], chunk)
            if self.computed[i] == 0:  # sent whole once; the stage keeps its tokens and table
                new.append(NewSeq(i, tuple(t), len(self.prompts[i]), 0, n, self.tables[i], self.greedy, 0, i))
            else:
                cached.append(CachedSeq(i, n, len(self.tables[i])))
            self.computed[i] += n
        plan = StepPlan(self._step, tuple(new), tuple(cached))
        result = self.runner.execute(plan, keep_logits=keep_logits)
        self._step += 1
        for row, (seq_id, token) in enumerate(zip(result.sampled_seq_ids, result.sampled.token_ids, strict=True)):
            self.tokens[seq_id].append(token)
            if keep_logits:
                self.logits[seq_id].append(result.logits[row].float().cpu())
        return plan.num_tokens
