"""A decode stage's import area (P/D disaggregation, issue 39): blocks pulled from the same stage
of a prefill replica (`PullBlocks`, worker_svc/service/kv_transfer.py), each kept under the
decode KV manager's prefix key until a `TIER_LOAD` of that key copies it into the pool and
consumes it (`KVTierStore`, worker_svc/execution/kv_tier.py, serves LOADs from here first).

An entry is the stage's layers' part of one block on the CPU, laid out as the tier's blocks,
`[2 * num_slot_pools, block_size, num_kv_heads, head_dim]`. The area holds at most `max_blocks`
entries, taken as pulls arrive (all of a pull or none) and given back when loaded, dropped
(`TIER_DROP`, a pipeline reset) or older than `ttl_s`: the KV manager forgets an import it has
not loaded after 60 s, so an entry left past `IMPORT_TTL_S` is one nobody will ask for.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

IMPORT_TTL_S = 120.0  # twice the KV manager's own limit for an import it has not loaded


class ImportAreaFullError(Exception):
    """`put` found no room for the entries: the area would hold more than its bound. Nothing
    was kept (try later, when loads have consumed entries or old ones have expired)."""


class ImportIntegrityError(AssertionError):
    """`ImportArea.check_integrity()` found the area inconsistent (a bug)."""


class ImportArea:
    """Pulled blocks by key, oldest first, each taken once.

    Invariants (`check_integrity`): at most `max_blocks` entries; each a CPU tensor of
    `block_shape` and `dtype`; arrival times non-decreasing in order (a replaced key moves to
    the end). Thread-safe: every method holds the area's lock for bookkeeping only (a block's
    bytes are checked before, and copied by the caller after).
    """

    def __init__(
        self,
        max_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        ttl_s: float = IMPORT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks < 0 or ttl_s <= 0:
            raise ValueError(f"kv import: {max_blocks=} must be >= 0 and {ttl_s=} positive")
        self.max_blocks, self.block_shape, self.dtype = max_blocks, tuple(block_shape), dtype
        self.ttl_s, self._clock = ttl_s, clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, float]] = OrderedDict()  # key -> (block, arrived)
        self.num_imported = self.num_expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> Iterator[bytes]:
        """The keys held now, oldest first (a snapshot)."""
        with self._lock:
            return iter(list(self._entries))

    def put(self, entries: Sequence[tuple[bytes, torch.Tensor]]) -> None:
        """Keep every `(key, block)`, replacing an entry of the same key, or none of them:
        ValueError for a block of another shape, dtype or device; `ImportAreaFullError` when the
        area would then hold more than `max_blocks` (after expired entries are swept)."""
        for key, block in entries:
            if block.device.type != "cpu" or tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
                raise ValueError(
                    f"kv import: block {key.hex()[:16]} is {block.dtype} {tuple(block.shape)} on {block.device}, "
                    f"expected {self.dtype} {self.block_shape} on the CPU"
                )
        with self._lock:
            self._sweep_locked()
            new = {key for key, _ in entries if key not in self._entries}
            if len(self._entries) + len(new) > self.max_blocks:
                raise ImportAreaFullError(
                    f"kv import: {len(new)} more blocks do not fit: {len(self._entries)} of "
                    f"{self.max_blocks} held (--kv-import-blocks)"
                )
            now = self._clock()
            for key, block in entries:
                self._entries.pop(key, None)  # a replaced key is new again: it goes to the end
                self._entries[key] = (block, now)
            self.num_imported += len(entries)

    def pop(self, key: bytes) -> torch.Tensor | None:
        """The key's block, taken out of the area; None when it is not here."""
        with self._lock:
            entry = self._entries.pop(key, None)
        return None if entry is None else entry[0]

    def discard(self, key: bytes) -> bool:
        """Forget the key; whether it was held."""
        with self._lock:
            return self._entries.pop(key, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def sweep(self) -> int:
        """Forget the entries older than `ttl_s`; how many."""
        with self._lock:
            return self._sweep_locked()

    def _sweep_locked(self) -> int:
        oldest_kept, swept = self._clock() - self.ttl_s, 0
        while self._entries:
            key, (_, arrived) = next(iter(self._entries.items()))
            if arrived > oldest_kept:
                break
            del self._entries[key]
            swept += 1
        self.num_expired += swept
        return swept

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(block.nbytes for block, _ in self._entries.values())

    def check_integrity(self) -> None:
        """`ImportIntegrityError` unless the invariants (class docstring) hold."""
        with self._lock:
            entries = list(self._entries.items())
        if len(entries) > self.max_blocks:
            raise ImportIntegrityError(f"{len(entries)} imported blocks, over the bound {self.max_blocks}")
        arrivals = [arrived for _, (_, arrived) in entries]
        if arrivals != sorted(arrivals):
            raise ImportIntegrityError("imported blocks out of arrival order")
        for key, (block, _) in entries:
            if tuple(block.shape) != self.block_shape or block.dtype != self.dtype or block.device.type != "cpu":
                raise ImportIntegrityError(f"imported block {key.hex()[:16]}: {block.dtype} {tuple(block.shape)}")
