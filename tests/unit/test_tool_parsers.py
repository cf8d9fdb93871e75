"""gateway.parsers tool-call parsers (issue 28, automatic tool calls), on replies written as
the models write them: whole replies read by `extract`, and the same replies streamed in
every split, which must give back exactly what `extract` gives."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.harmony import RECORDED

from gateway.parsers import TOOL_CALL_PARSERS, StreamDelta, ToolCall, ToolCallDelta, reasoning_parser, tool_call_parser

# a call's arguments are passed through as the model wrote them (issue 35, item 14); the
# pythonic format, which is not JSON, has them as compact JSON
WEATHER = '{"city": "Paris"}'
WEATHER_COMPACT = '{"city":"Paris"}'


def counting_ids():
    numbers = itertools.count()
    return lambda: f"call-{next(numbers)}"


def parser(name: str, **options):
    return tool_call_parser(name, new_id=counting_ids(), **options)


def calls_of(result) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in result.calls]


def streamed(name: str, deltas: list[str], **options) -> tuple[str | None, list[ToolCall]]:
    """Feed `deltas` to a fresh stream; the content and calls put back together, checking
    the OpenAI shape of the pieces on the way."""
    stream = parser(name, **options).stream()
    out = [stream.feed(delta) for delta in deltas] + [stream.finish()]
    content = "".join(delta.content or "" for delta in out) or None
    calls: dict[int, list[str]] = {}
    for piece in (piece for delta in out for piece in delta.tool_calls):
        if piece.index not in calls:
            assert piece.index == len(calls) and piece.id and piece.name
            calls[piece.index] = [piece.id, piece.name, piece.arguments]
        else:
            assert piece.id is None and piece.name is None
            calls[piece.index][2] += piece.arguments
    return content, [ToolCall(*calls[i]) for i in range(len(calls))]


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


# ------------------------------------------------------------------ recorded replies, by format
# (reply, expected content, expected calls as (name, arguments))

HERMES = [
    (
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
        'CA, USA", "unit": "celsius"}}\n</tool_call>',
        None,
        [("get_current_temperature", '{"location": "San Francisco, CA, USA", "unit": "celsius"}')],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>',
        None,
        [("get_weather", WEATHER), ("get_weather", '{"city": "London"}')],
    ),
    (
        'I\'ll look up the weather for you.\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>',
        "I'll look up the weather for you.\n\n",
        [("get_weather", WEATHER)],
    ),
    (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>\nI will report back.",
        "Checking.\n\nI will report back.",
        [("get_weather", WEATHER)],
    ),
    (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',  # stopped before </tool_call>
        None,
        [("get_time", "{}")],
    ),
    (
        '<tool_call>\n{"name": "translate", "arguments": {"text": "Grüße, 世界", "to": ["en", "fr"], '
        '"options": {"formal": true, "n": 2.5}}}\n</tool_call>',
        None,
        [("translate", '{"text": "Grüße, 世界", "to": ["en", "fr"], "options": {"formal": true, "n": 2.5}}')],
    ),
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", '{"a": 1}')]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("  \n", None, []),
    ("Wrap it in <tool_", "Wrap it in <tool_", []),
]
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
    "<tool_call>\n{'name': 'get_weather', 'arguments': {}}\n</tool_call>",  # not JSON
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',  # not JSON out
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lon',  # the second cut short
]

LLAMA3 = [
    (
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        None,
        [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')],
    ),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", WEATHER)]),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "London"}}',
        None,
        [("get_weather", WEATHER), ("get_weather", '{"city": "London"}')],
    ),
    (
        'Let me look that up.<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "Let me look that up.",
        [("get_weather", WEATHER)],
    ),
    ('\n\n{"type": "function", "name": "get_time", "parameters": {}}', None, [("get_time", "{}")]),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\nI will tell you soon.',
        "\nI will tell you soon.",
        [("get_weather", WEATHER)],
    ),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}};', None, [("get_weather", WEATHER)]),
    ("Paris is the capital {of France}.", "Paris is the capital {of France}.", []),
]
LLAMA3_MALFORMED = [
    '{"answer": 42, "unit": "m"}',  # a JSON answer, not a call
    '{"name": "Bob", "age": 3}',  # no parameters: not a call
    '{"name": "get_weather", "parameters": {"city": ',  # cut short
    '{"name": "get_weather", "parameters": {}}; {"name": ',  # the second cut short
    "{x} is a set",
    '<|python_tag|>brave_search.call(query="weather in Paris")',  # a built-in tool, not JSON
]

MISTRAL = [
    (
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}]',
        None,
        [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')],
    ),
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}, "id": "ab12cd34e"}]',
        None,
        [("get_weather", WEATHER), ("get_time", "{}")],
    ),
    (
        'Sure, let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "Sure, let me check.",
        [("get_weather", WEATHER)],
    ),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', None, [("get_weather", WEATHER)]),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [("get_weather", WEATHER), ("get_time", "{}")],
    ),
    ("Bonjour ! [TOOL", "Bonjour ! [TOOL", []),
]
MISTRAL_MALFORMED = [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut short
    "[TOOL_CALLS][]",
    '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',  # not JSON
    "[TOOL_CALLS]",
]

PYTHONIC = [
    (
        '[get_weather(city="San Francisco", metric="celsius")]',
        None,
        [("get_weather", '{"city":"San Francisco","metric":"celsius"}')],
    ),
    (
        "[get_weather(city='Paris'), get_time(timezone='Europe/Paris')]",
        None,
        [("get_weather", WEATHER_COMPACT), ("get_time", '{"timezone":"Europe/Paris"}')],
    ),
    (
        "[search(query='x', limit=5, exact=True, cursor=None, tags=['a', 'b'], span=(1, 2), "
        "filters={'lang': 'en', 'min': -0.5})]",
        None,
        [
            (
                "search",
                '{"query":"x","limit":5,"exact":true,"cursor":null,"tags":["a","b"],'
                '"span":[1,2],"filters":{"lang":"en","min":-0.5}}',
            )
        ],
    ),
    ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [("get_weather", WEATHER_COMPACT)]),
    ("Let me check. <|python_start|>[get_time()]<|python_end|>", "Let me check. ", [("get_time", "{}")]),
    (
        "\n[\n  get_weather(city='Paris'),\n  get_time()\n]\n",
        None,
        [("get_weather", WEATHER_COMPACT), ("get_time", "{}")],
    ),
    ("get_weather(city='Paris')", "get_weather(city='Paris')", []),  # not in a list
]
PYTHONIC_MALFORMED = [
    "[get_weather(city=location)]",  # a name, not a literal
    "[f(x=open('/etc/passwd'))]",  # a call, never run
    "[f(x=__import__('os').system('true'))]",
    "[get_weather('Paris')]",  # positional
    "[os.system(cmd='ls')]",  # not a plain name
    "[f(**{'a': 1})]",
    "[f(x=f'{y}')]",
    "[f(x=1 + 2)]",
    "[get_weather(city='Par",  # cut short
    "[get_weather(city='Paris')] Done.",  # text after the list
    "[link](https://example.com)",
    "[1, 2, 3]",
    "[]",
]

# gpt-oss's Harmony replies (tests/support/harmony.py; more in test_harmony_parsers.py): a
# malformed call is dropped, never given as content, since its markers must not leak
OPENAI = [(r.text, r.content, list(r.calls)) for r in RECORDED.values()]

FORMATS = {
    "openai": (OPENAI, []),
    "hermes": (HERMES, HERMES_MALFORMED),
    "llama3_json": (LLAMA3, LLAMA3_MALFORMED),
    "mistral": (MISTRAL, MISTRAL_MALFORMED),
    "pythonic": (PYTHONIC, PYTHONIC_MALFORMED),
}
WELL_FORMED = [(name, *case) for name, (cases, _) in FORMATS.items() for case in cases]
MALFORMED = [(name, text) for name, (_, texts) in FORMATS.items() for text in texts]
ALL_REPLIES = [(name, reply) for name, reply, _, _ in WELL_FORMED] + MALFORMED


@pytest.mark.parametrize(("name", "reply", "content", "calls"), WELL_FORMED)
def test_extract_reads_recorded_replies(name, reply, content, calls):
    result = parser(name).extract(reply)
    assert (result.content, calls_of(result)) == (content, calls)
    assert [call.id for call in result.calls] == [f"call-{i}" for i in range(len(calls))]
    for call in result.calls:
        assert json.loads(call.arguments) is not None


@pytest.mark.parametrize(("name", "reply"), MALFORMED)
def test_malformed_calls_give_the_whole_reply_as_content(name, reply):
    result = parser(name).extract(reply)
    assert (result.content, result.calls) == (reply, [])


@pytest.mark.parametrize(("name", "reply"), ALL_REPLIES)
def test_streaming_in_every_split_gives_what_extract_gives(name, reply):
    expected = parser(name).extract(reply)
    for deltas in chunkings(reply, seed=len(reply)):
        assert streamed(name, deltas) == (expected.content, expected.calls), deltas


@pytest.mark.parametrize(("name", "reply"), ALL_REPLIES)
def test_streaming_a_reply_cut_anywhere_gives_what_extract_gives(name, reply):
    rng = random.Random(7)
    for end in range(len(reply) + 1):
        cut = reply[:end]
        expected = parser(name).extract(cut)
        deltas = random_chunks(cut, rng)
        assert streamed(name, deltas) == (expected.content, expected.calls), deltas


_FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<|python_start|>",
    "<|python_end|>",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ";",
    ",",
    "\n",
    " ",
    '"name": "f"',
    '"arguments": {"a": 1}',
    '"parameters": {}',
    '{"name": "g", "arguments": {}}',
    "f(x=1)",
    "g()",
    "hello",
    "'",
    '"',
    ":",
    "=",
    "NaN",
]


@given(
    st.sampled_from(sorted(TOOL_CALL_PARSERS)),
    st.lists(st.sampled_from(_FRAGMENTS), max_size=14),
    st.randoms(use_true_random=False),
)
def test_any_text_in_any_chunking_streams_as_extract_reads_it(name, fragments, rng):
    reply = "".join(fragments)
    expected = parser(name).extract(reply)  # never raises
    assert streamed(name, random_chunks(reply, rng)) == (expected.content, expected.calls)


# ----------------------------------------------------------------- what streaming gives, and when


def test_text_before_a_call_streams_as_it_arrives_and_a_split_marker_is_held():
    stream = parser("hermes").stream()
    assert stream.feed("Let me check") == StreamDelta("Let me check")
    assert stream.feed(". <tool_c") == StreamDelta(". ")
    assert stream.feed('all>\n{"name": "get_weather", ') == StreamDelta()
    assert stream.feed('"arguments": {"city": "Paris"}}\n</tool_call>') == StreamDelta()
    assert stream.finish() == StreamDelta(None, (ToolCallDelta(0, "call-0", "get_weather", WEATHER),))


def test_text_that_only_looked_like_a_marker_is_given_once_it_differs():
    stream = parser("hermes").stream()
    assert stream.feed("Use <tool_") == StreamDelta("Use ")
    assert stream.feed("box>") == StreamDelta("<tool_box>")
    assert stream.finish() == StreamDelta()


def test_a_blank_start_is_held_and_dropped_before_a_call():
    stream = parser("hermes").stream()
    assert stream.feed("\n\n") == StreamDelta()
    assert stream.feed('<tool_call>{"name": "get_time"}</tool_call>') == StreamDelta()
    assert stream.finish() == StreamDelta(None, (ToolCallDelta(0, "call-0", "get_time", "{}"),))


def test_a_json_answer_streams_once_it_cannot_be_a_call():
    stream = parser("llama3_json").stream()
    assert stream.feed('{"answer": ') == StreamDelta()
    assert stream.feed("42}") == StreamDelta('{"answer": 42}')
    assert stream.feed(" is it.") == StreamDelta(" is it.")
    assert stream.finish() == StreamDelta()
    assert parser("llama3_json").stream().feed("{x") == StreamDelta("{x")


def test_a_bracketed_answer_streams_once_it_cannot_be_a_list_of_calls():
    stream = parser("pythonic").stream()
    assert stream.feed("[link") == StreamDelta()
    assert stream.feed("](https://example.com)") == StreamDelta("[link](https://example.com)")
    held = parser("pythonic").stream()
    assert held.feed("[get_weather(") == StreamDelta()
    assert held.finish() == StreamDelta("[get_weather(")


def test_each_call_comes_whole_in_the_openai_shape():
    stream = parser("mistral").stream()
    stream.feed('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ')
    stream.feed('{"name": "get_time", "arguments": {}}]')
    pieces = [piece.to_openai() for piece in stream.finish().tool_calls]
    assert pieces == [
        {"index": 0, "id": "call-0", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}},
        {"index": 1, "id": "call-1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert ToolCallDelta(0, arguments='{"a"').to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}
    assert ToolCall("x", "f", "{}").to_openai() == {
        "id": "x",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }


def test_feeding_or_finishing_a_finished_stream_is_a_bug():
    stream = parser("hermes").stream()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("more")
    with pytest.raises(RuntimeError):
        stream.finish()


def test_the_content_of_a_reasoning_stream_feeds_a_tool_call_stream():
    reply = (
        "<think>\nThe user wants the weather in Paris.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    thinking, calling = reasoning_parser("qwen3").stream(), parser("hermes").stream()
    reasoning, out = "", []
    for delta in [*reply[:40], reply[40:90], reply[90:]]:
        piece = thinking.feed(delta)
        reasoning += piece.reasoning or ""
        out.append(calling.feed(piece.content or ""))
    assert thinking.finish() == (None, None)
    out.append(calling.finish())
    assert reasoning == "\nThe user wants the weather in Paris.\n"
    assert [d.content for d in out if d.content] == []  # the blank after </think> is no content
    assert [d.tool_calls for d in out if d.tool_calls] == [(ToolCallDelta(0, "call-0", "get_weather", WEATHER),)]


# ------------------------------------------------------------------------ options, ids, registry


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_parallel_tool_calls_false_keeps_the_first_call(name):
    reply = next(case[1] for case in WELL_FORMED if case[0] == name and len(case[3]) == 2)
    first = parser(name).extract(reply).calls[:1]
    assert parser(name, parallel_tool_calls=False).extract(reply).calls == first
    for deltas in (list(reply), [reply]):
        assert streamed(name, deltas, parallel_tool_calls=False)[1] == first


def test_call_ids_are_vllms():
    reply = '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    ids = [call.id for call in tool_call_parser("hermes").extract(reply).calls]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 2
    (mistral,) = tool_call_parser("mistral").extract("[TOOL_CALLS]f{}").calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral.id)  # what Mistral's templates accept


def test_the_registry_has_vllms_names_and_refuses_others():
    assert set(TOOL_CALL_PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="hermes"):
        tool_call_parser("nope")


def test_the_parsers_are_pure_python():
    code = (
        "import sys, gateway.parsers; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'grpc', 'fastapi', 'scheduler_svc', 'kvcache_svc', 'worker_svc', 'wiring', "
        "'services')]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
