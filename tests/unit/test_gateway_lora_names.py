"""What a new user met about adapters' names (issue 35, items 5 and 16), over the in-process
app and a scripted fake scheduler (test_gateway_issue35's):

5  a response under an adapter reports the adapter's name as `model` (chat, completions,
   Responses; streamed or not), and the Responses API runs it under the adapter;
16 `/v1/models` gives an adapter's folder as its `root`; loading an adapter under the base
   model's name names the clash.
"""

from __future__ import annotations

import pytest
from test_gateway_issue35 import USER, events, session

from services.text import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


# --- 5: the adapter's name as `model` ------------------------------------------------------


def test_responses_under_an_adapter_report_its_name(tokenizer):
    (chat, chat_stream, completion, responses, responses_stream, base), generator = session(
        tokenizer,
        [
            ("POST", "/v1/chat/completions", {"model": "sql", "messages": USER, "max_tokens": 4}),
            ("POST", "/v1/chat/completions", {"model": "sql", "messages": USER, "max_tokens": 4, "stream": True}),
            ("POST", "/v1/completions", {"model": "sql", "prompt": "a", "max_tokens": 4}),
            ("POST", "/v1/responses", {"model": "sql", "input": "hi", "max_output_tokens": 4}),
            ("POST", "/v1/responses", {"model": "sql", "input": "hi", "max_output_tokens": 4, "stream": True}),
            ("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4}),
        ],
    )
    assert chat.json()["model"] == "sql" and completion.json()["model"] == "sql"
    assert {chunk["model"] for chunk in events(chat_stream)} == {"sql"}
    assert responses.json()["model"] == "sql"
    assert {e["response"]["model"] for e in events(responses_stream) if "response" in e} == {"sql"}
    assert base.json()["model"] == "tiny"
    # and the Responses API runs under the adapter, as chat does
    assert [params.lora_name for _, params, _ in generator.calls] == ["sql"] * 5 + [""]


# --- 16: an adapter's root, and a load under the base model's name ---------------------------


def test_an_adapters_root_is_its_folder_and_the_base_name_is_not_an_adapters(tokenizer):
    (models, one, clash, again), generator = session(
        tokenizer,
        [
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/sql", None),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/adapters/other"}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/other"}),
        ],
    )
    cards = {card["id"]: card for card in models.json()["data"]}
    assert cards["sql"]["root"] == "/adapters/sql" and cards["sql"]["parent"] == "tiny"
    assert cards["tiny"]["root"] == "tiny"
    assert one.json()["root"] == "/adapters/sql"
    error = clash.json()["error"]
    assert clash.status_code == 400 and error["param"] == "lora_name"
    assert "base model" in error["message"] and "already been loaded" not in error["message"]
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert generator.lora_calls == []
