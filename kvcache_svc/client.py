"""The KV-cache manager embedded in the scheduler's process: `InProcessKVCacheClient`,
the contract's client (services/kv_client.py) over direct calls on a `KVCacheManager`. The
wiring builds it (`pagoda scheduler --kvcache in-process`, the in-process engine, tests).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

from kvcache_svc.core import KVCacheManager
from kvcache_svc.core.tier import plan_import
from services.kv_client import ImportPlan, KVCacheClient, check_num_blocks
from services.kv_codec import stats_to_pb
from services.kv_stats import KVCacheStats, SequenceBlockStats
from services.kv_types import Fork, StepInput, StepOutput
from services.pb import kvcache_pb2


class InProcessKVCacheClient(KVCacheClient):
    """Direct calls on a `KVCacheManager` that this client owns from now on (the embedded
    default: tests and single-process use). No await happens inside a call, so calls are
    atomic on the event loop."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._epoch = secrets.randbits(63) | 1
        # what the service counts too, so that stats_message reads the same
        self._num_steps = 0
        self._num_peak_used_blocks = 0

    def _changed(self) -> None:
        num_used = self._manager.num_blocks - self._manager.num_available_blocks
        self._num_peak_used_blocks = max(self._num_peak_used_blocks, num_used)

    @property
    def manager(self) -> KVCacheManager:
        return self._manager

    async def step(self, step_input: StepInput) -> StepOutput:
        output = self._manager.step(step_input)
        self._num_steps += 1
        self._changed()
        return output

    async def fork(self, parent_seq_id: int, child_seq_ids: Iterable[int]) -> None:
        forks = tuple(Fork(parent_seq_id, child) for child in child_seq_ids)
        self._manager.step(StepInput(forks=forks))
        self._changed()

    async def free(self, seq_ids: Iterable[int]) -> int:
        num_available = self._manager.num_available_blocks
        self._manager.step(StepInput(frees=tuple(seq_ids)))
        self._changed()
        return self._manager.num_available_blocks - num_available

    async def stats(self) -> KVCacheStats:
        return self._manager.stats()

    async def sequence_stats(self) -> tuple[SequenceBlockStats, ...]:
        return self._manager.sequence_stats()

    async def stats_message(self, include_sequences: bool = False) -> kvcache_pb2.KVCacheStats:
        m = self._manager
        sequences, block_map = m.layout() if include_sequences else ([], b"")
        return stats_to_pb(
            m.stats(),
            epoch=self._epoch,
            num_peak_used_blocks=self._num_peak_used_blocks,
            num_steps=self._num_steps,
            enable_prefix_caching=m.enable_prefix_caching,
            sequences=sequences,
            block_map=block_map,
        )

    async def import_plan(self, namespace: str | None, token_ids: Sequence[int], num_blocks: int) -> ImportPlan:
        cache, tier = self._manager.import_level()
        plan = plan_import(cache, tier, namespace, tuple(token_ids), num_blocks, self._manager.block_size)
        return ImportPlan(*plan, tier.num_import, tier.import_blocks)

    async def commit_import(self, keys: Sequence[bytes]) -> None:
        self._manager.import_level()[1].commit_import(keys)

    async def forget_import(self, keys: Sequence[bytes]) -> None:
        self._manager.import_level()[1].forget(keys)

    async def reset(self) -> int:
        num_dropped = len(self._manager.seq_ids())
        self._manager.reset()
        return num_dropped

    async def check_capacity(self, num_blocks: int) -> bool:
        check_num_blocks(num_blocks)
        return self._manager.can_allocate(num_blocks)

    async def epoch(self) -> int:
        return self._epoch

    async def close(self) -> None:
        pass
