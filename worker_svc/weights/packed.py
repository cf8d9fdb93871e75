"""Layers whose weights stay in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and
the K-quants Q2_K ... Q6_K) or bfloat16.

`PackedLinear` holds the packed rows (`uint8 [out, row_bytes]`, see
worker_svc/kernels/block_formats.py for the block layouts; a K-quant's rows must be whole 256-value
super-blocks, a ValueError naming the weight's shape otherwise). A product of at least
`PACKED_GEMM_MIN_ROWS` rows (a prefill) dequantizes the weights in one native pass for a
GEMM: bfloat16 and oneDNN's bfloat16 GEMM on a CPU with BF16 units, else float32 and the
float32 GEMM, or the integer kernels where a start-up calibration found them faster
(worker_svc/kernels/cpu_features.py: never a bfloat16 GEMM without BF16 units, which emulates
it at a fraction of float32's rate); smaller ones (decode steps) multiply in the packed
form with the native kernels: activations quantized per 32-element block to int16
(default) or int8 (llama.cpp's method, `PAGODA_PACKED_ACT_BITS=8`), integer dot products on
the CPU's VNNI (or AVX2) units. int16 activations keep the products within ~3e-5 of float32
ones. On the real model's Q4_1 file the mean KL divergence from the file's float32
dequantization is 1.8e-4 with prefills on the bfloat16 GEMM (5e-8 with them on int16
products, 1.5x slower) against llama.cpp's 2.7e-3 (bench/quality.py). Without the native kernels it dequantizes on the fly (float32 activations).
The K-quants' decode products quantize the activations per 256-value super-block (Q8_K's
way, int16 or int8 as above); on the tiny Q4_K_M test file the logits stay within 0.0022 of
the file's float32 dequantization and every greedy token equals it
(tests/unit/test_gguf_kquants.py). `PackedLinear.concat` of layers of different types (a
Q4_K_M file's Q4_K q/k with a Q6_K v) gives a `PackedParts`: one product per run of one type
into one output, which the native decode step runs as a chain (worker_svc/models/fused_decode.py).
`PackedEmbedding` dequantizes only the rows it looks up, and serves as the tied LM head
(`as_linear`).

Weights are persistent buffers, so `weight_bytes()` (worker_svc/weights/quantization.py) counts
their packed size; activations and outputs are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.settings import PACKED_PREFILL_GEMM, env_value
from worker_svc.kernels.block_formats import KERNEL_TYPES, check_row_length, dequantize
from worker_svc.kernels.calibrate import cpu_paths
from worker_svc.kernels.quant_kernels import quant_kernels

PACKED_QTYPES = KERNEL_TYPES  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and the K-quants Q2_K ... Q6_K
# bfloat16 weights: above this many rows a product runs as oneDNN's bfloat16 GEMM (activations
# rounded to bfloat16; ~2.3x the native widening kernel's rate at 128 rows on AVX-512 BF16),
# at or below it the native kernel (float32 activations; memory-bound, as fast). The LM head
# (`float32_activations`) always takes the native kernel: on the trained tiny model every
# greedy choice that bfloat16 weights changed came from rounding the head's input (same top
# token as float32 at 97.9% of held-out positions with it rounded, 100% without)
BF16_GEMM_MIN_ROWS = 16
# Q8_0/Q4_0/Q4_1 weights: from this many rows a decoder layer's product dequantizes the
# weights to bfloat16 (one native pass) and runs oneDNN's bfloat16 GEMM, ~1.8x the integer
# kernels' rate on a prefill at the cost of bfloat16 activations there (see PACKED_GEMM_ENV);
# below it (decode steps) the integer kernels read the packed blocks directly
PACKED_GEMM_MIN_ROWS = 128
# bfloat16 weights without BF16 units: from this many rows the weights are widened to float32
# (one pass) for the float32 GEMM; below it the native widening kernel is faster (AVX2-capped
# EPYC, 576 x 1,536: 32 rows 0.77 ms against 0.84, 16 rows 0.46 against 0.43)
F32_GEMM_MIN_ROWS = 32
PACKED_GEMM_ENV = PACKED_PREFILL_GEMM.variable  # "0": prefills too on the integer kernels


def _prefill_gemm() -> bool:
    return env_value(PACKED_PREFILL_GEMM)


class PackedLinear(nn.Module):
    """`y = x @ W^T (+ bias)` with W packed. Invariants: `qweight` is uint8
    `[out_features, row_bytes]` of `qtype` (or bfloat16 `[out, in]` when qtype is "BF16");
    `bias` float32 or None."""

    def __init__(self, qweight: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if qtype not in (*PACKED_QTYPES, "BF16"):
            raise ValueError(f"PackedLinear: unsupported type {qtype!r}")
        if qtype != "BF16":
            check_row_length(qtype, in_features, qweight.shape[0])
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.kernels = quant_kernels()
        self.float32_activations = False  # never round x to bfloat16 (the LM head)
        self.prefill_gemm = _prefill_gemm()  # read once here, not on every product
        self.paths = cpu_paths()  # which GEMM a prefill takes on this CPU

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype}, native={self.kernels is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        if self.kernels is None:
            y = F.linear(x2, self.dequantized())
        elif self.qtype == "BF16":
            y = self._bf16_product(x2)
        else:
            y = self._packed_product(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def _bf16_product(self, x2: torch.Tensor) -> torch.Tensor:
        """bfloat16 weights: the path this CPU runs fastest for `x2`'s rows (module docstring)."""
        rows, path = x2.shape[0], self.paths.bf16_prefill
        if self.float32_activations:
            return self.kernels.matmul_bf16(x2, self.qweight)
        if path == "bf16-gemm" and rows > BF16_GEMM_MIN_ROWS:
            return F.linear(x2.to(torch.bfloat16), self.qweight).float()  # oneDNN's bfloat16 GEMM
        if path == "f32-gemm" and rows >= F32_GEMM_MIN_ROWS:
            return F.linear(x2, self.qweight.float())  # widened once, the float32 GEMM
        return self.kernels.matmul_bf16(x2, self.qweight)

    def _packed_product(self, x2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """GGUF block weights: integer kernels on the blocks, or a prefill dequantized to the
        GEMM this CPU runs fastest (bfloat16 only with BF16 units); into `out` when given."""
        path = self.paths.packed_prefill
        if x2.shape[0] < PACKED_GEMM_MIN_ROWS or self.float32_activations or not self.prefill_gemm or path == "integer":
            return self.kernels.matmul(x2, self.qweight, self.qtype, out=out)
        if path == "bf16-gemm":
            w = self.kernels.dequantize_bf16(self.qweight, self.qtype, self.in_features)
            y = F.linear(x2.to(torch.bfloat16), w).float()
        else:
            y = F.linear(x2, self.kernels.dequantize_f32(self.qweight, self.qtype, self.in_features))
        if out is None:
            return y
        out.copy_(y)
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 `[out, in]`."""
        if self.qtype == "BF16":
            return self.qweight.float()
        return dequantize(self.qweight, self.qtype, self.in_features)

    @staticmethod
    def concat(linears: list[PackedLinear]) -> PackedLinear | None:
        """One layer computing the given ones side by side (rows stacked), or None when their
        inputs or biases differ. Packed rows are independent, so stacking is exact. Parts of
        different types (a Q4_K_M file's Q4_K q/k with a Q6_K v) give a `PackedParts`: each
        run of one type stacked, one product a run."""
        first = linears[0]
        if any(m.in_features != first.in_features for m in linears):
            return None
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return None
        if any(m.qtype != first.qtype for m in linears):
            if "BF16" in {m.qtype for m in linears}:
                return None
            return PackedParts.of(linears)
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


class PackedParts(PackedLinear):
    """Linears of different packed types side by side: `parts` are runs of one type each (a
    `PackedLinear.concat` of consecutive layers of that type), their outputs laid out in
    order. `qweight` holds no rows of its own (the parts hold them); `qtype` names the parts'
    types joined by "+". The native decode step (worker_svc/models/fused_decode.py) takes the parts
    as a chain of products into one output."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        first = parts[0]
        super().__init__(
            torch.empty(sum(p.out_features for p in parts), 0, dtype=torch.uint8), first.qtype, first.in_features
        )
        self.parts = nn.ModuleList(parts)
        self.qtype = "+".join(p.qtype for p in parts)

    @classmethod
    def of(cls, linears: list[PackedLinear]) -> PackedParts:
        runs: list[list[PackedLinear]] = []
        for m in linears:
            if runs and runs[-1][0].qtype == m.qtype:
                runs[-1].append(m)
            else:
                runs.append([m])
        return cls([run[0] if len(run) == 1 else PackedLinear.concat(run) for run in runs])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(x2.shape[0], self.out_features)
        start = 0
        for part in self.parts:
            end = start + part.out_features
            if part.kernels is None:
                y[:, start:end] = F.linear(x2, part.dequantized())
            else:
                part._packed_product(x2, out=y[:, start:end])
            if part.bias is not None:
                y[:, start:end] += part.bias
            start = end
        return y.view(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


class PackedEmbedding(nn.Module):
    """A token embedding held packed; `forward(ids)` dequantizes the rows looked up."""

    def __init__(self, qweight: torch.Tensor, qtype: str, embedding_dim: int) -> None:
        super().__init__()
        self.linear = PackedLinear(qweight, qtype, embedding_dim)
        self.linear.float32_activations = True  # used as a linear only as the tied LM head
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


def pack_bfloat16(model: nn.Module) -> int:
    """Hold a CPU stage's bfloat16 weights as `PackedLinear` / `PackedEmbedding` ("BF16"):
    the weights stay bfloat16 (half of float32's bytes, what decode reads every step), the
    activations float32, the products widen each weight to float32 in the native kernel
    (bfloat16 activations only where oneDNN's bfloat16 GEMM pays: see `PackedLinear`). Norms
    become float32. Returns how many layers were converted."""
    count = 0
    for name, module in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
            bias = None if module.bias is None else module.bias.detach().float()
            packed = PackedLinear(module.weight.detach(), "BF16", module.in_features, bias)
            packed.float32_activations = child == "lm_head"  # the LM head's input stays float32
            setattr(parent, child, packed)
            count += 1
        elif type(module) is nn.Embedding and module.weight.dtype == torch.bfloat16:
            setattr(parent, child, PackedEmbedding(module.weight.detach(), "BF16", module.embedding_dim))
            count += 1
    for param_name, param in list(model.named_parameters()):
        if param.dtype == torch.bfloat16:  # the norms
            owner, _, leaf = param_name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, nn.Parameter(param.detach().float(), requires_grad=False))
    return count
