"""The KV manager's tier (kvcache_svc/core/tier.py): evicted cached blocks saved below the pool,
prefix hits there loaded into fresh blocks, bounds, demotion, and failures forgotten.

A simulated pipeline applies every step's tier moves and block copies in order, then writes the
step's tokens, holding per block *which tokens* it stores; a sequence's blocks must always hold
its own tokens. That is the contract the stages keep with their real pools
(worker_svc/execution/kv_tier.py)."""

from __future__ import annotations

import random

import pytest

from kvcache_svc.core import Allocated, Append, KVCacheManager, NewSequence, StepInput
from kvcache_svc.core.tier import TierIndex
from services.step import TIER_DEMOTE, TIER_DROP, TIER_LOAD, TIER_SAVE

BS = 4


class Pipeline:
    """What the stages hold, slot by slot: each pool block's slots (the token whose KV each holds,
    or None) and each tier key's. A step applies its tier moves, then its block copies, checks
    that every slot its sequences read (the tokens before the ones they compute) holds their
    own token, then writes only the slots it computes."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.pool: dict[int, list] = {}
        self.host: dict[bytes, list] = {}
        self.disk: dict[bytes, list] = {}
        self.tokens: dict[int, list[int]] = {}  # each live sequence's tokens
        self.ops: list = []
        self.next_mb = 1

    def block(self, block_id: int) -> list:
        return self.pool.setdefault(block_id, [None] * BS)

    def step(self, news=(), appends=(), fail=False, frees=()):
        mb, self.next_mb = self.next_mb, self.next_mb + 1
        out = self.m.step(StepInput(new_sequences=news, appends=appends, micro_batch_id=mb, frees=frees))
        self.ops.extend(out.tier_ops)
        for op in out.tier_ops:
            if op.kind == TIER_SAVE:
                assert op.key not in self.host and op.key not in self.disk
                self.host[op.key] = list(self.block(op.block_id))
            elif op.kind == TIER_LOAD:
                self.pool[op.block_id] = list(self.host[op.key] if op.key in self.host else self.disk[op.key])
            elif op.kind == TIER_DEMOTE:
                self.disk[op.key] = self.host.pop(op.key)
            elif op.kind == TIER_DROP:
                self.host.pop(op.key, None)
                self.disk.pop(op.key, None)
        for c in out.copies:
            self.pool[c.dst_block_id] = list(self.block(c.src_block_id))
        for seq_id, result in out.results.items():
            if not isinstance(result, Allocated):
                if seq_id in self.tokens and not self.m.has_sequence(seq_id):
                    del self.tokens[seq_id]  # a new sequence refused: not admitted
                continue
            table, toks = self.m.block_table(seq_id), self.tokens[seq_id]
            start, end = result.num_computed_tokens, result.num_computed_tokens + result.num_new_tokens
            for pos in range(start):  # what the step's attention reads
                got = self.block(table[pos // BS])[pos % BS]
                assert got == toks[pos], (seq_id, pos, got, toks[pos])
            for pos in range(start, end):
                self.block(table[pos // BS])[pos % BS] = toks[pos]
        assert len(self.host) <= self.m.stats().tier_host_capacity
        assert len(self.disk) <= self.m.stats().tier_disk_capacity
        if fail:
            self.m.fail([mb])
        else:
            self.m.complete([mb])
        self.m.check_integrity()
        return out

    def add(self, seq_id, tokens, fail=False):
        self.tokens[seq_id] = list(tokens)
        return self.step(news=[NewSequence(seq_id, tokens)], fail=fail).results[seq_id]

    def free(self, seq_id):
        self.tokens.pop(seq_id)
        self.m.free(seq_id)


def manager(num_blocks=8, host=4, disk=4) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, watermark=0.0, tier=TierIndex(host, disk))


def test_an_evicted_prefix_comes_back_from_the_tier_instead_of_being_recomputed():
    p = Pipeline(manager())
    a = list(range(100, 116))  # 4 full blocks
    p.add(1, a)
    p.free(1)
    p.add(2, list(range(200, 232)))  # 8 blocks: evicts a's 4 cached blocks
    assert sum(op.kind == TIER_SAVE for op in p.ops) == 4
    p.free(2)
    got = p.add(3, a + [7, 8, 9, 10, 11])  # a's blocks are below the pool now
    loads = [op for op in p.ops if op.kind == TIER_LOAD]
    assert len(loads) == 4 and got.num_computed_tokens == 16
    stats = p.m.stats()
    assert stats.num_tier_hit_tokens == 16 and stats.num_tier_loads == 4 and stats.num_prefix_hit_tokens == 0
    # and once completed they are findable in the pool again, no second load
    p.free(3)
    p.add(4, a + [1])
    assert len([op for op in p.ops if op.kind == TIER_LOAD]) == 4
    assert p.m.stats().num_prefix_hit_tokens == 16


def test_the_last_prompt_block_is_computed_and_a_partial_match_stops_at_the_first_miss():
    p = Pipeline(manager())
    a = list(range(100, 116))
    p.add(1, a)
    p.free(1)
    p.add(2, list(range(200, 232)))  # evicts everything cached
    p.free(2)
    got = p.add(3, a)  # the whole prompt below the pool: its last block is computed
    assert got.num_computed_tokens == 12
    p.free(3)
    p.add(5, list(range(300, 332)))
    p.free(5)
    got = p.add(6, a[:8] + [0] * 8)  # two blocks match, the third differs
    assert got.num_computed_tokens == 8


def test_a_full_host_tier_demotes_to_disk_and_a_full_disk_drops():
    p = Pipeline(manager(num_blocks=4, host=2, disk=2))
    for i in range(6):
        p.add(i, list(range(i * 100, i * 100 + 16)))  # each evicts the one before
        p.free(i)
    stats = p.m.stats()
    assert (stats.tier_host_blocks, stats.tier_disk_blocks) == (2, 2)
    assert stats.num_tier_demotions >= 2 and stats.num_tier_drops >= 1
    kinds = {op.kind for op in p.ops}
    assert {TIER_SAVE, TIER_DEMOTE, TIER_DROP} <= kinds


def test_a_failed_step_forgets_what_it_loaded_and_the_next_step_drops_it():
    p = Pipeline(manager())
    a = list(range(100, 116))
    p.add(1, a)
    p.free(1)
    p.add(2, list(range(200, 232)))
    p.free(2)
    p.add(3, a + [1, 2], fail=True)  # e.g. a stage found a tier file corrupt
    p.free(3)
    p.tokens[9] = list(range(500, 504))
    out = p.step(news=[NewSequence(9, list(range(500, 504)))])
    drops = [op for op in out.tier_ops if op.kind == TIER_DROP]
    assert len(drops) == 4 and out.tier_ops[:4] == tuple(drops)  # first in the step
    p.free(9)
    p.tokens[4] = a + [1, 2]
    got = p.step(news=[NewSequence(4, a + [1, 2])]).results[4]
    assert got.num_computed_tokens == 0  # recomputed, not loaded


def test_random_load_keeps_every_sequence_on_its_own_tokens():
    rng = random.Random(5)
    p = Pipeline(manager(num_blocks=12, host=6, disk=6))
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((8, 12, 16)))] for _ in range(6)]
    live: list[int] = []
    for seq_id in range(120):
        if live and (len(live) > 2 or rng.random() < 0.4):
            p.free(live.pop(rng.randrange(len(live))))
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
        if p.m.num_available_blocks < -(-len(tokens) // BS) + 1:
            continue
        p.add(seq_id, tokens, fail=rng.random() < 0.05)
        live.append(seq_id)
        if rng.random() < 0.5:
            s = rng.choice(live)
            if p.m.num_available_blocks > 1:
                p.tokens[s].append(7)
                p.step(appends=[Append(s, [7])])
    stats = p.m.stats()
    assert stats.num_tier_hit_tokens > 0 and stats.num_tier_saves > 0


def test_a_tier_needs_prefix_caching_and_one_kv_group():
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(8, BS, enable_prefix_caching=False, tier=TierIndex(2))
    with pytest.raises(ValueError, match="one KV group"):
        KVCacheManager(8, BS, group_windows=(0, 8), tier=TierIndex(2))
    with pytest.raises(ValueError, match="host_blocks"):
        TierIndex(0)


def test_a_whole_prompt_hits_copy_source_is_never_loaded_into_in_the_same_step():
    """Two whole-prompt hits and a tier hit in one step with no free block: the copies' sources
    stay held until the step's allocations are made, so no load lands in one before it is
    copied (found in review: the third sequence then gets NoBlocks, as it should)."""
    p = Pipeline(KVCacheManager(8, BS, watermark=0.0, tier=TierIndex(8, 0)))
    b, e, a, a2, h = [1, 2, 3, 4, 5], list(range(10, 18)), list(range(20, 28)), list(range(30, 38)), list(range(40, 48))
    for seq_id, tokens in ((1, b), (2, e), (3, a), (4, a2)):
        p.add(seq_id, tokens)
        p.free(seq_id)
    p.add(5, h)  # held; evicts b's first block into the tier
    for seq_id, tokens in ((6, a), (7, a2), (8, b[:4] + [6, 7, 8, 9])):
        p.tokens[seq_id] = tokens
    p.step(news=[NewSequence(6, a), NewSequence(7, a2), NewSequence(8, b[:4] + [6, 7, 8, 9])])
    for seq_id in (5, 6, 7, 8):
        if seq_id in p.tokens:
            p.free(seq_id)
    p.add(9, a + [99])  # a later request on a's prefix reads a's blocks, not another's
