"""The model's architecture as read from a Hugging Face `config.json`.

Reads both spellings that checkpoints use: `rope_scaling` (transformers 4) and
`rope_parameters` (transformers 5), `torch_dtype` and `dtype`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from worker_svc.errors import CheckpointError

# architecture name in config.json -> (model_type, has q/k/v bias by default)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


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


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder's shape. Derived sizes are properties."""

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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def shard(self, tensor_parallel_size: int) -> ModelConfig:
        """One tensor-parallel rank's share: its query heads, KV heads and MLP columns (every
        rank the same count; hidden size, vocabulary and head size unchanged). ValueError
        naming what does not divide: KV heads are split, never replicated, so a rank's query
        heads always read KV heads it holds."""
        t = tensor_parallel_size
        if t < 1:
            raise ValueError(f"tensor_parallel_size: must be positive, got {t}")
        sizes = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                 "intermediate_size": self.intermediate_size}
        bad = [f"{name}={n}" for name, n in sizes.items() if n % t]
        if bad:
            fits = [d for d in range(1, self.num_kv_heads + 1)
                    if all(n % d == 0 for n in sizes.values())]
            raise ValueError(
                f"tensor_parallel_size: {t} does not divide {', '.join(bad)} of this model; "
                f"sizes that divide its heads, KV heads and MLP: {', '.join(map(str, fits))}")
        if t == 1:
            return self
        return replace(self, num_heads=self.num_heads // t, num_kv_heads=self.num_kv_heads // t,
                       intermediate_size=self.intermediate_size // t)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: config.json not found in the checkpoint directory")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot be read as JSON: {exc}") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type, default_bias = SUPPORTED_ARCHITECTURES[arch]

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
                f"{source}: num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
        sliding_window = raw.get("sliding_window")
        if model_type == "qwen2":
            if raw.get("use_sliding_window"):
                raise CheckpointError(f"{source}: Qwen2 use_sliding_window=true is not supported")
            sliding_window = None
        if model_type == "llama":
            sliding_window = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            architecture=arch,
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
            hidden_act="silu",
            sliding_window=int(sliding_window) if sliding_window else None,
            torch_dtype=str(dtype),
            rope=_parse_rope(raw, source),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    max_pos = int(raw.get("max_position_embeddings", 4096))
    orig = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    factor = params.get("factor")
    if rope_type == "yarn" and factor is None:
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
    )
