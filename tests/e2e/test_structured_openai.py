"""Structured output and tool calls end to end: `pagoda serve` (PP=2, a KV pool small enough
that concurrent requests preempt each other) driven by the official `openai` client.

Outputs are parsed and validated with `jsonschema`; a random tiny model follows a schema only
because the last stage's sampler masks every token the grammar does not allow.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from support.schemas import SCHEMAS
from support.stack import kill_tree

from wiring.launcher import ServiceProcess, free_port, pagoda_command

NUM_KV_BLOCKS = 40  # x 16 = 640 slots: a dozen requests of ~100 + 100 tokens must preempt
BLOCK_SIZE = 16
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured-stack-logs")
    port, grpc_port = free_port(), free_port()
    serve = ServiceProcess(
        "serve",
        pagoda_command(
            "serve",
            model_dir,
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--pipeline-parallel-size",
            "2",
            "--num-kv-blocks",
            str(NUM_KV_BLOCKS),
            "--block-size",
            str(BLOCK_SIZE),
            "--num-threads",
            "1",
            "--max-model-len",
            str(NUM_KV_BLOCKS * BLOCK_SIZE),  # (as much as the pool holds)
            "--served-model-name",
            "tiny",
            "--log-dir",
            str(logs),
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=logs / "serve.log",
    )
    serve.start()
    try:
        serve.wait_healthy(180)
    except Exception:
        serve.stop()
        raise
    yield SimpleNamespace(port=port, serve=serve)
    kill_tree(serve)  # the graceful drain is not tested here (3-7 s a stack)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="none", max_retries=0, timeout=120)


def preemptions(stack) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/metrics", timeout=10).read().decode()
    match = re.search(r"^pagoda:num_preemptions_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    assert match, "the gateway's /metrics reports preemptions"
    return float(match.group(1))


def chat(client, content, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kwargs)


def test_twenty_schemas_greedy_and_sampled(client, stack):
    """response_format json_schema: every output parses and validates, greedy and sampled,
    all 40 requests at once."""
    jobs = [(i, temperature) for i in range(len(SCHEMAS)) for temperature in (0.0, 1.0)]

    def one(job):
        i, temperature = job
        # a long prompt, so that the concurrent requests do not fit the pool together
        prompt = f"Schema {i}: reply with JSON. " + "Some context to read first. " * 12
        r = chat(
            client,
            prompt,
            temperature=temperature,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True},
            },
        )
        return i, temperature, r.choices[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    for i, temperature, choice in results:
        assert choice.finish_reason == "stop", (i, temperature, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])


def test_a_preempted_request_gives_what_an_undisturbed_one_does(client, stack):
    """Greedy under a grammar: the same request alone and amid a crowd that preempts it (a
    dozen requests whose outputs of ~100 tokens outgrow the pool while they run)."""
    schema = {
        "type": "array",
        "items": {"type": "string", "minLength": 3, "maxLength": 6},
        "minItems": 16,
        "maxItems": 16,
    }
    prompt = "Name things. " + "Background to read first. " * 8

    def ask():
        return chat(
            client,
            prompt,
            temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": schema}},
        )

    alone = ask().choices[0].message.content
    before = preemptions(stack)
    with ThreadPoolExecutor(12) as pool:
        crowd = list(pool.map(lambda _: ask().choices[0].message.content, range(12)))
    assert preemptions(stack) > before
    assert crowd == [alone] * 12
    jsonschema.validate(json.loads(alone), schema)


def test_n3_choices_each_conform(client):
    schema = SCHEMAS[0]
    r = chat(
        client,
        "Three people",
        n=3,
        temperature=1.0,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    assert len(r.choices) == 3
    values = [json.loads(c.message.content) for c in r.choices]
    for value in values:
        jsonschema.validate(value, schema)
    assert len({json.dumps(v) for v in values}) > 1  # sampled: the choices differ


def test_json_object_and_vllm_guided_extras(client, model_dir):
    from services.text import Tokenizer

    # any object: nothing bounds its strings, so a bias towards closing braces ends it
    # (with the grammar, a brace can only close what is open)
    close = Tokenizer(model_dir).encode("}", add_special_tokens=False)
    obj = chat(
        client,
        "Any object",
        temperature=0.0,
        response_format={"type": "json_object"},
        logit_bias={str(t): 30 for t in close},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)

    guided = client.completions.create(
        model="tiny",
        prompt="JSON please",
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=3,
        extra_body={"guided_json": SCHEMAS[3]},
    )
    jsonschema.validate(json.loads(guided.choices[0].text), SCHEMAS[3])

    as_string = client.completions.create(
        model="tiny",
        prompt="JSON please",
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"guided_json": json.dumps(SCHEMAS[1])},
    )
    assert json.loads(as_string.choices[0].text) in SCHEMAS[1]["enum"]

    vllm_new = client.completions.create(
        model="tiny",
        prompt="JSON please",
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"structured_outputs": {"json": SCHEMAS[4]}},
    )
    jsonschema.validate(json.loads(vllm_new.choices[0].text), SCHEMAS[4])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_choice_and_regex(client, temperature):
    choices = ["positive", "negative", "neutral"]
    picked = client.completions.create(
        model="tiny",
        prompt="Sentiment:",
        max_tokens=20,
        n=3,
        temperature=temperature,
        seed=1,
        extra_body={"guided_choice": choices},
    )
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)

    pattern = r"[A-Z]{2}-[0-9]{4}"
    matched = chat(client, "A code", temperature=temperature, seed=2, n=3, extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.message.content) for c in matched.choices)

    streamed = client.completions.create(
        model="tiny",
        prompt="A code",
        max_tokens=20,
        temperature=temperature,
        stream=True,
        extra_body={"guided_regex": pattern},
    )
    assert re.fullmatch(pattern, "".join(chunk.choices[0].text for chunk in streamed if chunk.choices))


def test_grammar(client):
    grammar = 'root ::= "yes" | "no" | "it depends"'  # GBNF
    r = client.completions.create(
        model="tiny",
        prompt="Well?",
        max_tokens=20,
        temperature=1.0,
        seed=9,
        n=3,
        extra_body={"guided_grammar": grammar},
    )
    assert all(c.text in ("yes", "no", "it depends") for c in r.choices)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
        ({"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ],
)
def test_invalid_constraints_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "hi", extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_named_tool_call(client):
    r = chat(
        client,
        "Weather in Paris?",
        temperature=0.0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    # vLLM's call ids, as parsed calls have them (issue 35, item 14)
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop"

    streamed = chat(
        client,
        "Weather in Paris?",
        temperature=0.0,
        tools=[WEATHER, TIME],
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    names, arguments = [], ""
    for chunk in streamed:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [tc.function.name] if tc.function.name else []
            arguments += tc.function.arguments or ""
    assert names == ["get_weather"] and arguments == call.function.arguments


def test_required_tool_calls(client):
    """One call each (parallel_tool_calls false: a random model would go on adding calls)."""
    for stream in (False, True):
        r = chat(
            client,
            "Weather and time",
            temperature=1.0,
            seed=4,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            stream=stream,
        )
        if stream:
            calls = [tc for chunk in r if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []]
        else:
            assert r.choices[0].finish_reason == "tool_calls"
            calls = r.choices[0].message.tool_calls
        assert len(calls) == 1
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_none_is_a_plain_message(client):
    r = chat(client, "hello", temperature=0.0, max_tokens=8, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def test_the_stack_is_clean_afterwards(stack):
    """Every request above released its blocks (what the prefix cache keeps is not in use)."""
    deadline = time.time() + 10
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/metrics", timeout=10).read().decode()
        running = re.search(r"^pagoda:num_requests_running(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
        if running and float(running.group(1)) == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert running and float(running.group(1)) == 0
