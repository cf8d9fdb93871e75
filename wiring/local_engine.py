"""The in-process engine: the scheduler's engine driving in-process stage runners and the
in-process KV manager, with no gRPC at all.

One process, for offline batch generation from Python (`LLM.generate`, as users of vLLM's
offline `LLM` class expect) and as the baseline that prices the microservice boundaries.
The transports differ; the scheduling code is the one in `scheduler_svc.engine`.
It lives in `services/` so that `scheduler_svc` never imports `worker_svc` or torch.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from kvcache_svc.client import InProcessKVCacheClient
from kvcache_svc.core import KVCacheManager
from kvcache_svc.core.tier import tier_for
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.request import Request, SamplingOptions
from scheduler_svc.engine import Engine
from scheduler_svc.events import ErrorEvent, StageInfo
from scheduler_svc.outputs import RequestOutput
from services.defaults import NUM_KV_BLOCKS
from services.pooling import PoolingType, embedding_values
from services.step import StageTiming, StepPlan


class LocalStageTransport:
    """Runs every stage's runner in turn on one worker thread, micro-batches in order."""

    def __init__(self, runners: list) -> None:
        self.runners = runners
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-stages")
        self._on_event: Callable[[object], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.busy_ns = [0] * len(runners)

    async def connect(self, on_event, timeout_s: float = 30.0) -> list[StageInfo]:
        self._on_event = on_event
        self._loop = asyncio.get_running_loop()
        n = len(self.runners)
        return [
            StageInfo(
                stage_index=i,
                num_stages=n,
                epoch=1,
                layer_start=r.model.start,
                layer_end=r.model.end,
                num_layers=r.model.config.num_layers,
                num_kv_blocks=r.num_blocks,
                block_size=r.block_size,
                vocab_size=r.model.config.vocab_size,
                address="in-process",
                feedback=n > 1,
                device=r.device_name,
            )
            for i, r in enumerate(self.runners)
        ]

    async def submit(self, plan: StepPlan) -> None:
        self._executor.submit(self._run, plan)

    def _run(self, plan: StepPlan) -> None:
        hidden, result, timings = None, None, []
        try:
            for i, runner in enumerate(self.runners):
                result = runner.execute(plan, hidden)
                hidden = result.hidden
                self.busy_ns[i] += result.compute_ns
                timings.append(StageTiming(i, 0, 0, result.compute_ns))
            if len(self.runners) > 1 and result.sampled is not None:  # the last stage feeds the first
                self.runners[0].batch.feed(
                    zip(result.sampled_seq_ids, result.sampled_positions, result.sampled.token_ids, strict=True)
                )
            event = result.step_result(tuple(timings))
        except ValueError as exc:  # InvalidPlanError: a scheduler bug, reported like a stage would
            event = ErrorEvent(plan.step_id, len(timings), "INVALID_ARGUMENT", str(exc))
        except Exception as exc:
            event = ErrorEvent(plan.step_id, len(timings), "INTERNAL", f"{type(exc).__name__}: {exc}")
        self._loop.call_soon_threadsafe(self._on_event, event)

    async def abandon(self, seq_ids: list[int]) -> None:
        """Nothing waits here: steps run one after another, a missing token fails the step."""

    async def stage_stats(self, timeout_s: float = 1.0) -> list[dict]:
        return [
            {"stage_index": i, "address": "in-process", "healthy": True, "busy_ns": b}
            for i, b in enumerate(self.busy_ns)
        ]

    async def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)
        for runner in self.runners:
            if getattr(runner, "kv_tier", None) is not None:
                runner.kv_tier.close()  # its files go with it


