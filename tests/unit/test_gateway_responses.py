"""`/v1/responses` (issue 28): the in-process app over a fake scheduler that answers chosen
text. A Responses request renders the very prompt its chat request would (the chat route's
templating), asks the same sampling (structured output, forced calls), reads the reply with
the same parsers; its objects and events parse as the official `openai` SDK's types, and a
stream puts back together (the SDK's own accumulator) into the response it ends with.
"""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_gateway_app import FakeGenerator, post
from test_gateway_auto_tools import REPLIES, ScriptedGenerator, config

from gateway.app import create_app
from gateway.config import ApiKey
from gateway.generation import GenerationError
from gateway.responses import ResponseStore, StoredResponse, input_messages, response_param

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
EVENTS = TypeAdapter(ResponseStreamEvent)


class Session:
    """One app over a generator, for a few requests."""

    def __init__(self, tokenizer, generator, **gateway_config) -> None:
        self.generator = generator
        self.app = create_app(config(tokenizer, **gateway_config), generator)

    def post(self, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
        return self._run(lambda client: post(client, path, body, headers))

    def get(self, path: str, headers: dict | None = None) -> httpx.Response:
        return self._run(lambda client: client.get(path, headers=headers))

    def _run(self, call) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw") as client:
                return await call(client)

        return asyncio.run(go())

    def create(self, body: dict, **headers) -> dict:
        response = self.post("/v1/responses", body, headers)
        assert response.status_code == 200, response.text
        Response.model_validate(response.json())  # the SDK's type, every field checked
        return response.json()

    def stream(self, body: dict) -> list[dict]:
        response = self.post("/v1/responses", {**body, "stream": True})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.text)

    def chat_prompt(self, body: dict) -> list[int]:
        response = self.post("/tokenize", body)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]


class RecordingGenerator(ScriptedGenerator):
    """`ScriptedGenerator` that also records each call's prompt (`prompts`; `calls`: params)."""

    def __init__(self, tokenizer, text: str) -> None:
        super().__init__(tokenizer, text)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
        self.prompts.append(list(prompt_ids))
        async for item in super().generate(prompt_ids, params, request_id, traceparent):
            yield item


