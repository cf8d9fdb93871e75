"""Pooling: how an embedding request turns its prompt into one vector, in every layer.

An embedding request is a prefill-only request (vLLM's pooling runner, for a decoder
checkpoint): it gets KV blocks, its prompt may be chunked and batched with other requests'
steps, and the last stage, instead of sampling after the prompt's last position, pools the
final hidden states (the output of the model's final norm) and L2-normalizes the result.
The request then finishes, freeing its blocks. `PoolingType` says how it pools; the vector
travels as little-endian float32 bytes (`Embedding`), and as a `pagoda.v1.Tensor` on the
wire (`embedding_to_pb` / `embedding_from_pb`).
"""

from __future__ import annotations

import enum
import struct

from services.pb import common_pb2


class PoolingType(enum.Enum):
    """LAST: the last prompt position's hidden state (vLLM's default for decoder models);
    a prefix-cache hit is fine, as the last position is always computed. MEAN: the mean
    over every prompt position, so every position must be computed (never from the prefix
    cache), chunk by chunk."""

    LAST = "LAST"
    MEAN = "MEAN"

    @property
    def needs_every_position(self) -> bool:
        return self is PoolingType.MEAN

    def to_pb(self) -> int:
        return _TO_PB[self]

    @classmethod
    def from_pb(cls, value: int) -> PoolingType | None:
        """None for POOLING_TYPE_UNSPECIFIED (a request that generates); ValueError for a
        value this version does not know."""
        if value == common_pb2.POOLING_TYPE_UNSPECIFIED:
            return None
        for kind, number in _TO_PB.items():
            if number == value:
                return kind
        raise ValueError(f"pooling: unknown pooling type {value}")


_TO_PB = {PoolingType.LAST: common_pb2.POOLING_TYPE_LAST, PoolingType.MEAN: common_pb2.POOLING_TYPE_MEAN}
POOLING_TYPES = tuple(p.value for p in PoolingType)

# an embedding: float32 values, little-endian, no padding
Embedding = bytes
FLOAT32_BYTES = 4


def embedding_values(data: Embedding) -> list[float]:
    """The float32 values of an embedding, as Python floats."""
    return list(struct.unpack(f"<{len(data) // FLOAT32_BYTES}f", data))


def embedding_to_pb(data: Embedding, out: common_pb2.Tensor) -> None:
    out.dtype = common_pb2.DTYPE_FLOAT32
    out.shape[:] = [len(data) // FLOAT32_BYTES]
    out.data = data


def embedding_from_pb(t: common_pb2.Tensor) -> Embedding:
    """ValueError unless it is a non-empty float32 vector whose bytes match its shape."""
    if (
        t.dtype != common_pb2.DTYPE_FLOAT32
        or len(t.shape) != 1
        or t.shape[0] < 1
        or len(t.data) != t.shape[0] * FLOAT32_BYTES
    ):
        raise ValueError(
            f"embedding: want a float32 vector, got dtype {t.dtype}, shape {list(t.shape)}, {len(t.data)} bytes"
        )
    return bytes(t.data)
