"""`KVCacheManager`: per-sequence block tables over a `BlockPool` and a `PrefixCache`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from kvcache_svc.core import audit, groups
from kvcache_svc.core.block_pool import BlockPool
from kvcache_svc.core.prefix_cache import (
    ROOT_KEY,
    TOKEN_BYTES,
    CachedBlock,
    CacheListener,
    HashFn,
    PrefixCache,
    hash_block,
    unpack_token_ids,
)
from kvcache_svc.core.sequence import MicroBatchRecord, SequenceState
from kvcache_svc.core.tier import TierIndex
from kvcache_svc.core.validation import ValidAppend, ValidNewSequence, validate_step
from services.defaults import BLOCK_SIZE
from services.kv_errors import ImportUnavailable, SequenceNotFound
from services.kv_layout import NULL_PAGE, first_needed_block
from services.kv_stats import KVCacheStats, SequenceBlockStats
from services.kv_types import Allocated, BlockCopy, Fork, NoBlocks, StepInput, StepOutput
from services.step import TierOp


class _NumTokensView(Mapping[int, int]):
    """Live sequences' token counts, read through: validation reads a few entries per step,
    so copying all of them (O(live sequences) per step) would dominate small steps."""

    __slots__ = ("_seqs",)

    def __init__(self, seqs: dict[int, SequenceState]) -> None:
        self._seqs = seqs

    def __getitem__(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __iter__(self) -> Iterator[int]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)


class KVCacheManager:
    """Paged KV accounting: block tables, prefix caching, copy-on-write and the step.

    Owns a `BlockPool` (ref counts, free extents, best-fit) and a `PrefixCache` (hash-chain
    index, LRU of evictable blocks); one caller owns it (no locks). Invariants, checked by
    `check_integrity()`: a block's ref count is the number of tables holding it; every block
    is exactly one of used, free or evictable; a sequence has `ceil(num_tokens /
    block_size)` blocks, and at most `MAX_LOOKAHEAD_SLOTS` slots' worth held ahead.

    KV groups (services/kv_layout.py, `group_windows`): for a hybrid model every table
    entry is a tuple of pages, one per sub-group, all drawn from the one pool; a sliding
    sub-group gives back the pages no window reaches any more before each append, and a
    prefix hit needs every full sub-group's pages from the start and every sliding
    sub-group's pages inside its window. Counts (supply, `NoBlocks`, statistics) are pages.
    With one group (the default) an entry is one block, answered as a plain int.

    Allocation takes free blocks first (best-fit) and evicts cached blocks, least recently
    used first, only when no free block is left. New sequences must leave
    `watermark_blocks` blocks available (admission control); appends to running sequences
    may use everything.

    A prompt hit in full (its length a multiple of `block_size`, every block cached) is
    capped at `len(prompt) - 1` computed tokens, so the last token is computed again for its
    logits: the last cached block is copied into a fresh block (reported in `copies`) and
    only its last slot is written, so the cached original is never written to.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block,
        listener: CacheListener | None = None,
        group_windows: tuple[int, ...] = (0,),
        tier: TierIndex | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if not group_windows or group_windows[0] != 0 or min(group_windows) < 0:
            raise ValueError(f"group_windows: full-attention group first, got {group_windows}")
        self._windows = tuple(group_windows)
        self._num_groups = len(self._windows)
        self._sliding = groups.sliding_groups(self._windows)
        self._pool = BlockPool(num_blocks)
        self._block_size = block_size
        self._watermark_blocks = int(watermark * num_blocks)
        self._enable_prefix_caching = enable_prefix_caching
        self._cache = PrefixCache(hash_fn, listener)
        self._seqs: dict[int, SequenceState] = {}
        self._in_flight: dict[int, MicroBatchRecord] = {}
        self._counters = audit.Counters()
        if tier is not None and (not enable_prefix_caching or self._num_groups > 1):
            raise ValueError("a KV tier needs prefix caching and one KV group (no sliding-window sub-groups)")
        self._tier = tier  # the KV tier below the pool (kvcache_svc/core/tier.py), or None
        self._tier_ops: list[TierOp] = []  # this step's moves (`step`)
        # sources of this step's whole-prompt-hit copies: parked (evictable) only once every
        # allocation of the step is made, so none is evicted, saved over or loaded into before
        # the stages copy it
        self._park_after_step: list[int] = []

    # ---- configuration and queries -------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def group_windows(self) -> tuple[int, ...]:
        """Each KV sub-group's sliding window (0: full attention)."""
        return self._windows

    @property
    def watermark_blocks(self) -> int:
        return self._watermark_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._enable_prefix_caching

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can have now: free plus evictable."""
        return self._pool.num_free_blocks + self._cache.num_evictable_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody holds (evicted LRU first when no free block is left)."""
        return self._cache.num_evictable_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` more blocks can be had and still leave the watermark."""
        return self.num_available_blocks - num_blocks >= self._watermark_blocks

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> tuple[int, ...]:
        return tuple(self._seqs)

    def block_table(self, seq_id: int) -> tuple:
        """The table as answers give it: block ids, or with groups, tuples of pages."""
        return self._answer(self._get(seq_id).block_ids)

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """Every page the sequence holds, in table order (sub-groups within an entry)."""
        return tuple(p for entry in self._get(seq_id).block_ids for p in entry if p != NULL_PAGE)

    def _answer(self, entries: list[tuple[int, ...]]) -> tuple:
        return tuple(e[0] for e in entries) if self._num_groups == 1 else tuple(entries)

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref_count(block_id)

    def cached_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        """The tokens a cached block holds, or None if it is not in the prefix cache."""
        entry = self._cache.entry(block_id)
        return None if entry is None else unpack_token_ids(entry.token_bytes)

    def tier_keys(self) -> list[tuple[bytes, str]]:
        """The KV tier's blocks (key, "host" or "disk"); none without a tier."""
        return self._tier.keys() if self._tier is not None else []

    def cached_blocks(self) -> list[CachedBlock]:
        """Every block in the prefix cache with its key's input (a KV-event snapshot)."""
        return self._cache.entries()

    def evictable_block_ids(self) -> tuple[int, ...]:
        """Cached blocks nobody holds, in eviction order (least recently used first)."""
        return self._cache.evictable_block_ids()

    def free_extents(self) -> list[tuple[int, int]]:
        """`(start, length)` of the free (uncached) extents, by start."""
        return self._pool.free_extents()

    def in_flight_micro_batch_ids(self) -> tuple[int, ...]:
        return tuple(self._in_flight)

    def _get(self, seq_id: int) -> SequenceState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise SequenceNotFound(seq_id)
        return seq

    def import_level(self) -> tuple[PrefixCache, TierIndex]:
        """P/D: the prefix cache and the tier with an import level (tier.py `plan_import`,
        `commit_import`, `forget`); ImportUnavailable without one."""
        if self._tier is None or not self._tier.import_blocks or not self._enable_prefix_caching:
            raise ImportUnavailable("this KV service has no import level (--kv-import-blocks)")
        return self._cache, self._tier

    # ---- the step ------------------------------------------------------------------------

    def step(self, step_input: StepInput) -> StepOutput:
        """Apply one plan's bookkeeping (see `StepInput` for the order).

        Raises `SequenceNotFound` / `InvalidStepError` with the state unchanged; a sequence
        short of blocks gets `NoBlocks` and is left as it was, the others are applied.
        """
        valid = validate_step(
            step_input,
            _NumTokensView(self._seqs),
            self._in_flight,
            self._pool.num_blocks // (self._num_groups - len(self._sliding)) * self._block_size,
        )
        for micro_batch_id in valid.failed_micro_batch_ids:
            failed = self._in_flight.pop(micro_batch_id)
            for seq in failed.seqs:
                seq.cacheable = False
            if self._tier is not None:  # a stage may lack what it saved or loaded
                self._tier.forget(failed.tier_keys)
        for micro_batch_id in valid.completed_micro_batch_ids:
            self._complete(self._in_flight.pop(micro_batch_id))
        for seq_id in valid.frees:
            self._free(self._seqs.pop(seq_id))
        for parent_seq_id, child_seq_id in valid.forks:
            parent = self._seqs[parent_seq_id]
            shared = -(-parent.num_tokens // self._block_size)  # not the blocks held ahead
            for entry in parent.block_ids[:shared]:
                for page in entry:
                    if page != NULL_PAGE:
                        self._pool.incref(page)
            self._seqs[child_seq_id] = parent.copy(child_seq_id, shared)

        # validation made sure a step that writes names its micro-batch
        micro_batch = MicroBatchRecord()
        self._tier_ops = []
        if self._tier is not None and valid.micro_batch_id is not None:
            self._tier.expire_imports()
            self._tier.take_pending(self._tier_ops)
        results: dict[int, Allocated | NoBlocks] = {}
        for append in valid.appends:
            results[append.seq_id] = self._append(append, micro_batch)
        for new in valid.new_sequences:
            results[new.seq_id] = self._add(new, micro_batch)
        if valid.micro_batch_id is not None:
            self._in_flight[valid.micro_batch_id] = micro_batch
        copies = [c for r in results.values() if isinstance(r, Allocated) for c in r.copies]
        self._counters.num_copy_on_write += len(copies)
        return StepOutput(results=results, copies=tuple(copies), tier_ops=self._end_tier_step(micro_batch))

    def _end_tier_step(self, micro_batch: MicroBatchRecord) -> tuple[TierOp, ...]:
        """The step's KV tier moves; the keys they name are the micro-batch's (forgotten if it
        fails); whole-prompt hits' sources become evictable now (`_add`)."""
        if self._tier is None:  # (nothing moves: no work on the step's path)
            return ()
        for page in self._park_after_step:
            if self._pool.decref(page) == 0:
                self._cache.park(page)
        self._park_after_step = []
        ops, self._tier_ops = tuple(self._tier_ops), []
        micro_batch.tier_keys = list(dict.fromkeys(op.key for op in ops))
        return ops

    def free(self, seq_id: int) -> None:
        self.step(StepInput(frees=(seq_id,)))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        self.step(StepInput(forks=(Fork(parent_seq_id, child_seq_id),)))

    def complete(self, micro_batch_ids: Iterable[int]) -> None:
        """The micro-batches finished: the full blocks they wrote become findable."""
        self.step(StepInput(completed_micro_batch_ids=tuple(micro_batch_ids)))

    def fail(self, micro_batch_ids: Iterable[int]) -> None:
        """The micro-batches failed: nothing they wrote becomes findable, nor anything the
        sequences that wrote in them write later (free or reset those sequences)."""
        self.step(StepInput(failed_micro_batch_ids=tuple(micro_batch_ids)))

    def reset(self) -> None:
        """Forget every sequence, cached block and micro-batch (the workers lost their KV).
        Cumulative counters are kept."""
        self._pool = BlockPool(self._pool.num_blocks)
        self._cache.clear()
        self._seqs.clear()
        self._in_flight.clear()
        if self._tier is not None:  # the stages clear theirs with their pools
            self._tier.clear()
        self._counters.num_resets += 1

    # ---- allocation ----------------------------------------------------------------------

    def _allocate_entries(self, num_entries: int) -> list[tuple[int, ...]]:
        """`num_entries` table entries of fresh pages, one page per sub-group each."""
        pages, n = self._allocate(num_entries * self._num_groups), self._num_groups
        return [tuple(pages[i : i + n]) for i in range(0, len(pages), n)]

    def _allocate(self, num_blocks: int) -> list[int]:
        """Free blocks best-fit first, then evicted ones (LRU); the caller checked supply."""
        from_pool = min(num_blocks, self._pool.num_free_blocks)
        block_ids = self._pool.allocate(from_pool)
        for _ in range(num_blocks - from_pool):
            block_id, entry = self._cache.evict()
            if self._tier is not None:
                self._tier.save(entry.key, block_id, self._tier_ops)
            self._pool.acquire_parked(block_id)
            block_ids.append(block_id)
        self._counters.num_evictions += num_blocks - from_pool
        return block_ids

    def _free(self, seq: SequenceState) -> None:
        # the tail is evicted before the head
        self._let_go([p for entry in reversed(seq.block_ids) for p in entry if p != NULL_PAGE])

    def _let_go(self, pages: list[int]) -> None:
        """One holder fewer for each page: a cached page nobody holds becomes evictable,
        others go back to the free extents."""
        released: list[int] = []
        for page in pages:
            if self._pool.decref(page) == 0:
                if self._cache.is_cached(page):
                    self._cache.park(page)
                else:
                    released.append(page)
        self._pool.release(released)

    def _slide(self, seq: SequenceState, start: int, out: list[tuple[int, int, int]]) -> None:
        """Give back the pages `groups.sliding_out` named.

        Safe before this step's allocation even with steps in flight: every stage runs
        steps in order, so an earlier step's reads of a page come before a later owner's
        writes, and this step's queries attend from `start - window + 1` on."""
        entries = seq.block_ids
        for j, s, _ in out:
            entry = list(entries[j])
            entry[s] = NULL_PAGE
            entries[j] = tuple(entry)
        bs = self._block_size
        seq.num_slid = max(seq.num_slid, min(first_needed_block(start, w, bs) for _, w in self._sliding))
        self._counters.num_slid_pages += len(out)
        self._let_go([page for _, _, page in out])

    def _complete(self, micro_batch: MicroBatchRecord) -> None:
        if self._tier is not None:
            self._tier.settled(micro_batch.tier_keys)
        for seq, block_id, generation, entry in micro_batch.filled:
            if seq.cacheable and self._pool.ref_count(block_id) > 0 and self._pool.generation(block_id) == generation:
                self._cache.register(block_id, entry)

    def _append(self, append: ValidAppend, micro_batch: MicroBatchRecord) -> Allocated | NoBlocks:
        seq = self._seqs[append.seq_id]
        bs = self._block_size
        start = seq.num_tokens
        # pages a window left: back to the pool before this step's, if it gets its own
        out = groups.sliding_out(seq, start, self._sliding, bs) if self._sliding else []
        # the partly filled block the tokens go into first (held ahead blocks are empty)
        partial = start // bs if start % bs and append.num_tokens else None
        shared = (
            ()
            if partial is None
            else [s for s, page in enumerate(seq.block_ids[partial]) if self._pool.ref_count(page) > 1]
        )
        room = start + append.num_tokens + append.num_lookahead_slots
        num_new_entries = max(0, -(-room // bs) - len(seq.block_ids))
        num_needed = num_new_entries * self._num_groups + len(shared)
        num_available = self.num_available_blocks + sum(1 for _, _, page in out if self._pool.ref_count(page) == 1)
        if num_needed > num_available:
            return NoBlocks(append.seq_id, num_needed, num_available)
        if out:
            self._slide(seq, start, out)
        if len(seq.block_ids) > -(-room // bs):
            self._give_back_ahead(seq, -(-room // bs))
        copies: tuple[BlockCopy, ...] = ()
        if shared:
            copies = self._copy_on_write(seq, partial, shared)
        self._write(seq, append.token_bytes, append.num_tokens, self._allocate_entries(num_new_entries), micro_batch)
        offset = seq.answer_offset()
        return Allocated(append.seq_id, self._answer(seq.block_ids[offset:]), append.num_tokens, start, copies, offset)

    def _copy_on_write(self, seq: SequenceState, index: int, sub_groups: list[int]) -> tuple[BlockCopy, ...]:
        """Entry `index`'s shared pages of `sub_groups` get private copies before it is written."""
        entry = list(seq.block_ids[index])
        copies = []
        for s, dst in zip(sub_groups, self._allocate(len(sub_groups)), strict=True):
            src = entry[s]
            entry[s] = dst
            self._pool.decref(src)  # still held by the sharers
            copies.append(BlockCopy(src, dst))
        seq.block_ids[index] = tuple(entry)
        if seq.num_answered is not None:
            seq.num_answered = min(seq.num_answered, index)
        return tuple(copies)

    def _give_back_ahead(self, seq: SequenceState, keep: int) -> None:
        """Blocks held ahead past the first `keep` (empty: a verify step's rejected drafts'
        slots, speculative decoding) go back to the pool; the next answer starts at `keep`."""
        extra = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        self._pool.release([b for entry in extra for b in entry if self._pool.decref(b) == 0])
        if seq.num_answered is not None:
            seq.num_answered = min(seq.num_answered, keep)

    def _add(self, new: ValidNewSequence, micro_batch: MicroBatchRecord) -> Allocated | NoBlocks:
        bs = self._block_size
        hits = (
            self._cache.lookup(new.namespace, new.token_bytes, bs)
            if self._enable_prefix_caching and not new.skip_prefix_cache
            else []
        )
        hit_entries = groups.hit_entries(self._cache, new, hits, self._windows, bs)
        whole_prompt_hit = bool(hit_entries) and len(hit_entries) * bs == new.num_tokens
        below = self._tier_hits(new, hits[: len(hit_entries)]) if self._tier is not None else []
        num_computed = new.num_tokens - 1 if whole_prompt_hit else (len(hit_entries) + len(below)) * bs
        num_new_tokens = new.num_tokens - num_computed
        if new.max_num_new_tokens is not None:
            num_new_tokens = min(num_new_tokens, new.max_num_new_tokens)
        num_shared = len(hit_entries) - whole_prompt_hit
        num_new_entries = -(-(num_computed + num_new_tokens) // bs) - num_shared
        hit_pages = [p for entry in hit_entries for p in entry if p != NULL_PAGE]
        # evictable hits stop being available once this sequence holds them
        num_taken = sum(1 for page in hit_pages if self._cache.is_evictable(page))
        # the watermark keeps room for running sequences to grow; with none held, nothing can
        # free blocks by waiting, and a request that fits the pool would wait for ever
        watermark = self._watermark_blocks if self._seqs else 0
        num_available = max(0, self.num_available_blocks - num_taken - watermark)
        num_needed = num_new_entries * self._num_groups
        if num_needed > num_available:
            return NoBlocks(new.seq_id, num_needed, num_available)

        for page in hit_pages:
            if self._cache.is_evictable(page):
                self._cache.unpark(page)
            self._pool.incref(page)
        if below:  # this allocation's saves must not move what it loads
            self._tier.pin(e.key for e in below)
        new_entries = self._allocate_entries(num_new_entries)
        seq = SequenceState(new.seq_id, new.namespace)
        if below:
            self._load_from_tier(seq, below, new_entries, micro_batch)
            self._tier.unpin()
        seq.cacheable = not new.skip_prefix_cache
        seq.block_ids = hit_entries[:num_shared]
        seq.num_slid = groups.num_slid(hit_entries, num_shared, self._sliding)
        copies: tuple[BlockCopy, ...] = ()
        if whole_prompt_hit:
            # the last cached block was held through the allocation so it could not be
            # evicted into it; the copy gets the recomputed last token, never the original
            src, dst = hit_entries[-1], new_entries.pop(0)
            seq.block_ids.append(dst)
            if self._tier is not None:  # a later allocation of this step must not load into it
                self._park_after_step.extend(src)
            else:  # (evicted for a later sequence of this step, it is written only after the copy)
                for page in src:
                    if self._pool.decref(page) == 0:
                        self._cache.park(page)
            copies = tuple(BlockCopy(a, b) for a, b in zip(src, dst, strict=True))
            seq.last_full_key = hits[num_shared - 1].key if num_shared else ROOT_KEY
            seq.partial_token_bytes = new.token_bytes[num_shared * bs * TOKEN_BYTES : num_computed * TOKEN_BYTES]
        elif hit_entries and not below:
            seq.last_full_key = hits[num_shared - 1].key
        seq.num_tokens = num_computed
        self._seqs[new.seq_id] = seq
        token_bytes = new.token_bytes[num_computed * TOKEN_BYTES : (num_computed + num_new_tokens) * TOKEN_BYTES]
        self._write(seq, token_bytes, num_new_tokens, new_entries, micro_batch)

        if self._enable_prefix_caching and not new.skip_prefix_cache:
            self._counters.num_prefix_queries += 1
            self._counters.num_prefix_hits += num_computed > 0
            self._counters.num_prefix_query_tokens += new.num_tokens
            self._counters.num_prefix_hit_tokens += num_computed - len(below) * bs
            self._counters.num_tier_hit_tokens += len(below) * bs
        seq.answer_offset()  # its first answer: the whole table
        return Allocated(new.seq_id, self._answer(seq.block_ids), num_new_tokens, num_computed, copies)

    def _tier_hits(self, new: ValidNewSequence, hits: list) -> list[CachedBlock]:
        """The prompt's full blocks past the pool's hits found in the KV tier, in order (the
        block holding the prompt's last token is always computed: its logits are needed)."""
        if new.skip_prefix_cache:
            return []
        bs, stride = self._block_size, self._block_size * TOKEN_BYTES
        parent = hits[-1].key if hits else ROOT_KEY
        found: list[CachedBlock] = []
        for j in range(len(hits), (new.num_tokens - 1) // bs):
            block_tokens = new.token_bytes[j * stride : (j + 1) * stride]
            key = self._cache.key_of(parent, new.namespace, block_tokens)
            if key not in self._tier:
                break
            found.append(CachedBlock(key, parent, new.namespace, block_tokens, 0))
            parent = key
        return found

    def _load_from_tier(
        self, seq: SequenceState, below: list[CachedBlock], new_entries: list[tuple[int, ...]], micro_batch
    ) -> None:
        """The tier's blocks are read into the first fresh entries (after this step's saves,
        which may have freed those very blocks); they become findable when the step completes."""
        for entry, (page,) in zip(below, new_entries, strict=False):
            self._tier.load(entry.key, page, self._tier_ops)
            micro_batch.filled.append((seq, page, self._pool.generation(page), entry))
        seq.last_full_key = below[-1].key

    def _write(
        self,
        seq: SequenceState,
        token_bytes: bytes,
        num_tokens: int,
        new_entries: list[tuple[int, ...]],
        micro_batch: MicroBatchRecord,
    ) -> None:
        """Give `seq` slots for `num_tokens` more tokens (in `new_entries` past its last
        entry) and key the blocks they fill (every sub-group's page of each)."""
        bs = self._block_size
        blocks = seq.block_ids
        blocks.extend(new_entries)
        start = seq.num_tokens
        seq.num_tokens = start + num_tokens
        micro_batch.seqs.append(seq)

        if self._enable_prefix_caching:
            data = seq.partial_token_bytes + token_bytes
            stride = bs * TOKEN_BYTES
            num_full = len(data) // stride
            first_index = start // bs
            # a sequence out of the cache for good (skip_prefix_cache, or after a failed
            # micro-batch) registers nothing: its blocks need no keys
            for j in range(num_full if seq.cacheable else 0):
                block_tokens = data[j * stride : (j + 1) * stride]
                key = self._cache.key_of(seq.last_full_key, seq.namespace, block_tokens)
                for group, page in enumerate(blocks[first_index + j]):
                    if page != NULL_PAGE:
                        micro_batch.filled.append(
                            (
                                seq,
                                page,
                                self._pool.generation(page),
                                CachedBlock(key, seq.last_full_key, seq.namespace, block_tokens, group),
                            )
                        )
                seq.last_full_key = key
            seq.partial_token_bytes = data[num_full * stride :]

    # ---- statistics and integrity --------------------------------------------------------

    def layout(self) -> tuple[list[tuple[SequenceBlockStats, tuple[int, ...]]], bytes]:
        """Each live sequence's stats with the pages it holds (its block table with one
        group), and the state of every block (`BlockPool.state_map`): the memory monitor's
        detailed view."""
        return [(s, self.pages(s.seq_id)) for s in self.sequence_stats()], self._pool.state_map()

    def sequence_stats(self) -> tuple[SequenceBlockStats, ...]:
        """The per-sequence block distribution (pages, with KV groups; extents of group 0)."""
        return tuple(audit.sequence_stats(seq, self._pool, self._windows) for seq in self._seqs.values())

    def stats(self) -> KVCacheStats:
        return audit.kv_stats(
            self._pool,
            self._cache,
            self._seqs,
            self._counters,
            block_size=self._block_size,
            windows=self._windows,
            watermark_blocks=self._watermark_blocks,
            tier=self._tier,
        )

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless: each block's ref count equals the number of tables
        holding it; every block is exactly one of used (ref > 0), free (in an extent) or
        evictable (cached, ref 0, in the LRU) — so used + free + evictable == total; the
        extents and the prefix index are consistent; each table fits its token count and
        holds every entry its last answer named."""
        audit.check_integrity(
            self._pool,
            self._cache,
            self._seqs,
            block_size=self._block_size,
            windows=self._windows,
            enable_prefix_caching=self._enable_prefix_caching,
        )
        if self._tier is not None:
            self._tier.check_integrity()
