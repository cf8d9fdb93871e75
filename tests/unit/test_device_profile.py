"""Device profiles (services/device_profile.py): the shipped files, the JSON form, the step formula."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.device_profile import (
    STEP_FIELDS,
    DeviceProfile,
    load_profile,
    profile_names,
    profile_to_dict,
    save_profile,
)

A100 = "a100-80gb-llama2-70b-tp8"
H200 = "h200-141gb-llama3-8b-tp1"
SHIPPED = (A100, H200, "cpu-local")


def make(**overrides) -> DeviceProfile:
    values = dict(
        name="test",
        source="made by hand",
        fixed_s=1e-3,
        per_prefill_token_s=1e-4,
        per_decode_row_s=2e-4,
        per_context_token_s=1e-6,
        allreduce_per_token_s=1e-5,
        eos_probability=0.25,
        per_step_s=4e-3,
    )
    values.update(overrides)
    return DeviceProfile(**values)


def write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


# --- the shipped profiles ---------------------------------------------------------------------


def test_the_shipped_profiles_are_found_and_load_under_their_names():
    assert set(SHIPPED) <= set(profile_names())
    assert profile_names() == sorted(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        assert profile.name == name
        assert profile.source and profile.notes


def test_the_a100_profile_explains_every_number_in_its_notes():
    profile = load_profile(A100)
    text = " ".join(profile.notes)
    for field in (*STEP_FIELDS, "eos_probability"):
        assert field in text, f"{field} is not explained"


def test_the_a100_profile_follows_from_its_stated_inputs():
    """The roofline of its notes, recomputed: device figures, model shapes, efficiencies."""
    flops, hbm, nvlink_one_way = 312e12, 2.039e12, 300e9
    mbu, mfu, kv_eff, bus_eff, allreduce_latency = 0.5, 0.6, 0.6, 0.75, 10e-6
    layers, hidden, kv_heads, head_dim, inter, tp = 80, 8192, 8, 128, 28672, 8
    params = layers * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    profile = load_profile(A100)
    expected = {
        "per_step_s": params * 2 / tp / (hbm * mbu) + 2 * layers * allreduce_latency,
        "per_prefill_token_s": 2 * params / tp / (flops * mfu),
        "per_decode_row_s": 2 * params / tp / (flops * mfu),
        "per_context_token_s": 2 * layers * (kv_heads // tp) * head_dim * 2 / (hbm * kv_eff),
        "allreduce_per_token_s": 2 * layers * hidden * 2 * 2 * (tp - 1) / tp / (nvlink_one_way * bus_eff),
    }
    for field, value in expected.items():
        assert getattr(profile, field) == pytest.approx(value, rel=1e-3), field
    assert profile.tensor_parallel_size == tp
    assert (profile.hidden_size, profile.num_layers) == (hidden, layers)


def test_the_a100_profile_lands_in_the_published_range_of_a_70b_tp8_decode_step():
    """Near the published 29 ms per token at batch 1 on 8 x A100 (see its notes), and below 40 ms at 32 rows."""
    profile = load_profile(A100)
    one = profile.step_time_s(
        layer_fraction=1.0, num_prefill_tokens=0, num_decode_rows=1, num_context_tokens=129, tensor_parallel_size=8
    )
    batch = profile.step_time_s(
        layer_fraction=1.0,
        num_prefill_tokens=0,
        num_decode_rows=32,
        num_context_tokens=32 * 1025,
        tensor_parallel_size=8,
    )
    assert 0.015 < one < 0.030 and one < batch < 0.040
    half = profile.step_time_s(
        layer_fraction=0.5, num_prefill_tokens=0, num_decode_rows=1, num_context_tokens=129, tensor_parallel_size=8
    )
    assert half == pytest.approx(profile.fixed_s + (one - profile.fixed_s) / 2)


def test_the_h200_profile_is_derived_labelled_and_explains_every_number():
    profile = load_profile(H200)
    assert profile.source.startswith("derived, not measured") and "published" in profile.source
    text = " ".join(profile.notes)
    for field in (*STEP_FIELDS, "eos_probability"):
        assert field in text, f"{field} is not explained"
    assert profile.tensor_parallel_size == 1 and profile.allreduce_per_token_s == 0
    assert (profile.hidden_size, profile.num_layers) == (4096, 32)


def test_the_h200_profile_follows_from_its_stated_inputs():
    """The roofline of its notes, recomputed: H200 datasheet figures, Llama-3-8B's shapes, efficiencies."""
    flops, hbm, mbu, mfu, kv_eff = 989e12, 4.8e12, 0.7, 0.6, 0.6
    layers, hidden, kv_heads, head_dim, inter, vocab = 32, 4096, 8, 128, 14336, 128256
    params = layers * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    profile = load_profile(H200)
    expected = {
        "per_step_s": params * 2 / (hbm * mbu),
        "per_prefill_token_s": 2 * params / (flops * mfu),
        "per_decode_row_s": 2 * params / (flops * mfu),
        "per_context_token_s": 2 * layers * kv_heads * head_dim * 2 / (hbm * kv_eff),
        "last_stage_fixed_s": vocab * hidden * 2 / (hbm * mbu),
        "last_stage_per_row_s": 2 * vocab * hidden / (flops * mfu),
    }
    for field, value in expected.items():
        assert getattr(profile, field) == pytest.approx(value, rel=1e-3), field


