"""What a new user met on the real model (issue 28), over the in-process gateway and its fake
scheduler (test_gateway_app's): the tool round trip, abandoned requests in the metrics, a
tool without parameters, vLLM's API details (stop_reason on EOS, 404 for an unknown model,
continue_final_message, why a body does not parse) and latency buckets past 80 s.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx2 as httpx
import jsonschema
import pytest
from support.scripted_call import ScriptedCall, script_scheduler
from test_gateway_app import FakeGenerator, post, run

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.core import TextGenerator
from gateway.generation import ChoiceDelta, Finished, GenerationParams
from gateway.grpc_api import response_from_delta
from gateway.metrics import GatewayMetrics
from gateway.tools import tool_calling
from scheduler_svc.metrics import SchedulerMetrics
from services import grammar
from services.pb import common_pb2, scheduler_pb2
from services.sampling import SamplingOptions
from services.text import Tokenizer

# SmolLM2's template (the default model's): it concatenates the content, so a message
# without one failed with "'dict object' has no attribute 'content'"
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template that shows what it is given of tool calls (arguments as an object, as
# transformers' and vLLM's templates expect them) and of tool answers.
TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] | trim }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% if m.tool_call_id is defined %}#{{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}"
)
MAX_MODEL_LEN = 256
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


@pytest.fixture(scope="module")
def with_template(model_factory, tmp_path_factory):
    """The tiny model's tokenizer under another chat template."""

    def make(template: str) -> Tokenizer:
        model_dir = tmp_path_factory.mktemp("template") / "tiny"
        shutil.copytree(model_factory(arch="llama"), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        return Tokenizer(model_dir)

    return make


def make_app(tokenizer, generator):
    config = GatewayConfig(
        model=str(tokenizer.model_dir),
        scheduler_address="unused:1",
        max_model_len=MAX_MODEL_LEN,
        served_model_names=("tiny",),
    )
    return create_app(config, generator)


def posts(tokenizer, requests):
    """Each (path, body) posted in turn to one app: (responses, the fake scheduler)."""

    async def go():
        generator = FakeGenerator(tokenizer)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=make_app(tokenizer, generator)), base_url="http://gateway"
        )
        async with client:
            return [await post(client, path, body) for path, body in requests], generator

    return run(go())


def prompt_text(tokenizer: Tokenizer, generator) -> str:
    return tokenizer.decode(generator.calls[-1][0], skip_special_tokens=False)


# --- 1. the tool round trip ------------------------------------------------------------------


