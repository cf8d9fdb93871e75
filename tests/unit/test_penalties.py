"""Presence, frequency and repetition penalties and logit bias: the sampler against the
definitions, and whole generations through the in-process engine against `transformers`
(support/penalties.py), with batching, pipeline splits, n > 1 and preemption."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from support.penalties import check_greedy, processed

from scheduler_svc.core.request import SamplingOptions
from services.sampling import SamplingParams
from wiring.local_engine import LLM
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.logit_filters import apply_logit_bias, apply_penalties
from worker_svc.execution.sampler import Sampler
from worker_svc.execution.sampler_types import SampleRow, SequenceSamplerState

VOCAB = 40
CASES = [  # (presence, frequency, repetition, logit bias)
    (0.0, 0.0, 1.0, {}),
    (0.5, 0.0, 1.0, {}),
    (0.0, 0.7, 1.0, {}),
    (0.0, 0.0, 1.3, {}),
    (-0.4, 1.1, 0.8, {3: 2.0, 7: -100.0}),
    (2.0, -2.0, 2.0, {}),
]


def rows_and_states(g):
    rows, states = [], []
    for i, (presence, frequency, repetition, bias) in enumerate(CASES):
        params = SamplingParams(
            temperature=0.0,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            logit_bias=tuple(bias.items()),
            num_logprobs=0,
        )  # the sampled token's logprob only
        prompt = torch.randint(0, VOCAB, (5,), generator=g).tolist()
        output = torch.randint(0, VOCAB, (i * 2,), generator=g).tolist()
        rows.append(SampleRow(i, params, 0, len(output), 1, (tuple(prompt), tuple(output))))
        states.append(SequenceSamplerState(i, list(output), tuple(prompt), True))
    return rows, states


def test_bias_and_penalties_follow_the_definitions():
    g = torch.Generator().manual_seed(0)
    rows, states = rows_and_states(g)
    logits = torch.randn(len(rows), VOCAB, generator=g) * 3
    got = apply_penalties(apply_logit_bias(logits, rows), rows, states)
    for i, (presence, frequency, repetition, bias) in enumerate(CASES):
        want = processed(
            logits[i],
            list(states[i].prompt_token_ids),
            states[i].output_token_ids,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            logit_bias=bias,
        )
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)


def test_the_sampler_keeps_each_sequences_history():
    g = torch.Generator().manual_seed(1)
    rows, _ = rows_and_states(g)
    sampler = Sampler()
    history = {row.seq_id: (list(row.history[0]), list(row.history[1])) for row in rows}
    for step in range(4):
        logits = torch.randn(len(rows), VOCAB, generator=g) * 3
        out = sampler.sample(logits, rows)
        for i, (presence, frequency, repetition, bias) in enumerate(CASES):
            prompt, output = history[i]
            want = processed(
                logits[i],
                prompt,
                output,
                presence=presence,
                frequency=frequency,
                repetition=repetition,
                logit_bias=bias,
            )
            assert out.token_ids[i] == int(want.argmax()), (step, i)
            # reported logprobs stay those of the raw logits
            assert out.logprobs[i] == pytest.approx(float(torch.log_softmax(logits[i], -1)[out.token_ids[i]]), abs=1e-6)
            output.append(out.token_ids[i])
        rows = [SampleRow(r.seq_id, r.params, 0, len(history[r.seq_id][1]), 1) for r in rows]
    # a re-sent history (a re-admitted sequence) replaces the state
    rows[1] = SampleRow(1, rows[1].params, 0, 1, 1, ((9,), (9,)))
    sampler.sample(torch.zeros(len(rows), VOCAB), rows)
    assert sampler.state(1).prompt_token_ids == (9,) and sampler.state(1).output_token_ids[:1] == [9]


def test_penalties_without_history_are_refused():
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    with pytest.raises(InvalidPlanError, match="history"):
        Sampler().sample(torch.zeros(1, VOCAB), [SampleRow(4, params, 0, 0, 1)])
    with pytest.raises(ValueError, match="history holds 1 output tokens at output_position 0"):
        SampleRow(4, params, 0, 0, 1, ((1,), (2,)))


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.01),
        ("logit_bias", ((3, 100.5),)),
        ("logit_bias", ((3, 1.0), (3, 2.0))),
    ],
)
def test_bad_params_are_refused(field, value):
    with pytest.raises(ValueError, match=field if field != "logit_bias" else "logit_bias"):
        SamplingParams(**{field: value})


# --- whole generations -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


ENGINE_CASES = [
    {},
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.8},
    {"presence_penalty": 1.5, "logit_bias": {11: 3.0, 12: -100.0}},
    {"presence_penalty": -0.5, "frequency_penalty": 0.4, "repetition_penalty": 0.9},
    {"logit_bias": {20: 5.0}},
]


def options(case, **more):
    bias = tuple(sorted(case.get("logit_bias", {}).items()))
    fields = {
        "max_tokens": 24,
        "temperature": 0.0,
        "ignore_eos": True,
        "logit_bias": bias,
        **{k: v for k, v in case.items() if k != "logit_bias"},
        **more,
    }
    return SamplingOptions(**fields)


def reference_kwargs(case):
    return {
        "presence": case.get("presence_penalty", 0.0),
        "frequency": case.get("frequency_penalty", 0.0),
        "repetition": case.get("repetition_penalty", 1.0),
        "logit_bias": case.get("logit_bias"),
    }


@pytest.mark.parametrize(("pp", "num_kv_blocks"), [(1, 512), (2, 512), (1, 14)])
def test_greedy_with_penalties_equals_transformers(model_dir, hf_llama, pp, num_kv_blocks):
    """Every case in one batch, twice over; with 14 blocks of 4 (one request at a time fits
    for sure) the batch is preempted and recomputed, so the sampler's history is re-sent
    under new sequence ids."""
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(5, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 29, (2 * len(ENGINE_CASES),), generator=g)
    ]
    cases = ENGINE_CASES * 2
    llm = LLM(
        model_dir, pipeline_parallel_size=pp, num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=64
    )
    outs = llm.generate(prompts, [options(c) for c in cases], detokenize=False)
    for prompt, case, out in zip(prompts, cases, outs, strict=True):
        got = out.outputs[0].token_ids
        assert len(got) == 24
        check_greedy(hf_llama, prompt, got, **reference_kwargs(case))
    if num_kv_blocks == 14:
        assert sum(o.num_preemptions for o in outs) > 0
    # the penalties changed something: repetition_penalty 1.3 differs from no penalty
    plain = llm.generate(prompts[1:2], [options({})], detokenize=False)[0].outputs[0].token_ids
    assert plain != outs[1].outputs[0].token_ids


def test_n_choices_each_keep_their_own_history(model_dir, hf_llama):
    prompt = list(range(30, 50))
    case = {"frequency_penalty": 1.0, "repetition_penalty": 1.2}
    out = LLM(model_dir, num_kv_blocks=256).generate(
        [prompt], [options(case, n=3, temperature=0.8, seed=5)], detokenize=False
    )[0]
    assert len(out.outputs) == 3
    # sampled choices, but every one was drawn from the penalised distribution: replaying the
    # same seeds alone gives the same tokens
    again = LLM(model_dir, num_kv_blocks=256).generate(
        [prompt, prompt[:5]], [options(case, n=3, temperature=0.8, seed=5), options({})], detokenize=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # ...and the penalties took part in the draws: the same seeds without them differ
    unpenalised = LLM(model_dir, num_kv_blocks=256).generate(
        [prompt], [options({}, n=3, temperature=0.8, seed=5)], detokenize=False
    )[0]
    assert [c.token_ids for c in unpenalised.outputs] != [c.token_ids for c in out.outputs]
    greedy = LLM(model_dir, num_kv_blocks=256).generate([prompt], [options(case, n=2)], detokenize=False)[0]
    for choice in greedy.outputs:
        check_greedy(hf_llama, prompt, choice.token_ids, **reference_kwargs(case))


def test_a_request_that_can_never_fit_is_refused_not_left_waiting(model_dir):
    llm = LLM(model_dir, num_kv_blocks=14, block_size=4)
    with pytest.raises(ValueError, match="need up to 15 KV blocks; the pool has 14"):
        llm.generate([list(range(5, 41))], [options({})], detokenize=False)


def test_the_wire_carries_penalties_bias_and_history():
    """A step plan as the scheduler encodes it, read back by a stage: what the sampler gets.
    The history (prompt and output so far) is the sequence's state, sent once."""
    from scheduler_svc.core.request import sampling_params
    from services.step import NewSeq, StepPlan
    from services.step_codec import plan_from_pb, plan_to_pb
    from worker_svc.execution.batch import PersistentBatch, StageShape

    o = options(
        {
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "repetition_penalty": 1.5,
            "logit_bias": {3: -100.0, 9: 2.5},
        }
    )
    sent = StepPlan(
        3,
        (
            NewSeq(11, (5, 6, 7, 8, 8), 3, 0, 5, (0, 1), sampling_params(o, (1,)), 0, 99),
            NewSeq(12, (5,), 1, 0, 1, (2,), sampling_params(options({}), ()), 0, 1),
        ),
    )
    plan = plan_from_pb(plan_to_pb(sent))
    assert plan == sent
    stage = PersistentBatch(StageShape(True, True, 8, 4, 4096, VOCAB))
    row, other = stage.apply(plan)
    assert row.sample and other.sample
    state = row.state
    assert (tuple(state.token_ids[: state.prompt_len]), tuple(state.token_ids[state.prompt_len :])) == (
        (5, 6, 7),
        (8, 8),
    )
    p = state.sampling
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.5)
    assert p.logit_bias == ((3, -100.0), (9, 2.5)) and p.uses_penalties and p.eos_token_ids == (1,)
    assert not other.state.sampling.uses_penalties and other.state.sampling.logit_bias == ()


