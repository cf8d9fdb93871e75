"""GGUF checkpoints (llama.cpp's single-file format): the model's shape and its tensors.

`GGUFCheckpoint(path)` reads the file's metadata with the `gguf` package (the file is
memory-mapped; nothing is copied until a tensor is asked for) and answers in the terms the
rest of the worker uses:

- `hf_config()`: a `config.json`-shaped dict (what `worker_svc.models.registry.read_config` reads), from the
  `{arch}.*` keys llama.cpp writes, for every architecture of worker_svc/models/ (each names
  its GGUF tensor names and metadata keys beyond Llama's).
- `tensor(name)`: the tensor a Hugging Face parameter name stands for, as a `GGUFTensor`:
  block-quantized types stay in their blocks, `uint8 [rows, row_bytes]`: Q8_0, Q4_0, Q4_1,
  MXFP4 and the K-quants Q2_K-Q6_K with Q5_0 and Q5_1 (all served packed: worker_svc/weights/packed.py);
  F32, F16 and BF16 come as tensors of their type.
  llama.cpp's converter permutes the rows of Llama's q and k projections (its rotary
  embedding pairs neighbouring elements, the Hugging Face one pairs the halves of a head);
  the permutation is undone here on whole rows, which for a matrix in blocks moves whole
  rows of blocks and changes no block.

Where llama.cpp and `transformers`' GGUF loader read a file's metadata differently, the
config follows llama.cpp, which runs the real files:

- the head size is `{arch}.attention.key_length` (llama.cpp's converter writes it wherever
  config.json names a `head_dim`); transformers reads it only for Gemma (and Llama's
  `rope.dimension_count`) and takes Qwen3Config's default head_dim 128 for a qwen3 file;
- Gemma's attention scale is llama.cpp's 1 / sqrt(head size) (1 / sqrt(hidden / heads) for
  the 27B models, `worker_svc.models.gemma2.gguf_query_pre_attn_scalar`); transformers keeps
  its configs' default query_pre_attn_scalar 256;
- Gemma 2's soft-caps are the file's; transformers keeps its defaults (50 and 30);
- Gemma 3's global layers are every sixth (llama.cpp's fixed pattern; transformers' default
  too), the sliding ones' rope base 10,000, and a `rope.scaling.*` linear scaling applies to
  the global ones; transformers reads no rope scaling for gemma3;
- Phi-3's LongRoPE factors are the `rope_factors_long`/`_short` tensors; transformers reads none.

The tests' tiny files (tests/unit/test_gguf_archs.py) take shapes on which both agree:
Qwen3's head size 128, Gemma 3's 256 = query_pre_attn_scalar, no rope scaling, no soft-caps.

Layouts: a GGUF tensor's `shape` lists the fastest dimension first (`[in, out]` for a
weight); `GGUFTensor.shape` is the torch order (`[out, in]`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_svc.errors import CheckpointError
from worker_svc.kernels.block_formats import dequantize as dequantize_packed
from worker_svc.kernels.kquants import KQUANT_TYPES
from worker_svc.kernels.kquants import dequantize as dequantize_kquant
from worker_svc.models.registry import architecture_of_gguf

# A GGUF file is served from a folder prepared for it (wiring/model_source.py): the
# config.json and tokenizer files every service reads, and this file naming the GGUF whose
# tensors the stages load.
GGUF_SOURCE_FILE = "gguf_source.json"

# ggml type id -> (name, elements per block, bytes per block) of the types served packed (the
# native kernels multiply them as stored: worker_svc/kernels/quant_kernels.py)
PACKED_TYPES: dict[int, tuple[str, int, int]] = {
    8: ("Q8_0", 32, 34),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    39: ("MXFP4", 32, 17),
    **{tid: (name, block, size) for name, (tid, block, size) in KQUANT_TYPES.items()},
}
# ggml type id -> (name, elements per block, bytes per block) of the block types dequantized at
# load: none since the K-quants and Q5_0/Q5_1 have packed kernels (issue 33)
DEQUANTIZED_TYPES: dict[int, tuple[str, int, int]] = {}
# ggml type id -> torch dtype of the types served as plain tensors
PLAIN_TYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, layer_tensors: dict[str, str]) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name (an architecture's
    `gguf_layer_tensors`), or None (e.g. `rope_freqs`)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
    return None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the worker holds it: `data` is `uint8 [rows, row_bytes]` when `qtype`
    names a block format (`blocked`: Q8_0, Q4_0, Q4_1 or one of KQUANT_TYPES, all served
    `packed`), else a tensor of `shape` and its dtype (`qtype` then "F32", "F16" or
    "BF16")."""

    name: str
    qtype: str
    shape: tuple[int, ...]  # torch order: [out, in] for a weight
    data: torch.Tensor

    @property
    def packed(self) -> bool:
        """Whether the native kernels multiply this block type as it is (worker_svc/weights/packed.py)."""
        return any(self.qtype == name for name, _, _ in PACKED_TYPES.values())

    @property
    def blocked(self) -> bool:
        return self.packed or self.qtype in KQUANT_TYPES

    def to_float32(self) -> torch.Tensor:
        """The values as float32 of `shape` (a block format dequantized, bit for bit as the
        `gguf` package dequantizes it)."""
        if not self.blocked:
            return self.data.to(torch.float32)
        dequantize = dequantize_packed if self.packed else dequantize_kquant
        return dequantize(self.data, self.qtype, self.shape[-1]).view(self.shape)


