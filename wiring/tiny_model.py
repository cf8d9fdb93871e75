"""Tiny Hugging Face causal-LM checkpoints, made offline, deterministically, in seconds.

`make_tiny_model(out_dir, spec)` writes a complete checkpoint directory that
`transformers.AutoModelForCausalLM` and `AutoTokenizer` load as they would a hub model:

    config.json              the architecture's HF config (legacy spellings: `torch_dtype`,
                             `rope_theta`, `rope_scaling`; transformers 5 converts them)
    model.safetensors        random weights from `spec.seed`, HF tensor names
    generation_config.json   bos, eos = [<|eos|>, <|im_end|>]
    tokenizer.json           a byte-level BPE trained on the stdlib's `pydoc_data` text
    tokenizer_config.json    special tokens and a ChatML chat template
    special_tokens_map.json

Same spec, same bytes (on the same Python, whose `pydoc_data` is the training text, and the
same numpy and tokenizers). The weights are scaled so that logits are peaked rather than
near-uniform (logit std about `_LOGIT_STD`), so that greedy decoding is a meaningful test
of a runtime: a top-1/top-2 tie within 1e-4 is rare.

This module is part of the torch-free shared library: weights are made with numpy and the
safetensors file is written by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from services.settings import cache_root

ARCHS: dict[str, tuple[str, str]] = {
    # arch -> (model_type, architectures[0])
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}
DTYPES = ("float32", "float16", "bfloat16")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# Special tokens, at fixed ids 0..4 in this order.
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID = range(5)

# 256 byte tokens + the special tokens: a BPE with no merges at all.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
# The training text runs out of merges a little above this (about 9,100 tokens on
# Python 3.11); make_tiny_model checks the size it actually got.
MAX_VOCAB_SIZE = 8192

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Bump when the maker's output changes for the same spec, so default_model_dir() makes
# a fresh model instead of returning one made by older code.
MAKER_VERSION = 1

_LOGIT_STD = 4.0  # std of the final logits: peaked, but not one-hot
_NORM_NOISE_STD = 0.1  # norm weights are 1 + noise, so a runtime that skips them differs
# qwen2's q/k/v biases: enough that dropping them changes the logits by far more than
# 1e-4; larger ones add the same vector at every position and greedy output repeats.
_QKV_BIAS_STD = 0.1
# o_proj and down_proj write into the residual stream this many times louder than a
# unit-variance init: the layers then outweigh the token's own embedding, so greedy
# decoding does not just repeat the last token (which tied embeddings otherwise favour).
_RESIDUAL_GAIN = 3.0
# Qwen2Tokenizer's pre-tokenizer split, as transformers hard-codes it.
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


# --- small helpers -------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _checked_rope_scaling(rope_scaling: Any) -> dict[str, Any]:
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling: must be a dict or None, got {rope_scaling!r}")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not one of {list(ROPE_TYPES)}")
    factor = rope_scaling.get("factor", 1.0)
    if rope_type != "default" and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
        raise ValueError(f"rope_scaling: factor must be a positive number, got {factor!r}")
    try:
        return json.loads(json.dumps(rope_scaling))  # a deep, JSON-able copy
    except (TypeError, ValueError) as e:
        raise ValueError(f"rope_scaling: not JSON-serialisable: {e}") from e


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


# --- the spec ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """What make_tiny_model makes. Frozen and validated: a spec that exists is makeable.

    `intermediate_size=None` means 8/3 of `hidden_size` rounded up to a multiple of 16
    (176 for 64); it is resolved at construction, so the field always holds an int.
    `rope_scaling` is a dict in HF's legacy spelling (with `rope_type`), copied at
    construction; it takes no part in the hash.
    """

    arch: str = "llama"
    num_layers: int = 4
    hidden_size: int = 64
    intermediate_size: int | None = None
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    sliding_window: int | None = None
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_shape()
        self._check_embeddings_and_rope()

    def _check_shape(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch: {self.arch!r} is not one of {sorted(ARCHS)}")
        if self.intermediate_size is None and _is_int(self.hidden_size):
            # SwiGLU's usual 8/3 ratio, rounded up to a multiple of 16: 176 for 64.
            object.__setattr__(self, "intermediate_size", _round_up(self.hidden_size * 8 // 3, 16))
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.head_dim % 2:
            raise ValueError(
                f"num_heads: head_dim = hidden_size / num_heads = {self.head_dim} must be even for rotary embeddings"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if not _is_int(self.vocab_size) or not MIN_VOCAB_SIZE <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size: must be an int in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]"
                f" (256 bytes + {len(SPECIAL_TOKENS)} special tokens + merges the "
                f"training text allows), got {self.vocab_size!r}"
            )

    def _check_embeddings_and_rope(self) -> None:
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings: must be a bool, got {self.tie_word_embeddings!r}")
        if (
            isinstance(self.rope_theta, bool)
            or not isinstance(self.rope_theta, (int, float))
            or not self.rope_theta > 0
        ):
            raise ValueError(f"rope_theta: must be a positive number, got {self.rope_theta!r}")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _checked_rope_scaling(self.rope_scaling))
        if self.sliding_window is not None:
            if self.arch != "mistral":
                raise ValueError(f"sliding_window: only the mistral arch has one, not {self.arch!r}")
            if not _is_int(self.sliding_window) or self.sliding_window < 1:
                raise ValueError(f"sliding_window: must be a positive int or None, got {self.sliding_window!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {list(DTYPES)}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed: must be a non-negative int, got {self.seed!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape, _ in _tensor_plan(self))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-able values (a copy)."""
        return dataclasses.asdict(self)


