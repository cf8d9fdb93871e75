"""The pure core of the KV-cache service: block accounting with no I/O, grpc or torch.

`KVCacheManager.step(StepInput) -> StepOutput` is the one entry point a servicer needs;
`stats()`, `reset()` and `check_integrity()` complete it.
"""

from kvcache_svc.core.block_pool import BlockPool
from kvcache_svc.core.manager import KVCacheManager
from kvcache_svc.core.prefix_cache import ROOT_KEY, CachedBlock, PrefixCache, hash_block
from services.kv_errors import IntegrityError, InvalidStepError, KVCacheError, SequenceNotFound
from services.kv_stats import KVCacheStats, SequenceBlockStats
from services.kv_types import Allocated, Append, BlockCopy, Fork, NewSequence, NoBlocks, StepInput, StepOutput, slots

__all__ = [
    "ROOT_KEY",
    "Allocated",
    "Append",
    "BlockCopy",
    "BlockPool",
    "CachedBlock",
    "Fork",
    "IntegrityError",
    "InvalidStepError",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheStats",
    "NewSequence",
    "NoBlocks",
    "PrefixCache",
    "SequenceBlockStats",
    "SequenceNotFound",
    "StepInput",
    "StepOutput",
    "hash_block",
    "slots",
]
