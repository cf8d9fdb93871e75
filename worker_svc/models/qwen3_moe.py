"""Qwen3-MoE: Qwen3's attention (q/k norms, no bias) with a mixture-of-experts MLP
(worker_svc/layers/moe.py) on every `decoder_sparse_step`-th layer not in `mlp_only_layers`:
`num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` a token, their
weights renormalised when `norm_topk_prob`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker_svc.errors import CheckpointError
from worker_svc.model_config import ModelConfig, MoEConfig
from worker_svc.models.base import MOE_GGUF_LAYER_TENSORS, GGUFField
from worker_svc.models.qwen3 import Qwen3


def moe_config(
    raw: dict[str, Any],
    source: str,
    *,
    size_key: str,
    renormalize: bool,
    sparse_layers: tuple[bool, ...] = (),
    shared_size: int = 0,
) -> MoEConfig:
    """The MoE fields of a config, checked: a ValueError naming the field. The expert count
    is `num_experts` (Qwen's hub configs) or `num_local_experts` (Mixtral's, and what
    transformers 5 writes for both)."""
    experts_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    num, top_k, size = raw.get(experts_key), raw.get("num_experts_per_tok"), raw.get(size_key)
    if not (
        isinstance(num, int) and isinstance(top_k, int) and isinstance(size, int) and 1 <= top_k <= num and size > 0
    ):
        raise CheckpointError(
            f"{source}: {experts_key}={num!r}, num_experts_per_tok={top_k!r}, {size_key}={size!r}: "
            "need 1 <= num_experts_per_tok <= experts and a positive expert size"
        )
    return MoEConfig(num, top_k, size, renormalize, shared_size, sparse_layers)


class Qwen3Moe(Qwen3):
    model_type = "qwen3_moe"
    hf_names = ("Qwen3MoeForCausalLM",)
    gguf_names = ("qwen3moe",)
    # llama.cpp's qwen3moe layers have no dense MLP: its names are the experts' only
    gguf_layer_tensors = {
        **{g: hf for g, hf in Qwen3.gguf_layer_tensors.items() if not hf.startswith("mlp.")},
        **MOE_GGUF_LAYER_TENSORS,
    }

    @classmethod
    def gguf_config(cls, field: GGUFField, config: dict[str, Any]) -> None:
        """llama.cpp's qwen3moe: every layer sparse, the top-k weights renormalised."""
        config["num_experts"] = int(field("expert_count", 0))
        config["num_experts_per_tok"] = int(field("expert_used_count", 0))
        config["moe_intermediate_size"] = int(field("expert_feed_forward_length", 0))
        config["norm_topk_prob"] = True

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or ())
        sparse = tuple((i + 1) % step == 0 and i not in dense for i in range(config.num_layers))
        moe = moe_config(
            raw,
            source,
            size_key="moe_intermediate_size",
            renormalize=bool(raw.get("norm_topk_prob", True)),
            sparse_layers=sparse,
        )
        return replace(super().configure(raw, config, source), moe=moe)