DEFAULT_SPEC = TinyModelSpec()
SPEC_25M = TinyModelSpec(
    num_layers=8, hidden_size=512, intermediate_size=1152, num_heads=8, num_kv_heads=4, vocab_size=4096
)
PRESETS: dict[str, TinyModelSpec] = {"tiny": DEFAULT_SPEC, "25m": SPEC_25M}


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    spec: TinyModelSpec = DEFAULT_SPEC,
    *,
    overwrite: bool = False,
    finish: Callable[[Path], object] | None = None,
) -> Path:
    """Write a checkpoint for `spec` into `out_dir` and return its path.

    `finish`, if given, is called on the complete checkpoint before it is moved into place
    (e.g. `wiring.tiny_train.train_tiny_model`, which replaces the random weights).

    The files are written into a temporary folder next to `out_dir` and renamed into place,
    so `out_dir` never holds a half-written model. An existing non-empty `out_dir` raises
    FileExistsError, unless `overwrite` is set and it holds a checkpoint (a config.json).
    """
    out_dir = Path(out_dir).absolute()
    if _is_nonempty_dir(out_dir) or (out_dir.exists() and not out_dir.is_dir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty")
        if not (out_dir / "config.json").is_file():
            raise FileExistsError(
                f"{out_dir} exists and holds no config.json: not overwriting what may not be a checkpoint"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_checkpoint(tmp_dir, spec)
        if finish is not None:
            finish(tmp_dir)
        os.chmod(tmp_dir, 0o755)  # mkdtemp's 0o700 would hide the model from other users
        if overwrite and _is_nonempty_dir(out_dir):
            old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old_dir / "model")
            shutil.rmtree(old_dir)
        try:
            os.replace(tmp_dir, out_dir)  # onto a missing or empty directory only
        except OSError as e:
            raise FileExistsError(f"{out_dir} appeared while the model was being made") from e
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def default_model_dir(*, cache_dir: str | os.PathLike[str] | None = None, spec: TinyModelSpec = DEFAULT_SPEC) -> Path:
    """The default model (for `make run` and tests), made once into the cache and reused.

    The cache is `cache_dir`, else Pagoda's (services/settings.cache_root); the model's
    folder is named by a hash of the spec and MAKER_VERSION, so a changed spec or maker
    makes a new model. Safe against concurrent callers: the loser of a race returns the
    winner's model, which is byte-identical.
    """
    if cache_dir is None:
        cache_dir = cache_root()
    path = Path(cache_dir).absolute() / "models" / f"tiny-{spec.arch}-{spec_digest(spec)}"
    if path.is_dir():
        return path
    try:
        return make_tiny_model(path, spec)
    except FileExistsError:
        if (path / "config.json").is_file():
            return path
        raise


def spec_digest(spec: TinyModelSpec) -> str:
    """A short hash naming what make_tiny_model would write for `spec`."""
    key = json.dumps({"maker_version": MAKER_VERSION, "spec": spec.to_dict()}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the spec's options (not OUT_DIR) to `parser`; spec_from_args reads them back.

    Every option defaults to None, meaning "as in --preset" (default: tiny).
    """
    group = parser.add_argument_group("tiny model")
    group.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="starting spec that the other options override (default: tiny)",
    )
    group.add_argument(
        "--arch", choices=sorted(ARCHS), default=None, help="the architecture config.json names (default: the preset's)"
    )
    for flag, help_text in (
        ("--num-layers", None),
        ("--hidden-size", None),
        ("--intermediate-size", "default: 8/3 of hidden size, rounded up to a multiple of 16"),
        ("--num-heads", None),
        ("--num-kv-heads", None),
        ("--vocab-size", f"tokenizer and model vocabulary, {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE}"),
        ("--max-position-embeddings", None),
        ("--sliding-window", "mistral only"),
        ("--seed", None),
    ):
        group.add_argument(flag, type=int, default=None, help=help_text)
    group.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--rope-theta", type=float, default=None)
    group.add_argument(
        "--rope-scaling",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='e.g. \'{"rope_type": "llama3", "factor": 8.0, ...}\'',
    )
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the weights' dtype in model.safetensors (default: the preset's, float32)",
    )


def spec_from_args(args: argparse.Namespace) -> TinyModelSpec:
    """The spec that add_cli_arguments' options describe. Raises ValueError naming a field."""
    base = PRESETS[getattr(args, "preset", None) or "tiny"]
    changes = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TinyModelSpec)
        if getattr(args, f.name, None) is not None
    }
    if "hidden_size" in changes and "intermediate_size" not in changes:
        changes["intermediate_size"] = None  # derive from the new hidden size
    return dataclasses.replace(base, **changes)


