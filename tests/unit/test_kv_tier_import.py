"""The import area of a stage's KV tier (P/D disaggregation, issue 39): `KVTierStore.put_imported`
(worker_svc/execution/kv_import.py under worker_svc/execution/kv_tier.py).

On a real small PagedKVCache, CPU only: a LOAD of an imported key copies it into the pool
byte-exactly and consumes it; a DROP, a miss and a reset forget it; the bound is all or nothing;
old entries expire (a stepped clock); a store with no host and no disk tier holds imports, and
`_fit` never drops an imported key a LOAD reads; the stage builds its store from
`--kv-import-blocks` alone.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.step import TIER_DROP, TIER_LOAD, TIER_SAVE, TierOp
from worker_svc.config import WorkerConfig
from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.execution.kv_import import IMPORT_TTL_S, ImportArea
from worker_svc.execution.kv_tier import ImportAreaFullError, KVTierStore, TierIntegrityError, TierMissError
from worker_svc.service.loading import attach_kv_tier

NUM_BLOCKS = 8


def make_cache(dtype: torch.dtype = torch.float32) -> PagedKVCache:
    cache = PagedKVCache(2, NUM_BLOCKS, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(0)
    for k, v in cache.slot_pools:
        k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    return cache


def pool_block(cache: PagedKVCache, b: int) -> torch.Tensor:
    return torch.stack([t[b] for pair in cache.slot_pools for t in pair])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def load(k: int, b: int) -> TierOp:
    return TierOp(TIER_LOAD, key(k), b)


def save(k: int, b: int) -> TierOp:
    return TierOp(TIER_SAVE, key(k), b)


def drop(k: int) -> TierOp:
    return TierOp(TIER_DROP, key(k))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pulled(store: KVTierStore, seed: int) -> torch.Tensor:
    """A block as a pull brings it: this store's layout, other bytes than any pool block."""
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(store.block_shape, generator=gen).to(store.dtype)


@pytest.fixture
def cache() -> PagedKVCache:
    return make_cache()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(cache: PagedKVCache, clock: Clock):
    """Imports only (a decode stage with no --kv-offload): no host, no disk tier."""
    s = KVTierStore(cache, host_blocks=0, disk_dir=None, disk_blocks=0, import_blocks=3, clock=clock)
    yield s
    s.check_integrity()
    s.close()


# ---------------------------------------------------------------------- LOAD, DROP, reset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_load_copies_the_imported_block_exactly_and_consumes_it(dtype: torch.dtype) -> None:
    cache = make_cache(dtype)
    store = KVTierStore(cache, 0, None, 0, import_blocks=2)
    a, b = pulled(store, 1), pulled(store, 2)
    store.put_imported([(key(1), a), (key(2), b)])
    assert (store.num_import_blocks, store.imports.nbytes) == (2, 2 * store.block_bytes)
    untouched = pool_block(cache, 0)
    store.apply([load(2, 5), load(1, 3)])  # a batch of two
    assert same(pool_block(cache, 3), a) and same(pool_block(cache, 5), b)
    assert same(pool_block(cache, 0), untouched)
    assert (store.num_loaded_import, store.num_import_blocks, store.num_loaded_host) == (2, 0, 0)
    with pytest.raises(TierMissError, match="in neither tier"):  # taken once
        store.apply([load(1, 6)])
    store.put_imported([(key(3), a)])
    store.apply([load(3, 7)])  # one alone: the direct copy
    assert same(pool_block(cache, 7), a)
    store.check_integrity()
    store.close()


def test_a_drop_forgets_an_imported_key(store: KVTierStore) -> None:
    store.put_imported([(key(1), pulled(store, 1)), (key(2), pulled(store, 2))])
    store.apply([drop(1), drop(7)])  # 7: never held, a no-op
    assert list(store.imports.keys()) == [key(2)] and store.num_dropped == 1
    with pytest.raises(TierMissError):
        store.apply([load(1, 0)])


def test_a_reset_forgets_the_imports(store: KVTierStore) -> None:
    store.put_imported([(key(1), pulled(store, 1))])
    store.clear()
    assert store.num_import_blocks == 0


def test_an_imported_key_is_served_before_the_host_tier(cache: PagedKVCache) -> None:
    store = KVTierStore(cache, host_blocks=2, disk_dir=None, disk_blocks=0, import_blocks=2)
    store.apply([save(1, 0)])
    imported = pulled(store, 1)
    store.put_imported([(key(1), imported)])  # (a manager never does both; which copy wins is fixed)
    store.apply([load(1, 4)])
    assert same(pool_block(cache, 4), imported)
    assert (store.num_loaded_import, store.num_host_blocks) == (1, 1)
    store.check_integrity()
    store.close()


# ---------------------------------------------------------------------- the bound, all or nothing


