"""The fused-MoE Triton kernel on CUDA (worker_svc/kernels/triton_moe.py): checked against the
torch path and timed at a Qwen3-MoE-30B-A3B layer's shape (hidden 2048, 128 experts, top-8,
expert intermediate 768, bfloat16) for 1, 64 and 256 tokens, and an MoE block built from a
model config (worker_svc/layers/moe.py) run on CUDA against the same reference.
`scripts/gpu_check.sh` runs it after scripts/gpu_check.py; tests/gpu/test_gpu_moe.py reuses
its helpers.

    python tests/gpu/moe_check.py               # on the GPU machine (about a minute)
    python tests/gpu/moe_check.py --cpu-smoke   # here: the interpreter, toy sizes

Figures go to `$OUT/gpu_moe.json` (or ./gpu_moe.json); the exit status is non-zero when a
case misses its bound or there is no CUDA device outside --cpu-smoke. Imports torch only at
the top, so that it can choose Triton's mode before triton is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from gpu_check_common import timed  # noqa: E402  (one timer for every GPU figure)

QWEN3_30B_A3B = {"hidden": 2048, "num_experts": 128, "top_k": 8, "inter": 768}
SMOKE_SHAPE = {"hidden": 64, "num_experts": 8, "top_k": 2, "inter": 32}
REL_ERR_BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # ||out - ref|| / ||ref||


def gated(g: torch.Tensor, u: torch.Tensor, act_kind: int, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    if act_kind == 0:
        return F.silu(g) * u
    if act_kind == 1:
        return F.gelu(g, approximate="tanh") * u
    g = g.clamp(max=limit)
    return (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)


def torch_moe(
    x, w_gate_up, w_down, topk_weights, topk_ids, act_kind=0, b_gate_up=None, b_down=None, dtype=torch.float32
) -> torch.Tensor:
    """The CPU path's algorithm in torch, in `dtype`: slots grouped by expert, each active
    expert's weights applied once to all its rows, the weighted sum in float32."""
    num_tokens, top_k = topk_ids.shape
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    rows, slot_weights = order // top_k, topk_weights.flatten()[order].float()
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()):
        if count:
            sel = rows[start : start + count]
            gu = x.index_select(0, sel).to(dtype) @ w_gate_up[expert].to(dtype).T
            if b_gate_up is not None:
                gu = gu + b_gate_up[expert].to(dtype)
            y = gated(gu[:, :inter], gu[:, inter:], act_kind) @ w_down[expert].to(dtype).T
            if b_down is not None:
                y = y + b_down[expert].to(dtype)
            out.index_add_(0, sel, y.float() * slot_weights[start : start + count, None])
            start += count
    return out