def build_local_engine(
    model_dir: str,
    config: SchedulerConfig,
    num_kv_blocks: int = NUM_KV_BLOCKS,
    dtype: str = "auto",
    device: str | None = None,
    attention_backend: str | None = None,
) -> Engine:
    """Every part in this process: KV manager, scheduler engine, stage runners (with the
    stage processes' malloc settings: `worker_svc.kernels.cpu_kernels.keep_freed_memory`); with
    `device` "emulated:PROFILE", emulated stages (worker_svc/execution/emulated.py): no weights."""
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.config import WorkerConfig, emulated_profile_spec
    from worker_svc.execution.device import default_attention_backend, resolve_device
    from worker_svc.execution.emulated import build_emulated_runner
    from worker_svc.execution.runner import StageRunner
    from worker_svc.kernels.cpu_kernels import keep_freed_memory
    from worker_svc.models.registry import load_config

    keep_freed_memory()
    n = config.pipeline_parallel_size
    if emulated_profile_spec(device) is not None:  # no weights: each stage's step is a wait
        runners = [
            build_emulated_runner(
                WorkerConfig(
                    model=model_dir,
                    stage=k,
                    num_stages=n,
                    next_address=None if k == n - 1 else "in-process",
                    num_kv_blocks=num_kv_blocks,
                    block_size=config.block_size,
                    dtype=dtype,
                    device=device,
                )
            )
            for k in range(n)
        ]
    else:
        dev = resolve_device(device)
        attention_backend = attention_backend or default_attention_backend(dev)
        from worker_svc.execution.drafter import drafter_for

        runners = []
        for k in range(n):
            model = load_stage(model_dir, k, n, dtype=dtype, device=dev)
            drafter = drafter_for(
                config.speculative_config,
                is_last=k == n - 1,
                vocab_size=model.config.vocab_size,
                max_model_len=config.max_model_len,
                num_blocks=num_kv_blocks,
                block_size=config.block_size,
                dtype=next(model.parameters()).dtype,
                device=dev,
                backend=attention_backend,
            )
            layout = model.kv_layout if model.kv_layout.grouped else None
            runners.append(
                StageRunner(model, num_kv_blocks, config.block_size, attention_backend, drafter=drafter, layout=layout)
            )
            _attach_kv_tier(runners[-1], model_dir, k, n, config.kv_offload)
    model_config = load_config(model_dir)
    layout = model_config.kv_layout
    kv = InProcessKVCacheClient(
        KVCacheManager(
            num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            group_windows=layout.windows,
            tier=tier_for(config.kv_offload),
        )
    )
    config = replace(config, kv_groups=layout.spec())
    return Engine(config, kv, LocalStageTransport(runners), eos_token_ids=model_config.eos_token_ids)


def _attach_kv_tier(runner, model_dir: str, stage: int, num_stages: int, kv_offload: str) -> None:
    """Each stage's part of the KV tier (`--kv-offload`, in blocks), as a stage process makes it."""
    if not kv_offload:
        return
    from worker_svc.config import WorkerConfig
    from worker_svc.service.loading import attach_kv_tier

    next_address = None if stage == num_stages - 1 else "in-process"
    config = WorkerConfig(
        model=model_dir, stage=stage, num_stages=num_stages, next_address=next_address, kv_offload=kv_offload
    )
    attach_kv_tier(runner, config)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    # with SamplingOptions.logprobs: per token, (its logprob, [(id, logprob) most likely first])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # with SamplingOptions.prompt_logprobs: per prompt token after the first,
    # (token id, logprob, rank, [(id, logprob) most likely first])
    prompt_logprobs: list | None = None


@dataclass
class EmbeddingOutput:
    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]  # pooled and L2-normalized (services.pooling)
    num_cached_tokens: int = 0


