"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and k head before rotary
(`q_norm`, `k_norm`), no q/k/v bias."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker_svc.model_config import ModelConfig
from worker_svc.models.base import LLAMA_GGUF_LAYER_TENSORS, Architecture
from worker_svc.models.qwen2 import no_window


class Qwen3(Architecture):
    model_type = "qwen3"
    hf_names = ("Qwen3ForCausalLM",)
    gguf_names = ("qwen3",)
    gguf_layer_tensors = {
        **LLAMA_GGUF_LAYER_TENSORS,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        return replace(no_window(raw, config, source, "Qwen3"), qk_norm=True)
