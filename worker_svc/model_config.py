"""The model's shape as read from a Hugging Face `config.json`.

`base_config` reads the fields every decoder has here; the architecture that
`architectures` names (worker_svc/models/: each sets its own options, e.g. Qwen3's q/k
norms or Gemma's per-layer attention types) builds the config on it:
`worker_svc.models.registry.read_config(raw)` / `load_config(model_dir)`. Reads both spellings that
checkpoints use: `rope_scaling` (transformers 4) and `rope_parameters` (transformers 5),
`torch_dtype` and `dtype`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from services.kv_layout import KVLayout, kv_layout
from worker_svc.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
SLIDING, FULL = "sliding_attention", "full_attention"  # `layer_types` entries
DTYPE_NAMES = ("float32", "bfloat16", "float16")
READ_QUANT_METHODS = ("mxfp4",)  # quantized checkpoint formats read (gpt-oss's experts)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (worker_svc/layers/moe.py): `num_experts` gated MLPs of
    `intermediate_size`, `top_k` of them per token. Routing: softmax over every expert then
    the top k (renormalised to sum 1 when `renormalize`: Qwen3-MoE's `norm_topk_prob`,
    Mixtral). A shared expert of `shared_intermediate_size` (0: none) runs for every token,
    scaled by a sigmoid gate (Qwen2-MoE). `sparse_layers`: per layer, whether its MLP is one
    (() = every layer). gpt-oss: `softmax_after_topk` (the top k of the router's logits, then
    a softmax over those k), a router bias, biases on the experts' products, and its experts'
    clamped SwiGLU (`activation` "swiglu_oai" with `swiglu_alpha`, `swiglu_limit`; None: the
    config's `hidden_act`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool = True
    shared_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()
    softmax_after_topk: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # expert parallelism (`ModelConfig.shard`): this rank holds experts [ep_rank * E / ep_size,
    # (ep_rank + 1) * E / ep_size) whole; 1: every expert (split by columns under TP)
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def local_experts(self) -> range:
        """The experts this rank holds (whole)."""
        n = self.num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape and the options its architecture sets (worker_svc/models/).
    Derived sizes are properties."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str = "silu"
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # options an architecture sets (the defaults are Llama's)
    layer_types: tuple[str, ...] = ()  # per layer: SLIDING or FULL; () = every layer alike
    rope_local: RopeConfig | None = None  # the sliding layers' own rotary (Gemma 3)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # norms scale by (offset + w) (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2/3)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2
    attention_sinks: bool = False  # a learned per-head logit in every softmax (gpt-oss)
    o_proj_bias: bool = False  # a bias on the attention's output product (gpt-oss)
    final_logit_softcap: float | None = None  # Gemma 2
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (worker_svc/layers/moe.py)

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and (not self.moe.sparse_layers or self.moe.sparse_layers[layer])

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to its whole context)."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == SLIDING else None
        return self.sliding_window

    @property
    def kv_layout(self) -> KVLayout:
        """How the layers share KV pages (services/kv_layout.py): groups for a hybrid model."""
        return kv_layout([self.window(i) for i in range(self.num_layers)])

    def rope_for(self, layer: int) -> RopeConfig:
        """The rotary parameters of layer `layer`."""
        if self.rope_local is not None and self.layer_types and self.layer_types[layer] == SLIDING:
            return self.rope_local
        return self.rope

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def shard(self, tensor_parallel_size: int, expert_rank: int | None = None) -> ModelConfig:
        """One tensor-parallel rank's share: its query heads, KV heads and MLP columns (every
        rank the same count; hidden size, vocabulary and head size unchanged). ValueError
        naming what does not divide: KV heads are split, never replicated, so a rank's query
        heads always read KV heads it holds. `expert_rank` (expert parallelism, rank
        `expert_rank`): its 1/T of the experts whole instead of 1/T of every expert's columns."""
        t = tensor_parallel_size
        if t < 1:
            raise ValueError(f"tensor_parallel_size: must be positive, got {t}")
        sizes = {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }
        if self.moe is not None:  # each expert's columns split like a dense MLP's, or whole experts
            sizes |= {"shared_expert_intermediate_size": self.moe.shared_intermediate_size}
            sizes |= (
                {"num_experts": self.moe.num_experts}
                if expert_rank is not None
                else {"moe_intermediate_size": self.moe.intermediate_size}
            )
        bad = [f"{name}={n}" for name, n in sizes.items() if n % t]
        if bad:
            fits = [d for d in range(1, self.num_kv_heads + 1) if all(n % d == 0 for n in sizes.values())]
            raise ValueError(
                f"tensor_parallel_size: {t} does not divide {', '.join(bad)} of this model; "
                f"sizes that divide its heads, KV heads and MLP: {', '.join(map(str, fits))}"
            )
        if t == 1:
            return self
        if self.moe is not None and expert_rank is not None:
            moe = replace(
                self.moe,
                shared_intermediate_size=self.moe.shared_intermediate_size // t,
                ep_size=t,
                ep_rank=expert_rank,
            )
        else:
            moe = self.moe and replace(
                self.moe,
                intermediate_size=self.moe.intermediate_size // t,
                shared_intermediate_size=self.moe.shared_intermediate_size // t,
            )
        return replace(
            self,
            num_heads=self.num_heads // t,
            num_kv_heads=self.num_kv_heads // t,
            intermediate_size=self.intermediate_size // t,
            moe=moe,
        )


