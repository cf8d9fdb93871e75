"""Multi-LoRA end to end (issue 27): `pagoda serve --enable-lora` with two stages (each holds
the adapters for its own layers), driven by the official `openai` SDK.

Three adapters made with `peft` (random A, nonzero B; ranks 4, 8 and 16, different target
modules, one rsLoRA): two given with `--lora-modules`, the third loaded at run time through
`/v1/load_lora_adapter`. Requests of the three and of the base model run at once
(synchronous scheduling: one micro-batch holds every running sequence, so a step mixes all
four); each greedy completion equals `transformers` running peft's merged model
(`merge_and_unload`), under the tie rule. `/v1/models` lists the adapters with the base as
`parent`; the public gRPC API takes an adapter as its `model` too; an unknown `model` is a
404 naming it; an unload works, and what was unloaded is
then unknown; the same prompt under two adapters shares no prefix-cache block; no KV block
is left.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from support.lora import make_adapter, merged_model
from support.stack import start_serve

ADAPTERS = {  # name -> make_adapter's arguments
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
    "mlp-r8": dict(r=8, lora_alpha=16, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"], seed=2),
    "all-r16-rslora": dict(
        r=16,
        lora_alpha=32,
        use_rslora=True,
        seed=3,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}
PROMPTS = {
    "attn-r4": [17, 99, 5, 300, 42, 7, 250],
    None: [8, 8, 61, 400, 123, 9, 77, 31, 200, 15, 6, 88],
    "mlp-r8": [301, 12, 44, 5, 90],
    "all-r16-rslora": [64, 128, 256, 11, 13, 17, 19, 23, 29],
}
MAX_TOKENS = 12
TIE = 1e-4


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def stack(model_dir, adapters, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora-stack-logs")
    serve = start_serve(
        model_dir,
        logs,
        "--pipeline-parallel-size",
        "2",
        "--no-async-scheduling",
        "--num-kv-blocks",
        "64",
        "--num-threads",
        "1",
        "--max-model-len",
        "256",
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "16",
        "--allow-runtime-lora-updating",
        "--lora-modules",
        f"attn-r4={adapters['attn-r4']}",
        f"mlp-r8={adapters['mlp-r8']}",
    )
    yield serve
    serve.stop()


def _post(port: int, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _greedy(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [x[0] for x in out.logits]


def _check(model, prompt: list[int], got: list[int]) -> None:
    """`got` is the model's greedy continuation, but where the model's top two are within TIE
    (then it continues from `got`'s token)."""
    want, logits = _greedy(model, prompt)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            assert float(logits[j].max() - logits[j][g]) <= TIE, (prompt, j, g, w)
            return _check(model, prompt + got[: j + 1], got[j + 1 :]) if got[j + 1 :] else None
    return None


def _grpc_tokens(port: int, model: str, prompt: list[int]) -> list[int]:
    """The public gRPC API's greedy tokens for `prompt` under `model` (an adapter's name)."""
    import grpc

    from services.pb import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.TextGenerateRequest(model=model)
    request.token_ids.ids.extend(prompt)
    request.options.sampling_params.max_tokens = MAX_TOKENS
    request.options.sampling_params.temperature = 0.0
    request.options.sampling_params.ignore_eos = True
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = gateway_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)
        return [t for msg in stream for choice in msg.choices for t in choice.token_ids]


def test_a_step_of_three_adapters_and_the_base_equals_peft_merged_models(stack, model_dir, adapters):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="none")
    status, text = _post(
        stack.port, "/v1/load_lora_adapter", {"lora_name": "all-r16-rslora", "lora_path": adapters["all-r16-rslora"]}
    )
    assert status == 200, text

    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"tiny", *ADAPTERS}
    assert all(getattr(cards[name], "parent", None) == "tiny" for name in ADAPTERS)

    def complete(item):
        name, prompt = item
        out = client.completions.create(
            model=name or "tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return name, prompt, out.choices[0].token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(complete, PROMPTS.items()))
    outputs = {}
    for name, prompt, got in results:
        assert len(got) == MAX_TOKENS
        _check(merged_model(model_dir, adapters[name] if name else None), prompt, got)
        outputs[name] = got
    assert len({tuple(v) for v in outputs.values()}) == 4  # every adapter changed the output
    assert _grpc_tokens(stack.grpc_port, "attn-r4", PROMPTS["attn-r4"]) == outputs["attn-r4"]

    # the prefix cache is keyed by adapter: a prompt cached under one is computed anew under another
    prompt = list(range(40, 80))
    cached = []
    for name in ("attn-r4", "attn-r4", "all-r16-rslora", None):
        out = client.completions.create(model=name or "tiny", prompt=prompt, max_tokens=1)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached[1] >= 32 and cached[2] == 0 and cached[3] == 0, cached

    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="no-such-adapter", prompt=[5, 6], max_tokens=2)
    assert refused.value.body["param"] == "model"

    status, text = _post(stack.port, "/v1/unload_lora_adapter", {"lora_name": "mlp-r8"})
    assert status == 200, text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp-r8", prompt=[5, 6], max_tokens=2)
    status, _ = _post(stack.port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})
    assert status == 400
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/metrics", timeout=10).read().decode()
    assert 'pagoda:kv_cache_used_blocks{model_name="tiny"} 0.0' in metrics
    listed = {m.id for m in client.models.list().data} - {"tiny"}
    _assert_endpoint_picker_metrics(metrics, served=listed)


def _assert_endpoint_picker_metrics(text: str, served: set[str]) -> None:
    """The names an endpoint picker of the Gateway API Inference Extension scrapes by default
    (v1.5.0 pkg/epp/server/options.go: vllm:num_requests_waiting, _running, kv_cache_usage_perc,
    lora_requests_info, cache_config_info), with the types and labels its model server
    protocol asks for."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge" and len(families[name].samples) == 1, name
    assert families["vllm:num_requests_running"].samples[0].value == 0  # (nothing runs now)
    assert 0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1
    (cache,) = families["vllm:cache_config_info"].samples
    assert cache.labels["block_size"] == "16" and int(cache.labels["num_gpu_blocks"]) > 0
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels["max_lora"] == "3"
    assert set(lora.labels["running_lora_adapters"].split(",")) == served
    assert lora.value > 1.7e9  # a time stamp: the picker takes the latest series
