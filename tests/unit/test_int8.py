"""int8 weight-only quantization (`quantization="int8"`, CPU): one scale per output channel,
held in Q8_0's block layout so the native VNNI / AVX2 kernels and the one-call decode step
serve it (worker_svc/weights/quantization.py). Quality against the unquantized model on the trained
tiny model, as tests/unit/test_fp8.py measures fp8."""

from __future__ import annotations

import pytest
import torch
from support.logits import all_logits
from test_fp8 import quality_figures
from torch import nn

from wiring.tiny_train import held_out_windows
from worker_svc.checkpoints.loader import load_stage
from worker_svc.kernels.block_formats import dequantize
from worker_svc.weights.packed import PackedLinear
from worker_svc.weights.quantization import quantize_int8_rows, weight_bytes


def test_quantize_int8_rows_one_scale_per_output_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 40)[:, None]  # rows of every size
    w[7] = 0.0
    rows = quantize_int8_rows(w)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 96 // 32 * 34)
    blocks = rows.view(40, 3, 34)
    d = blocks[:, :, :2].contiguous().view(torch.float16).view(40, 3).float()
    assert torch.equal(d, d[:, :1].expand(40, 3)), "every block of a row carries the row's scale"
    q = blocks[:, :, 2:].contiguous().view(torch.int8).view(40, 96).float()
    assert q.abs().max() <= 127
    assert torch.equal(q[7], torch.zeros(96)) and d[7, 0] == 1.0  # an all-zero row: d = 1, q = 0
    nonzero = torch.arange(40) != 7
    assert torch.equal(q[nonzero].abs().amax(dim=1), torch.full((39,), 127.0))  # the whole range
    back = dequantize(rows, "Q8_0", 96)
    assert torch.equal(back, q * d[:, :1])
    # round to nearest: within half a step of the float16 scale (plus its own rounding)
    assert ((back - w).abs() <= d[:, :1] * 0.5 + w.abs() * 2e-3).all()


def test_int8_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8_rows(torch.randn(8, 40))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_stage_holds_int8_rows(trained_model_dir, dtype):
    model = load_stage(trained_model_dir, dtype=dtype, quantization="int8")
    assert model.weight_format == "int8-per-channel"
    for layer in model.model.layers.values():
        for linear in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(linear, PackedLinear) and linear.qtype == "Q8_0"
        assert isinstance(layer.self_attn.qkv_packed, PackedLinear)  # fused as stacked rows
    assert not any(type(m) is nn.Linear for m in model.model.layers.modules())
    floats = load_stage(trained_model_dir, dtype="float32")
    linear_params = sum(m.weight.numel() for m in floats.model.layers.modules() if type(m) is nn.Linear)
    saved = weight_bytes(floats) - weight_bytes(model)
    # float32 (4 bytes a weight) -> 34 bytes per 32 weights; bfloat16 halves what stays
    assert saved >= linear_params * (4 - 34 / 32) * 0.999


def test_int8_quality_on_a_trained_model(trained_model_dir):
    """The bar: greedy top-1 agreement >= 0.97 with float32 on held-out text."""
    reference = load_stage(trained_model_dir, dtype="float32")
    quantized = load_stage(trained_model_dir, dtype="float32", quantization="int8")
    seqs = held_out_windows(trained_model_dir, 32, 64, seed=2024)
    figures = quality_figures(all_logits(reference, seqs), all_logits(quantized, seqs))
    print(figures)
    assert figures["agreement"] >= 0.97, figures
    assert figures["rms_logit_error"] <= 0.03, figures


def test_int8_on_cuda_is_refused_naming_the_choice(trained_model_dir):
    with pytest.raises(ValueError, match="int8 runs on the CPU"):
        load_stage(trained_model_dir, device="cuda", quantization="int8")
