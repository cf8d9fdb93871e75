"""Mixture-of-experts (issue 36, first part): the MoE block (worker_svc/layers/moe.py) equals a
per-token reference for each router variant, with and without a shared expert, for batches
1-64; tiny random Qwen3-MoE and Mixtral models built by `transformers` give its greedy output
(float32, tie rule) through the paged, pipelined runtime at one and two stages, prefill whole
and chunked, torch and CPU attention; tensor-parallel shares split each expert like a dense
MLP."""

from __future__ import annotations

import pytest
import torch
from support.archs import MOE_CONFIGS, QWEN3_MOE_GGUF, make_arch_model, reference_maker
from support.reference import HFReference
from test_model_equivalence import NEW_TOKENS, make_prompts, run_runtime

from worker_svc.checkpoints.loader import load_stage
from worker_svc.layers.moe import MoE
from worker_svc.model_config import ModelConfig, MoEConfig
from worker_svc.models.registry import load_config


def _config(renormalize: bool, shared: int) -> ModelConfig:
    return ModelConfig(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        100,
        32,
        64,
        1,
        4,
        2,
        8,
        1e-6,
        256,
        False,
        False,
        moe=MoEConfig(16, 4, 24, renormalize, shared),
    )


def _per_token(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own, in float64: its top-k experts' outputs weighted."""
    out = []
    for row in x.double():
        probs = torch.softmax(row @ block.gate.weight.double().T, dim=-1)
        weights, experts = torch.topk(probs, block.top_k)
        if block.renormalize:
            weights = weights / weights.sum()
        acc = torch.zeros_like(row)
        for w, e in zip(weights, experts.tolist(), strict=True):
            mlp = block.experts[e]
            h = torch.nn.functional.silu(row @ mlp.gate_proj.weight.double().T) * (row @ mlp.up_proj.weight.double().T)
            acc += w * (h @ mlp.down_proj.weight.double().T)
        if block.shared_expert is not None:
            s = block.shared_expert
            h = torch.nn.functional.silu(row @ s.gate_proj.weight.double().T) * (row @ s.up_proj.weight.double().T)
            acc += torch.sigmoid(row @ block.shared_expert_gate.weight.double().T) * (h @ s.down_proj.weight.double().T)
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shared", [0, 40])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_block_equals_a_per_token_reference(renormalize, shared, rows):
    torch.manual_seed(rows + shared)
    block = MoE(_config(renormalize, shared))
    for p in block.parameters():
        p.data = torch.randn_like(p) / p.shape[-1] ** 0.5
    x = torch.randn(rows, 32)
    want = _per_token(block, x)
    torch.testing.assert_close(block(x).double(), want, rtol=1e-5, atol=1e-5)
    assert block.fuse()  # each expert's gate and up in one product: the same numbers
    torch.testing.assert_close(block(x).double(), want, rtol=1e-5, atol=1e-5)
    if rows == 64:  # the rows spread over most experts
        assert len(set(block.route(x)[1].flatten().tolist())) >= 12


@pytest.fixture(scope="module")
def tokenizer_dir(model_factory):
    return model_factory(arch="llama", vocab_size=1024)


@pytest.fixture(scope="module")
def references(tmp_path_factory, tokenizer_dir):
    return reference_maker(tmp_path_factory, tokenizer_dir)


CASES = [
    ("qwen3_moe", 1, 16, None, "cpu"),
    ("qwen3_moe", 2, 8, 7, "torch"),
    ("mixtral", 1, 16, 7, "torch"),
    ("mixtral", 2, 16, None, "cpu"),
    ("gpt_oss", 1, 16, None, "cpu"),
    ("gpt_oss", 2, 8, 7, "torch"),
]


@pytest.mark.parametrize(("arch", "num_stages", "block_size", "chunk", "backend"), CASES)
def test_greedy_equals_transformers(references, arch, num_stages, block_size, chunk, backend):
    model_dir, ref = references(arch)
    prompts = make_prompts(ref.model.config.vocab_size)
    outputs, _ = run_runtime(model_dir, num_stages, block_size, chunk, prompts, backend)
    diverged = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out) == NEW_TOKENS
        diverged += ref.compare(prompt, out).tie_divergences > 0
    assert diverged <= 1, f"{diverged} of {len(prompts)} prompts needed the tie rule"
    assert len({t for out in outputs for t in out}) >= 5, "every prompt gives the same tokens: a vacuous test"


