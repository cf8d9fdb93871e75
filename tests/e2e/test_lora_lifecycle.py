"""LoRA adapters loaded, unloaded and reloaded at run time (issue 35), end to end: `pagoda
serve --enable-lora --allow-runtime-lora-updating` with two stages, driven by the official
`openai` SDK, `peft`'s merged models the reference.

- An adapter reloaded under its old name with other weights reuses none of the old one's
  prefix-cache blocks: its answer is the new weights' (item 1).
- `/v1/embeddings` under an adapter's name is the adapter's vector, reported under its name
  (item 3).
- Loading past `--max-loras` is a 400 that names the setting, which the SDK does not retry
  (item 6).
- Unloading an adapter while requests run under it drains: new requests under it are
  refused, those running complete, then it is unloaded; what outlasts the drain timeout
  ends with an error naming the adapter (item 21).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch
from support.lora import check_greedy, make_adapter, merged_model, pooled_last
from support.stack import start_serve

from services.grpc_utils import INTERNAL_TOKEN_HEADER
from services.pb import scheduler_pb2_grpc, worker_pb2

TOKEN = "lora-lifecycle-test-token"
ADAPTERS = {  # name -> make_adapter's arguments
    "static": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=11),
    "first": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], seed=12),
    "second": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], seed=13),
}
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle-adapters")
    return {name: make_adapter(model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def stack(model_dir, adapters, tmp_path_factory):
    s = start_serve(
        model_dir,
        tmp_path_factory.mktemp("lora-lifecycle-logs"),
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "128",
        "--num-threads",
        "1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--allow-runtime-lora-updating",
        "--lora-modules",
        f"static={adapters['static']}",
        env={"PAGODA_INTERNAL_TOKEN": TOKEN},
    )
    yield s
    s.stop()


def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


def post(stack, path: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        f"{stack.url}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=180) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def load(stack, name: str, path: str) -> None:
    status, body = post(stack, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert status == 200, body


def unload(stack, name: str) -> None:
    status, body = post(stack, "/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200, body


def complete(stack, model: str, prompt: list[int], max_tokens: int):
    return sdk(stack).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def test_an_adapter_reloaded_under_its_name_reuses_none_of_the_old_ones_kv(stack, model_dir, adapters):
    prompt = list(range(100, 144))  # 44 tokens: two full blocks of 16 cached
    load(stack, "swap", adapters["first"])
    old = complete(stack, "swap", prompt, 8)
    again = complete(stack, "swap", prompt, 8)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # (the prefix cache is on)
    assert again.choices[0].token_ids == old.choices[0].token_ids
    unload(stack, "swap")

    load(stack, "swap", adapters["second"])
    new = complete(stack, "swap", prompt, 8)
    unload(stack, "swap")
    assert new.usage.prompt_tokens_details.cached_tokens == 0
    check_greedy(merged_model(model_dir, adapters["second"]), prompt, new.choices[0].token_ids)
    assert new.choices[0].token_ids != old.choices[0].token_ids


def test_embeddings_under_an_adapter_are_the_adapters(stack, model_dir, adapters):
    prompt = [5, 17, 99, 260, 31, 8, 77]
    client = sdk(stack)
    under = client.embeddings.create(model="static", input=[prompt], encoding_format="float")
    base = client.embeddings.create(model="tiny", input=[prompt], encoding_format="float")
    assert under.model == "static" and base.model == "tiny"
    got, got_base = (torch.tensor(r.data[0].embedding) for r in (under, base))
    want = pooled_last(merged_model(model_dir, adapters["static"]), prompt)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
    assert torch.allclose(got_base, pooled_last(merged_model(model_dir), prompt), atol=1e-5, rtol=0)

    from services.pb import gateway_pb2, gateway_pb2_grpc  # the public gRPC API's Embed too

    request = gateway_pb2.EmbedRequest(model="static")
    request.token_ids.add().ids.extend(prompt)
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        reply = gateway_pb2_grpc.GenerationStub(channel).Embed(request, timeout=60)
    vector = torch.frombuffer(bytearray(reply.embeddings[0].data), dtype=torch.float32)
    assert torch.allclose(vector, want, atol=1e-5, rtol=0)


def test_loading_past_max_loras_is_a_400_naming_the_setting(stack, adapters):
    load(stack, "one", adapters["first"])  # with "static": both slots of --max-loras 2
    try:
        status, body = post(stack, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": adapters["second"]})
        assert status == 400, body  # (429 and 409 the SDK retries)
        assert "--max-loras" in body["error"]["message"] and body["error"]["param"] == "lora_name", body
        names = {m.id for m in sdk(stack).models.list().data}
        assert "two" not in names and {"one", "static"} <= names
    finally:
        unload(stack, "one")


def _stream(stack, model: str, prompt: list[int], max_tokens: int, first: threading.Event, out: list) -> None:
    got: list[int] = []
    try:
        for chunk in sdk(stack).completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        ):
            for choice in chunk.choices:
                got += getattr(choice, "token_ids", None) or []
            if got:
                first.set()
        out.append(("ok", got))
    except openai.APIError as exc:
        out.append(("error", str(exc), got))
    finally:
        first.set()


def test_unloading_under_running_requests_drains_them(stack, adapters):
    load(stack, "drain", adapters["first"])
    first, streamed = threading.Event(), []
    runner = threading.Thread(target=_stream, args=(stack, "drain", [7, 8, 9, 10], 400, first, streamed))
    runner.start()
    assert first.wait(60)
    unloaded: list = []
    unloading = threading.Thread(
        target=lambda: unloaded.append(post(stack, "/v1/unload_lora_adapter", {"lora_name": "drain"}))
    )
    unloading.start()
    time.sleep(0.3)
    with pytest.raises(openai.NotFoundError) as refused:  # admitted no more while it drains
        complete(stack, "drain", [1, 2, 3], 2)
    assert refused.value.body["param"] == "model", refused.value.body
    assert runner.is_alive() and unloading.is_alive()  # (the drain was under way)
    runner.join(120)
    unloading.join(120)
    assert streamed and streamed[0][0] == "ok" and len(streamed[0][1]) == 400, streamed
    assert unloaded[0][0] == 200, unloaded
    assert "drain" not in {m.id for m in sdk(stack).models.list().data}
    assert complete(stack, "tiny", [1, 2, 3], 2).choices[0].token_ids  # the base serves on


def test_what_outlasts_the_drain_timeout_ends_with_an_error(stack, adapters):
    load(stack, "slow", adapters["second"])
    first, streamed = threading.Event(), []
    runner = threading.Thread(target=_stream, args=(stack, "slow", [7, 8, 9, 10], 480, first, streamed))
    runner.start()
    assert first.wait(60)
    began = time.time()
    with grpc.insecure_channel(stack.ready["scheduler"]) as channel:
        scheduler_pb2_grpc.SchedulerStub(channel).UnloadLoraAdapter(
            worker_pb2.LoraAdapterRequest(lora_name="slow", drain_timeout_s=0.5),
            timeout=60,
            metadata=((INTERNAL_TOKEN_HEADER, TOKEN),),
        )
    took = time.time() - began
    runner.join(60)
    assert 0.5 <= took < 10, took
    assert streamed[0][0] == "error" and "slow" in streamed[0][1] and len(streamed[0][2]) < 480, streamed
    # the gateway learns the adapter is gone from the scheduler
    assert "slow" not in {m.id for m in sdk(stack).models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(stack, "slow", [1, 2, 3], 2)


def test_a_stage_that_lost_an_adapter_fails_no_request_of_the_others(stack, model_dir, adapters):
    """A stage that no longer holds an adapter the scheduler serves (unloaded behind the
    scheduler's back here; a restart, in the chaos suite) fails the step naming it: the
    scheduler takes that as the stages being out of step with it, loads the adapter again,
    and every request, of the base, of other adapters and of that one, completes."""
    from services.pb import worker_pb2_grpc

    load(stack, "lost", adapters["first"])
    try:
        with grpc.insecure_channel(stack.ready["workers"][1]) as channel:
            worker_pb2_grpc.StageWorkerStub(channel).UnloadLoraAdapter(
                worker_pb2.LoraAdapterRequest(lora_name="lost"), timeout=30, metadata=((INTERNAL_TOKEN_HEADER, TOKEN),)
            )
        work = [(model, [3 + i, 40 + i, 77, 5 + 2 * i]) for i in range(4) for model in ("tiny", "static", "lost")]
        threads_out: list = [None] * len(work)

        def one(i: int) -> None:
            try:
                threads_out[i] = ("ok", complete(stack, work[i][0], work[i][1], 8).choices[0].token_ids)
            except openai.APIError as exc:
                threads_out[i] = ("error", str(exc))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(o is not None and o[0] == "ok" for o in threads_out), threads_out
        check_greedy(merged_model(model_dir, adapters["first"]), work[2][1], threads_out[2][1])
    finally:
        unload(stack, "lost")
