"""Structured output below the HTTP layer: the constraint type and its limits, the grammar
check both front doors share (`services.grammar`), the step codec, and the last stage's
sampler masking logits with llguidance matchers (`worker_svc.execution.structured`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.grammar import GrammarError, check
from services.pb import common_pb2
from services.sampling import MAX_CHOICES, MAX_STRUCTURED_CHARS, SamplingParams, StructuredOutput
from services.sampling_pb import options_to_pb as sampling_params_to_pb
from services.sampling_pb import params_from_pb as sampling_params_from_pb
from services.text import Tokenizer
from worker_svc.execution.sampler import Sampler
from worker_svc.execution.sampler_types import SampleRow
from worker_svc.execution.structured import GrammarBank


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def vocab(model_dir):
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("json_object"),
        StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
        StructuredOutput("regex", r"\d{3}-[a-z]+"),
        StructuredOutput("choice", choices=("yes", "no")),
        StructuredOutput("grammar", 'root ::= "yes" | "no"'),  # GBNF
        StructuredOutput("grammar", 'start: "a" "b"*'),  # Lark
    ],
)
def test_valid_constraints_compile(spec):
    check(spec)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutput("json_schema", '{"type": 5}'), "type must be a string"),
        (StructuredOutput("json_schema", "[1, 2]"), "must be a JSON object"),
        (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
        (StructuredOutput("json_schema", '{"$ref": "#/$defs/missing"}'), "does not exist"),
        (StructuredOutput("json_schema", '{"type": "string", "format": "bogus"}'), "Unknown format"),
        (StructuredOutput("regex", "(abc"), "unclosed group"),
        (StructuredOutput("regex", "(?<=a)b"), "look-around"),
        (StructuredOutput("grammar", "start: undefined_rule"), "unknown name"),
    ],
)
def test_invalid_constraints_say_why(spec, says):
    with pytest.raises(GrammarError, match=says):
        check(spec)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"kind": "xml"}, "kind must be one of"),
        ({"kind": "regex"}, "is empty"),
        ({"kind": "choice"}, "needs 1 to"),
        ({"kind": "choice", "choices": ("a", "")}, "non-empty strings"),
        ({"kind": "choice", "choices": tuple(map(str, range(MAX_CHOICES + 1)))}, "needs 1 to"),
        ({"kind": "regex", "spec": "a", "choices": ("a",)}, "only for kind 'choice'"),
        ({"kind": "grammar", "spec": "x" * (MAX_STRUCTURED_CHARS + 1)}, "at most"),
    ],
)
def test_the_constraint_is_bounded(kwargs, says):
    with pytest.raises(ValueError, match=says) as err:
        StructuredOutput(**kwargs)
    assert str(err.value).startswith("structured_output: ")  # names the field


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("json_object"),
        StructuredOutput("regex", "[0-9]+"),
        StructuredOutput("choice", choices=("x", "y")),
        StructuredOutput("json_schema", '{"enum": [1]}'),
    ],
)
def test_step_codec_carries_the_constraint(spec):
    params = SamplingParams(temperature=0.0, eos_token_ids=(1,), structured=spec)
    msg = common_pb2.SamplingParams()
    sampling_params_to_pb(params, msg)
    back = sampling_params_from_pb(common_pb2.SamplingParams.FromString(msg.SerializeToString()), (1,))
    assert back == params


# --- the sampler ------------------------------------------------------------------------------


def _decode(tokenizer, tokens):
    eos = set(tokenizer.eos_token_ids)
    return tokenizer.decode([t for t in tokens if t not in eos])


def _run(sampler, params, vocab, steps, seq_id=1, start=(), seed=0):
    """Samples up to `steps` tokens for one sequence from random logits (seeded), stopping at EOS."""
    g = torch.Generator().manual_seed(seed)
    out = list(start)
    for _ in range(steps):
        history = ((5, 6), tuple(out)) if sampler.state(seq_id) is None else None
        row = SampleRow(seq_id, params, 0, len(out), 7, history)
        token = sampler.sample(torch.randn(1, vocab, generator=g) * 5, [row]).token_ids[0]
        out.append(token)
        if token in params.eos_token_ids:
            break
    return out


def test_sampled_tokens_follow_the_grammar(model_dir, tokenizer, vocab):
    eos = tokenizer.eos_token_ids
    cases = [
        (StructuredOutput("choice", choices=("alpha", "beta", "gamma")), lambda t: t in ("alpha", "beta", "gamma")),
        (StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
        (
            StructuredOutput(
                "json_schema",
                json.dumps(
                    {
                        "type": "object",
                        "properties": {"k": {"enum": ["v", "w"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["k", "n"],
                        "additionalProperties": False,
                    }
                ),
            ),
            lambda t: set(json.loads(t)) == {"k", "n"},
        ),
    ]
    for spec, ok in cases:
        for temperature in (0.0, 1.0):
            sampler = Sampler(GrammarBank(model_dir, vocab))
            params = SamplingParams(temperature=temperature, eos_token_ids=eos, structured=spec)
            tokens = _run(sampler, params, vocab, 80, seed=3)
            assert tokens[-1] in eos, "the grammar ends the output with EOS"
            assert ok(_decode(tokenizer, tokens)), (spec.kind, _decode(tokenizer, tokens))


def test_state_rebuilt_from_the_tokens_equals_the_live_state(model_dir, tokenizer, vocab):
    """What preemption and a stage's full resend rely on: a matcher rebuilt from the output
    so far allows exactly what the live one does, and sampling goes on identically."""
    spec = StructuredOutput(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
                },
                "required": ["name", "tags"],
                "additionalProperties": False,
            }
        ),
    )
    params = SamplingParams(temperature=1.0, seed=11, eos_token_ids=tokenizer.eos_token_ids, structured=spec)
    bank = GrammarBank(model_dir, vocab)
    whole = _run(Sampler(bank), params, vocab, 60, seed=4)
    assert len(whole) > 8
    live = Sampler(bank)
    first = _run(live, params, vocab, 6, seed=4)
    probe = Sampler(bank)  # a state started from the six tokens, as after a preemption
    probe._state_for(SampleRow(1, params, 0, 6, 7, ((5, 6), tuple(first[:6]))))
    live_allowed = bank.allowed([live.state(1).matcher], [params.eos_token_ids], vocab)
    probe_allowed = bank.allowed([probe.state(1).matcher], [params.eos_token_ids], vocab)
    assert torch.equal(live_allowed, probe_allowed)
    assert first == whole[:6]
    g = torch.Generator().manual_seed(99)
    logits = torch.randn(1, vocab, generator=g) * 5
    assert (
        probe.sample(logits, [SampleRow(1, params, 0, 6, 7)]).token_ids
        == live.sample(logits, [SampleRow(1, params, 0, 6, 7)]).token_ids
    )


def test_the_grammar_wins_over_min_tokens(model_dir, tokenizer, vocab):
    """A choice complete after one token can only end; min_tokens holds EOS back, but the
    grammar allows nothing else, so EOS it is (never a token outside the grammar)."""
    eos = tokenizer.eos_token_ids
    choice = tokenizer.decode([40])
    spec = StructuredOutput("choice", choices=(choice,))
    params = SamplingParams(temperature=0.0, min_tokens=5, eos_token_ids=eos, structured=spec)
    sampler = Sampler(GrammarBank(model_dir, vocab))
    tokens = _run(sampler, params, vocab, 5)
    assert _decode(tokenizer, tokens) == choice and tokens[-1] in eos


def test_a_sampler_without_grammars_refuses_a_constraint(vocab):
    params = SamplingParams(temperature=0.0, eos_token_ids=(1,), structured=StructuredOutput("json_object"))
    from worker_svc.errors import InvalidPlanError

    with pytest.raises(InvalidPlanError, match="no structured output"):
        Sampler().sample(torch.zeros(1, vocab), [SampleRow(1, params, 0, 0, 7, ((5,), ()))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["native", "torch"])
@pytest.mark.parametrize("vocab_size", [8192, 1000, 31])
def test_applying_a_bitmask_natively_equals_unpacking_it(dtype, vocab_size):
    from worker_svc.execution.structured import _unpack

    g = torch.Generator().manual_seed(vocab_size)
    words = -(-vocab_size // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # every token allowed
    bitmask[2, 0] = 1 << 5  # one
    logits = torch.randn(5, vocab_size, generator=g, dtype=dtype)
    masked = logits.clone()
    GrammarBank.apply(masked, bitmask)
    assert torch.equal(masked, logits.masked_fill(~_unpack(bitmask, vocab_size), float("-inf")))
    assert torch.equal(masked[1], logits[1])
