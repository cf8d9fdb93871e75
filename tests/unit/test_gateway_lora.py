"""The gateway's multi-LoRA surface, in-process over a fake generator: a request's `model`
names an adapter (it reaches the scheduler as `lora_name`), `/v1/models` lists adapters with
their base as `parent`, and the runtime load/unload endpoints are refused without
--allow-runtime-lora-updating and, with API keys, from a key without the admin grant."""

from __future__ import annotations

import asyncio
import json

import grpc
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
    cfg = GatewayConfig(
        model=str(tokenizer.model_dir),
        scheduler_address="unused:1",
        max_model_len=MAX_MODEL_LEN,
        served_model_names=("tiny",),
        enable_lora=True,
        lora_modules=("sql=/adapters/sql",),
        **config,
    )
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


class SchedulerLikeGenerator(LoraGenerator):
    """Answers as the scheduler does: the adapters it serves after each call, and on
    `lora_adapters`; `refusal` is the next call's gRPC refusal; `unloading` holds an unload
    (a drain) until it is set."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.served = {"sql": "/adapters/sql"}
        self.refusal: grpc.StatusCode | None = None
        self.unloading = asyncio.Event()
        self.unloading.set()

    async def lora_adapters(self) -> dict[str, str]:
        return dict(self.served)

    async def lora_adapter(self, load: bool, name: str, path: str) -> dict[str, str]:
        await super().lora_adapter(load, name, path)
        if self.refusal is not None:
            raise grpc.aio.AioRpcError(
                self.refusal,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "LoRA bank is full: max_loras=1 ...; or serve with a larger --max-loras",
            )
        if not load:
            await self.unloading.wait()
        if load:
            self.served[name] = path
        else:
            self.served.pop(name, None)
        return dict(self.served)


def make_scheduler_like(tokenizer):
    generator = SchedulerLikeGenerator(tokenizer)
    cfg = GatewayConfig(
        model=str(tokenizer.model_dir),
        scheduler_address="unused:1",
        max_model_len=MAX_MODEL_LEN,
        served_model_names=("tiny",),
        enable_lora=True,
        lora_modules=("sql=/adapters/sql",),
        allow_runtime_lora_updating=True,
    )
    app = create_app(cfg, generator)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway"), generator


def test_the_adapters_follow_what_the_scheduler_serves(tokenizer):
    """An adapter the scheduler dropped (a restarted stage could not load it again) leaves
    /v1/models, unload says 404 and a load under its name works (issue 35, item 2)."""

    async def go():
        client, generator = make_scheduler_like(tokenizer)
        generator.served.pop("sql")  # dropped by the scheduler
        assert "sql" not in {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
        assert (await client.get("/v1/models/sql")).status_code == 404
        assert (await _post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})).status_code == 404
        r = await _post(client, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql2"})
        assert r.status_code == 200, r.text
        cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert cards["sql"]["parent"] == "tiny"

    asyncio.run(go())


def test_a_full_bank_is_a_400_the_sdk_does_not_retry(tokenizer):
    async def go():
        client, generator = make_scheduler_like(tokenizer)
        generator.refusal = grpc.StatusCode.FAILED_PRECONDITION
        r = await _post(client, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/adapters/x"})
        assert r.status_code == 400 and "--max-loras" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "lora_name"

    asyncio.run(go())


def test_an_adapter_being_unloaded_is_served_no_more(tokenizer):
    """While the scheduler drains the adapter, requests under it are 404 at the gateway; a
    refused unload serves it again (issue 35, item 21)."""

    async def go():
        client, generator = make_scheduler_like(tokenizer)
        generator.unloading.clear()
        unloading = asyncio.ensure_future(_post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"}))
        await asyncio.sleep(0.05)
        r = await _post(client, "/v1/completions", {"model": "sql", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        generator.unloading.set()
        assert (await unloading).status_code == 200
        generator.refusal = grpc.StatusCode.UNAVAILABLE
        generator.served["sql"] = "/adapters/sql"
        assert (await _post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})).status_code == 502
        r = await _post(client, "/v1/completions", {"model": "sql", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200

    asyncio.run(go())