def test_the_models_are_what_their_configs_say(references):
    qwen = load_stage(references("qwen3_moe")[0], dtype="float32")
    kinds = [type(layer.mlp).__name__ for layer in qwen.model.layers.values()]
    assert kinds == ["MoE", "MLP", "MoE"]  # mlp_only_layers [1]
    assert qwen.fused_decode is None  # float32 experts: the module path (packed ones: the native step)
    int8 = load_stage(references("qwen3_moe")[0], quantization="int8")  # the router packed too
    assert type(int8.model.layers["0"].mlp.gate).__name__ == "PackedLinear" and int8.fused_decode is not None
    mixtral_dir = references("mixtral")[0]
    from safetensors import safe_open

    with safe_open(f"{mixtral_dir}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.5.w3.weight" in names  # read as experts.5.up_proj
    config = load_config(mixtral_dir)
    assert config.moe == MoEConfig(6, 2, 48, True, 0, ())
    assert MOE_CONFIGS["mixtral"]["num_local_experts"] == 6


def test_tensor_parallel_ranks_split_each_expert_like_a_dense_mlp(references):
    model_dir = references("qwen3_moe")[0]
    whole = load_stage(model_dir, dtype="float32")
    halves = [load_stage(model_dir, dtype="float32", tp_rank=r, tp_size=2) for r in (0, 1)]
    w = whole.model.layers["0"].mlp.experts[3]
    parts = [h.model.layers["0"].mlp.experts[3] for h in halves]
    assert torch.equal(torch.cat([p.gate_proj.weight for p in parts]), w.gate_proj.weight)
    assert torch.equal(torch.cat([p.down_proj.weight for p in parts], dim=1), w.down_proj.weight)
    assert all(
        torch.equal(h.model.layers["0"].mlp.gate.weight, whole.model.layers["0"].mlp.gate.weight) for h in halves
    )  # the router is replicated


def test_gpt_oss_ranks_hold_their_heads_sinks_and_expert_columns_and_rank_0_the_biases(references):
    """Each rank's MoE output is a partial sum: the row-parallel biases (o_proj's, each
    expert's down_proj's) are rank 0's alone, the sinks go with their heads, and each
    expert's gate and up rows come out of the interleaved [hidden, 2I] checkpoint tensor."""
    model_dir, ref = references("gpt_oss")
    whole = load_stage(model_dir, dtype="float32")
    halves = [load_stage(model_dir, dtype="float32", tp_rank=r, tp_size=2) for r in (0, 1)]
    layer, parts = whole.model.layers["1"], [h.model.layers["1"] for h in halves]
    torch.testing.assert_close(torch.cat([p.self_attn.sinks for p in parts]), layer.self_attn.sinks)
    assert torch.equal(parts[0].self_attn.o_proj.bias, layer.self_attn.o_proj.bias)
    assert not parts[1].self_attn.o_proj.bias.any()
    hf = ref.model.model.layers[1].mlp.experts
    assert torch.equal(layer.mlp.experts[5].up_proj.weight, hf.gate_up_proj[5][:, 1::2].T)
    assert torch.equal(layer.mlp.experts[5].down_proj.bias, hf.down_proj_bias[5])
    x = torch.randn(9, whole.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(sum(p.mlp(x) for p in parts), layer.mlp(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.mlp(x), ref.model.model.layers[1].mlp(x[None])[0][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_ranks_hold_whole_experts_whose_outputs_sum_to_the_layer(references, arch):
    """--enable-expert-parallel: rank r holds experts [r E/2, (r+1) E/2) whole (named as the
    checkpoint names them; the others empty places), each its own experts' biases, and the
    ranks' partial outputs (the stage's all-reduce sums them) give the whole layer's."""
    model_dir, _ = references(arch)
    whole = load_stage(model_dir, dtype="float32")
    ranks = [load_stage(model_dir, dtype="float32", tp_rank=r, tp_size=2, expert_parallel=True) for r in (0, 1)]
    layer, parts = whole.model.layers["0"].mlp, [h.model.layers["0"].mlp for h in ranks]
    num = layer.num_experts
    assert [list(p.local) for p in parts] == [list(range(num // 2)), list(range(num // 2, num))]
    held = [{n.split(".")[1] for n, _ in p.named_parameters() if n.startswith("experts.")} for p in parts]
    assert held == [{str(e) for e in p.local} for p in parts]
    e = num - 1
    assert torch.equal(parts[1].experts[e].down_proj.weight, layer.experts[e].down_proj.weight)  # whole
    if arch == "gpt_oss":  # an expert's row-parallel bias belongs to the rank holding it
        assert torch.equal(parts[1].experts[e].down_proj.bias, layer.experts[e].down_proj.bias)
    x = torch.randn(17, whole.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(parts[0](x) + parts[1](x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory, tokenizer_dir):
    """A Qwen3-MoE checkpoint as Q8_0 and Q4_K_M GGUF files (experts stacked, llama.cpp's
    `ffn_*_exps`), and transformers reading each."""
    from wiring.gguf_export import write_gguf

    folder = tmp_path_factory.mktemp("moe-gguf")
    source = make_arch_model(folder / "hf", "qwen3_moe", tokenizer_dir, **QWEN3_MOE_GGUF)
    return {q: write_gguf(source, folder / f"tiny-qwen3moe-{q}.gguf", q) for q in ("Q8_0", "Q4_K_M")}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_a_moe_gguf_file_at_float32_equals_transformers_reading_it(moe_files, qtype):
    from wiring.model_source import prepare_gguf

    path = moe_files[qtype]
    # transformers' GGUF reader maps no `expert_feed_forward_length` for qwen3moe (it takes its
    # config's default, 768, right for Qwen3-30B-A3B only): it is told the file's
    ref = HFReference(None, gguf_file=path, moe_intermediate_size=QWEN3_MOE_GGUF["moe_intermediate_size"])
    prompts = make_prompts(ref.model.config.vocab_size)[:4]
    outputs, _ = run_runtime(str(prepare_gguf(path)), 2, 16, 7, prompts, "torch")
    for prompt, out in zip(prompts, outputs, strict=True):
        ref.compare(prompt, out)
    assert len({t for out in outputs for t in out}) >= 5


def test_a_moe_gguf_file_at_its_own_types_keeps_the_experts_packed(moe_files):
    from wiring.model_source import prepare_gguf
    from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from worker_svc.layers.moe import expert_weight_bytes
    from worker_svc.weights.packed import PackedLinear
    from worker_svc.weights.quantization import weight_bytes

    path = moe_files["Q4_K_M"]
    stage = load_stage(prepare_gguf(path))
    experts = stage.model.layers["0"].mlp.experts
    assert all(isinstance(e.gate_proj, PackedLinear) and isinstance(e.down_proj, PackedLinear) for e in experts)
    assert not isinstance(stage.model.layers["0"].mlp.gate, PackedLinear)  # the router stays float32
    assert {"Q4_K"} <= set(stage.weight_format.removeprefix("gguf:").split("/"))
    assert weight_bytes(stage) <= 1.2 * GGUFCheckpoint(path).tensor_bytes()
    # the experts' bytes (StageLoadInfo.expert_weights_bytes, /debug/memory): the stacked
    # `ffn_*_exps` tensors' packed bytes, a share of the whole
    ckpt = GGUFCheckpoint(path)
    exps = sum(int(t.n_bytes) for name, t in ckpt._tensors.items() if "_exps." in name)
    assert expert_weight_bytes(stage) == exps < weight_bytes(stage)


def test_a_mixtral_gguf_file_is_a_llama_file_with_experts_read_as_mixtral(references, tmp_path):
    """llama.cpp writes Mixtral as `llama` with `ffn_*_exps` and an expert count: served as
    Mixtral, at F32 it equals transformers on the folder it was written from (q/k rows
    permuted and back, experts stacked and back); at Q4_K_M the experts stay packed."""
    from wiring.gguf_export import write_gguf
    from wiring.model_source import prepare_gguf
    from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from worker_svc.weights.packed import PackedLinear

    model_dir, ref = references("mixtral")
    f32 = write_gguf(model_dir, tmp_path / "tiny-mixtral-F32.gguf", "F32")
    ckpt = GGUFCheckpoint(f32)
    assert ckpt.architecture == "llama" and ckpt.arch.model_type == "mixtral"
    assert "blk.0.ffn_gate_exps.weight" in ckpt._tensors
    prompts = make_prompts(ref.model.config.vocab_size)[:4]
    outputs, _ = run_runtime(str(prepare_gguf(f32)), 2, 16, 7, prompts, "torch")
    for prompt, out in zip(prompts, outputs, strict=True):
        ref.compare(prompt, out)
    q4 = load_stage(prepare_gguf(write_gguf(model_dir, tmp_path / "tiny-mixtral-Q4_K_M.gguf", "Q4_K_M")))
    # (gate and up: rows of 64, whole blocks of Q4_K_M's fallback; down's 48 columns stay F32)
    assert all(isinstance(e.gate_proj, PackedLinear) for e in q4.model.layers["1"].mlp.experts)


@pytest.fixture(scope="module")
def mxfp4(references, tmp_path_factory):
    """gpt-oss with MXFP4 experts (its own checkpoint format), and transformers reading it
    (dequantized: it has no MXFP4 kernel for the CPU)."""
    from support.archs import make_mxfp4_gpt_oss
    from transformers import Mxfp4Config

    folder = make_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt-oss-mxfp4"), references("gpt_oss")[0])
    return folder, HFReference(folder, quantization_config=Mxfp4Config(dequantize=True))


def test_gpt_oss_mxfp4_experts_at_float32_equal_transformers_reading_them(mxfp4):
    folder, ref = mxfp4
    prompts = make_prompts(ref.model.config.vocab_size)[:6]
    outputs, _ = run_runtime(folder, 2, 8, 7, prompts, "cpu", dtype="float32")
    for prompt, out in zip(prompts, outputs, strict=True):
        ref.compare(prompt, out)
    assert len({t for out in outputs for t in out}) >= 5


def test_gpt_oss_mxfp4_experts_stay_packed_and_close(mxfp4):
    """At --dtype auto the experts stay MXFP4 (17 bytes a block of 32 values) and multiply
    with the native kernel (int8 activations): measured against the dequantized stage."""
    from support.logits import all_logits

    from worker_svc.layers.moe import expert_weight_bytes
    from worker_svc.weights.packed import PackedLinear

    folder, ref = mxfp4
    packed, exact = load_stage(folder), load_stage(folder, dtype="float32")
    experts = packed.model.layers["0"].mlp.experts
    assert all(isinstance(e.gate_proj, PackedLinear) and e.gate_proj.qtype == "MXFP4" for e in experts)
    assert packed.weight_format == "mxfp4" and experts[2].down_proj.bias is not None
    values = sum(
        p.numel() for m in exact.modules() if isinstance(m, MoE) for p in m.experts.parameters() if p.dim() == 2
    )
    assert expert_weight_bytes(packed) <= 1.2 * values * 17 / 32 < expert_weight_bytes(exact) / 6
    seqs = torch.randint(3, ref.model.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(5)).tolist()
    got, want = all_logits(packed, seqs), all_logits(exact, seqs)
    same = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    # the same weights; only the activations' int8 rounding differs (measured: 1.0, KL 6e-8)
    assert same >= 0.99 and float(kl) < 1e-4, (same, float(kl))


def test_a_quantized_checkpoint_of_a_format_not_read_is_refused_naming_it(references):
    import json
    from pathlib import Path

    from worker_svc.errors import CheckpointError
    from worker_svc.models.registry import read_config

    raw = json.loads(Path(references("gpt_oss")[0], "config.json").read_text())
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not read"):
        read_config({**raw, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert read_config({**raw, "quantization_config": {"quant_method": "mxfp4"}}).moe is not None
