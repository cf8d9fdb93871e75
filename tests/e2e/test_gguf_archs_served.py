"""`pagoda serve tiny.gguf --dtype float32` of tiny Q4_K_M-style files (Q4_K, Q6_K and the
Q5_0/Q8_0 fallbacks) of a Llama, a Qwen3 and a Gemma 3 the test writes itself
(tests/unit/test_gguf_archs.py's shapes), and of a Qwen3-MoE (its experts stacked as
llama.cpp's ffn_*_exps, in Q4_K and the fallbacks): with concurrent requests at two pipeline
stages, transformers' greedy continuation of the same file (tie rule); and served at the
file's own types, each stage's weights hold at most 1.2x the file's tensor bytes
(/debug/memory, which reports the experts' share). The
Gemma 3 file carries a SentencePiece-style vocabulary (`tokenizer.ggml.model` "llama", byte
fallback), as real Gemma downloads do: its chat completions stream the text they return whole.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.archs import Q4_K_M_MODELS, QWEN3_MOE_GGUF, make_arch_model
from support.reference import HFReference
from support.spm import make_gemma_tokenizer
from support.stack import start_serve

from wiring.gguf_export import write_gguf
from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint

PROMPTS = [[5, 17, 300, 2], list(range(40, 73)), list(range(100, 190)), [7] * 60]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    tokenizer_dir = model_factory(arch="llama", vocab_size=1024)
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            folder = tmp_path_factory.mktemp(f"served-q4km-{arch}")
            if arch == "gemma3":  # Gemma's ids: <pad> 0, <eos> 1, <bos> 2
                source = make_arch_model(
                    folder / "hf",
                    arch,
                    make_gemma_tokenizer(folder / "tok"),
                    **Q4_K_M_MODELS[arch],
                    bos_token_id=2,
                    eos_token_id=1,
                    pad_token_id=0,
                )
            else:
                shape = QWEN3_MOE_GGUF if arch == "qwen3_moe" else Q4_K_M_MODELS[arch]
                source = make_arch_model(folder / "hf", arch, tokenizer_dir, **shape)
            made[arch] = str(write_gguf(source, folder / f"tiny-{arch}-Q4_K_M.gguf", "Q4_K_M"))
        return made[arch]

    return get


def _complete_all(stack, model: str) -> list[list[int]]:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)

    def one(prompt: list[int]) -> list[int]:
        done = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return done.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_moe"])
def test_served_q4_k_m_file_at_float32_equals_transformers(files, tmp_path, arch):
    path = files(arch)
    stack = start_serve(
        path,
        tmp_path,
        "--dtype",
        "float32",
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "96",
        "--block-size",
        "8",
    )
    try:
        outputs = _complete_all(stack, path)
    finally:
        stack.stop()
    # transformers' GGUF reader maps no `expert_feed_forward_length` for qwen3moe: told the file's
    told = {"moe_intermediate_size": QWEN3_MOE_GGUF["moe_intermediate_size"]} if arch == "qwen3_moe" else {}
    ref = HFReference(None, gguf_file=path, **told)
    for prompt, got in zip(PROMPTS, outputs, strict=True):
        assert len(got) == MAX_TOKENS
        ref.compare(prompt, got)


def test_served_at_its_own_types_a_stage_holds_at_most_1_2x_the_file(files, tmp_path):
    path = files("gemma3")
    stack = start_serve(path, tmp_path, "--num-kv-blocks", "256", "--block-size", "8")
    try:
        stages = stack.get("/debug/memory")["stages"]
        outputs = _complete_all(stack, path)
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
        ask = {
            "model": path,
            "messages": [{"role": "user", "content": "Grüße, 世界 🙂"}],
            "max_tokens": 24,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**ask)
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True) if c.choices
        )
    finally:
        stack.stop()
    assert whole.usage.prompt_tokens > 5 and whole.usage.completion_tokens > 0
    assert streamed == whole.choices[0].message.content
    assert all(len(o) == MAX_TOKENS for o in outputs)
    file_bytes = GGUFCheckpoint(path).tensor_bytes()
    assert len(stages) == 1 and "Q4_K" in stages[0]["quantization"], stages
    assert stages[0]["weights_bytes"] <= 1.2 * file_bytes, (stages[0]["weights_bytes"], file_bytes)


def test_a_served_moe_file_keeps_its_experts_packed_within_1_2x(files, tmp_path):
    path = files("qwen3_moe")
    stack = start_serve(path, tmp_path, "--num-kv-blocks", "128", "--block-size", "8")
    try:
        stages = stack.get("/debug/memory")["stages"]
        outputs = _complete_all(stack, path)
    finally:
        stack.stop()
    assert all(len(o) == MAX_TOKENS for o in outputs)
    file_bytes = GGUFCheckpoint(path).tensor_bytes()
    assert "Q4_K" in stages[0]["quantization"], stages
    assert stages[0]["weights_bytes"] <= 1.2 * file_bytes, (stages[0]["weights_bytes"], file_bytes)
    assert 0 < stages[0]["expert_weights_bytes"] < stages[0]["weights_bytes"]  # reported apart
