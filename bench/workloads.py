"""The benchmark workloads: fixed-seed prompts as token ids, with exact output lengths.

After the three workloads LLM-serving comparisons use, plus one for the prefix cache:

    short          128-token prompts, 4 output tokens (classification-like)
    long           64-token prompts, 512 output tokens (long generation)
    mixed          short and long interleaved, one of each in turn
    shared-prefix  one 1,024-token system prompt + a distinct 64-token question each

Prompts are drawn from the model tokenizer's vocabulary (special tokens excluded, its BOS
first when its encoder adds one) with a seeded generator, and sent as token ids, so every
arm of every comparison sees the same ids and the lengths are exact; requests run with
`ignore_eos`, so the output lengths are exact too. The nth request of a workload is the
same whatever the number asked for, so a run that stops early ran a prefix of another's.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

WORKLOAD_NAMES = ("short", "long", "mixed", "shared-prefix")


@dataclass(frozen=True)
class TokenSpace:
    """Which ids a prompt may hold: [0, vocab_size) without the special ids; BOS first if set."""

    vocab_size: int
    special_ids: frozenset[int] = frozenset()
    bos_id: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size - len({i for i in self.special_ids if 0 <= i < self.vocab_size}) < 2:
            raise ValueError(f"vocab_size: {self.vocab_size} leaves fewer than 2 ordinary tokens")

    @property
    def ordinary_ids(self) -> list[int]:
        return [i for i in range(self.vocab_size) if i not in self.special_ids]


def token_space_of(tokenizer) -> TokenSpace:
    """The token space of a `services.text.Tokenizer` (BOS only when `encode` adds it)."""
    adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    return TokenSpace(
        tokenizer.vocab_size, frozenset(tokenizer.special_token_ids), tokenizer.bos_token_id if adds_bos else None
    )


@dataclass(frozen=True)
class Shape:
    """Token counts of a workload; `quick` runs scale some down (see `Shape.scaled`)."""

    short_prompt: int = 128
    short_output: int = 4
    long_prompt: int = 64
    long_output: int = 512
    system_prompt: int = 1024
    question: int = 64
    shared_output: int = 16

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")


FULL_SHAPE = Shape()
# --quick: `long` generates 128 tokens instead of 512 and `shared-prefix` 8 instead of 16,
# so that every arm of a comparison finishes a few dozen requests in ~20 s on 2 cores.
QUICK_SHAPE = Shape(long_output=128, shared_output=8)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its index, what kind it is, its prompt ids and output length."""

    index: int
    kind: str  # "short", "long" or "shared-prefix"
    prompt_ids: tuple[int, ...]
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def _ids(rng: random.Random, ordinary: Sequence[int], n: int) -> list[int]:
    return [ordinary[rng.randrange(len(ordinary))] for _ in range(n)]


def _prompt(space: TokenSpace, ordinary: Sequence[int], rng: random.Random, n: int) -> tuple[int, ...]:
    """n ids in all: BOS (if the tokenizer adds one) then n-1 (or n) drawn ones."""
    if space.bos_id is not None:
        return (space.bos_id, *_ids(rng, ordinary, n - 1))
    return tuple(_ids(rng, ordinary, n))


def _kind_request(
    kind: str, i: int, shape: Shape, space: TokenSpace, ordinary: Sequence[int], seed: int
) -> BenchRequest:
    # one generator per (seed, kind, index): request i is the same however many are asked for
    rng = random.Random(f"{seed}/{kind}/{i}")
    if kind == "short":
        return BenchRequest(i, kind, _prompt(space, ordinary, rng, shape.short_prompt), shape.short_output)
    if kind == "long":
        return BenchRequest(i, kind, _prompt(space, ordinary, rng, shape.long_prompt), shape.long_output)
    raise ValueError(f"kind: {kind!r}")


def system_prompt(shape: Shape, space: TokenSpace, seed: int = 0) -> tuple[int, ...]:
    """The shared-prefix workload's common system prompt."""
    return _prompt(space, space.ordinary_ids, random.Random(f"{seed}/system"), shape.system_prompt)


def make_workload(
    name: str, num_requests: int, space: TokenSpace, shape: Shape = FULL_SHAPE, seed: int = 0
) -> list[BenchRequest]:
    """The first `num_requests` requests of workload `name`, deterministic in (space, shape, seed)."""
    if num_requests < 0:
        raise ValueError(f"num_requests: must be >= 0, got {num_requests}")
    pool = Workload(name, space, shape, seed, limit=num_requests)
    return [pool[i] for i in range(num_requests)]


class Workload(Sequence):
    """Requests 0 .. limit-1 of workload `name`, made when first read (a long pool costs
    nothing until a run gets that far)."""

    def __init__(
        self, name: str, space: TokenSpace, shape: Shape = FULL_SHAPE, seed: int = 0, limit: int = 100_000
    ) -> None:
        if name not in WORKLOAD_NAMES:
            raise ValueError(f"workload: must be one of {', '.join(WORKLOAD_NAMES)}, got {name!r}")
        self.name, self.space, self.shape, self.seed, self.limit = name, space, shape, seed, limit
        self._ordinary = space.ordinary_ids
        self._prefix = system_prompt(shape, space, seed) if name == "shared-prefix" else ()
        self._made: dict[int, BenchRequest] = {}

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, i):  # an int or a slice, as Sequence has it
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.limit))]
        if i < 0:
            i += self.limit
        if not 0 <= i < self.limit:
            raise IndexError(i)
        if i not in self._made:
            self._made[i] = self._make(i)
        return self._made[i]

    def _make(self, i: int) -> BenchRequest:
        shape, space, seed = self.shape, self.space, self.seed
        if self.name in ("short", "long"):
            return _kind_request(self.name, i, shape, space, self._ordinary, seed)
        if self.name == "mixed":
            kind = "short" if i % 2 == 0 else "long"
            r = _kind_request(kind, i // 2, shape, space, self._ordinary, seed)
            return BenchRequest(i, kind, r.prompt_ids, r.max_tokens)
        rng = random.Random(f"{seed}/question/{i}")
        question = tuple(_ids(rng, self._ordinary, shape.question))
        return BenchRequest(i, "shared-prefix", self._prefix + question, shape.shared_output)


def num_output_tokens(requests: Iterable[BenchRequest]) -> int:
    return sum(r.max_tokens for r in requests)


def num_prompt_tokens(requests: Iterable[BenchRequest]) -> int:
    return sum(r.num_prompt_tokens for r in requests)


def describe(name: str, shape: Shape) -> str:
    """One line on a workload's token counts, for the report."""
    if name == "short":
        return f"{shape.short_prompt}-token prompts, {shape.short_output} output tokens"
    if name == "long":
        return f"{shape.long_prompt}-token prompts, {shape.long_output} output tokens"
    if name == "mixed":
        return (
            f"short ({shape.short_prompt} in / {shape.short_output} out) and long "
            f"({shape.long_prompt} in / {shape.long_output} out), alternating"
        )
    if name == "shared-prefix":
        return (
            f"{shape.system_prompt}-token common system prompt + distinct {shape.question}-token "
            f"question, {shape.shared_output} output tokens"
        )
    raise ValueError(f"workload: {name!r}")
