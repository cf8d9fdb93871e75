"""Loading one pipeline stage from a Hugging Face checkpoint directory (safetensors), or through
gguf_loader.py from a folder prepared from a GGUF file.

Reads only the tensors its stage needs, from a single `model.safetensors` or from shards
listed in `model.safetensors.index.json`, casting to the configured dtype. Never unpickles:
a directory holding only `pytorch_model.bin` is refused. What both formats share is
stage_setup.py (place, dtypes, the steps after reading) and shards.py (a rank's share).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from worker_svc.checkpoints.gguf_checkpoint import gguf_source
from worker_svc.checkpoints.gguf_loader import load_gguf_stage
from worker_svc.checkpoints.shards import full_shape, held_whole, rank_bias, rank_share
from worker_svc.checkpoints.stage_setup import (
    check_place,
    finish_stage,
    fused_sources,
    install_packed,
    load_state,
    partition_layers,
    read_dtype,
    resolve_dtype,
)
from worker_svc.errors import CheckpointError
from worker_svc.model_config import ModelConfig
from worker_svc.models.base import StackedSource
from worker_svc.models.registry import architecture_of_model, load_config
from worker_svc.models.stage import StageModel
from worker_svc.weights.quantization import check_quantization, weight_bytes

log = logging.getLogger(__name__)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index: {exc}") from exc
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    hint = (
        " (pickled pytorch_model.bin is not loaded: convert it to safetensors)"
        if (model_dir / "pytorch_model.bin").exists()
        else ""
    )
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json found{hint}")


def _open(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file listed by the checkpoint is missing")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: cannot be read as safetensors: {exc}") from exc


def load_stage(
    model_dir: str | Path,
    stage: int = 0,
    num_stages: int = 1,
    partition: Sequence[int] | None = None,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_parallel: bool = False,
) -> StageModel:
    """Build stage `stage` of `num_stages` and load exactly its tensors.

    With `tp_size` > 1, rank `tp_rank`'s share of them (`ModelConfig.shard`): each split
    tensor is read as a slice of the checkpoint's; `expert_parallel`: a mixture of experts'
    experts are not split, the rank holds 1/T of them whole. Ranks other than 0 of the last stage hold
    no final norm or LM head (rank 0 alone computes the logits). `quantization="fp8"`
    quantizes the linear layers' weights once they are loaded (see
    worker_svc/weights/quantization.py); the stage's weight bytes are logged either way.
    """
    check_quantization(quantization)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: checkpoint directory not found")
    gguf_file = gguf_source(model_dir)
    if gguf_file is not None:
        return load_gguf_stage(
            gguf_file,
            model_dir,
            stage,
            num_stages,
            partition,
            dtype,
            device,
            quantization,
            tp_rank,
            tp_size,
            expert_parallel,
        )
    config = load_config(model_dir)
    check_place(stage, num_stages, tp_rank, tp_size)
    start, end = partition_layers(config.num_layers, num_stages, partition)[stage]
    torch_dtype = resolve_dtype(dtype, config, device)
    load_dtype = read_dtype(quantization, torch_dtype, device)
    model = StageModel(
        config.shard(tp_size, tp_rank if expert_parallel and config.moe else None),
        start,
        end,
        is_first=stage == 0,
        is_last=stage == num_stages - 1 and tp_rank == 0,
        device=device,
    )
    model.source_dir = str(model_dir)  # the checkpoint folder (its tokenizer: structured output)
    # MXFP4 experts (gpt-oss) stay packed where a GGUF file's types would: --dtype auto on the CPU
    keep_mxfp4 = dtype == "auto" and quantization is None and tp_size == 1 and torch.device(device).type == "cpu"
    state, packed_modules = _safetensors_state(
        model, config, model_dir, f"stage {stage} needs it for layers [{start}, {end})", (tp_rank, tp_size), keep_mxfp4
    )
    state = {name: t.to(device=device, dtype=load_dtype) for name, t in state.items()}
    install_packed(model, packed_modules, state)
    load_state(model, state, model_dir)
    del state
    if packed_modules:
        model.weight_format = "mxfp4"
    model.fold_norm_offsets()
    finish_stage(model, quantization, torch_dtype, device)
    log.info(
        "stage %d of %d%s: layers [%d, %d), %s weights%s: %d bytes",
        stage, num_stages, f", tensor-parallel rank {tp_rank} of {tp_size}" if tp_size > 1 else "",
        start, end, torch_dtype, f" ({quantization})" if quantization else "", weight_bytes(model),
    )  # fmt: skip
    return model


def _safetensors_state(
    model: StageModel, config: ModelConfig, model_dir: Path, needed_for: str, tp: tuple[int, int], keep_mxfp4: bool
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, torch.Tensor, int]]]:
    """The stage's tensors from a safetensors checkpoint (`config`: the whole model's): (float
    tensors by name, module -> (qtype, data, in_features) of those kept packed); a rank's own
    experts read whole."""
    expected = model.expected_tensors()
    where = weight_files(model_dir)
    sources = {**_renamed_sources(config, expected, where), **fused_sources(config, expected)}
    whole = {n: w for n, w in expected.items() if held_whole(n, model.config)}
    split = {n: w for n, w in expected.items() if n not in whole}
    state: dict[str, torch.Tensor] = {}
    packed_modules: dict[str, tuple[str, torch.Tensor, int]] = {}
    for names, (rank, size) in ((split, tp), (whole, (0, 1))):
        by_file = _tensors_by_file(model_dir, names, needed_for, sources, where)
        for name, tensor in _read_safetensors(by_file, names, rank, size, sources, keep_mxfp4):
            if isinstance(tensor, PackedRows):
                packed_modules[name.rsplit(".", 1)[0]] = (tensor.qtype, tensor.data, tensor.in_features)
            else:
                state[name] = rank_bias(name, tensor, rank)
    return state, packed_modules


@dataclass(frozen=True)
class PackedRows:
    """A weight read in a packed type, kept so (`install_packed`): MXFP4 experts."""

    qtype: str
    data: torch.Tensor  # uint8 [rows, row bytes]
    in_features: int


# a tensor the checkpoint holds inside a fused one (Phi-3's qkv_proj): name -> (the fused
# tensor's name, its first row, its rows), in the whole model's terms; or under another
# name: (that name, None, None); or as one expert's slice of a stacked tensor (gpt-oss)
FusedSources = Mapping[str, tuple[str, int | None, int | None] | StackedSource]


def _stored(source: tuple[str, int | None, int | None] | StackedSource) -> str:
    return source.stored if isinstance(source, StackedSource) else source[0]


def _renamed_sources(
    config: ModelConfig, expected: Mapping[str, Sequence[int]], where: Mapping[str, Path]
) -> dict[str, tuple[str, None, None]]:
    """Tensors the checkpoint holds under another name (`Architecture.stored_names`: a
    multimodal checkpoint's language model)."""
    arch = architecture_of_model(config.model_type)
    found = {}
    for name in expected:
        stored = next((n for n in arch.stored_names(name) if n in where), name)
        if stored != name:
            found[name] = (stored, None, None)
    return found


def _tensors_by_file(
    model_dir: Path,
    expected: Mapping[str, Sequence[int]],
    needed_for: str,
    sources: FusedSources | None = None,
    where: Mapping[str, Path] | None = None,
) -> dict[Path, list[str]]:
    """The safetensors files holding the `expected` tensors, and which of them each holds."""
    where = weight_files(model_dir) if where is None else where
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        stored = _stored(sources[name]) if sources and name in sources else name
        if stored not in where and f"{stored}_blocks" in where:  # MXFP4 (`_mxfp4_part`)
            stored = f"{stored}_blocks"
        if stored not in where:
            raise CheckpointError(f"{model_dir}: tensor {stored!r} is missing from the checkpoint ({needed_for})")
        by_file.setdefault(where[stored], []).append(name)
    return by_file


def _read_safetensors(
    by_file: Mapping[Path, list[str]],
    expected: Mapping[str, Sequence[int]],
    tp_rank: int,
    tp_size: int,
    sources: FusedSources | None = None,
    keep_mxfp4: bool = False,
) -> Iterator[tuple[str, torch.Tensor | PackedRows]]:
    """Each tensor of `by_file` as the checkpoint holds it (rank `tp_rank`'s share of a split
    one; its rows of a fused one, `sources`), after checking its shape against `expected`
    (the whole tensor's, for a split one); each file is opened once."""
    for path, names in by_file.items():
        with _open(path) as f:
            present = set(f.keys())
            for name in names:
                source = (sources or {}).get(name, (name, None, None))
                if isinstance(source, StackedSource):
                    yield name, _stacked_part(f, path, source, name, expected[name], (tp_rank, tp_size), keep_mxfp4)
                    continue
                stored, first, rows = source
                if stored not in present:
                    raise CheckpointError(f"{path}: tensor {stored!r} is missing from this file")
                part = f.get_slice(stored)
                shape = tuple(part.get_shape())
                dim, full = full_shape(name, expected[name], tp_size)
                if first is not None:  # one part's rows of a fused tensor
                    if len(shape) < 1 or shape[0] < first + rows or tuple(shape[1:]) != tuple(full[1:]):
                        raise CheckpointError(
                            f"{path}: tensor {stored!r} has shape {list(shape)}, too "
                            f"small for {name!r} (rows {first}..{first + rows})"
                        )
                    size = expected[name][0] if dim == 0 else rows
                    offset = first + (tp_rank * size if dim == 0 else 0)
                    yield name, part[offset : offset + size]
                    continue
                if shape != tuple(full):
                    raise CheckpointError(
                        f"{path}: tensor {stored!r} has shape {list(shape)}, expected {full} from config.json"
                    )
                if dim is None:
                    yield name, f.get_tensor(stored)
                else:
                    yield name, rank_share(part, dim, expected[name][dim], tp_rank)


def _stacked_part(
    f, path: Path, source: StackedSource, name: str, want: Sequence[int], tp: tuple[int, int], keep_mxfp4: bool
) -> torch.Tensor | PackedRows:
    """Rank `tp[0]`'s share of `name`, one expert's slice of a stacked tensor (`source`):
    only that expert is read. An MXFP4 checkpoint (`<stored>_blocks`, `_scales`) holds the
    weight as its transpose's rows: kept packed when `keep_mxfp4`, else dequantized."""
    names = set(f.keys())
    if source.stored not in names and f"{source.stored}_blocks" in names:
        return _mxfp4_part(f, path, source, name, want, tp, keep_mxfp4)
    if source.stored not in names:
        raise CheckpointError(f"{path}: tensor {source.stored!r} is missing from this file")
    stacked = f.get_slice(source.stored)
    shape = tuple(stacked.get_shape())
    if not shape or shape[0] <= source.expert:
        raise CheckpointError(f"{path}: tensor {source.stored!r} has shape {list(shape)}: no expert {source.expert}")
    tensor = stacked[source.expert]
    tensor = (tensor.T if source.transposed else tensor)[source.offset :: source.step]
    dim, full = full_shape(name, want, tp[1])
    if tuple(tensor.shape) != tuple(full):
        raise CheckpointError(
            f"{path}: tensor {source.stored!r} has shape {list(shape)}: expert {source.expert}'s "
            f"{name!r} would be {list(tensor.shape)}, expected {full} from config.json"
        )
    return (tensor if dim is None else rank_share(tensor, dim, want[dim], tp[0])).contiguous()


def _mxfp4_part(
    f, path: Path, source: StackedSource, name: str, want: Sequence[int], tp: tuple[int, int], keep: bool
) -> torch.Tensor | PackedRows:
    """`_stacked_part` of an MXFP4 weight: blocks [experts, rows, K / 32, 16] and scales
    [experts, rows, K / 32], rows the outputs (the float layout's transpose); a rank's columns
    are whole blocks."""
    from worker_svc.weights.mxfp4 import BLOCK, hf_mxfp4_dequantize, hf_to_ggml_mxfp4

    blocks = f.get_slice(f"{source.stored}_blocks")[source.expert][source.offset :: source.step]
    scales = f.get_slice(f"{source.stored}_scales")[source.expert][source.offset :: source.step]
    dim, full = full_shape(name, want, tp[1])
    if not source.transposed or [blocks.shape[0], blocks.shape[1] * BLOCK] != full:
        raise CheckpointError(
            f"{path}: MXFP4 tensor {source.stored!r}_blocks has expert {source.expert}'s {name!r} "
            f"as {list(blocks.shape[:2])} blocks, expected {full} values from config.json"
        )
    if dim == 1 and want[1] % BLOCK:
        raise CheckpointError(
            f"{path}: {name!r}: a tensor-parallel rank's {want[1]} columns are not whole MXFP4 blocks of {BLOCK}"
        )
    if dim is not None:
        size = want[dim] // (BLOCK if dim == 1 else 1)
        blocks, scales = (rank_share(t, dim, size, tp[0]) for t in (blocks, scales))
    if keep:
        return PackedRows("MXFP4", hf_to_ggml_mxfp4(blocks.contiguous(), scales.contiguous()), want[1])
    return hf_mxfp4_dequantize(blocks.contiguous(), scales.contiguous(), torch.float32)
