"""Sampling defaults end to end (issue 35, item 4): `pagoda serve` on a GGUF file (the default
model's kind: no generation config) applies llama.cpp server's defaults to the fields a
request leaves out, says so in its start banner and in `/v1/models`, and a request's own
fields win; `--generation-config vllm` applies none. Driven by the official `openai` SDK with
fixed seeds: seeded draws depend only on (seed, choice, position), so two requests that
sample alike give the same tokens.
"""

from __future__ import annotations

import openai
import pytest
from support.stack import start_serve

LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
SEEDS = (1, 2, 3, 4)
ARGS = ("--num-kv-blocks", "64", "--num-threads", "1", "--max-model-len", "256", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def gguf(gguf_factory):
    return gguf_factory("Q8_0", arch="llama")


@pytest.fixture(scope="module")
def stacks(gguf, tmp_path_factory):
    """The same file served twice: with the defaults (auto) and with vLLM's (none)."""
    auto = start_serve(gguf, tmp_path_factory.mktemp("defaults-auto"), *ARGS)
    try:
        none = start_serve(gguf, tmp_path_factory.mktemp("defaults-vllm"), *ARGS, "--generation-config", "vllm")
    except Exception:
        auto.stop()
        raise
    yield auto, none
    for stack in (auto, none):
        stack.stop()


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="none")


def _tokens(stack, seed: int, **sampling) -> list[int]:
    out = _client(stack).completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=24,
        seed=seed,
        extra_body={
            "ignore_eos": True,
            "return_token_ids": True,
            **{k: v for k, v in sampling.items() if k in ("top_k", "min_p")},
        },
        **{k: v for k, v in sampling.items() if k in ("temperature", "top_p")},
    )
    return out.choices[0].token_ids


def test_a_request_without_sampling_fields_samples_with_llama_cpps_defaults(stacks):
    auto, _ = stacks
    for seed in SEEDS:
        assert _tokens(auto, seed) == _tokens(auto, seed, **LLAMA_CPP), seed


def test_a_requests_own_fields_win(stacks):
    auto, none = stacks
    # every field given: as the server without defaults samples a request that gives none
    for seed in SEEDS:
        assert _tokens(auto, seed, **NEUTRAL) == _tokens(none, seed), seed
    # one field given: it wins, the others keep their defaults (top_k 1 is greedy)
    assert _tokens(auto, 5, top_k=1) == _tokens(auto, 5, temperature=0.0)
    # and the defaults did change what is sampled
    assert any(_tokens(auto, seed) != _tokens(none, seed) for seed in SEEDS)


def test_the_banner_and_v1_models_say_which_defaults_apply(stacks):
    auto, none = stacks
    model = _client(auto).models.retrieve("tiny")
    assert model.model_extra["sampling_defaults"] == {
        **LLAMA_CPP,
        "repetition_penalty": None,
        "source": "llama.cpp's, for a GGUF file",
    }
    listed = _client(none).models.list().data[0]
    assert listed.model_extra["sampling_defaults"]["temperature"] is None
    assert (
        "sampling defaults: temperature 0.8, top_p 0.95, top_k 40, min_p 0.05 (llama.cpp's"
        in (auto.logs / "serve.log").read_text()
    )
    assert "sampling defaults: none (temperature 1, no truncation)" in (none.logs / "serve.log").read_text()
