"""A stage's physical KV memory: one K and one V pool per local layer.

Each pool is `[num_blocks, block_size, num_kv_heads, head_dim]`. Block `b` of a sequence
means the same slot range in every stage's pools (one logical block table for the whole
pipeline); each stage holds only its own layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PagedKVCache:
    """K/V pools of one stage; `copy_blocks` carries out the KV manager's copy-on-write."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.pools)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks `src -> dst` in every layer (ids already validated)."""
        if not copies:
            return
        device = self.pools[0][0].device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
        for k_pool, v_pool in self.pools:
            k_pool.index_copy_(0, dst, k_pool.index_select(0, src))
            v_pool.index_copy_(0, dst, v_pool.index_select(0, src))
