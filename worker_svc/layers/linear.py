"""Linears that read the same input, computed as one product."""

from __future__ import annotations

import torch
from torch import nn


def fuse_linears(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for linears that read the same input, their outputs side by
    side; each linear's own parameters become views into it, so the weights are held once
    and keep their checkpoint names. None when any of them is not a plain `nn.Linear`
    (a quantized one) or they do not agree on dtype, device and bias."""
    if any(type(m) is not nn.Linear for m in linears):
        return None
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or weights[0].is_meta:
        return None
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([w.detach() for w in weights])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias
