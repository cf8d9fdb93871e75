"""gpt-oss's Harmony output (issue 36): the `openai_gptoss` reasoning parser and the `openai`
tool-call parser on recorded replies (tests/support/harmony.py), whole and streamed in every
split, alone and together as the gateway composes them; the markers reach the parsers through
the detokenizer and never come out of them; gpt-oss's chat template renders through the
gateway as transformers renders it."""

from __future__ import annotations

import itertools
import json
import random
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.harmony import RECORDED, SPECIAL_TOKENS, TEMPLATE_PATH, write_harmony_tokenizer

from gateway.chat_parsing import ReplyDelta, ReplyParsing
from gateway.config import GatewayConfig
from gateway.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, reasoning_parser, tool_call_parser
from gateway.parsers.harmony import MARKERS, HarmonyHeader, Route, parse_header
from gateway.protocol import ChatCompletionRequest
from gateway.validation import ModelLimits, chat_prompt
from services.text import Tokenizer
from services.text.output import TextOutputProcessor

CASES = sorted(RECORDED)
BOTH = ReplyParsing("openai", "openai_gptoss")


def counting_ids():
    numbers = itertools.count()
    return lambda: f"call-{next(numbers)}"


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if text else []
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def chunkings(text: str, seed: int = 0, num_random: int = 8):
    """The whole text, 1-character deltas, every split in two, and random chunkings."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(num_random):
        yield random_chunks(text, rng)


def no_marker(*texts: str | None) -> bool:
    return not any(text and any(m in text for m in MARKERS) for text in texts)


# --------------------------------------------------------------------------- the parsers alone


def reasoning_streamed(deltas: list[str], tool_calls_follow: bool = False) -> tuple[str | None, str | None]:
    stream = reasoning_parser("openai_gptoss", tool_calls_follow=tool_calls_follow).stream()
    out = [stream.feed(d) for d in deltas] + [stream.finish()]
    return ("".join(p.reasoning or "" for p in out) or None, "".join(p.content or "" for p in out) or None)


def tools_streamed(deltas: list[str], **options) -> tuple[str | None, list[tuple[str, str, str]]]:
    stream = tool_call_parser("openai", new_id=counting_ids(), **options).stream()
    out = [stream.feed(d) for d in deltas] + [stream.finish()]
    calls = [(c.id, c.name, c.arguments) for d in out for c in d.tool_calls]
    assert [c.index for d in out for c in d.tool_calls] == list(range(len(calls)))  # each call whole, once
    return "".join(d.content or "" for d in out) or None, calls


@pytest.mark.parametrize("case", CASES)
def test_the_reasoning_parser_reads_recorded_replies_in_every_split(case):
    recorded = RECORDED[case]
    expected = (recorded.reasoning, recorded.reasoning_only_content)
    assert reasoning_parser("openai_gptoss").extract(recorded.text) == expected
    assert no_marker(*expected)
    for deltas in chunkings(recorded.text, seed=len(case)):
        assert reasoning_streamed(deltas) == expected, deltas


@pytest.mark.parametrize("case", CASES)
def test_the_tool_parser_reads_recorded_replies_in_every_split(case):
    recorded = RECORDED[case]
    result = tool_call_parser("openai", new_id=counting_ids()).extract(recorded.text)
    calls = [(c.id, c.name, c.arguments) for c in result.calls]
    assert (result.content, [c[1:] for c in calls]) == (recorded.content, list(recorded.calls))
    assert [c[0] for c in calls] == [f"call-{i}" for i in range(len(calls))]
    for _, _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)
    for deltas in chunkings(recorded.text, seed=len(case)):
        assert tools_streamed(deltas) == (result.content, calls), deltas


@pytest.mark.parametrize("case", CASES)
def test_a_reply_cut_anywhere_streams_as_it_reads_whole(case):
    """Whatever max_tokens cuts, the stream and the whole reply agree, and no marker, nor a
    marker's beginning, comes out."""
    text, rng = RECORDED[case].text, random.Random(5)
    for end in range(len(text) + 1):
        cut = text[:end]
        deltas = random_chunks(cut, rng)
        reasoning = reasoning_parser("openai_gptoss").extract(cut)
        assert reasoning_streamed(deltas) == reasoning and no_marker(*reasoning)
        result = tool_call_parser("openai", new_id=counting_ids()).extract(cut)
        assert tools_streamed(deltas) == (result.content, [(c.id, c.name, c.arguments) for c in result.calls])
        assert no_marker(result.content, *(c.arguments for c in result.calls))


# ------------------------------------------------------------- together, as the gateway reads them


def reply_streamed(parsing: ReplyParsing, deltas: list[str]) -> tuple[str | None, str | None, list]:
    stream = parsing.stream()
    out = [stream.feed(d) for d in deltas] + [stream.finish()]
    reasoning = "".join(d.reasoning or "" for d in out) or None
    content = "".join(d.content or "" for d in out) or None
    return reasoning, content, [(c.name, c.arguments) for d in out for c in d.tool_calls]


@pytest.mark.parametrize("case", CASES)
def test_both_parsers_give_reasoning_content_and_calls_streamed_or_not(case):
    recorded = RECORDED[case]
    message, finish = BOTH.message(recorded.text, "stop")
    assert (message["reasoning_content"], message["content"]) == (recorded.reasoning, recorded.content)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert calls == list(recorded.calls)
    assert finish == ("tool_calls" if recorded.calls else "stop")
    assert BOTH.message(recorded.text, "length")[1] == "length"
    assert no_marker(message["reasoning_content"], message["content"], *(a for _, a in calls))
    for deltas in chunkings(recorded.text, seed=len(case), num_random=4):
        assert reply_streamed(BOTH, deltas) == (recorded.reasoning, recorded.content, calls), deltas


def test_the_reasoning_parser_hands_calls_on_as_harmony_only_to_a_tool_parser():
    text = RECORDED["preamble_then_call"].text
    _, handed_on = reasoning_parser("openai_gptoss", tool_calls_follow=True).extract(text)
    assert handed_on.startswith("<|start|>assistant<|channel|>commentary<|message|>Let me check")
    assert "analysis" not in handed_on
    _, plain = reasoning_parser("openai_gptoss").extract(text)
    assert plain == RECORDED["preamble_then_call"].content_unread


def test_content_streams_as_it_comes_and_a_call_comes_whole_at_its_end():
    stream = BOTH.stream()
    assert stream.feed("<|channel|>analysis<|mess") == ReplyDelta()  # a header is held
    assert stream.feed("age|>Think").reasoning == "Think"
    assert stream.feed(".<|end|><|start|>assistant<|channel|>final<|message|>It is").content == "It is"
    assert stream.feed(" 4.<|e").content == " 4."  # a marker's beginning is held
    piece = stream.feed(
        'nd|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
    )
    assert (piece.content, piece.tool_calls) == (None, ())
    (call,) = stream.feed("<|call|>").tool_calls
    assert (call.index, call.name, call.arguments) == (0, "f", '{"a": 1}') and call.id
    assert stream.finish() == ReplyDelta() and stream.found_calls


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = RECORDED["two_calls"].text
    first = [(c.name, c.arguments) for c in tool_call_parser("openai").extract(text).calls][:1]
    one = tool_call_parser("openai", parallel_tool_calls=False)
    assert [(c.name, c.arguments) for c in one.extract(text).calls] == first
    for deltas in (list(text), [text]):
        assert [c[1:] for c in tools_streamed(deltas, parallel_tool_calls=False)[1]] == first


def test_include_reasoning_false_drops_the_reasoning():
    parsing = ReplyParsing("openai", "openai_gptoss", include_reasoning=False)
    message, _ = parsing.message(RECORDED["reasoning_and_final"].text, "stop")
    assert "reasoning_content" not in message and message["content"] == "2 + 2 = **4**."


