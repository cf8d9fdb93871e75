"""A stage's physical KV memory: one K and one V pool per page slot its layers use.

Each pool is `[num_blocks, block_size, num_kv_heads, head_dim]`. With one table for all
layers (no layout, or one that does not group) every local layer has a pool of its own,
and block `b` of a sequence means the same slot range in every stage's pools (one logical
block table for the whole pipeline). With KV groups (services/kv_layout.py) a "block" is a
*page*: page `p` is slot range `p * block_size ...` of `layout.layers_per_page` pools, and
the layer at `layout.layer_places[layer] == (sub_group, slot)` keeps its KV in pool `slot`
at the pages of its sub-group's table; layers of different sub-groups share a pool, never
a page. Each stage holds only the pools of the slots its own layers use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.kv_layout import KVLayout


class PagedKVCache:
    """K/V pools of one stage; `copy_blocks` carries out the KV manager's copy-on-write.

    `pools[local]` is local layer `local`'s (K, V); with a grouped layout, layers at the same
    slot share one pair of tensors (the same objects), so `nbytes` and `copy_blocks` count
    and copy each distinct pair once (`slot_pools`).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        layout: KVLayout | None = None,
        layers: Sequence[int] | None = None,  # the stage's layers (model indices); default 0 ... num_layers - 1
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        layers = range(num_layers) if layers is None else layers
        if len(layers) != num_layers:
            raise ValueError(f"{num_layers} layers, but {len(layers)} layer indices given")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layout = layout if layout is not None and layout.grouped else None
        slot_of = (
            [self.layout.layer_places[layer][1] for layer in layers]
            if self.layout is not None
            else list(range(num_layers))
        )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        by_slot = {
            s: (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for s in sorted(set(slot_of))
        }
        self.slot_pools: list[tuple[torch.Tensor, torch.Tensor]] = list(by_slot.values())
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = [by_slot[s] for s in slot_of]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.slot_pools)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (pages) `src -> dst` in every pool (ids already validated)."""
        if not copies:
            return
        device = self.pools[0][0].device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
        for k_pool, v_pool in self.slot_pools:
            k_pool.index_copy_(0, dst, k_pool.index_select(0, src))
            v_pool.index_copy_(0, dst, v_pool.index_select(0, src))
