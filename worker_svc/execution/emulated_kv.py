"""An emulated stage's side of the KV manager's tier ops: P/D disaggregation's import area, keys
without bytes (issue 39; the emulated device: worker_svc/execution/emulated.py).

An emulated stage holds no KV tensors, so a decode replica's emulated stage keeps, of each block
it pulled from a prefill replica (`PullBlocks`, worker_svc/service/kv_transfer.py, which waits the
time the profile's KV link would take), only the decode KV manager's key: the same `ImportArea`
as a real stage's (worker_svc/execution/kv_import.py: the bound `--kv-import-blocks`, the TTL,
all of a pull or none), each entry an empty tensor. The plan's tier ops are then what a real
stage's `KVTierStore` does with its import area and no host or disk tier:

- LOAD of a held key consumes it (nothing is copied: the pool has no bytes either); a LOAD of a
  key not held fails the step with `TierMissError` once the plan's other ops are applied (the
  KV manager forgets the key and the tokens are recomputed), as a real stage's miss does;
- DROP forgets the key (missing is fine); a pipeline reset (`clear`) forgets every key;
- SAVE and DEMOTE are refused (`InvalidPlanError`, the plan changes nothing): an emulated stage
  models no host or disk tier (`--kv-offload`).

Threads, as the real store's: `apply`, `clear` on the compute thread; `put_keys` from the event
loop; the area's lock covers its bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from services.step import TIER_DROP, TIER_LOAD, TierOp
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.kv_import import IMPORT_TTL_S, ImportArea, ImportIntegrityError
from worker_svc.execution.kv_tier import MAX_KEY_BYTES, TierIntegrityError, TierMissError

NO_BYTES = torch.empty(0, dtype=torch.uint8)  # an emulated block's bytes: none (shared, never written)
_KIND_NAMES = {TIER_LOAD: "LOAD", TIER_DROP: "DROP"}


class EmulatedKVTier:
    """The import area of an emulated stage: pulled keys, each loaded (taken) once.

    Invariants (`check_integrity`): those of `ImportArea` (at most `import_blocks` keys, in
    arrival order), every entry `NO_BYTES`'s shape. Counters (`num_*`) are cumulative across
    `clear`.
    """

    def __init__(
        self,
        num_pool_blocks: int,
        import_blocks: int,
        *,
        import_ttl_s: float = IMPORT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_pool_blocks < 1 or import_blocks < 1:
            raise ValueError(f"emulated kv import: {num_pool_blocks=} and {import_blocks=} must be >= 1")
        self.num_pool_blocks = num_pool_blocks
        self.imports = ImportArea(import_blocks, NO_BYTES.shape, NO_BYTES.dtype, ttl_s=import_ttl_s, clock=clock)
        self.num_loaded_import = self.num_dropped = self.num_missed = 0

    @property
    def import_blocks(self) -> int:
        """The import area's bound (`--kv-import-blocks`)."""
        return self.imports.max_blocks

    @property
    def num_import_blocks(self) -> int:
        return len(self.imports)

    def put_keys(self, keys: Sequence[bytes]) -> None:
        """Keep pulled blocks' keys, all or none: `ImportAreaFullError` when the area (after
        sweeping expired keys) has no room; ValueError for a key of the wrong length."""
        for key in keys:
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"kv import: a key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        self.imports.put([(key, NO_BYTES) for key in keys])

    def check(self, ops: Sequence[TierOp], step_id: int) -> None:
        """InvalidPlanError unless every op is one this stage carries out: a LOAD or DROP with a
        key of 1 to MAX_KEY_BYTES bytes, a LOAD into a pool block in range, no block loaded twice.
        Changes nothing."""
        load_targets: set[int] = set()
        for i, op in enumerate(ops):
            where = f"micro-batch {step_id}, kv tier op {i}"
            if op.kind not in _KIND_NAMES:
                raise InvalidPlanError(
                    f"{where}: kind {op.kind} moves KV blocks to or from a host or disk tier, which an "
                    "emulated stage does not model (no --kv-offload on an emulated device)"
                )
            if not 0 < len(op.key) <= MAX_KEY_BYTES:
                raise InvalidPlanError(f"{where}: a key is 1 to {MAX_KEY_BYTES} bytes, got {len(op.key)}")
            if op.kind == TIER_LOAD:
                if not 0 <= op.block_id < self.num_pool_blocks or op.block_id in load_targets:
                    raise InvalidPlanError(
                        f"{where}: LOAD into block {op.block_id}: out of range [0, {self.num_pool_blocks}) "
                        "or loaded twice"
                    )
                load_targets.add(op.block_id)

    def apply(self, ops: Sequence[TierOp]) -> None:
        """Carry out checked ops in order (`check` first): a LOAD takes its key, a DROP forgets
        its key. `TierMissError` naming the LOADs whose key was not held, after the others."""
        self.imports.sweep()
        misses: list[tuple[bytes, str]] = []
        for op in ops:
            if op.kind == TIER_LOAD:
                if self.imports.pop(op.key) is None:
                    misses.append((op.key, "not in the import area (emulated)"))
                else:
                    self.num_loaded_import += 1
            elif self.imports.discard(op.key):
                self.num_dropped += 1
        if misses:
            self.num_missed += len(misses)
            raise TierMissError(misses)

    def prefetch(self, ops: Sequence[TierOp]) -> None:
        """Nothing to read ahead: no disk tier (the stage's service calls it as it calls a real
        store's)."""

    def clear(self) -> None:
        """A pipeline reset: forget every key."""
        self.imports.clear()

    def close(self) -> None:
        self.clear()

    def check_integrity(self) -> None:
        """`TierIntegrityError` unless the invariants (class docstring) hold."""
        try:
            self.imports.check_integrity()
        except ImportIntegrityError as e:
            raise TierIntegrityError(str(e)) from None
