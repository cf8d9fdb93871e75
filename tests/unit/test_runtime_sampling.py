"""Seeded sampling through the runtime, plan validation, and block copies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.driver import DriverSeq, PipelineDriver
from support.reference import HFReference

from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, StepPlan
from worker_svc.checkpoints.loader import load_stage
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.runner import StageRunner

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


def runners(model_dir, num_stages, block_size=16, num_blocks=256):
    return [StageRunner(load_stage(model_dir, k, num_stages), num_blocks, block_size) for k in range(num_stages)]


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(5, 512, (int(length),), generator=g).tolist()
        for length in torch.randint(1, 60, (n,), generator=g)
    ]


def run(model_dir, num_stages, seqs, chunk=None):
    return PipelineDriver(runners(model_dir, num_stages), chunk_size=chunk).run(seqs)


def seeded(seed, temperature=0.9, **kw):
    return SamplingParams(temperature=temperature, top_p=0.95, seed=seed, **kw)


def test_seed_is_independent_of_batch_position_and_split(model_dir):
    target = prompts(1, seed=99)[0]
    alone = run(model_dir, 1, [DriverSeq(0, target, NEW_TOKENS, seeded(42))])[0]
    # the same request at row 5 of a batch of 8, arriving later, others sampled differently
    others = prompts(7)
    batch = [DriverSeq(i + 10, p, NEW_TOKENS, seeded(i), arrival_step=i % 3) for i, p in enumerate(others)]
    batch.insert(5, DriverSeq(3, target, NEW_TOKENS, seeded(42), arrival_step=2))
    in_batch = run(model_dir, 1, batch, chunk=5)[5]
    split = run(model_dir, 3, [DriverSeq(77, target, NEW_TOKENS, seeded(42))], chunk=7)[0]
    assert alone == in_batch == split
    other_seed = run(model_dir, 1, [DriverSeq(0, target, NEW_TOKENS, seeded(43))])[0]
    assert other_seed != alone


def test_choices_of_one_request_differ(model_dir):
    target = prompts(1, seed=5)[0]
    seqs = [DriverSeq(i, target, NEW_TOKENS, seeded(1, temperature=1.2), choice_index=i) for i in range(2)]
    a, b = run(model_dir, 2, seqs)
    assert a != b


def test_block_copy_then_fork_continues_like_transformers(model_dir):
    """A sequence forked mid-block: the child's partial block is copied, then both decode
    from the stage's persistent state (each step sends only appended blocks)."""
    ref = HFReference(model_dir)
    (runner,) = runners(model_dir, 1, block_size=8, num_blocks=16)
    prompt = prompts(1, seed=11)[0][:21]  # 21 tokens: block 2 holds 5 of 8 slots
    greedy = SamplingParams(temperature=0.0)

    parent_table = [3, 9, 4]
    out = runner.execute(StepPlan(0, (NewSeq(1, tuple(prompt), 21, 0, 21, (3, 9, 4), greedy),)), keep_logits=True)
    first = out.sampled.token_ids[0]
    # fork: the child shares blocks 3 and 9; block 4 (partial) is copied into block 12
    child_table = [3, 9, 12]
    forced = [first, (first + 1) % 512]  # force the two children apart (sent whole again)
    plan = StepPlan(
        1,
        (
            NewSeq(1, (*prompt, forced[0]), 21, 21, 1, tuple(parent_table), greedy),
            NewSeq(2, (*prompt, forced[1]), 21, 21, 1, tuple(child_table), greedy),
        ),
        block_copies=((4, 12),),
    )
    tokens = {1: [forced[0]], 2: [forced[1]]}
    tables = {1: parent_table, 2: child_table}
    result = runner.execute(plan)
    for step in range(6):
        for seq_id, tok in zip(result.sampled_seq_ids, result.sampled.token_ids, strict=True):
            tokens[seq_id].append(tok)
        ctx = 21 + len(tokens[1]) - 1
        cached = []
        for seq_id, table in tables.items():
            held = len(table)
            if len(table) * 8 <= ctx:
                table.append({1: 5, 2: 6}[seq_id] + 8 * (len(table) - 3))
            cached.append(CachedSeq(seq_id, 1, held, tuple(table[held:])))
        result = runner.execute(StepPlan(2 + step, cached_seqs=tuple(cached)))
    for seq_id in (1, 2):
        got = tokens[seq_id][1:]
        want, _ = ref.greedy(prompt + [forced[seq_id - 1]], len(got))
        assert ref.compare(prompt + [forced[seq_id - 1]], got).tie_divergences == 0, (got, want)


