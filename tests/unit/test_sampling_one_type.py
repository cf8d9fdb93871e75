"""Issue 25: sampling is one type with one validator, one codec and one admission check.

`SamplingOptions` is the type; the stages' `SamplingParams` is a view derived from it (EOS
ids inside); `services.sampling_pb` is the one codec of both; `services.admission.admit` is
the one check the gateway's two front doors and the scheduler share; the REST model's
bounds are the type's (`RANGES`)."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest

from gateway import validation
from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.generation import GenerationParams
from gateway.grpc_api import RequestError, admit_prompt
from gateway.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import InvalidRequest, request_from_pb
from services.admission import AdmissionError, Limits, admit
from services.pb import common_pb2, scheduler_pb2
from services.sampling import (
    CHOICE_FIELDS,
    MAX_LOGPROBS,
    RANGES,
    SamplingOptions,
    SamplingParams,
    StructuredOutput,
    sampling_params,
)
from services.sampling_pb import options_from_pb, options_to_pb, params_from_pb
from services.step import NewSeq, StepPlan
from services.step_codec import PlanDecodeError, plan_from_pb, plan_to_pb

FULL = SamplingOptions(
    n=3,
    max_tokens=7,
    min_tokens=2,
    temperature=0.5,
    top_p=0.25,
    top_k=4,
    min_p=0.125,
    seed=9,
    logprobs=3,
    stop_token_ids=(3, 9),
    ignore_eos=True,
    presence_penalty=-2.0,
    frequency_penalty=1.5,
    repetition_penalty=0.5,
    logit_bias=((1, -100.0), (7, 2.5)),
    prompt_logprobs=2,
    structured=StructuredOutput("regex", "[a-z]+"),
)


# --- one type, a derived view ----------------------------------------------------------------


def test_the_stage_view_is_the_type_with_the_eos_ids_inside():
    view = sampling_params(FULL, (2, 5))
    assert isinstance(view, SamplingOptions) and view.eos_token_ids == (2, 5)
    assert {name: getattr(view, name) for name in CHOICE_FIELDS} == {
        name: getattr(FULL, name) for name in CHOICE_FIELDS
    }
    assert view.logprobs == view.num_logprobs == 3
    # what only the scheduler acts on is not the stages'
    assert (view.n, view.max_tokens, view.prompt_logprobs) == (1, None, None)
    assert sampling_params(FULL, (2, 5)) is view  # derived once per request
    assert view.min_tokens_masked_ids == (3, 9)  # ignore_eos: EOS is not a stop


def test_one_convention_for_top_k():
    assert SamplingOptions().top_k == SamplingParams().top_k == 0  # 0: off, on both
    with pytest.raises(ValueError, match="^top_k: "):
        SamplingParams(top_k=None)


def test_one_validator_with_one_message_per_field():
    for name, value in (
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 2.0),
        ("seed", -1),
        ("min_tokens", -1),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
    ):
        with pytest.raises(ValueError) as options_error:
            SamplingOptions(**{name: value})
        with pytest.raises(ValueError) as view_error:
            SamplingParams(**{name: value})
        assert str(options_error.value) == str(view_error.value)
        assert str(options_error.value).startswith(f"{name}: must be ")
        assert str(options_error.value).endswith(f"{RANGES[name]}, got {value!r}")


def test_a_request_asks_for_at_most_max_logprobs_a_stage_returns_any_number():
    with pytest.raises(ValueError, match="^logprobs: "):
        SamplingOptions(logprobs=MAX_LOGPROBS + 1)
    assert SamplingParams(num_logprobs=100).num_logprobs == 100
    with pytest.raises(TypeError):
        SamplingParams(max_tokens=5)  # not a stage's


# --- one codec -------------------------------------------------------------------------------


def test_the_view_rides_in_the_same_message_as_the_options():
    view = sampling_params(FULL, (2,))
    from_view, from_options = common_pb2.SamplingParams(), common_pb2.SamplingParams()
    options_to_pb(view, from_view)
    options_to_pb(FULL, from_options)
    for name in ("n", "max_tokens", "prompt_logprobs"):  # the stages' message never held these
        assert not from_view.HasField(name) if name != "n" else from_view.n == 0
        from_options.ClearField(name)
    assert from_view == from_options
    wire = common_pb2.SamplingParams.FromString(from_view.SerializeToString())
    assert params_from_pb(wire, (2,)) == view
    assert options_from_pb(wire) == dataclasses.replace(FULL, n=1, max_tokens=None, prompt_logprobs=None)


def test_the_step_codec_carries_the_view_and_names_a_bad_value():
    view = sampling_params(FULL, (2,))
    plan = StepPlan(4, (NewSeq(1, (5, 6), 2, 0, 2, (0,), view, 0, 3),))
    assert plan_from_pb(plan_to_pb(plan)).new_seqs[0].sampling == view
    msg = plan_to_pb(plan)
    msg.new_seqs[0].params.top_p = 2.0
    with pytest.raises(PlanDecodeError, match=r"^step 4, sequence 1: sampling parameters: top_p: "):
        plan_from_pb(msg)


# --- one admission check, three doors ---------------------------------------------------------

LIMITS = Limits(max_model_len=64, vocab_size=100, max_n=4, max_logprobs=5)


@pytest.mark.parametrize(
    ("options", "prompt_len", "field"),
    [
        (SamplingOptions(n=5), 3, "n"),
        (SamplingOptions(logprobs=6), 3, "logprobs"),
        (SamplingOptions(prompt_logprobs=6), 3, "prompt_logprobs"),
        (SamplingOptions(stop_token_ids=(5, 100)), 3, "stop_token_ids[1]"),
        (SamplingOptions(logit_bias=((100, 1.0),)), 3, "logit_bias"),
        (SamplingOptions(max_tokens=62), 3, "max_tokens"),
        (SamplingOptions(), 64, "prompt"),
    ],
)
def test_admit_names_the_field(options, prompt_len, field):
    with pytest.raises(AdmissionError) as err:
        admit(options, LIMITS, prompt_len)
    assert err.value.path == field and str(err.value) == f"{field}: {err.value.reason}"


def test_admit_resolves_max_tokens_and_refuses_what_never_fits_in_kv():
    assert admit(SamplingOptions(max_tokens=None), LIMITS, 4).max_tokens == 60
    assert admit(SamplingOptions(max_tokens=8), LIMITS, 4).max_tokens == 8
    kv = Limits(max_model_len=4096, num_kv_blocks=8, block_size=16)
    with pytest.raises(AdmissionError, match="^max_tokens: .* KV blocks"):
        admit(SamplingOptions(max_tokens=100), kv, 100)


def _reason(options: SamplingOptions, limits: Limits, prompt_len: int) -> str:
    with pytest.raises(AdmissionError) as err:
        admit(options, limits, prompt_len)
    return err.value.reason


def test_both_front_doors_and_the_scheduler_give_the_same_reason():
    """n over the bound and logit_bias outside the vocabulary: one reason, each door's field name."""
    prompt = [5, 6, 7]
    config = GatewayConfig(model="m", scheduler_address="s:1", max_n=4, max_logprobs=5)
    model = validation.ModelLimits("m", max_model_len=64, vocab_size=100)
    gateway = Limits(64, 100, max_n=4, max_logprobs=5)
    scheduler = SchedulerConfig(max_model_len=64, max_num_seqs=4)
    for options, rest, grpc_field, scheduler_field in (
        (SamplingOptions(n=5, max_tokens=4), {"n": 5}, "n", "n"),
        (
            SamplingOptions(logit_bias=((100, 1.0),), max_tokens=4),
            {"logit_bias": {"100": 1.0}},
            "logit_bias",
            "logit_bias",
        ),
    ):
        reason = _reason(options, gateway, len(prompt))
        with pytest.raises(ApiError) as rest_error:
            validation.completion_params(
                CompletionRequest(prompt=prompt, max_tokens=4, **rest), [prompt], model, config
            )
        assert rest_error.value.body()["error"]["message"] == f"{grpc_field}: {reason}"
        with pytest.raises(RequestError) as grpc_error:
            admit_prompt("text", len(prompt), GenerationParams(sampling=options), gateway)
        assert grpc_error.value.message == f"options.sampling_params.{grpc_field}: {reason}"
        msg = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
        options_to_pb(options, msg.sampling_params)
        with pytest.raises(InvalidRequest) as scheduler_error:
            request_from_pb(msg, scheduler, vocab_size=100)
        assert str(scheduler_error.value) == f"sampling_params.{scheduler_field}: {reason}"


