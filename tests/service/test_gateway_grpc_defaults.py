"""The public gRPC API's sampling defaults (issue 35, item 4): a `pagoda.v1.Generation` request
that leaves temperature, top_p, top_k, min_p or repetition_penalty unset samples with the
served model's defaults, as a REST request does (for a GGUF file, llama.cpp's); a field it
sets wins, 0 (off) included. A real gRPC server on port 0 over a fake scheduler that records
the sampling each request reached it with."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from gateway.config import GatewayConfig
from gateway.generation import ChoiceDelta, Finished, Usage
from gateway.grpc_api import add_generation_service
from services.generation_config import GGUF_SOURCE_FILE
from services.grpc_utils import aio_channel, create_aio_server
from services.pb import gateway_pb2, gateway_pb2_grpc
from services.text import Tokenizer


class Recording:
    """`TextGenerator`'s interface: records each request's parameters, answers one token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list = []

    async def generate(self, prompt_ids, params, request_id=None, traceparent=""):
        self.calls.append(params)
        yield ChoiceDelta(0, "a", [5], finish_reason="length")
        yield Finished(Usage(len(prompt_ids), 1))


@pytest.fixture(scope="module")
def gguf_folder(model_factory, tmp_path_factory):
    """The tiny model's files, marked as the folder prepared for a GGUF file."""
    folder = tmp_path_factory.mktemp("grpc-defaults") / "model"
    shutil.copytree(model_factory(arch="llama"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / GGUF_SOURCE_FILE).write_text(json.dumps({"file": "/nowhere/model.gguf"}))
    return folder


def _sampled(folder, requests, **config):
    """Each request's sampling as the scheduler got it, through a real gRPC server."""

    async def main():
        generator = Recording(Tokenizer(folder))
        cfg = GatewayConfig(
            model=str(folder), scheduler_address="unused:1", max_model_len=64, served_model_names=("tiny",), **config
        )
        server, port, _ = create_aio_server("127.0.0.1:0")
        add_generation_service(server, generator, cfg)
        await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}") as channel:
                stub = gateway_pb2_grpc.GenerationStub(channel)
                for request in requests:
                    async for _ in stub.Generate(request):
                        pass
        finally:
            await server.stop(None)
        return [params.sampling for params in generator.calls]

    return asyncio.run(main())


def _request(**sampling) -> gateway_pb2.TextGenerateRequest:
    request = gateway_pb2.TextGenerateRequest(text="Hello")
    for name, value in sampling.items():
        setattr(request.options.sampling_params, name, value)
    return request


def _picked(o):
    return (round(o.temperature, 6), round(o.top_p, 6), o.top_k, round(o.min_p, 6), o.repetition_penalty)


def test_unset_fields_take_the_models_defaults_and_set_ones_win(gguf_folder):
    bare, some, off = _sampled(
        gguf_folder,
        [
            gateway_pb2.TextGenerateRequest(text="Hello"),  # no sampling_params at all
            _request(max_tokens=4, temperature=0.5),
            _request(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0),
        ],
    )
    assert _picked(bare) == (0.8, 0.95, 40, 0.05, 1.0)
    assert _picked(some) == (0.5, 0.95, 40, 0.05, 1.0) and some.max_tokens == 4
    assert _picked(off) == (1.0, 1.0, 0, 0.0, 1.0)


def test_without_defaults_an_unset_field_is_off(gguf_folder):
    (bare,) = _sampled(gguf_folder, [_request(max_tokens=4)], generation_config="vllm")
    assert _picked(bare) == (1.0, 1.0, 0, 0.0, 1.0)
