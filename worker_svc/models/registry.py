"""Which architecture serves a checkpoint: `config.json`'s `architectures` or GGUF's
`general.architecture`, looked up in ARCHITECTURES; anything else is refused naming the
field and listing what is served."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker_svc.errors import CheckpointError
from worker_svc.model_config import ModelConfig
from worker_svc.models.base import Architecture
from worker_svc.models.gemma2 import Gemma2
from worker_svc.models.gemma3 import Gemma3
from worker_svc.models.gpt_oss import GptOss
from worker_svc.models.llama import Llama
from worker_svc.models.mistral import Mistral
from worker_svc.models.mixtral import Mixtral
from worker_svc.models.phi3 import Phi3
from worker_svc.models.qwen2 import Qwen2
from worker_svc.models.qwen3 import Qwen3
from worker_svc.models.qwen3_moe import Qwen3Moe

ARCHITECTURES: tuple[type[Architecture], ...] = (
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    Qwen3Moe,
    Mixtral,
    GptOss,
)
BY_HF_NAME = {name: arch for arch in ARCHITECTURES for name in arch.hf_names}
BY_GGUF_NAME = {name: arch for arch in ARCHITECTURES for name in arch.gguf_names}
BY_GGUF_EXPERT_NAME = {name: arch for arch in ARCHITECTURES for name in arch.gguf_expert_names}
BY_MODEL_TYPE = {arch.model_type: arch for arch in ARCHITECTURES}


def architecture_of_config(raw: dict[str, Any], source: str = "config.json") -> type[Architecture]:
    """The architecture a `config.json` names in `architectures`."""
    names = raw.get("architectures") or []
    arch = next((BY_HF_NAME[a] for a in names if a in BY_HF_NAME), None)
    if arch is None:
        raise CheckpointError(
            f"{source}: architectures {names or raw.get('model_type')!r} is not supported; "
            f"supported: {', '.join(BY_HF_NAME)}"
        )
    return arch


def architecture_of_gguf(name: Any, source: str, experts: bool = False) -> type[Architecture]:
    """The architecture a GGUF file names in `general.architecture`; `experts`: its layers
    hold experts (`{arch}.expert_count`: a `llama` file is then Mixtral's)."""
    if experts and name in BY_GGUF_EXPERT_NAME:
        return BY_GGUF_EXPERT_NAME[name]
    if name not in BY_GGUF_NAME:
        raise CheckpointError(
            f"{source}: general.architecture {name!r} is not supported; supported: {', '.join(BY_GGUF_NAME)}"
        )
    return BY_GGUF_NAME[name]


def architecture_of_model(model_type: str) -> type[Architecture]:
    """The architecture of a loaded `ModelConfig.model_type`."""
    return BY_MODEL_TYPE[model_type]


def read_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The `ModelConfig` of a `config.json` dict, as its architecture reads it;
    CheckpointError naming the field otherwise."""
    return architecture_of_config(raw, source).read_config(raw, source)


def load_config(model_dir: str | Path) -> ModelConfig:
    """`read_config` of a checkpoint folder's config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found in the checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON: {exc}") from exc
    return read_config(raw, source=str(path))