_FRAGMENTS = [
    *MARKERS,
    "<|",
    "|>",
    "<|chan",
    "nel|>",
    "assistant",
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    " to=python",
    " json",
    "json",
    '{"a": 1}',
    "{",
    "}",
    "hi",
    " ",
    "\n",
    "é",
]


@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=16), st.randoms(use_true_random=False))
def test_any_text_in_any_chunking_streams_as_it_reads_whole_and_no_marker_leaks(fragments, rng):
    reply = "".join(fragments)
    deltas = random_chunks(reply, rng)
    reasoning, content, calls = reply_streamed(BOTH, deltas)
    message, _ = BOTH.message(reply, "stop")
    whole_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert (reasoning, content, calls) == (message["reasoning_content"], message["content"], whole_calls)
    assert no_marker(reasoning, content, *(a for _, a in calls))
    for follow in (False, True):  # alone too
        alone = reasoning_parser("openai_gptoss", tool_calls_follow=follow).extract(reply)
        assert reasoning_streamed(deltas, follow) == alone
    assert no_marker(*reasoning_parser("openai_gptoss").extract(reply))


# ------------------------------------------------------------------------- headers, registration


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("<|channel|>analysis", HarmonyHeader("<|channel|>analysis", "analysis")),
        ("assistant<|channel|>final", HarmonyHeader("assistant<|channel|>final", "final")),
        (
            "<|channel|>commentary to=functions.get_weather <|constrain|>json",
            HarmonyHeader(
                "<|channel|>commentary to=functions.get_weather <|constrain|>json",
                "commentary",
                "functions.get_weather",
                "json",
            ),
        ),
        (
            "assistant to=functions.f<|channel|>commentary json",
            HarmonyHeader("assistant to=functions.f<|channel|>commentary json", "commentary", "functions.f", "json"),
        ),
        (
            "<|channel|>commentary<|constrain|>json to=functions.g",
            HarmonyHeader("<|channel|>commentary<|constrain|>json to=functions.g", "commentary", "functions.g", "json"),
        ),
        ("", HarmonyHeader("")),
    ],
)
def test_headers_are_read_in_either_order(raw, expected):
    assert parse_header(raw) == expected


def test_routes():
    assert parse_header("<|channel|>commentary to=functions.f").route is Route.CALL
    assert parse_header("<|channel|>analysis to=functions.f").route is Route.CALL  # vLLM: a call too
    assert parse_header("<|channel|>analysis").route is Route.REASONING
    assert parse_header("<|channel|>commentary to=browser.search").route is Route.REASONING
    assert parse_header("<|channel|>commentary").route is Route.CONTENT  # a preamble
    assert parse_header("<|channel|>final").route is Route.CONTENT
    assert parse_header("<|channel|>commentary to=functions.").route is Route.REASONING  # no name


def test_registered_under_vllms_names_and_accepted_by_the_config():
    assert "openai_gptoss" in REASONING_PARSERS and "openai" in TOOL_CALL_PARSERS
    config = GatewayConfig(
        model="m",
        scheduler_address="a:1",
        enable_auto_tool_choice=True,
        tool_call_parser="openai",
        reasoning_parser="openai_gptoss",
    )
    assert (config.tool_call_parser, config.reasoning_parser) == ("openai", "openai_gptoss")
    assert set(BOTH.kept_tokens) >= set(MARKERS)
    assert set(ReplyParsing(None, "openai_gptoss").kept_tokens) >= set(MARKERS)
    assert set(ReplyParsing("openai", None).kept_tokens) >= set(MARKERS)


# ------------------------------------------------- a Harmony tokenizer: markers through the detokenizer


@pytest.fixture(scope="module")
def harmony_dir(model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony") / "model"
    shutil.copytree(model_factory(arch="llama", vocab_size=1024), path)
    write_harmony_tokenizer(path)
    return path


def test_the_markers_are_special_tokens_and_stop_tokens(harmony_dir):
    tok = Tokenizer(harmony_dir)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))) and set(ids) <= set(tok.special_token_ids)
    assert tok.eos_token_ids[:1] == (tok.token_to_id("<|return|>"),)
    assert {tok.token_to_id("<|call|>"), tok.token_to_id("<|endoftext|>")} <= set(tok.eos_token_ids)


