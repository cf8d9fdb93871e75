"""Device selection for stage workers (the CUDA side is in tests/gpu/test_gpu_runtime.py)."""

from __future__ import annotations

import pytest
import torch

from worker_svc.execution.device import check_dtype, default_attention_backend, resolve_device


def test_cpu_and_default():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == want
    assert default_attention_backend(torch.device("cpu")) == "cpu"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check_dtype(torch.device("cpu"), dtype)


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "", "mps", "meta"])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_refused(name):
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device(name)


def test_unsupported_dtype_is_refused():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        check_dtype(torch.device("cpu"), torch.float64)


def test_worker_attention_backend_is_chosen_by_configuration():
    from worker_svc.config import WorkerConfig

    assert WorkerConfig(model="m").attention_backend is None  # resolved per device at start
    assert WorkerConfig(model="m", attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        WorkerConfig(model="m", attention_backend="flash")
