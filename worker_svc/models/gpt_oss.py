"""gpt-oss: attention with q/k/v/o biases and a learned sink logit per head, sliding-window
(128) and full layers alternating, yarn rotary, and a mixture of experts on every layer
whose router takes the top k of its (biased) logits and then a softmax over those k, and
whose experts gate with a clamped SwiGLU and carry biases.

The checkpoint stacks each layer's experts: `mlp.experts.gate_up_proj` [E, hidden, 2I]
(transposed, gate and up columns interleaved: gate 0, up 0, gate 1...), `down_proj`
[E, I, hidden] (transposed), their biases [E, 2I] and [E, hidden]; the router is
`mlp.router`. Each expert's products are read as rows of those (`StackedSource`), so the
experts are the gated MLPs every MoE model here has (packing, TP splits, the native step).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from worker_svc.layers.mlp import SWIGLU_OAI
from worker_svc.model_config import FULL, SLIDING, ModelConfig, layer_types
from worker_svc.models.base import Architecture, StackedSource
from worker_svc.models.qwen3_moe import moe_config

_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)")


class GptOss(Architecture):
    model_type = "gpt_oss"
    hf_names = ("GptOssForCausalLM",)
    default_bias = True

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        if not raw.get("layer_types"):
            raw = {**raw, "layer_types": [SLIDING if (i + 1) % 2 else FULL for i in range(config.num_layers)]}
        moe = moe_config(raw, source, size_key="intermediate_size", renormalize=False)
        moe = replace(
            moe,
            softmax_after_topk=True,
            router_bias=True,
            expert_bias=True,
            activation=SWIGLU_OAI,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        )
        return replace(
            config,
            layer_types=layer_types(raw, source, config.num_layers),
            attention_sinks=True,
            o_proj_bias=config.attention_bias,
            moe=moe,
        )

    @classmethod
    def stored_names(cls, name: str) -> tuple[str, ...]:
        return (name.replace(".mlp.gate.", ".mlp.router."),) if ".mlp.gate." in name else (name,)

    @classmethod
    def source_of(cls, name: str, config: ModelConfig) -> tuple[str, int, int] | StackedSource | None:
        m = _EXPERT.fullmatch(name)
        if m is None:
            return super().source_of(name, config)
        experts, expert, proj, leaf = m[1], int(m[2]), m[3], m[4]
        weight = leaf == "weight"
        if proj == "down":
            return StackedSource(f"{experts}.down_proj{'' if weight else '_bias'}", expert, transposed=weight)
        return StackedSource(
            f"{experts}.gate_up_proj{'' if weight else '_bias'}",
            expert,
            transposed=weight,
            offset=0 if proj == "gate" else 1,
            step=2,
        )