def _valid_seq() -> NewSeq:
    return NewSeq(1, (5, 6, 7), 3, 0, 3, (2,), SamplingParams(temperature=0.0))


def _valid_plan(runner: StageRunner) -> StepPlan:
    return StepPlan(0, (_valid_seq(),))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: dataclasses.replace(s, block_ids=(999,)), "block id 999 out of range"),
        (lambda s: dataclasses.replace(s, block_ids=()), "block table has 0 blocks"),
        (
            lambda s: dataclasses.replace(s, token_ids=(5, 6), prompt_len=2),
            "computes up to position 2 but knows 2 tokens",
        ),
        (lambda s: dataclasses.replace(s, token_ids=(5, 6, 100000)), "token id outside"),
        (lambda s: dataclasses.replace(s, num_scheduled=0), "need at least one"),
        (
            lambda s: dataclasses.replace(s, num_computed=9999, token_ids=(5,) * 10003),
            "exceeds max_position_embeddings",
        ),
        (lambda s: dataclasses.replace(s, prompt_len=0), "prompt_len 0"),
    ],
)
def test_malformed_plan_fails_and_changes_nothing(model_dir, mutate, message):
    (runner,) = runners(model_dir, 1)
    good = _valid_plan(runner)
    before = [k.clone() for k, _ in runner.kv_cache.pools]
    bad = StepPlan(0, (mutate(good.new_seqs[0]),))
    with pytest.raises(InvalidPlanError, match=message):
        runner.execute(bad)
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, runner.kv_cache.pools, strict=True))
    assert len(runner.batch) == 0
    assert runner.execute(good).sampled is not None  # and the stage keeps serving


@pytest.mark.parametrize(
    ("cached", "message"),
    [
        (CachedSeq(7, 1, 1), "not held by this stage"),
        (CachedSeq(1, 1, block_offset=5), "block_offset 5 beyond its 1 blocks"),
        (CachedSeq(1, 2, 1), "computes up to position 4 but knows 4 tokens"),
        (CachedSeq(1, 1, 0), "block table has 0 blocks"),
        (CachedSeq(1, 1, 0, (999,)), "block id 999 out of range"),
    ],
)
def test_a_diff_that_does_not_fit_the_held_state_fails_and_changes_nothing(model_dir, cached, message):
    (runner,) = runners(model_dir, 1)
    runner.execute(_valid_plan(runner))  # holds sequence 1: 3 tokens computed, 4 known
    state = runner.batch.seqs[1]
    before = (list(state.token_ids), state.num_computed, list(state.block_ids))
    with pytest.raises(InvalidPlanError, match=message):
        runner.execute(StepPlan(1, cached_seqs=(cached,)))
    assert (list(state.token_ids), state.num_computed, list(state.block_ids)) == before
    assert runner.execute(StepPlan(2, cached_seqs=(CachedSeq(1, 1, 1),))).sampled is not None


def test_wrong_stage_inputs(model_dir):
    first, last = runners(model_dir, 2)
    plan = _valid_plan(first)
    with pytest.raises(InvalidPlanError, match="hidden states of shape None"):
        last.execute(plan)
    with pytest.raises(InvalidPlanError, match=r"expected \(3, 64\)"):
        last.execute(plan, torch.zeros(4, 64))
    with pytest.raises(InvalidPlanError, match="stage 0 takes token ids"):
        first.execute(plan, torch.zeros(3, 64))
    with pytest.raises(InvalidPlanError, match="block copy"):
        first.execute(dataclasses.replace(plan, block_copies=((1, 5000),)))
    with pytest.raises(InvalidPlanError, match="appears twice"):
        first.execute(dataclasses.replace(plan, new_seqs=plan.new_seqs * 2))


def test_release_drops_sampler_state(model_dir):
    (runner,) = runners(model_dir, 1)
    runner.execute(_valid_plan(runner))
    assert runner.sampler.num_live_states == 1
    moved = dataclasses.replace(_valid_seq(), seq_id=2)
    runner.execute(StepPlan(1, (moved,), finished_seq_ids=(1,)))
    assert runner.sampler.num_live_states == 1 and runner.sampler.state(1) is None
    assert set(runner.batch.seqs) == {2}
