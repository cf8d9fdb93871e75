"""Tensors <-> `pagoda.v1.Tensor` (raw bytes + dtype + shape, never pickle).

Plans and results have their one codec next to the proto (`services.step_codec`); this
module holds what needs torch.
"""

from __future__ import annotations

import torch

from services.pb import common_pb2
from worker_svc.errors import InvalidPlanError

_TO_PB_DTYPE = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float8_e4m3fn: common_pb2.DTYPE_FLOAT8_E4M3FN,
    torch.int64: common_pb2.DTYPE_INT64,
    torch.int32: common_pb2.DTYPE_INT32,
}
_FROM_PB_DTYPE = {v: k for k, v in _TO_PB_DTYPE.items()}


def dtype_to_pb(dtype: torch.dtype) -> int:
    return _TO_PB_DTYPE[dtype]


def tensor_to_pb(t: torch.Tensor, out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """Raw little-endian bytes + dtype + shape; never pickle."""
    out = common_pb2.Tensor() if out is None else out
    t = t.detach().contiguous().cpu()
    out.dtype = _TO_PB_DTYPE[t.dtype]
    del out.shape[:]
    out.shape.extend(t.shape)
    out.data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return out


def dtype_from_pb(value: int) -> torch.dtype:
    """InvalidPlanError for a dtype a stage does not take."""
    if value not in _FROM_PB_DTYPE:
        raise InvalidPlanError(
            f"tensor dtype {common_pb2.DType.Name(value) if value in common_pb2.DType.values() else value} is not supported"
        )
    return _FROM_PB_DTYPE[value]


def tensor_from_pb(msg: common_pb2.Tensor) -> torch.Tensor:
    dtype = dtype_from_pb(msg.dtype)
    shape = tuple(msg.shape)
    numel = 1
    for n in shape:
        if n < 0:
            raise InvalidPlanError(f"tensor shape {list(shape)} has a negative size")
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != numel * itemsize:
        raise InvalidPlanError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {numel * itemsize} bytes, got {len(msg.data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
