"""Automatic tool calls and reasoning output in chat completions (issue 28): the in-process
app over a fake scheduler that answers chosen text, with `--enable-auto-tool-choice
--tool-call-parser NAME` and `--reasoning-parser NAME`; each parser's recorded format
unstreamed and streamed (cut into small deltas), reasoning split, `include_reasoning`, n > 1
with logprobs, and the markers that are special tokens kept through the real detokenizer.
"""

from __future__ import annotations

import json
import shutil

import httpx2 as httpx
import pytest
from support.scripted_call import ScriptedCall, script_scheduler
from test_gateway_app import post, run

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.core import TextGenerator
from gateway.generation import ChoiceDelta, Finished, TokenLogprob, Usage
from gateway.parsers import TOOL_CALL_PARSERS
from services.pb import common_pb2, scheduler_pb2
from services.text import Tokenizer
from wiring.cli import build_parser, main

MAX_MODEL_LEN = 256
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# a call's arguments as the model wrote them (issue 35, item 14); pythonic calls, which are not
# JSON, as compact JSON
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
PARSED = {parser: PARIS for parser in ("hermes", "llama3_json", "mistral", "openai")} | {
    "pythonic": {"name": "get_weather", "arguments": '{"city":"Paris"}'}
}
# each parser's format as its models write it (content before the call where the format has any)
REPLIES = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me look.\n",
    ),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None),
    "pythonic": ("[get_weather(city='Paris')]", None),
    # gpt-oss (Harmony): a preamble, then the call
    "openai": (
        "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        "Let me look.",
    ),
}
TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


class ScriptedGenerator:
    """`TextGenerator`'s interface: each choice's reply is `text`, in deltas of `size`
    characters (one token each, with a logprob when asked), ending "stop"."""

    def __init__(self, tokenizer: Tokenizer, text: str, size: int = 3) -> None:
        self.tokenizer, self.max_model_len = tokenizer, MAX_MODEL_LEN
        self.pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        self.calls: list = []

    async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
        self.calls.append(params)
        for i in range(params.sampling.n):
            for k, piece in enumerate(self.pieces):
                lps = [TokenLogprob(k, piece, -0.5)] if params.sampling.logprobs is not None else []
                yield ChoiceDelta(i, piece, [k], lps, "stop" if k == len(self.pieces) - 1 else None)
        yield Finished(Usage(len(prompt_ids), len(self.pieces) * params.sampling.n))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The flags' defaults read PAGODA_* when the parser is built: none but the test's."""
    import os

    for name in [
        n for n in os.environ if n.startswith("PAGODA_") and n not in ("PAGODA_INTERNAL_TOKEN", "PAGODA_AUTO_DTYPE")
    ]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


def config(tokenizer, **parsers) -> GatewayConfig:
    return GatewayConfig(
        model=str(tokenizer.model_dir),
        scheduler_address="unused:1",
        max_model_len=MAX_MODEL_LEN,
        served_model_names=("tiny",),
        **parsers,
    )


def chat(tokenizer, text: str, body: dict, **parsers):
    """The response to one chat request whose replies are `text`: JSON, or the stream's chunks."""

    async def go():
        app = create_app(config(tokenizer, **parsers), ScriptedGenerator(tokenizer, text))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return await post(client, "/v1/chat/completions", {"messages": ASK, "max_tokens": 50, **body})

    response = run(go())
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return response.json()
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def streamed(chunks: list[dict], index: int = 0) -> dict:
    """One choice's stream put back together: reasoning, content, calls (id and name once,
    arguments joined) and the last finish reason."""
    out: dict = {"reasoning_content": "", "content": "", "calls": {}, "finish_reason": None}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            out["reasoning_content"] += delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", ()):
                entry = out["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                if "id" in call:
                    assert "id" not in entry and call["type"] == "function"
                    entry["id"], entry["name"] = call["id"], call["function"]["name"]
                entry["arguments"] += call["function"]["arguments"]
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def functions(calls) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


AUTO = {"enable_auto_tool_choice": True}


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_each_parsers_calls_come_back_unstreamed_as_openai_tool_calls(tokenizer, parser):
    text, content = REPLIES[parser]
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        choice = chat(tokenizer, text, body, tool_call_parser=parser, **AUTO)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert (message["role"], message["content"]) == ("assistant", content)
        assert functions(message["tool_calls"]) == [PARSED[parser]]
        assert message["tool_calls"][0]["type"] == "function" and message["tool_calls"][0]["id"]
        assert "reasoning_content" not in message  # no reasoning parser


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_each_parsers_calls_stream_as_tool_call_deltas(tokenizer, parser):
    text, content = REPLIES[parser]
    chunks = chat(tokenizer, text, {"tools": [WEATHER], "stream": True}, tool_call_parser=parser, **AUTO)
    got = streamed(chunks)
    assert got["finish_reason"] == "tool_calls" and got["content"] == (content or "")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in got["calls"].values()] == [PARSED[parser]]
    assert all(c["id"] for c in got["calls"].values())
    # nothing of the call's text leaks into the content
    assert not any("Paris" in (ch["choices"][0]["delta"].get("content") or "") for ch in chunks if ch["choices"])


def test_a_reply_without_a_call_is_plain_content_and_finishes_as_it_ended(tokenizer):
    reply = chat(tokenizer, "It is sunny.", {"tools": [WEATHER]}, tool_call_parser="hermes", **AUTO)
    choice = reply["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"
    got = streamed(
        chat(tokenizer, "It is sunny.", {"tools": [WEATHER], "stream": True}, tool_call_parser="hermes", **AUTO)
    )
    assert (got["content"], got["calls"], got["finish_reason"]) == ("It is sunny.", {}, "stop")


def test_parallel_calls_and_parallel_tool_calls_false(tokenizer):
    both = chat(tokenizer, TWO_CALLS, {"tools": [WEATHER, TIME]}, tool_call_parser="hermes", **AUTO)
    assert functions(both["choices"][0]["message"]["tool_calls"]) == [PARIS, {"name": "get_time", "arguments": "{}"}]
    ids = [c["id"] for c in both["choices"][0]["message"]["tool_calls"]]
    assert len(set(ids)) == 2
    got = streamed(
        chat(tokenizer, TWO_CALLS, {"tools": [WEATHER, TIME], "stream": True}, tool_call_parser="hermes", **AUTO)
    )
    assert sorted(got["calls"]) == [0, 1] and got["calls"][1]["name"] == "get_time"
    first = chat(
        tokenizer,
        TWO_CALLS,
        {"tools": [WEATHER, TIME], "parallel_tool_calls": False},
        tool_call_parser="hermes",
        **AUTO,
    )
    assert functions(first["choices"][0]["message"]["tool_calls"]) == [PARIS]


def test_tool_choice_none_and_no_tools_are_not_parsed(tokenizer):
    text = REPLIES["hermes"][0]
    for body in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        choice = chat(tokenizer, text, body, tool_call_parser="hermes", **AUTO)["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": text}
        assert choice["finish_reason"] == "stop"


def test_auto_without_the_flag_is_a_400_naming_it(tokenizer):
    async def go(body, **parsers):
        app = create_app(config(tokenizer, **parsers), ScriptedGenerator(tokenizer, "x"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return await post(client, "/v1/chat/completions", {"messages": ASK, **body})

    # a parser alone does not enable "auto" (as vLLM: --enable-auto-tool-choice says so)
    for parsers in ({}, {"tool_call_parser": "hermes"}):
        for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
            response = run(go(body, **parsers))
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "tool_choice"
            assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]


def test_auto_tool_choice_without_a_parser_is_refused_at_start(tokenizer, capsys, model_factory, tmp_path):
    with pytest.raises(ValueError, match="enable_auto_tool_choice: needs --tool-call-parser"):
        config(tokenizer, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser: must be one of"):
        config(tokenizer, tool_call_parser="nope")
    model = shutil.copytree(model_factory(arch="llama"), tmp_path / "model")
    code = main(["serve", str(model), "--port", "0", "--grpc-port", "0", "--enable-auto-tool-choice"])
    err = capsys.readouterr().err
    assert code == 2 and "--enable-auto-tool-choice: needs --tool-call-parser NAME" in err, err


def test_serve_passes_the_parser_flags_to_its_gateway():
    from wiring.serve import passed_flags

    args = build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1"]
    )
    assert passed_flags(args, "gateway") == [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "mistral",
        "--reasoning-parser",
        "deepseek_r1",
    ]
    assert passed_flags(args, "scheduler") == passed_flags(args, "worker") == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])


