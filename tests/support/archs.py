"""Tiny models of every served architecture, built by `transformers` itself from a config
(random weights, scaled so that logits are peaked: greedy decoding then means something),
saved with the tiny tokenizer of `wiring.tiny_model` (1,024 tokens) so that a stack can
serve them. `ARCH_CONFIGS` holds several layers of each attention type per architecture.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

VOCAB = 1024
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "max_position_embeddings": 2048,
}
SLIDING, FULL = "sliding_attention", "full_attention"

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3},
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "num_hidden_layers": 3,
        "sliding_window": 48,
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": 3,
        "tie_word_embeddings": True,
    },
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4},
    "gemma2": {
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "num_hidden_layers": 4,
        "sliding_window": 48,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 8.0,
        "layer_types": [SLIDING, FULL, SLIDING, FULL],
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 6,
        "sliding_window": 48,
        "query_pre_attn_scalar": 24,
        "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    },
    "phi3": {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "num_hidden_layers": 3,
        "sliding_window": 80,
        "original_max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
            "original_max_position_embeddings": 512,
        },
    },
}
# mixture-of-experts models (tests/unit/test_moe.py): enough experts that a step's rows
# spread over several, top-k > 1; Qwen3-MoE with a dense layer among the sparse ones
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
    },
    "mixtral": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "num_hidden_layers": 2,
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
    },
    # sliding and full layers alternating, a window the prompts outgrow, yarn rotary, and a
    # SwiGLU limit low enough that the clamp bites on these activations
    "gpt_oss": {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 3,
        "intermediate_size": 32,
        "sliding_window": 24,
        "swiglu_limit": 1.5,
        "layer_types": [SLIDING, FULL, SLIDING, FULL],
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 512,
            "rope_theta": 150000.0,
            "truncate": False,
        },
    },
}
LOGIT_STD = 4.0

# Q4_K_M-style GGUF test models (tests/unit/test_gguf_archs.py's docstring says why these shapes)
Q4_K_M_SHAPE = {"hidden_size": 256, "intermediate_size": 288}
Q4_K_M_MODELS = {
    "llama": {
        **Q4_K_M_SHAPE,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "qwen3": {
        **Q4_K_M_SHAPE,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
    },
    "gemma3": {
        **Q4_K_M_SHAPE,
        "num_hidden_layers": 12,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 48,
        "layer_types": None,
        "rope_parameters": None,
    },
}

# a Qwen3-MoE GGUF test model: experts' gate/up rows of 256 (Q4_K in a Q4_K_M file), down rows
# of 64 (the Q5_0 / Q8_0 fallback); transformers' GGUF reader must be told
# `moe_intermediate_size` (it maps no `expert_feed_forward_length` for qwen3moe)
QWEN3_MOE_GGUF = {
    **Q4_K_M_SHAPE,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_hidden_layers": 2,
    "mlp_only_layers": [],
    "moe_intermediate_size": 64,
}


def reference_maker(tmp_path_factory, tokenizer_dir: str | Path):
    """arch -> (its tiny model folder, transformers' reference of it), each made once: a
    module fixture's body."""
    from support.reference import HFReference

    made: dict[str, tuple[str, Any]] = {}

    def get(arch: str) -> tuple[str, Any]:
        if arch not in made:
            folder = make_arch_model(tmp_path_factory.mktemp(arch), arch, tokenizer_dir)
            made[arch] = (folder, HFReference(folder))
        return made[arch]

    return get


def make_arch_model(out_dir: str | Path, arch: str, tokenizer_dir: str | Path, seed: int = 0, **overrides: Any) -> str:
    """A checkpoint folder of architecture `arch` (an ARCH_CONFIGS key) with the tokenizer
    files of `tokenizer_dir`; returns its path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**_SHAPE, **(ARCH_CONFIGS | MOE_CONFIGS)[arch], **overrides}
    model_type = fields.pop("model_type")
    architectures = fields.pop("architectures")
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = architectures
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _peaked(model, config)
    out = Path(out_dir)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return str(out)


@torch.no_grad()
def _peaked(model: torch.nn.Module, config) -> None:
    """Weights that keep activations near unit scale and make final logits' std ~LOGIT_STD."""
    gemma = "gemma" in config.model_type
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.randn_like(p) * 0.1 + (0.0 if gemma else 1.0))
        elif name.endswith("bias"):
            p.copy_(torch.randn_like(p) * 0.1)
        elif "embed_tokens" in name:
            p.copy_(torch.randn_like(p) * (1.0 / config.hidden_size**0.5 if gemma else 1.0))
        elif name == "lm_head.weight":
            p.copy_(torch.randn_like(p) * LOGIT_STD / config.hidden_size**0.5)
        else:
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)  # fan-in (experts stacked: [E, out, in])
    if getattr(config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings().weight
        emb.mul_(LOGIT_STD / emb.std() / config.hidden_size**0.5)


def make_mxfp4_gpt_oss(out_dir: str | Path, float_dir: str | Path) -> str:
    """gpt-oss's own checkpoint format from a float one (`make_arch_model(..., "gpt_oss")`):
    each layer's experts as MXFP4 `<name>_blocks` / `<name>_scales` (rows the outputs, as
    openai/gpt-oss-20b stores them), `quantization_config` saying so; the rest unchanged."""
    from safetensors.torch import load_file, save_file

    from worker_svc.weights.mxfp4 import quantize_hf_mxfp4

    out, source = Path(out_dir), Path(float_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in load_file(str(source / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_hf_mxfp4(t.transpose(1, 2).contiguous())
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    return str(out)
