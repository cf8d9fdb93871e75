"""What loading a stage does whatever the checkpoint's format (loader.py: safetensors,
gguf_loader.py: GGUF): where the stage sits (its layers, its rank), the dtypes it is read and
served in, and what every loaded stage goes through once its tensors are read (packed modules
installed, the state loaded, quantization, the CPU's bfloat16 packing, fused projections)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from services.settings import AUTO_DTYPE, PACKED_BF16, env_value
from worker_svc.errors import CheckpointError
from worker_svc.kernels.cpu_features import cpu_features
from worker_svc.model_config import DTYPE_NAMES, ModelConfig
from worker_svc.models.registry import architecture_of_model
from worker_svc.models.stage import StageModel
from worker_svc.weights.packed import PackedEmbedding, PackedLinear, pack_bfloat16
from worker_svc.weights.quantization import quantize_model

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def partition_layers(num_layers: int, num_stages: int, partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
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
        raise ValueError(f"layer partition {partition} must have {num_stages} positive counts summing to {num_layers}")
    ranges, start = [], 0
    for n in partition:
        ranges.append((start, start + n))
        start += n
    return ranges


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


def check_place(stage: int, num_stages: int, tp_rank: int, tp_size: int) -> None:
    """ValueError unless stage `stage` of `num_stages` and rank `tp_rank` of `tp_size` exist."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")


def fused_sources(
    config: ModelConfig, expected: Mapping[str, Sequence[int]], gguf: bool = False
) -> dict[str, tuple[str, int, int]]:
    arch = architecture_of_model(config.model_type)
    source_of = arch.gguf_source_of if gguf else arch.source_of
    return {name: src for name in expected if (src := source_of(name, config)) is not None}


def read_dtype(quantization: str | None, dtype: torch.dtype, device) -> torch.dtype:
    """The dtype tensors are read in: float32 for int8 (its rows are quantized from the
    checkpoint's float32 values; the rest takes `dtype` after), else `dtype`."""
    if quantization != "int8":
        return dtype
    if torch.device(device).type != "cpu":
        raise ValueError("quantization int8 runs on the CPU's kernels only; use fp8 on CUDA")
    return torch.float32


def install_packed(
    model: StageModel, packed_modules: Mapping[str, tuple[str, torch.Tensor, int]], state: dict[str, torch.Tensor]
) -> None:
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


def load_state(model: StageModel, state: dict[str, torch.Tensor], source: Path) -> None:
    """`state` into `model` (whose packed modules are installed already): every tensor used,
    none left unloaded."""
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left or unexpected:
        raise CheckpointError(f"{source}: tensors not matched to the model: {left or unexpected}")


def finish_stage(model: StageModel, quantization: str | None, torch_dtype: torch.dtype, device) -> None:
    """What every loaded stage goes through once its tensors are in: quantization, the CPU's
    bfloat16 packing, fused projections."""
    model.eval()
    _quantize(model, quantization, torch_dtype)
    _pack_cpu_bfloat16(model, torch_dtype, device, quantization)
    model.fuse_projections()


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
    if (
        dtype != torch.bfloat16
        or quantization not in (None, "int8")
        or torch.device(device).type != "cpu"
        or not env_value(PACKED_BF16)
    ):
        return
    pack_bfloat16(model)
    if not model.weight_format:
        model.weight_format = "bf16-weights"
