"""The stage runtime on CUDA: device selection, FP8 weights (scaled FP8 matmuls on compute
capability >= 8.9, dequantized elsewhere) and the Triton backend end to end."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from support.logits import all_logits  # noqa: E402
from support.trained import make_trained_model  # noqa: E402
from unit.test_fp8 import QUALITY_SPEC, quality_figures  # noqa: E402

from wiring.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402
from wiring.tiny_train import held_out_windows  # noqa: E402
from worker_svc.checkpoints.loader import load_stage  # noqa: E402
from worker_svc.execution.device import check_dtype, default_attention_backend, resolve_device  # noqa: E402
from worker_svc.weights.quantization import Fp8Linear, scaled_mm_supported, weight_bytes  # noqa: E402

CUDA = torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # the trained model of tests/unit/test_fp8.py (this file runs without the conftest)
    return make_trained_model(tmp_path_factory.mktemp("gpu-fp8") / "model")


def test_resolve_device_on_cuda():
    assert resolve_device(None) == CUDA
    assert resolve_device("cuda") == CUDA
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match="does not exist"):
        resolve_device(f"cuda:{count}")
    assert default_attention_backend(CUDA) == "triton"
    for dtype in (torch.float32, torch.float16):
        check_dtype(CUDA, dtype)


def test_fp8_linear_on_cuda_matches_dequantized():
    g = torch.Generator(device="cuda").manual_seed(0)
    linear = torch.nn.Linear(1024, 512, bias=False, device=CUDA, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.use_scaled_mm == scaled_mm_supported(CUDA)
    x = torch.randn(37, 1024, device=CUDA, dtype=torch.bfloat16, generator=g)
    got, want = fp8(x).float(), fp8.forward_dequantized(x).float()
    # the scaled path also quantizes activations per token: about 3% RMS on top
    assert float((got - want).norm() / want.norm()) < 0.06


def test_fp8_weight_bytes_on_cuda(tmp_path):
    # the random model of tests/unit/test_fp8.py, whose linear layers hold most weights
    model_dir = make_tiny_model(tmp_path / "random", TinyModelSpec(**QUALITY_SPEC))
    reference = load_stage(model_dir, dtype="bfloat16", device=CUDA)
    quantized = load_stage(model_dir, dtype="bfloat16", device=CUDA, quantization="fp8")
    assert weight_bytes(quantized) <= 0.55 * weight_bytes(reference)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_model_on_cuda(model_dir, dtype):
    reference = load_stage(model_dir, dtype=dtype, device=CUDA)
    quantized = load_stage(model_dir, dtype=dtype, device=CUDA, quantization="fp8")
    seqs = held_out_windows(model_dir, 32, 64, seed=2024)
    want, got = all_logits(reference, seqs).cpu(), all_logits(quantized, seqs).cpu()
    figures = quality_figures(want, got)
    figures["scaled_mm"] = scaled_mm_supported(CUDA) and dtype == "bfloat16"
    print(dtype, figures)
    # CPU figures: 0.988 (float32). With activations in FP8 as well (scaled_mm), a CPU
    # emulation of the same arithmetic gives 0.976.
    assert figures["agreement"] >= 0.95, figures
