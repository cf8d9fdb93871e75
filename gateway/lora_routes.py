"""Multi-LoRA at run time: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Refused (403) unless the gateway runs with `--allow-runtime-lora-updating` (vLLM gates them
with VLLM_ALLOW_RUNTIME_LORA_UPDATING), and, when the gateway takes API keys, unless the
request's key is granted `admin`. A load reaches every stage through the scheduler (each
stage holds the adapter for its own layers; a stage that refuses undoes the others) before
the name is served. An unload drains: the name is served no more from the start (404), the
requests running under it end first (or end with an error after the scheduler's drain
timeout), then it is unloaded. A load past `--max-loras` is a 400 that says so (a 429 or a
409, the openai SDK would retry).

The scheduler is the record of what is served (it drops an adapter that a restarted stage
cannot load again): the gateway's list (`Limits.loras`, shared with the public gRPC API)
follows it at every load, unload and `/v1/models` (`refresh_loras`).
"""

from __future__ import annotations

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import ApiError

# the stages' and the scheduler's refusals, as HTTP statuses
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 400,  # (a full bank: retrying changes nothing)
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(..., min_length=1, max_length=256, description="The name requests send as `model`.")
    lora_path: str = Field(..., min_length=1, description="The PEFT adapter folder on the server.")


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(..., min_length=1, max_length=256)
    lora_int_id: int | None = None  # (vLLM's; ignored)


def add_lora_routes(app: FastAPI, gw) -> None:
    @app.post("/v1/load_lora_adapter", tags=["vLLM"], response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> str:
        """Load a PEFT adapter on every stage; requests may then name it as `model`."""
        _check_allowed(gw, request)
        name = body.lora_name
        await refresh_loras(gw)
        if name in gw.limits.names:
            raise ApiError(
                400,
                f"lora_name: {name!r} is a name of the base model; load the adapter under another name",
                "lora_name",
            )
        if name in gw.limits.loras:
            raise ApiError(400, f"lora_name: the adapter {name!r} has already been loaded", "lora_name")
        served = await _call(gw, True, name, body.lora_path)
        _follow(gw, served, {**gw.limits.loras, name: body.lora_path})
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter", tags=["vLLM"], response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> str:
        """Unload an adapter from every stage, once the requests running under it ended (no
        new one is admitted meanwhile)."""
        _check_allowed(gw, request)
        name = body.lora_name
        await refresh_loras(gw)
        if name not in gw.limits.loras:
            raise ApiError(404, f"lora_name: no adapter {name!r} is loaded", "lora_name", "model_not_found")
        path = gw.limits.loras.pop(name)  # served no more while it drains
        try:
            served = await _call(gw, False, name, "")
        except ApiError as exc:
            if exc.status != 404:  # (refused, or the scheduler is down: it serves on)
                gw.limits.loras.setdefault(name, path)
            raise
        _follow(gw, served, {n: p for n, p in gw.limits.loras.items() if n != name})
        return f"Success: LoRA adapter '{name}' removed successfully."


def _check_allowed(gw, request: Request) -> None:
    if not gw.config.enable_lora:
        raise ApiError(400, "LoRA is off on this server (--enable-lora)", code="lora_disabled")
    if not gw.config.allow_runtime_lora_updating:
        raise ApiError(
            403,
            "loading and unloading LoRA adapters at run time is off (--allow-runtime-lora-updating)",
            code="forbidden",
        )
    grant = getattr(request.state, "api_key", None)
    if gw.config.api_keys and (grant is None or not grant.admin):
        raise ApiError(
            403, "this API key may not load or unload LoRA adapters (it has no admin grant)", code="forbidden"
        )


async def refresh_loras(gw) -> None:
    """The gateway's adapters as the scheduler serves them now; kept as they are when it does
    not answer (or the generator cannot tell: a test's)."""
    listing = getattr(gw.generator, "lora_adapters", None)
    if not gw.config.enable_lora or listing is None:
        return
    try:
        served = await listing()
    except grpc.aio.AioRpcError:
        return
    _follow(gw, served, served)


def _follow(gw, served: dict[str, str] | None, otherwise: dict[str, str]) -> None:
    """Replace the adapters in place (the gRPC API holds the same dict) with `served`, the
    scheduler's, or `otherwise` when the generator did not say."""
    loras = gw.limits.loras
    new = served if served is not None else otherwise
    if new != loras:
        loras.clear()
        loras.update(new)


async def _call(gw, load: bool, name: str, path: str) -> dict[str, str] | None:
    """The scheduler's answer: the adapters it serves after the call (None from a generator
    that does not say); ApiError with its refusal."""
    try:
        return await gw.generator.lora_adapter(load, name, path)
    except grpc.aio.AioRpcError as exc:
        status = _STATUS.get(exc.code(), 502)
        param = "lora_path" if load and exc.code() == grpc.StatusCode.INVALID_ARGUMENT else "lora_name"
        raise ApiError(status, exc.details() or exc.code().name, param) from None
