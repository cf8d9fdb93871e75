"""KVTierStore (worker_svc/execution/kv_tier.py): a stage's host and disk tiers below its KV pool.

On a real small PagedKVCache (2 layers), CPU only: round trips are byte-exact (float32 and
bfloat16), through host memory, a disk file, a queued write and a prefetch; a damaged file
(payload byte, truncation, another key's header) is never served; bounds and contradictions
are refused whole; a seeded random run of manager-shaped plans, with the next plan prefetched on
another thread while the current one applies, keeps every invariant and every block's bytes.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from services.step import TIER_DEMOTE, TIER_DROP, TIER_LOAD, TIER_SAVE, TierOp
from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.execution.kv_tier import KVTierStore, TierIntegrityError, TierMissError
from worker_svc.execution.kv_tier_files import MAGIC

NUM_BLOCKS = 8


def make_cache(dtype: torch.dtype = torch.float32, num_layers: int = 2, device: str = "cpu") -> PagedKVCache:
    cache = PagedKVCache(num_layers, NUM_BLOCKS, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    for k, v in cache.slot_pools:
        k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    return cache


def block_of(cache: PagedKVCache, b: int) -> list[torch.Tensor]:
    return [t[b].clone() for pair in cache.slot_pools for t in pair]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Byte-equal (NaN-safe): the tier moves bits, not values."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def scribble(cache: PagedKVCache, b: int) -> None:
    """The step computes something else into block `b`."""
    for k, v in cache.slot_pools:
        k[b].normal_()
        v[b].normal_()


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4  # 16 bytes, like a prefix hash


def save(k: int, b: int) -> TierOp:
    return TierOp(TIER_SAVE, key(k), b)


def load(k: int, b: int) -> TierOp:
    return TierOp(TIER_LOAD, key(k), b)


def demote(k: int) -> TierOp:
    return TierOp(TIER_DEMOTE, key(k))


def drop(k: int) -> TierOp:
    return TierOp(TIER_DROP, key(k))


@pytest.fixture
def cache() -> PagedKVCache:
    return make_cache()


@pytest.fixture
def store(cache: PagedKVCache, tmp_path: Path):
    s = KVTierStore(cache, host_blocks=4, disk_dir=tmp_path, disk_blocks=4)
    yield s
    s.close()


def file_of(tmp_path: Path, k: int) -> Path:
    return tmp_path / "stage0" / (key(k).hex() + ".kv")


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_then_load_restores_the_block_exactly(dtype: torch.dtype, tmp_path: Path) -> None:
    cache = make_cache(dtype)
    store = KVTierStore(cache, host_blocks=2, disk_dir=tmp_path, disk_blocks=2)
    original = block_of(cache, 2)
    store.apply([save(1, 2)])
    scribble(cache, 2)
    assert not same(block_of(cache, 2), original)
    store.apply([load(1, 5)])  # into another block
    assert same(block_of(cache, 5), original)
    store.apply([load(1, 2)])  # and back into its own
    assert same(block_of(cache, 2), original)
    assert (store.num_saved, store.num_loaded_host, store.num_host_blocks) == (1, 2, 1)
    assert store.host_bytes == store.block_bytes == 2 * 2 * 4 * 2 * 8 * dtype.itemsize
    store.check_integrity()
    store.close()


def test_loads_of_one_plan_go_as_a_batch(store: KVTierStore, cache: PagedKVCache) -> None:
    originals = {b: block_of(cache, b) for b in (0, 1, 2)}
    store.apply([save(0, 0), save(1, 1), save(2, 2)])
    for b in (0, 1, 2):
        scribble(cache, b)
    untouched = block_of(cache, 7)
    store.apply([load(2, 3), load(0, 4), load(1, 5)])
    assert same(block_of(cache, 3), originals[2])
    assert same(block_of(cache, 4), originals[0])
    assert same(block_of(cache, 5), originals[1])
    assert same(block_of(cache, 7), untouched)


def test_a_save_reads_the_block_before_a_later_load_of_the_same_plan_overwrites_it(
    store: KVTierStore, cache: PagedKVCache
) -> None:
    """The manager saves an evicted block and reuses it for a tier hit in one step: order holds."""
    a, b = block_of(cache, 1), block_of(cache, 2)
    store.apply([save(1, 1), save(2, 2)])
    store.apply([drop(2), save(3, 2), load(1, 2)])
    assert same(block_of(cache, 2), a)
    store.apply([load(3, 6)])
    assert same(block_of(cache, 6), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demote_then_load_from_disk(dtype: torch.dtype, tmp_path: Path) -> None:
    cache = make_cache(dtype)
    store = KVTierStore(cache, host_blocks=2, disk_dir=tmp_path, disk_blocks=2)
    original = block_of(cache, 3)
    store.apply([save(7, 3), demote(7)])
    store.flush()
    path = file_of(tmp_path, 7)
    assert path.read_bytes().startswith(MAGIC)
    assert path.stat().st_size == store.disk_bytes > store.block_bytes
    assert (store.num_host_blocks, store.num_disk_blocks, store.num_demoted) == (0, 1, 1)
    scribble(cache, 3)
    store.apply([load(7, 6)])
    assert same(block_of(cache, 6), original)
    assert (store.num_loaded_disk, store.num_loaded_host) == (1, 0)
    store.check_integrity()
    store.close()


def test_a_load_before_the_write_lands_is_served_from_memory(store: KVTierStore, cache: PagedKVCache) -> None:
    original = block_of(cache, 1)
    release = threading.Event()
    store._io.submit(release.wait)  # hold the I/O thread: the DEMOTE's write stays queued
    store.apply([save(1, 1), demote(1)])
    store.apply([load(1, 4)])
    release.set()
    assert same(block_of(cache, 4), original)
    assert store.num_loaded_disk == 1
    store.check_integrity()


def test_prefetch_reads_ahead_and_the_load_takes_its_bytes(
    store: KVTierStore, cache: PagedKVCache, tmp_path: Path
) -> None:
    original = block_of(cache, 2)
    store.apply([save(5, 2), demote(5)])
    store.flush()
    plan = [load(5, 6)]
    store.prefetch(plan)
    store.flush()  # the read has run ...
    file_of(tmp_path, 5).unlink()  # ... so the file is no longer needed
    store.apply(plan)
    assert same(block_of(cache, 6), original)
    assert (store.num_prefetched, store.num_loaded_disk, store.num_corrupt) == (1, 1, 0)


def test_prefetch_skips_what_is_in_memory_and_keeps_its_bound(cache: PagedKVCache, tmp_path: Path) -> None:
    store = KVTierStore(cache, host_blocks=4, disk_dir=tmp_path, disk_blocks=4, prefetch_blocks=1)
    originals = {b: block_of(cache, b) for b in (0, 1, 2)}
    store.apply([save(0, 0), save(1, 1), save(2, 2), demote(1), demote(2)])
    store.flush()
    plan = [load(0, 4), load(1, 5), load(2, 6)]
    store.prefetch(plan)  # 0 is in host memory; 2 pushes out 1's read
    assert store.num_prefetched == 2
    assert list(store._prefetched) == [key(2)]
    store.apply(plan)
    for b, target in ((0, 4), (1, 5), (2, 6)):
        assert same(block_of(cache, target), originals[b])
    store.check_integrity()
    store.close()


# ---------------------------------------------------------------------- files never served damaged


def flip_payload_byte(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def truncate_header(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])


def another_keys_file(path: Path, other: Path) -> None:
    path.write_bytes(other.read_bytes())


def trailing_bytes(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


def bad_magic(path: Path, other: Path) -> None:
    path.write_bytes(b"X" + path.read_bytes()[1:])


def missing(path: Path, other: Path) -> None:
    path.unlink()


DAMAGE = [flip_payload_byte, truncate, truncate_header, another_keys_file, trailing_bytes, bad_magic, missing]


@pytest.mark.parametrize("prefetched", [False, True], ids=["read-now", "prefetched"])
@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_file_is_a_miss_never_data(
    damage, prefetched: bool, store: KVTierStore, cache: PagedKVCache, tmp_path: Path
) -> None:
    store.apply([save(1, 1), save(2, 2), demote(1), demote(2)])
    store.flush()
    damage(file_of(tmp_path, 1), file_of(tmp_path, 2))
    before = block_of(cache, 5)
    plan = [load(1, 5), load(2, 6)]
    if prefetched:
        store.prefetch(plan)
    with pytest.raises(TierMissError) as caught:
        store.apply(plan)
    assert caught.value.keys == (key(1),)
    assert key(1).hex() in str(caught.value)
    assert same(block_of(cache, 5), before)  # nothing loaded into the missed block
    assert same(block_of(cache, 6), block_of(cache, 2))  # the other LOAD was applied
    assert (store.num_corrupt, store.num_missed, store.num_loaded_disk) == (1, 1, 1)
    assert store.num_disk_blocks == 1  # the missed key is forgotten, its file removed
    store.check_integrity()
    assert not file_of(tmp_path, 1).exists()
    store.apply([drop(1)])  # the manager's DROP of it is a no-op
    assert store.num_dropped == 0


def test_a_key_in_neither_tier_is_a_miss_but_not_corrupt(store: KVTierStore, cache: PagedKVCache) -> None:
    a = block_of(cache, 0)
    with pytest.raises(TierMissError, match="in neither tier") as caught:
        store.apply([load(9, 3), save(1, 0)])
    assert caught.value.keys == (key(9),)
    assert (store.num_corrupt, store.num_saved) == (0, 1)  # the SAVE after the miss was applied
    store.apply([load(1, 4)])
    assert same(block_of(cache, 4), a)


def test_a_write_that_fails_makes_its_load_miss(
    store: KVTierStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(key: bytes, block: torch.Tensor) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store._files, "write", disk_full)
    store.apply([save(1, 1), demote(1)])
    store.flush()
    assert store.num_write_errors == 1
    store.check_integrity()  # a failed write has no file, as the index says
    with pytest.raises(TierMissError, match="could not be written"):
        store.apply([load(1, 3)])
    assert store.num_disk_blocks == 0
    store.check_integrity()


# ---------------------------------------------------------------------- bounds and manager bugs


@pytest.mark.parametrize(
    "ops, held, refitted",
    [
        ([save(1, 0), save(2, 1), save(3, 2)], (2, 0), 1),  # host full: its oldest dropped first
        ([save(1, 0), save(2, 1), demote(1), demote(2)], (0, 1), 1),  # disk full: its oldest dropped
        ([save(1, 0), save(1, 1)], (1, 0), 1),  # held already: replaced
        ([save(1, 0), demote(1), save(1, 1)], (1, 0), 1),
        ([demote(4)], (0, 0), 1),  # not in host memory: skipped
    ],
)
def test_a_plan_out_of_step_with_the_store_is_fitted_never_past_a_bound(
    ops: list[TierOp], held: tuple[int, int], refitted: int, cache: PagedKVCache, tmp_path: Path
) -> None:
    """A stage that missed an earlier plan's moves (the plan failed before reaching it) holds
    other keys than the manager thinks: its plans are fitted to what it holds, within bounds;
    what it then lacks is a LOAD miss (recomputed), never an error loop."""
    store = KVTierStore(cache, host_blocks=2, disk_dir=tmp_path, disk_blocks=1)
    store.apply(ops)
    assert (store.num_host_blocks, store.num_disk_blocks, store.num_refitted) == (*held, refitted)
    store.check_integrity()
    store.close()


def test_a_load_of_what_a_fit_dropped_misses(cache: PagedKVCache, tmp_path: Path) -> None:
    store = KVTierStore(cache, host_blocks=1, disk_dir=None, disk_blocks=0)
    store.apply([save(1, 0)])
    store.apply([save(2, 1)])  # the manager thought key 1 was gone: this store drops it to fit
    with pytest.raises(TierMissError):
        store.apply([load(1, 3)])
    store.check_integrity()
    store.close()


@pytest.mark.parametrize(
    "ops, message",
    [
        ([save(1, NUM_BLOCKS)], "out of range"),
        ([load(1, -1)], "out of range"),
        ([save(1, 0), load(1, 3), load(1, 3)], "loaded twice"),
        ([TierOp(9, key(1))], "unknown kind"),
        ([TierOp(TIER_DROP, b"")], "key is 1 to"),
    ],
)
def test_a_plan_against_the_store_is_refused_whole(
    ops: list[TierOp], message: str, cache: PagedKVCache, tmp_path: Path
) -> None:
    store = KVTierStore(cache, host_blocks=2, disk_dir=tmp_path, disk_blocks=1)
    with pytest.raises(ValueError, match=message):
        store.apply(ops)
    assert (store.num_saved, store.num_host_blocks, store.num_disk_blocks) == (0, 0, 0)
    store.check_integrity()
    store.close()


def test_room_made_by_a_drop_or_demote_in_the_same_plan_counts(cache: PagedKVCache, tmp_path: Path) -> None:
    store = KVTierStore(cache, host_blocks=1, disk_dir=tmp_path, disk_blocks=1)
    store.apply([save(1, 0)])
    store.apply([demote(1), save(2, 1)])  # host full: demote first, as the manager does
    store.apply([drop(1), demote(2), save(3, 2)])  # disk full too: drop its oldest first
    assert (store.num_host_blocks, store.num_disk_blocks, store.num_dropped) == (1, 1, 1)
    store.check_integrity()
    store.close()


def test_bad_construction_is_refused(cache: PagedKVCache, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no disk directory"):
        KVTierStore(cache, host_blocks=1, disk_dir=None, disk_blocks=1)
    with pytest.raises(ValueError, match="negative"):
        KVTierStore(cache, host_blocks=-1, disk_dir=None, disk_blocks=0)
    with pytest.raises(ValueError, match="plain directory name"):
        KVTierStore(cache, host_blocks=1, disk_dir=tmp_path, disk_blocks=1, name="../x")


def test_host_only_store(cache: PagedKVCache) -> None:
    store = KVTierStore(cache, host_blocks=1, disk_dir=None, disk_blocks=0)
    a = block_of(cache, 0)
    store.prefetch([load(1, 2)])  # nothing on disk: nothing to read
    store.apply([save(1, 0)])
    store.apply([load(1, 2)])
    assert same(block_of(cache, 2), a)
    store.apply([demote(1)])  # no disk (the manager drops instead): fitted to a drop
    assert (store.num_host_blocks, store.num_refitted) == (0, 1)
    with pytest.raises(TierMissError):
        store.apply([load(1, 3)])
    store.check_integrity()
    store.close()


# ---------------------------------------------------------------------- reset, start, close


def test_clear_forgets_everything_and_removes_the_files(store: KVTierStore, tmp_path: Path) -> None:
    store.apply([save(1, 1), save(2, 2), demote(1), demote(2), save(3, 3)])
    store.prefetch([load(1, 4)])
    store.clear()
    store.flush()
    assert list((tmp_path / "stage0").iterdir()) == []
    assert (store.num_host_blocks, store.num_disk_blocks, store.host_bytes, store.disk_bytes) == (0, 0, 0, 0)
    store.check_integrity()
    store.apply([save(1, 1), demote(1)])  # usable again
    store.check_integrity()
    assert file_of(tmp_path, 1).exists()


def test_start_removes_leftover_tier_files_only(cache: PagedKVCache, tmp_path: Path) -> None:
    own = tmp_path / "stage1"
    own.mkdir()
    (own / "ab.kv").write_bytes(b"old")
    (own / "cd.kv.tmp").write_bytes(b"half")
    (own / "notes.txt").write_text("not ours")
    store = KVTierStore(cache, host_blocks=1, disk_dir=tmp_path, disk_blocks=1, name="stage1")
    assert sorted(p.name for p in own.iterdir()) == ["notes.txt"]
    store.check_integrity()
    store.close()


def test_close_removes_the_files_and_stops_the_io_thread(store: KVTierStore, tmp_path: Path) -> None:
    store.apply([save(1, 1), demote(1)])
    store.close()
    assert list((tmp_path / "stage0").iterdir()) == []
    store.prefetch([load(1, 2)])  # a plan arriving after close is ignored
    store.close()  # idempotent


# ---------------------------------------------------------------------- invariants


class ManagerModel:
    """Plans shaped like kvcache_svc/core/tier.py's, generated ahead with what each block holds.

    Block contents are tracked as versions: `pool[b]` holds version `pool[b]`, a tier key the
    version saved under it; a scribble (the step computing into a block) makes a new version.
    """

    def __init__(self, rng: random.Random, host_blocks: int, disk_blocks: int) -> None:
        self.rng, self.host_blocks, self.disk_blocks = rng, host_blocks, disk_blocks
        self.host: OrderedDict[int, None] = OrderedDict()
        self.disk: OrderedDict[int, None] = OrderedDict()
        self.held: dict[int, int] = {}  # key -> version
        self.pool = list(range(NUM_BLOCKS))  # block -> version
        self.next_key, self.next_version = 0, NUM_BLOCKS

    def plan(self) -> list[TierOp]:
        ops: list[TierOp] = []
        targets: set[int] = set()
        for _ in range(self.rng.randint(1, 4)):
            choice = self.rng.random()
            if choice < 0.4:
                self._save(ops)
            elif choice < 0.75 and self.held:
                k = self.rng.choice(sorted(self.held))
                b = self.rng.choice([b for b in range(NUM_BLOCKS) if b not in targets])
                targets.add(b)
                ops.append(load(k, b))
                self.pool[b] = self.held[k]
            elif choice < 0.85 and self.host and len(self.disk) < self.disk_blocks:
                k = self.rng.choice(sorted(self.host))
                del self.host[k]
                self.disk[k] = None
                ops.append(demote(k))
            else:
                k = self.rng.choice([*sorted(self.held), 10_000])  # a key never held: a no-op
                self.host.pop(k, None)
                self.disk.pop(k, None)
                self.held.pop(k, None)
                ops.append(drop(k))
        return ops

    def _save(self, ops: list[TierOp]) -> None:
        if len(self.host) >= self.host_blocks:
            old, _ = self.host.popitem(last=False)
            if len(self.disk) >= self.disk_blocks:
                gone, _ = self.disk.popitem(last=False)
                del self.held[gone]
                ops.append(drop(gone))
            self.disk[old] = None
            ops.append(demote(old))
        k, b = self.next_key, self.rng.randrange(NUM_BLOCKS)
        self.next_key += 1
        self.host[k] = None
        self.held[k] = self.pool[b]
        ops.append(save(k, b))

    def scribble(self) -> int:
        b = self.rng.randrange(NUM_BLOCKS)
        self.pool[b] = self.next_version
        self.next_version += 1
        return b


def write_version(cache: PagedKVCache, b: int, version: int) -> None:
    for i, t in enumerate(t for pair in cache.slot_pools for t in pair):
        t[b].fill_(version * 16 + i)  # each pool its own value: a mixed-up pool shows


def assert_pool_holds(cache: PagedKVCache, versions: list[int]) -> None:
    for b, version in enumerate(versions):
        for i, t in enumerate(t for pair in cache.slot_pools for t in pair):
            assert bool((t[b] == version * 16 + i).all()), f"block {b} pool {i}: not version {version}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_plans_keep_every_invariant_and_every_byte(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    cache = make_cache()
    for b in range(NUM_BLOCKS):
        write_version(cache, b, b)
    model = ManagerModel(rng, host_blocks=3, disk_blocks=4)
    store = KVTierStore(cache, host_blocks=3, disk_dir=tmp_path, disk_blocks=4, prefetch_blocks=2)
    steps = []  # plan, block scribbled after it, its version; then the pool's versions and the tier sizes
    for _ in range(120):
        plan = model.plan()
        scribbled = model.scribble() if rng.random() < 0.5 else None
        version = None if scribbled is None else model.pool[scribbled]
        steps.append((plan, scribbled, version, list(model.pool), (len(model.host), len(model.disk))))
    for i, (plan, scribbled, version, expected, sizes) in enumerate(steps):
        ahead = steps[i + 1][0] if i + 1 < len(steps) else []
        prefetcher = threading.Thread(target=store.prefetch, args=(ahead,))  # the event loop, meanwhile
        prefetcher.start()
        store.apply(plan)
        prefetcher.join()
        if scribbled is not None:
            write_version(cache, scribbled, version)
        assert_pool_holds(cache, expected)
        assert (store.num_host_blocks, store.num_disk_blocks) == sizes
        store.check_integrity()
    assert store.num_loaded_disk > 0 and store.num_prefetched > 0 and store.num_demoted > 0
    store.close()


def break_by_deleting_a_file(store: KVTierStore, tmp_path: Path) -> None:
    file_of(tmp_path, 1).unlink()


def break_by_an_extra_file(store: KVTierStore, tmp_path: Path) -> None:
    (tmp_path / "stage0" / "00ff.kv").write_bytes(b"stray")


def break_by_a_slot_held_twice(store: KVTierStore, tmp_path: Path) -> None:
    store._host[key(9)] = store._host[key(2)]


def break_by_a_slot_lost(store: KVTierStore, tmp_path: Path) -> None:
    store._free_slots.pop()


def break_by_a_key_in_both_tiers(store: KVTierStore, tmp_path: Path) -> None:
    store._host[key(1)] = store._free_slots.pop()


def break_by_a_resized_file(store: KVTierStore, tmp_path: Path) -> None:
    truncate(file_of(tmp_path, 1), file_of(tmp_path, 1))


@pytest.mark.parametrize(
    "breakage",
    [
        break_by_deleting_a_file,
        break_by_an_extra_file,
        break_by_a_slot_held_twice,
        break_by_a_slot_lost,
        break_by_a_key_in_both_tiers,
        break_by_a_resized_file,
    ],
    ids=lambda f: f.__name__,
)
def test_check_integrity_catches_a_broken_state(breakage, store: KVTierStore, tmp_path: Path) -> None:
    store.apply([save(1, 1), save(2, 2), demote(1)])
    store.check_integrity()
    breakage(store, tmp_path)
    with pytest.raises(TierIntegrityError):
        store.check_integrity()


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sequence_of_every_path(dtype: torch.dtype, device: str, tmp_path: Path) -> None:
    """On a CUDA pool the asynchronous path: a pinned slab, non-blocking copies, a DEMOTE that
    waits for its SAVE's copy."""
    cache = make_cache(dtype, device=device)
    store = KVTierStore(cache, host_blocks=4, disk_dir=tmp_path, disk_blocks=4)
    assert store._slab.is_pinned() == (device == "cuda")
    originals = {b: block_of(cache, b) for b in range(4)}
    store.apply([save(0, 0), save(1, 1), demote(0), save(2, 2), save(3, 3), demote(2)])
    for b in range(4):
        scribble(cache, b)
    store.apply([load(0, 4)])  # one block, from disk (its write maybe still queued)
    store.flush()
    store.prefetch([load(2, 5), load(1, 6), load(3, 7)])
    store.apply([load(2, 5), load(1, 6), load(3, 7)])  # a batch: a prefetched disk block and host ones
    store.apply([drop(1), save(4, 6), load(3, 6)])  # block 6 saved, then overwritten, in one plan
    store.apply([load(4, 0)])
    if device == "cuda":
        torch.cuda.synchronize()
    expected = {0: originals[1], 4: originals[0], 5: originals[2], 6: originals[3], 7: originals[3]}
    for target, block in expected.items():
        assert same(block_of(cache, target), block), target
    assert (store.num_loaded_disk, store.num_loaded_host, store.num_corrupt) == (2, 4, 0)
    store.check_integrity()
    store.close()
