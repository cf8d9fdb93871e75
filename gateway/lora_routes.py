"""Multi-LoRA at run time: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Refused (403) unless the gateway runs with `--allow-runtime-lora-updating` (vLLM gates them
with VLLM_ALLOW_RUNTIME_LORA_UPDATING), and, when the gateway takes API keys, unless the
request's key is granted `admin`. A load reaches every stage through the scheduler (each
stage holds the adapter for its own layers; a stage that refuses undoes the others) before
the name is served; an unload is refused while requests run under the adapter.
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
    grpc.StatusCode.FAILED_PRECONDITION: 409,
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
        if name in gw.limits.names or name in gw.limits.loras:
            raise ApiError(400, f"lora_name: the adapter {name!r} has already been loaded", "lora_name")
        await _call(gw, True, name, body.lora_path)
        gw.limits.loras[name] = body.lora_path
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter", tags=["vLLM"], response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> str:
        """Unload an adapter from every stage (refused while requests run under it)."""
        _check_allowed(gw, request)
        name = body.lora_name
        if name not in gw.limits.loras:
            raise ApiError(404, f"lora_name: no adapter {name!r} is loaded", "lora_name", "model_not_found")
        await _call(gw, False, name, "")
        del gw.limits.loras[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def _check_allowed(gw, request: Request) -> None:
    if not gw.config.enable_lora:
        raise ApiError(400, "LoRA is off on this server (--enable-lora)", code="lora_disabled")
    if not gw.config.allow_runtime_lora_updating:
        raise ApiError(403, "loading and unloading LoRA adapters at run time is off "
                            "(--allow-runtime-lora-updating)", code="forbidden")
    grant = getattr(request.state, "api_key", None)
    if gw.config.api_keys and (grant is None or not grant.admin):
        raise ApiError(403, "this API key may not load or unload LoRA adapters (it has no admin grant)",
                       code="forbidden")


async def _call(gw, load: bool, name: str, path: str) -> None:
    try:
        await gw.generator.lora_adapter(load, name, path)
    except grpc.aio.AioRpcError as exc:
        status = _STATUS.get(exc.code(), 502)
        param = "lora_path" if load and exc.code() == grpc.StatusCode.INVALID_ARGUMENT else "lora_name"
        raise ApiError(status, exc.details() or exc.code().name, param) from None
