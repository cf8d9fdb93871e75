"""One sampling type from the gateway to the stages: `SamplingOptions` and its one codec to
`pagoda.v1.SamplingParams` (`services/sampling_pb.py`), used by the gateway (both front
doors build it, then write it to the scheduler) and the scheduler (reads it)."""

from __future__ import annotations

import pytest

from gateway.generation import GenerationParams
from scheduler_svc.core.request import SamplingOptions as SchedulerOptions
from services.pb import common_pb2
from services.sampling import SamplingOptions, StructuredOutput, sampling_params
from services.sampling_pb import options_from_pb, options_to_pb

CASES = [
    SamplingOptions(),
    SamplingOptions(max_tokens=None),
    SamplingOptions(
        n=3,
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.25,
        top_k=4,
        min_p=0.125,
        seed=2**64 - 1,
        logprobs=0,
        stop_token_ids=(3, 9),
        ignore_eos=True,
        presence_penalty=-2.0,
        frequency_penalty=1.5,
        repetition_penalty=0.5,
        logit_bias=((1, -100.0), (7, 2.5)),
        prompt_logprobs=20,
    ),
    SamplingOptions(structured=StructuredOutput("json_schema", '{"type": "object"}')),
    SamplingOptions(structured=StructuredOutput("json_object")),
    SamplingOptions(structured=StructuredOutput("regex", "[a-z]+")),
    SamplingOptions(structured=StructuredOutput("choice", choices=("yes", "no"))),
    SamplingOptions(structured=StructuredOutput("grammar", 'start: "a" | "b"')),
]


@pytest.mark.parametrize("options", CASES)
def test_options_survive_the_wire(options):
    msg = common_pb2.SamplingParams()
    options_to_pb(options, msg)
    assert options_from_pb(common_pb2.SamplingParams.FromString(msg.SerializeToString())) == options


def test_the_layers_share_the_type():
    assert SchedulerOptions is SamplingOptions
    assert isinstance(GenerationParams().sampling, SamplingOptions)
    assert GenerationParams().sampling.max_tokens is None  # the gateway's default: the rest of the context
    assert sampling_params(CASES[2], (2,)).num_logprobs == 0


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("max_tokens", 0, "max_tokens"),
        ("top_p", 1.5, "top_p"),
        ("temperature", -1.0, "temperature"),
        ("repetition_penalty", 3.0, "repetition_penalty"),
        ("logprobs", 21, "logprobs"),
    ],
)
def test_a_bad_value_read_from_the_wire_names_its_field(field, value, where):
    msg = common_pb2.SamplingParams()
    setattr(msg, field, value)
    with pytest.raises(ValueError, match=f"^{where}: "):
        options_from_pb(msg)


def test_max_tokens_none_resolves_to_the_room_left():
    assert SamplingOptions(max_tokens=None).resolve_max_tokens(100).max_tokens == 100
    assert SamplingOptions(max_tokens=5).resolve_max_tokens(100).max_tokens == 5
    with pytest.raises(ValueError, match="^min_tokens: "):
        SamplingOptions(max_tokens=3, min_tokens=4)
    assert SamplingOptions(max_tokens=None, min_tokens=4).min_tokens == 4
