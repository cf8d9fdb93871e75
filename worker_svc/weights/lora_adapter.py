"""LoRA adapters read from PEFT folders: the loading half of multi-LoRA serving (the bank of
slots and a step's products: worker_svc/weights/lora.py).

    load_adapter(folder, config, start, end, ...) -> LoraAdapter   a folder's A and B for a stage's layers

An adapter adds `scaling * B @ A` to the weight of some of a decoder layer's seven linear
layers (q/k/v/o_proj, gate/up/down_proj; `LORA_TARGETS`; an adapter of a fused module of
Phi-3's checkpoint, `qkv_proj` or `gate_up_proj`, is the adapters of its parts, B's rows
split: `FUSED_TARGETS`).

Files: `adapter_config.json` and `adapter_model.safetensors` only; a folder holding only a
pickle (`adapter_model.bin`) is refused, never unpickled. Tensor names are PEFT's:
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). Tensor parallelism takes a rank's share as
worker_svc/checkpoints/shards.py shards the base weights: column-parallel targets (q/k/v, gate/up)
slice B's rows, row-parallel ones (o_proj, down_proj) slice A's columns, so the ranks'
partial deltas of o_proj and down_proj sum (in the layer's all-reduce) to the whole delta.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from worker_svc.errors import CheckpointError
from worker_svc.model_config import ModelConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QKV_TARGETS = ("q_proj", "k_proj", "v_proj")  # Attention.qkv's columns, in order
GATE_UP_TARGETS = ("gate_proj", "up_proj")  # MLP.gate_up's columns, in order
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# tensor parallelism: the dimension of a target's base weight [out, in] that the ranks split,
# as worker_svc/loader.shard_dim splits the checkpoint (a test holds them equal; not imported
# from there: the loader imports the model, which names worker_svc/weights/lora.py's types)
SHARD_DIMS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 0, "up_proj": 0, "down_proj": 1}
# targets of checkpoints that hold several linears in one (Phi-3's, worker_svc/models/phi3.py):
# an adapter of one is the adapters of its parts, B's rows split (delta = B @ A, row by row)
FUSED_TARGETS = {"qkv_proj": QKV_TARGETS, "gate_up_proj": GATE_UP_TARGETS}
_PARENT.update({"qkv_proj": "self_attn", "gate_up_proj": "mlp"})
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# adapter_config.json options that change what the adapter computes beyond `scaling * B @ A`
# on the seven targets: refused when set (any true, non-empty value)
_REFUSED_OPTIONS = (
    "use_dora",
    "modules_to_save",
    "lora_bias",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "arrow_config",
    "velora_config",
    "monteclora_config",
    "use_bdlora",
    "kasa_config",
)
_TENSOR_NAME = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")


class LoraWeights(NamedTuple):
    """One module's adapter: `delta W = scaling * b @ a`."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights for layers `[start, end)` (a rank's share of them under tensor
    parallelism); `rank` is its largest module rank over all the model's layers."""

    folder: str
    start: int
    end: int
    rank: int
    weights: Mapping[tuple[int, str], LoraWeights]  # (layer, target) -> weights

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(target for _, target in self.weights)


@dataclass(frozen=True)
class _Options:
    """What adapter_config.json says about the products."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]

    def module_rank(self, module: str) -> int:
        return int(self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r))

    def scaling(self, module: str) -> float:
        r = self.module_rank(module)
        alpha = float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def max_rank(self) -> int:
        return max([self.r, *map(int, self.rank_pattern.values())])


def _pattern_key(patterns: Mapping[str, object], module: str) -> str | None:
    """The rank_pattern / alpha_pattern key that applies to `module`, matched as PEFT does:
    the key is a suffix of the module's dotted name (regular expression)."""
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)


def module_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of a target's base weight in a model of `config` (a rank's share of it)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }[target]