def _h200_decode_s(
    profile: DeviceProfile, rows: int, context: int, layer_fraction: float = 1.0, is_last_stage: bool = True
) -> float:
    return profile.step_time_s(
        layer_fraction=layer_fraction,
        num_prefill_tokens=0,
        num_decode_rows=rows,
        num_context_tokens=rows * context,
        is_last_stage=is_last_stage,
        num_sampled_rows=rows if is_last_stage else 0,
    )


def test_the_h200_profile_predicts_fast_decode_steps_in_its_stated_range():
    """Whole-model decode steps of ~3-6 ms at serving batches (its notes: 4.6 ms at 1 row, 5.7 ms
    at 32 rows of 200 context; published 4.6-6.5 ms per token), a fifth of the A100 profile's,
    and a pipeline stage at PP=4 near a quarter of that."""
    profile = load_profile(H200)
    one, batch, long = (
        _h200_decode_s(profile, 1, 129),
        _h200_decode_s(profile, 32, 200),
        _h200_decode_s(profile, 32, 1025),
    )
    assert 0.003 < one < batch < 0.006 < long < 0.0075
    assert one == pytest.approx(4.60e-3, rel=0.01) and batch == pytest.approx(5.67e-3, rel=0.01)
    a100 = load_profile(A100).step_time_s(
        layer_fraction=1.0,
        num_prefill_tokens=0,
        num_decode_rows=32,
        num_context_tokens=32 * 200,
        tensor_parallel_size=8,
    )
    assert 3 < a100 / batch < 5
    first_of_four = _h200_decode_s(profile, 32, 200, layer_fraction=0.25, is_last_stage=False)
    last_of_four = _h200_decode_s(profile, 32, 200, layer_fraction=0.25)
    assert 0.0011 < first_of_four < last_of_four < 0.0018
    assert last_of_four - first_of_four == pytest.approx(profile.last_stage_fixed_s + 32 * profile.last_stage_per_row_s)


def test_the_cpu_profile_is_a_tensor_parallel_1_fit():
    profile = load_profile("cpu-local")
    assert profile.tensor_parallel_size == 1 and profile.allreduce_per_token_s == 0
    assert "fit_profile" in profile.source


# --- the formula ------------------------------------------------------------------------------


def test_step_time_is_fixed_plus_the_layer_share_of_every_term():
    profile = make()
    got = profile.step_time_s(layer_fraction=0.25, num_prefill_tokens=100, num_decode_rows=10, num_context_tokens=1000)
    # fixed, then a quarter of: per step, prefill, decode, context (TP 1: no all-reduce)
    assert got == pytest.approx(1e-3 + 0.25 * (4e-3 + 100 * 1e-4 + 10 * 2e-4 + 1000 * 1e-6))


def test_the_all_reduce_term_is_paid_only_above_tensor_parallel_1():
    profile = make()
    kwargs = dict(layer_fraction=0.5, num_prefill_tokens=30, num_decode_rows=2, num_context_tokens=50)
    tp1 = profile.step_time_s(**kwargs)
    assert profile.step_time_s(**kwargs, tensor_parallel_size=1) == tp1
    assert profile.step_time_s(**kwargs, tensor_parallel_size=4) == pytest.approx(tp1 + 0.5 * 32 * 1e-5)
    assert profile.step_time_s(**kwargs, tensor_parallel_size=8) == profile.step_time_s(
        **kwargs, tensor_parallel_size=2
    )


def test_an_empty_step_costs_the_fixed_and_the_per_step_share():
    profile = make()
    got = profile.step_time_s(
        layer_fraction=0.5, num_prefill_tokens=0, num_decode_rows=0, num_context_tokens=0, tensor_parallel_size=8
    )
    assert got == pytest.approx(1e-3 + 0.5 * 4e-3)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(layer_fraction=0.0), "layer_fraction"),
        (dict(layer_fraction=1.5), "layer_fraction"),
        (dict(num_prefill_tokens=-1), "num_prefill_tokens"),
        (dict(num_decode_rows=-1), "num_decode_rows"),
        (dict(num_context_tokens=-1), "num_context_tokens"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    ],
)
def test_step_time_refuses_impossible_steps(kwargs, word):
    args = dict(layer_fraction=1.0, num_prefill_tokens=1, num_decode_rows=1, num_context_tokens=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=word):
        make().step_time_s(**args)


def test_a_profile_is_frozen_and_checked_when_made():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().fixed_s = 0.0
    with pytest.raises(ValueError, match="per_decode_row_s"):
        make(per_decode_row_s=-1e-3)
    with pytest.raises(ValueError, match="eos_probability"):
        make(eos_probability=1.01)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make(tensor_parallel_size=0)


