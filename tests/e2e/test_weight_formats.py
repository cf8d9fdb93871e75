"""Every CPU weight format served end to end through the stack (`pagoda serve`: gateway,
scheduler, KV service, stages) at PP=1 and PP=2: bfloat16 (`--dtype bfloat16`: bfloat16
weights, float32 activations), int8 (`--quantization int8`, per output channel), the GGUF
block formats Q8_0 and Q4_1 held packed, and Q8_0 over bfloat16 KV pools
(`--kv-cache-dtype bfloat16`). The fixed text is held-out text of the trained
tiny model (support/trained.py); each stack scores it with vLLM's `prompt_logprobs` (the
prompt's positions through the paged KV and the stages' kernels), and the top token at
every position is compared with the float32 model's, computed once in process. The stage
statistics (`/debug/memory`) name the format each stage holds. And the exact path: a GGUF
file served with `--dtype float32` gives transformers' greedy tokens for the same file."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from support.logits import all_logits
from support.stack import start_serve

from wiring.tiny_train import held_out_windows
from worker_svc.checkpoints.loader import load_stage

TEXT_WINDOWS, TEXT_LEN = 3, 160  # 160-row prefills: PACKED_GEMM_MIN_ROWS (128) and above
# (name, served file or folder, extra flags, what /debug/memory reports, same-top bound); the
# bounds sit under what was measured here (in the comment) on this text: 477 positions
FORMATS = {
    "bfloat16": ("folder", ["--dtype", "bfloat16"], "bf16-weights", 0.98),  # measured 0.9937
    "int8": ("folder", ["--dtype", "float32", "--quantization", "int8"], "int8-per-channel", 0.97),  # 0.9874
    "Q8_0": ("Q8_0", [], "gguf:Q8_0", 0.97),  # measured 0.9916
    "Q4_1": ("Q4_1", [], "gguf:Q4_1", 0.88),  # measured 0.9434
    # bfloat16 KV pools (--kv-cache-dtype bfloat16) under Q8_0 weights
    "Q8_0+bf16-kv": ("Q8_0", ["--kv-cache-dtype", "bfloat16"], "gguf:Q8_0", 0.97),  # measured 0.9895
}


@pytest.fixture(scope="module")
def text(trained_model_dir):
    return held_out_windows(trained_model_dir, TEXT_WINDOWS, TEXT_LEN, seed=11)


@pytest.fixture(scope="module")
def float32_top(trained_model_dir, text):
    """The float32 model's most likely next token after each position of each window."""
    return all_logits(load_stage(trained_model_dir, dtype="float32"), text).argmax(-1).tolist()


@pytest.fixture(scope="module")
def gguf_files(trained_model_dir, tmp_path_factory):
    from wiring.gguf_export import write_gguf

    out = tmp_path_factory.mktemp("formats-gguf")
    return {q: str(write_gguf(trained_model_dir, out / f"trained-{q}.gguf", q)) for q in ("Q8_0", "Q4_1")}


def served_top(url: str, model: str, ids: list[int]) -> list[int]:
    """The stack's top token after each position but the last, from `prompt_logprobs`."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    scored = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    return [int(next(t for t, e in entry.items() if e["rank"] == 1)) for entry in scored[1:]]


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("name", list(FORMATS))
def test_format_serves_through_the_stack(name, pp, trained_model_dir, gguf_files, text, float32_top, tmp_path_factory):
    source, flags, reported, bound = FORMATS[name]
    model = trained_model_dir if source == "folder" else gguf_files[source]
    stack = start_serve(
        model,
        tmp_path_factory.mktemp(f"format-{name}-pp{pp}"),
        *flags,
        "--pipeline-parallel-size",
        str(pp),
        "--num-kv-blocks",
        "64",
    )
    try:
        stages = stack.get("/debug/memory")["stages"]
        assert [s["quantization"] for s in stages] == [reported] * pp, stages
        cfg = json.loads((Path(trained_model_dir) / "config.json").read_text())
        kv_bytes = 2 if "bf16-kv" in name else 4  # K and V of a block, every layer of the stage
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        assert [s["kv_block_bytes"] for s in stages] == [
            2 * (s["layers"][1] - s["layers"][0]) * 16 * cfg["num_key_value_heads"] * head_dim * kv_bytes
            for s in stages
        ], stages
        assert [s["kv_cache_dtype"] for s in stages] == ["bfloat16" if "bf16-kv" in name else "float32"] * pp
        agree = total = 0
        for ids, want in zip(text, float32_top, strict=True):
            got = served_top(stack.url, model, ids)
            agree += sum(a == b for a, b in zip(got, want[:-1], strict=True))
            total += len(got)
    finally:
        stack.stop()
    rate = agree / total
    print(f"{name} PP={pp}: same top token as float32 at {rate:.4f} of {total} positions")
    assert rate >= bound, (name, pp, rate)


def test_the_formats_differ_from_float32_where_they_should(trained_model_dir, text):
    """The comparison measures the formats: float32 served against itself agrees everywhere,
    and a model whose layers are perturbed by more than Q4's rounding does not."""
    ref = load_stage(trained_model_dir, dtype="float32")
    want = all_logits(ref, text).argmax(-1)
    with torch.no_grad():
        for layer in ref.model.layers.values():
            layer.mlp.down_proj.weight.mul_(4.0)
    assert (all_logits(ref, text).argmax(-1) == want).float().mean() < 0.9


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_served_gguf_at_float32_equals_transformers(qtype, gguf_factory, tmp_path_factory):
    """`pagoda serve file.gguf --dtype float32` on a tiny file the test converts itself:
    transformers' greedy continuation of the same GGUF (tie rule as everywhere), at PP=2."""
    from support.reference import HFReference

    path = gguf_factory(qtype, arch="llama")
    stack = start_serve(
        path,
        tmp_path_factory.mktemp(f"gguf-f32-{qtype}"),
        "--dtype",
        "float32",
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "64",
    )
    prompts = [[5, 17, 300, 2], list(range(40, 73))]
    try:
        outs = []
        for prompt in prompts:
            body = json.dumps(
                {
                    "model": path,
                    "prompt": prompt,
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
            ).encode()
            request = urllib.request.Request(f"{stack.url}/v1/completions", body, {"Content-Type": "application/json"})
            outs.append(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["token_ids"])
    finally:
        stack.stop()
    ref = HFReference(None, gguf_file=path)
    for prompt, tokens in zip(prompts, outs, strict=True):
        assert len(tokens) == 12
        ref.compare(prompt, tokens)
