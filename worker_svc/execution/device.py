"""Where a stage worker runs: `--device cpu|cuda|cuda:N`, by default CUDA when present.

`resolve_device` turns the configured name into a concrete `torch.device` (an explicit
index for CUDA) or raises ValueError saying what is available; `check_dtype` refuses a
dtype the device cannot compute in; `default_attention_backend` names the attention
backend that suits the device (Triton kernels on CUDA, the native decode kernel on the CPU).
"""

from __future__ import annotations

import torch

DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """`None`: the current CUDA device when there is one, else the CPU."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be cpu, cuda or cuda:N; got {name!r}") from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device type {device.type!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = f"CUDA {built} build, but no device is visible" if built else "a CPU-only build"
        raise ValueError(f"device {str(device)!r} requested, but CUDA is not available (torch "
                         f"{torch.__version__}: {why})")  # fmt: skip
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(f"device {str(device)!r} does not exist: {count} CUDA device(s), "
                         f"cuda:0..cuda:{count - 1}")  # fmt: skip
    return torch.device("cuda", index)


def check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """ValueError for a compute dtype the device cannot run (bfloat16 before Ampere)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
    if device.type == "cuda" and dtype == torch.bfloat16:
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(device)
            raise ValueError(f"{name} ({device}) has no bfloat16 support; use float16 or float32")


def default_attention_backend(device: torch.device) -> str:
    """The attention backend for a device: Triton kernels on CUDA; on the CPU the native
    decode kernel (`cpu`, which keeps the torch path when no C compiler is there)."""
    return "triton" if device.type == "cuda" else "cpu"
