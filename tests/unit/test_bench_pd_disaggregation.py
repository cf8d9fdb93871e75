"""bench.pd_disaggregation's figures from recorded streams and GetStats snapshots (no stack run)."""

from __future__ import annotations

import pytest

from bench.pd_disaggregation import (
    DISAGG_FIELDS,
    Stream,
    itl_gaps,
    parse_args,
    prompts,
    pulls_per_sequence,
    ratio,
    summary_ms,
)


def test_gaps_are_between_one_streams_consecutive_tokens_inside_the_window():
    a = Stream("chat", 8, sent_s=0.0, token_s=[1.0, 1.1, 1.4, 2.0, 3.0])
    b = Stream("chat", 8, sent_s=0.0, token_s=[0.5, 1.5, 1.6])
    assert itl_gaps([a, b], (1.05, 2.5)) == pytest.approx([0.3, 0.6, 0.1])
    assert itl_gaps([Stream("chat", 8)], (0, 10)) == []
    assert a.ttft_s == 1.0 and a.done_s == 3.0 and Stream("long", 4).ttft_s is None


def test_summaries_and_ratios_say_none_where_there_is_nothing():
    got = summary_ms([0.01, 0.02, 0.03])
    assert got["n"] == 3 and got["p50_ms"] == pytest.approx(20.0) and got["max_ms"] == pytest.approx(30.0)
    assert summary_ms([]) == {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    assert ratio(3.0, 2.0) == 1.5 and ratio(None, 2.0) is None and ratio(1.0, None) is None


def test_pulls_are_per_imported_sequence_between_snapshots():
    before = dict.fromkeys(DISAGG_FIELDS, 0)
    before.update(num_imported=2, num_imported_blocks=10, num_imported_bytes=1000, import_seconds=0.5)
    after = {**before, "num_imported": 6, "num_imported_blocks": 50, "num_imported_bytes": 5000, "import_seconds": 0.9}
    got = pulls_per_sequence(before, after)
    assert (got["num_imported"], got["blocks_per_seq"], got["bytes_per_seq"]) == (4, 10.0, 1000.0)
    assert got["pull_ms_per_seq"] == pytest.approx(100.0)
    assert pulls_per_sequence(before, before)["blocks_per_seq"] is None


def test_the_load_is_the_same_on_both_arms_and_fits_the_models_positions():
    assert prompts(1, [4, 6]) == prompts(1, [4, 6]) != prompts(2, [4, 6])
    assert [len(p) for p in prompts(1, [4, 6])] == [4, 6]
    args = parse_args([])
    assert args.long_prompt + args.long_output <= args.max_model_len
    assert args.chat_prompt + args.chat_output <= args.max_model_len
    assert parse_args(["--real"]).real
