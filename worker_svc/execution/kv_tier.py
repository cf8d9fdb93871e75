"""A stage's KV tier: host memory, then disk, below its KV pool (issue 39, `--kv-offload`), and
the import area of P/D disaggregation (`--kv-import-blocks`).

The KV manager (`kvcache_svc/core/tier.py`) decides every move and sends it in the plan as
`StepPlan.tier_ops`; each stage carries them out in order on its own layers' part of each block
(`KVTierStore.apply`, on the compute thread, before the step's block copies):

- SAVE: pool block `block_id` -> the host tier under `key` (the block is about to be reused);
- LOAD: the key's bytes (the import area, host, or disk) -> pool block `block_id` (a prefix hit
  below the pool);
- DEMOTE: host tier -> a disk file; DROP: forget the key (missing is fine).

The host tier is one slab of `host_blocks` blocks allocated up front (pinned on a CUDA pool, so
copies to and from the device are asynchronous), a block being every K and V pool of the stage
at one block id, `[2 * num_slot_pools, block_size, num_kv_heads, head_dim]` (K0, V0, K1, V1 ...).

The disk tier is one file per block, `disk_dir/<name>/<hex key>.kv`, written and removed by one
I/O thread in the order the moves were made, each written to a `.tmp` file and renamed into
place. A DEMOTE returns at once: until its write lands, a LOAD of the key is served from memory.
When a plan arrives, `prefetch` queues the reads of its disk LOADs on the same thread, so a disk
hit overlaps the steps ahead of it. A file is served only if its magic, version, key, dtype,
shapes, length and checksum all match; anything else is a miss (`TierMissError`), never data.

The file format: worker_svc/execution/kv_tier_files.py.

The import area (worker_svc/execution/kv_import.py; `import_blocks`, which works with no host or
disk tier at all) holds blocks a decode stage pulled from a prefill replica (`put_imported`, from
the event loop), under the decode KV manager's keys, which it counts as tier hits: a LOAD of such
a key is served from the area first and consumes the entry; a DROP, a miss or `clear` forgets
it; entries older than `IMPORT_TTL_S` are swept on each `put_imported` and `apply`.

Measured on a SmolLM2-135M-sized block (30 layers, 3 KV heads, head_dim 64, block 16, float32:
737 KB per block), one torch thread on a 2-core machine, per block on the compute thread: SAVE
0.12 ms; LOAD from the host 0.20 ms (0.17 in a batch of 8); DEMOTE 0.25 ms (a copy; its write,
0.45 ms, on the I/O thread); LOAD from disk 0.26 ms prefetched, 0.6 ms read on the spot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from math import prod
from pathlib import Path

import torch

from services.step import TIER_DEMOTE, TIER_DROP, TIER_LOAD, TIER_SAVE, TierOp
from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.execution.kv_import import IMPORT_TTL_S, ImportArea, ImportAreaFullError, ImportIntegrityError
from worker_svc.execution.kv_tier_files import BlockFiles, Unreadable

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 120  # the file name is the key in hex: under the usual 255-byte name limit
MAX_QUEUED_WRITES = 32  # demoted blocks waiting for the disk, at most (their buffers' memory)
SPARE_BUFFERS = 16  # written blocks' buffers kept for the next DEMOTEs (fresh memory costs page faults)
_KIND_NAMES = {TIER_SAVE: "SAVE", TIER_LOAD: "LOAD", TIER_DEMOTE: "DEMOTE", TIER_DROP: "DROP"}
__all__ = ["IMPORT_TTL_S", "ImportAreaFullError", "KVTierStore", "TierIntegrityError", "TierMissError"]


class TierMissError(Exception):
    """LOADs of a plan that could not be served: the key is in neither tier, or its file is
    missing, truncated, or fails its header or checksum check.

    Raised after every other op of the plan was applied. Nothing was written into the missed
    LOADs' blocks, and the missed keys are forgotten here (a later DROP of them is a no-op); the
    step fails, and the KV manager forgets the keys and recomputes their tokens.
    """

    def __init__(self, misses: Sequence[tuple[bytes, str]]) -> None:
        self.keys: tuple[bytes, ...] = tuple(key for key, _ in misses)
        self.reasons: tuple[str, ...] = tuple(reason for _, reason in misses)
        super().__init__("kv tier: cannot load " + "; ".join(f"{k.hex()}: {r}" for k, r in misses))


class TierIntegrityError(AssertionError):
    """`KVTierStore.check_integrity()` found the store's bookkeeping inconsistent (a bug)."""


