"""Llama (and models written as Llama: SmolLM2, TinyLlama, ...): the defaults of
`Architecture`. A pre-norm decoder, SiLU-gated MLP, rotary with the Llama 3 / YaRN /
linear scalings, no window. llama.cpp's converter permutes q/k rows (undone at load)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker_svc.model_config import ModelConfig
from worker_svc.models.base import Architecture


class Llama(Architecture):
    model_type = "llama"
    hf_names = ("LlamaForCausalLM",)
    gguf_names = ("llama",)
    gguf_permuted_qk = True

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        return replace(config, sliding_window=None)