def test_the_rest_api_names_the_field_as_the_endpoint_spells_it():
    model = validation.ModelLimits("m", max_model_len=64, vocab_size=100)
    config = GatewayConfig(model="m", scheduler_address="s:1", max_logprobs=5)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for body, param in (
        ({**chat, "max_completion_tokens": 62}, "max_completion_tokens"),
        ({**chat, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ):
        with pytest.raises(ApiError) as err:
            validation.chat_params(ChatCompletionRequest(**body), [5, 6, 7], model, config)
        assert err.value.body()["error"]["param"] == param


# --- the REST model's bounds are the type's ---------------------------------------------------


@pytest.mark.parametrize(
    ("model", "field", "name"),
    [
        (CompletionRequest, "temperature", "temperature"),
        (CompletionRequest, "top_p", "top_p"),
        (CompletionRequest, "min_p", "min_p"),
        (CompletionRequest, "min_tokens", "min_tokens"),
        (CompletionRequest, "presence_penalty", "presence_penalty"),
        (CompletionRequest, "frequency_penalty", "frequency_penalty"),
        (CompletionRequest, "repetition_penalty", "repetition_penalty"),
        (CompletionRequest, "n", "n"),
        (CompletionRequest, "logprobs", "logprobs"),
        (CompletionRequest, "prompt_logprobs", "prompt_logprobs"),
        (ChatCompletionRequest, "top_logprobs", "logprobs"),
        (ChatCompletionRequest, "max_tokens", "max_tokens"),
        (ChatCompletionRequest, "max_completion_tokens", "max_tokens"),
        (GenerateRequest, "max_tokens", "max_tokens"),
    ],
)
def test_the_rest_model_takes_its_bounds_from_the_type(model, field, name):
    r = RANGES[name]
    base = {"prompt": "a"} if model is not ChatCompletionRequest else {"messages": [{"role": "user", "content": "a"}]}
    for bound in r.bounds.values():
        for value in (bound, bound - 1, bound + 1) if r.integer else (bound, bound - 0.001, bound + 0.001):
            value = value if r.integer else float(value)
            try:
                model(**base, **{field: value})
                accepted = True
            except pydantic.ValidationError:
                accepted = False
            assert accepted == (value in r), (field, value)