# --- the JSON form ----------------------------------------------------------------------------


def test_save_then_load_gives_the_same_profile(tmp_path):
    for profile in (
        make(),
        make(hidden_size=576, num_layers=30, tensor_parallel_size=4, notes=("a line", "another")),
        load_profile(A100),
    ):
        path = tmp_path / "sub" / f"{profile.name}.json"
        save_profile(profile, path)
        assert load_profile(str(path)) == profile
        assert json.loads(path.read_text()) == profile_to_dict(profile)


def test_a_path_and_a_name_load_the_same_file(tmp_path):
    profile = load_profile(A100)
    save_profile(profile, tmp_path / "copy.json")
    assert load_profile(str(tmp_path / "copy.json")) == profile


def test_per_step_and_tensor_parallel_size_may_be_left_out(tmp_path):
    data = profile_to_dict(make())
    del data["step"]["per_step_s"], data["tensor_parallel_size"], data["model"], data["notes"]
    profile = load_profile(write(tmp_path, data))
    assert (profile.per_step_s, profile.tensor_parallel_size, profile.notes) == (0.0, 1, ())


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown device profile 'h100-nope'") as e:
        load_profile("h100-nope")
    for name in SHIPPED:
        assert name in str(e.value)


def _broken(change):
    data = profile_to_dict(make())
    change(data)
    return data


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d["step"].pop("per_decode_row_s"), "missing field 'step.per_decode_row_s'"),
        (lambda d: d.pop("eos_probability"), "missing field 'eos_probability'"),
        (lambda d: d.pop("step"), "missing field 'step'"),
        (lambda d: d["step"].update(per_context_token_s=-1e-9), "per_context_token_s must be finite and >= 0"),
        (lambda d: d["step"].update(fixed_s="0.001"), "fixed_s must be a number"),
        (lambda d: d["step"].update(fixed_s=True), "fixed_s must be a number"),
        (lambda d: d.update(eos_probability=1.5), r"eos_probability must be in \[0, 1\]"),
        (lambda d: d.update(eos_probability=-0.1), "eos_probability must be finite and >= 0"),
        (lambda d: d["step"].update(per_prefil_token_s=1.0), "unknown field.*'per_prefil_token_s'"),
        (lambda d: d.update(eos_probabilty=0.1), "unknown field.*'eos_probabilty'"),
        (lambda d: d.update(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
        (lambda d: d.update(model={"hidden_size": 0}), "hidden_size must be an integer >= 1"),
        (lambda d: d.update(notes="one line"), "'notes' must be a list of strings"),
        (lambda d: d.update(step=[1, 2]), "'step' must be an object"),
        (lambda d: d.update(name=""), "name must be a non-empty string"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_and_the_field(tmp_path, change, words):
    path = write(tmp_path, _broken(change))
    with pytest.raises(ValueError, match=words) as e:
        load_profile(path)
    assert path in str(e.value)


def test_a_file_that_is_not_a_profile_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(str(bad))
    with pytest.raises(ValueError, match="a profile is a JSON object"):
        load_profile(write(tmp_path, [1, 2]))
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(str(tmp_path / "missing.json"))


def test_the_extra_model_fields_are_for_readers(tmp_path):
    data = profile_to_dict(make())
    data["model"] = {"name": "some/model", "hidden_size": 64, "num_layers": 2, "dtype": "bfloat16"}
    profile = load_profile(write(tmp_path, data))
    assert (profile.hidden_size, profile.num_layers) == (64, 2)


def test_the_last_stage_alone_pays_the_last_stage_costs_per_sampled_row():
    p = make(last_stage_fixed_s=2e-3, last_stage_per_row_s=5e-4)
    shape = dict(layer_fraction=0.5, num_prefill_tokens=0, num_decode_rows=4, num_context_tokens=400)
    plain = p.step_time_s(**shape)
    assert p.step_time_s(**shape, is_last_stage=True, num_sampled_rows=4) == pytest.approx(plain + 2e-3 + 4 * 5e-4)
    assert p.step_time_s(**shape, is_last_stage=False, num_sampled_rows=4) == pytest.approx(plain)
    with pytest.raises(ValueError, match="num_sampled_rows must be >= 0"):
        p.step_time_s(**shape, is_last_stage=True, num_sampled_rows=-1)


def test_host_compute_round_trips_and_must_be_a_bool(tmp_path):
    p = make(host_compute=True, last_stage_fixed_s=1e-3)
    path = tmp_path / "cpu.json"
    save_profile(p, path)
    assert load_profile(str(path)) == p
    assert load_profile("cpu-local").host_compute and not load_profile(A100).host_compute
    data = profile_to_dict(make())
    data["host_compute"] = "yes"
    with pytest.raises(ValueError, match="host_compute must be true or false"):
        load_profile(write(tmp_path, data))
