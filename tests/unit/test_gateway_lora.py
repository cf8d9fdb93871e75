"""The gateway's multi-LoRA surface, in-process over a fake generator: a request's `model`
names an adapter (it reaches the scheduler as `lora_name`), `/v1/models` lists adapters with
their base as `parent`, and the runtime load/unload endpoints are refused without
--allow-runtime-lora-updating and, with API keys, from a key without the admin grant."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from test_gateway_app import MAX_MODEL_LEN, FakeGenerator

from gateway.app import create_app
from gateway.config import ApiKey, GatewayConfig
from services.text import Tokenizer


class LoraGenerator(FakeGenerator):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.lora_calls: list[tuple[bool, str, str]] = []

    async def lora_adapter(self, load: bool, name: str, path: str) -> None:
        self.lora_calls.append((load, name, path))


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory(arch="llama"))


def make(tokenizer, **config):
    generator = LoraGenerator(tokenizer)
    cfg = GatewayConfig(model=str(tokenizer.model_dir), scheduler_address="unused:1", max_model_len=MAX_MODEL_LEN,
                        served_model_names=("tiny",), enable_lora=True, lora_modules=("sql=/adapters/sql",),
                        **config)
    app = create_app(cfg, generator)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway"), generator


async def _post(client, path, body, key=None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return await client.post(path, content=json.dumps(body), headers=headers)


def test_model_names_an_adapter_and_models_lists_it(tokenizer):
    async def go():
        client, generator = make(tokenizer)
        r = await _post(client, "/v1/completions", {"model": "sql", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] in ("tiny", "sql")
        r = await _post(client, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2})
        assert [c[1].lora_name for c in generator.calls] == ["sql", ""]
        r = await _post(client, "/v1/completions", {"model": "nope", "prompt": "a"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert cards["sql"]["parent"] == "tiny" and "parent" not in cards["tiny"]
    asyncio.run(go())


def test_runtime_updates_are_refused_without_the_flag(tokenizer):
    async def go():
        client, generator = make(tokenizer)
        r = await _post(client, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a"})
        assert r.status_code == 403 and "allow-runtime-lora-updating" in r.json()["error"]["message"]
        r = await _post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert r.status_code == 403
        assert generator.lora_calls == []
    asyncio.run(go())


def test_runtime_updates_with_the_flag_and_the_admin_grant(tokenizer):
    async def go():
        keys = {"user-key": ApiKey(), "admin-key": ApiKey(admin=True)}
        client, generator = make(tokenizer, allow_runtime_lora_updating=True, api_keys=keys)
        body = {"lora_name": "x", "lora_path": "/adapters/x"}
        assert (await _post(client, "/v1/load_lora_adapter", body, "user-key")).status_code == 403
        r = await _post(client, "/v1/load_lora_adapter", body, "admin-key")
        assert r.status_code == 200, r.text
        assert (await _post(client, "/v1/load_lora_adapter", body, "admin-key")).status_code == 400
        r = await _post(client, "/v1/completions", {"model": "x", "prompt": "a", "max_tokens": 1}, "user-key")
        assert r.status_code == 200 and generator.calls[-1][1].lora_name == "x"
        assert (await _post(client, "/v1/unload_lora_adapter", {"lora_name": "x"}, "admin-key")).status_code == 200
        r = await _post(client, "/v1/completions", {"model": "x", "prompt": "a"}, "user-key")
        assert r.status_code == 404
        assert (await _post(client, "/v1/unload_lora_adapter", {"lora_name": "x"}, "admin-key")).status_code == 404
        assert generator.lora_calls == [(True, "x", "/adapters/x"), (False, "x", "")]
    asyncio.run(go())
