"""Mixtral: Llama's attention (with Mistral's window when the config sets one) and a
mixture-of-experts MLP on every layer: `num_local_experts` experts of `intermediate_size`,
`num_experts_per_tok` a token, weights renormalised. Checkpoints name the MLP
`block_sparse_moe` and each expert's projections `w1` (gate), `w3` (up), `w2` (down).

llama.cpp writes Mixtral as a `llama` GGUF file whose layers hold the experts
(`llama.expert_count`, `ffn_*_exps`; q/k rows permuted as for Llama): the registry serves a
`llama` file with experts as this architecture (`gguf_expert_names`)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from worker_svc.model_config import ModelConfig
from worker_svc.models.base import LLAMA_GGUF_LAYER_TENSORS, MOE_GGUF_LAYER_TENSORS, Architecture, GGUFField
from worker_svc.models.qwen3_moe import moe_config

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")
_STORED = {"gate": "w1", "up": "w3", "down": "w2"}


class Mixtral(Architecture):
    model_type = "mixtral"
    hf_names = ("MixtralForCausalLM",)
    gguf_names = ()
    gguf_expert_names = ("llama",)
    gguf_permuted_qk = True
    gguf_layer_tensors = {
        **{g: hf for g, hf in LLAMA_GGUF_LAYER_TENSORS.items() if not hf.startswith("mlp.")},
        **MOE_GGUF_LAYER_TENSORS,
    }

    @classmethod
    def gguf_config(cls, field: GGUFField, config: dict[str, Any]) -> None:
        config["num_local_experts"] = int(field("expert_count", 0))
        config["num_experts_per_tok"] = int(field("expert_used_count", 0))

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        moe = moe_config(raw, source, size_key="intermediate_size", renormalize=True)
        return replace(config, moe=moe)

    @classmethod
    def stored_names(cls, name: str) -> tuple[str, ...]:
        stored = _EXPERT.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{_STORED[m[2]]}.", name)
        stored = stored.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        return (name,) if stored == name else (stored, name)

    @classmethod
    def model_name(cls, stored: str) -> str:
        """The model's name of checkpoint tensor `stored` (`stored_names` read backwards)."""
        m = re.fullmatch(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(.*)", stored)
        if m is not None:
            proj = {v: k for k, v in _STORED.items()}[m[3]]
            return f"{m[1]}.mlp.experts.{m[2]}.{proj}_proj.{m[4]}"
        return stored.replace(".block_sparse_moe.gate.", ".mlp.gate.")