def load_adapter(
    folder: str | Path, config: ModelConfig, start: int, end: int, tp_rank: int = 0, tp_size: int = 1, *, max_rank: int
) -> LoraAdapter:
    """The adapter in PEFT folder `folder`, for layers `[start, end)` of a model of `config`:
    the config the stage holds (`StageModel.config`: rank `tp_rank`'s share of the model
    when `tp_size` > 1), the checkpoint's shapes being `tp_size` times its split sizes.

    Every tensor of the file is checked (name, target, shape, rank), not only the stage's,
    so that every stage accepts or refuses an adapter alike. ValueError (CheckpointError for
    a missing or unreadable file) naming what is wrong: a target other than the seven
    linear layers of the decoder (embed_tokens, lm_head), a rank above `max_rank`, an
    option this serving does not compute (DoRA, modules_to_save, ...)."""
    folder = Path(folder)
    if not 0 <= start < end <= config.num_layers:
        raise ValueError(f"layer range [{start}, {end}) outside 0..{config.num_layers}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    options = _read_options(folder)
    if options.max_rank > max_rank:
        raise ValueError(
            f"{folder}: LoRA rank {options.max_rank} is above max_rank={max_rank} "
            "(the bank's largest rank: raise it to serve this adapter)"
        )
    path = _weights_path(folder)
    weights: dict[tuple[int, str], LoraWeights] = {}
    with _open(path) as f:
        modules = _modules_of(path, list(f.keys()), config.num_layers)
        for (layer, target), names in sorted(modules.items()):
            a_name, b_name = names
            module = f"model.layers.{layer}.{_PARENT[target]}.{target}"
            a, b = f.get_slice(a_name), f.get_slice(b_name)
            parts = FUSED_TARGETS.get(target, (target,))
            fulls = [_full_shape(config, part, tp_size) for part in parts]
            _check_shapes(
                path,
                module,
                tuple(a.get_shape()),
                tuple(b.get_shape()),
                (sum(out for out, _ in fulls), fulls[0][1]),
                options.module_rank(module),
            )
            if target in FUSED_TARGETS and any((layer, part) in modules for part in parts):
                raise ValueError(f"{path}: layer {layer} adapts {target} and one of its parts")
            if start <= layer < end:
                a_full, b_full = f.get_tensor(a_name), f.get_tensor(b_name)
                for part, b_part in zip(parts, b_full.split([out for out, _ in fulls]), strict=True):
                    a_part, b_part = _rank_share(part, a_full, b_part, module_shape(config, part), tp_rank, tp_size)
                    weights[layer, part] = LoraWeights(a_part.float(), b_part.float(), options.scaling(module))
    return LoraAdapter(str(folder), start, end, options.max_rank, weights)


def _read_options(folder: Path) -> _Options:
    """adapter_config.json, checked: a LoRA adapter whose every option this serving computes."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: {CONFIG_FILE} not found (not a PEFT adapter folder)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON: {exc}") from exc
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {raw['peft_type']!r} is not supported (LORA only)")
    refused = [key for key in _REFUSED_OPTIONS if raw.get(key)]
    if refused:
        raise ValueError(f"{path}: {', '.join(f'{k}={raw[k]!r}' for k in refused)} is not supported by LoRA serving")
    if raw.get("fan_in_fan_out"):
        raise ValueError(f"{path}: fan_in_fan_out=true is not supported (Conv1D-style weights)")
    if raw.get("bias", "none") != "none":
        raise ValueError(f'{path}: bias={raw["bias"]!r} is not supported (bias must be "none")')
    _check_target_modules(path, raw.get("target_modules"))
    try:
        options = _Options(
            int(raw["r"]),
            float(raw.get("lora_alpha", 8)),
            bool(raw.get("use_rslora")),
            dict(raw.get("rank_pattern") or {}),
            dict(raw.get("alpha_pattern") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: r, lora_alpha, rank_pattern, alpha_pattern: {exc!r}") from exc
    if options.r < 1 or any(int(r) < 1 for r in options.rank_pattern.values()):
        raise ValueError(
            f"{path}: LoRA ranks must be positive, got r={options.r}, rank_pattern={dict(options.rank_pattern)}"
        )
    return options


def _check_target_modules(path: Path, target_modules: str | Sequence[str] | None) -> None:
    """A list of targets must name only supported modules; a regular expression (a string)
    is checked through the tensors the file holds."""
    if target_modules is None or isinstance(target_modules, str):
        return
    unsupported = sorted({t for t in target_modules if t.rsplit(".", 1)[-1] not in (*LORA_TARGETS, *FUSED_TARGETS)})
    if unsupported:
        raise ValueError(
            f"{path}: target module(s) {', '.join(unsupported)} not supported; LoRA "
            f"serving adapts {', '.join(LORA_TARGETS)} of the decoder layers"
        )


def _weights_path(folder: Path) -> Path:
    """adapter_model.safetensors; a folder with only pickled weights is refused by name."""
    path = folder / WEIGHTS_FILE
    if path.is_file():
        return path
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{folder}: {', '.join(pickles)} is a pickle, which is never loaded: "
            f"save the adapter as {WEIGHTS_FILE} (save_pretrained(..., "
            "safe_serialization=True))"
        )
    raise CheckpointError(f"{folder}: {WEIGHTS_FILE} not found")


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: cannot be read as safetensors: {exc}") from exc


def _modules_of(path: Path, names: list[str], num_layers: int) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, target) -> (lora_A's tensor name, lora_B's), every name of the file checked."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in names:
        match = _TENSOR_NAME.fullmatch(name)
        if match is None or match[3] not in _PARENT or _PARENT[match[3]] != match[2]:
            raise ValueError(
                f"{path}: tensor {name!r} is not a LoRA weight of a supported target; "
                f"LoRA serving adapts {', '.join(LORA_TARGETS)} of the decoder layers "
                "(not embed_tokens or lm_head)"
            )
        layer = int(match[1])
        if layer >= num_layers:
            raise ValueError(f"{path}: tensor {name!r} is for layer {layer}; the model has {num_layers}")
        found.setdefault((layer, match[3]), {})[match[4]] = name
    if not found:
        raise ValueError(f"{path}: holds no LoRA weights")
    for (layer, target), pair in found.items():
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"{path}: layer {layer} {target} has no {missing} weight")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def _full_shape(config: ModelConfig, target: str, tp_size: int) -> tuple[int, int]:
    """(out, in) of the checkpoint's whole base weight: a rank's share times `tp_size` along
    the dimension the ranks split."""
    shape = list(module_shape(config, target))
    shape[SHARD_DIMS[target]] *= tp_size
    return shape[0], shape[1]


def _check_shapes(
    path: Path, module: str, a: tuple[int, ...], b: tuple[int, ...], full: tuple[int, int], rank: int
) -> None:
    out_size, in_size = full
    want_a, want_b = (rank, in_size), (out_size, rank)
    if a != want_a or b != want_b:
        raise ValueError(
            f"{path}: {module} has lora_A {list(a)} and lora_B {list(b)}, expected "
            f"{list(want_a)} and {list(want_b)} (rank {rank} from {CONFIG_FILE}, "
            "sizes from the model's config.json)"
        )


def _rank_share(
    target: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int], tp_rank: int, tp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `tp_rank`'s share of a target's A [r, in] and B [out, r], its base weight being
    `shape` (out, in) on the rank: B's rows where the base weight's rows are split (column
    parallel), A's columns where its columns are (row parallel)."""
    if tp_size == 1:
        return a, b
    dim = SHARD_DIMS[target]
    size = shape[dim]
    share = slice(tp_rank * size, (tp_rank + 1) * size)
    if dim == 0:
        return a, b[share].contiguous()
    return a[:, share].contiguous(), b
