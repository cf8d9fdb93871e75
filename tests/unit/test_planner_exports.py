"""P/D disaggregation on a prefill replica's planner (scheduler_svc/core/exports.py, issue 39):
a request sent with kv_export finishes, but its KV stays held (the KV service keeps its blocks,
the stages its block table) until released or timed out; then it is freed like any other."""

from __future__ import annotations

from test_planner import Sim

from scheduler_svc.core.exports import EXPORT_HOLD_S


def held_sim(prompt_len=19, export=True, n=1):
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True)
    r = sim.add("a", list(range(5, 5 + prompt_len)), max_tokens=1, n=n)
    r.export_kv = export
    sim.run()
    return sim, r


def test_an_exported_prompt_keeps_its_blocks_until_released():
    sim, r = held_sim()
    assert r.exported is not None
    seq_id, num_blocks = r.exported
    assert num_blocks == (19 - 1) // 4  # the full blocks before the last prompt token's
    assert sim.kv.has_sequence(seq_id) and seq_id in sim.stage.seqs  # KV service and stage hold it
    assert len(sim.planner.exports) == 1
    assert not sim.planner.release_export("nobody")
    assert sim.planner.release_export("a")
    assert not sim.planner.release_export("a")  # once
    sim.run()  # the free goes out with the next step
    assert not sim.kv.has_sequence(seq_id) and sim.kv.stats().num_used_blocks == 0
    sim.add("b", [7, 8, 9], max_tokens=2)
    sim.run()  # and the stages let go with the next plan
    assert seq_id not in sim.stage.seqs


def test_a_hold_nobody_releases_ends_by_itself():
    sim, r = held_sim()
    seq_id = r.exported[0]
    sim.planner.expire_exports(sim.now + EXPORT_HOLD_S / 2)
    assert sim.kv.has_sequence(seq_id)
    sim.planner.expire_exports(sim.now + EXPORT_HOLD_S + 1)
    sim.run()
    assert not sim.kv.has_sequence(seq_id) and sim.kv.stats().num_used_blocks == 0
    assert sim.planner.exports.num_expired == 1


def test_without_kv_export_or_with_several_choices_nothing_is_held():
    for kwargs in ({"export": False}, {"n": 2}):
        sim, r = held_sim(**kwargs)
        assert r.exported is None and len(sim.planner.exports) == 0
        assert sim.kv.stats().num_used_blocks == 0


def test_a_pipeline_reset_ends_every_hold():
    sim, _ = held_sim()
    sim.planner.reset_all(sim.now)
    sim.kv.reset()
    assert len(sim.planner.exports) == 0
    sim.planner.check_integrity()