@dataclass(eq=False)
class _DiskEntry:
    data: torch.Tensor | None  # the block while its write is queued (LOADs read it); None once written
    failed: bool = False  # the write failed: no file, a LOAD misses
    dropped: bool = False  # forgotten before its write ran: the write is skipped


class _Overlay:
    """A key set as `base` would be after the ops checked so far (validation changes nothing)."""

    def __init__(self, base: Collection[bytes]) -> None:
        self.base, self.added, self.removed = base, set[bytes](), set[bytes]()

    def __contains__(self, key: bytes) -> bool:
        return key in self.added or (key in self.base and key not in self.removed)

    def __len__(self) -> int:
        return len(self.base) - len(self.removed) + len(self.added)

    def add(self, key: bytes) -> None:  # `key` is not in the set
        if key in self.base:
            self.removed.discard(key)
        else:
            self.added.add(key)

    def discard(self, key: bytes) -> None:
        self.added.discard(key)
        if key in self.base:
            self.removed.add(key)


class KVTierStore:
    """One stage's host and disk tiers and import area, carrying out the KV manager's `TierOp`s.

    Invariants (`check_integrity`): at most `host_blocks` keys in host memory, each in its own
    slab slot, the free slots the rest; at most `disk_blocks` keys on disk; no key in both; each
    disk key whose write has landed has one file of the expected size, and the directory holds no
    other tier file; prefetched keys are disk keys, at most `prefetch_blocks` of them; at most
    `import_blocks` imported keys (`ImportArea`'s invariants).

    Threads: `apply`, `clear` and `close` on the compute thread (the owner of the pools);
    `prefetch` and `put_imported` from any thread (the event loop), concurrently with `apply` of
    earlier plans. The indexes are shared under locks (the store's, the import area's), held only
    for bookkeeping, never across a copy or I/O.
    Counters (`num_*`) are cumulative across `clear`.
    """

    def __init__(
        self,
        kv_cache: PagedKVCache,
        host_blocks: int,
        disk_dir: str | os.PathLike[str] | None,
        disk_blocks: int,
        *,
        name: str = "stage0",
        prefetch_blocks: int = 64,  # disk blocks read ahead and held, at most
        import_blocks: int = 0,  # P/D: blocks pulled from a prefill replica held, at most (0: no import area)
        import_ttl_s: float = IMPORT_TTL_S,
        clock: Callable[[], float] = time.monotonic,  # the import area's (tests step it)
    ) -> None:
        if min(host_blocks, disk_blocks, prefetch_blocks, import_blocks) < 0:
            raise ValueError(
                f"kv tier: negative bound: {host_blocks=}, {disk_blocks=}, {prefetch_blocks=}, {import_blocks=}"
            )
        if disk_blocks and disk_dir is None:
            raise ValueError(f"kv tier: {disk_blocks} disk blocks but no disk directory")
        if not name or name in (".", "..") or "/" in name or os.sep in name:
            raise ValueError(f"kv tier: name {name!r} is not a plain directory name")
        self._pools = [pool for pair in kv_cache.slot_pools for pool in pair]  # K0, V0, K1, V1 ...
        first = self._pools[0]
        if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in self._pools):
            raise ValueError("kv tier: the stage's pools differ in shape, dtype or device")
        self._device, self._pin = first.device, first.device.type == "cuda"
        self.block_shape: tuple[int, ...] = (len(self._pools), *first.shape[1:])
        self.num_pool_blocks = first.shape[0]
        self.host_blocks, self.disk_blocks, self.prefetch_blocks = host_blocks, disk_blocks, prefetch_blocks
        self.dtype: torch.dtype = first.dtype
        self.imports = ImportArea(import_blocks, self.block_shape, first.dtype, ttl_s=import_ttl_s, clock=clock)
        self._slab = torch.empty((host_blocks, *self.block_shape), dtype=first.dtype, pin_memory=self._pin)
        self._files: BlockFiles | None = None
        if disk_dir is not None:
            self._files = BlockFiles(Path(disk_dir) / name, first.dtype, self.block_shape)
            self._files.directory.mkdir(parents=True, exist_ok=True)
            self._files.remove_all()  # the manager's index starts empty: leftovers are garbage
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-tier-{name}")
        self._free_slots = list(range(host_blocks - 1, -1, -1))
        self._host: dict[bytes, int] = {}  # key -> slab slot
        self._disk: dict[bytes, _DiskEntry] = {}
        self._prefetched: OrderedDict[bytes, Future[torch.Tensor]] = OrderedDict()  # oldest first
        self._spare: list[torch.Tensor] = []  # buffers of written blocks, for the next DEMOTEs
        self._writes: deque[Future[None]] = deque()  # queued DEMOTE writes, oldest first
        self._disk_bytes = 0
        self._saves_pending: torch.cuda.Event | None = None  # device -> slab copies not yet waited on
        self._closed = False
        self.num_saved = self.num_loaded_host = self.num_loaded_disk = self.num_demoted = self.num_dropped = 0
        self.num_loaded_import = 0  # LOADs served from the import area
        self.num_corrupt = self.num_missed = self.num_prefetched = self.num_write_errors = 0
        self.num_refitted = 0  # moves added or skipped to fit a plan to what this store holds (`_fit`)

    # ------------------------------------------------------------------ statistics

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in this stage's tiers (its layers' part of the block)."""
        return prod(self.block_shape) * self._slab.dtype.itemsize

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    @property
    def num_disk_blocks(self) -> int:
        return len(self._disk)

    @property
    def host_bytes(self) -> int:
        return len(self._host) * self.block_bytes

    @property
    def disk_bytes(self) -> int:
        """The files' bytes, counting a file from its DEMOTE (before its write lands)."""
        return self._disk_bytes

    @property
    def import_blocks(self) -> int:
        """The import area's bound (0: none)."""
        return self.imports.max_blocks

    @property
    def num_import_blocks(self) -> int:
        return len(self.imports)

    # ------------------------------------------------------------------ the import area

    def put_imported(self, entries: Sequence[tuple[bytes, torch.Tensor]]) -> None:
        """Keep pulled blocks (`(key, block)`, each `block_shape` of `dtype` on the CPU) in the
        import area, where a LOAD of the key takes it; all or nothing. `ImportAreaFullError`
        when the area (`import_blocks`, after sweeping expired entries) has no room for them;
        ValueError for a key of the wrong length or a block of another layout."""
        for key, _ in entries:
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"kv import: a key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        self.imports.put(entries)

    # ------------------------------------------------------------------ the moves

    def prefetch(self, ops: Sequence[TierOp]) -> None:
        """A plan arrived: queue reads of its LOADs found on disk (checked whole, into memory) on
        the I/O thread, where the LOAD will take them. Skips what the store holds in memory already;
        past `prefetch_blocks` held, the oldest read is let go (its LOAD reads the file itself)."""
        keys = [op.key for op in ops if op.kind == TIER_LOAD]
        if not keys or self._files is None or not self.prefetch_blocks:
            return
        with self._lock:
            if self._closed:
                return
            for key in keys:
                entry = self._disk.get(key)
                if entry is None or entry.data is not None or entry.failed or key in self._prefetched:
                    continue
                while len(self._prefetched) >= self.prefetch_blocks:
                    self._prefetched.popitem(last=False)[1].cancel()
                self._prefetched[key] = self._io.submit(self._files.read, key, self._pin)
                self.num_prefetched += 1

    def apply(self, ops: Sequence[TierOp]) -> None:
        """Carry out a plan's tier ops in order (module docstring). First the list is fitted to
        what this store holds (`_fit`: a stage that missed an earlier plan's moves, one that
        failed before reaching this stage, holds other keys than the manager thinks); then it is
        checked whole: what still contradicts the store raises ValueError and changes nothing. A
        LOAD that cannot be served raises `TierMissError` after every other op was applied.
        Consecutive SAVEs, and consecutive LOADs, go as one batch."""
        self.imports.sweep()
        if not ops:
            return
        ops = self._fit(ops)
        self._validate(ops)
        misses: list[tuple[bytes, str]] = []
        for kind, run in groupby(ops, key=lambda op: op.kind):
            batch = list(run)
            if kind == TIER_SAVE:
                self._save(batch)
            elif kind == TIER_LOAD:
                misses += self._load(batch)
            elif kind == TIER_DEMOTE:
                for op in batch:
                    self._demote(op.key)
            else:
                for op in batch:
                    self._drop(op.key)
        if misses:
            self.num_missed += len(misses)
            raise TierMissError(misses)

    def clear(self) -> None:
        """A pipeline reset: forget every key and remove the tier's files (on the I/O thread, after
        the writes queued before; `flush` waits for it)."""
        with self._lock:
            for entry in self._disk.values():
                entry.dropped = True
            for future in self._prefetched.values():
                future.cancel()
            self._host.clear()
            self._disk.clear()
            self._prefetched.clear()
            self.imports.clear()
            self._free_slots = list(range(self.host_blocks - 1, -1, -1))
            self._disk_bytes = 0
            if self._files is not None and not self._closed:
                self._io.submit(self._files.remove_all)

    def flush(self) -> None:
        """Wait until every queued write, removal and read has run."""
        if not self._closed:
            self._io.submit(lambda: None).result()

    def close(self) -> None:
        """Forget everything, remove the files and stop the I/O thread (idempotent)."""
        if self._closed:
            return
        self.clear()
        with self._lock:
            self._closed = True
        self._io.shutdown(wait=True)

    # ------------------------------------------------------------------ validation

    def _fit(self, ops: Sequence[TierOp]) -> list[TierOp]:
        """`ops` made applicable here, never past a bound: a SAVE of a key held already (in a tier
        or the import area) replaces it, a SAVE into a full host tier (or a DEMOTE into a full
        disk) first drops this store's oldest key no later LOAD of the plan reads (no room: the
        SAVE is skipped), a DEMOTE of a key not in host memory is skipped. LOADs are kept as they
        are (an imported key is held: no drop here takes it). Counted in `num_refitted`; what the
        manager then asks for and this store lacks is a LOAD miss (the step is recomputed), never
        a wrong block."""
        host, disk = _Overlay(self._host), _Overlay(self._disk)
        wanted = {op.key for op in ops if op.kind == TIER_LOAD}
        out: list[TierOp] = []
        for op in ops:
            extra: list[TierOp] = []
            if op.kind == TIER_SAVE:
                if op.key in host or op.key in disk or op.key in self.imports:
                    extra.append(TierOp(TIER_DROP, op.key))
                if op.key not in host and len(host) >= self.host_blocks:  # (a copy elsewhere frees no slot)
                    room = self._oldest_drop(host, wanted)
                    if not room:  # every block held is loaded by this plan (or no host tier): not kept
                        self.num_refitted += 1
                        continue
                    extra += room
            elif op.kind == TIER_DEMOTE:
                if op.key not in host:
                    self.num_refitted += 1
                    continue
                if len(disk) >= self.disk_blocks:
                    extra += self._oldest_drop(disk, wanted)
                    if not extra:  # no room on disk that no LOAD of this plan needs: dropped
                        self.num_refitted += 1
                        op = TierOp(TIER_DROP, op.key)
            for fix in extra:
                host.discard(fix.key)
                disk.discard(fix.key)
            self.num_refitted += len(extra)
            out += extra
            out.append(op)
            if op.kind == TIER_SAVE:
                host.add(op.key)
            elif op.kind == TIER_DEMOTE:
                host.discard(op.key)
                disk.add(op.key)
            elif op.kind == TIER_DROP:
                host.discard(op.key)
                disk.discard(op.key)
        return out

    @staticmethod
    def _oldest_drop(level: _Overlay, keep: set[bytes]) -> list[TierOp]:
        oldest = next((k for k in (*level.base, *level.added) if k in level and k not in keep), None)
        return [] if oldest is None else [TierOp(TIER_DROP, oldest)]

    def _validate(self, ops: Sequence[TierOp]) -> None:
        """ValueError unless every op is well formed: a known kind, a key, a block in range, no
        block loaded twice (the bounds and what the store holds are `_fit`'s)."""
        load_targets: set[int] = set()
        for i, op in enumerate(ops):
            where = f"kv tier op {i} ({_KIND_NAMES.get(op.kind, op.kind)} {op.key.hex()[:16]})"
            if op.kind not in _KIND_NAMES:
                raise ValueError(f"{where}: unknown kind")
            if not 0 < len(op.key) <= MAX_KEY_BYTES:
                raise ValueError(f"{where}: a key is 1 to {MAX_KEY_BYTES} bytes, got {len(op.key)}")
            if op.kind in (TIER_SAVE, TIER_LOAD) and not 0 <= op.block_id < self.num_pool_blocks:
                raise ValueError(f"{where}: block {op.block_id} out of range [0, {self.num_pool_blocks})")
            if op.kind == TIER_LOAD:
                if op.block_id in load_targets:
                    raise ValueError(f"{where}: block {op.block_id} is loaded twice")
                load_targets.add(op.block_id)

    # ------------------------------------------------------------------ SAVE and LOAD

    def _save(self, ops: list[TierOp]) -> None:
        with self._lock:
            slots = [self._free_slots.pop() for _ in ops]
            self._host.update((op.key, slot) for op, slot in zip(ops, slots, strict=True))
        for op, slot in zip(ops, slots, strict=True):
            parts = [pool[op.block_id] for pool in self._pools]
            if self._pin:  # gathered on the device, one asynchronous copy into pinned memory
                self._slab[slot].copy_(torch.stack(parts), non_blocking=True)
            else:
                torch.stack(parts, out=self._slab[slot])
        if self._pin:
            self._saves_pending = torch.cuda.Event()
            self._saves_pending.record()
        self.num_saved += len(ops)

    def _load(self, ops: list[TierOp]) -> list[tuple[bytes, str]]:
        """Copy the LOADs' blocks into the pool; the misses, forgotten."""
        block_ids, sources, misses = [], [], []
        for op in ops:
            block, reason = self._source(op.key)
            if block is None:
                misses.append((op.key, reason))
            else:
                block_ids.append(op.block_id)
                sources.append(block)
        if block_ids:
            self._copy_into_pool(block_ids, sources)
        for key, _ in misses:
            self._forget(key)
        return misses

    def _source(self, key: bytes) -> tuple[torch.Tensor | None, str]:
        """The key's block on the CPU, from the import area (consumed), the host slab, a queued
        write, a prefetch or its file (read now); or None and why not."""
        imported = self.imports.pop(key)
        if imported is not None:
            self.num_loaded_import += 1
            return imported, ""
        with self._lock:
            slot, entry, read = self._host.get(key), self._disk.get(key), self._prefetched.pop(key, None)
            pending = entry.data if entry is not None else None
        if slot is not None:
            self.num_loaded_host += 1
            return self._slab[slot], ""
        if entry is None or self._files is None:
            return None, "in neither tier"
        if entry.failed:
            return None, "its file could not be written"
        try:
            if pending is not None:
                block = pending
            elif read is not None:
                block = read.result()
            else:
                block = self._files.read(key, self._pin)
        except (Unreadable, OSError) as e:
            self.num_corrupt += 1
            log.warning("kv tier: block %s not served: %s", key.hex(), e)
            return None, str(e)
        self.num_loaded_disk += 1
        return block, ""

    def _copy_into_pool(self, block_ids: list[int], sources: list[torch.Tensor]) -> None:
        """`sources[j]` ([num_pools, ...] on the CPU) -> pool block `block_ids[j]` in every pool."""
        if len(block_ids) == 1 and not self._pin:  # on the CPU, direct copies are cheapest for one
            for pool, part in zip(self._pools, sources[0].unbind(0), strict=True):
                pool[block_ids[0]].copy_(part)
            return
        # one transfer per block, then one index_copy_ per pool for the whole batch
        stacked = torch.stack([s.to(self._device, non_blocking=True) for s in sources])  # [n, num_pools, ...]
        dst = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        for pool, part in zip(self._pools, stacked.unbind(1), strict=True):
            pool.index_copy_(0, dst, part)

    # ------------------------------------------------------------------ DEMOTE and DROP

    def _demote(self, key: bytes) -> None:
        assert self._files is not None  # validated: disk_blocks > 0 needs a directory
        if self._saves_pending is not None:  # the slab is read on the CPU: device copies must land
            self._saves_pending.synchronize()
            self._saves_pending = None
        slot = self._host[key]
        with self._lock:
            buffer = self._spare.pop() if self._spare else torch.empty_like(self._slab[slot])
        entry = _DiskEntry(buffer.copy_(self._slab[slot]))
        with self._lock:
            del self._host[key]
            self._free_slots.append(slot)
            self._disk[key] = entry
        self._disk_bytes += self._files.file_bytes(key)
        self._writes.append(self._io.submit(self._write, key, entry))
        while len(self._writes) > MAX_QUEUED_WRITES:  # a slow disk: wait, do not hold ever more buffers
            self._writes.popleft().result()
        while self._writes and self._writes[0].done():
            self._writes.popleft()
        self.num_demoted += 1

    def _write(self, key: bytes, entry: _DiskEntry) -> None:
        """On the I/O thread: the demoted block's file."""
        assert self._files is not None and entry.data is not None
        failed = False
        if not entry.dropped:
            try:
                self._files.write(key, entry.data)
            except OSError as e:
                log.warning("kv tier: block %s not written (its LOAD will miss): %s", key.hex(), e)
                failed = True
        with self._lock:
            if len(self._spare) < SPARE_BUFFERS:
                self._spare.append(entry.data)
            entry.data, entry.failed = None, failed
            self.num_write_errors += failed

    def _drop(self, key: bytes) -> None:
        if self._forget(key):
            self.num_dropped += 1

    def _forget(self, key: bytes) -> bool:
        """Remove `key` from both tiers (its file on the I/O thread) and the import area;
        whether it was held."""
        imported = self.imports.discard(key)
        with self._lock:
            slot = self._host.pop(key, None)
            if slot is not None:
                self._free_slots.append(slot)
            entry = self._disk.pop(key, None)
            read = self._prefetched.pop(key, None)
            if entry is not None:
                entry.dropped = True
        if read is not None:
            read.cancel()
        if entry is not None and self._files is not None:
            self._disk_bytes -= self._files.file_bytes(key)
            self._io.submit(self._files.remove, key)
        return imported or slot is not None or entry is not None

    # ------------------------------------------------------------------ invariants

    def check_integrity(self) -> None:
        """`TierIntegrityError` unless the invariants (class docstring) hold; waits for the I/O
        thread first (call it while the stage is idle)."""
        self.flush()
        try:
            self.imports.check_integrity()
        except ImportIntegrityError as e:
            raise TierIntegrityError(str(e)) from None
        with self._lock:
            host, disk, free = dict(self._host), dict(self._disk), list(self._free_slots)
            prefetched = set(self._prefetched)
        if len(host) > self.host_blocks or len(disk) > self.disk_blocks:
            raise TierIntegrityError(f"over a bound: {len(host)} host, {len(disk)} disk blocks")
        if sorted([*host.values(), *free]) != list(range(self.host_blocks)):
            raise TierIntegrityError(f"host slots lost or held twice: held {sorted(host.values())}, free {free}")
        if host.keys() & disk.keys():
            raise TierIntegrityError(f"{len(host.keys() & disk.keys())} keys in both tiers")
        if not prefetched <= disk.keys() or len(prefetched) > self.prefetch_blocks:
            raise TierIntegrityError(f"{len(prefetched)} prefetched blocks, not all of them on disk")
        if any(entry.data is not None for entry in disk.values()):
            raise TierIntegrityError("a write still pending after a flush")
        if self._files is None:
            if disk:
                raise TierIntegrityError("disk blocks without a disk directory")
            return
        if self._disk_bytes != sum(self._files.file_bytes(key) for key in disk):
            raise TierIntegrityError(f"disk_bytes {self._disk_bytes} disagrees with the index")
        expected = {self._files.path(k).name: self._files.file_bytes(k) for k, e in disk.items() if not e.failed}
        found = self._files.listing()
        if found != expected:
            extra, lost = sorted(found.keys() - expected.keys()), sorted(expected.keys() - found.keys())
            sized = sorted(n for n in found.keys() & expected.keys() if found[n] != expected[n])
            raise TierIntegrityError(f"files differ from the index: extra {extra}, lost {lost}, sized {sized}")
