"""The sampling a request gets for the fields it leaves out, chosen as vLLM and llama.cpp's
server choose it.

Where the defaults come from (vLLM's `--generation-config`):

- `auto` (the default): the sampling fields of the model folder's `generation_config.json`
  (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`), as vLLM applies them. A
  GGUF file carries no generation config (the folder Pagoda prepares for one holds only its
  stop ids): it gets llama.cpp server's defaults, which Ollama applies too — temperature 0.8,
  top_k 40, top_p 0.95, min_p 0.05. Without them a small instruct model answers noise at
  temperature 1 over its whole vocabulary.
- `vllm`: none; a field left out is off (temperature 1, no truncation), vLLM's own defaults.
- a folder: that folder's `generation_config.json`.

`--override-generation-config '{"temperature": 0.5}'` sets fields over whichever applies.
A request's own fields always win: the gateway applies these only to the fields a request
leaves out (gateway/validation.py), field by field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.sampling import RANGES

GENERATION_CONFIG_FILE = "generation_config.json"
GGUF_SOURCE_FILE = "gguf_source.json"  # what marks a folder prepared for a GGUF file (wiring/model_source.py)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MODES = ("auto", "vllm")  # or a folder
# llama.cpp's server (common/common.h) and Ollama, for a model without a generation config
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass(frozen=True)
class SamplingDefaults:
    """The value of each sampling field a request leaves out; None: the field is off (the
    neutral value: temperature 1, top_p 1, top_k 0, min_p 0, repetition_penalty 1). `source`
    says where they come from. Every value is in the sampling type's range (ValueError naming
    the field otherwise)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = "none"

    def __post_init__(self) -> None:
        for name, value in self.fields().items():
            if isinstance(value, bool) or value not in RANGES[name]:
                raise ValueError(f"{name}: must be {RANGES[name]}, got {value!r}")

    def fields(self) -> dict[str, float | int]:
        """The fields that are set, in `SAMPLING_FIELDS` order."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def to_json(self) -> dict[str, Any]:
        """As `/v1/models` lists them: every field (null: off) and the source."""
        return asdict(self)

    def describe(self) -> str:
        """One line for the start banner."""
        values = ", ".join(f"{name} {value:g}" for name, value in self.fields().items())
        return f"{values or 'none (temperature 1, no truncation)'} ({self.source}); a request's own fields win"


def parse_override(text: str | None) -> dict[str, float | int]:
    """`--override-generation-config`'s JSON object of sampling fields; ValueError saying what
    is wrong."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"override_generation_config: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("override_generation_config: must be a JSON object such as '{\"temperature\": 0.7}'")
    unknown = sorted(set(value) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown field(s) {', '.join(unknown)}; the "
            f"sampling fields are {', '.join(SAMPLING_FIELDS)}"
        )
    try:
        SamplingDefaults(**_normalized(value))
    except ValueError as exc:
        raise ValueError(f"override_generation_config: {exc}") from None
    return _normalized(value)


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is `auto`, `vllm` or a path (not checked to exist here)."""
    if not isinstance(mode, str) or not mode.strip():
        raise ValueError(f"generation_config: must be auto, vllm or a folder, got {mode!r}")


def sampling_defaults(model_dir: str | Path, mode: str = "auto", override: str | None = None) -> SamplingDefaults:
    """The defaults for the model in `model_dir` (see the module docstring); ValueError naming
    the setting when the folder or its file cannot be read, or a value is out of range."""
    check_mode(mode)
    if mode == "vllm":
        fields, source = {}, "vLLM's: none"
    elif mode == "auto":
        fields = _read(Path(model_dir), required=False)
        source = f"the model's {GENERATION_CONFIG_FILE}"
        if not fields and (Path(model_dir) / GGUF_SOURCE_FILE).is_file():
            fields, source = dict(LLAMA_CPP_DEFAULTS), "llama.cpp's, for a GGUF file"
        elif not fields:
            source = f"none in the model's {GENERATION_CONFIG_FILE}"
    else:
        fields, source = _read(Path(mode), required=True), f"{Path(mode) / GENERATION_CONFIG_FILE}"
    extra = parse_override(override)
    if extra:
        source += ", overridden by --override-generation-config"
    try:
        return SamplingDefaults(**{**fields, **extra}, source=source)
    except ValueError as exc:
        raise ValueError(f"generation_config: {source}: {exc}") from None


def _read(folder: Path, required: bool) -> dict[str, float | int]:
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        if required:
            raise ValueError(f"generation_config: {folder} holds no {GENERATION_CONFIG_FILE}")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return _normalized({k: v for k, v in config.items() if k in SAMPLING_FIELDS and v is not None})


def _normalized(fields: dict[str, Any]) -> dict[str, Any]:
    """transformers' and vLLM's spellings as the sampling type's: a top_k of -1 (or 0) is off."""
    out = dict(fields)
    if isinstance(out.get("top_k"), int) and not isinstance(out["top_k"], bool) and out["top_k"] < 0:
        out["top_k"] = 0
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if isinstance(out.get(name), int) and not isinstance(out[name], bool):
            out[name] = float(out[name])
    return out
