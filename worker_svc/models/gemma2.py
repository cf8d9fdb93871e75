"""Gemma 2: sliding-window and global layers alternating (`layer_types`), the sandwich
layer (norms before and after attention and MLP), norms scaling by (1 + w), GELU-tanh MLP,
embeddings scaled by sqrt(hidden), attention scale `query_pre_attn_scalar ** -0.5`, and
soft-capped attention scores and final logits (cap * tanh(x / cap)). llama.cpp stores the
norms as 1 + w already."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker_svc.layers.decoder import SandwichDecoderLayer
from worker_svc.model_config import FULL, SLIDING, ModelConfig, layer_types
from worker_svc.models.base import LLAMA_GGUF_LAYER_TENSORS, Architecture, GGUFField

GEMMA_GGUF_LAYER_TENSORS = {
    **{k: v for k, v in LLAMA_GGUF_LAYER_TENSORS.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def gemma_options(raw: dict[str, Any], config: ModelConfig, source: str, pattern: int) -> ModelConfig:
    """What Gemma 2 and 3 share; `pattern`: every `pattern`-th layer is global when the
    config lists no `layer_types`."""
    if "layer_types" not in raw or not raw["layer_types"]:
        raw = {**raw, "layer_types": [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_layers)]}
    scalar = raw.get("query_pre_attn_scalar")
    return replace(
        config,
        layer_types=layer_types(raw, source, config.num_layers),
        norm_offset=1.0,
        sandwich_norms=True,
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        embed_scale=config.hidden_size**0.5,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        final_logit_softcap=raw.get("final_logit_softcapping"),
    )


# the layer counts of the 27B models, whose attention scale llama.cpp takes from hidden / heads
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def gguf_query_pre_attn_scalar(model_type: str, config: dict[str, Any]) -> int:
    """The `query_pre_attn_scalar` llama.cpp attends with (llama-model.cpp: 1 / sqrt(head
    size), but 1 / sqrt(hidden / heads) for the 27B models, told by their layer count): a GGUF
    file has no key for it. Equal to the Hugging Face configs' value at every released size."""
    if config["num_hidden_layers"] == GGUF_27B_LAYERS[model_type]:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def gemma_gguf_config(field: GGUFField, config: dict[str, Any], pattern: int, model_type: str) -> None:
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["query_pre_attn_scalar"] = gguf_query_pre_attn_scalar(model_type, config)
    config["sliding_window_pattern"] = pattern
    for key, name in (
        ("attn_logit_softcapping", "attn_logit_softcapping"),
        ("final_logit_softcapping", "final_logit_softcapping"),
    ):
        value = field(name, None)
        if value is not None:
            config[key] = float(value)


class Gemma2(Architecture):
    model_type = "gemma2"
    hf_names = ("Gemma2ForCausalLM",)
    gguf_names = ("gemma2",)
    activations = ("gelu_pytorch_tanh",)
    act_key = "hidden_activation"
    layer = SandwichDecoderLayer
    gguf_layer_tensors = GEMMA_GGUF_LAYER_TENSORS
    gguf_norm_offset_stored = True

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        config = gemma_options(raw, config, source, pattern=2)
        return replace(config, attn_logit_softcap=raw.get("attn_logit_softcapping"))

    @classmethod
    def gguf_config(cls, field: GGUFField, config: dict[str, Any]) -> None:
        gemma_gguf_config(field, config, pattern=2, model_type=cls.model_type)
