"""The planner's speculation policy alone (scheduler_svc/core/speculation_policy.py): which drafts a
decode step verifies, when a sequence waits for drafts instead of a placeholder step, and what
a verify step's answer does. The planner's use of it: tests/unit/test_speculative.py."""

from __future__ import annotations

import dataclasses

from scheduler_svc.core.in_flight import ScheduledSeq
from scheduler_svc.core.request import Request, SamplingOptions, Sequence
from scheduler_svc.core.speculation_policy import SpeculationPolicy
from services.pooling import PoolingType

PROMPT = (1, 2, 3, 4, 5, 1, 2, 3)  # "1 2 3" was followed by "4 5"


def _seq(prompt=PROMPT, max_tokens: int = 50, **request) -> Sequence:
    return Sequence(1, Request("r", prompt, SamplingOptions(max_tokens=max_tokens), 0.0, **request), 0, entropy_seed=1)


def test_ngram_drafts_follow_the_latest_match_within_every_bound():
    policy = SpeculationPolicy(4, "ngram", 1, 3, max_model_len=100)
    assert policy.drafts(_seq(), 8, []) == (4, 5, 1, 2)
    assert policy.drafts(_seq(), 2, []) == (4, 5)  # the step's token budget
    assert policy.drafts(_seq(max_tokens=3), 8, []) == (4, 5)  # max_tokens: two more, then the last
    assert SpeculationPolicy(4, "ngram", 1, 3, max_model_len=10).drafts(_seq(), 8, []) == (4, 5)
    assert policy.max_lookahead == 4 and SpeculationPolicy().max_lookahead == 1


def test_no_drafts_when_off_for_pooling_or_past_the_batch_limit():
    seq = _seq()
    assert SpeculationPolicy().drafts(seq, 8, []) == () and seq.drafts is None
    assert not SpeculationPolicy().waits_for_drafts(seq, [])
    assert SpeculationPolicy(4, "ngram", 1, 3).drafts(_seq(pooling=PoolingType.LAST), 8, []) == ()
    limited = SpeculationPolicy(4, "ngram", 1, 3, max_batch=1)
    assert limited.drafts(seq, 8, ["a", "b"]) == () and not limited.waits_for_drafts(seq, ["a", "b"])
    assert seq.drafts is None  # never drafting: no state made
    assert limited.drafts(seq, 8, ["a"]) == (4, 5, 1, 2)


def test_a_verify_step_that_kept_nothing_backs_off_and_stops_waiting_for_drafts():
    policy = SpeculationPolicy(2, "ngram", 1, 3)
    seq = _seq()
    assert policy.waits_for_drafts(seq, []) and policy.drafts(seq, 8, []) == (4, 5)
    seq.num_computed = 7
    policy.verified(seq, ScheduledSeq(seq, 1, 7, 3, True, num_drafts=2), num_sampled=1)
    assert seq.num_computed == 8 and seq.drafts.skip == 1  # after its known token, none kept
    assert not policy.waits_for_drafts(seq, [])  # backing off: a placeholder step may go
    assert policy.drafts(seq, 8, []) == ()  # that turn is taken
    assert policy.drafts(seq, 8, []) == (4, 5)
    assert dataclasses.astuple(policy.stats)[:3] == (1, 2, 0)


def test_a_draft_model_offer_is_used_only_while_it_follows_the_tokens():
    policy = SpeculationPolicy(3, "draft_model")
    seq = _seq()
    assert not policy.waits_for_drafts(seq, [])
    policy.offer(seq, (9, 8, 7, 6))
    assert policy.waits_for_drafts(seq, []) and policy.drafts(seq, 8, []) == (9, 8, 7)
    seq.output.append(9)  # the tokens moved on: the offer no longer follows them
    assert policy.drafts(seq, 8, []) == ()


def test_the_windowed_lookup_finds_what_a_scan_of_the_whole_context_finds():
    """`Drafts.lookup_in` reads only the tokens not indexed yet and the suffix; the answer is
    the latest earlier occurrence of the longest suffix n-gram, as a full scan finds it."""
    import random

    from scheduler_svc.core.speculation import Drafts

    def scan(tokens, k, lo, hi):
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[len(tokens) - n :]]
            if starts:
                return tuple(tokens[starts[-1] + n : starts[-1] + n + k])
        return ()

    def reader(tokens, reads):
        return lambda a, b: reads.append(b - a) or tokens[a:b]

    rng, reads = random.Random(1), []
    for _ in range(300):
        lo = rng.randint(1, 3)
        hi, drafts, tokens = rng.randint(lo, 5), Drafts(), [rng.randint(0, 4)]
        for _ in range(rng.randint(1, 20)):
            k = rng.randint(1, 5)
            found = drafts.lookup_in(len(tokens), reader(tokens, reads), k, lo, hi)
            assert found == scan(tokens, k, lo, hi)
            tokens += [rng.randint(0, 4) for _ in range(rng.randint(0, 4))]
    assert max(reads) < 30  # a window and a draft's worth, never the context
