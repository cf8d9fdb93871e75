"""Hash-chain keys of full blocks (services/prefix_hash.py), the prefix-cache index and the
LRU of evictable blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Protocol

from services.kv_errors import IntegrityError
from services.prefix_hash import ROOT_KEY, TOKEN_BYTES, hash_block, pack_token_ids, unpack_token_ids  # noqa: F401 - the chain is shared with routers

HashFn = Callable[[bytes, str | None, bytes], bytes]


class CacheListener(Protocol):
    """Told of every change to the cache's contents (kvcache_svc.events.EventLog)."""

    def stored(self, key: bytes, parent_key: bytes, namespace: str | None, token_bytes: bytes) -> None: ...

    def removed(self, key: bytes) -> None: ...

    def cleared(self) -> None: ...


class CachedBlock(NamedTuple):
    """What a cached block holds: its key and the exact input that key was hashed from.

    `group` is the KV sub-group whose page it is (services/kv_layout.py): a hybrid model
    caches one page per sub-group under the same chain key; only group 0's pages are
    announced as KV events (routers count block positions, not pages).
    """

    key: bytes
    parent_key: bytes
    namespace: str | None
    token_bytes: bytes
    group: int = 0

    def matches(self, parent_key: bytes, namespace: str | None, token_bytes: bytes) -> bool:
        return self.token_bytes == token_bytes and self.parent_key == parent_key and self.namespace == namespace


class PrefixHit(NamedTuple):
    block_id: int
    key: bytes


class PrefixCache:
    """Index of full, computed blocks by hash-chain key, and the LRU of evictable ones.

    Invariants: `key -> block` and `block -> CachedBlock` are inverse maps; a block is
    *evictable* when it is cached and nobody holds it, and exactly the evictable blocks are
    in the LRU, least recently used first. The manager parks a cached block in the LRU when
    its last holder lets go — a sequence's blocks last to first, so a sequence's tail is
    evicted before its head, which more sequences share — and unparks it on a prefix hit.

    A hit requires the stored block's own hash input (parent key, namespace, tokens) to equal
    the query's, so even a colliding hash never returns a block holding other tokens; the
    first block registered under a key keeps it.
    """

    def __init__(self, hash_fn: HashFn = hash_block, listener: CacheListener | None = None) -> None:
        self._hash_fn = hash_fn
        self.listener = listener  # told what enters and leaves (KV events)
        self._block_by_key: dict[bytes | tuple[bytes, int], int] = {}
        self._entry_by_block: dict[int, CachedBlock] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entry_by_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._lru)

    def key_of(self, parent_key: bytes, namespace: str | None, token_bytes: bytes) -> bytes:
        return self._hash_fn(parent_key, namespace, token_bytes)

    def lookup(self, namespace: str | None, token_bytes: bytes, block_size: int) -> list[PrefixHit]:
        """The cached blocks of the longest cached prefix of `token_bytes` (full blocks only)."""
        stride = block_size * TOKEN_BYTES
        hits: list[PrefixHit] = []
        parent_key = ROOT_KEY
        for start in range(0, len(token_bytes) - stride + 1, stride):
            block_tokens = token_bytes[start : start + stride]
            key = self._hash_fn(parent_key, namespace, block_tokens)
            block_id = self._block_by_key.get(key)
            if block_id is None:
                break
            if not self._entry_by_block[block_id].matches(parent_key, namespace, block_tokens):
                break  # a hash collision: a miss, never wrong tokens
            hits.append(PrefixHit(block_id, key))
            parent_key = key
        return hits

    def find(self, key: bytes, group: int, parent_key: bytes, namespace: str | None, token_bytes: bytes) -> int | None:
        """Sub-group `group`'s cached page of the block keyed `key` (found by `lookup` in
        group 0), or None; a colliding entry is a miss."""
        block_id = self._block_by_key.get(_index_key(key, group))
        if block_id is None or not self._entry_by_block[block_id].matches(parent_key, namespace, token_bytes):
            return None
        return block_id

    def register(self, block_id: int, entry: CachedBlock) -> bool:
        """Make a computed full block findable; False if its key (or the block) is taken."""
        index_key = _index_key(entry.key, entry.group)
        if index_key in self._block_by_key or block_id in self._entry_by_block:
            return False
        self._block_by_key[index_key] = block_id
        self._entry_by_block[block_id] = entry
        if self.listener is not None and not entry.group:
            self.listener.stored(entry.key, entry.parent_key, entry.namespace, entry.token_bytes)
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entry_by_block

    def entry(self, block_id: int) -> CachedBlock | None:
        return self._entry_by_block.get(block_id)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._lru

    def park(self, block_id: int) -> None:
        """A cached block nobody holds becomes evictable, most recently used."""
        if block_id not in self._entry_by_block:
            raise ValueError(f"block {block_id} is not cached")
        self._lru[block_id] = None

    def unpark(self, block_id: int) -> None:
        del self._lru[block_id]

    def evict(self) -> tuple[int, CachedBlock]:
        """Forget the least recently used evictable block; its id (still parked) and what it held."""
        block_id, _ = self._lru.popitem(last=False)
        entry = self._entry_by_block.pop(block_id)
        del self._block_by_key[_index_key(entry.key, entry.group)]
        if self.listener is not None and not entry.group:
            self.listener.removed(entry.key)
        return block_id, entry

    def evictable_block_ids(self) -> tuple[int, ...]:
        """Evictable blocks, next to be evicted first."""
        return tuple(self._lru)

    def entries(self) -> list[CachedBlock]:
        """Every cached block of group 0 (a snapshot for KV-event subscribers)."""
        return [e for e in self._entry_by_block.values() if not e.group]

    def clear(self) -> None:
        self._block_by_key.clear()
        self._entry_by_block.clear()
        self._lru.clear()
        if self.listener is not None:
            self.listener.cleared()

    def check_integrity(self, ref_count: Callable[[int], int]) -> None:
        """Maps are inverse, keys match their hash input, and the LRU holds exactly the
        cached blocks with ref count 0. Raises `IntegrityError`."""
        if len(self._block_by_key) != len(self._entry_by_block):
            raise IntegrityError("key index and block index differ in size")
        for block_id, entry in self._entry_by_block.items():
            if self._block_by_key.get(_index_key(entry.key, entry.group)) != block_id:
                raise IntegrityError(f"cached block {block_id} not indexed by its key")
            if entry.key != self._hash_fn(entry.parent_key, entry.namespace, entry.token_bytes):
                raise IntegrityError(f"cached block {block_id} key is not its hash")
            if (ref_count(block_id) == 0) != (block_id in self._lru):
                raise IntegrityError(
                    f"cached block {block_id}: ref count {ref_count(block_id)}, "
                    f"{'in' if block_id in self._lru else 'not in'} the LRU"
                )
        for block_id in self._lru:
            if block_id not in self._entry_by_block:
                raise IntegrityError(f"evictable block {block_id} is not cached")


def _index_key(key: bytes, group: int) -> bytes | tuple[bytes, int]:
    """Group 0's pages are indexed by their chain key, other sub-groups' by (key, group)."""
    return (key, group) if group else key
