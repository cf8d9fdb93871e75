"""Step deadlines (scheduler_svc/core/deadlines.py) and the verdict on the stages' progress
(issue 34: a slow step is not a hung stage, and no step is planned again at a size that was
late)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduler_svc.core.deadlines import StepDeadlines
from scheduler_svc.recovery import progress_verdict


def test_a_deadline_scales_with_the_planned_work():
    d = StepDeadlines(timeout_s=2.0, max_tokens=2048)
    assert d.allowance_s(2048) == 2.0  # nothing learned yet: the base timeout
    d.dispatched(1, 100, now_s=0.0)
    d.returned(1, now_s=0.5, compute_s=0.1)  # 1 ms a token computed (the rest queued)
    assert d.s_per_token == pytest.approx(1e-3)
    d.dispatched(9, 1, now_s=0.0)
    d.returned(9, now_s=0.01)  # a one-token step's fixed cost weighs by its tokens, not as a rate
    assert d.s_per_token == pytest.approx((0.8 * 0.1 + 0.2 * 0.01) / (0.8 * 100 + 0.2 * 1))
    assert d.allowance_s(10) == 2.0
    assert d.allowance_s(2000) == pytest.approx(4 * 2000 * d.s_per_token)  # slack 4 x the expected
    d.dispatched(2, 2000, now_s=1.0)
    end = 1.0 + d.allowance_s(2000)
    assert d.overdue(end - 0.1) is None
    assert d.overdue(end + 0.1) == (2, pytest.approx(end - 0.9))
    d.check_integrity()


def test_a_late_step_caps_the_next_and_its_size_is_never_planned_again():
    d = StepDeadlines(timeout_s=1.0, max_tokens=2048)
    d.dispatched(1, 2048, now_s=0.0)
    assert d.overdue(1.5)[0] == 1
    assert d.late(1, working=True, now_s=1.5) == [1]
    # below the size, and below what the step's rate fits in half the base timeout
    assert d.token_cap == min(1024, int(2048 * 1.0 / 1.5 / 2))
    assert d.ceiling == 2048 and d.num_extended == 1
    assert d.overdue(2.0) is None  # waited on: its deadline moved by its allowance
    assert d.overdue(2.6) is not None
    d.returned(1, now_s=3.0)
    for mb_id in range(2, 40):  # quick steps at the cap let it grow back, never to the late size
        d.dispatched(mb_id, d.token_cap, now_s=10.0 + mb_id)
        d.returned(mb_id, now_s=10.0 + mb_id + 0.01)
        d.check_integrity()
        assert d.token_cap < 2048
    assert d.token_cap == 2047


def test_a_hung_stage_halves_the_cap_down_to_one_token():
    d = StepDeadlines(timeout_s=1.0, max_tokens=64)
    size, mb_id = 64, 0
    while size > 1:
        mb_id += 1
        d.dispatched(mb_id, size, now_s=0.0)
        d.late(mb_id, working=False, now_s=100.0)
        size = d.token_cap
        d.forget(mb_id)
        d.check_integrity()
    assert d.token_cap == 1 and d.num_late == mb_id


def test_a_step_late_for_waiting_behind_another_blames_the_one_computed():
    d = StepDeadlines(timeout_s=1.0, max_tokens=2048)
    d.dispatched(1, 600, now_s=0.0)  # computed, slowly
    d.dispatched(2, 1, now_s=0.5)  # queued behind it
    d.dispatched(3, 1, now_s=0.9)
    assert d.late(2, working=True, now_s=1.2, computing=(1,)) == [1]  # 1 is late itself
    assert d.token_cap == min(300, int(600 / 1.2 / 2)) and d.ceiling == 600
    assert d.overdue(1.3) is None  # every late step waited on
    d2 = StepDeadlines(timeout_s=1.0, max_tokens=2048)
    d2.dispatched(1, 600, now_s=0.0)
    d2.dispatched(2, 1, now_s=0.1)
    d2._steps[1].deadline_s = 5.0  # the computed step within its (larger) allowance
    assert d2.late(2, working=True, now_s=1.2, computing=(1,)) == []  # 2 only waited: no cap
    assert d2.token_cap == 2048 and d2.ceiling is None


def _stage(i, computing=0, age_s=0.0, healthy=True):
    if not healthy:
        return {"stage_index": i, "healthy": False, "error": "DEADLINE_EXCEEDED"}
    pb = SimpleNamespace(computing_micro_batch_id=computing, progress_age_ns=int(age_s * 1e9))
    return {"stage_index": i, "healthy": True, "stats": pb}


def test_the_verdict_on_the_stages_progress():
    assert progress_verdict([_stage(0, 7, 0.2), _stage(1, 6, 0.1)], 1.0)[::2] == (True, (7, 6))
    assert progress_verdict([_stage(0, 7, 3.0), _stage(1)], 1.0)[0]  # one layer may take seconds
    assert not progress_verdict([_stage(0, 7, 31.0), _stage(1)], 1.0)[0]  # computing, no tick for 31 s
    assert not progress_verdict([_stage(0, 7, 61.0), _stage(1)], 60.0)[0]
    assert not progress_verdict([_stage(0, 7, 0.2), _stage(1, healthy=False)], 1.0)[0]  # one did not answer
    working, detail, _ = progress_verdict([_stage(0, 0, 40.0), _stage(1, 0, 35.0)], 1.0)
    assert not working and "no stage computing" in detail  # nothing moved anywhere for 35 s
    assert progress_verdict([_stage(0, 0, 0.3), _stage(1, 0, 35.0)], 1.0)[0]  # between steps
    # an in-process stage reports no progress: it works while it answers
    assert progress_verdict([{"stage_index": 0, "healthy": True, "busy_ns": 5}], 1.0)[0]
