"""What an architecture module says about its models (`Architecture`), with Llama's
answers as the defaults.

An architecture is a subclass with class attributes and, where it differs, methods:

- `hf_names` / `gguf_names`: the `architectures` entries of `config.json` and the GGUF
  `general.architecture` values it serves; `model_type` its config's.
- `configure(raw, config, source)`: its own options on top of `base_config`'s fields
  (worker_svc/model_config.py), e.g. Qwen3's q/k norms.
- `layer`: the decoder layer class (worker_svc/layers/decoder.py) it builds per layer.
- `fused_tensors`: checkpoint tensors holding several of the model's (Phi-3's `qkv_proj`):
  module suffix -> (the checkpoint's module suffix, index of this part); the loader reads
  each part's rows.
- `stored_names(name)`: the names a checkpoint may hold tensor `name` under, in the order
  tried (a multimodal checkpoint's language model under a prefix: Gemma 3's); `model_name`
  the other way (the GGUF writer's).
- GGUF: `gguf_layer_tensors` (llama.cpp's per-layer names beyond Llama's), `gguf_config`
  (its metadata keys beyond Llama's), `gguf_permuted_qk` (whether llama.cpp's converter
  permuted q/k rows), `gguf_norm_offset_stored` (whether it stored norms as offset + w),
  `gguf_expert_names` (another architecture's GGUF name whose files with experts it serves).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from worker_svc.layers.decoder import DecoderLayer
from worker_svc.model_config import ModelConfig, base_config

# llama.cpp's per-layer tensor names -> the Hugging Face names under `model.layers.N.`
LLAMA_GGUF_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# llama.cpp's names of a mixture of experts' tensors: the router, and each projection's experts
# stacked into one tensor ([experts, rows, columns])
MOE_GGUF_LAYER_TENSORS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
EXPERT_TENSOR = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class StackedSource:
    """A model tensor a checkpoint holds as one expert's slice of a stacked tensor
    [experts, ...] (gpt-oss): rows `offset::step` of `stored[expert]`, transposed first
    when `transposed` (a [columns, rows] matrix)."""

    stored: str
    expert: int
    transposed: bool = False
    offset: int = 0
    step: int = 1


# read a GGUF metadata key of the file's architecture: (key without the `{arch}.` prefix,
# default) -> value
GGUFField = Callable[[str, Any], Any]


class Architecture:
    model_type: ClassVar[str] = "llama"
    hf_names: ClassVar[tuple[str, ...]] = ()
    gguf_names: ClassVar[tuple[str, ...]] = ()
    # GGUF architectures whose files it serves when they hold experts (Mixtral: `llama`)
    gguf_expert_names: ClassVar[tuple[str, ...]] = ()
    default_bias: ClassVar[bool] = False  # q/k/v bias when the config does not say
    activations: ClassVar[tuple[str, ...]] = ("silu", "swish")
    act_key: ClassVar[str] = "hidden_act"
    layer: ClassVar[type[nn.Module]] = DecoderLayer
    fused_tensors: ClassVar[dict[str, tuple[str, int]]] = {}
    gguf_layer_tensors: ClassVar[dict[str, str]] = LLAMA_GGUF_LAYER_TENSORS
    gguf_permuted_qk: ClassVar[bool] = False
    gguf_norm_offset_stored: ClassVar[bool] = False

    @classmethod
    def read_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        arch = next((a for a in raw.get("architectures") or () if a in cls.hf_names), cls.hf_names[0])
        config = base_config(
            raw,
            source,
            arch,
            cls.model_type,
            default_bias=cls.default_bias,
            activations=cls.activations,
            act_key=cls.act_key,
        )
        return cls.configure(raw, config, source)

    @classmethod
    def configure(cls, raw: dict[str, Any], config: ModelConfig, source: str) -> ModelConfig:
        """This architecture's options on top of the common fields (Llama: none)."""
        return config

    @classmethod
    def stored_names(cls, name: str) -> tuple[str, ...]:
        """The names a checkpoint may hold the model's tensor `name` under (Llama: itself)."""
        return (name,)

    @classmethod
    def model_name(cls, stored: str) -> str:
        """The model's name of a checkpoint's tensor `stored` (Llama: itself)."""
        return stored

    @classmethod
    def gguf_config(cls, field: GGUFField, config: dict[str, Any]) -> None:
        """Add this architecture's `config.json` fields read from GGUF metadata (Llama: none)."""

    @classmethod
    def fused_part_rows(cls, fused: str, config: ModelConfig) -> list[int]:
        """Rows of each part of fused checkpoint module `fused` (in the whole model)."""
        if fused.endswith("qkv_proj"):
            return [config.q_size, config.kv_size, config.kv_size]
        if fused.endswith("gate_up_proj"):
            return [config.intermediate_size] * 2
        raise ValueError(f"{cls.__name__}: no part sizes for fused tensor {fused!r}")

    @classmethod
    def gguf_source_of(cls, name: str, config: ModelConfig) -> tuple[str, int, int] | None:
        """`source_of` in a GGUF file: there llama.cpp also stacks each layer's experts into one
        tensor a projection (`ffn_gate_exps`...; read as `mlp.experts.<proj>.weight`, its rows
        expert after expert)."""
        m = EXPERT_TENSOR.fullmatch(name)
        if m is None or config.moe is None:
            return cls.source_of(name, config)
        rows = config.hidden_size if m[3] == "down_proj" else config.moe.intermediate_size
        return f"{m[1]}.{m[3]}.weight", int(m[2]) * rows, rows

    @classmethod
    def source_of(cls, name: str, config: ModelConfig) -> tuple[str, int, int] | StackedSource | None:
        """For a tensor the checkpoint holds inside a fused one: (the fused tensor's name,
        first row, rows) in the whole model's terms, or where a stacked one holds it
        (`StackedSource`); None for a tensor held as itself."""
        module, leaf = name.rsplit(".", 1)
        for suffix, (fused, part) in cls.fused_tensors.items():
            if module.endswith(suffix):
                rows = cls.fused_part_rows(fused, config)
                return f"{module[: -len(suffix)]}{fused}.{leaf}", sum(rows[:part]), rows[part]
        return None
