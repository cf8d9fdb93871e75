"""What a new user met in the gateway (issue 35, items 7, 8, 14, 15, 17; the adapters' items
5 and 16 are test_gateway_lora_names'), over the in-process app and test_gateway_app's fake
scheduler, which answers a scripted text:

7  a named tool_choice cut short by max_tokens is a tool call streamed or not (vLLM's shape);
8  a 400 names the request's own field: a forced tool's bad `parameters`, a temperature past
   what the wire carries;
14 forced calls' ids are vLLM's (`chatcmpl-tool-...`) as parsed ones, and their arguments are
   passed through as generated;
15 a text part without `text` says so;
17 Responses `metadata` keys and values are bounded as OpenAI bounds them (64 / 512).
"""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest
from test_gateway_app import MAX_MODEL_LEN, FakeGenerator, post

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.generation import ChoiceDelta, Finished, Usage
from services.text import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


class Scripted(FakeGenerator):
    """Answers every request with `text` in two deltas, finishing as `finish_reason`."""

    def __init__(self, tokenizer, text: str = "hello", finish_reason: str = "stop") -> None:
        super().__init__(tokenizer)
        self.text, self.finish_reason = text, finish_reason
        self.lora_calls: list[tuple[bool, str, str]] = []

    async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
        self.calls.append((list(prompt_ids), params, request_id))
        half = len(self.text) // 2
        yield ChoiceDelta(0, self.text[:half], [1])
        yield ChoiceDelta(0, self.text[half:], [2], finish_reason=self.finish_reason)
        yield Finished(Usage(len(prompt_ids), 2))

    async def lora_adapter(self, load: bool, name: str, path: str) -> None:
        self.lora_calls.append((load, name, path))


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


def session(tokenizer, requests, text="hello", finish_reason="stop"):
    """Each (method, path, body) in turn against one app: (responses, the fake scheduler)."""

    async def go():
        generator = Scripted(tokenizer, text, finish_reason)
        config = GatewayConfig(
            model=str(tokenizer.model_dir),
            scheduler_address="unused:1",
            max_model_len=MAX_MODEL_LEN,
            served_model_names=("tiny",),
            enable_lora=True,
            lora_modules=("sql=/adapters/sql",),
            allow_runtime_lora_updating=True,
        )
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(config, generator)), base_url="http://gateway"
        )
        out = []
        async with client:
            for method, path, body in requests:
                out.append(await (client.get(path) if method == "GET" else post(client, path, body)))
        return out, generator

    return asyncio.run(go())


def events(resp) -> list[dict]:
    return [
        json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


# --- 7 and 14: forced tool calls ------------------------------------------------------------


def test_a_named_call_cut_short_is_a_tool_call_streamed_or_not(tokenizer):
    named = {
        "messages": USER,
        "tools": [WEATHER_TOOL],
        "max_tokens": 4,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    (whole, streamed), _ = session(
        tokenizer,
        [("POST", "/v1/chat/completions", named), ("POST", "/v1/chat/completions", {**named, "stream": True})],
        text='{"city": "Pa',
        finish_reason="length",
    )
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    chunks = [c["choices"][0] for c in events(streamed) if c["choices"]]
    pieces = [d for c in chunks for d in c["delta"].get("tool_calls", ())]
    assert "".join(p["function"].get("arguments", "") for p in pieces) == '{"city": "Pa'
    assert chunks[-1]["finish_reason"] == "length"
    assert call["id"].startswith("chatcmpl-tool-") and pieces[0]["id"].startswith("chatcmpl-tool-")


def test_forced_calls_have_vllms_ids_and_their_arguments_as_generated(tokenizer):
    output = '[{"name": "get_weather", "parameters": {"city":  "Paris", "days": 2}}]'
    (required, named), _ = session(
        tokenizer,
        [
            ("POST", "/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "required"}),
            (
                "POST",
                "/v1/chat/completions",
                {
                    "messages": USER,
                    "tools": [WEATHER_TOOL],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                },
            ),
        ],
        text=output,
    )
    choice = required.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":  "Paris", "days": 2}'}
    assert call["id"].startswith("chatcmpl-tool-")
    assert named.json()["choices"][0]["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")


# --- 8: the request's own field in `param` ----------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {
                "messages": USER,
                "tool_choice": "required",
                "tools": [
                    WEATHER_TOOL,
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}},
                ],
            },
            "tools[1].function.parameters",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": USER,
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            },
            "tools[0].function.parameters",
        ),
        (
            "/v1/responses",
            {
                "input": "hi",
                "tool_choice": "required",
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],
            },
            "tools[0].parameters",
        ),
        ("/v1/responses", {"input": "hi", "temperature": 1e308}, "temperature"),
        ("/v1/chat/completions", {"messages": USER, "temperature": 1e308}, "temperature"),
        ("/v1/completions", {"prompt": "a", "temperature": 1e39}, "temperature"),
    ],
)
def test_a_400_names_the_requests_own_field(tokenizer, path, body, param):
    (resp,), generator = session(tokenizer, [("POST", path, body)])
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == param, error
    assert "sampling_params" not in error["message"] and "structured_output" not in error["message"]
    assert generator.calls == []  # refused before the scheduler


# --- 15: a text part without text -------------------------------------------------------------


def test_a_text_part_without_text_says_so(tokenizer):
    (missing, other), _ = session(
        tokenizer,
        [
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            (
                "POST",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            ),
        ],
    )
    error = missing.json()["error"]
    assert missing.status_code == 400 and error["param"] == "messages[0].content[0].text"
    assert "needs its text" in error["message"] and "only text parts" not in error["message"]
    assert (
        other.status_code == 400
        and "only text parts are supported, got type 'image_url'" in (other.json()["error"]["message"])
    )


# --- 17: Responses metadata bounds -------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata, ok", [({"k" * 64: "v" * 512}, True), ({"k" * 65: "v"}, False), ({"k": "v" * 513}, False)]
)
def test_responses_metadata_is_bounded_as_openais(tokenizer, metadata, ok):
    (resp,), _ = session(
        tokenizer, [("POST", "/v1/responses", {"input": "hi", "metadata": metadata, "max_output_tokens": 2})]
    )
    if ok:
        assert resp.status_code == 200 and resp.json()["metadata"] == metadata
    else:
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "metadata", resp.json()
