"""Every served architecture through `pagoda serve` (real processes, the official `openai`
client, concurrent requests): a tiny random model of each, built by `transformers` itself
from a config (tests/support/archs.py: several layers of each attention type, windows
shorter than the prompts), gives transformers' greedy continuation (float32, the tie rule)
at one and two pipeline stages, and at two tensor-parallel ranks for Qwen3 and Gemma 3; the
mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss) likewise, Qwen3-MoE and gpt-oss at two ranks too,
and Qwen3-MoE with its experts split whole between the two ranks (expert parallelism).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.archs import ARCH_CONFIGS, MOE_CONFIGS, make_arch_model
from support.reference import HFReference
from support.stack import start_serve

# Llama and Qwen2 are served at one stage by many other tests (tests/e2e/test_tensor_parallel.py,
# test_scheduler_stack.py, ...): here at two, to keep the stacks this file starts to 14
NEW = ("mistral", "qwen3", "gemma2", "gemma3", "phi3")
CASES = (
    [(arch, "pp", 1) for arch in NEW]
    + [(arch, "pp", 2) for arch in ARCH_CONFIGS]
    + [("qwen3", "tp", 2), ("gemma3", "tp", 2)]
    + [(arch, "pp", size) for arch in MOE_CONFIGS for size in (1, 2)]
    + [("qwen3_moe", "tp", 2), ("gpt_oss", "tp", 2), ("qwen3_moe", "ep", 2)]
)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def built(model_factory, tmp_path_factory):
    tokenizer_dir = model_factory(arch="llama", vocab_size=1024)
    made: dict[str, tuple[str, HFReference]] = {}

    def get(arch: str) -> tuple[str, HFReference]:
        if arch not in made:
            folder = make_arch_model(tmp_path_factory.mktemp(f"served-{arch}"), arch, tokenizer_dir)
            made[arch] = (folder, HFReference(folder))
        return made[arch]

    return get


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(n)] for n in (2, 9, 30, 61, 75, 100)]


@pytest.mark.parametrize(("arch", "split", "size"), CASES)
def test_served_greedy_equals_transformers(built, tmp_path, arch, split, size):
    folder, ref = built(arch)
    flag = "--pipeline-parallel-size" if split == "pp" else "--tensor-parallel-size"
    ep = ["--enable-expert-parallel"] if split == "ep" else []  # TP ranks holding whole experts
    stack = start_serve(
        folder,
        tmp_path,
        "--dtype",
        "float32",
        flag,
        str(size),
        *ep,
        "--num-kv-blocks",
        "160",
        "--block-size",
        "8",
        "--max-num-batched-tokens",
        "48",
    )
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
    work = prompts()

    def one(prompt: list[int]) -> list[int]:
        done = client.completions.create(
            model=folder,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return done.choices[0].model_extra["token_ids"]

    try:
        with ThreadPoolExecutor(len(work)) as pool:  # concurrent: steps mix prefill chunks and decodes
            outputs = list(pool.map(one, work))
        stages = httpx.get(f"{stack.url}/debug/memory", timeout=30).json()["stages"]
    finally:
        stack.stop()
    for prompt, got in zip(work, outputs, strict=True):
        assert len(got) == MAX_TOKENS
        ref.compare(prompt, got)
    experts = [s["expert_weights_bytes"] for s in stages]  # what dominates an MoE model's memory
    if arch in MOE_CONFIGS:
        assert all(0 < e < s["weights_bytes"] for e, s in zip(experts, stages, strict=True)), stages
    else:
        assert experts == [0] * len(stages)


def test_a_gemma3_sequence_of_four_windows_holds_its_window_in_the_sliding_groups(built, tmp_path):
    """The KV groups (services/kv_layout.py), through the served stack: Gemma 3's four sliding
    layers share two sub-groups, its two full ones one; at 4x the window the KV service's
    statistics (/debug/memory) show the full sub-group holding every block and each sliding
    one `window / block_size + 1` at most, and the output is still transformers'."""
    import json
    import threading
    import urllib.request

    folder, ref = built("gemma3")
    window, bs = ARCH_CONFIGS["gemma3"]["sliding_window"], 8
    stack = start_serve(folder, tmp_path, "--dtype", "float32", "--num-kv-blocks", "160", "--block-size", str(bs))
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = prompts(3)[2]
    snapshots: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            with urllib.request.urlopen(f"{stack.url}/debug/memory?include_sequences=true", timeout=10) as r:
                memory = json.load(r)
            seqs = memory["kv_cache"]["sequences"]
            if seqs and seqs[0]["num_tokens"] >= 4 * window:
                snapshots.append(memory)
                return
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        got = client.completions.create(
            model=folder,
            prompt=prompt,
            max_tokens=4 * window + 40 - len(prompt),
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    finally:
        done.set()
        watcher.join()
        stack.stop()
    assert snapshots, "no statistics seen at 4x the window"
    kv = snapshots[0]["kv_cache"]
    assert kv["group_windows"] == [0, window, window]
    (seq,) = kv["sequences"]
    n, full = seq["num_tokens"], seq["num_blocks"] - seq["num_window_blocks"]
    assert -(-n // bs) <= full <= -(-(n + 1) // bs)  # every block (and one held ahead, async)
    per_group = seq["num_window_blocks"] / 2
    ahead = full - -(-n // bs)
    # every block the next query's window reaches, and what the window of the last append's
    # first position reached: window / block_size + 1 blocks, one more when that append
    # carried two tokens (async scheduling appends a placeholder step's token with the next)
    assert full - (n - window + 1) // bs <= per_group <= window // bs + 1 + 1 + ahead
    assert seq["num_blocks"] <= full + 2 * (window // bs + 2 + ahead) < 3 * full  # one table: 3 x full
    assert kv["num_slid_blocks"] >= 2 * (full - (window // bs + 2 + ahead))
    ref.compare(prompt, got.choices[0].model_extra["token_ids"])
