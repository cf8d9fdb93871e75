"""The KV tier's index: which evicted prefix blocks the stages hold below the pool (host memory,
then disk), kept by the KV manager, which decides every move (`services.step.TierOp`) and sends
it to every stage in the plan of the step that makes it.

A cached block evicted from the pool is saved to the host tier (unless the tier holds its key
already); a full host tier demotes its least recently used block to the disk tier, and a full
disk tier drops its own. A prefix lookup that runs past the pool's hits continues here: each
key found is loaded into a fresh pool block before the step that needs it computes. A step that
saved or loaded a key and failed forgets that key (a stage may not hold it, or held it corrupt);
the next writing step carries the drops. Both tiers are bounded in blocks (every stage's part of
a block together: `--kv-offload host:GiB,disk:PATH:GiB` over the pipeline's bytes per block).

P/D disaggregation adds an import level (`--kv-import-blocks`, on a decode replica): blocks every
stage pulled from a prefill replica (`StageWorker.PullBlocks`) under the keys `import_plan` named,
added by `commit_import`. A lookup finds them as tier hits; their LOAD consumes them (the stages
let go of the bytes). Unloaded ones are dropped after `IMPORT_TTL_S` (the stages keep theirs
longer, so a key the index holds is always held below). Never saved to, demoted or evicted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvcache_svc.core.prefix_cache import ROOT_KEY, TOKEN_BYTES, PrefixCache, pack_token_ids
from services.kv_offload import parse_kv_offload
from services.step import TIER_DEMOTE, TIER_DROP, TIER_LOAD, TIER_SAVE, TierOp

HOST, DISK, IMPORT = "host", "disk", "import"
IMPORT_TTL_S = 60.0  # an imported block not loaded by then is dropped (the stages keep theirs 120 s)


class TierListener:
    """Told of the tier's contents (the KV events: a router counts a tier hit as a cheaper one)."""

    def tier_stored(self, key: bytes, medium: str) -> None: ...

    def tier_removed(self, key: bytes, medium: str) -> None: ...


