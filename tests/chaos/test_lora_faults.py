"""Stage restarts with LoRA adapters loaded at run time, under load (issue 35's chaos cases).

`pagoda serve --enable-lora` at PP=2 with one adapter from `--lora-modules` and one loaded
through `/v1/load_lora_adapter`; a burst of greedy completions under the base model and both
adapters, with embeddings under the runtime one, and a stage worker killed (SIGKILL) in it:

- every request completes, each output identical to an undisturbed run's (which peft's
  merged models confirm): the restarted stage gets back the runtime adapter, and no
  adapter's trouble fails a step of the others (item 2); the embeddings under the adapter
  are its own (item 3);
- afterwards the adapter reloaded under its name with other weights answers as the new
  weights, with no prefix-cache block of the old (item 1);
- an adapter that cannot be reloaded (its folder is gone) is dropped everywhere at once:
  `/v1/models` no longer lists it, requests under it are 404, unload says 404 and a load
  under its name works again, while every other request completes unchanged (item 2).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from support.lora import check_greedy, make_adapter, merged_model, pooled_last
from support.stack import profile, start_serve
from test_faults import restarted, wait_running

NUM_REQUESTS = 24 if profile() == "quick" else 96
MAX_TOKENS = 32 if profile() == "quick" else 96
MODELS = ("tiny", "static", "rt")
ADAPTERS = {
    "static": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=21),
    "rt": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"], seed=22),
    "other": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], seed=23),
}


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos-adapters")
    return {name: make_adapter(model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def stack(model_dir, adapters, tmp_path_factory):
    s = start_serve(
        model_dir,
        tmp_path_factory.mktemp("chaos-lora"),
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "512",
        "--num-threads",
        "1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "8",
        "--allow-runtime-lora-updating",
        "--lora-modules",
        f"static={adapters['static']}",
        "--max-restarts",
        "20",
        "--step-timeout-s",
        "3",
    )
    assert post(s, "/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": adapters["rt"]})[0] == 200
    yield s
    s.stop()


def post(stack, path: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        f"{stack.url}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=180) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 480 + 3 for j in range(6 + i % 11)]


def work():
    """The burst: (kind, model, prompt) for completions under each model in turn, and an
    embedding under the runtime adapter and the base every fourth."""
    items = []
    for i in range(NUM_REQUESTS):
        items.append(("complete", MODELS[i % len(MODELS)], prompt(i)))
        if i % 4 == 0:
            items.append(("embed", ("rt", "tiny")[i // 4 % 2], prompt(i)))
    return items


def run_all(stack, items, during=None):
    """Every item at once; `during()` once the stack is busy. Each outcome: ("ok", tokens or
    vector) or ("error", what)."""
    c = client(stack)

    def one(item):
        kind, model, ids = item
        try:
            if kind == "embed":
                r = c.embeddings.create(model=model, input=[ids], encoding_format="float")
                return ("ok", torch.tensor(r.data[0].embedding))
            r = c.completions.create(
                model=model,
                prompt=ids,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return ("ok", r.choices[0].token_ids)
        except (openai.APIError, openai.APIConnectionError) as exc:
            return ("error", f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(len(items)) as pool:
        futures = [pool.submit(one, item) for item in items]
        if during is not None:
            time.sleep(0.2)
            wait_running(stack, futures)
            during()
        return [f.result(timeout=300) for f in futures]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.allclose(a, b, atol=1e-5, rtol=0)
    return a == b


@pytest.fixture(scope="module")
def baseline(stack, model_dir, adapters):
    items = work()
    outcomes = run_all(stack, items)
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    for model in MODELS:  # one completion under each, against peft
        i = next(i for i, (kind, m, _) in enumerate(items) if kind == "complete" and m == model)
        check_greedy(merged_model(model_dir, adapters.get(model)), items[i][2], outcomes[i][1])
    i = next(i for i, (kind, m, _) in enumerate(items) if kind == "embed" and m == "rt")  # the adapter's vector
    assert torch.allclose(
        outcomes[i][1], pooled_last(merged_model(model_dir, adapters["rt"]), items[i][2]), atol=1e-5, rtol=0
    )
    return items, [value for _, value in outcomes]


def models(stack) -> set[str]:
    return {m.id for m in client(stack).models.list().data}


def kill(stack, stage: int) -> int:
    victim = stack.service_pid("worker", stage)
    os.kill(victim, signal.SIGKILL)
    return victim


def check_burst(name, outcomes, want) -> None:
    errors = [o for o in outcomes if o[0] != "ok"]
    print(f"\n[chaos] {name}: {len(outcomes)} requests, {len(outcomes) - len(errors)} completed, {len(errors)} errors")
    assert not errors, errors
    assert all(same(got, w) for (_, got), w in zip(outcomes, want, strict=True)), (
        "outputs differ from the undisturbed run"
    )


@pytest.mark.parametrize("stage", [1, 0])
def test_a_stage_restart_keeps_the_runtime_adapter_and_fails_nothing(stack, baseline, model_dir, adapters, stage):
    items, want = baseline
    victims = []
    outcomes = run_all(stack, items, during=lambda: victims.append(kill(stack, stage)))
    stack.wait_serving(60)
    check_burst(f"SIGKILL worker-{stage} with a runtime adapter", outcomes, want)
    assert restarted(stack, "worker", stage, victims[0], 60)
    stack.wait_serving(60)
    # the restarted stage serves the runtime adapter: the same answers again
    check_burst(f"after the restart of worker-{stage}", run_all(stack, items), want)
    assert {"rt", "static"} <= models(stack)

    # the name reloaded with other weights: the new weights' answer, no old block
    ids = list(range(200, 244))
    c = client(stack)
    c.completions.create(model="rt", prompt=ids, max_tokens=1)  # its prefix cached under the old weights
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "rt"})[0] == 200
    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": adapters["other"]})[0] == 200
    out = c.completions.create(
        model="rt", prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    check_greedy(merged_model(model_dir, adapters["other"]), ids, out.choices[0].token_ids)
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "rt"})[0] == 200
    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": adapters["rt"]})[0] == 200


def test_an_adapter_that_cannot_come_back_is_dropped_everywhere(stack, baseline, adapters, tmp_path):
    items, want = baseline
    folder = shutil.copytree(adapters["other"], tmp_path / "gone")
    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(folder)})[0] == 200
    shutil.rmtree(folder)  # a restarted stage cannot load it again
    victims = []
    outcomes = run_all(stack, items, during=lambda: victims.append(kill(stack, 1)))
    stack.wait_serving(60)
    check_burst("SIGKILL worker-1 with an adapter that cannot be reloaded", outcomes, want)
    assert restarted(stack, "worker", 1, victims[0], 60)
    stack.wait_serving(60)
    deadline = time.time() + 30  # (the scheduler reconnects once it notices the restart)
    while "gone" in models(stack) and time.time() < deadline:
        time.sleep(0.2)
    assert "gone" not in models(stack) and {"rt", "static"} <= models(stack)
    with pytest.raises(openai.NotFoundError):
        client(stack).completions.create(model="gone", prompt=[1, 2, 3], max_tokens=2)
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "gone"})[0] == 404
    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": adapters["other"]})[0] == 200
    assert client(stack).completions.create(model="gone", prompt=[1, 2, 3], max_tokens=2).choices[0].text is not None
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "gone"})[0] == 200
    check_burst("after dropping an adapter", run_all(stack, items), want)