class GGUFCheckpoint:
    """A GGUF file's metadata and tensors (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # the reader of llama.cpp's project; imported only where a GGUF is served

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: GGUF file not found")
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # the reader raises ValueError, struct errors, ...
            raise CheckpointError(f"{self.path}: cannot be read as GGUF: {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self.field("general.architecture")
        experts = bool(self.field(f"{arch}.expert_count", 0))
        self.arch = architecture_of_gguf(arch, str(self.path), experts)
        self.architecture = str(arch)
        layer_tensors = self.arch.gguf_layer_tensors
        self._by_hf = {n: g for g in self._tensors if (n := hf_name(g, layer_tensors)) is not None}

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _need(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise CheckpointError(f"{self.path}: required metadata field {key!r} is missing")
        return value

    def hf_config(self) -> dict[str, Any]:
        """`config.json` for this file (see `worker_svc.models.registry.read_config`)."""
        a = self.architecture
        hidden = int(self._need(f"{a}.embedding_length"))
        heads = int(self._need(f"{a}.attention.head_count"))
        kv_heads = int(self.field(f"{a}.attention.head_count_kv", heads))
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = self.field(f"{a}.vocab_size") or (len(tokens) if tokens is not None else None)
        if vocab is None:
            vocab = int(self._tensor_info("model.embed_tokens.weight").shape[1])
        head_dim = int(self.field(f"{a}.attention.key_length") or hidden // heads)
        if int(self.field(f"{a}.rope.dimension_count", head_dim)) != head_dim:
            raise CheckpointError(
                f"{self.path}: {a}.rope.dimension_count other than the head size (partial rotary) is not supported"
            )
        config: dict[str, Any] = {
            "architectures": [self.arch.hf_names[0]],
            "model_type": self.arch.model_type,
            "hidden_size": hidden,
            # (a file of experts only has no dense width: llama.cpp omits it)
            "intermediate_size": int(
                self.field(f"{a}.feed_forward_length") or self._need(f"{a}.expert_feed_forward_length")
            ),
            "num_hidden_layers": int(self._need(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": int(vocab),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 4096)),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        scaling = self._rope_scaling(config["max_position_embeddings"])
        if scaling is not None:
            config["rope_scaling"] = scaling
        window = self.field(f"{a}.attention.sliding_window")
        if window:
            config["sliding_window"] = int(window)
        self.arch.gguf_config(lambda key, default: self.field(f"{a}.{key}", default), config)
        for key, name in (
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ):
            value = self.field(name)
            if value is not None:
                config[key] = int(value)
        return config

    def _rope_scaling(self, max_positions: int) -> dict[str, Any] | None:
        """`rope_scaling` from `{arch}.rope.scaling.*`: linear; Phi-3's LongRoPE, whose factors
        llama.cpp writes as the tensors `rope_factors_long` / `rope_factors_short`."""
        a = self.architecture
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling == "linear":
            return {"rope_type": "linear", "factor": float(self._need(f"{a}.rope.scaling.factor"))}
        if scaling not in (None, "none"):
            raise CheckpointError(f"{self.path}: {a}.rope.scaling.type {scaling!r} is not supported")
        if "rope_factors_long.weight" not in self._tensors:
            return None
        original = int(self.field(f"{a}.rope.scaling.original_context_length", max_positions))
        factors = {
            key: np.asarray(self._tensors[f"rope_factors_{key}.weight"].data, dtype=np.float32).tolist()
            for key in ("long", "short")
        }
        return {
            "rope_type": "longrope",
            "long_factor": factors["long"],
            "short_factor": factors["short"],
            "original_max_position_embeddings": original,
        }

    def _tensor_info(self, name: str):
        gname = self._by_hf.get(name)
        if gname is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        return self._tensors[gname]

    def has(self, name: str) -> bool:
        return name in self._by_hf

    def names(self) -> list[str]:
        return list(self._by_hf)

    def tensor_bytes(self) -> int:
        """Bytes of all the file's tensors as stored."""
        return sum(int(t.n_bytes) for t in self._tensors.values())

    def tensor(self, name: str, config: dict[str, Any] | None = None) -> GGUFTensor:
        """The tensor Hugging Face calls `name` (a copy, in the worker's own memory)."""
        info = self._tensor_info(name)
        tid = int(info.tensor_type)
        shape = tuple(int(d) for d in reversed(info.shape.tolist()))
        if len(shape) == 3:  # stacked experts: their rows one after another
            shape = (shape[0] * shape[1], shape[2])
        if tid in PACKED_TYPES or tid in DEQUANTIZED_TYPES:
            qtype, block, block_bytes = PACKED_TYPES.get(tid) or DEQUANTIZED_TYPES[tid]
            if shape[-1] % block:
                raise CheckpointError(
                    f"{self.path}: tensor {info.name!r}: {shape[-1]} columns are not "
                    f"a multiple of {qtype}'s {block}-element block"
                )
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            array = np.asarray(info.data, dtype=np.uint8).reshape(rows, shape[-1] // block * block_bytes)
        elif tid in PLAIN_TYPES:
            qtype = {0: "F32", 1: "F16", 30: "BF16"}[tid]
            raw = np.asarray(info.data)
            if tid == 30:  # stored as uint16 bits
                raw = raw.view(np.uint16).view(np.int16)
            array = raw.reshape(shape)
        else:
            raise CheckpointError(
                f"{self.path}: tensor {info.name!r} has ggml type {info.tensor_type.name}; served "
                f"types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, MXFP4, {', '.join(KQUANT_TYPES)}"
            )
        data = torch.from_numpy(np.array(array, copy=True))
        if qtype == "BF16":
            data = data.view(torch.bfloat16)
        if self._permuted(name):
            cfg = config or self.hf_config()
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            data = unpermute_rows(data, heads)
        return GGUFTensor(name=name, qtype=qtype, shape=shape, data=data)

    def _permuted(self, name: str) -> bool:
        return self.arch.gguf_permuted_qk and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)


def unpermute_rows(data: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (per head, rows [0, 2, 4, ...] then [1, 3, ...]
    became pairs) on `data` whose first dimension is the rows (packed or not)."""
    rows = data.shape[0]
    half = rows // num_heads // 2
    tail = data.shape[1:]
    return data.reshape(num_heads, half, 2, *tail).transpose(1, 2).reshape(rows, *tail).contiguous()


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a prepared folder stands for (see GGUF_SOURCE_FILE), or None for a plain
    checkpoint folder."""
    path = Path(model_dir) / GGUF_SOURCE_FILE
    if not path.is_file():
        return None
    try:
        source = Path(json.loads(path.read_text())["file"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a valid GGUF source record: {exc}") from exc
    if not source.is_file():
        raise CheckpointError(f"{path}: the GGUF file {source} it names is gone")
    return source