def sse_events(text: str) -> list[dict]:
    """The stream's events, each checked: named by its type, and a valid SDK event."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    return events


def accumulated(events: list[dict], tools=()) -> object:
    """The final response that the SDK's `responses.stream()` makes of the events (its
    accumulator raises on an event for an item not added, or an item left unfinished)."""
    state = ResponseStreamState(input_tools=list(tools), text_format=omit)
    for event in events:
        state.handle_event(EVENTS.validate_python(event))
    return state._completed_response


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    from services.text import Tokenizer

    return Tokenizer(model_factory(arch="llama"))


def scripted(tokenizer, text: str, **gateway_config) -> Session:
    return Session(tokenizer, RecordingGenerator(tokenizer, text), **gateway_config)


# --- text, messages, instructions -----------------------------------------------------------


def test_a_text_input_is_a_user_message_and_the_reply_its_output_text(tokenizer):
    s = scripted(tokenizer, "It is sunny.")
    response = s.create({"model": "tiny", "input": "Weather?", "max_output_tokens": 20, "temperature": 0})
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert (response["status"], response["model"], response["incomplete_details"]) == ("completed", "tiny", None)
    [message] = response["output"]
    assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
    assert message["content"] == [{"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}]
    assert s.generator.prompts[0] == s.chat_prompt({"messages": [{"role": "user", "content": "Weather?"}]})
    usage = response["usage"]
    assert usage["input_tokens"] == len(s.generator.prompts[0]) and usage["output_tokens"] == 4
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    params = s.generator.calls[0]
    assert (params.sampling.max_tokens, params.sampling.temperature) == (20, 0.0)
    assert (response["max_output_tokens"], response["temperature"], response["text"]) == (
        20,
        0.0,
        {"format": {"type": "text"}},
    )


def test_messages_and_instructions_render_as_the_chat_request_would(tokenizer):
    s = scripted(tokenizer, "ok")
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather?"},
    ]
    s.create({"input": items, "instructions": "You are a weather bot."})
    assert s.generator.prompts[0] == s.chat_prompt(
        {
            "messages": [
                {"role": "system", "content": "You are a weather bot."},
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi\nthere"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Weather?"},
            ]
        }
    )


def test_max_output_tokens_reached_is_incomplete(tokenizer):
    generator = FakeGenerator(tokenizer)  # ends "length"
    s = Session(tokenizer, generator)
    response = s.create({"input": "Hi", "max_output_tokens": 2})
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert output_text(response) == "hello" and response["output"][-1]["status"] == "incomplete"
    events = s.stream({"input": "Hi", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["status"] == "incomplete"


# --- structured output and tools ------------------------------------------------------------


def test_a_json_schema_format_is_the_chat_routes_structured_output(tokenizer):
    s = scripted(tokenizer, '{"colour": "red"}')
    fmt = {"type": "json_schema", "name": "c", "schema": SCHEMA, "strict": True}
    response = s.create({"input": "A colour?", "text": {"format": fmt}})
    structured = s.generator.calls[0].sampling.structured
    assert (structured.kind, json.loads(structured.spec)) == ("json_schema", SCHEMA)
    assert json.loads(output_text(response)) == {"colour": "red"}
    assert response["text"] == {"format": fmt}
    s.create({"input": "JSON?", "text": {"format": {"type": "json_object"}}})
    assert s.generator.calls[1].sampling.structured.kind == "json_object"


@pytest.mark.parametrize("stream", [False, True])
def test_an_auto_tool_call_is_a_function_call_item(tokenizer, stream):
    s = scripted(tokenizer, REPLIES["hermes"][0], enable_auto_tool_choice=True, tool_call_parser="hermes")
    body = {"input": "Weather in Paris?", "tools": [WEATHER]}
    if stream:
        events = s.stream(body)
        response = events[-1]["response"]
        final = accumulated(events, [WEATHER])
        assert [item.type for item in final.output] == ["message", "function_call"]
        deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
        assert json.loads("".join(e["delta"] for e in deltas)) == {"city": "Paris"}
    else:
        response = s.create(body)
    message, call = response["output"]
    assert output_text(response) == "Let me look.\n" and message["status"] == "completed"
    assert (call["type"], call["name"], json.loads(call["arguments"]), call["status"]) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call["call_id"] and call["id"].startswith("fc_")
    assert response["tools"] == [WEATHER] and response["tool_choice"] == "auto"
    # the tools reach the template as chat's would
    assert s.generator.prompts[0] == s.chat_prompt(
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [CHAT_WEATHER]}
    )


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choices_are_forced_calls(tokenizer, stream):
    cases = [
        ("required", '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'),
        ({"type": "function", "name": "get_weather"}, '{"city": "Rome"}'),
    ]
    for choice, text in cases:
        s = scripted(tokenizer, text)
        body = {"input": "Weather in Rome?", "tools": [WEATHER], "tool_choice": choice}
        if stream:
            events = s.stream(body)
            response = events[-1]["response"]
            assert accumulated(events, [WEATHER]).output[0].arguments == '{"city": "Rome"}'
        else:
            response = s.create(body)
        [call] = response["output"]
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Rome"})
        assert s.generator.calls[0].sampling.structured.kind == "json_schema"


def test_a_tool_round_trip_renders_the_call_and_its_output(tokenizer):
    s = scripted(tokenizer, "It is 22 C.", enable_auto_tool_choice=True, tool_call_parser="hermes")
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_c": 22}'},
    ]
    response = s.create({"input": items, "tools": [WEATHER]})
    assert output_text(response) == "It is 22 C."
    assert s.generator.prompts[0] == s.chat_prompt(
        {
            "tools": [CHAT_WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 22}'},
            ],
        }
    )


def test_input_items_become_chat_messages():
    call = {
        "type": "function_call",
        "call_id": "c1",
        "name": "f",
        "arguments": "{}",
        "id": "fc_1",
        "status": "completed",
    }
    items = [
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier thoughts: not rendered back
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
        },
        call,
        {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ]
    chat_call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert input_messages(items) == [
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [{"id": "c1", **chat_call}, {"id": "c2", **chat_call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    assert input_messages([call])[0] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", **chat_call}],
    }
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_reasoning_is_a_reasoning_item(tokenizer):
    s = scripted(tokenizer, "<think>Paris is in France.</think>It is sunny.", reasoning_parser="deepseek_r1")
    response = s.create({"input": "Weather?"})
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "Paris is in France."}
    ]
    assert output_text(response) == "It is sunny."
    events = s.stream({"input": "Weather?"})
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == "Paris is in France."
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


# --- streaming ---------------------------------------------------------------------------------


def test_a_stream_is_the_responses_events_in_order_and_numbered(tokenizer):
    s = scripted(tokenizer, "It is sunny.")
    events = s.stream({"input": "Weather?"})
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas == 4
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"].endswith(".delta")) == "It is sunny."
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 4
    assert events[0]["response"]["id"] == final["id"] and events[0]["response"]["status"] == "in_progress"
    item_id = final["output"][0]["id"]
    assert all(e.get("item_id", item_id) == item_id for e in events)
    assert accumulated(events).output_text == "It is sunny."


def test_an_error_mid_stream_fails_the_response(tokenizer):
    import grpc

    generator = FakeGenerator(tokenizer)
    generator.error_mid_stream = GenerationError(grpc.StatusCode.UNAVAILABLE, "the pipeline is recovering")
    events = Session(tokenizer, generator).stream({"input": "Hi"})
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert events[-2]["code"] == "unavailable" and events[-1]["response"]["error"]["code"] == "server_error"
    assert "recovering" in events[-1]["response"]["error"]["message"]


# --- previous_response_id and the store ---------------------------------------------------------


def test_previous_response_id_continues_a_stored_response(tokenizer):
    s = scripted(tokenizer, "Sunny.")
    first = s.create({"input": "Weather?", "instructions": "Be brief."})
    second = s.create({"input": "And tomorrow?", "previous_response_id": first["id"]})
    assert second["previous_response_id"] == first["id"]
    # the first input and output before the new input; the first instructions not carried over
    assert s.generator.prompts[1] == s.chat_prompt(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "And tomorrow?"},
            ]
        }
    )
    # a streamed response is stored too, and continues the chain
    streamed = s.stream({"input": "And after?", "previous_response_id": second["id"]})[-1]["response"]
    s.create({"input": "Thanks", "previous_response_id": streamed["id"]})
    assert s.generator.prompts[3] == s.chat_prompt(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "And tomorrow?"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "And after?"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "Thanks"},
            ]
        }
    )
    got = s.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first


def test_an_unknown_previous_response_id_is_a_400_naming_it(tokenizer):
    s = scripted(tokenizer, "Sunny.")
    unstored = s.create({"input": "Hi", "store": False})
    for previous in ("resp_nope", unstored["id"]):
        response = s.post("/v1/responses", {"input": "Hi", "previous_response_id": previous})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "previous_response_id"
    assert s.get("/v1/responses/resp_nope").status_code == 404
    assert len(s.generator.calls) == 1


def test_stored_responses_belong_to_their_api_key(tokenizer):
    keys = {"key-a": ApiKey("a"), "key-b": ApiKey("b")}
    s = scripted(tokenizer, "Sunny.", api_keys=keys)
    first = s.create({"input": "Hi"}, authorization="Bearer key-a")
    assert s.get(f"/v1/responses/{first['id']}", {"authorization": "Bearer key-a"}).status_code == 200
    assert s.get(f"/v1/responses/{first['id']}", {"authorization": "Bearer key-b"}).status_code == 404
    other = s.post(
        "/v1/responses", {"input": "Hi", "previous_response_id": first["id"]}, {"authorization": "Bearer key-b"}
    )
    assert other.status_code == 400 and other.json()["error"]["param"] == "previous_response_id"
    assert s.post("/v1/responses", {"input": "Hi"}).status_code == 401
    deleted = s._run(lambda c: c.delete(f"/v1/responses/{first['id']}", headers={"authorization": "Bearer key-a"}))
    assert deleted.json()["deleted"] is True
    assert s.get(f"/v1/responses/{first['id']}", {"authorization": "Bearer key-a"}).status_code == 404


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, [], None))
    assert store.get("a", None) is not None  # a is now the most recent
    store.put(StoredResponse({"id": "c"}, [], None))
    assert (store.get("b", None), len(store)) == (None, 2)
    assert store.get("a", "someone") is None and store.get("a", None) is not None
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(0)


# --- refusals -----------------------------------------------------------------------------------

BAD = [
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [CHAT_WEATHER]}, "tools[0].function"),
    ({"input": "Hi", "tools": [{**WEATHER, "name": "bad name"}], "tool_choice": "required"}, "tools[0].name"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER]}, "tool_choice"),  # auto without --enable-auto-tool-choice
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": "Hi " * 300}, "input"),  # longer than the context
    ({"input": "Hi", "max_output_tokens": 1000}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "text.format.schema"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "Hi", "n": 2}, "n"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "guided_choice": []}, "guided_choice"),
    ({"input": "Hi", "guided_choice": ["a"], "text": {"format": {"type": "json_object"}}}, "guided_choice"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_a_400_naming_them_before_the_scheduler(tokenizer, body, param):
    s = Session(tokenizer, FakeGenerator(tokenizer))
    response = s.post("/v1/responses", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    assert s.generator.calls == []


def test_a_model_this_server_does_not_serve_is_a_404(tokenizer):
    response = Session(tokenizer, FakeGenerator(tokenizer)).post("/v1/responses", {"model": "gpt-4", "input": "Hi"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_chat_fields_are_named_as_the_responses_request_names_them():
    assert response_param("messages") == "input"
    assert response_param("messages[3].content[0]") == "input"
    assert response_param("max_completion_tokens") == "max_output_tokens"
    assert response_param("response_format.json_schema.schema") == "text.format.schema"
    assert response_param("tools[2].function.parameters") == "tools[2].parameters"
    assert response_param("tool_choice.function.name") == "tool_choice.name"
    assert response_param("guided_regex") == "guided_regex" and response_param(None) is None


def test_responses_are_charged_to_the_rate_limit(tokenizer):
    s = scripted(tokenizer, "Sunny.", rate_limit_rpm=1)
    s.create({"input": "Hi"})
    refused = s.post("/v1/responses", {"input": "Hi", "stream": True})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(s.generator.calls) == 1
