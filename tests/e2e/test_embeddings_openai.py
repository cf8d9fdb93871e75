"""`/v1/embeddings` end to end (issue 28): `pagoda serve --task embed` with two stages, the
official `openai` SDK's `client.embeddings.create`, against `transformers`' final hidden
states (after the final norm) pooled and L2-normalized.

One stack for the module (PP=2, prompts prefilled in chunks of 64 tokens); a second gateway
with `--pooling-type MEAN` shares its scheduler, since the pooling type travels with each
request. Checked: 3 inputs batched together equal the reference within 1e-5 for last-token
and mean pooling, as floats and as base64; usage counts the prompt tokens; the refusals the
SDK sees; no KV block outlives the requests, a client that disconnects included.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from types import SimpleNamespace

import openai
import pytest
import torch
import torch.nn.functional as F
from support.stack import kill_tree, start_serve

from services.text import Tokenizer
from wiring.launcher import ServiceProcess, free_port, pagoda_command

MAX_MODEL_LEN = 256
INPUTS = ["Hello, world.", "Embeddings pool the final hidden states of a prompt. " * 8, "A third, short one"]


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("embeddings-stack-logs")
    serve = start_serve(
        model_dir,
        logs,
        "--task",
        "embed",
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "64",
        "--num-threads",
        "1",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--served-model-name",
        "tiny",
    )
    mean_port, mean_grpc = free_port(), free_port()
    mean = ServiceProcess(  # a second gateway on the same scheduler, mean pooling
        "gateway-mean",
        pagoda_command(
            "gateway",
            "--model",
            model_dir,
            "--scheduler",
            serve.ready["scheduler"],
            "--port",
            str(mean_port),
            "--grpc-port",
            str(mean_grpc),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--served-model-name",
            "tiny",
            "--pooling-type",
            "MEAN",
        ),
        f"127.0.0.1:{mean_grpc}",
        log_path=logs / "gateway-mean.log",
    )
    try:
        mean.start()
        mean.wait_healthy(60)
    except Exception:
        mean.stop()
        serve.serve.stop()
        raise
    yield SimpleNamespace(port=serve.port, grpc_port=serve.grpc_port, mean_port=mean_port)
    kill_tree(mean)  # the graceful drain is not tested here (3-7 s a stack)
    serve.stop()


def sdk(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf_model, prompt, pooling):
    """transformers' last `output_hidden_states` entry, the final norm's output (in HF Llama
    the LM head reads it: tests/unit/test_embeddings.py checks that), pooled, normalized."""
    with torch.no_grad():
        hidden = hf_model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    return F.normalize(hidden[-1] if pooling == "LAST" else hidden.mean(dim=0), dim=-1)


def kv_used_blocks(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/debug/memory")
    memory = json.loads(conn.getresponse().read())
    conn.close()
    return memory["kv_cache"]["num_used_blocks"]


def wait_kv_free(port, timeout_s=30.0):
    deadline = time.time() + timeout_s
    while (used := kv_used_blocks(port)) and time.time() < deadline:
        time.sleep(0.2)
    return used


@pytest.mark.parametrize(("pooling", "encoding"), [("LAST", "float"), ("LAST", "base64"), ("MEAN", "base64")])
def test_three_inputs_batched_equal_transformers(stack, model_dir, hf_model, pooling, encoding):
    """The SDK decodes base64 itself (it asks for it unless told otherwise); the second input
    is longer than a step's budget, so its prompt is computed in chunks across both stages."""
    tokenizer = Tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in INPUTS]
    assert len(prompts[1]) > 64
    client = sdk(stack.port if pooling == "LAST" else stack.mean_port)
    kwargs = {"encoding_format": encoding} if encoding == "float" else {}
    result = client.embeddings.create(model="tiny", input=INPUTS, **kwargs)
    assert [d.index for d in result.data] == [0, 1, 2] and result.model == "tiny"
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, prompts))
    for prompt, item in zip(prompts, result.data, strict=True):
        got = torch.tensor(item.embedding, dtype=torch.float32)
        want = reference(hf_model, prompt, pooling)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (pooling, float((got - want).abs().max()))


def test_token_id_inputs_and_a_prompt_that_fills_the_context(stack, hf_model):
    prompts = [[5, 17, 99, 260, 31], list(range(3, 3 + MAX_MODEL_LEN))]
    result = sdk(stack.mean_port).embeddings.create(model="tiny", input=prompts, encoding_format="float")
    for prompt, item in zip(prompts, result.data, strict=True):
        got = torch.tensor(item.embedding)
        assert torch.allclose(got, reference(hf_model, prompt, "MEAN"), atol=1e-5, rtol=0)
    one = sdk(stack.port).embeddings.create(model="tiny", input=prompts[0], encoding_format="float")
    assert torch.allclose(
        torch.tensor(one.data[0].embedding), reference(hf_model, prompts[0], "LAST"), atol=1e-5, rtol=0
    )


def test_the_sdk_sees_refusals_naming_the_field(stack):
    client = sdk(stack.port)
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model="tiny", input="hi", dimensions=8)
    assert exc.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model="tiny", input=list(range(3, 4 + MAX_MODEL_LEN)))
    assert exc.value.body["param"] == "input" and exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-4", input="hi")


def test_no_kv_block_outlives_the_requests_a_disconnected_client_included(stack):
    """Many long inputs, the client gone after a moment: every request is aborted downstream
    and the pool is empty again (finished embedding requests free theirs as they end)."""
    body = json.dumps({"model": "tiny", "input": [[7 + i % 200] * 200 for i in range(192)]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=0.5)
    conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    assert wait_kv_free(stack.port) == 0
    assert wait_kv_free(stack.mean_port) == 0
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    conn.close()
    aborted = re.search(
        r'^pagoda:request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.e+]+)$', metrics, re.M
    )
    assert aborted and float(aborted.group(1)) > 0, "the inputs cut short count as aborted"


def test_the_public_grpc_api_embeds_as_rest_does(stack, model_dir, hf_model):
    """`pagoda.v1.Generation/Embed` with the generated client: the same vectors as REST's,
    and refusals naming the field."""
    import asyncio

    import grpc

    from services.grpc_utils import aio_channel
    from services.pb import gateway_pb2, gateway_pb2_grpc
    from services.pooling import embedding_from_pb, embedding_values

    async def call(request):
        async with aio_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            return await gateway_pb2_grpc.GenerationStub(channel).Embed(request, timeout=60)

    reply = asyncio.run(call(gateway_pb2.EmbedRequest(model="tiny", texts=INPUTS)))
    tokenizer = Tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in INPUTS]
    assert reply.usage.num_prompt_tokens == sum(map(len, prompts)) and reply.request_id
    for prompt, tensor in zip(prompts, reply.embeddings, strict=True):
        got = torch.tensor(embedding_values(embedding_from_pb(tensor)))
        assert torch.allclose(got, reference(hf_model, prompt, "LAST"), atol=1e-5, rtol=0)
    for request, field in (
        (gateway_pb2.EmbedRequest(), "texts"),
        (
            gateway_pb2.EmbedRequest(
                token_ids=[gateway_pb2.PromptTokenIds(ids=[5]), gateway_pb2.PromptTokenIds(ids=[99999])]
            ),
            "token_ids[1]",
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            asyncio.run(call(request))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details().startswith(f"{field}: "), exc.value.details()
