"""`pagoda simulate-routing`'s workload: its settings (`SimConfig`) and the requests it
replays, tenants by weight, shared prefixes by Zipf popularity, Poisson arrivals at a share
of the fleet's cold capacity (bench/simulate_routing.py's docstring tells the whole model).
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass

from services.defaults import BLOCK_SIZE
from services.prefix_hash import block_keys


@dataclass(frozen=True)
class SimConfig:
    """One simulation's settings; times in milliseconds, lengths in tokens (inclusive ranges)."""

    requests_per_replica: int = 200
    load: float = 0.8
    tenants: int = 4
    tenant_skew: float = 2.0
    prefixes_per_replica: int = 16
    prefixes: int | None = None  # fixed, instead of per replica
    zipf: float = 1.0
    users_per_tenant: int = 64
    prefix_tokens: tuple[int, int] = (512, 2048)
    suffix_tokens: tuple[int, int] = (16, 512)
    output_tokens: tuple[int, int] = (16, 512)
    block_size: int = BLOCK_SIZE
    cache_blocks: int = 8192
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    prefill_ms_per_token: float = 0.1
    decode_step_ms: float = 10.0
    decode_ms_per_seq: float = 0.15
    poll_ms: float = 500.0  # the gateway's POLL_S
    index: str = "exact"
    warmup: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "requests_per_replica",
            "tenants",
            "prefixes_per_replica",
            "users_per_tenant",
            "block_size",
            "cache_blocks",
            "max_num_seqs",
            "max_batched_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("prefix_tokens", "suffix_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {low}-{high}")
        if self.prefixes is not None and self.prefixes < self.tenants:
            raise ValueError(f"prefixes ({self.prefixes}) must be at least tenants ({self.tenants})")
        if not 0 < self.load:
            raise ValueError(f"load must be positive, got {self.load}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")
        if min(self.prefill_ms_per_token, self.decode_step_ms, self.decode_ms_per_seq) < 0:
            raise ValueError("step times must not be negative")
        if self.poll_ms <= 0:
            raise ValueError(f"poll_ms must be positive, got {self.poll_ms}")
        if self.index not in ("exact", "polled"):
            raise ValueError(f"index must be exact or polled, got {self.index!r}")
        if self.max_seq_blocks > self.cache_blocks:
            raise ValueError(
                f"the longest request needs {self.max_seq_blocks} KV blocks, "
                f"more than cache_blocks ({self.cache_blocks})"
            )

    @property
    def max_seq_blocks(self) -> int:
        longest = self.prefix_tokens[1] + self.suffix_tokens[1] + self.output_tokens[1]
        return -(-longest // self.block_size)

    def num_prefixes(self, num_replicas: int) -> int:
        if self.prefixes is not None:
            return self.prefixes
        return max(self.tenants, self.prefixes_per_replica * num_replicas)

    def ideal_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Latency alone on an idle replica with a cold cache: the slowdown's denominator."""
        chunks = -(-prompt_tokens // self.max_batched_tokens)
        prefill_ms = chunks * self.decode_step_ms + prompt_tokens * self.prefill_ms_per_token
        return (prefill_ms + (output_tokens - 1) * (self.decode_step_ms + self.decode_ms_per_seq)) / 1000

    @property
    def capacity_per_replica(self) -> float:
        """Requests/s one replica sustains with no prefix cache, its batch as full as the KV
        pool and max_num_seqs allow (every prefill token and every decode step paid)."""
        mean = lambda r: (r[0] + r[1]) / 2  # noqa: E731
        prompt, output = mean(self.prefix_tokens) + mean(self.suffix_tokens), mean(self.output_tokens)
        batch = min(self.max_num_seqs, self.cache_blocks // math.ceil((prompt + output) / self.block_size))
        decode_ms = output * (self.decode_step_ms / batch + self.decode_ms_per_seq)
        return 1000 / (decode_ms + prompt * self.prefill_ms_per_token)


@dataclass(slots=True)
class Request:
    id: int
    tenant: int
    user: int
    arrival_s: float
    prefix: int
    prompt_tokens: int
    output_tokens: int
    prefix_blocks: int  # full blocks wholly inside the shared prefix: the only ones two prompts share
    prompt_blocks: int  # full blocks of the whole prompt
    cached_tokens: int = 0
    first_token_s: float = 0.0
    finish_s: float = 0.0
    held_blocks: int = 0  # private KV blocks (not in the prefix cache) held while it runs
    prefill_left: int = 0


@dataclass
class Workload:
    """Requests in arrival order, and each shared prefix's token ids and block keys."""

    requests: list[Request]
    prefix_token_ids: list[array]
    prefix_keys: list[list[bytes]]  # block_keys(prefix_token_ids[p]): every prompt's leading keys
    num_replicas: int


def _zipf_picker(n: int, s: float, rng: random.Random):
    weights = [1 / (rank + 1) ** s for rank in range(n)]
    cum, total = [], 0.0
    for w in weights:
        total += w
        cum.append(total)
    return lambda: rng.choices(range(n), cum_weights=cum)[0]


def make_workload(config: SimConfig, num_replicas: int) -> Workload:
    rng = random.Random(f"{config.seed}/{num_replicas}")
    bs = config.block_size
    num_prefixes = config.num_prefixes(num_replicas)
    prefix_len = [rng.randint(*config.prefix_tokens) for _ in range(num_prefixes)]
    token_ids = [array("H", rng.randbytes(2 * n)) for n in prefix_len]  # a 65,536-word vocabulary
    prefix_keys = [block_keys(t, bs) for t in token_ids]
    owned = [list(range(t, num_prefixes, config.tenants)) for t in range(config.tenants)]
    pickers = [_zipf_picker(len(o), config.zipf, rng) for o in owned]
    tenant_weights = [config.tenant_skew**-t for t in range(config.tenants)]
    rate = config.load * config.capacity_per_replica * num_replicas
    now, requests = 0.0, []
    for i in range(config.requests_per_replica * num_replicas):
        now += rng.expovariate(rate)
        tenant = rng.choices(range(config.tenants), weights=tenant_weights)[0]
        prefix = owned[tenant][pickers[tenant]()]
        prompt = prefix_len[prefix] + rng.randint(*config.suffix_tokens)
        requests.append(
            Request(
                i,
                tenant,
                rng.randrange(config.users_per_tenant),
                now,
                prefix,
                prompt,
                rng.randint(*config.output_tokens),
                prefix_len[prefix] // bs,
                prompt // bs,
            )
        )
    return Workload(requests, token_ids, prefix_keys, num_replicas)
