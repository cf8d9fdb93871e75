"""Every recipe of docs/clients.md marked `<!-- run -->` runs against a live `pagoda serve`
(the tiny model served under the name `make run` serves the default model as, so that each
recipe runs as a user copies it: issue 35, item 9), with the documented ports replaced by
the test's.

The stack serves automatic tool calls (`--enable-auto-tool-choice --tool-call-parser
hermes`) through a test chat template that renders tools, calls and their results in
Hermes' syntax, for the agent-loop recipe and for the round trip with the official `openai`
SDK below, where the tiny model is made to write a call through structured output, with
chat completions and with the Responses API (`client.responses.create` and `.stream`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
from support.stack import kill_tree

from wiring.launcher import ServiceProcess, free_port, pagoda_command
from wiring.model_source import DEFAULT_MODEL_NAME

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
BLOCK = re.compile(r"<!-- run -->\n```(bash|python)\n(.*?)```", re.S)
RECIPES = [(lang, code) for lang, code in BLOCK.findall(DOC.read_text())]
MODEL = DEFAULT_MODEL_NAME  # what `make run` serves, and so what every recipe names
# a model named in a recipe: "model": "X", model="X", model=X, (LiteLLM's) model="openai/X"
NAMED = re.compile(r"""\bmodel["']?\s*[:=]\s*["']?(?:openai/)?([A-Za-z0-9_./-]+)""")


# Hermes' format (Qwen2.5, Qwen3), compact: the tools in a system turn, an assistant's calls as
# <tool_call> blocks, a tool's result as a <tool_response> in a user turn
TOOLS_TEMPLATE = """\
{%- if tools -%}
<|im_start|>system
Tools:{% for tool in tools %}{{ "\\n" }}{{ tool.function | tojson }}{% endfor %}
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == "tool" -%}
<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}{% for call in message.tool_calls or [] -%}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def test_the_doc_has_its_recipes():
    assert [lang for lang, _ in RECIPES].count("python") >= 5 and len(RECIPES) >= 7


def test_every_recipe_names_the_model_make_run_serves():
    """Copied as written against `make run`, no recipe may get a 404 for its model's name."""
    code = "\n".join(re.findall(r"```(?:bash|python)\n(.*?)```", DOC.read_text(), re.S))
    named = NAMED.findall(code)
    assert len(named) >= 10 and set(named) == {MODEL}, sorted(set(named))


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("clients-stack-logs")
    template = logs / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    port, grpc_port = free_port(), free_port()
    serve = ServiceProcess(
        "serve",
        pagoda_command(
            "serve",
            model_factory(arch="llama"),
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--num-kv-blocks",
            "128",
            "--num-threads",
            "1",
            "--max-model-len",
            "512",
            "--served-model-name",
            MODEL,
            "--log-dir",
            str(logs),
            "--chat-template",
            str(template),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
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
    yield port, grpc_port
    kill_tree(serve)  # the graceful drain is not tested here (3-7 s a stack)


@pytest.mark.parametrize(("lang", "code"), RECIPES, ids=[f"{i}-{lang}" for i, (lang, _) in enumerate(RECIPES)])
def test_recipe_runs(stack, lang, code, tmp_path):
    port, grpc_port = stack
    code = code.replace("localhost:8000", f"127.0.0.1:{port}").replace("localhost:50051", f"127.0.0.1:{grpc_port}")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(tmp_path),
    }  # no user configuration of any client library leaks in
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), done.stderr


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# a random tiny model writes a call only when made to: the one choice it may write is the call
FORCED = {"guided_choice": [CALL]}


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.load(urllib.request.urlopen(request, timeout=60))


def test_auto_tool_calls_round_trip_with_the_openai_sdk(stack):
    """tool_choice "auto": the reply parsed into calls, unstreamed and streamed; the call and
    its result rendered back through the template in the second turn."""
    port, _ = stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=100, extra_body=FORCED
    ).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )

    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=100, stream=True, extra_body=FORCED
    ):
        for c in chunk.choices:
            assert not c.delta.content  # the call is not content
            for piece in c.delta.tool_calls or ():
                entry = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
                entry["arguments"] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["id"]
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == ("get_weather", {"city": "Paris"})

    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 22}'},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = _post(port, "/tokenize", {"messages": messages, "tools": [WEATHER]})["tokens"]
    rendered = _post(port, "/detokenize", {"tokens": tokens})["prompt"]
    assert '{"name": "get_weather", "description": "The weather in a city"' in rendered
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in rendered
    assert '<tool_response>{"temperature_c": 22}</tool_response>' in rendered
    assert second.usage.prompt_tokens == len(tokens)


# Responses' flat function tool; the same function as WEATHER
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}
COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}},
    "required": ["colour"],
    "additionalProperties": False,
}


def test_the_responses_api_with_the_openai_sdk(stack):
    """`client.responses.create`, unstreamed and streamed: text, messages, instructions, a
    json_schema format and a tool (the tiny model made to write the call), the call's output
    sent back with previous_response_id and rendered as chat renders it."""
    port, _ = stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "input_text", "text": "A story?"}]},
    ]
    whole = client.responses.create(
        model=MODEL, input=messages, instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens > 0
    tokens = _post(
        port,
        "/tokenize",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                *messages[:2],
                {"role": "user", "content": "A story?"},
            ]
        },
    )["tokens"]
    assert whole.usage.input_tokens == len(tokens)
    events = list(
        client.responses.create(
            model=MODEL, input=messages, instructions="Be brief.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == whole.output_text  # greedy: the same text

    shaped = client.responses.create(
        model=MODEL,
        input="A colour?",
        max_output_tokens=20,
        text={"format": {"type": "json_schema", "name": "colour", "schema": COLOUR, "strict": True}},
    )
    assert json.loads(shaped.output_text)["colour"] in ("red", "green")

    called = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[RESPONSES_WEATHER],
        max_output_tokens=100,
        extra_body=FORCED,
    )
    [call] = called.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[RESPONSES_WEATHER],
        max_output_tokens=100,
        extra_body=FORCED,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == [
        ("function_call", "get_weather", {"city": "Paris"})
    ]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 22}'}
    second = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[result],
        tools=[RESPONSES_WEATHER],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert second.previous_response_id == called.id and second.status in ("completed", "incomplete")
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.arguments},
    }
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature_c": 22}'},
    ]
    tokens = _post(port, "/tokenize", {"messages": turn, "tools": [WEATHER]})["tokens"]
    assert second.usage.input_tokens == len(tokens)
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, previous_response_id="resp_unknown", input="Hi")
