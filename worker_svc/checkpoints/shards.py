"""A tensor-parallel rank's share of a checkpoint tensor: the dimension it is split along, the
rank's rows or columns of it, and the tensors a rank holds whole or zeroed (both formats'
loaders read through these; worker_svc/weights/lora_adapter.py shards adapters the same way)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker_svc.model_config import ModelConfig

# tensor parallelism: the dimension along which a rank takes its share of a tensor (rows of
# the column-parallel q/k/v and gate/up projections and their biases, columns of the
# row-parallel o_proj and down_proj); tensors not named here are replicated
_SHARD_DIMS = {
    "self_attn.q_proj": 0,
    "self_attn.k_proj": 0,
    "self_attn.v_proj": 0,
    "self_attn.o_proj": 1,
    ".gate_proj": 0,
    ".up_proj": 0,
    ".down_proj": 1,
}  # experts' too


def shard_dim(name: str) -> int | None:
    """The dimension a tensor-parallel rank splits checkpoint tensor `name` along, or None.
    A row-parallel product's bias is not split (`rank_bias`); attention sinks go with their
    heads."""
    module, leaf = name.rsplit(".", 1)
    if leaf == "sinks":
        return 0
    dim = next((d for suffix, d in _SHARD_DIMS.items() if module.endswith(suffix)), None)
    return None if dim == 1 and leaf == "bias" else dim


def rank_bias(name: str, tensor: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """`tensor` as rank `tp_rank` holds it: a row-parallel product's bias (o_proj's,
    down_proj's) only on rank 0, zeros elsewhere, since the ranks' partial outputs are summed."""
    module, leaf = name.rsplit(".", 1)
    if tp_rank and leaf == "bias" and any(module.endswith(s) for s, d in _SHARD_DIMS.items() if d == 1):
        return torch.zeros_like(tensor)
    return tensor


def held_whole(name: str, config: ModelConfig) -> bool:
    """Whether a tensor-parallel rank reads tensor `name` whole: an expert's, under expert
    parallelism (`MoEConfig.ep_size`)."""
    return config.moe is not None and config.moe.ep_size > 1 and ".mlp.experts." in name


def full_shape(name: str, want: Sequence[int], tp_size: int) -> tuple[int | None, list[int]]:
    """(the dimension tensor `name` is split along across `tp_size` ranks or None, the
    checkpoint's whole shape of a tensor a rank holds as `want`)."""
    full = list(want)
    dim = shard_dim(name) if tp_size > 1 else None
    if dim is not None:
        full[dim] *= tp_size
    return dim, full


def rank_share(tensor, dim: int, size: int, tp_rank: int):
    """Rank `tp_rank`'s `size` rows (`dim` 0) or columns (`dim` 1) of `tensor` (a tensor or a
    safetensors slice, which reads only them)."""
    rows = slice(tp_rank * size, (tp_rank + 1) * size)
    return tensor[rows] if dim == 0 else tensor[:, rows]
