"""The scheduler's LoRA registry (scheduler_svc/core/lora.py): what a request may run under,
the prefix-cache namespace of an adapter's identity, and what each stage must unload and load
to hold exactly the registry's adapters after a (re)connect (issue 35, items 1, 2 and 21)."""

from __future__ import annotations

import pytest

from scheduler_svc.core.lora import (
    AdapterNotServed,
    LoraAdapter,
    LoraRegistry,
    StageSync,
    lora_namespace,
    new_load_id,
    request_namespace,
)
from scheduler_svc.core.request import Request, SamplingOptions

STATIC = LoraAdapter("sql", "/adapters/sql", 0)
RUNTIME = LoraAdapter("chat", "/adapters/chat", 77)


def started(*held_by_stage) -> LoraRegistry:
    """A registry after its first sync with stages holding `held_by_stage`."""
    registry = LoraRegistry()
    registry.sync(held_by_stage)
    return registry


def test_a_name_reloaded_has_another_namespace():
    first, again = new_load_id(), new_load_id()
    assert first != again and first % 2 == 1 and again > 0
    assert lora_namespace("m", "a1", first) != lora_namespace("m", "a1", again)
    assert lora_namespace("m", "a1", 0) == "m/lora:a1#0"
    assert lora_namespace(None, "a1", 255) == "/lora:a1#ff"


def test_a_request_keeps_the_model_namespace_unless_it_runs_under_an_adapter():
    plain = Request("r", (1, 2), SamplingOptions(), 0.0)
    tuned = Request("q", (1, 2), SamplingOptions(), 0.0, lora_name="a1", lora_load_id=255)
    assert request_namespace("m", plain) == "m" and request_namespace(None, plain) is None
    assert request_namespace("m", tuned) == lora_namespace("m", "a1", 255)


def test_the_first_sync_adopts_what_the_stages_hold():
    registry = LoraRegistry()
    plans = registry.sync([[STATIC, RUNTIME], [STATIC, RUNTIME]])
    assert plans == [StageSync(), StageSync()] and all(p.empty for p in plans)
    assert registry.adapters == (STATIC, RUNTIME)
    assert registry.admit("chat") == RUNTIME


def test_a_restarted_stage_gets_the_runtime_adapters_back():
    registry = started([STATIC, RUNTIME], [STATIC, RUNTIME])
    plans = registry.sync([[STATIC, RUNTIME], [STATIC]])  # stage 1 restarted
    assert plans == [StageSync(), StageSync(load=(RUNTIME,))]


def test_a_stage_holding_a_name_under_another_identity_swaps_it():
    registry = started([STATIC], [STATIC])
    registry.remove("sql")
    reloaded = LoraAdapter("sql", "/adapters/other", 99)  # unloaded, then another folder as "sql"
    registry.add(reloaded)
    plans = registry.sync([[reloaded], [STATIC]])  # stage 1 restarted with --lora-modules' "sql"
    assert plans == [StageSync(), StageSync(unload=("sql",), load=(reloaded,))]


def test_an_adapter_unloaded_is_unloaded_from_a_stage_that_comes_back_with_it():
    registry = started([STATIC], [STATIC])
    registry.remove("sql")
    assert registry.sync([[], [STATIC]]) == [StageSync(), StageSync(unload=("sql",))]


def test_adoption_prefers_a_runtime_load_to_a_start_one():
    newer = LoraAdapter("sql", "/adapters/newer", 5)
    registry = LoraRegistry()
    plans = registry.sync([[STATIC], [newer]])
    assert registry.adapters == (newer,)
    assert plans == [StageSync(unload=("sql",), load=(newer,)), StageSync()]


def test_a_draining_adapter_admits_nothing_but_stays_held():
    registry = started([STATIC, RUNTIME], [STATIC, RUNTIME])
    assert registry.drain("chat") == RUNTIME
    with pytest.raises(AdapterNotServed, match="being unloaded"):
        registry.admit("chat")
    with pytest.raises(KeyError):
        registry.drain("chat")  # one unload at a time
    assert registry.served == (STATIC,) and registry.adapters == (STATIC, RUNTIME)
    assert registry.sync([[STATIC], [STATIC, RUNTIME]]) == [StageSync(load=(RUNTIME,)), StageSync()]
    registry.resume("chat")  # an unload given up: served again
    assert registry.admit("chat") == RUNTIME
    registry.drain("chat")
    registry.remove("chat")
    assert not registry.is_draining("chat") and registry.get("chat") is None
    with pytest.raises(AdapterNotServed, match="no LoRA adapter 'chat'"):
        registry.admit("chat")


def test_a_name_is_registered_once():
    registry = started([STATIC], [STATIC])
    with pytest.raises(ValueError, match="loaded already"):
        registry.add(LoraAdapter("sql", "/x", 3))
    with pytest.raises(KeyError):
        registry.drain("nope")
