"""Layers whose weights stay in a GGUF block format (Q8_0, Q4_0, Q4_1) or bfloat16.

`PackedLinear` holds the packed rows (`uint8 [out, row_bytes]`, see
worker_svc/quant_kernels.py for the block layouts) and multiplies in that form with the
native kernels: activations quantized per 32-element block to int8, integer dot products on
the CPU's VNNI (or AVX2) units, as llama.cpp does. Without the native kernels it dequantizes
on the fly (the same weights, float32 activations: a slower path that computes the same
product up to the activations' rounding). `PackedEmbedding` dequantizes only the rows it
looks up, and serves as the tied LM head (`as_linear`).

Weights are persistent buffers, so `weight_bytes()` (worker_svc/quantization.py) counts
their packed size; activations and outputs are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.quant_kernels import dequantize, quant_kernels

PACKED_QTYPES = ("Q8_0", "Q4_0", "Q4_1")


class PackedLinear(nn.Module):
    """`y = x @ W^T (+ bias)` with W packed. Invariants: `qweight` is uint8
    `[out_features, row_bytes]` of `qtype` (or bfloat16 `[out, in]` when qtype is "BF16");
    `bias` float32 or None."""

    def __init__(self, qweight: torch.Tensor, qtype: str, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if qtype not in (*PACKED_QTYPES, "BF16"):
            raise ValueError(f"PackedLinear: unsupported type {qtype!r}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.kernels = quant_kernels()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, native={self.kernels is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        if self.kernels is not None:
            if self.qtype == "BF16":
                y = self.kernels.matmul_bf16(x2, self.qweight)
            else:
                y = self.kernels.matmul(x2, self.qweight, self.qtype)
        else:
            y = F.linear(x2, self.dequantized())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 `[out, in]`."""
        if self.qtype == "BF16":
            return self.qweight.float()
        return dequantize(self.qweight, self.qtype, self.in_features)

    @staticmethod
    def concat(linears: list[PackedLinear]) -> PackedLinear | None:
        """One layer computing the given ones side by side (rows stacked), or None when their
        types, inputs or biases differ. Packed rows are independent, so stacking is exact."""
        first = linears[0]
        if any(m.qtype != first.qtype or m.in_features != first.in_features for m in linears):
            return None
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return None
        bias = None if biases[0] is None else torch.cat(biases)
        fused = PackedLinear(torch.cat([m.qweight for m in linears]), first.qtype, first.in_features, bias)
        start = 0  # the parts keep their names, as views of the fused rows: held once
        for m in linears:
            end = start + m.out_features
            m.qweight = fused.qweight[start:end]
            if bias is not None:
                m.bias = fused.bias[start:end]
            start = end
        return fused


class PackedEmbedding(nn.Module):
    """A token embedding held packed; `forward(ids)` dequantizes the rows looked up."""

    def __init__(self, qweight: torch.Tensor, qtype: str, embedding_dim: int) -> None:
        super().__init__()
        self.linear = PackedLinear(qweight, qtype, embedding_dim)
        self.num_embeddings, self.embedding_dim = qweight.shape[0], embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.linear.qweight.index_select(0, ids.reshape(-1))
        if self.linear.qtype == "BF16":
            out = rows.float()
        else:
            out = dequantize(rows, self.linear.qtype, self.embedding_dim)
        return out.view(*ids.shape, self.embedding_dim)

    def as_linear(self, h: torch.Tensor) -> torch.Tensor:
        """The tied LM head: `h @ E^T`."""
        return self.linear(h)
