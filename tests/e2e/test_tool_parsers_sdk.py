"""Automatic tool calls in every format, end to end with the official `openai` SDK (issue 28).

One `pagoda serve` of the tiny model (its own gateway serves `hermes`) and one `pagoda
gateway` per other parser on the same scheduler (`llama3_json`, `mistral`, `pythonic`),
each with `--enable-auto-tool-choice --tool-call-parser NAME` and a test chat template in
that family's syntax: the tools in a system turn, an assistant's calls as the model writes
them, a tool's result in the family's result turn. A random tiny model writes a call only
when made to, so each request is `tool_choice="auto"` with the call's text as the one
`guided_choice`; the gateway's parser, not the constraint, turns that text into calls.

Per parser: the call parsed unstreamed and streamed (finish_reason "tool_calls", no
content), then the call and its result sent back, accepted, and rendered by the template
(`/tokenize` and `/detokenize`). The tiny tokenizer has no special tokens for the markers
(`[TOOL_CALLS]`, `<|python_tag|>`): they are plain text here, so decoding them with special
tokens kept is left to the unit tests.
"""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass

import openai
import pytest
from support.stack import kill_tree, start_serve

from wiring.launcher import ServiceProcess, free_port, pagoda_command

MAX_MODEL_LEN = 512
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature_c": 22}'
LISTED = '"name": "get_weather", "description": "The weather in a city"'  # the tool, in every template

# Hermes (Qwen2.5, Qwen3): <tool_call> blocks; a result as <tool_response> in a user turn
HERMES = """\
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

# Llama 3.x's headers, for llama3_json and pythonic: the tools in the system turn, a result as
# an `ipython` turn; CALLS is how an assistant's calls are written
LLAMA = """\
{%- if tools -%}
<|start_header_id|>system<|end_header_id|>

INSTRUCTIONS
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>
{%- endif -%}
{%- for message in messages -%}
<|start_header_id|>{{ "ipython" if message.role == "tool" else message.role }}<|end_header_id|>

{% if message.tool_calls %}CALLS{% else %}{{ message.content }}{% endif %}<|eot_id|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start_header_id|>assistant<|end_header_id|>