@pytest.mark.parametrize("case", ["reasoning_and_call", "preamble_then_call", "reasoning_and_final"])
def test_the_detokenizer_keeps_the_markers_for_the_parsers_and_drops_the_stop_token(harmony_dir, case):
    tok = Tokenizer(harmony_dir)
    recorded = RECORDED[case]
    stop = "<|call|>" if recorded.calls else "<|return|>"
    ids = tok.encode(recorded.text, add_special_tokens=False) + [tok.token_to_id(stop)]
    assert sum(i in set(tok.special_token_ids) for i in ids) == sum(recorded.text.count(m) for m in MARKERS) + 1
    proc = TextOutputProcessor(tok, keep_special_tokens=BOTH.kept_tokens)
    for token_id in ids[:-1]:  # token by token, as the scheduler sends them
        proc.push([token_id])
    proc.finish(ids[-1:], stop_token_id=ids[-1])
    assert proc.text == recorded.text
    plain = TextOutputProcessor(tok)  # without a parser the special tokens are skipped
    plain.push(ids[:-1])
    assert no_marker(plain.text + plain.finish().text)


# ---------------------------------------------------------------------------- the chat template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, in °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "  Grüße! What is 2+2? 世界 🌍  "}
REPLY = {"role": "assistant", "content": "4."}
USER_2 = {"role": "user", "content": "And times three?"}
ASK = {"role": "user", "content": "Weather in Zürich?"}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Zürich"}}}
RESULT = {"role": "tool", "tool_call_id": "call12345", "content": '{"temp_c": 21}'}
TEMPLATE_CASES = {
    "user": ([USER], None, {}),
    "system_user": ([SYSTEM, USER], None, {}),
    "multi_turn": ([SYSTEM, USER, REPLY, USER_2], None, {}),
    "tools_offered": ([ASK], [WEATHER_TOOL], {}),
    "call_and_result": ([ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}, RESULT], [WEATHER_TOOL], {}),
    "reasoning_effort": ([USER], None, {"reasoning_effort": "high"}),
}


def _sent(messages: list[dict]) -> list[dict]:
    """As an OpenAI client sends them: a call's arguments as JSON text."""
    return [
        {
            **m,
            "tool_calls": [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ],
        }
        if "tool_calls" in m
        else m
        for m in messages
    ]


@pytest.mark.parametrize("case", sorted(TEMPLATE_CASES))
def test_the_gpt_oss_template_renders_as_transformers(harmony_dir, case):
    from transformers import AutoTokenizer

    messages, tools, kwargs = TEMPLATE_CASES[case]
    tok, hf = Tokenizer(harmony_dir), AutoTokenizer.from_pretrained(harmony_dir)
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    want = hf.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=True, **kwargs
    )
    body = {
        "model": "tiny",
        "messages": _sent(messages),
        **({"tools": tools} if tools else {}),
        **({"chat_template_kwargs": kwargs} if kwargs else {}),
    }
    got = chat_prompt(ChatCompletionRequest.model_validate(body), tok, ModelLimits("tiny", 1 << 16, tok.vocab_size))
    assert tok.decode(got, skip_special_tokens=False) == text
    assert list(got) == list(want)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and text.endswith("<|start|>assistant")
    assert tok.token_to_id("<|channel|>") in got or "<|channel|>" not in text  # markers are single tokens
    if tools:
        assert "type get_weather = (_: {" in text
    if case == "call_and_result":  # the call as gpt-oss writes it, the result to the assistant
        assert (
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"location": "Zürich"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
            '<|message|>"{\\"temp_c\\": 21}"<|end|>'
        ) in text


def test_the_vendored_template_is_gpt_oss():
    source = TEMPLATE_PATH.read_text(encoding="utf-8")
    assert "<|start|>assistant<|channel|>final<|message|>" in source and source.endswith("{%- endif -%}")