class LLM:
    """Offline batch generation in one process, as vLLM's `LLM` class offers it.

    llm = LLM("/models/tiny")
    outs = llm.generate(["Hello"], SamplingOptions(max_tokens=16, temperature=0))
    vectors = llm.embed(["Hello"])  # pooled final hidden states, as vLLM's LLM.embed
    """

    def __init__(self, model: str, **config_fields) -> None:
        num_kv_blocks = config_fields.pop("num_kv_blocks", NUM_KV_BLOCKS)
        dtype = config_fields.pop("dtype", "auto")
        device = config_fields.pop("device", None)
        from wiring.model_source import is_gguf, prepare_gguf

        if is_gguf(model):  # a GGUF file: its prepared folder (wiring/model_source.py)
            model = str(prepare_gguf(model))
        # one process: the stages' thread and the planner share the GIL, so planning ahead
        # does not overlap compute here (in-process async measured 0.96x of sync)
        config_fields.setdefault("async_scheduling", False)
        self.model = model
        self.config = SchedulerConfig(model=model, num_kv_blocks=num_kv_blocks, **config_fields)
        self._engine_args = (num_kv_blocks, dtype, device)
        self._tokenizer = None
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from services.text import Tokenizer

            self._tokenizer = Tokenizer(self.model)
        return self._tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        sampling: SamplingOptions | Sequence[SamplingOptions] | None = None,
        detokenize: bool = True,
    ) -> list[GenerationOutput]:
        """Outputs in the order of `prompts` (text, or lists of token ids)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        token_prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if sampling is None or isinstance(sampling, SamplingOptions):
            sampling = [sampling or SamplingOptions()] * len(token_prompts)
        return asyncio.run(self._generate(token_prompts, list(sampling), detokenize))

    def embed(
        self, prompts: Sequence[str] | Sequence[Sequence[int]] | str, pooling: PoolingType = PoolingType.LAST
    ) -> list[EmbeddingOutput]:
        """Each prompt's final hidden states pooled (`pooling`) and L2-normalized, computed
        like any prompt (batched, chunked) through the same engine, in the order of `prompts`."""
        if isinstance(prompts, str):
            prompts = [prompts]
        token_prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        requests = [
            Request(self._request_id(), tuple(p), SamplingOptions(max_tokens=1), arrival_s=0.0, pooling=pooling)
            for p in token_prompts
        ]
        outputs = []
        for request, (_, final) in zip(requests, asyncio.run(self._run(requests)), strict=True):
            if final.error is not None or final.embedding is None:
                raise RuntimeError(f"request {request.request_id} failed: {final.error}")
            outputs.append(
                EmbeddingOutput(
                    request.request_id, list(request.prompt), embedding_values(final.embedding), final.num_cached_tokens
                )
            )
        return outputs

    def _request_id(self) -> str:
        return f"offline-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    async def _run(self, requests: list[Request]) -> list[tuple[dict, RequestOutput]]:
        """Every request through a fresh in-process engine: each one's choices and last output."""
        engine = build_local_engine(self.model, self.config, *self._engine_args)
        await engine.start()
        try:
            streams = [engine.submit(r) for r in requests]
            return await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            await engine.stop()

    async def _generate(self, prompts, sampling, detokenize: bool) -> list[GenerationOutput]:
        requests = [
            Request(self._request_id(), tuple(p), s, arrival_s=0.0) for p, s in zip(prompts, sampling, strict=True)
        ]
        results = await self._run(requests)
        outputs = []
        for request, (choices, final) in zip(requests, results, strict=True):
            if final.error is not None:
                raise RuntimeError(f"request {request.request_id} failed: {final.error[1]}")
            completions = []
            for index in sorted(choices):
                ids, reason, logprobs = choices[index]
                text = self.tokenizer.decode(ids) if detokenize else None
                completions.append(
                    CompletionOutput(
                        index, ids, text, reason, logprobs if request.options.logprobs is not None else None
                    )
                )
            outputs.append(
                GenerationOutput(
                    request.request_id,
                    list(request.prompt),
                    completions,
                    final.num_cached_tokens,
                    final.num_preemptions,
                    final.prompt_logprobs,
                )
            )
        return outputs


async def _collect(stream) -> tuple[dict[int, tuple[list[int], str | None, list]], RequestOutput]:
    """Per choice (token ids, finish reason, logprob infos), and the request's last output."""
    choices: dict[int, tuple[list[int], str | None, list]] = {}
    final, prompt_logprobs = None, None
    async for out in stream:
        if out.prompt_logprobs is not None:
            prompt_logprobs = out.prompt_logprobs
        for d in out.deltas:
            ids, reason, logprobs = choices.get(d.index, ([], None, []))
            ids.extend(d.token_ids)
            logprobs.extend(lp for lp in d.logprobs if lp is not None)
            if d.finish_reason is not None:
                reason = d.finish_reason.value
            choices[d.index] = (ids, reason, logprobs)
        final = out
    if final is not None and final.prompt_logprobs is None:
        final.prompt_logprobs = prompt_logprobs
    return choices, final
