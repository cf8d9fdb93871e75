"""The KV pool of a local stack (`start_stack`, `pagoda serve`): its shape as the checkpoint
gives it (`model_max_len`, `model_kv_groups`), and its size when memory sets it
(`MemorySetting`: each stage sizes its own pool, `pool_from_stages` takes the smallest).
No torch, no grpc: the checkpoint's config is read only when asked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services import settings as shared
from services.defaults import MAX_MODEL_LEN
from wiring.flags import flag_args


@dataclass(frozen=True)
class MemorySetting:
    """How `start_stack` sizes the KV pool when it is given no block count (one of the two):
    `gpu_memory_utilization`, the fraction of the machine's (device's) memory the stages of
    this stack use together (each stage gets an equal share); `kv_cache_memory`, bytes for
    each stage's pool. `max_model_len`: one sequence of it must fit, or the start fails."""

    gpu_memory_utilization: float | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None

    def worker_args(self, num_stages: int) -> list[str]:
        if self.kv_cache_memory is not None:
            return flag_args(shared.KV_CACHE_MEMORY, self.kv_cache_memory)
        return [
            *flag_args(shared.GPU_MEMORY_UTILIZATION, self.gpu_memory_utilization / num_stages),
            *flag_args(shared.MAX_MODEL_LEN, self.max_model_len or None),
        ]


def pool_from_stages(
    infos: Sequence, block_size: int, max_model_len: int, setting: MemorySetting, num_stages: int
) -> int:
    """The one pool: the smallest stage's (each reported its StageLoadInfo). ValueError saying
    what would fit when one sequence of `max_model_len` does not."""
    smallest = min(infos, key=lambda i: i.num_kv_blocks)
    blocks = smallest.num_kv_blocks
    needed = -(-max_model_len // block_size)
    if blocks >= needed:
        return blocks
    if setting.kv_cache_memory is not None:
        raise_to = f"--kv-cache-memory to at least {needed * smallest.kv_block_bytes} bytes"
    else:
        want = smallest.memory_baseline_bytes + smallest.activation_peak_bytes + needed * smallest.kv_block_bytes
        raise_to = f"--gpu-memory-utilization to at least {want / smallest.memory_total_bytes * num_stages:.3f}"
    raise ValueError(
        f"KV cache: stage {smallest.stage_index}'s memory leaves room for {blocks} blocks ({blocks * block_size} "
        f"tokens), but one sequence of max_model_len={max_model_len} needs {needed} blocks: raise {raise_to}, "
        f"or lower --max-model-len to at most {blocks * block_size}"
    )


def model_max_len(model_dir: str) -> int:
    """The checkpoint's longest sequence as its architecture reads it (worker_svc/models/:
    `ModelConfig.max_position_embeddings`); for a folder no architecture reads, config.json's
    max_position_embeddings, or MAX_MODEL_LEN when it does not say."""
    import json

    from worker_svc.models.registry import load_config

    try:
        return load_config(model_dir).max_position_embeddings
    except ValueError:  # CheckpointError: not a served architecture (the start refuses it)
        pass
    try:
        return int(
            json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", MAX_MODEL_LEN)
        )
    except (OSError, ValueError):
        return MAX_MODEL_LEN


def model_kv_groups(model_dir: str) -> str:
    """The checkpoint's KV groups as the KV service takes them (`--kv-groups`,
    services/kv_layout.py): "" for a model whose layers attend alike, or one not read here."""
    from worker_svc.models.registry import load_config

    try:
        return load_config(model_dir).kv_layout.spec()
    except (ValueError, OSError):  # not a served architecture, or no folder (the start says)
        return ""


def kv_offload_in_blocks(spec: str, model_dir: str, block_size: int, kv_cache_dtype: str = "auto") -> str:
    """`--kv-offload` in blocks of the whole pipeline (every layer's K and V of one block), the
    form every service takes. A block is counted at the pools' dtype when it is given
    (`--kv-cache-dtype bfloat16`: 2 bytes a value), else at 4 bytes a value, the most a pool
    takes on the CPU: the tier then never holds more than the GiB given."""
    from services.kv_offload import parse_kv_offload
    from worker_svc.models.registry import load_config

    offload = parse_kv_offload(spec)
    if offload is None or offload.in_blocks:
        return offload.spec() if offload else ""
    cfg = load_config(model_dir)
    value_bytes = 2 if kv_cache_dtype == "bfloat16" else 4
    block_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * value_bytes
    return offload.in_blocks_of(block_bytes).spec()
