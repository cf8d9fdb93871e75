"""Weight quantization at load time: `quantization="fp8"` or `"int8"`.

`int8` (CPU): weight-only int8 with one scale per output channel (`scale = amax(|row|) / 127`,
rounded to float16), held in GGUF's Q8_0 block layout with every block of a row carrying
the row's scale, so the native VNNI / AVX2 kernels of worker_svc/kernels/quant_kernels.py multiply it
(activations quantized per 32-block to int16, or int8 with `PAGODA_PACKED_ACT_BITS=8`) and
the one-call decode step serves it. The repeated scale costs 2 bytes per 32 weights (8.5
bits a weight instead of 8). The same layers as fp8 are quantized; the LM head and the
embeddings keep the model's dtype.

fp8:

Every linear layer of the decoder layers (q/k/v/o projections, gate/up/down of the MLP)
has its weight stored as float8_e4m3fn with one float32 scale per output channel
(`scale = amax(|row|) / 448`, so each row uses the format's whole range). What stays in the
model's dtype, and why:

- the token embeddings and the norms: a lookup and element-wise scales, no matmul to speed
  up, and together a small share of the weights of any real model;
- the LM head: as vLLM's fp8 does by default. Its error lands directly on the logits that
  greedy decoding compares, and on the last stage it is one matmul per sampled row only.

`Fp8Linear` computes `x @ (w_fp8 * scale)^T + bias`. On a CUDA device of compute capability
8.9 or higher (Ada, Hopper, Blackwell) with bfloat16 activations it runs `torch._scaled_mm`
on FP8 tensor cores, quantizing activations per token (row-wise scales); anywhere else it
dequantizes on the fly — `(x @ w_fp8.to(x.dtype)^T) * scale`, the per-channel scale applied
to the output, which is exact and cheaper than scaling the weight — so the same quantized
model runs everywhere.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.config import QUANTIZATION_METHODS
from worker_svc.weights.packed import PackedLinear

INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite, positive scale


def check_quantization(method: str | None) -> None:
    """ValueError unless `method` is None (no quantization) or a supported method."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or unset; got {method!r}")


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight -> (float8_e4m3fn weight [out, in], float32 scale [out]).

    `weight ≈ qweight.float() * scale[:, None]`, rounding to nearest in float8.
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
    qweight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return qweight, scale


def quantize_int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float weight (in % 32 == 0) -> uint8 [out, in / 32 * 34]: Q8_0 blocks whose
    scales are all the row's, `d = float16(amax(|row|) / 127)`, `q = round(w / d)` in
    [-127, 127]. `dequantize(rows, "Q8_0", in)` gives back `q * d`. An all-zero row gets d = 1."""
    w = weight.detach().float().cpu()
    n, k = w.shape
    if k % 32:
        raise ValueError(f"quantization int8: a layer's input size must be a multiple of 32, got {k}")
    d = (w.abs().amax(dim=1) / INT8_MAX).to(torch.float16)
    if torch.isinf(d).any():
        raise ValueError("quantization int8: a weight row's scale overflows float16")
    d = torch.where(d == 0, torch.ones_like(d), d)
    q = (w / d.float()[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    blocks = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    blocks[:, :, :2] = d.view(torch.uint8).view(n, 1, 2)
    blocks[:, :, 2:] = q.view(torch.uint8).view(n, k // 32, 32)
    return blocks.view(n, -1)


def scaled_mm_supported(device: torch.device) -> bool:
    """True where torch._scaled_mm runs row-wise scaled FP8 matmuls: a CUDA device of compute
    capability >= 8.9 on which a small probe matmul succeeds (some torch builds lack the
    row-wise kernels on some architectures)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9) and _probe_scaled_mm(index)


@functools.cache
def _probe_scaled_mm(index: int) -> bool:
    device = torch.device("cuda", index)
    a = torch.ones(16, 32, device=device).to(FP8_DTYPE)
    b = torch.ones(16, 32, device=device).to(FP8_DTYPE)
    try:
        out = torch._scaled_mm(
            a, b.t(), scale_a=torch.ones(16, 1, device=device),
            scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16,
        )  # fmt: skip
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out == 32).all())


class Fp8Linear(nn.Module):
    """A linear layer with an FP8 weight and per-output-channel scales.

    Invariants: `weight` is float8_e4m3fn `[out_features, in_features]`; `weight_scale` is
    float32 `[out_features]`, all positive; `bias` (if any) is in the activations' dtype.
    Weights are buffers, not parameters, so `model.parameters()` keeps yielding the model's
    activation dtype. `use_scaled_mm` is fixed at construction (device, dtype and shapes).
    """

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype
    ) -> None:
        super().__init__()
        if qweight.dtype != FP8_DTYPE or qweight.dim() != 2:
            raise ValueError(f"Fp8Linear needs a 2-D {FP8_DTYPE} weight, got {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("weight", qweight)
        self.register_buffer("weight_scale", scale.float())
        self.register_buffer("bias", bias)
        self.act_dtype = act_dtype
        # _scaled_mm's row-wise scaling wants bfloat16 output and dimensions in 16s.
        self.use_scaled_mm = (
            scaled_mm_supported(qweight.device)
            and act_dtype == torch.bfloat16
            and self.in_features % 16 == 0
            and self.out_features % 16 == 0
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        qweight, scale = quantize_fp8(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(qweight, scale, bias, linear.weight.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scaled_mm={self.use_scaled_mm}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_scaled_mm:
            return self._forward_scaled_mm(x)
        return self.forward_dequantized(x)

    def forward_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        # per-token activation scales: each row of x uses the whole float8 range
        x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
        xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        y = torch._scaled_mm(
            xq,
            self.weight.t(),  # [in, out], column-major as _scaled_mm wants
            scale_a=x_scale,  # [tokens, 1]
            scale_b=self.weight_scale.view(1, -1),  # [1, out]
            out_dtype=x.dtype,
        )
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace, in place, every nn.Linear of the decoder layers by its quantized form.

    The LM head (`lm_head`) is kept in the model dtype (see the module docstring). Modules
    are replaced one at a time, so the peak memory is the unquantized model plus one layer.
    """
    check_quantization(method)
    if method == "int8":

        def convert(linear: nn.Linear) -> nn.Module:
            bias = None if linear.bias is None else linear.bias.detach().float()
            return PackedLinear(quantize_int8_rows(linear.weight), "Q8_0", linear.in_features, bias)
    else:
        convert = Fp8Linear.from_linear
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] != "lm_head"
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, convert(linear))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by a stage's weights: parameters and persistent buffers (FP8 weights and
    their scales, packed GGUF rows), each storage counted once (fused projections are views
    of one tensor). Non-persistent buffers (rotary tables) are derived state, not weights,
    and are left out."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for module in model.modules():
        tensors = list(module._parameters.values()) + [
            b for name, b in module._buffers.items() if name not in module._non_persistent_buffers_set
        ]
        for t in tensors:
            if t is None or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