# --- reasoning ---------------------------------------------------------------------------------

THOUGHT = "<think>Paris is in France.</think>It is sunny."


def test_reasoning_is_split_from_the_content_unstreamed_and_streamed(tokenizer):
    message = chat(tokenizer, THOUGHT, {}, reasoning_parser="deepseek_r1")["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Paris is in France."
    assert message["content"] == "It is sunny."
    got = streamed(chat(tokenizer, THOUGHT, {"stream": True}, reasoning_parser="deepseek_r1"))
    assert (got["reasoning_content"], got["content"], got["finish_reason"]) == (
        "Paris is in France.",
        "It is sunny.",
        "stop",
    )
    # qwen3: a reply that does not open <think> is all content
    plain = chat(tokenizer, "It is sunny.", {}, reasoning_parser="qwen3")["choices"][0]["message"]
    assert (plain["reasoning_content"], plain["content"]) == (None, "It is sunny.")


def test_include_reasoning_false_drops_the_reasoning(tokenizer):
    body = {"include_reasoning": False}
    message = chat(tokenizer, THOUGHT, body, reasoning_parser="deepseek_r1")["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is sunny."}
    chunks = chat(tokenizer, THOUGHT, {**body, "stream": True}, reasoning_parser="deepseek_r1")
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks if c["choices"])
    assert streamed(chunks)["content"] == "It is sunny."


def test_a_model_that_thinks_then_calls_gives_both(tokenizer):
    text = "<think>I need the weather.</think>" + REPLIES["hermes"][0]
    parsers = {"tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1", **AUTO}
    choice = chat(tokenizer, text, {"tools": [WEATHER]}, **parsers)["choices"][0]
    assert choice["message"]["reasoning_content"] == "I need the weather."
    assert choice["message"]["content"] == "Let me look.\n"
    assert functions(choice["message"]["tool_calls"]) == [PARIS] and choice["finish_reason"] == "tool_calls"
    got = streamed(chat(tokenizer, text, {"tools": [WEATHER], "stream": True}, **parsers))
    assert got["reasoning_content"] == "I need the weather." and got["content"] == "Let me look.\n"
    assert [c["name"] for c in got["calls"].values()] == ["get_weather"]


