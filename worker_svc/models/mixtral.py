"""Mixtral: Llama's attention (with Mistral's window when the config sets one) and a
mixture-of-experts MLP on every layer: `num_local_experts` experts of `intermediate_size`,
`num_experts_per_tok` a token, weights renormalised. Checkpoints name the MLP
`block_sparse_moe` and each expert's projections `w1` (gate), `w3` (up), `w2` (down)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from worker_svc.model_config import ModelConfig
from worker_svc.models.base import Architecture
from worker_svc.models.qwen3_moe import moe_config

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")
_STORED = {"gate": "w1", "up": "w3", "down": "w2"}


class Mixtral(Architecture):
    model_type = "mixtral"
    hf_names = ("MixtralForCausalLM",)
    gguf_names = ()
    gguf_permuted_qk = True

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        moe = moe_config(raw, source, size_key="intermediate_size", renormalize=True)
        return replace(config, moe=moe)

    @classmethod
    def stored_names(cls, name: str) -> tuple[str, ...]:
        stored = _EXPERT.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{_STORED[m[2]]}.", name)
        stored = stored.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        return (name,) if stored == name else (stored, name)