# --- the checkpoint files --------------------------------------------------------------


def _write_checkpoint(out_dir: Path, spec: TinyModelSpec) -> None:
    tokenizer_json = _train_tokenizer(spec.arch, spec.vocab_size)
    files: dict[str, bytes] = {
        "config.json": _json_bytes(_hf_config(spec)),
        "generation_config.json": _json_bytes(
            {
                "bos_token_id": BOS_TOKEN_ID,
                "eos_token_id": [EOS_TOKEN_ID, IM_END_TOKEN_ID],
                "pad_token_id": PAD_TOKEN_ID,
            }
        ),
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": _json_bytes(_tokenizer_config(spec)),
        "special_tokens_map.json": _json_bytes(
            {
                "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
            }
        ),
    }
    for name, data in files.items():
        (out_dir / name).write_bytes(data)
    with open(out_dir / "model.safetensors", "wb") as f:
        _write_safetensors(f, _make_weights(spec), spec.dtype)


def _hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    model_type, architecture = ARCHS[spec.arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6 if spec.arch == "qwen2" else 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if spec.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif spec.arch == "mistral":
        # Written even when None: MistralConfig's default is a 4096-token window.
        config["sliding_window"] = spec.sliding_window
    elif spec.arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers)
    return config


def _tokenizer_config(spec: TinyModelSpec) -> dict[str, Any]:
    return {
        # transformers 5 loads a qwen2 tokenizer as Qwen2Tokenizer whatever this says.
        "tokenizer_class": "Qwen2Tokenizer" if spec.arch == "qwen2" else "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


# --- the tokenizer -----------------------------------------------------------------------


def _training_text() -> list[str]:
    """English text that ships with every CPython: the interpreter's pydoc topics."""
    from pydoc_data import topics

    return [topics.topics[key] for key in sorted(topics.topics)]


def _train_tokenizer(arch: str, vocab_size: int) -> bytes:
    """tokenizer.json of a byte-level BPE with exactly `vocab_size` tokens.

    llama and mistral get GPT-2's byte-level pre-tokenizer. qwen2 gets Qwen2's NFC
    normalizer and split regex, because transformers 5 always loads a qwen2 checkpoint's
    tokenizer as Qwen2Tokenizer, which rebuilds those two whatever tokenizer.json says:
    trained the same way, tokenizer.json and AutoTokenizer agree.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    if arch == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size: the training text yields only {tokenizer.get_vocab_size()} tokens, not {vocab_size}"
        )
    special_ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    if special_ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("the BPE trainer did not put the special tokens at ids 0..4")
    return (tokenizer.to_str(pretty=True) + "\n").encode()


# --- the weights ---------------------------------------------------------------------------


def _tensor_plan(spec: TinyModelSpec) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """(name, shape, init std) of every tensor; norms are 1 + N(0, std)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    head_std = _LOGIT_STD / hidden**0.5  # the final norm leaves rms 1: logit std = _LOGIT_STD
    yield "model.embed_tokens.weight", (spec.vocab_size, hidden), (head_std if spec.tie_word_embeddings else 1.0)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,), _NORM_NOISE_STD
        yield p + "self_attn.q_proj.weight", (q_size, hidden), hidden**-0.5
        yield p + "self_attn.k_proj.weight", (kv_size, hidden), hidden**-0.5
        yield p + "self_attn.v_proj.weight", (kv_size, hidden), hidden**-0.5
        if spec.arch == "qwen2":
            yield p + "self_attn.q_proj.bias", (q_size,), _QKV_BIAS_STD
            yield p + "self_attn.k_proj.bias", (kv_size,), _QKV_BIAS_STD
            yield p + "self_attn.v_proj.bias", (kv_size,), _QKV_BIAS_STD
        yield p + "self_attn.o_proj.weight", (hidden, q_size), _RESIDUAL_GAIN * q_size**-0.5
        yield p + "post_attention_layernorm.weight", (hidden,), _NORM_NOISE_STD
        yield p + "mlp.gate_proj.weight", (inter, hidden), hidden**-0.5
        yield p + "mlp.up_proj.weight", (inter, hidden), hidden**-0.5
        yield p + "mlp.down_proj.weight", (hidden, inter), _RESIDUAL_GAIN * inter**-0.5
    yield "model.norm.weight", (hidden,), _NORM_NOISE_STD
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", (spec.vocab_size, hidden), head_std