def test_structured_output_is_not_split_into_reasoning(tokenizer):
    """A grammar holds the output from its first token: it has no thinking part (a forced
    call or a JSON answer would otherwise be read as unfinished reasoning)."""
    body = {"response_format": {"type": "json_object"}}
    message = chat(tokenizer, '{"a": 1}', body, reasoning_parser="deepseek_r1")["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"a": 1}'}
    forced = chat(
        tokenizer,
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
        {"tools": [WEATHER], "tool_choice": "required"},
        reasoning_parser="deepseek_r1",
    )
    assert forced["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# --- n > 1 and logprobs ------------------------------------------------------------------------


def test_each_choice_is_parsed_on_its_own_with_its_logprobs(tokenizer):
    text = "<think>hm</think>" + REPLIES["hermes"][0]
    parsers = {"tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1", **AUTO}
    body = {"tools": [WEATHER], "n": 2, "logprobs": True}
    reply = chat(tokenizer, text, body, **parsers)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for choice in reply["choices"]:
        assert functions(choice["message"]["tool_calls"]) == [PARIS]
        assert choice["message"]["reasoning_content"] == "hm"
        assert "".join(e["token"] for e in choice["logprobs"]["content"]) == text
    chunks = chat(tokenizer, text, {**body, "stream": True}, **parsers)
    for index in (0, 1):
        got = streamed(chunks, index)
        assert (got["reasoning_content"], got["finish_reason"]) == ("hm", "tool_calls")
        assert [c["name"] for c in got["calls"].values()] == ["get_weather"]
        # every token's logprob is sent, held text or not
        tokens = [
            e["token"]
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == index and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]
        ]
        assert "".join(tokens) == text


# --- markers that are special tokens, through the real detokenizer -----------------------------


@pytest.fixture(scope="module")
def marker_tokenizer(model_factory, tmp_path_factory):
    """The tiny model's tokenizer with `[TOOL_CALLS]` (and another token) made special, as
    Mistral's tokenizer has it."""
    model_dir = tmp_path_factory.mktemp("markers") / "tiny"
    shutil.copytree(model_factory(arch="llama"), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    path.write_text(json.dumps({**tok_config, "additional_special_tokens": ["[TOOL_CALLS]", "[OTHER]"]}))
    return Tokenizer(model_dir)


class _Scheduler:
    """Answers each choice with `token_ids`, one token per response, then EOS."""

    def __init__(self, token_ids: list[int], eos: int) -> None:
        self.token_ids, self.eos = token_ids, eos

    def Generate(self, request, metadata=None):  # noqa: N802 (gRPC's spelling)
        ids = [*self.token_ids, self.eos]
        responses = []
        for index in range(request.sampling_params.n or 1):
            for k, token in enumerate(ids):
                resp = scheduler_pb2.GenerateResponse(request_id=request.request_id, index=index, token_ids=[token])
                if k == len(ids) - 1:
                    resp.finish_reason, resp.stop_token_id = common_pb2.FINISH_REASON_STOP, token
                responses.append(resp)
        responses[-1].usage.num_prompt_tokens = len(request.prompt_token_ids)
        return ScriptedCall(responses)


def test_a_marker_that_is_a_special_token_is_decoded_for_the_parser_and_no_other_leaks(marker_tokenizer):
    tok = marker_tokenizer
    marker, other = tok.token_to_id("[TOOL_CALLS]"), tok.token_to_id("[OTHER]")
    assert {marker, other} <= tok.special_token_ids
    ids = [
        *tok.encode("Sure", add_special_tokens=False),
        other,
        marker,
        *tok.encode('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', add_special_tokens=False),
    ]

    def ask(body, **parsers):
        async def go():
            generator = TextGenerator("127.0.0.1:1", tok, MAX_MODEL_LEN)
            script_scheduler(generator, _Scheduler(ids, tok.eos_token_ids[0]))
            app = create_app(config(tok, **parsers), generator)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
                return await post(
                    client, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "max_tokens": 60, **body}
                )

        response = run(go())
        assert response.status_code == 200, response.text
        return response

    message = ask({}, tool_call_parser="mistral", **AUTO).json()["choices"][0]["message"]
    assert functions(message["tool_calls"]) == [PARIS]
    assert message["content"] == "Sure"  # [OTHER], a special token, is still skipped
    stream = ask({"stream": True}, tool_call_parser="mistral", **AUTO).text
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    got = streamed(events)
    assert (got["content"], got["finish_reason"]) == ("Sure", "tool_calls")
    assert [c["name"] for c in got["calls"].values()] == ["get_weather"]
    # without parsing, special tokens are skipped as before
    plain = ask({"tool_choice": "none"}, tool_call_parser="mistral", **AUTO).json()["choices"][0]["message"]
    assert plain["content"] == 'Sure[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
