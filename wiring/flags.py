"""The command line's shared values: parsers for flag values, `PAGODA_*` defaults, help texts.

`pagoda serve` and each service's subcommand declare the same settings; what they share is
written here once (both import it; neither imports the other for it).
"""

from __future__ import annotations

import argparse

KV_CACHE_DTYPE_HELP = ("the KV pools' dtype: auto (the activations': float32 for GGUF and CPU bfloat16 "
                       "stages), float32, or bfloat16 (half the bytes; CPU kernels)")


STALL_HELP = ("a streaming client that reads nothing for this long, while the gateway holds all it "
              "buffers for it, has its request aborted (finish reason \"abort\"); 0: never (default 30)")


def names(raw: str) -> list[str]:
    """A list of names from one setting: separated by commas or whitespace."""
    return [n for n in raw.replace(",", " ").split() if n]


def env_default(name: str, default=None, kind=str):
    """Flag default from `PAGODA_<NAME>`, so a service can be configured by environment."""
    import os

    variable = f"PAGODA_{name.upper().replace('-', '_')}"
    raw = os.environ.get(variable)
    if raw is None or (raw == "" and kind is not str):  # set empty (compose's ${X:-}): unset
        return default
    try:
        return kind(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"error: {variable}={raw!r}: {exc}") from None


def _setting(text: str, convert, ok, expected: str):
    """One optional setting's value: "" (an unset PAGODA_* variable in compose) means none;
    otherwise `convert(text)`, which `ok` must accept."""
    if not text.strip():
        return None
    try:
        value = convert(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from exc
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def optional_limit(text: str) -> int | None:
    """A positive limit, or none."""
    return _setting(text, int, lambda v: v >= 1, "a positive integer")


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _bytes(text: str) -> int:
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    if raw[len(number):] not in _BYTE_UNITS:
        raise ValueError(f"unknown unit in {text!r}")
    return int(float(number) * _BYTE_UNITS[raw[len(number):]])


def byte_size(text: str) -> int | None:
    """A size in bytes: 4294967296, 4GiB, 512MiB, 1.5GB; or none."""
    return _setting(text, _bytes, lambda v: 1 <= v < 2**63, "a size such as 4GiB or 512MiB")


def fraction(text: str) -> float | None:
    """A fraction in (0, 1], or none."""
    return _setting(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


GPU_MEMORY_HELP = ("size the KV pool from memory: the fraction of the device's memory a stage may use (on "
                   "the CPU, of the system's memory), weights and peak activations included (as vLLM)")
KV_CACHE_MEMORY_HELP = "size the KV pool from memory: bytes for the pool itself, e.g. 4GiB (as vLLM-cpu's KV space)"
TENSOR_PARALLEL_HELP = ("processes per stage, each holding 1/T of every layer's attention heads, KV heads and "
                        "MLP columns (torch.distributed: gloo on the CPU, NCCL on CUDA); T must divide them "
                        "(default 1)")


def check_tensor_parallel(model_dir: str, size: int) -> None:
    """ValueError when `size` ranks cannot split the checkpoint's heads and MLP evenly (a
    missing or unreadable checkpoint is left to the loader to report)."""
    if size == 1:
        return
    from worker_svc.errors import CheckpointError
    from worker_svc.model_config import ModelConfig

    try:
        config = ModelConfig.from_dir(model_dir)
    except CheckpointError:
        return
    config.shard(size)


def parse_bool(text: str) -> bool:
    return text.lower() in ("1", "true", "yes", "on")


def _bool_or_auto(text: str) -> bool | None:
    """`PAGODA_ASYNC_SCHEDULING`: "" or "auto" -> None (decided by the stage count)."""
    value = text.strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return parse_bool(value)
    raise SystemExit(f"error: expected true, false or auto, got {text!r}")


def _tenant_weights(text: str) -> dict[str, float]:
    """`a=3,b=1` -> {"a": 3.0, "b": 1.0}"""
    out = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, _, weight = part.partition("=")
        try:
            out[name] = float(weight)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected tenant=weight pairs, got {part!r}") from exc
    return out


PARSERS = {"int": int, "float": float, "str": str, "bool": parse_bool, "switch": parse_bool,
            "auto_bool": _bool_or_auto, "weights": _tenant_weights}
