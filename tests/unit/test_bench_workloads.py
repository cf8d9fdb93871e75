"""`bench.workloads`: fixed-seed prompts with exact token counts; the transformers batching."""

from __future__ import annotations

import pytest

from bench.baseline import static_batches
from bench.workloads import (
    FULL_SHAPE,
    QUICK_SHAPE,
    Shape,
    TokenSpace,
    Workload,
    make_workload,
    num_output_tokens,
    num_prompt_tokens,
    system_prompt,
    token_space_of,
)

SPACE = TokenSpace(512, frozenset(range(5)))
BOS_SPACE = TokenSpace(512, frozenset(range(5)), bos_id=0)


def test_token_counts_are_exact():
    short = make_workload("short", 6, SPACE)
    assert all(len(r.prompt_ids) == 128 and r.max_tokens == 4 and r.kind == "short" for r in short)
    long = make_workload("long", 6, SPACE)
    assert all(len(r.prompt_ids) == 64 and r.max_tokens == 512 and r.kind == "long" for r in long)
    shared = make_workload("shared-prefix", 4, SPACE)
    assert all(len(r.prompt_ids) == 1024 + 64 and r.max_tokens == 16 for r in shared)
    assert num_output_tokens(short) == 24 and num_prompt_tokens(long) == 6 * 64


def test_mixed_interleaves_short_and_long_and_reuses_their_prompts():
    mixed = make_workload("mixed", 6, SPACE)
    assert [r.kind for r in mixed] == ["short", "long"] * 3
    assert [r.index for r in mixed] == list(range(6))
    short, long = make_workload("short", 3, SPACE), make_workload("long", 3, SPACE)
    assert [r.prompt_ids for r in mixed[0::2]] == [r.prompt_ids for r in short]
    assert [r.prompt_ids for r in mixed[1::2]] == [r.prompt_ids for r in long]


def test_same_seed_same_ids_other_seed_other_ids():
    assert make_workload("mixed", 8, SPACE, seed=3) == make_workload("mixed", 8, SPACE, seed=3)
    a, b = make_workload("short", 4, SPACE, seed=3), make_workload("short", 4, SPACE, seed=4)
    assert all(x.prompt_ids != y.prompt_ids for x, y in zip(a, b, strict=True))
    assert len({r.prompt_ids for r in make_workload("long", 20, SPACE)}) == 20


def test_a_shorter_run_is_a_prefix_of_a_longer_one():
    assert make_workload("mixed", 5, SPACE) == make_workload("mixed", 50, SPACE)[:5]
    pool = Workload("shared-prefix", SPACE, limit=30)
    assert [pool[i] for i in range(3)] == make_workload("shared-prefix", 3, SPACE)
    assert len(pool) == 30 and pool[-1].index == 29 and len(pool[2:5]) == 3
    with pytest.raises(IndexError):
        pool[30]


def test_no_special_ids_and_bos_first_when_the_tokenizer_adds_one():
    for r in make_workload("mixed", 20, SPACE):
        assert all(5 <= t < 512 for t in r.prompt_ids)
    for r in make_workload("mixed", 6, BOS_SPACE):
        assert r.prompt_ids[0] == 0 and all(t >= 5 for t in r.prompt_ids[1:])
        assert len(r.prompt_ids) in (128, 64)


def test_shared_prefix_shares_exactly_the_system_prompt():
    reqs = make_workload("shared-prefix", 5, SPACE)
    prefix = system_prompt(FULL_SHAPE, SPACE)
    assert all(r.prompt_ids[:1024] == prefix for r in reqs)
    assert len({r.prompt_ids[1024:] for r in reqs}) == 5


def test_quick_shape_scales_long_output_down():
    assert QUICK_SHAPE.long_output < FULL_SHAPE.long_output
    assert make_workload("long", 1, SPACE, QUICK_SHAPE)[0].max_tokens == QUICK_SHAPE.long_output


def test_bad_input():
    with pytest.raises(ValueError, match="workload"):
        make_workload("huge", 1, SPACE)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("short", -1, SPACE)
    with pytest.raises(ValueError, match="long_output"):
        Shape(long_output=0)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenSpace(3, frozenset({0, 1}))


def test_token_space_of_a_tokenizer():
    class Tok:
        vocab_size, special_token_ids, bos_token_id = 300, frozenset({0, 1}), 0

        def encode(self, text):
            return [0, 97]

    space = token_space_of(Tok())
    assert space == TokenSpace(300, frozenset({0, 1}), bos_id=0)
    Tok.encode = lambda self, text: [97]
    assert token_space_of(Tok()).bos_id is None


def test_static_batches_group_by_shape_in_order():
    mixed = make_workload("mixed", 7, SPACE, QUICK_SHAPE)
    batches = static_batches(mixed, 2)
    assert [[r.index for r in b] for b in batches] == [[0, 2], [4, 6], [1, 3], [5]]
    for b in batches:
        assert len({(r.num_prompt_tokens, r.max_tokens) for r in b}) == 1
    with pytest.raises(ValueError):
        static_batches(mixed, 0)
