"""KV groups (services/kv_layout.py): the layout a model's windows give, the wire forms of
grouped tables (the step codec and the KV service's messages), and what a long sequence of
a hybrid model holds in the KV manager."""

from __future__ import annotations

import pytest

from kvcache_svc.core import Append, KVCacheManager, NewSequence, StepInput
from scheduler_svc.core.request import SamplingOptions, sampling_params
from services.kv_codec import step_output_from_pb, step_output_to_pb
from services.kv_layout import NULL_PAGE, entries_of, flat_pages, kv_layout, parse_spec
from services.pb import kvcache_pb2, worker_pb2
from services.step import CachedSeq, NewSeq, StepPlan
from services.step_codec import PlanDecodeError, plan_from_pb, plan_to_pb

GEMMA3_26 = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # Gemma-3-1B: 4 full, 22 sliding


def test_a_hybrid_model_pages_as_many_layers_as_its_smallest_group():
    layout = kv_layout(GEMMA3_26)
    assert layout.layers_per_page == 4
    assert layout.windows == (0,) + (512,) * 6  # 22 sliding layers: six sub-groups of up to 4
    assert layout.layer_places[5] == (0, 0) and layout.layer_places[23] == (0, 3)
    assert layout.layer_places[0] == (1, 0) and layout.layer_places[25] == (6, 1)
    assert sorted(layout.layer_places) == sorted(set(layout.layer_places))  # no two layers share a place
    assert parse_spec(layout.spec()) == layout.windows
    assert layout.slots_of(range(13, 26)) == (0, 1, 2, 3)


@pytest.mark.parametrize("windows", [[None] * 6, [4096] * 6, []])
def test_models_whose_layers_attend_alike_keep_one_table(windows):
    layout = kv_layout(windows)
    assert not layout.grouped and layout.windows == (0,) and layout.spec() == ""
    assert layout.layer_places == tuple((0, i) for i in range(len(windows)))


@pytest.mark.parametrize("spec", ["512,0", "x", "0,-3", "0,512,256"])
def test_a_bad_groups_setting_names_the_field(spec):
    with pytest.raises(ValueError, match="kv_groups"):
        parse_spec(spec)


def test_entries_travel_flat():
    entries = ((1, 2, NULL_PAGE), (4, 5, 6))
    assert entries_of(flat_pages(entries), 3) == entries
    assert entries_of(flat_pages((7, 8)), 0) == (7, 8)
    with pytest.raises(ValueError):
        entries_of([1, 2, 3, 4], 3)


def _params():
    return sampling_params(SamplingOptions(max_tokens=4), ())


def test_the_step_codec_carries_grouped_tables():
    plan = StepPlan(
        9,
        (NewSeq(1, (5, 6, 7), 3, 0, 3, ((1, 2, 3), (4, NULL_PAGE, 6)), _params()),),
        (CachedSeq(2, 1, 3, ((7, 8, 9),)), CachedSeq(3, 1, 2)),
        block_copies=((1, 10),),
    )
    msg = plan_to_pb(plan)
    assert msg.kv_groups == 3
    assert plan_from_pb(worker_pb2.MicroBatch.FromString(msg.SerializeToString())) == plan
    msg.cached.block_ids.append(11)  # a torn entry
    with pytest.raises(PlanDecodeError, match="entries of 3"):
        plan_from_pb(msg)


def _gemma_like(num_blocks: int = 200, block_size: int = 4, window: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, group_windows=(0, window, window))


def test_a_sequence_of_four_windows_holds_window_over_block_size_plus_one_sliding_pages():
    bs, window = 4, 8
    m = _gemma_like(block_size=bs, window=window)
    prompt = list(range(1, 6))
    m.step(StepInput(new_sequences=[NewSequence(1, prompt)], micro_batch_id=1))
    n, mb, most = len(prompt), 1, 0
    while n < 4 * window:
        mb += 1
        m.step(StepInput(appends=[Append(1, [n % 50 + 1])], completed_micro_batch_ids=[mb - 1], micro_batch_id=mb))
        n += 1
        (stats,) = m.sequence_stats()
        full = -(-n // bs)
        assert stats.num_blocks - stats.num_window_blocks == full  # the full group keeps every block
        # each sliding sub-group holds the blocks from the one with position n-1-window+1 on
        assert stats.num_window_blocks == 2 * (full - (n - 1 - window + 1) // bs if n > window else full)
        most = max(most, stats.num_window_blocks if n > window else 0)
    assert most == 2 * (window // bs + 1)  # window / block_size + 1 per sliding sub-group, at most
    assert m.stats().num_slid_blocks == 2 * full - stats.num_window_blocks
    m.check_integrity()


def test_a_prefix_hit_needs_the_sliding_pages_inside_the_window_only():
    bs, window = 4, 8
    m = _gemma_like(block_size=bs, window=window)
    prompt = list(range(1, 33))  # 8 blocks
    m.step(StepInput(new_sequences=[NewSequence(1, prompt)], micro_batch_id=1))
    for i in range(8):  # decode past the prompt: the window leaves its first blocks
        m.step(StepInput(appends=[Append(1, [99])], completed_micro_batch_ids=[i + 1], micro_batch_id=i + 2))
    m.complete([9])
    out = m.step(StepInput(new_sequences=[NewSequence(2, prompt + [7])], micro_batch_id=20))
    hit = out.results[2]
    assert hit.num_computed_tokens == 32
    table = hit.block_ids
    # full pages of every block shared; sliding pages only of the blocks the window reaches
    assert all(entry[0] != NULL_PAGE for entry in table)
    first = (32 - window + 1) // bs
    assert all(entry[1] == entry[2] == NULL_PAGE for entry in table[:first])
    assert all(NULL_PAGE not in entry for entry in table[first:])
    m.check_integrity()


def test_the_kv_service_messages_carry_grouped_answers():
    m = _gemma_like()
    out = m.step(StepInput(new_sequences=[NewSequence(1, list(range(1, 10)))], micro_batch_id=1))
    msg = step_output_to_pb(out, kv_groups=3)
    back = step_output_from_pb(kvcache_pb2.StepResponse.FromString(msg.SerializeToString()))
    assert back.results[1] == out.results[1] and len(out.results[1].block_ids[0]) == 3


def test_a_sequence_is_admitted_against_the_entries_the_pages_hold():
    from services.kv_layout import entries_that_fit

    assert entries_that_fit(64, (0,), 8, 512) == 64  # one table: a page is a block
    # six sub-groups, windows too long for the pool to see a sliding one give pages back
    assert entries_that_fit(64, (0, 48, 48, 48, 48, 48), 8, 512) == 10
    # a sliding sub-group holds its window and one chunk: ceil((48 - 1 + 16) / 8) + 1 = 9 entries
    assert entries_that_fit(1000, (0, 48, 48), 8, 16) == 1000 - 2 * 9