def make_layer(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device, seed: int = 0, bias: bool = False
) -> dict[str, torch.Tensor | None]:
    """Random expert weights scaled so that activations stay near 1."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    return {
        "w_gate_up": rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
        "w_down": rand(num_experts, hidden, inter, scale=inter**-0.5),
        "b_gate_up": rand(num_experts, 2 * inter, scale=0.3) if bias else None,
        "b_down": rand(num_experts, hidden, scale=0.3) if bias else None,
    }


def make_tokens(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, dtype: torch.dtype, device, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] and a renormalised softmax-top-k routing of it (Qwen3-MoE's)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((num_tokens, hidden), generator=g, device=device).to(dtype)
    probs = torch.softmax(torch.randn((num_tokens, num_experts), generator=g, device=device), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return x, weights / weights.sum(dim=-1, keepdim=True), ids


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def bench_layer(
    shape: dict[str, int], tokens: tuple[int, ...], dtype: torch.dtype, device, iterations: int
) -> list[dict[str, Any]]:
    """fused_moe against the torch path at each token count: error, times, and the bandwidth
    of reading the active experts' weights once."""
    from worker_svc.kernels.triton_moe import fused_moe

    layer = make_layer(shape["num_experts"], shape["hidden"], shape["inter"], dtype, device)
    w_gate_up, w_down = layer["w_gate_up"], layer["w_down"]
    expert_bytes = (w_gate_up[0].numel() + w_down[0].numel()) * w_gate_up.element_size()
    cases = []
    for num_tokens in tokens:
        x, weights, ids = make_tokens(
            num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"], dtype, device, seed=num_tokens
        )
        ref = torch_moe(x, w_gate_up, w_down, weights, ids)  # float32 products of the same weights
        out = fused_moe(x, w_gate_up, w_down, weights, ids)
        fused_s = timed(lambda x=x, w=weights, i=ids: fused_moe(x, w_gate_up, w_down, w, i), iterations, device)
        torch_s = timed(
            lambda x=x, w=weights, i=ids: torch_moe(x, w_gate_up, w_down, w, i, dtype=dtype),
            max(1, iterations // 4),
            device,
        )
        active = len(set(ids.flatten().tolist()))
        case = {
            "tokens": num_tokens,
            "active_experts": active,
            "rel_err": rel_err(out, ref),
            "fused_ms": round(fused_s * 1e3, 4),
            "torch_ms": round(torch_s * 1e3, 4),
            "speedup_vs_torch": round(torch_s / fused_s, 2),
            "expert_weights_GBps": round(active * expert_bytes / fused_s / 1e9, 1),
            "ok": rel_err(out, ref) < REL_ERR_BOUND[dtype],
        }
        print(json.dumps(case), flush=True)
        cases.append(case)
    return cases


def check_block(device, dtype: torch.dtype, num_tokens: int = 24) -> dict[str, Any]:
    """A small MoE block (16 experts, top-4) made from a model config, on the device: its own
    forward and fused_moe on its stacked experts against the torch path, for each gating."""
    from worker_svc.kernels.triton_moe import fused_moe, stack_experts
    from worker_svc.layers.moe import MoE
    from worker_svc.model_config import ModelConfig, MoEConfig

    errors = {}
    for act_kind, hidden_act in enumerate(("silu", "gelu_pytorch_tanh")):
        config = ModelConfig(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            100,
            256,
            512,
            1,
            4,
            2,
            64,
            1e-6,
            256,
            False,
            False,
            hidden_act=hidden_act,
            moe=MoEConfig(16, 4, 96, True, 0),
        )
        torch.manual_seed(act_kind)
        block = MoE(config)
        for p in block.parameters():
            p.data = torch.randn_like(p) / p.shape[-1] ** 0.5
        block.to(device=device, dtype=dtype)
        x = torch.randn(num_tokens, 256, device=device, dtype=dtype)
        stacked = stack_experts(block)
        weights, ids = block.route(x)
        ref = torch_moe(x, stacked.w_gate_up, stacked.w_down, weights, ids, act_kind)
        fused = fused_moe(x, stacked.w_gate_up, stacked.w_down, weights, ids, act_kind=act_kind)
        errors[hidden_act] = {"block_rel_err": rel_err(block(x), ref), "fused_rel_err": rel_err(fused, ref)}
    ok = all(e < REL_ERR_BOUND[dtype] for v in errors.values() for e in v.values())
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": num_tokens, **errors, "ok": ok}


def run(smoke: bool) -> dict[str, Any]:
    if smoke:
        device, dtype, shape, tokens, iterations = torch.device("cpu"), torch.float32, SMOKE_SHAPE, (1, 4, 16), 1
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            return {"ok": False, "error": "no CUDA device (run with --cpu-smoke on the CPU)"}
        device, dtype, shape, tokens, iterations = torch.device("cuda"), torch.bfloat16, QWEN3_30B_A3B, (1, 64, 256), 20
    report: dict[str, Any] = {
        "mode": "cpu-smoke" if smoke else "gpu",
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": shape,
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    report["layer"] = bench_layer(shape, tokens, dtype, device, iterations)
    report["block"] = (
        [check_block(device, dt) for dt in (torch.float32, dtype)]
        if not smoke
        else [check_block(device, torch.float32, num_tokens=5)]
    )
    report["ok"] = all(c["ok"] for c in report["layer"] + report["block"])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the CPU, Triton's interpreter, toy sizes")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT/gpu_moe.json or ./gpu_moe.json")
    args = parser.parse_args(argv)
    # compiled kernels for the GPU, the interpreter for the smoke run: before triton is imported
    os.environ["TRITON_INTERPRET"] = "1" if args.cpu_smoke else "0"
    out = args.out or Path(os.environ.get("OUT") or ".") / "gpu_moe.json"
    started = time.perf_counter()
    try:
        with torch.no_grad():
            report = run(args.cpu_smoke)
    except Exception as exc:  # the step's crash is its result: still written
        traceback.print_exc()
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    report["seconds"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"== fused_moe: {'ok' if report['ok'] else 'FAILED: ' + report.get('error', 'a case off its bound')} "
        f"({report['seconds']} s); figures written to {out}",
        flush=True,
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # worker_svc, without PYTHONPATH
    sys.exit(main())
