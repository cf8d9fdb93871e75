"""The CPU's features and the paths chosen from them (worker_svc/kernels/cpu_features.py): no path
needs a unit the CPU lacks. The products themselves are checked in a process started with
an AVX2-only CPU's caps (the features masked as issue 34 says), whatever this CPU is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support.caches import private_cache_with_shared_kernels

from worker_svc.kernels.cpu_features import CpuFeatures, CpuPaths

ZEN2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
ZEN4 = ZEN2 + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
SAPPHIRE = ZEN4 + " amx_bf16 amx_tile amx_int8"
AVX2_CAPS = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "PAGODA_CPU_ISA": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def cpuinfo(flags: str, name: str = "AMD EPYC 7R32") -> str:
    return f"processor\t: 0\nmodel name\t: {name}\ncpu family\t: 23\nmodel\t\t: 49\nflags\t\t: {flags}\n\n"


def test_levels_follow_the_flags():
    assert CpuFeatures.from_cpuinfo(cpuinfo(ZEN2), {}).level == "avx2"
    assert CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), {}).level == "avx512_bf16"
    assert CpuFeatures.from_cpuinfo(cpuinfo(SAPPHIRE), {}).level == "amx"
    assert CpuFeatures.from_cpuinfo(cpuinfo("fpu sse2"), {}).level == "scalar"
    zen2 = CpuFeatures.from_cpuinfo(cpuinfo(ZEN2), {})
    assert (zen2.model_name, zen2.family, zen2.model) == ("AMD EPYC 7R32", 23, 49)


@pytest.mark.parametrize(
    "var, value, level",
    [
        ("ONEDNN_MAX_CPU_ISA", "AVX2", "avx2"),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE", "avx512"),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core_vnni", "avx512_vnni"),
        ("ATEN_CPU_CAPABILITY", "avx2", "avx2"),
        ("ATEN_CPU_CAPABILITY", "default", "scalar"),
        ("PAGODA_CPU_ISA", "avx2", "avx2"),
        ("ATEN_CPU_CAPABILITY", "avx512", "avx512_bf16"),
        ("ONEDNN_MAX_CPU_ISA", "bogus", "avx512_bf16"),
    ],
)
def test_caps_lower_the_level(var, value, level):
    features = CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), {var: value})
    assert features.level == level
    assert features.caps == ((f"{var}={value}",) if level != "avx512_bf16" else ())


def test_no_bfloat16_gemm_without_bf16_units():
    for features in (
        CpuFeatures.from_cpuinfo(cpuinfo(ZEN2), {}),
        CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), AVX2_CAPS),
        CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}),
    ):
        assert not features.bf16_units
        paths = CpuPaths.choose(features)
        assert not paths.bf16_gemm and "bf16-gemm" not in (paths.packed_prefill, paths.bf16_prefill)
        assert CpuPaths.choose(features, calibrated="integer").packed_prefill == "integer"
        with pytest.raises(ValueError, match="BF16 units"):
            CpuPaths.choose(features, forced="packed_prefill=bf16-gemm")
    for flags in (ZEN4, SAPPHIRE):
        paths = CpuPaths.choose(CpuFeatures.from_cpuinfo(cpuinfo(flags), {}))
        assert paths.bf16_gemm and paths.packed_prefill == paths.bf16_prefill == "bf16-gemm"


def test_marches_follow_the_caps():
    assert CpuPaths.choose(CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), {})).march == "native"
    assert CpuPaths.choose(CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), AVX2_CAPS)).march == "x86-64-v3"
    assert CpuPaths.choose(CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), {"PAGODA_CPU_ISA": "scalar"})).march == "x86-64-v2"


def test_forced_paths_are_checked():
    features = CpuFeatures.from_cpuinfo(cpuinfo(ZEN4), {})
    paths = CpuPaths.choose(features, forced="packed_prefill=integer, bf16_prefill=native")
    assert (paths.packed_prefill, paths.bf16_prefill, paths.forced) == (
        "integer",
        "native",
        ("bf16_prefill", "packed_prefill"),
    )
    with pytest.raises(ValueError, match="PAGODA_CPU_PATHS"):
        CpuPaths.choose(features, forced="packed_prefill=fast")


# Runs in a process with an AVX2-only CPU's caps: every matrix product of packed and bfloat16
# layers, at decode and prefill sizes, recorded with its dtypes; none may be bfloat16.
_MASKED = textwrap.dedent("""
    import json, sys, torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.set_num_threads(1)
    from worker_svc.kernels.cpu_features import cpu_features
    from worker_svc.kernels.calibrate import cpu_paths
    from worker_svc.weights.packed import PackedLinear, pack_bfloat16
    from worker_svc.kernels.quant_kernels import quant_kernels

    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_mkldnn_linear", "mkldnn_linear"}

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in MATMULS:
                self.seen.append((name, sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor)})))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    K, N = 128, 96
    w = torch.randn(N, K, generator=g) * 0.05
    blocks = torch.randint(0, 256, (N, K // 32, 20), dtype=torch.uint8, generator=g)
    blocks[:, :, :4] = torch.tensor([0.01, -0.05], dtype=torch.float16).view(torch.uint8)
    layers = {"Q4_1": PackedLinear(blocks.reshape(N, -1).contiguous(), "Q4_1", K)}
    bf16 = nn.Sequential(nn.Linear(K, N, bias=False)).to(torch.bfloat16)
    bf16[0].weight.data.copy_(w)
    pack_bfloat16(bf16)
    layers["BF16"] = bf16[0]
    errors = {}
    mode = Products()
    for name, layer in layers.items():
        for rows in (1, 8, 33, 128, 300):
            x = torch.randn(rows, K, generator=g)
            with mode:
                y = layer(x)
            ref = F.linear(x, layer.dequantized())
            errors[f"{name}@{rows}"] = float((y - ref).abs().max() / ref.abs().max())
    k = quant_kernels()
    print(json.dumps({"seen": mode.seen, "errors": errors, "isa": k.isa if k else None,
                      "level": cpu_features().level, "paths": cpu_paths().describe(),
                      "bf16_gemm": cpu_paths().bf16_gemm}))
""")


def test_an_avx2_only_cpu_runs_no_bfloat16_product(tmp_path):
    # the AVX2 build (-march=x86-64-v3) and its calibration are keyed apart from this CPU's
    # own in the shared kernel cache: made once per machine (support/caches.py)
    env = {**os.environ, **AVX2_CAPS, "PAGODA_CACHE_DIR": str(private_cache_with_shared_kernels(tmp_path))}
    done = subprocess.run([sys.executable, "-c", _MASKED], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["level"] == "avx2" and not out["bf16_gemm"], out
    assert out["isa"] in ("avx2", "scalar", None), out
    assert out["seen"], "the prefill products should run on a GEMM"
    assert all("torch.bfloat16" not in dtypes for _, dtypes in out["seen"]), out["seen"]
    # float32 products of the same weights: the integer kernels' activation rounding at most
    assert max(out["errors"].values()) < 1e-3, out["errors"]
