"""`pagoda eval-quality`'s weight formats: what a --formats name stands for, and the
checkpoints made once in the cache from the source GGUF file (its float32 dequantization,
other GGUF block types written from it). Imports torch and worker_svc only where used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.quality_text import quality_cache

GGUF_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")
_FILE_TYPES = {2: "Q4_0", 3: "Q4_1", 7: "Q8_0"}  # GGUF general.file_type -> its main block type


@dataclass(frozen=True)
class WeightFormat:
    """How one format is loaded: `load_stage(folder of `checkpoint`, dtype, quantization)`;
    `checkpoint` is "source" (the GGUF file given) or a GGUF block type written from float32."""

    name: str
    checkpoint: str
    dtype: str
    quantization: str | None = None


def weight_format(name: str, source_type: str | None) -> WeightFormat:
    """The format a --formats name stands for (ValueError naming the choices otherwise)."""
    from worker_svc.weights.quantization import QUANTIZATION_METHODS

    if name in ("float32", "bfloat16", "float16"):
        return WeightFormat(name, "source", name)
    if name in GGUF_BLOCK_TYPES:
        return WeightFormat(name, "source" if name == source_type else name, "auto")
    if name in QUANTIZATION_METHODS:
        return WeightFormat(name, "source", "float32", name)
    raise ValueError(
        f"unknown format {name!r}: float32, bfloat16, float16, "
        f"{', '.join(GGUF_BLOCK_TYPES)} or a quantization ({', '.join(QUANTIZATION_METHODS)})"
    )


def gguf_file_type(path: Path) -> str | None:
    """The block type a GGUF file is mostly in (its general.file_type), or None."""
    import gguf

    field_ = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    return None if field_ is None else _FILE_TYPES.get(int(field_.parts[-1][0]))


def _file_key(path: Path) -> str:
    stat = path.resolve().stat()
    return hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def float32_folder(source: Path, prepared: Path, log: Callable[[str], None] = print) -> Path:
    """A float32 safetensors checkpoint (config.json, model.safetensors, tokenizer files) of
    the GGUF `source`, dequantized; made once in the cache."""
    from safetensors.torch import save_file

    from worker_svc.checkpoints.loader import load_stage

    folder = quality_cache() / f"{source.stem}-{_file_key(source)}-float32"
    if (folder / "model.safetensors").is_file():
        return folder
    log(f"eval-quality: writing {source.name} dequantized to float32 safetensors in {folder}, once")
    model = load_stage(prepared, dtype="float32")
    tensors = {name: t.detach().clone().contiguous() for name, t in model.named_parameters()}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    ):
        if (prepared / name).is_file():
            shutil.copy2(prepared / name, tmp / name)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, folder)
    return folder


def exported_gguf(source: Path, prepared: Path, qtype: str, log: Callable[[str], None] = print) -> Path:
    """A `qtype` GGUF written from the float32 weights of `source`; made once in the cache."""
    from wiring.gguf_export import write_gguf

    out = quality_cache() / f"{source.stem.split('.')[0]}-{_file_key(source)}.{qtype}.gguf"
    if out.is_file():
        return out
    f32 = float32_folder(source, prepared, log)
    log(f"eval-quality: writing {out.name} from the float32 weights, once")
    part = out.with_suffix(".part")
    write_gguf(f32, part, qtype)
    os.replace(part, out)
    return out