{% endif -%}
"""
LLAMA3_JSON = LLAMA.replace(
    "INSTRUCTIONS", 'Call a function as {"name": function name, "parameters": its arguments}:'
).replace(
    "CALLS",
    '{% for call in message.tool_calls %}{% if not loop.first %}; {% endif %}{"name": '
    '"{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}',
)
PYTHONIC = LLAMA.replace("INSTRUCTIONS", "Call functions as [func_name1(param1=value1), func_name2(...)]:").replace(
    "CALLS",
    "[{% for call in message.tool_calls %}{% if not loop.first %}, {% endif %}{{ call.function.name }}("
    "{% for key, value in call.function.arguments.items() %}{% if not loop.first %}, {% endif %}"
    "{{ key }}={{ value | tojson }}{% endfor %}){% endfor %}]",
)

# Mistral v3 (7B Instruct v0.3, Nemo): [AVAILABLE_TOOLS], [TOOL_CALLS] with a JSON list, a
# result as [TOOL_RESULTS]; like Mistral's own templates it refuses call ids of other than 9 characters
MISTRAL = """\
{%- if tools -%}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}
{%- for message in messages -%}
{%- if message.role == "user" -%}[INST]{{ message.content }}[/INST]
{%- elif message.role == "tool" -%}
[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.tool_calls -%}[TOOL_CALLS][
{%- for call in message.tool_calls -%}
{%- if call.id | length != 9 %}{{ raise_exception("Tool call IDs should be 9 alphanumeric characters") }}{% endif -%}
{%- if not loop.first %}, {% endif -%}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}
{%- endfor -%}
]</s>
{%- else -%}{{ message.content }}</s>
{%- endif -%}
{%- endfor -%}
"""

VLLM_ID = r"chatcmpl-tool-[0-9a-f]{32}"


@dataclass(frozen=True)
class Format:
    template: str
    call: str  # what the model is made to write
    rendered: tuple[str, ...]  # in the second turn's prompt; @ID: the call's id
    call_id: str = VLLM_ID


FORMATS = {
    "hermes": Format(
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        (
            '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            "<|im_end|>",
            f"<tool_response>{RESULT}</tool_response>",
        ),
    ),
    "llama3_json": Format(
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        (
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            "<|eot_id|>",
            f"<|start_header_id|>ipython<|end_header_id|>\n\n{RESULT}<|eot_id|>",
        ),
    ),
    "mistral": Format(
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        (
            '[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "@ID"}]</s>',
            '[TOOL_RESULTS]{"content": ' + json.dumps(RESULT) + ', "call_id": "@ID"}[/TOOL_RESULTS]',
        ),
        call_id=r"[A-Za-z0-9]{9}",
    ),
    "pythonic": Format(
        PYTHONIC,
        "[get_weather(city='Paris')]",
        (
            '<|start_header_id|>assistant<|end_header_id|>\n\n[get_weather(city="Paris")]<|eot_id|>',
            f"<|start_header_id|>ipython<|end_header_id|>\n\n{RESULT}<|eot_id|>",
        ),
    ),
}


@pytest.fixture(scope="module")
def ports(model_factory, tmp_path_factory):
    """Parser name -> the port of its gateway: `pagoda serve`'s own for hermes, a `pagoda
    gateway` on the same scheduler for each other (started together, then waited for)."""
    logs = tmp_path_factory.mktemp("tool-parsers-logs")
    model = model_factory(arch="llama")
    for name, fmt in FORMATS.items():
        (logs / f"{name}.jinja").write_text(fmt.template)
    stack = start_serve(
        model,
        logs,
        "--num-kv-blocks",
        "128",
        "--num-threads",
        "1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--served-model-name",
        "tiny",
        *parser_flags(logs, "hermes"),
    )
    found, gateways = {"hermes": stack.port}, []
    try:
        for name in ("llama3_json", "mistral", "pythonic"):
            found[name], grpc_port = free_port(), free_port()
            gateways.append(
                ServiceProcess(
                    name,
                    pagoda_command(
                        "gateway",
                        "--model",
                        model,
                        "--scheduler",
                        stack.ready["scheduler"],
                        "--port",
                        str(found[name]),
                        "--grpc-port",
                        str(grpc_port),
                        "--max-model-len",
                        str(MAX_MODEL_LEN),
                        "--served-model-name",
                        "tiny",
                        *parser_flags(logs, name),
                    ),
                    f"127.0.0.1:{grpc_port}",
                    log_path=logs / f"gateway-{name}.log",
                )
            )
            gateways[-1].start()
        for gateway in gateways:
            gateway.wait_healthy(120)
        yield found
    finally:
        for gateway in gateways:
            kill_tree(gateway)  # the graceful drain is not tested here
        stack.stop()


def parser_flags(logs, name: str) -> list[str]:
    return ["--chat-template", str(logs / f"{name}.jinja"), "--enable-auto-tool-choice", "--tool-call-parser", name]


def sdk(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def ask(port: int, parser: str, **kwargs):
    """`tool_choice="auto"`, the model made to write the call's text (as the one choice)."""
    return sdk(port).chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=64,
        extra_body={"guided_choice": [FORMATS[parser].call]},
        **kwargs,
    )


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.load(urllib.request.urlopen(request, timeout=60))


@pytest.mark.parametrize("parser", FORMATS)
def test_the_call_parsed_and_its_result_rendered_back(ports, parser):
    choice = ask(ports[parser], parser).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    assert re.fullmatch(FORMATS[parser].call_id, call.id)

    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    second = sdk(ports[parser]).chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = post(ports[parser], "/tokenize", {"messages": messages, "tools": [WEATHER]})["tokens"]
    rendered = post(ports[parser], "/detokenize", {"tokens": tokens})["prompt"]
    for part in (LISTED, *FORMATS[parser].rendered):
        assert part.replace("@ID", call.id) in rendered
    assert second.usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize("parser", FORMATS)
def test_the_streamed_call_is_the_same_call(ports, parser):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(ports[parser], parser, stream=True):
        for c in chunk.choices:
            assert not c.delta.content  # the call's text is not content
            for piece in c.delta.tool_calls or ():
                entry = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
                entry["arguments"] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert re.fullmatch(FORMATS[parser].call_id, calls[0]["id"])
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == ("get_weather", {"city": "Paris"})
