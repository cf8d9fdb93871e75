"""Loading one pipeline stage from a GGUF file (`load_stage` comes here for a folder that
`prepare_gguf` made from one): its tensors read from the file, kept in their packed types or
dequantized, then the steps every stage goes through (stage_setup.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint, GGUFTensor
from worker_svc.checkpoints.shards import full_shape, held_whole, rank_bias, rank_share, shard_dim
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
from worker_svc.models.registry import load_config
from worker_svc.models.stage import StageModel
from worker_svc.weights.quantization import weight_bytes

log = logging.getLogger(__name__)


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
    load_dtype = read_dtype(quantization, torch_dtype, device)
    check_place(stage, num_stages, tp_rank, tp_size)
    start, end = partition_layers(config.num_layers, num_stages, partition)[stage]
    model = StageModel(
        config.shard(tp_size, tp_rank if expert_parallel and config.moe else None),
        start,
        end,
        is_first=stage == 0,
        is_last=stage == num_stages - 1 and tp_rank == 0,
        device=device,
    )
    model.source_dir = str(model_dir)
    state, packed_modules, dequantized = _gguf_state(
        model, ckpt, gguf_file, config, raw_config, packed, (tp_rank, tp_size), device, load_dtype
    )
    install_packed(model, packed_modules, state)
    load_state(model, state, gguf_file)
    del state
    if not ckpt.arch.gguf_norm_offset_stored:  # llama.cpp stores Gemma's norms as 1 + w
        model.fold_norm_offsets()
    finish_stage(model, quantization, torch_dtype, device)
    kinds = sorted({q for q, _, _ in packed_modules.values()})
    if kinds:
        model.weight_format = f"gguf:{'/'.join(kinds)}"
    if packed and dequantized:
        log.info(
            "stage %d: %s tensors of %s dequantized to float32 at load (no packed kernels for these types yet); %s",
            stage,
            "/".join(sorted(dequantized)),
            gguf_file.name,
            f"{'/'.join(kinds)} kept packed" if kinds else "none kept packed",
        )
    log.info(
        "stage %d of %d: layers [%d, %d) of %s, %s: %d bytes",
        stage, num_stages, start, end, gguf_file.name,
        f"packed {'/'.join(kinds)} weights" if kinds else f"{torch_dtype} weights", weight_bytes(model),
    )  # fmt: skip
    return model


def _gguf_state(
    model: StageModel,
    ckpt: GGUFCheckpoint,
    gguf_file: Path,
    config: ModelConfig,
    raw_config,
    packed: bool,
    tp: tuple[int, int],
    device,
    load_dtype: torch.dtype,
):
    """The stage's tensors from the GGUF file: (state dict of float tensors, module -> (qtype,
    data, in_features) of those kept packed, block types dequantized for want of kernels)."""
    state: dict[str, torch.Tensor] = {}
    packed_modules: dict[str, tuple[str, torch.Tensor, int]] = {}  # module -> (qtype, data, in)
    dequantized: set[str] = set()  # block types without packed kernels, dequantized here
    expected = model.expected_tensors()
    sources = fused_sources(config, expected, gguf=True)
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
            tensor = rank_share(tensor, dim, want[dim], tp_rank)
        state[name] = rank_bias(name, tensor, tp_rank).to(device=device, dtype=load_dtype).contiguous()
    return state, packed_modules, dequantized


def _check_packed_gguf(quantization: str | None, device: str | torch.device, tp_size: int) -> None:
    """A GGUF file served in its own packed types (`dtype="auto"`): no load-time
    quantization, the CPU only, no tensor parallelism."""
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} needs float weights: pass --dtype with a GGUF file")
    if device != "cpu" and torch.device(device).type != "cpu":
        raise ValueError(
            f"a GGUF file's packed types run on the CPU: pass --dtype bfloat16 or float32 for device {device}"
        )
    if tp_size > 1:
        raise ValueError(
            "tensor parallelism over a GGUF file's packed types is not supported: pass --dtype to serve it dequantized"
        )


def _gguf_tensor(ckpt: GGUFCheckpoint, gguf_file: Path, name: str, want: Sequence[int], raw_config, tp_size: int):
    """Checkpoint tensor `name` from the GGUF file, its shape checked against `want` (the
    whole tensor's, for one split across `tp_size` ranks)."""
    if name == "lm_head.weight" and not ckpt.has(name):
        raise CheckpointError(f"{gguf_file}: tensor 'output.weight' is missing (the model's embeddings are not tied)")
    t = ckpt.tensor(name, raw_config)
    _, full = full_shape(name, want, tp_size)
    if t.shape != tuple(full):
        raise CheckpointError(
            f"{gguf_file}: tensor {name!r} has shape {list(t.shape)}, expected {full} from the file's metadata"
        )
    return t


def _gguf_part(
    ckpt: GGUFCheckpoint,
    gguf_file: Path,
    source: tuple[str, int, int],
    want: Sequence[int],
    raw_config,
    tp_size: int,
    cache: dict,
):
    """The rows of one part of a fused GGUF tensor (Phi-3's attn_qkv, ffn_up), its shape
    checked against `want` (the whole part's, for one split across `tp_size` ranks)."""
    stored, first, rows = source
    if stored not in cache:
        if len(cache) >= 3:  # parts are asked for fused tensor by fused tensor (experts: three at a time)
            cache.clear()
        cache[stored] = ckpt.tensor(stored, raw_config)
    t = cache[stored]
    if t.shape[0] < first + rows or tuple(t.shape[1:]) != tuple(want[1:]):
        raise CheckpointError(
            f"{gguf_file}: tensor {stored!r} has shape {list(t.shape)}, too small for "
            f"rows {first}..{first + rows} of {want[1:]} columns"
        )
    if rows != want[0] * tp_size:
        raise CheckpointError(f"{gguf_file}: a part of {stored!r} has {rows} rows, expected {want[0] * tp_size}")
    return GGUFTensor(name=stored, qtype=t.qtype, shape=(rows, *t.shape[1:]), data=t.data[first : first + rows])