def _make_weights(spec: TinyModelSpec) -> dict[str, np.ndarray]:
    """float32 weights. Each tensor has its own generator keyed on (seed, name), so a
    tensor does not change when others are added or removed (e.g. more layers)."""
    weights = {}
    for name, shape, std in _tensor_plan(spec):
        name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        rng = np.random.default_rng([spec.seed, name_key])
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if name.endswith("norm.weight"):
            values += np.float32(1.0)
        weights[name] = values
    return weights


def _write_safetensors(f: Any, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """A safetensors file: u64 header length, JSON header (sorted keys), raw little-endian
    data in the header's order. float32 arrays are converted to `dtype` on the way."""
    blobs: dict[str, bytes] = {}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        blob = _to_dtype_bytes(tensors[name], dtype)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs[name] = blob
        offset += len(blob)
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # keeps the data 8-byte aligned
    f.write(struct.pack("<Q", len(header_bytes)))
    f.write(header_bytes)
    for name in sorted(blobs):
        f.write(blobs[name])


def _to_dtype_bytes(values: np.ndarray, dtype: str) -> bytes:
    values = np.ascontiguousarray(values, dtype="<f4")
    if dtype == "float32":
        return values.tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    return float32_to_bfloat16_bits(values).astype("<u2").tobytes()


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even.
    (NaN payloads are not preserved; the weights have none.)"""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)
