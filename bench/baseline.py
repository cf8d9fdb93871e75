"""The `transformers` static-batching baseline: padded `generate` in fixed batches.

How a user without a server batches: take the requests in order, `batch_size` at a time, and
call `model.generate` on each batch; the next batch starts when the whole batch is done.
To make the output token counts exact and the comparison fair to the baseline, requests are
grouped by (prompt length, max_tokens) first, so no batch pads or generates past what any of
its requests asked for, and each batch runs with `min_new_tokens = max_new_tokens` (EOS
cannot end it early), greedy, on the same token ids as the Pagoda arms.

Per request, the record reads as a closed loop with `batch_size` clients would see it: sent
when its batch started, one chunk per generated token (timed by a logits processor, which
transformers calls once per step), done when its batch finished.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.load import LoadResult
from bench.stats import RequestRecord
from bench.workloads import BenchRequest


def static_batches(requests: Sequence[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Requests grouped by (prompt length, max_tokens) in order of first appearance, then cut
    into batches of `batch_size` in request order."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    groups: dict[tuple[int, int], list[BenchRequest]] = {}
    for r in requests:
        groups.setdefault((r.num_prompt_tokens, r.max_tokens), []).append(r)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


@dataclass(frozen=True)
class BaselineInfo:
    transformers_version: str
    torch_threads: int
    batch_size: int
    num_batches: int
    load_s: float


def run_transformers(
    model_dir: str, requests: Sequence[BenchRequest], batch_size: int, threads: int
) -> tuple[LoadResult, BaselineInfo]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Notes when each step's logits are ready (one call per generated token)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        load_s = time.perf_counter() - t0
        batches = static_batches(requests, batch_size)
        # one untimed warm-up call, as the server arms get
        with torch.inference_mode():
            model.generate(
                torch.tensor([list(requests[0].prompt_ids)]),
                max_new_tokens=2,
                min_new_tokens=2,
                do_sample=False,
                pad_token_id=pad_id,
            )
        records: list[RequestRecord] = []
        started = time.perf_counter()
        for batch in batches:
            n = batch[0].max_tokens
            input_ids = torch.tensor([list(r.prompt_ids) for r in batch])  # [batch, prompt_len]
            clock = StepClock()
            sent = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=pad_id,
                    logits_processor=LogitsProcessorList([clock]),
                )
            done = time.perf_counter()
            generated = out.shape[1] - input_ids.shape[1]
            for r in batch:
                records.append(
                    RequestRecord(
                        r.index,
                        r.kind,
                        r.num_prompt_tokens,
                        r.max_tokens,
                        sent,
                        chunk_times=list(clock.times),
                        num_output_tokens=generated,
                        done_s=done,
                    )
                )
        ended = time.perf_counter()
    finally:
        torch.set_num_threads(previous_threads)
    records.sort(key=lambda r: r.index)
    info = BaselineInfo(transformers.__version__, threads, batch_size, len(batches), load_s)
    return LoadResult(records, started, ended, ended, "static-batch", concurrency=batch_size), info