# --- running counts --------------------------------------------------------------------------


def test_running_counts_follow_the_history_across_steps_and_a_reseed():
    """The sampler's per-sequence counts and prompt set stay those of output_token_ids and
    prompt_token_ids, whether a token was sampled, the state was seeded, or re-seeded."""
    g = torch.Generator().manual_seed(2)
    rows, _ = rows_and_states(g)
    rows.append(SampleRow(99, SamplingParams(temperature=1.0, seed=4), 0, 0, 1))  # no penalties
    sampler = Sampler()
    expected = {row.seq_id: list(row.history[1]) if row.history else [] for row in rows}
    for step in range(6):
        if step == 3:  # re-admitted: a new history replaces the state
            rows[2] = SampleRow(2, rows[2].params, 0, 5, 1, ((1, 2, 2, VOCAB + 1), (5, 5, 7, 5, 0)))
            expected[2] = [5, 5, 7, 5, 0]
        out = sampler.sample(torch.randn(len(rows), VOCAB, generator=g) * 3, rows)
        for row, token in zip(rows, out.token_ids, strict=True):
            expected[row.seq_id].append(token)
            state = sampler.state(row.seq_id)
            assert state.output_token_ids == expected[row.seq_id], (step, row.seq_id)
            assert state.output_token_counts == Counter(state.output_token_ids), (step, row.seq_id)
            assert state.prompt_token_id_set == set(state.prompt_token_ids), (step, row.seq_id)
        rows = [SampleRow(r.seq_id, r.params, 0, len(expected[r.seq_id]), 1) for r in rows]
    assert sampler.state(2).prompt_token_ids == (1, 2, 2, VOCAB + 1)
    assert sampler.state(2).prompt_token_id_set == {1, 2, VOCAB + 1}


