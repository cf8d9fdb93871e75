"""This process's CPU paths (`cpu_paths()`, chosen once from worker_svc/kernels/cpu_features.py), and
the start-up calibration of the one choice the CPU's features do not settle: without BF16
units, is a packed (Q4_1 / Q8_0 / Q4_0) prefill product faster on the native integer kernels
or dequantized to float32 on the float32 GEMM? (On an EPYC of family 25 model 17 capped to AVX2, one thread, 128
x 576 x 1,536 Q4_1: float32 GEMM 3.2 ms, integer 3.8 ms; a CPU with slow float32 GEMM and
fast integer dot products may answer the other way.)

Each is timed on one shape of the default model's size (a few milliseconds), best of a few
runs, at one thread; the answer is cached per CPU model, flags, caps and torch version in
the kernels' cache folder, so later starts read it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time

import torch
import torch.nn.functional as F

from services.settings import CPU_PATHS, env_value
from worker_svc.kernels.cpu_features import CpuFeatures, CpuPaths, cpu_features
from worker_svc.kernels.cpu_kernels import cache_dir
from worker_svc.kernels.quant_kernels import quant_kernels

log = logging.getLogger(__name__)

SHAPE = (128, 576, 1536)  # rows, inputs, outputs: a 128-row chunk of SmolLM2's gate/up product
REPEATS = 3


def packed_prefill_path(features: CpuFeatures) -> str:
    """ "integer" or "f32-gemm": the faster packed prefill path without BF16 units (cached)."""
    kernels = quant_kernels()
    if kernels is None:
        return "f32-gemm"  # no native kernels: the torch fallback dequantizes anyway
    key = hashlib.sha256(
        "\0".join(
            [
                features.model_name,
                str(features.family),
                str(features.model),
                " ".join(sorted(features.host_flags)),
                *features.caps,
                torch.__version__,
                kernels.isa,
                str(kernels.act_bits),
                repr(SHAPE),
            ]
        ).encode()
    ).hexdigest()[:20]
    path = cache_dir() / f"calibration-{key}.json"
    try:
        return json.loads(path.read_text())["packed_prefill"]
    except (OSError, ValueError, KeyError):
        pass
    timings = time_packed_prefill(kernels)
    choice = "integer" if timings["integer"] < timings["f32-gemm"] else "f32-gemm"
    log.info(
        "calibrated the packed prefill on %s: %s (%s)",
        features.model_name,
        choice,
        ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items()),
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"packed_prefill": choice, "seconds": timings, "cpu": features.describe()}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("calibration not cached (%s): %s", path, exc)
    return choice


def time_packed_prefill(kernels) -> dict[str, float]:
    """Seconds of one SHAPE product of random Q4_1 weights on each path (best of REPEATS),
    at one thread."""
    rows, k, n = SHAPE
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=generator)
    scales = torch.tensor([0.01, -0.05], dtype=torch.float16).view(torch.uint8)  # d, m of every block
    blocks[:, :, :4] = scales
    weights = blocks.reshape(n, -1).contiguous()
    x = torch.randn(rows, k, generator=generator)
    paths = {
        "integer": lambda: kernels.matmul(x, weights, "Q4_1"),
        "f32-gemm": lambda: F.linear(x, kernels.dequantize_f32(weights, "Q4_1", k)),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {}
        for name, run in paths.items():
            run()
            times = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            best[name] = min(times)
        return best
    finally:
        torch.set_num_threads(threads)


@functools.cache
def cpu_paths() -> CpuPaths:
    """This process's paths (chosen once; the packed prefill calibrated once per CPU model
    and cached)."""
    features = cpu_features()
    calibrated, forced = None, env_value(CPU_PATHS)
    if not features.bf16_units and "packed_prefill" not in (forced or ""):
        calibrated = packed_prefill_path(features)
    paths = CpuPaths.choose(features, calibrated, forced)
    log.info("CPU: %s; paths: %s", features.describe(), paths.describe())
    return paths


def describe_cpu(device: str) -> str:
    """What a stage on `device` reports of its CPU and paths ("" off the CPU: a GPU or an
    emulated device runs none of these products)."""
    if device != "cpu":
        return ""
    return f"{cpu_features().describe()}; paths: {cpu_paths().describe()}"