class TierIndex:
    def __init__(
        self,
        host_blocks: int,
        disk_blocks: int = 0,
        listener: TierListener | None = None,
        import_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if host_blocks < (0 if import_blocks > 0 else 1) or disk_blocks < 0 or import_blocks < 0:
            raise ValueError(
                "kv tier: host_blocks must be >= 1 (or 0 with an import level) and disk_blocks, "
                f"import_blocks >= 0, got {host_blocks}, {disk_blocks}, {import_blocks}"
            )
        if disk_blocks and not host_blocks:
            raise ValueError("kv tier: a disk tier needs a host tier above it")
        self.host_blocks, self.disk_blocks, self.import_blocks = host_blocks, disk_blocks, import_blocks
        self._imported: OrderedDict[bytes, float] = OrderedDict()  # key -> when committed, oldest first
        # imported keys a step in flight loads: the stages hold them until they apply it
        self._loading: set[bytes] = set()
        self._clock = clock
        self.num_imported = self.num_import_loads = self.num_import_expired = 0
        self._host: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._disk: OrderedDict[bytes, None] = OrderedDict()
        self._pending: list[TierOp] = []  # drops decided outside a writing step (a failure)
        self._pinned: set[bytes] = set()  # keys this step loads: never moved before their load
        self.listener = listener
        self.num_saves = self.num_loads = self.num_demotions = self.num_drops = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._host or key in self._disk or key in self._imported

    @property
    def num_host(self) -> int:
        return len(self._host)

    @property
    def num_disk(self) -> int:
        return len(self._disk)

    @property
    def num_import(self) -> int:
        """Imported blocks the stages hold: not loaded yet, or loaded by a step in flight."""
        return len(self._imported) + len(self._loading)

    def medium(self, key: bytes) -> str | None:
        if key in self._imported:
            return IMPORT
        return HOST if key in self._host else DISK if key in self._disk else None

    def pin(self, keys: Iterable[bytes]) -> None:
        """Keys the step being planned will load: they stay where they are until `unpin`."""
        self._pinned.update(keys)

    def unpin(self) -> None:
        self._pinned.clear()

    def save(self, key: bytes, block_id: int, ops: list[TierOp]) -> bool:
        """Pool block `block_id`, about to be reused, holds `key`: keep it in the host tier
        (False: the tier holds it already, or has no room that is not pinned)."""
        for level in (self._host, self._disk):
            if key in level:
                level.move_to_end(key)
                return False
        if len(self._host) >= self.host_blocks and not self._make_room(ops):
            return False
        self._host[key] = None
        ops.append(TierOp(TIER_SAVE, key, block_id))
        self.num_saves += 1
        self._told("stored", key, HOST)
        return True

    def load(self, key: bytes, block_id: int, ops: list[TierOp]) -> None:
        """A prefix hit below the pool: `key` is read into fresh pool block `block_id` (an
        imported key is consumed: the stages let go of it as they load it)."""
        if self._imported.pop(key, None) is not None:
            self._loading.add(key)
            self.num_import_loads += 1
        else:
            level = self._host if key in self._host else self._disk
            level.move_to_end(key)
        ops.append(TierOp(TIER_LOAD, key, block_id))
        self.num_loads += 1

    def commit_import(self, keys: Iterable[bytes]) -> int:
        """Keys every stage now holds in its import area (P/D: pulled from a prefill replica);
        returns how many were added. A key found in another level already stays there (the
        stages' copy is dropped by the next writing step); past the import bound, the oldest
        imported keys are dropped."""
        added = 0
        for key in keys:
            if key in self._host or key in self._disk:
                continue  # (a DROP would take the tier's copy too: the stages' import expires)
            self._imported.pop(key, None)
            self._imported[key] = self._clock()
            added += 1
        while self._imported and self.num_import > self.import_blocks:
            old, _ = self._imported.popitem(last=False)
            self._pending.append(TierOp(TIER_DROP, old))
        self.num_imported += added
        return added

    def settled(self, keys: Iterable[bytes]) -> None:
        """A step that moved `keys` completed: every stage has applied it (its imported LOADs
        let go of their blocks)."""
        if self._loading:
            self._loading.difference_update(keys)

    def expire_imports(self) -> None:
        """Imported keys not loaded within IMPORT_TTL_S are dropped (by the next writing step)."""
        if not self._imported:
            return
        now = self._clock()
        while self._imported:
            key, when = next(iter(self._imported.items()))
            if now - when < IMPORT_TTL_S or key in self._pinned:
                return
            del self._imported[key]
            self._pending.append(TierOp(TIER_DROP, key))
            self.num_import_expired += 1

    def forget(self, keys: Iterable[bytes]) -> None:
        """Every key a failed step moved (saved, loaded, demoted, dropped): some stages made
        the moves and some did not, so none is trusted; each is dropped on every stage (by the
        next writing step), held or not."""
        for key in keys:
            for level, medium in ((self._host, HOST), (self._disk, DISK)):
                if level.pop(key, False) is None:
                    self.num_drops += 1
                    self._told("removed", key, medium)
            self._imported.pop(key, None)
            self._loading.discard(key)
            self._pending.append(TierOp(TIER_DROP, key))

    def take_pending(self, ops: list[TierOp]) -> None:
        """The drops decided since the last writing step go first in this one."""
        if self._pending:
            ops[:0] = self._pending
            self._pending = []

    def clear(self) -> None:
        """A pipeline reset: the stages clear their tiers with their pools (the KV events' one
        `AllBlocksCleared` covers the tier too)."""
        self._host.clear()
        self._disk.clear()
        self._imported.clear()
        self._loading.clear()
        self._pending.clear()

    def _oldest(self, level: OrderedDict[bytes, None]) -> bytes | None:
        """The least recently used key of `level` not pinned, or None."""
        return next((k for k in level if k not in self._pinned), None)

    def _make_room(self, ops: list[TierOp]) -> bool:
        """One host slot freed: its oldest block demoted to disk (the disk's oldest dropped
        when full) or, without room on disk, dropped. False when every candidate is pinned."""
        old = self._oldest(self._host)
        if old is None:
            return False
        if self.disk_blocks and len(self._disk) >= self.disk_blocks:
            dropped = self._oldest(self._disk)
            if dropped is not None:
                self._drop(dropped, self._disk, DISK, ops)
        if not self.disk_blocks or len(self._disk) >= self.disk_blocks:
            self._drop(old, self._host, HOST, ops)
            return True
        del self._host[old]
        self._told("removed", old, HOST)
        self._disk[old] = None
        ops.append(TierOp(TIER_DEMOTE, old))
        self.num_demotions += 1
        self._told("stored", old, DISK)
        return True

    def _drop(self, key: bytes, level: OrderedDict[bytes, None], medium: str, ops: list[TierOp]) -> None:
        del level[key]
        ops.append(TierOp(TIER_DROP, key))
        self.num_drops += 1
        self._told("removed", key, medium)

    def _told(self, what: str, key: bytes, medium: str) -> None:
        if self.listener is not None:
            getattr(self.listener, f"tier_{what}")(key, medium)

    def keys(self) -> list[tuple[bytes, str]]:
        """Every key held, with its medium (a snapshot for KV-event subscribers)."""
        return [(k, HOST) for k in self._host] + [(k, DISK) for k in self._disk]

    def check_integrity(self) -> None:
        assert len(self._host) <= self.host_blocks, (len(self._host), self.host_blocks)
        assert len(self._disk) <= self.disk_blocks, (len(self._disk), self.disk_blocks)
        assert self.num_import <= self.import_blocks, (self.num_import, self.import_blocks)
        assert not self._host.keys() & self._disk.keys(), "a key in both tiers"
        assert not self._imported.keys() & (self._host.keys() | self._disk.keys()), "an imported key in a tier"
        assert all(op.kind == TIER_DROP for op in self._pending), self._pending


def plan_import(
    cache: PrefixCache,
    tier: TierIndex,
    namespace: str | None,
    token_ids: tuple[int, ...],
    num_blocks: int,
    block_size: int,
) -> tuple[list[int], list[bytes], int]:
    """P/D: which of a prompt's first `num_blocks` full blocks a decode replica pulls: those
    neither in the pool's cached prefix nor in the tier (the block holding the last token is
    always computed). Returns (their indices, their keys, the leading blocks found)."""
    stride = block_size * TOKEN_BYTES
    count = max(0, min(num_blocks, (len(token_ids) - 1) // block_size, tier.import_blocks))
    token_bytes = pack_token_ids(token_ids[: count * block_size])
    hits = cache.lookup(namespace, token_bytes, block_size)
    parent, present = (hits[-1].key if hits else ROOT_KEY), len(hits)
    indices: list[int] = []
    keys: list[bytes] = []
    for j in range(len(hits), count):
        key = cache.key_of(parent, namespace, token_bytes[j * stride : (j + 1) * stride])
        if key not in tier:
            indices.append(j)
            keys.append(key)
        elif not indices:
            present += 1
        parent = key
    return indices, keys, present


def tier_for(kv_offload: str, listener: TierListener | None = None, import_blocks: int = 0) -> TierIndex | None:
    """The index for a `--kv-offload` given in blocks (services/kv_offload.py) and an import
    level of `import_blocks` (P/D); None without either."""
    offload = parse_kv_offload(kv_offload)
    if offload is None:
        return TierIndex(0, 0, listener, import_blocks) if import_blocks > 0 else None
    return TierIndex(offload.host_blocks, offload.disk_blocks if offload.disk_path else 0, listener, import_blocks)
