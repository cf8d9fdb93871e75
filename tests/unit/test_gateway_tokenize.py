"""`POST /tokenize` and `POST /detokenize` (vLLM's extras) over the in-process gateway.

A text is tokenized as completions encode it, a conversation exactly as chat completions
sends it to the scheduler; neither endpoint calls the scheduler. The app and its fake
scheduler are the ones of test_gateway_app.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_gateway_app import MAX_MODEL_LEN, make_client, post, run
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from gateway.config import ApiKey
from services.text import Tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
]
# The tiny model's template loops over text parts, so they reach it as sent (vLLM's "openai"
# content format; a template that reads only strings gets them joined by newlines).
PLAIN_CHAT = CHAT


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


@pytest.fixture(scope="module")
def bos_tokenizer(model_factory, tmp_path_factory):
    """The tiny model with a post-processor that adds a BOS its chat template never writes:
    the one case where chat's own BOS rule, add_special_tokens false and true all differ."""
    model_dir = tmp_path_factory.mktemp("bos-model") / "tiny"
    shutil.copytree(model_factory(arch="llama"), model_dir)
    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 0)]
    )
    backend.save(str(model_dir / "tokenizer.json"))
    return Tokenizer(model_dir)


def posts(tokenizer, requests, **config):
    """Each (path, body) posted in turn to one app: (responses, the fake scheduler)."""

    async def go():
        client, generator = make_client(tokenizer, **config)
        async with client:
            return [await post(client, path, body) for path, body in requests], generator

    return run(go())


