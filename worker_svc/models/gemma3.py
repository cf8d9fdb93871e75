"""Gemma 3 (text; `Gemma3ForCausalLM`, the 270M and 1B checkpoints): Gemma 2's layer and
options with five sliding-window layers to one global (`layer_types`), each kind with its
own rotary (`rope_parameters` per layer type: the sliding layers' base 10,000, the global
ones' 1,000,000 and their scaling), q/k norms (as Qwen3's, scaling by 1 + w), and no
attention soft-capping.

The multimodal checkpoints (`Gemma3ForConditionalGeneration`: 4B, 12B, 27B) are served as
their language model: the config's `text_config`, the tensors under `language_model.`
(`language_model.model.layers.0...`, or transformers 5's `model.language_model.layers.0...`);
the vision tower is not loaded (text prompts only)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker_svc.layers.decoder import SandwichDecoderLayer
from worker_svc.model_config import FULL, SLIDING, ModelConfig, parse_rope
from worker_svc.models.base import Architecture, GGUFField
from worker_svc.models.gemma2 import GEMMA_GGUF_LAYER_TENSORS, gemma_gguf_config, gemma_options


class Gemma3(Architecture):
    model_type = "gemma3_text"
    hf_names = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    gguf_names = ("gemma3",)
    activations = ("gelu_pytorch_tanh",)
    act_key = "hidden_activation"
    layer = SandwichDecoderLayer
    gguf_layer_tensors = {
        **GEMMA_GGUF_LAYER_TENSORS,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }
    gguf_norm_offset_stored = True

    @classmethod
    def read_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        text = raw.get("text_config")
        if isinstance(text, dict):  # a multimodal checkpoint: its language model's config
            inherited = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype") if k in raw}
            raw = {**inherited, **text, "architectures": raw.get("architectures")}
        return super().read_config(raw, source)

    @classmethod
    def stored_names(cls, name: str) -> tuple[str, ...]:
        if name.startswith("model."):
            rest = name[len("model.") :]
            return name, f"language_model.model.{rest}", f"model.language_model.{rest}"
        return name, f"language_model.{name}"

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        config = gemma_options(raw, config, source, pattern=int(raw.get("sliding_window_pattern") or 6))
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and FULL in params:  # transformers 5: one entry per layer type
            full, local = dict(params[FULL]), dict(params.get(SLIDING) or {})
        else:  # transformers 4: rope_theta and rope_scaling for the global layers
            full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(raw.get("rope_scaling") or {})}
            local = {}
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
        local.setdefault("rope_type", "default")
        return replace(
            config, qk_norm=True, rope=parse_rope(raw, source, full), rope_local=parse_rope(raw, source, local)
        )

    @classmethod
    def gguf_config(cls, field: GGUFField, config: dict[str, Any]) -> None:
        gemma_gguf_config(field, config, pattern=6, model_type=cls.model_type)
        config["rope_local_base_freq"] = 10_000.0
        config.pop("attn_logit_softcapping", None)
