"""Every served architecture, a tiny random model built by `transformers` itself from a
config (tests/support/archs.py: several layers of each attention type, 1,024 tokens), gives
greedy output equal to transformers' (float32, the tie rule) through the paged, pipelined
runtime: one and two stages, prefill in one piece and in chunks, prompts past the sliding
windows, the native CPU decode kernel and the torch reference. The registry refuses what it
does not serve, naming the field and listing what it does.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.archs import ARCH_CONFIGS, reference_maker
from support.reference import HFReference
from test_model_equivalence import NEW_TOKENS, make_prompts, run_runtime

from worker_svc.checkpoints.loader import load_stage
from worker_svc.errors import CheckpointError
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.models.registry import ARCHITECTURES, BY_GGUF_NAME, BY_HF_NAME, load_config

NEW_ARCHS = ("qwen3", "gemma2", "gemma3", "phi3")
# (arch, stages, block size, chunk, backend)
CASES = (
    [(a, 1, 16, None, "cpu") for a in ARCH_CONFIGS]
    + [(a, 2, 32, 7, "torch") for a in NEW_ARCHS]
    + [("gemma3", 2, 1, None, "cpu"), ("qwen3", 2, 16, 7, "cpu")]
)


@pytest.fixture(scope="module")
def tokenizer_dir(model_factory):
    return model_factory(arch="llama", vocab_size=1024)


@pytest.fixture(scope="module")
def references(tmp_path_factory, tokenizer_dir):
    return reference_maker(tmp_path_factory, tokenizer_dir)


@pytest.mark.parametrize(("arch", "num_stages", "block_size", "chunk", "backend"), CASES)
def test_greedy_equals_transformers(references, arch, num_stages, block_size, chunk, backend):
    model_dir, ref = references(arch)
    prompts = make_prompts(ref.model.config.vocab_size)
    outputs, driver = run_runtime(model_dir, num_stages, block_size, chunk, prompts, backend)
    assert any(r.mixes_prefill_and_decode and len(r.entries) >= 3 for r in driver.records)
    diverged = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out) == NEW_TOKENS
        diverged += ref.compare(prompt, out).tie_divergences > 0
    assert diverged <= 1, f"{diverged} of {len(prompts)} prompts needed the tie rule"
    assert len({t for out in outputs for t in out}) >= 5, "every prompt gives the same tokens: a vacuous test"


def test_the_models_have_what_each_architecture_adds(references):
    """The tiny configs exercise the options: windows shorter than the prompts, both
    attention types, soft-capping, q/k norms, fused checkpoint tensors, LongRoPE."""
    qwen3 = load_stage(references("qwen3")[0], dtype="float32")
    assert qwen3.model.layers["0"].self_attn.q_norm is not None
    gemma3 = load_stage(references("gemma3")[0], dtype="float32")
    windows = [layer.self_attn.sliding_window for layer in gemma3.model.layers.values()]
    assert windows == [48, 48, None, 48, 48, None] and len(gemma3.rotaries) == 2
    gemma2 = load_stage(references("gemma2")[0], dtype="float32")
    assert gemma2.config.attn_logit_softcap == 5.0 and gemma2.config.final_logit_softcap == 8.0
    phi3_dir = references("phi3")[0]
    from safetensors import safe_open

    with safe_open(f"{phi3_dir}/model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.qkv_proj.weight" in f.keys()
    assert load_stage(phi3_dir, dtype="float32").config.rope.rope_type == "longrope"


def test_longrope_takes_the_long_factors_past_the_original_length(references):
    """Below original_max_position_embeddings (512 here) positions rotate by the short
    factors, from it on by the long ones, as transformers rotates a pass of them."""
    model_dir, ref = references("phi3")
    config = load_config(model_dir)
    rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
    hf = ref.model.model.rotary_emb
    x = torch.zeros(1, 1, dtype=torch.float32)
    for positions in (torch.arange(480, 512), torch.arange(512, 540)):
        hf_cos, hf_sin = hf(x, positions[None])
        cos, sin = rotary.cos_sin(positions, torch.float32)
        torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=0, atol=1e-6)
    short, long = rotary.cos_sin(torch.tensor([511, 512]), torch.float32)[0][:, 0]
    assert not torch.allclose(short, long, atol=0.05)  # the two tables differ


def test_every_architecture_is_in_the_registry():
    assert set(BY_HF_NAME) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Phi3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "GptOssForCausalLM",
    }
    assert {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"} <= set(BY_GGUF_NAME)
    assert len(ARCHITECTURES) == 10


def test_an_unknown_architecture_is_refused_naming_the_field(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"], "model_type": "falcon"}')
    start = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        load_config(tmp_path)
    assert time.monotonic() - start < 2
    message = str(err.value)
    assert "architectures" in message and "FalconForCausalLM" in message
    assert "Qwen3ForCausalLM" in message and "Gemma3ForCausalLM" in message


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_max_model_len_is_the_architectures_own_field(references, arch):
    from wiring.kv_pool import model_max_len

    folder, ref = references(arch)
    assert model_max_len(folder) == ref.model.config.max_position_embeddings == 2048


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_native_decode_step_equals_the_module_path(references, arch):
    """The one-call native decode step (worker_svc/models/fused_decode.py) takes the new
    architectures' layers (q/k norms, sandwich norms, GELU-tanh, per-layer windows and
    rotary tables, Gemma 2's soft-capped scores) and computes what their modules compute
    (the torch path's soft-capping included), up to float rounding, on bfloat16 weights,
    with contexts past the windows."""
    from test_gguf import _decode_logits

    folder = references(arch)[0]
    fused, plain = load_stage(folder, dtype="bfloat16"), load_stage(folder, dtype="bfloat16")
    assert fused.fused_decode is not None
    plain.fused_decode = None
    calls = []
    native = fused.fused_decode.forward
    fused.fused_decode.forward = lambda *a: calls.append(1) or native(*a)
    got = _decode_logits(fused, steps=8, lengths=(60, 90, 100))
    assert len(calls) == 8  # every decode step went through the native call
    for a, b in zip(got, _decode_logits(plain, steps=8, lengths=(60, 90, 100)), strict=True):
        scale = b.abs().max()
        assert ((a - b).abs().max() / scale).item() < 1e-4, ((a - b).abs().max(), scale)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_phi3_adapter_of_its_fused_modules_equals_peft(references, tmp_path):
    """A PEFT adapter of Phi-3's fused `qkv_proj` and `gate_up_proj` (and o_proj, down_proj)
    is served as the adapters of their parts (B's rows split): one forward under it equals
    peft's merged model."""
    from support.lora import make_adapter, merged_model, reference_logits
    from test_lora import MAX_RANK, Batch

    from worker_svc.weights.lora import LoraBank, LoraStep, token_slots
    from worker_svc.weights.lora_adapter import load_adapter

    folder = references("phi3")[0]
    adapter = make_adapter(
        folder, tmp_path / "adapter", r=4, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    )
    model = load_stage(folder, dtype="float32")
    loaded = load_adapter(adapter, model.config, 0, model.end, max_rank=MAX_RANK)
    assert {t for _, t in loaded.weights} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    bank = LoraBank(model.config, 0, model.end, max_loras=2, max_rank=MAX_RANK)
    bank.add("a", loaded)
    prompt = list(range(20, 45))
    got = Batch(model, num_seqs=1, max_len=32).run(
        torch.tensor(prompt), [(0, len(prompt))], LoraStep(bank, token_slots([bank.slot_of("a")], [len(prompt)]))
    )
    want = reference_logits(merged_model(folder, adapter), prompt)
    base = reference_logits(merged_model(folder), prompt)
    assert (want - base).abs().max() > 0.5  # the adapter moves the logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path, tokenizer_dir):
    """`Gemma3ForConditionalGeneration` (Gemma 3 4B-27B's checkpoints) is served as its
    language model: `text_config`, the tensors under `language_model.`, greedy output on
    text prompts equal to transformers' multimodal model's."""
    import shutil

    from support.archs import _SHAPE, ARCH_CONFIGS, _peaked
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    text = {**_SHAPE, **{k: v for k, v in ARCH_CONFIGS["gemma3"].items() if k not in ("model_type", "architectures")}}
    config = Gemma3Config(
        text_config=text,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        image_token_index=1000,
        boi_token_index=1001,
        eoi_token_index=1002,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    _peaked(model.model.language_model, config.text_config)
    model.save_pretrained(tmp_path)
    shutil.copy(f"{tokenizer_dir}/tokenizer.json", tmp_path / "tokenizer.json")
    stage = load_stage(tmp_path, dtype="float32")
    assert stage.config.architecture == "Gemma3ForConditionalGeneration" and stage.config.num_layers == 6
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), Gemma3ForConditionalGeneration)
    ref = HFReference(tmp_path)
    prompts = make_prompts(1000)[:5]
    outputs, _ = run_runtime(str(tmp_path), 2, 16, 7, prompts, "cpu")
    for prompt, out in zip(prompts, outputs, strict=True):
        ref.compare(prompt, out)