def test_a_text_is_tokenized_as_completions_encode_it(tokenizer):
    text = "Hello <|im_start|> wörld"
    (default, bare, strs), generator = posts(
        tokenizer,
        [
            ("/tokenize", {"prompt": text}),
            ("/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False}),
            ("/tokenize", {"prompt": text, "return_token_strs": True}),
        ],
    )
    ids = tokenizer.encode(text)
    assert default.status_code == 200, default.text
    assert default.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    assert bare.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert strs.json()["tokens"] == ids
    assert strs.json()["token_strs"] == [tokenizer.id_to_token(i) for i in ids]
    assert "<|im_start|>" in strs.json()["token_strs"]  # a special token written in the text
    assert generator.calls == []


def test_a_conversation_is_tokenized_as_chat_completions_sends_it(tokenizer):
    bodies = [
        {"messages": CHAT},
        {"messages": CHAT, "add_generation_prompt": False},
        {"messages": CHAT, "chat_template_kwargs": {"unused_variable": 1}},
    ]
    requests = [(path, body) for body in bodies for path in ("/tokenize", "/v1/chat/completions")]
    responses, generator = posts(tokenizer, requests)
    tokenized = [r.json()["tokens"] for r in responses[0::2]]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert tokenized == [ids for ids, _, _ in generator.calls]  # what the scheduler was sent
    assert tokenized[0] == tokenizer.encode_chat(PLAIN_CHAT)
    assert tokenized[1] == tokenizer.encode_chat(PLAIN_CHAT, add_generation_prompt=False)
    assert tokenized[0] != tokenized[1]


def test_add_special_tokens_with_a_tokenizer_that_adds_a_bos(bos_tokenizer):
    tok = bos_tokenizer
    (chat_default, chat_bare, chat_added, completion, text, text_bare), generator = posts(
        tok,
        [
            ("/tokenize", {"messages": CHAT}),
            ("/tokenize", {"messages": CHAT, "add_special_tokens": False}),
            ("/tokenize", {"messages": CHAT, "add_special_tokens": True}),
            ("/v1/chat/completions", {"messages": CHAT}),
            ("/tokenize", {"prompt": "Hi"}),
            ("/tokenize", {"prompt": "Hi", "add_special_tokens": False}),
        ],
    )
    rendered = tok.encode(tok.apply_chat_template(PLAIN_CHAT), add_special_tokens=False)
    assert rendered[0] != tok.bos_token_id
    assert chat_default.json()["tokens"] == generator.calls[0][0] == [tok.bos_token_id, *rendered]
    assert chat_bare.json()["tokens"] == rendered  # vLLM's false: the template's text alone
    assert chat_added.json()["tokens"] == [tok.bos_token_id, *rendered]
    assert completion.status_code == 200
    assert text.json()["tokens"] == [tok.bos_token_id, *tok.encode("Hi", add_special_tokens=False)]
    assert text_bare.json()["tokens"] == tok.encode("Hi", add_special_tokens=False)


def test_tokenize_counts_a_prompt_longer_than_the_context(tokenizer):
    (resp,), _ = posts(tokenizer, [("/tokenize", {"prompt": "hello " * 200})])
    assert resp.status_code == 200 and resp.json()["count"] > MAX_MODEL_LEN


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "  two leading spaces\tand a tab\n",
        "émoji 🐍 und Ünïcödé",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_then_detokenize_gives_the_text_back(tokenizer, text, add_special_tokens):
    async def go():
        client, _ = make_client(tokenizer)
        async with client:
            tokens = await post(client, "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})
            return tokens, await post(client, "/detokenize", {"tokens": tokens.json()["tokens"]})

    tokens, text_back = run(go())
    assert tokens.status_code == 200 and text_back.status_code == 200, text_back.text
    assert text_back.json() == {"prompt": text}


def test_a_tokenized_conversation_detokenizes_to_the_rendered_template(bos_tokenizer):
    tok = bos_tokenizer

    async def go():
        client, _ = make_client(tok)
        async with client:
            tokens = (await post(client, "/tokenize", {"messages": CHAT})).json()["tokens"]
            return await post(client, "/detokenize", {"model": "tiny", "tokens": tokens})

    # special tokens are kept, as vLLM decodes: the BOS shows
    assert run(go()).json()["prompt"] == tok.bos_token + tok.apply_chat_template(PLAIN_CHAT)


HI = [{"role": "user", "content": "hi"}]
BAD = [
    # (path, body, param)
    ("/tokenize", b'{"prompt": ', None),
    ("/tokenize", b"[1, 2]", None),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ("/tokenize", {"messages": HI, "model": "gpt-4"}, "model"),
    ("/tokenize", {"messages": HI, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ("/tokenize", {"messages": HI, "add_special_tokens": 0}, "add_special_tokens"),
    ("/tokenize", {"messages": HI, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": HI, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": HI, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/tokenize", {"messages": HI, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/detokenize", b"[1]", None),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_bodies_get_400_naming_the_field(tokenizer, path, body, param):
    (resp,), generator = posts(tokenizer, [(path, body)])
    assert resp.status_code == (404 if param == "model" else 400), resp.text  # 404: as OpenAI
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"] and (param is None or error["message"].startswith(param.split("[")[0]))
    assert generator.calls == []


def test_detokenize_of_no_tokens_is_empty(tokenizer):
    (resp,), _ = posts(tokenizer, [("/detokenize", {"tokens": []})])
    assert resp.status_code == 200 and resp.json() == {"prompt": ""}


def test_wrong_content_type_says_so(tokenizer):
    async def go():
        client, _ = make_client(tokenizer)
        async with client:
            return [
                await client.post(path, content=body, headers={"Content-Type": "text/plain"})
                for path, body in (("/tokenize", b'{"prompt": "a"}'), ("/detokenize", b'{"tokens": [1]}'))
            ]

    for resp in run(go()):
        assert resp.status_code == 400
        assert "Content-Type: application/json" in resp.json()["error"]["message"]


def test_api_keys_and_the_body_limit_guard_both(tokenizer):
    keys = {"good-key": ApiKey(tenant="team-a")}
    big = json.dumps({"prompt": "a" * 4000}).encode()

    async def go():
        client, _ = make_client(tokenizer, api_keys=keys, max_body_bytes=2048)
        good = {"Authorization": "Bearer good-key"}
        async with client:
            return [
                await post(client, "/tokenize", {"prompt": "a"}),
                await post(client, "/detokenize", {"tokens": [1]}, {"Authorization": "Bearer nope"}),
                await post(client, "/tokenize", {"prompt": "a"}, good),
                await post(client, "/detokenize", {"tokens": [70]}, good),
                await post(client, "/tokenize", big, good),
                await post(client, "/detokenize", json.dumps({"tokens": [1] * 2000}), good),
            ]

    missing, wrong, tokenized, detokenized, too_big, too_many = run(go())
    for resp in (missing, wrong):
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert tokenized.status_code == 200 and detokenized.status_code == 200
    for resp in (too_big, too_many):
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_both_endpoints_are_in_the_openapi_schema(tokenizer):
    async def go():
        client, _ = make_client(tokenizer)
        async with client:
            return (await client.get("/openapi.json")).json()

    schema = run(go())
    tokenize = schema["paths"]["/tokenize"]["post"]
    body = tokenize["requestBody"]["content"]["application/json"]["schema"]
    members = {ref["$ref"].rsplit("/", 1)[1] for ref in body.get("oneOf", body.get("anyOf", []))}
    assert members == {"TokenizeCompletionRequest", "TokenizeChatRequest"}
    ok = tokenize["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["$ref"].endswith("/TokenizeResponse")
    assert "400" in tokenize["responses"] and "401" in tokenize["responses"]
    detokenize = schema["paths"]["/detokenize"]["post"]
    assert detokenize["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/DetokenizeRequest")
    assert set(schema["components"]["schemas"]["TokenizeResponse"]["properties"]) == {
        "count",
        "max_model_len",
        "tokens",
        "token_strs",
    }
