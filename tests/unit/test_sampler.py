"""The last stage's sampler: masks, filters against their analytic distributions, counter-based seeds."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from services.sampling import SamplingParams
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.counter_rng import _mix32, _mix32_int, _mul32, row_key, uniform_bits
from worker_svc.execution.sampler import Sampler
from worker_svc.execution.sampler_types import SampleRow

torch.set_num_threads(1)

# Hand-made logits over a small vocabulary: distinct values, no two tokens near a filter boundary.
LOGITS = torch.tensor([2.0, 1.6, 1.3, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.6, -1.0, -1.5])
NUM_DRAWS = 20_000
MIN_P_VALUE = 1e-3


def _row(seq_id: int, params: SamplingParams, position: int = 0, choice: int = 0, entropy: int = 7):
    return SampleRow(seq_id=seq_id, params=params, choice_index=choice, output_position=position, entropy_seed=entropy)


def _draw_positions(params: SamplingParams, logits: torch.Tensor, positions: range) -> list[int]:
    """One independent draw per output position, all in one batch (position = counter)."""
    rows = [_row(i, params, position=p) for i, p in enumerate(positions)]
    out = Sampler().sample(logits.expand(len(rows), -1), rows)
    return out.token_ids


def _counts(tokens: list[int], vocab_size: int) -> list[int]:
    counts = [0] * vocab_size
    for token in tokens:
        counts[token] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# Analytic distributions, in float64, following the definitions


def _softmax(logits: list[float], temperature: float) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    return [w / total for w in weights]


def _renormalised(probs: list[float], keep: set[int]) -> list[float]:
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


def _ranked(probs: list[float]) -> list[int]:
    return sorted(range(len(probs)), key=lambda i: (-probs[i], i))


def _top_k_set(probs: list[float], k: int) -> set[int]:
    return set(_ranked(probs)[:k])


def _nucleus(probs: list[float], top_p: float) -> set[int]:
    keep: set[int] = set()
    mass = 0.0
    for i in _ranked(probs):
        if mass >= top_p:
            break
        keep.add(i)
        mass += probs[i]
    return keep


def _min_p_set(probs: list[float], min_p: float) -> set[int]:
    top = max(probs)
    return {i for i, p in enumerate(probs) if p >= min_p * top}


def _analytic(logits: list[float], params: SamplingParams) -> list[float]:
    probs = _softmax(logits, params.temperature)
    if params.top_k:
        probs = _renormalised(probs, _top_k_set(probs, params.top_k))
    if params.top_p < 1.0:
        probs = _renormalised(probs, _nucleus(probs, params.top_p))
    if params.min_p > 0.0:
        probs = _renormalised(probs, _min_p_set(probs, params.min_p))
    return probs


def _chi_square_p(tokens: list[int], expected_probs: list[float]) -> float:
    counts = _counts(tokens, len(expected_probs))
    for token, prob in enumerate(expected_probs):
        if prob == 0.0:
            assert counts[token] == 0, f"token {token} is outside the filter but was drawn"
    support = [i for i, prob in enumerate(expected_probs) if prob > 0.0]
    observed = [counts[i] for i in support]
    expected = [expected_probs[i] * len(tokens) for i in support]
    assert min(expected) >= 5, "chi-square needs at least 5 expected draws per cell"
    return float(chisquare(observed, expected).pvalue)


# ---------------------------------------------------------------------------------------------
# Greedy and masks


def test_greedy_equals_argmax_in_any_float_dtype() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator)
    rows = [_row(i, SamplingParams(temperature=0.0)) for i in range(6)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        out = Sampler().sample(logits.to(dtype), rows)
        assert out.token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()


def test_greedy_ties_pick_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]])
    out = Sampler().sample(logits, [_row(0, SamplingParams(temperature=0.0))])
    assert out.token_ids == [1]


def test_min_tokens_masks_stop_and_eos_until_reached() -> None:
    # eos (id 4) is the most likely token, the stop id (3) the next.
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 6.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,), eos_token_ids=(4,))
    sampler = Sampler()
    tokens = [sampler.sample(logits, [_row(0, params, position=p)]).token_ids[0] for p in range(5)]
    assert tokens == [2, 2, 2, 4, 4]


def test_min_tokens_masks_sampled_rows_too() -> None:
    logits = torch.tensor([0.0, 0.5, 4.0, 4.0, 4.0, 9.0])  # ids 3 and 5 are stop / eos
    params = SamplingParams(temperature=1.0, seed=3, min_tokens=10, stop_token_ids=(3,), eos_token_ids=(5, 99))
    early = _draw_positions(params, logits, range(10))
    assert not {3, 5} & set(early)
    late = _draw_positions(params, logits, range(10, 20))
    assert 5 in late  # the 99 out of the vocabulary is simply skipped


def test_ignore_eos_leaves_eos_sampleable_but_still_masks_stops() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 6.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(4,), eos_token_ids=(3,), ignore_eos=True)
    assert Sampler().sample(logits, [_row(0, params)]).token_ids == [3]


def test_a_row_with_every_token_masked_samples_unmasked() -> None:
    logits = torch.tensor([[1.0, 2.0]])
    params = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(0, 1))
    assert Sampler().sample(logits, [_row(0, params)]).token_ids == [1]


# ---------------------------------------------------------------------------------------------
# Counter-based randomness


def test_hash_on_tensors_matches_the_python_reference() -> None:
    rng = random.Random(0)
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    tensor = torch.tensor(values, dtype=torch.int64)
    assert _mix32(tensor).tolist() == [_mix32_int(v) for v in values]
    for constant in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF, 1):
        assert _mul32(tensor, constant).tolist() == [(v * constant) % 2**32 for v in values]


def test_uniform_bits_are_pinned() -> None:
    # A change here changes every seeded output: bump it only on purpose, and say so in the notes.
    bits = uniform_bits([row_key(seed=1234, choice_index=0, output_position=0)], 6, "cpu")
    assert bits.tolist() == [[2660963525, 1204025092, 3329868915, 575469863, 3951758955, 675946145]]
    assert row_key(2**64 - 1, 0, 0) != row_key(2**32 - 1, 0, 0) != row_key(0, 0, 0)


def test_uniform_bits_look_uniform() -> None:
    keys = [row_key(seed=5, choice_index=0, output_position=p) for p in range(64)]
    bits = uniform_bits(keys, 512, "cpu").flatten()  # 32,768 words
    for shift in (0, 12, 28):  # low, middle and high nibbles
        counts = torch.bincount((bits >> shift) & 0xF, minlength=16).tolist()
        assert chisquare(counts).pvalue > 1e-3


def test_same_seed_same_token_alone_or_anywhere_in_a_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    target_logits = torch.randn(1000, generator=generator) * 0.5  # fairly flat: many candidates
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    others = [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.2, seed=42),
    ]
    for position in range(20):
        alone = Sampler().sample(target_logits[None], [_row(0, target, position)]).token_ids[0]
        batch_logits = torch.randn(8, 1000, generator=generator)
        batch_logits[5] = target_logits
        rows = [_row(10 + i, others[i % len(others)], position=i, entropy=i) for i in range(8)]
        rows[5] = _row(99, target, position)  # another seq id and row, same (seed, choice, position)
        assert Sampler().sample(batch_logits, rows).token_ids[5] == alone


def test_seed_decides_and_entropy_seed_stands_in_for_none() -> None:
    logits = torch.zeros(1000)
    by_seed = {seed: _draw_positions(SamplingParams(seed=seed), logits, range(20)) for seed in (0, 1, 2**32, 2**64 - 1)}
    assert len({tuple(tokens) for tokens in by_seed.values()}) == 4
    # An explicit seed ignores entropy_seed; without one, entropy_seed plays its part.
    rows = [_row(i, SamplingParams(seed=1), position=i, entropy=1000 + i) for i in range(20)]
    assert Sampler().sample(logits.expand(20, -1), rows).token_ids == by_seed[1]
    rows = [_row(i, SamplingParams(), position=i, entropy=1) for i in range(20)]
    assert Sampler().sample(logits.expand(20, -1), rows).token_ids == by_seed[1]


def test_choices_differ_and_resampling_after_release_repeats() -> None:
    logits = torch.zeros(1, 1000)
    params = SamplingParams(seed=9)
    sampler = Sampler()

    def run(choice: int) -> list[int]:
        return [sampler.sample(logits, [_row(choice, params, p, choice=choice)]).token_ids[0] for p in range(20)]

    first, second = run(0), run(1)
    assert first != second
    sampler.release([0, 1])  # preempted: recomputed later, same positions, same tokens
    assert run(0) == first


# ---------------------------------------------------------------------------------------------
# Filters against their analytic distributions


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, seed=12),
        SamplingParams(temperature=1.5, seed=13),
        SamplingParams(temperature=1.0, top_k=4, seed=14),
        SamplingParams(temperature=1.0, top_p=0.8, seed=15),
        SamplingParams(temperature=1.0, min_p=0.3, seed=16),
        SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.1, seed=17),
    ],
    ids=["t1.0", "t0.7", "t1.5", "top_k4", "top_p0.8", "min_p0.3", "combined"],
)
def test_draws_follow_the_analytic_distribution(params: SamplingParams) -> None:
    tokens = _draw_positions(params, LOGITS, range(NUM_DRAWS))
    p_value = _chi_square_p(tokens, _analytic(LOGITS.tolist(), params))
    print(f"chi-square p-value {p_value:.4f}")
    assert p_value > MIN_P_VALUE


def test_draws_over_seeds_follow_the_analytic_distribution() -> None:
    # Independence across seeds at one position, not only across positions of one seed.
    params = [SamplingParams(temperature=1.2, top_p=0.9, seed=s) for s in range(NUM_DRAWS)]
    rows = [_row(i, p, position=3) for i, p in enumerate(params)]
    tokens = Sampler().sample(LOGITS.expand(NUM_DRAWS, -1), rows).token_ids
    p_value = _chi_square_p(tokens, _analytic(LOGITS.tolist(), params[0]))
    print(f"chi-square p-value {p_value:.4f}")
    assert p_value > MIN_P_VALUE


# Each filter is often off, so that the others are tested alone too.
@settings(max_examples=80, deadline=None)
@given(
    logits=st.lists(st.floats(min_value=-10, max_value=10, allow_nan=False, width=32), min_size=2, max_size=40),
    temperature=st.floats(min_value=0.05, max_value=3.0),
    top_k=st.integers(min_value=0, max_value=12),
    top_p=st.one_of(st.just(1.0), st.floats(min_value=0.01, max_value=1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1.0)),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_no_token_outside_top_k_nucleus_or_min_p(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    # Rank on the same float32 scaled logits the sampler sees; equal values rank by lower id.
    scaled = (torch.tensor(logits) / torch.tensor(temperature)).double()
    probs = torch.softmax(scaled, dim=0).tolist()
    ranked = sorted(range(len(logits)), key=lambda i: (-scaled[i].item(), i))
    k = top_k if top_k else len(logits)
    kept_mass = sum(probs[i] for i in ranked[:k])
    tokens = set(_draw_positions(params, torch.tensor(logits), range(128)))
    for token in tokens:
        rank = ranked.index(token)
        assert rank < k
        mass_before = sum(probs[i] for i in ranked[:rank]) / kept_mass
        assert mass_before < top_p + 1e-5
        assert probs[token] >= min_p * max(probs) * (1 - 1e-5)


# ---------------------------------------------------------------------------------------------
# Logprobs, state, validation


def test_logprobs_are_of_the_raw_distribution_and_top_n_sorted() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=generator) * 3
    raw = torch.log_softmax(logits.double(), dim=-1)
    rows = [
        _row(0, SamplingParams(temperature=0.0, num_logprobs=5)),
        _row(1, SamplingParams(temperature=0.5, top_k=3, seed=1, num_logprobs=3)),
        _row(2, SamplingParams(temperature=1.0, num_logprobs=None)),
        _row(3, SamplingParams(temperature=1.0, seed=2, num_logprobs=100)),
    ]
    out = Sampler().sample(logits, rows)
    for i, token in enumerate(out.token_ids):
        if i != 2:
            assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-5)
    assert out.top_logprobs[2] is None and out.logprobs[2] is None  # not asked: not computed
    for i, n in ((0, 5), (1, 3), (3, 30)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == n
        values = [value for _, value in top]
        assert values == sorted(values, reverse=True)
        assert [token for token, _ in top] == raw[i].argsort(descending=True)[:n].tolist()
        for token, value in top:
            assert value == pytest.approx(raw[i, token].item(), abs=1e-5)
        # The sampled token is among the top N here, with the same logprob as reported for it.
        assert (out.token_ids[i], out.logprobs[i]) in top
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy: the top entry


def test_zero_logprobs_is_an_empty_list() -> None:
    out = Sampler().sample(torch.zeros(1, 4), [_row(0, SamplingParams(num_logprobs=0))])
    assert out.top_logprobs == [[]]


def test_state_is_kept_per_sequence_until_released() -> None:
    sampler = Sampler()
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    for position in range(3):
        sampler.sample(logits, [_row(10, greedy, position), _row(20, greedy, position)])
    assert sampler.num_live_states == 2
    assert sampler.state(10).output_token_ids == [1, 1, 1]
    assert sampler.state(20).output_token_ids == [0, 0, 0]
    sampler.release([10, 30])  # 30 was never sampled: ignored
    assert sampler.num_live_states == 1 and sampler.state(10) is None
    sampler.release([20])
    assert sampler.num_live_states == 0


def test_malformed_batches_are_rejected() -> None:
    sampler = Sampler()
    with pytest.raises(InvalidPlanError, match="2 rows"):
        sampler.sample(torch.zeros(3, 4), [_row(0, SamplingParams()), _row(1, SamplingParams())])
    with pytest.raises(InvalidPlanError, match="twice"):
        sampler.sample(torch.zeros(2, 4), [_row(0, SamplingParams()), _row(0, SamplingParams())])
    assert sampler.sample(torch.zeros(0, 4), []).token_ids == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", -1),
        ("seed", 2**64),
        ("num_logprobs", -1),
        ("min_tokens", -1),
        ("stop_token_ids", (1, -2)),
        ("eos_token_ids", ("a",)),
        ("ignore_eos", 1),
    ],
)
def test_bad_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"), [("choice_index", -1), ("output_position", 2**32), ("entropy_seed", 2**64), ("seq_id", None)]
)
def test_bad_rows_name_the_field(field: str, value: object) -> None:
    kwargs = dict(seq_id=0, params=SamplingParams(), choice_index=0, output_position=0, entropy_seed=0)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        SampleRow(**kwargs)


def test_params_normalise_id_lists_and_report_greedy() -> None:
    params = SamplingParams(stop_token_ids=[1, 2], eos_token_ids=[3])
    assert params.stop_token_ids == (1, 2) and params.min_tokens_masked_ids == (1, 2, 3)
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_same_bits_and_tokens_as_cpu() -> None:
    keys = [row_key(seed=s, choice_index=s % 3, output_position=s) for s in range(16)]
    assert torch.equal(uniform_bits(keys, 50_000, "cuda").cpu(), uniform_bits(keys, 50_000, "cpu"))
    logits = torch.randn(16, 50_000, generator=torch.Generator().manual_seed(0))
    rows = [_row(i, SamplingParams(top_p=0.9, seed=i), position=i) for i in range(16)]
    cpu = Sampler().sample(logits, rows)
    cuda = Sampler().sample(logits.cuda(), rows)
    assert cuda.token_ids == cpu.token_ids
