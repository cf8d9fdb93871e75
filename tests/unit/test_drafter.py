"""The draft proposer of speculative decoding (worker_svc/execution/drafter.py): its drafts are the
draft model's greedy continuation as `transformers` computes it, across rejections, a pool
too small for every sequence, and the k / max_model_len edges."""

from __future__ import annotations

import pytest
import torch
from support.reference import HFReference

from worker_svc.execution.drafter import DraftBlockPool, DraftProposer
from worker_svc.models.registry import load_config

DRAFT_SPEC = dict(arch="llama", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1)
K = 4


@pytest.fixture(scope="module")
def draft_dir(model_factory):
    return model_factory(**DRAFT_SPEC)


@pytest.fixture(scope="module")
def ref(draft_dir):
    return HFReference(draft_dir)


def make(draft_dir, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256) -> DraftProposer:
    return DraftProposer(draft_dir, K, max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check(ref: HFReference, known: list[int], drafts: tuple[int, ...], k: int) -> None:
    assert len(drafts) == k
    ref.compare(known, list(drafts))


def test_draft_and_target_share_a_vocabulary(draft_dir, model_factory):
    proposer = make(draft_dir)
    target = load_config(model_factory(arch="llama"))
    assert proposer.vocab_size == target.vocab_size == 512
    assert proposer.model.config.num_layers == 2 and proposer.model.is_first and proposer.model.is_last


def test_a_batch_of_different_lengths_equals_transformers(draft_dir, ref):
    proposer = make(draft_dir)
    seqs = [(10, prompt(1, 1), 4), (11, prompt(5, 2), 3), (12, prompt(17, 3), 4), (13, prompt(33, 4), 1)]
    got = proposer.propose(seqs)
    for (_, known, k), drafts in zip(seqs, got, strict=True):
        check(ref, known, drafts, k)
    proposer.check_integrity()
    # every known token and every draft fed (all but the last) holds its K/V
    assert proposer.computed_tokens(12) == tuple(seqs[2][1]) + got[2][:-1]
    assert proposer.num_forward_tokens == (1 + 5 + 17 + 33) + 3 + 2 + 3


def test_after_a_partial_rejection_the_drafts_again_equal_transformers(draft_dir, ref):
    proposer = make(draft_dir)
    knowns = {1: prompt(6, 5), 2: prompt(14, 6), 3: prompt(3, 7)}
    drafts = dict(zip(knowns, proposer.propose([(s, t, K) for s, t in knowns.items()]), strict=True))
    # the target accepts two drafts of seq 1 and then picks another token, accepts all of
    # seq 2's and adds its own, and rejects seq 3's first
    other = lambda token: 5 + (token + 1) % 400  # noqa: E731
    knowns[1] += [*drafts[1][:2], other(drafts[1][2])]
    knowns[2] += [*drafts[2], 77]
    knowns[3] += [other(drafts[3][0])]
    before = proposer.num_forward_tokens
    again = proposer.propose([(s, t, K) for s, t in knowns.items()])
    for seq_id, got in zip(knowns, again, strict=True):
        check(ref, knowns[seq_id], got, K)
    # reused: seq 1 recomputes from its third draft, seq 2 runs its last draft and the new
    # token, seq 3 only its new token; then K - 1 steps each
    assert proposer.num_forward_tokens - before == 1 + 2 + 1 + 3 * (K - 1)
    proposer.check_integrity()


def test_asking_again_with_nothing_new_recomputes_the_last_position(draft_dir, ref):
    proposer = make(draft_dir)
    known = prompt(9, 8)
    first = proposer.propose([(5, known, K)])
    assert proposer.propose([(5, known, K)]) == first
    shorter = known[:4]  # the caller went back: only the prefix is kept
    check(ref, shorter, proposer.propose([(5, shorter, 2)])[0], 2)
    proposer.check_integrity()


def test_tokens_that_differ_before_the_last_are_computed_again(draft_dir, ref):
    proposer = make(draft_dir)
    known = prompt(12, 26)
    proposer.propose([(6, known, K)])
    changed = known[:3] + prompt(12, 27)  # the caller's tokens differ from position 3 on
    before = proposer.num_forward_tokens
    check(ref, changed, proposer.propose([(6, changed, K)])[0], K)
    assert proposer.num_forward_tokens - before == 12 + K - 1
    assert proposer.computed_tokens(6)[:15] == tuple(changed)
    proposer.check_integrity()


def test_release_and_reset_free_the_blocks(draft_dir):
    proposer = make(draft_dir, num_blocks=16)
    proposer.propose([(1, prompt(10, 9), K), (2, prompt(6, 10), K)])
    # 10 + 3 positions in 4 blocks of 4, 6 + 3 in 3
    assert proposer.num_free_blocks == 16 - 4 - 3
    proposer.release([1, 99])  # an unknown id is ignored
    assert proposer.num_free_blocks == 16 - 3 and proposer.cached_seq_ids == (2,)
    proposer.check_integrity()
    proposer.reset()
    assert proposer.num_free_blocks == 16 and proposer.cached_seq_ids == ()
    proposer.check_integrity()


def test_a_pool_too_small_for_every_sequence_drops_the_least_recently_used(draft_dir, ref):
    proposer = make(draft_dir, num_blocks=6)
    knowns = {1: prompt(10, 11), 2: prompt(12, 12), 3: prompt(7, 13), 4: prompt(30, 14)}
    rounds = 3
    for round_ in range(rounds):
        got = proposer.propose([(s, t, 3) for s, t in knowns.items()])
        proposer.check_integrity()
        # 1, 2 and 3 need 3, 4 and 3 blocks of the 6 (more as they grow); 4 never fits
        assert got[3] == ()
        for seq_id, drafts in zip((1, 2, 3), got, strict=False):
            check(ref, knowns[seq_id], drafts, 3)
            knowns[seq_id] += [*drafts[: round_ % 3], 5 + (drafts[round_ % 3] + 1) % 400]
    assert 4 not in proposer.cached_seq_ids


def test_eviction_takes_the_least_recently_used_first(draft_dir, ref):
    proposer = make(draft_dir, num_blocks=8)
    a, b, c = prompt(6, 15), prompt(6, 16), prompt(6, 17)  # 6 + 1 positions: 2 blocks each
    for seq_id, known in ((1, a), (2, b), (3, c)):
        proposer.propose([(seq_id, known, 2)])
    proposer.propose([(1, a, 2)])  # 1 used again: 2 is now the least recently used
    assert proposer.cached_seq_ids == (2, 3, 1) and proposer.num_free_blocks == 2
    d = prompt(10, 18)  # 10 + 1 positions: 3 blocks, one more than are free
    check(ref, d, proposer.propose([(4, d, 2)])[0], 2)
    assert proposer.cached_seq_ids == (3, 1, 4) and proposer.num_free_blocks == 1
    proposer.check_integrity()


def test_k_zero_and_max_model_len_cap_the_drafts(draft_dir, ref):
    proposer = make(draft_dir, max_model_len=20)
    at_limit, near, past, short = prompt(20, 19), prompt(18, 20), prompt(25, 21), prompt(4, 22)
    got = proposer.propose([(1, at_limit, K), (2, near, K), (3, past, K), (4, short, 0), (5, short, K)])
    assert got[0] == got[2] == got[3] == ()
    check(ref, near, got[1], 2)  # positions 18 and 19 only
    check(ref, short, got[4], K)
    assert proposer.cached_seq_ids == (2, 5)
    assert len(proposer.computed_tokens(2)) == 19  # never a position >= max_model_len
    proposer.check_integrity()


def test_malformed_requests_change_nothing(draft_dir):
    proposer = make(draft_dir)
    proposer.propose([(1, prompt(5, 23), K)])
    held = (proposer.num_free_blocks, proposer.computed_tokens(1))
    for bad in (
        [(2, [7], K + 1)],
        [(2, [7], 1), (2, [8], 1)],
        [(2, [], 1)],
        [(2, [7, 512], 1)],
        [(1, prompt(5, 23) + [-1], 1)],
    ):
        with pytest.raises(ValueError):
            proposer.propose(bad)
    assert (proposer.num_free_blocks, proposer.computed_tokens(1)) == held
    with pytest.raises(ValueError):
        DraftProposer(draft_dir, 0, max_model_len=16, num_blocks=4)


def test_the_block_pool_hands_out_the_oldest_freed_ids_first():
    pool = DraftBlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None and pool.num_free == 1
    pool.free([1, 0])
    assert pool.allocate(3) == [3, 1, 0] and pool.num_free == 0


def test_a_gguf_draft_loads_from_its_prepared_folder(gguf_factory):
    from wiring.model_source import prepare_gguf

    path = gguf_factory("Q8_0", **DRAFT_SPEC)
    proposer = DraftProposer(prepare_gguf(path), K, max_model_len=64, num_blocks=16, block_size=4)
    ref = HFReference(None, gguf_file=path)
    knowns = [prompt(3, 24), prompt(11, 25)]
    got = proposer.propose([(i, t, K) for i, t in enumerate(knowns)])
    for known, drafts in zip(knowns, got, strict=True):
        check(ref, known, drafts, K)