def test_a_long_history_is_penalised_as_the_definitions_say():
    """5,000 output tokens per row, some ids beyond the vocabulary (skipped): the whole
    penalised row equals the definition at every step, and so does the greedy pick."""
    g = torch.Generator().manual_seed(3)
    rows, history = [], {}
    for i, (presence, frequency, repetition, bias) in enumerate(CASES):
        params = SamplingParams(
            temperature=0.0,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            logit_bias=tuple(bias.items()),
            num_logprobs=0,
        )  # the sampled token's logprob only
        prompt = torch.randint(0, VOCAB + 4, (300,), generator=g).tolist()
        output = torch.randint(0, VOCAB + 4, (5000,), generator=g).tolist()
        rows.append(SampleRow(i, params, 0, len(output), 1, (tuple(prompt), tuple(output))))
        history[i] = (prompt, output)
    assert any(t >= VOCAB for _, output in history.values() for t in output)
    sampler = Sampler()
    for step in range(4):
        logits = torch.randn(len(rows), VOCAB, generator=g) * 3
        wants = []
        for i, (presence, frequency, repetition, bias) in enumerate(CASES):
            prompt, output = history[i]
            wants.append(
                processed(
                    logits[i],
                    [t for t in prompt if t < VOCAB],
                    [t for t in output if t < VOCAB],
                    presence=presence,
                    frequency=frequency,
                    repetition=repetition,
                    logit_bias=bias,
                )
            )
        if step:  # the states the sampler has kept since the seeding step
            states = [sampler.state(row.seq_id) for row in rows]
            got = apply_penalties(apply_logit_bias(logits, rows), rows, states)
            for i, want in enumerate(wants):
                torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-4)
        out = sampler.sample(logits, rows)
        for i, want in enumerate(wants):
            assert out.token_ids[i] == int(want.argmax()), (step, i)
            history[i][1].append(out.token_ids[i])
        rows = [SampleRow(r.seq_id, r.params, 0, len(history[r.seq_id][1]), 1) for r in rows]