def test_put_is_all_or_nothing_within_the_bound(store: KVTierStore, cache: PagedKVCache) -> None:
    first = pulled(store, 1)
    store.put_imported([(key(1), first), (key(2), pulled(store, 2))])
    with pytest.raises(ImportAreaFullError, match="2 more blocks do not fit"):
        store.put_imported([(key(3), pulled(store, 3)), (key(4), pulled(store, 4))])
    assert list(store.imports.keys()) == [key(1), key(2)]  # neither kept
    replaced = pulled(store, 5)
    store.put_imported([(key(1), replaced), (key(3), pulled(store, 3))])  # 1 replaced, 3 fits
    assert list(store.imports.keys()) == [key(2), key(1), key(3)]
    store.apply([load(1, 0)])
    assert same(pool_block(cache, 0), replaced)


@pytest.mark.parametrize(
    "entry, message",
    [
        ((key(1), torch.zeros(2, 4, 2, 8)), "expected"),  # another shape
        ((key(1), torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)), "expected"),
        ((b"", torch.zeros(4, 4, 2, 8)), "key is 1 to"),
        ((b"k" * 121, torch.zeros(4, 4, 2, 8)), "key is 1 to"),
    ],
)
def test_put_refuses_what_is_not_a_block_of_this_stage(store: KVTierStore, entry, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        store.put_imported([(key(9), pulled(store, 9)), entry])
    assert store.num_import_blocks == 0


def test_no_import_area_holds_nothing(cache: PagedKVCache) -> None:
    store = KVTierStore(cache, host_blocks=2, disk_dir=None, disk_blocks=0)
    assert store.import_blocks == 0
    with pytest.raises(ImportAreaFullError):
        store.put_imported([(key(1), pulled(store, 1))])
    with pytest.raises(ValueError, match="negative bound"):
        KVTierStore(cache, 0, None, 0, import_blocks=-1)


def test_integrity_covers_the_import_bound(store: KVTierStore) -> None:
    store.put_imported([(key(1), pulled(store, 1))])
    store.check_integrity()
    for i in (2, 3, 4):  # past the bound behind put's back: a bug the check must see
        store.imports._entries[key(i)] = (pulled(store, i), 0.0)
    with pytest.raises(TierIntegrityError, match="over the bound"):
        store.check_integrity()
    store.imports.clear()


# ---------------------------------------------------------------------- expiry


def test_old_entries_expire_on_apply(store: KVTierStore, clock: Clock) -> None:
    store.put_imported([(key(1), pulled(store, 1))])
    clock.now += 60
    store.put_imported([(key(2), pulled(store, 2))])
    clock.now += IMPORT_TTL_S - 60 + 0.5  # key 1 is past the limit, key 2 is not
    store.apply([load(2, 1)])
    assert store.imports.num_expired == 1 and store.num_import_blocks == 0
    assert store.num_loaded_import == 1


def test_expired_entries_make_room_for_a_put(store: KVTierStore, clock: Clock) -> None:
    store.put_imported([(key(i), pulled(store, i)) for i in (1, 2, 3)])
    with pytest.raises(ImportAreaFullError):
        store.put_imported([(key(4), pulled(store, 4))])
    clock.now += IMPORT_TTL_S + 1
    store.put_imported([(key(4), pulled(store, 4))])
    assert list(store.imports.keys()) == [key(4)] and store.imports.num_expired == 3
    with pytest.raises(TierMissError):  # an expired key is a miss: the manager recomputes it
        store.apply([load(1, 0)])


def test_a_replaced_entry_starts_its_time_again(clock: Clock) -> None:
    area = ImportArea(2, (1,), torch.float32, ttl_s=10, clock=clock)
    area.put([(b"a", torch.zeros(1)), (b"b", torch.zeros(1))])
    clock.now += 6
    area.put([(b"a", torch.ones(1))])
    clock.now += 6
    assert area.sweep() == 1 and list(area.keys()) == [b"a"]
    area.check_integrity()


# ---------------------------------------------------------------------- fitting plans


def test_fit_keeps_the_loads_of_imported_keys(store: KVTierStore) -> None:
    """With no host tier, SAVEs are not kept (refitted away), DEMOTEs skipped; the LOAD stays."""
    store.put_imported([(key(1), pulled(store, 1))])
    plan = [save(5, 2), load(1, 3), TierOp(3, key(5))]  # SAVE, LOAD, DEMOTE
    assert store._fit(plan) == [load(1, 3)]
    store.apply(plan)
    assert store.num_loaded_import == 1


def test_a_full_host_tier_never_drops_an_imported_key_for_room(cache: PagedKVCache) -> None:
    store = KVTierStore(cache, host_blocks=1, disk_dir=None, disk_blocks=0, import_blocks=2)
    store.apply([save(5, 0)])
    imported = pulled(store, 1)
    store.put_imported([(key(1), imported)])
    fitted = store._fit([save(6, 2), load(1, 3)])
    assert fitted == [drop(5), save(6, 2), load(1, 3)]  # the host's key goes, not the import
    store.apply([save(6, 2), load(1, 3)])
    assert same(pool_block(cache, 3), imported)
    store.check_integrity()
    store.close()


def test_a_save_of_an_imported_key_replaces_it(cache: PagedKVCache) -> None:
    store = KVTierStore(cache, host_blocks=2, disk_dir=None, disk_blocks=0, import_blocks=2)
    store.put_imported([(key(1), pulled(store, 1))])
    assert store._fit([save(1, 2)]) == [drop(1), save(1, 2)]
    saved = pool_block(cache, 2)
    store.apply([save(1, 2)])
    store.apply([load(1, 6)])
    assert same(pool_block(cache, 6), saved)
    assert store.num_import_blocks == 0
    store.check_integrity()
    store.close()


def test_a_save_of_an_imported_key_without_a_host_tier_is_not_kept(store: KVTierStore, cache: PagedKVCache) -> None:
    """No slot to save into: the SAVE is skipped, and the import (the same key's bytes) stays."""
    imported = pulled(store, 1)
    store.put_imported([(key(1), imported)])
    assert store._fit([save(1, 2)]) == []
    store.apply([save(1, 2), load(1, 5)])
    assert same(pool_block(cache, 5), imported)


def test_a_save_of_a_disk_key_into_a_full_host_tier_makes_room(cache: PagedKVCache, tmp_path: Path) -> None:
    """The copy dropped from disk frees no host slot: the host's oldest key goes too."""
    store = KVTierStore(cache, host_blocks=1, disk_dir=tmp_path, disk_blocks=2)
    store.apply([save(1, 0), TierOp(3, key(1)), save(2, 1)])  # 1 on disk, 2 fills the host
    saved = pool_block(cache, 3)
    assert store._fit([save(1, 3)]) == [drop(1), drop(2), save(1, 3)]
    store.apply([save(1, 3), load(1, 6)])
    assert same(pool_block(cache, 6), saved)
    assert (store.num_host_blocks, store.num_disk_blocks) == (1, 0)  # key 1, saved again
    store.check_integrity()
    store.close()


def test_puts_from_another_thread_while_plans_apply(cache: PagedKVCache) -> None:
    """The event loop puts pulls while the compute thread loads them: every LOAD of a key put
    before it gets that key's bytes, and the bookkeeping holds."""
    store = KVTierStore(cache, 0, None, 0, import_blocks=64)
    blocks = {i: pulled(store, i) for i in range(40)}
    ready = [threading.Event() for _ in blocks]

    def putter() -> None:
        for i, block in blocks.items():
            store.put_imported([(key(i), block)])
            ready[i].set()

    thread = threading.Thread(target=putter)
    thread.start()
    for i in blocks:
        ready[i].wait(5)
        store.apply([load(i, i % NUM_BLOCKS)])
        assert same(pool_block(cache, i % NUM_BLOCKS), blocks[i])
    thread.join()
    assert (store.num_loaded_import, store.num_import_blocks) == (40, 0)
    store.check_integrity()
    store.close()


# ---------------------------------------------------------------------- the stage builds it


def _runner(cache: PagedKVCache, groups: int = 1) -> SimpleNamespace:
    return SimpleNamespace(kv_cache=cache, num_kv_groups=groups, kv_tier=None)


def test_the_stage_builds_an_import_area_without_a_tier(cache: PagedKVCache, tmp_path: Path) -> None:
    runner = _runner(cache)
    attach_kv_tier(runner, WorkerConfig(model="m", kv_import_blocks=5))
    tier = runner.kv_tier
    assert (tier.host_blocks, tier.disk_blocks, tier.import_blocks) == (0, 0, 5)
    tier.close()
    both = _runner(cache)
    attach_kv_tier(both, WorkerConfig(model="m", kv_offload="host:3b", kv_import_blocks=2))
    assert (both.kv_tier.host_blocks, both.kv_tier.import_blocks) == (3, 2)
    both.kv_tier.close()
    none = _runner(cache)
    attach_kv_tier(none, WorkerConfig(model="m"))
    assert none.kv_tier is None


def test_the_stage_refuses_an_import_area_it_cannot_hold(cache: PagedKVCache) -> None:
    with pytest.raises(ValueError, match="kv_import_blocks: an import area needs one KV group"):
        attach_kv_tier(_runner(cache, groups=2), WorkerConfig(model="m", kv_import_blocks=5))
    with pytest.raises(ValueError, match="negative bound"):
        attach_kv_tier(_runner(cache), WorkerConfig(model="m", kv_import_blocks=-1))
