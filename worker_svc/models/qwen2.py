"""Qwen2 / Qwen2.5: Llama's layer with q/k/v biases. The per-layer window some configs
offer (`use_sliding_window`) is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker_svc.errors import CheckpointError
from worker_svc.model_config import ModelConfig
from worker_svc.models.base import Architecture


def no_window(raw: dict[str, Any], config: ModelConfig, source: str, name: str) -> ModelConfig:
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{source}: {name} use_sliding_window=true is not supported")
    return replace(config, sliding_window=None)


class Qwen2(Architecture):
    model_type = "qwen2"
    hf_names = ("Qwen2ForCausalLM",)
    gguf_names = ("qwen2",)
    default_bias = True

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        return no_window(raw, config, source, "Qwen2")
