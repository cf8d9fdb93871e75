"""`pagoda simulate-routing`'s replica: one continuous-batching engine stepped an iteration
at a time, and its KV pool with the prefix cache (LRU, tails before heads) whose changes the
router's index follows (bench/simulate_routing.py's docstring tells the whole model).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable

from bench.sim_workload import Request, SimConfig


class IntegrityError(RuntimeError):
    """A simulated replica's block accounting broke: a bug in the simulator."""


class Replica:
    """One engine and its KV pool. Invariant: cached-in-use (`refs`) + private (`held`) +
    evictable (`lru_blocks`) blocks never exceed `capacity`; a key is in `refs` or `lru`, not
    both. `lru` maps a key to its number of blocks (1, or a request's unique tail), oldest first."""

    def __init__(
        self, index: int, config: SimConfig, on_cache_change: Callable[[bytes, int, bool], None] | None
    ) -> None:
        self.index, self.config, self.on_cache_change = index, config, on_cache_change
        self.capacity = config.cache_blocks
        self.refs: dict[bytes, int] = {}
        self.lru: OrderedDict[object, int] = OrderedDict()
        self.lru_blocks = 0
        self.held = 0
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[tuple[int, int, Request]] = []  # heap: (`steps` at its last token, id, it)
        self.steps = 0  # steps done
        self.stepping = False
        self.plan: list[tuple[Request, int]] = []  # prefill chunks of the step under way
        self.num_steps = 0  # steps planned, under way
        self.step_s = 0.0  # each one's duration
        self.step_start_s = 0.0
        self.version = 0  # of the plan: a step-end event of an older one is stale
        self.busy_s = 0.0
        self.num_requests = 0
        self.occupancy_s = 0.0  # summed time its requests spent here (Little: mean occupancy x time)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def kv_usage(self) -> float:
        """Blocks in use over the pool, as the KV service's stats count them."""
        return (len(self.refs) + self.held) / self.capacity

    @property
    def cache_fill(self) -> float:
        """Blocks in the prefix cache (in use or evictable) over the pool, as the router
        reads it from the index (the size of the replica's block set)."""
        return (len(self.refs) + self.lru_blocks) / self.capacity

    def check_integrity(self) -> None:
        used = len(self.refs) + self.held + self.lru_blocks
        if used > self.capacity or self.held < 0 or self.num_running > self.config.max_num_seqs:
            raise IntegrityError(
                f"replica {self.index}: {used} blocks of {self.capacity}, {self.held} held, {self.num_running} running"
            )
        if self.lru_blocks != sum(self.lru.values()) or self.refs.keys() & self.lru.keys():
            raise IntegrityError(f"replica {self.index}: the LRU's count is off or overlaps refs")
        if min(self.refs.values(), default=1) < 1:
            raise IntegrityError(f"replica {self.index}: a cached block in use by nobody")

    def _make_room(self, blocks: int) -> None:
        """Evict least recently used entries until `blocks` more fit."""
        while len(self.refs) + self.held + self.lru_blocks + blocks > self.capacity:
            key, n = self.lru.popitem(last=False)
            self.lru_blocks -= n
            if self.on_cache_change is not None and isinstance(key, bytes):
                self.on_cache_change(key, self.index, False)

    def _admit(self, request: Request, keys: list[bytes]) -> bool:
        """Start `request` on its prompt's leading cached blocks if its blocks fit."""
        refs, lru = self.refs, self.lru
        hits = pinned = 0  # pinned: evictable now, not once it runs
        for key in keys[: request.prefix_blocks]:
            if key in lru:
                pinned += 1
            elif key not in refs:
                break
            hits += 1
        total = -(-(request.prompt_tokens + request.output_tokens) // self.config.block_size)
        if len(refs) + self.held + pinned + total - hits > self.capacity:
            return False
        for key in keys[:hits]:
            if key in lru:
                self.lru_blocks -= lru.pop(key)
                refs[key] = 1
            else:
                refs[key] += 1
        self._make_room(total - hits)
        request.held_blocks = total - hits
        self.held += request.held_blocks
        request.cached_tokens = min(hits * self.config.block_size, request.prompt_tokens - 1)
        request.prefill_left = request.prompt_tokens - request.cached_tokens
        return True

    def _prefilled(self, request: Request, keys: list[bytes]) -> None:
        """Its prefix's full blocks join the cache (a block another request computed
        meanwhile is shared, and its own copy freed)."""
        refs, lru, announce = self.refs, self.lru, self.on_cache_change
        computed = keys[request.cached_tokens // self.config.block_size : request.prefix_blocks]
        for key in computed:
            if key in lru:
                self.lru_blocks -= lru.pop(key)
                refs[key] = 1
            elif key in refs:
                refs[key] += 1
            else:
                refs[key] = 1
                if announce is not None:
                    announce(key, self.index, True)
        request.held_blocks -= len(computed)
        self.held -= len(computed)

    def _finished(self, request: Request, keys: list[bytes]) -> None:
        refs, lru = self.refs, self.lru
        tail = request.prompt_blocks - request.prefix_blocks  # unique to it: one entry, evicted first
        self.held -= request.held_blocks
        if tail:
            lru[("tail", request.id)] = tail
            self.lru_blocks += tail
        for key in reversed(keys[: request.prefix_blocks]):  # tails before heads, so heads outlive them
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
                lru[key] = 1
                self.lru_blocks += 1

    def start_step(self, now: float, keys_of) -> float | None:
        """Admit what fits and plan the next steps; when they end, or None when idle.

        Steps that only decode are planned together, up to the next request to finish: until
        then nothing changes but the step count, unless a request arrives (`interrupt`)."""
        while self.waiting and self.num_running < self.config.max_num_seqs:
            if not self._admit(self.waiting[0], keys_of(self.waiting[0])):
                break
            self.prefilling.append(self.waiting.popleft())
        budget = self.config.max_batched_tokens - len(self.decoding)
        self.plan = []
        for request in self.prefilling:
            if budget <= 0:
                break
            chunk = min(budget, request.prefill_left)
            self.plan.append((request, chunk))
            budget -= chunk
        if not self.plan and not self.decoding:
            self.stepping = False
            return None
        c = self.config
        self.step_s = (
            c.decode_step_ms
            + c.decode_ms_per_seq * len(self.decoding)
            + c.prefill_ms_per_token * sum(n for _, n in self.plan)
        ) / 1000
        self.num_steps = 1 if self.plan else self.decoding[0][0] - self.steps
        self.step_start_s = now
        self.stepping = True
        self.version += 1
        return now + self.num_steps * self.step_s

    def interrupt(self, now: float) -> float | None:
        """A request arrived: planned decode-only steps end after the one under way, so that
        the next can admit it. The new end time, or None when it stands."""
        if not self.stepping or self.num_steps == 1:
            return None
        num_steps = min(self.num_steps, int((now - self.step_start_s) / self.step_s) + 1)
        if num_steps == self.num_steps:
            return None
        self.num_steps = num_steps
        self.version += 1
        return self.step_start_s + num_steps * self.step_s

    def end_step(self, now: float, keys_of) -> list[Request]:
        """The planned steps' tokens land; the requests they finished."""
        self.steps += self.num_steps
        self.busy_s += self.num_steps * self.step_s
        done = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            done.append(heapq.heappop(self.decoding)[2])
        for request, chunk in self.plan:
            request.prefill_left -= chunk
            if request.prefill_left == 0:
                self.prefilling.remove(request)
                request.first_token_s = now
                self._prefilled(request, keys_of(request))
                if request.output_tokens == 1:
                    done.append(request)
                else:
                    last = self.steps + request.output_tokens - 1
                    heapq.heappush(self.decoding, (last, request.id, request))
        for request in done:
            request.finish_s = now
            self.occupancy_s += now - request.arrival_s
            self._finished(request, keys_of(request))
        return done
