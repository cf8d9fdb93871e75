"""The emulated device (`--device emulated:PROFILE`): a stage that does everything but compute.

An `EmulatedRunner` stands where a `StageRunner` stands, in the stage's servicer and in the
in-process engine. It receives and validates plans, keeps the persistent batch and its block
tables (`worker_svc.execution.batch`), hands hidden states of the model's real size to the next stage
(zeros, in the configured dtype), and on the last stage samples, feeds tokens back and
reports timings as any stage does. What it does not do:

- Compute. The forward pass is a wait of `DeviceProfile.step_time_s` for the step's shape
  (`StepShape`: prefill tokens, decode rows, context tokens read) over this stage's share of
  the layers. The wait is `time.sleep` on the stage's compute thread, where the forward pass
  runs today: the thread sleeps in the kernel (clock_nanosleep) with the GIL released, so it
  spends no CPU and the event loop keeps receiving the next micro-batch and sending the last
  one; it wakes within tens of microseconds, where an asyncio timer rounds up to a millisecond.
  A profile whose device is this machine's own CPU (`host_compute`, as `cpu-local`) computes
  for the step's time instead (`compute_for`), so the other services meet the contention the
  real stage would make.
- Load weights. config.json is the whole model (the gateway still wants a tokenizer).
- Hold KV memory. No tensor is allocated for the pool; the KV service does the block
  accounting as always and the batch keeps the block tables (block copies are validated,
  then have nothing to copy). The pool's size is what the stage is told (`--num-kv-blocks`,
  or `--kv-cache-memory` over what a real block of these layers would take). P/D
  disaggregation's transfers move no bytes either: a decode stage's pull waits the time the
  profile's KV link takes (`kv_transfer_bytes_per_s`, worker_svc/service/kv_transfer.py) and
  keeps the keys (`--kv-import-blocks`: worker_svc/execution/emulated_kv.py), which the plan's
  TIER_LOADs take; no host or disk tier is modelled (`--kv-offload` is refused).
- Sample from logits. `EmulatedSampler` draws a pseudo-random token per (seed, choice,
  output position) from the emulated model's distribution: EOS with the profile's
  probability, every other token equally likely.

It always says that it is emulated: its device is `emulated:<profile name>` in LoadInfo,
Health and the stage's metrics, and from there in the scheduler's statistics, the gateway's
/health, /metrics and dashboard, and the bench tables.
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.sampling import SamplingParams
from services.step import PooledOutput, PositionLogprobs, ScoredPrompt, StepPlan
from worker_svc.config import EMULATED_PREFIX, WorkerConfig
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.batch import PersistentBatch, Row, SeqState, StageShape
from worker_svc.execution.counter_rng import row_key
from worker_svc.execution.emulated_kv import EmulatedKVTier
from worker_svc.execution.memory import kv_block_bytes
from worker_svc.execution.pooler import normalized_bytes
from worker_svc.execution.runner import StageResult, check_stage_inputs
from worker_svc.execution.sampler_types import SamplerOutput
from worker_svc.model_config import ModelConfig
from worker_svc.models.registry import load_config

if TYPE_CHECKING:
    from services.device_profile import DeviceProfile

# a logprob of a token the emulated model never draws (as vLLM reports -inf: JSON has no inf)
NEVER_LOGPROB = -9999.0
_INV_2_32 = 2.0**-32


@dataclass(frozen=True)
class StepShape:
    """What a step's emulated time depends on. A decode row computes one token past its
    prompt; every other row's tokens are prefill tokens (prompt chunks, recompute after
    preemption). Context tokens: the KV positions the step's attention reads, each row's
    context length (its tokens so far and the ones it computes now), summed. Sampled rows:
    those whose last position the LM head computes (the last stage's share of the step)."""

    num_prefill_tokens: int
    num_decode_rows: int
    num_context_tokens: int
    num_sampled_rows: int = 0

    @classmethod
    def of(cls, rows: Iterable[Row]) -> StepShape:
        prefill = decode = context = sampled = 0
        for r in rows:
            if r.num_tokens == 1 and r.start >= r.state.prompt_len:
                decode += 1
            else:
                prefill += r.num_tokens
            context += r.context_len
            sampled += bool(r.sample)
        return cls(prefill, decode, context, sampled)


@dataclass(frozen=True)
class EmulatedSlice:
    """A stage's layers `[start, end)` as an emulated device holds them: the shape, no weights."""

    config: ModelConfig
    start: int
    end: int
    is_first: bool
    is_last: bool
    source_dir: str = ""
    weight_format: str = ""

    @property
    def num_local_layers(self) -> int:
        return self.end - self.start

    @property
    def layer_fraction(self) -> float:
        """This stage's share of the model's layers, as the profile scales a whole model's step."""
        return self.num_local_layers / self.config.num_layers


@dataclass(frozen=True)
class EmulatedDistribution:
    """The emulated model's next-token distribution, which its logprobs report: each EOS id
    with `eos_probability / len(eos_token_ids)`, every other token of the vocabulary equally
    likely. (As with real logits, what a request masks, min_tokens or ignore_eos, changes what
    is drawn, not the reported logprobs.)"""

    vocab_size: int
    eos_token_ids: tuple[int, ...]  # distinct, sorted, inside the vocabulary
    eos_probability: float

    @classmethod
    def of(cls, vocab_size: int, eos_token_ids: Iterable[int], eos_probability: float) -> EmulatedDistribution:
        eos = tuple(sorted({t for t in eos_token_ids if 0 <= t < vocab_size}))
        return cls(vocab_size, eos, eos_probability if eos else 0.0)

    @property
    def eos_logprob(self) -> float:
        n = len(self.eos_token_ids)
        return _log(self.eos_probability / n) if n else NEVER_LOGPROB

    @property
    def other_logprob(self) -> float:
        n = self.vocab_size - len(self.eos_token_ids)
        return _log((1.0 - self.eos_probability) / n) if n else NEVER_LOGPROB

    def logprob(self, token_id: int) -> float:
        return self.eos_logprob if token_id in self.eos_token_ids else self.other_logprob

    def rank(self, token_id: int) -> int:
        """1 + how many tokens are strictly more likely."""
        if token_id in self.eos_token_ids:
            return 1 if self.eos_logprob >= self.other_logprob else 1 + self.vocab_size - len(self.eos_token_ids)
        return 1 if self.other_logprob >= self.eos_logprob else 1 + len(self.eos_token_ids)

    def top(self, n: int) -> list[tuple[int, float]]:
        """The `n` most likely (token id, logprob), most likely first, ties by id."""
        if n <= 0:
            return []
        others = []
        for t in range(self.vocab_size):
            if len(others) == n:
                break
            if t not in self.eos_token_ids:
                others.append(t)
        candidates = [(t, self.logprob(t)) for t in (*self.eos_token_ids, *others)]
        return sorted(candidates, key=lambda c: (-c[1], c[0]))[:n]


def _log(p: float) -> float:
    return math.log(p) if p > 0 else NEVER_LOGPROB


class EmulatedSampler:
    """Draws each sampled row's token without logits, deterministically per (seed, choice,
    output position), hashed through the real sampler's counter-based key
    (`worker_svc.execution.counter_rng.row_key`). The seed is the sequence's entropy seed (drawn from its
    request id and choice at admission); a request with a seed (`SamplingParams.seed`) uses
    that seed mixed with a fingerprint of its prompt (`seed_of`), so that it draws the same
    tokens on every run while requests that share a seed but not a prompt do not (a load
    that seeds every request alike still gets varied lengths, as a model's logits would give).
    So a choice draws the same tokens whatever batch, row or pipeline split it lands in, and
    again after preemption and recompute.

    One uniform of the key decides EOS (probability `eos_probability`; never while fewer than
    `min_tokens` tokens exist, never with `ignore_eos`), the other picks the token: one of the
    EOS ids, or one uniform over the vocabulary without the EOS ids (nor, below min_tokens,
    the stop ids). Temperature, top-k/p, penalties, logit bias and grammars are not applied:
    the emulated model has no logits for them to shape."""

    def __init__(self, vocab_size: int, eos_probability: float) -> None:
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError(f"eos_probability: must be in [0, 1], got {eos_probability}")
        self.vocab_size = vocab_size
        self.eos_probability = eos_probability
        self._seeds: dict[int, int] = {}  # seeded sequences' seed_of, until released

    def release(self, plan: StepPlan) -> None:
        """Forget what the plan drops: everything on a reset, finished sequences, and the
        state under ids it sends whole (the compute thread calls it before applying the plan)."""
        if plan.reset:
            self._seeds.clear()
        for seq_id in (*plan.finished_seq_ids, *(n.seq_id for n in plan.new_seqs)):
            self._seeds.pop(seq_id, None)

    def seed_of(self, state: SeqState) -> int:
        """The seed a sequence draws with (class docstring): its entropy seed, or its request's
        seed mixed with its prompt's fingerprint (computed once per sequence)."""
        seed = state.sampling.seed
        if seed is None:
            return state.entropy_seed
        known = self._seeds.get(state.seq_id)
        if known is None:
            prompt = array("I", state.token_ids[: state.prompt_len]).tobytes()
            digest = hashlib.blake2b(prompt, digest_size=8, key=seed.to_bytes(8, "little")).digest()
            known = self._seeds[state.seq_id] = int.from_bytes(digest, "little")
        return known

    def distribution(self, params: SamplingParams) -> EmulatedDistribution:
        return EmulatedDistribution.of(self.vocab_size, params.eos_token_ids, self.eos_probability)

    def draw(self, params: SamplingParams, seed: int, choice_index: int, output_position: int) -> int:
        key_a, key_b = row_key(seed, choice_index, output_position)
        eos = self.distribution(params).eos_token_ids
        masked = output_position < params.min_tokens
        if eos and not params.ignore_eos and not masked and (key_a + 0.5) * _INV_2_32 < self.eos_probability:
            return eos[key_b % len(eos)]
        excluded = set(eos)
        if masked:
            excluded.update(t for t in params.stop_token_ids if t < self.vocab_size)
        token = (key_b * (self.vocab_size - len(excluded))) >> 32  # uniform over what is left
        for skipped in sorted(excluded):  # the token-th id that is not excluded
            if token < skipped:
                break
            token += 1
        return token

    def sample(self, states: list[SeqState]) -> SamplerOutput:
        """One token per state (its next output position), with logprobs where asked."""
        tokens, logprobs, tops = [], [], []
        for s in states:
            params = s.sampling
            token = self.draw(params, self.seed_of(s), s.choice_index, s.num_output_tokens)
            tokens.append(token)
            if params.num_logprobs is None:
                logprobs.append(None)
                tops.append(None)
                continue
            dist = self.distribution(params)
            logprobs.append(dist.logprob(token))
            tops.append(dist.top(params.num_logprobs))
        return SamplerOutput(tokens, logprobs, tops)

    def score(self, rows: list[Row]) -> list[ScoredPrompt]:
        """Prompt logprobs of the rows that score their prompt, under the same distribution."""
        out = []
        for r in rows:
            p = r.prompt_scoring
            dist = self.distribution(r.state.sampling)
            top = dist.top(p.num_top)
            positions = tuple(PositionLogprobs(t, dist.logprob(t), dist.rank(t), top) for t in p.targets)
            out.append(ScoredPrompt(r.seq_id, p.first_position, positions))
        return out


class EmulatedRunner:
    """Executes micro-batch plans as `StageRunner` does, its forward pass a wait of the
    profile's step time (module docstring). Owned by the stage's compute thread."""

    def __init__(
        self,
        model: EmulatedSlice,
        profile: DeviceProfile,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        tensor_parallel_size: int = 1,
        sleep: Callable[[float], None] = time.sleep,
        import_blocks: int = 0,  # P/D: the import area's bound (--kv-import-blocks; 0: none)
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        config = model.config
        self.model = model
        self.profile = profile
        self.tensor_parallel_size = tensor_parallel_size
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = self.kv_dtype = dtype
        self.device = torch.device("cpu")  # where the zeros it hands on live
        self.device_name = f"{EMULATED_PREFIX}{profile.name}"
        self.weights_bytes = self.expert_weights_bytes = 0  # none loaded
        self.kv_block_bytes = device_block_bytes(model, block_size, dtype, tensor_parallel_size)
        self.sampler = EmulatedSampler(config.vocab_size, profile.eos_probability) if model.is_last else None
        self.batch = PersistentBatch(
            StageShape(
                is_first=model.is_first,
                is_last=model.is_last,
                num_blocks=num_blocks,
                block_size=block_size,
                max_positions=config.max_position_embeddings,
                vocab_size=config.vocab_size,
                kv_windows=config.kv_layout.windows,
            )
        )
        self._sleep = sleep
        self._zeros = torch.zeros(0, config.hidden_size, dtype=dtype)  # never written: shared by every step
        # P/D: the pulled blocks' keys, which the plans' TIER_LOADs take (emulated_kv.py)
        self.kv_tier = EmulatedKVTier(num_blocks, import_blocks) if import_blocks else None
        self.emulated_s = 0.0  # the waits so far

    def step_time_s(self, shape: StepShape) -> float:
        """The profile's time for a step of this shape on this stage's layers."""
        return self.profile.step_time_s(
            layer_fraction=self.model.layer_fraction,
            num_prefill_tokens=shape.num_prefill_tokens,
            num_decode_rows=shape.num_decode_rows,
            num_context_tokens=shape.num_context_tokens,
            tensor_parallel_size=self.tensor_parallel_size,
            is_last_stage=self.model.is_last,
            num_sampled_rows=shape.num_sampled_rows,
        )

    def execute(self, plan: StepPlan, hidden: torch.Tensor | None = None, keep_logits: bool = False) -> StageResult:
        """Validate the plan whole, apply it to the batch, wait the step's time, then hand on
        zeros (not last) or draw the samples (last). `keep_logits`: there are none."""
        check_stage_inputs(plan, hidden, self.model.is_first, self.model.config.hidden_size)
        self._check_tier_ops(plan)
        started = time.perf_counter_ns()
        rows = self.batch.apply(plan)  # validates the plan whole before it changes anything
        if self.sampler is not None:
            self.sampler.release(plan)
        if self.kv_tier is not None:
            if plan.reset:
                self.kv_tier.clear()
            if plan.tier_ops:  # a LOAD of a key not held raises TierMissError: the step fails
                self.kv_tier.apply(plan.tier_ops)
        wait_s = max(0.0, self.step_time_s(StepShape.of(rows)))
        self._sleep(wait_s)  # the forward pass: no CPU (module docstring)
        self.emulated_s += wait_s
        result = StageResult(plan.step_id, rows=rows)
        if not self.model.is_last:
            result.hidden = self._hidden(plan.num_tokens)
        else:
            self._finish_last(rows, result)
        result.compute_ns = time.perf_counter_ns() - started
        return result

    def _check_tier_ops(self, plan: StepPlan) -> None:
        """InvalidPlanError for tier ops this stage cannot carry out (as a real stage with no
        tier): any without an import area; SAVE and DEMOTE always (emulated_kv.py)."""
        if not plan.tier_ops:
            return
        if self.kv_tier is None:
            raise InvalidPlanError(
                f"micro-batch {plan.step_id} moves KV blocks to or from a KV tier, but this emulated stage "
                "has no import area (--kv-import-blocks)"
            )
        self.kv_tier.check(plan.tier_ops, plan.step_id)

    def _hidden(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens, hidden_size] zeros in the stage's dtype: the model's output as far as
        its size goes (the sender encodes and sends every byte of it)."""
        if self._zeros.shape[0] < num_tokens:
            self._zeros = torch.zeros(num_tokens, self.model.config.hidden_size, dtype=self.dtype)
        return self._zeros[:num_tokens]

    def _finish_last(self, rows: list[Row], result: StageResult) -> None:
        sampled = [r for r in rows if r.sample]
        result.sampled_seq_ids = tuple(r.seq_id for r in sampled)
        result.sampled_positions = tuple(r.known_end for r in sampled)  # (drafts: none kept)
        result.sampled = self.sampler.sample([r.state for r in sampled])
        result.prompt_logprobs = self.sampler.score([r for r in rows if r.prompt_scoring is not None])
        done = [r for r in rows if r.pool_done]
        if done:  # a pooling sequence's vector: any fixed unit vector
            unit = normalized_bytes(torch.ones(self.model.config.hidden_size))
            result.pooled = [PooledOutput(r.seq_id, unit) for r in done]
        self.batch.record_sampled(rows, [[t] for t in result.sampled.token_ids])


def device_block_bytes(model: EmulatedSlice, block_size: int, dtype: torch.dtype, tensor_parallel_size: int) -> int:
    """What one KV block of these layers would take on one device of the stage (a
    tensor-parallel rank holds its share of the KV heads, at least one), though none is
    allocated."""
    config = model.config
    num_kv_heads = max(1, config.num_kv_heads // tensor_parallel_size)
    return kv_block_bytes(model.num_local_layers, block_size, num_kv_heads, config.head_dim, dtype)


def emulated_tensor_parallel_size(configured: int, profile: DeviceProfile) -> int:
    """The tensor-parallel size to emulate: `--tensor-parallel-size` when given (above 1),
    else the one the profile's costs were made for (`a100-80gb-llama2-70b-tp8`: 8)."""
    return configured if configured > 1 else profile.tensor_parallel_size


def emulated_num_blocks(config: WorkerConfig, block_bytes: int) -> int:
    """The pool an emulated stage holds: `--num-kv-blocks` (or the default), else as many of
    `block_bytes` as `--kv-cache-memory` holds. MemoryError when a count given with it does
    not fit, or none does."""
    if config.kv_cache_memory is None:
        return config.fixed_num_kv_blocks
    fits = config.kv_cache_memory // block_bytes
    if fits < 1 or (config.num_kv_blocks is not None and config.num_kv_blocks > fits):
        raise MemoryError(
            f"stage {config.stage}: --kv-cache-memory {config.kv_cache_memory} holds {fits} "
            f"blocks of {block_bytes} bytes (emulated), fewer than the pool needs"
        )
    return config.num_kv_blocks if config.num_kv_blocks is not None else fits


def compute_for(seconds: float) -> None:
    """Keep this thread's core busy for `seconds` (a profile with `host_compute`: the device is
    this machine's CPU): small matrix products, each of which releases the GIL as the real
    stage's do, until the time is up."""
    end = time.perf_counter() + seconds
    a = torch.ones(48, 48)
    while time.perf_counter() < end:
        torch.mm(a, a)


def build_emulated_runner(config: WorkerConfig, sleep: Callable[[float], None] = time.sleep) -> EmulatedRunner:
    """The stage `config` describes, on the emulated device it names: config.json read, no
    weights, no KV tensors. ValueError for an unknown profile, a layer split that does not fit,
    or a KV tier (`--kv-offload`).
    A profile of this machine's CPU (`host_compute`) computes for the step's time instead of
    sleeping (`compute_for`)."""
    from services.device_profile import load_profile
    from worker_svc.checkpoints.stage_setup import partition_layers, resolve_dtype

    spec = config.emulated_profile
    if spec is None:
        raise ValueError(f"device: {config.device!r} is not an emulated device ({EMULATED_PREFIX}PROFILE)")
    if config.kv_offload:
        raise ValueError(
            "kv_offload: an emulated device models no KV tier below its pool (only P/D's import area, "
            "--kv-import-blocks)"
        )
    profile = load_profile(spec)
    if profile.host_compute and sleep is time.sleep:
        sleep = compute_for
    model_config = load_config(config.model)
    start, end = partition_layers(model_config.num_layers, config.num_stages, config.layer_partition)[config.stage]
    model = EmulatedSlice(model_config, start, end, config.is_first, config.is_last, config.model)
    dtype = resolve_dtype(config.dtype, model_config, "meta")  # as configured: no CPU-only swap
    tp = emulated_tensor_parallel_size(config.tensor_parallel_size, profile)
    num_blocks = emulated_num_blocks(config, device_block_bytes(model, config.block_size, dtype, tp))
    return EmulatedRunner(model, profile, num_blocks, config.block_size, dtype, tp, sleep, config.kv_import_blocks)