def test_a_tool_round_trip_renders_null_and_missing_content_as_empty(with_template):
    tok = with_template(SMOLLM2_TEMPLATE)
    null_content = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
        {"role": "user", "content": None},
    ]
    no_content = [null_content[0], {"role": "assistant", "tool_calls": [CALL]}, null_content[2]]
    (first, second), generator = posts(
        tok,
        [
            ("/v1/chat/completions", {"messages": null_content, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": no_content, "max_tokens": 2}),
        ],
    )
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    turns = "<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n22C<|im_end|>\n"
    assert tok.decode(generator.calls[0][0], skip_special_tokens=False) == (
        system + turns + "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(generator.calls[1][0], skip_special_tokens=False) == (system + turns + "<|im_start|>assistant\n")


def test_tool_calls_and_the_tool_call_id_reach_the_template(with_template):
    tok = with_template(TOOLS_TEMPLATE)
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [CALL, {**CALL, "function": {"name": "now", "arguments": ""}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]
    (chat, tokenized), generator = posts(
        tok,
        [
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
            ("/tokenize", {"messages": messages, "add_generation_prompt": False}),
        ],
    )
    assert chat.status_code == 200, chat.text
    expected = 'user:Weather?\nassistant:[get_weather {"city": "Paris"}][now {}]\ntool:22C#call_1\n'
    assert prompt_text(tok, generator) == expected
    assert tokenized.json()["tokens"] == generator.calls[-1][0]


# --- 2. a client that leaves -----------------------------------------------------------------


class HangingGenerator:
    """Each choice's first 3 tokens, then nothing ever again (the client leaves meanwhile)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.max_model_len = tokenizer, MAX_MODEL_LEN
        self.hanging = asyncio.Event()
        self.closed = False

    async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
        try:
            for i in range(params.sampling.n):
                yield ChoiceDelta(i, "abc", [5, 6, 7])
            self.hanging.set()
            await asyncio.Event().wait()
        finally:
            self.closed = True

    async def health(self, timeout_s: float = 2.0):
        return True, ""

    async def stats(self, **_):
        raise RuntimeError("no scheduler")


async def _leave_after_the_tokens(app, generator: HangingGenerator, body: dict) -> None:
    """One request through the ASGI app whose client disconnects once the generator hangs."""
    payload = json.dumps(body).encode()
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await generator.hanging.wait()
        await asyncio.sleep(0.05)  # the deltas reach the response first
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("gateway", 80),
        "client": ("c", 1),
        "root_path": "",
    }
    await asyncio.wait_for(app(scope, receive, send), 10)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_counts_as_aborted_with_its_tokens(tokenizer, stream):
    async def go():
        generator = HangingGenerator(tokenizer)
        app = make_app(tokenizer, generator)
        await _leave_after_the_tokens(
            app, generator, {"prompt": [5, 6, 7, 8], "n": 2, "max_tokens": 20, "stream": stream}
        )
        return app.state.gateway.metrics.registry, generator

    registry, generator = run(go())
    assert generator.closed  # the scheduler call was cancelled
    value = registry.get_sample_value
    labels = {"model_name": "tiny"}
    assert value("pagoda:request_success_total", {**labels, "finished_reason": "abort"}) == 2
    assert value("pagoda:generation_tokens_total", labels) == 6
    assert value("pagoda:prompt_tokens_total", labels) == 4
    assert value("pagoda:e2e_request_latency_seconds_count", labels) == 1
    assert value("pagoda:api_requests_in_flight", labels) == 0


def test_a_closed_stream_counts_once_and_a_finished_one_is_not_aborted():
    """The gRPC API's path: the timer's context, closed after some deltas or after the end."""
    metrics = GatewayMetrics("m")

    async def stream(finish: bool):
        with metrics.serving(num_choices=2, num_prompt_tokens=3) as timer:
            timer.on_delta((0, 0), 2, "stop" if finish else None)
            yield
            timer.on_delta((0, 1), 1, "length" if finish else None)
            if finish:
                timer.on_finished(3, 3)
            yield

    async def go():
        for finish in (False, True):
            items = stream(finish)
            await anext(items)
            if finish:
                await anext(items)
            await items.aclose()

    run(go())
    value = metrics.registry.get_sample_value
    assert value("pagoda:request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 2
    assert value("pagoda:request_success_total", {"model_name": "m", "finished_reason": "stop"}) == 1
    assert value("pagoda:generation_tokens_total", {"model_name": "m"}) == 2 + 3
    assert value("pagoda:e2e_request_latency_seconds_count", {"model_name": "m"}) == 2


# --- 4. a tool without parameters ------------------------------------------------------------


def test_a_tool_without_parameters_takes_exactly_no_arguments():
    tools = [
        {"type": "function", "function": {"name": "now"}},
        {"type": "function", "function": {"name": "wait", "parameters": None}},
    ]
    _, required = tool_calling(tools, "required")
    _, named = tool_calling(tools, {"type": "function", "function": {"name": "now"}})
    for spec in (required, named):
        grammar.check(spec)
    calls, arguments = json.loads(required.spec), json.loads(named.spec)
    jsonschema.validate([{"name": "now", "parameters": {}}, {"name": "wait", "parameters": {}}], calls)
    jsonschema.validate({}, arguments)
    for bad in ([{"name": "now", "parameters": {"x": 1}}], [{"name": "wait", "parameters": {"a": []}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, calls)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": "y"}, arguments)


# --- 7. vLLM's API ---------------------------------------------------------------------------


class _Scheduler:
    """A stub whose `Generate` answers one choice ending on `stop_token_id`."""

    def __init__(self, stop_token_id: int) -> None:
        self.stop_token_id = stop_token_id

    def Generate(self, request, metadata=None):  # noqa: N802 (gRPC's spelling)
        resp = scheduler_pb2.GenerateResponse(
            request_id=request.request_id,
            token_ids=[70, self.stop_token_id],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            stop_token_id=self.stop_token_id,
        )
        resp.usage.num_prompt_tokens, resp.usage.num_completion_tokens = 2, 2
        return ScriptedCall([resp])


def test_stop_reason_is_null_for_eos_and_names_a_requested_stop_token(tokenizer):
    eos = tokenizer.eos_token_ids[0]

    def last_delta(stop_token_id: int, stop_token_ids: tuple[int, ...]) -> ChoiceDelta:
        generator = TextGenerator("127.0.0.1:1", tokenizer, MAX_MODEL_LEN)
        script_scheduler(generator, _Scheduler(stop_token_id))
        params = GenerationParams(sampling=SamplingOptions(max_tokens=4, stop_token_ids=stop_token_ids))

        async def go():
            return [item async for item in generator.generate([1, 2], params, "r")]

        items = run(go())
        assert isinstance(items[-1], Finished)
        return items[-2]

    on_eos, on_requested = last_delta(eos, ()), last_delta(9, (9,))
    assert (on_eos.finish_reason, on_eos.stop_reason) == ("stop", None)
    assert (on_requested.finish_reason, on_requested.stop_reason) == ("stop", 9)
    # the public gRPC API still names the token that stopped it, EOS included
    assert response_from_delta("r", on_eos).choices[0].stop_token_id == eos
    assert response_from_delta("r", on_requested).choices[0].stop_token_id == 9


def test_an_unknown_model_is_404_model_not_found(tokenizer):
    chat = [{"role": "user", "content": "hi"}]
    responses, generator = posts(
        tokenizer,
        [
            ("/v1/completions", {"prompt": "a", "model": "gpt-4"}),
            ("/v1/chat/completions", {"messages": chat, "model": "gpt-4"}),
            ("/tokenize", {"prompt": "a", "model": "gpt-4"}),
            ("/detokenize", {"tokens": [1], "model": "gpt-4"}),
        ],
    )
    for resp in responses:
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model") and "gpt-4" in error["message"]
    assert generator.calls == []


def test_continue_final_message_continues_the_last_message(tokenizer):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    (chat, tokenized, both), generator = posts(
        tokenizer,
        [
            (
                "/v1/chat/completions",
                {"messages": messages, "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True},
            ),
            ("/tokenize", {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}),
            ("/v1/chat/completions", {"messages": messages, "continue_final_message": True}),
        ],
    )
    assert chat.status_code == 200, chat.text
    assert prompt_text(tokenizer, generator) == ("<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,")
    assert tokenized.json()["tokens"] == generator.calls[0][0]
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    assert len(generator.calls) == 1


@pytest.mark.parametrize(
    "template",
    [
        TOOLS_TEMPLATE,  # trims the content: the cut drops the trailing space too
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}",
        "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{{ p.text }}{% endfor %}</s>{% endfor %}",
    ],
)
def test_continue_final_message_renders_as_transformers(with_template, template):
    from transformers import AutoTokenizer

    tok = with_template(template)
    ref = AutoTokenizer.from_pretrained(tok.model_dir)
    text = "Once upon a time "
    content = [{"type": "text", "text": "x"}, {"type": "text", "text": text}] if "p.text" in template else text
    messages = [{"role": "user", "content": "A story"}, {"role": "assistant", "content": content}]
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert "upon a time" in ours and ours.endswith(("time", "time "))


def test_a_body_that_does_not_parse_says_why(tokenizer):
    deep = b'{"prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    (utf8, nested), generator = posts(
        tokenizer, [("/v1/completions", b'{"prompt": "a\xff\xfe"}'), ("/v1/chat/completions", deep)]
    )
    for resp in (utf8, nested):
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "body", resp.text
    assert "not valid UTF-8: byte 0xff at offset 13" in utf8.json()["error"]["message"]
    assert "nested too deeply" in nested.json()["error"]["message"]
    assert generator.calls == []


# --- 11. latency buckets ---------------------------------------------------------------------


def test_latency_buckets_reach_past_80_seconds_as_vllms():
    gateway = GatewayMetrics("m")
    scheduler = SchedulerMetrics("m")
    for m in (gateway, scheduler):
        m.ttft.labels("m").observe(83.0)  # an 8,001-token prompt on a CPU
        m.e2e.labels("m").observe(3000.0)
        value = m.registry.get_sample_value
        assert value("pagoda:time_to_first_token_seconds_bucket", {"model_name": "m", "le": "80.0"}) == 0
        assert value("pagoda:time_to_first_token_seconds_bucket", {"model_name": "m", "le": "160.0"}) == 1
        assert value("pagoda:time_to_first_token_seconds_bucket", {"model_name": "m", "le": "2560.0"}) == 1
        assert value("pagoda:e2e_request_latency_seconds_bucket", {"model_name": "m", "le": "7680.0"}) == 1
    # the gateway's TTFT buckets are vLLM's exactly
    assert [b for b in gateway.ttft.labels("m")._upper_bounds if b != float("inf")] == [
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    ]


def test_a_request_that_ends_is_not_counted_as_aborted():
    """A request that ends normally is counted once, by its own finish reasons."""
    metrics = GatewayMetrics("m")
    with metrics.serving(num_choices=1, num_prompt_tokens=2) as timer:
        timer.on_delta((0, 0), 2, "length")
        timer.on_finished(2, 2)
    value = metrics.registry.get_sample_value
    assert value("pagoda:request_success_total", {"model_name": "m", "finished_reason": "length"}) == 1
    assert value("pagoda:request_success_total", {"model_name": "m", "finished_reason": "abort"}) is None
