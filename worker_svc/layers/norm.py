"""RMSNorm, computed as the reference computes it.

Gemma's norms scale by (1 + w) where Llama's scale by w: the architecture sets
`ModelConfig.norm_offset` and the loader adds it to the checkpoint's norm weights once
(`fold_offset`), so every norm, the native decode step's included, is one RMSNorm
(float32: 1 + w is the value Gemma's forward computes, and the product is the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def fold_offset(self, offset: float) -> None:
        """Scale by (offset + w) from now on (Gemma's norms: offset 1)."""
        if offset:
            self.weight = nn.Parameter(
                self.weight.detach().float().add(offset).to(self.weight.dtype), requires_grad=False
            )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, bit for bit the reference's result
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalise in float32, as the reference does, then scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