def base_config(
    raw: dict[str, Any],
    source: str,
    architecture: str,
    model_type: str,
    *,
    default_bias: bool = False,
    activations: tuple[str, ...] = ("silu", "swish"),
    act_key: str = "hidden_act",
) -> ModelConfig:
    """The fields every decoder here has, read from `raw` (an architecture then sets its own)."""

    def need(key: str) -> Any:
        if key not in raw:
            raise CheckpointError(f"{source}: required field {key!r} is missing")
        return raw[key]

    hidden_size = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    act = raw.get(act_key) or activations[0]
    if act not in activations:
        raise CheckpointError(f"{source}: {act_key} {act!r} is not supported ({', '.join(activations)})")
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method is not None and method not in READ_QUANT_METHODS:
        raise CheckpointError(
            f"{source}: quantization_config.quant_method {method!r} is not read; "
            f"checkpoints served: float weights or {', '.join(READ_QUANT_METHODS)}"
        )
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    window = raw.get("sliding_window")
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", default_bias)),
        hidden_act="silu" if act == "swish" else str(act),
        sliding_window=int(window) if window else None,
        torch_dtype=str(dtype),
        rope=parse_rope(raw, source),
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
    )


def layer_types(raw: dict[str, Any], source: str, num_layers: int) -> tuple[str, ...]:
    """`raw["layer_types"]`, checked: one of SLIDING or FULL per layer."""
    types = tuple(raw.get("layer_types") or ())
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise CheckpointError(
            f"{source}: layer_types must name {SLIDING!r} or {FULL!r} for each of "
            f"the {num_layers} layers, got {list(types)!r}"
        )
    return types


def parse_rope(raw: dict[str, Any], source: str, params: dict[str, Any] | None = None) -> RopeConfig:
    """The rotary parameters of `raw` (or of `params`, one layer type's entry of a per-type
    `rope_parameters`, Gemma 3's)."""
    if params is None:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    max_pos = int(raw.get("max_position_embeddings", 4096))
    orig = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if rope_type in ("yarn", "longrope") and factor is None:
        factor = max_pos / (orig or max_pos)
    if rope_type != "default" and factor is None:
        raise CheckpointError(f"{source}: rope type {rope_type!r} needs a 'factor'")
    if factor is not None and (not math.isfinite(float(factor)) or float(factor) <= 0):
        raise CheckpointError(f"{source}: rope factor must be positive, got {factor!r}")
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(factor) if factor is not None else 1.0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else max_pos,
        attention_factor=params.get("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=_factors(params, "short_factor", source, rope_type),
        long_factor=_factors(params, "long_factor", source, rope_type),
    )


def _factors(params: dict[str, Any], key: str, source: str, rope_type: str) -> tuple[float, ...]:
    if rope_type != "longrope":
        return ()
    values = params.get(key)
    if not isinstance(values, list) or not values:
        raise CheckpointError(f"{source}: rope type 'longrope' needs a list {key!r}")
    return tuple(float(v) for v in values)
