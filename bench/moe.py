"""Benchmark: a mixture-of-experts decode step against a dense model with the same active
parameters, and against running each token's experts one by one (issue 36).

Builds (once, under `$PAGODA_CACHE_DIR/moe-bench` or ~/.cache/pagoda/moe-bench), with random
weights from `transformers` itself, float32 safetensors:

    qwen3-moe   Qwen3-MoE: hidden 768, 8 layers, 12 heads over 4 KV heads of 64, 32 experts
                of 256, top 4 (renormalised), vocabulary 32,000 tied: ~190M parameters
    qwen3-dense Qwen3 of the same shape with one MLP of 1,024 (= 4 x 256): the same active
                parameters per token

and times a decode step of each in one process (bench/batch_decode.py's `pagoda_step_s`:
one thread, context 128) at each batch, loaded at `--dtype` (auto: bfloat16 weights on a CPU
with BF16 units) or `--quantization int8` (Q8_0 blocks); and the MoE model twice more
through the layer modules, not the native decode step (worker_svc/models/fused_decode.py,
which takes packed and bfloat16 stages' decode steps, bfloat16 ones up to 16 rows): its
experts grouped by expert (`modules`), and run token by token (each token's top-k experts
called on that token alone: the contrast to grouping a step's rows by expert).

    .venv/bin/python -m bench.moe [--batches 1,64] [--context 128] [--dtype auto] [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODELS = {
    "qwen3-moe": (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 1024,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    "qwen3-dense": ("qwen3", "Qwen3ForCausalLM", {"intermediate_size": 1024}),
}


def build(name: str, root: Path) -> Path:
    """The folder of model `name`, made once."""
    from bench.architectures import build_random

    return build_random(root / name, *MODELS[name], SHAPE)


def per_token(block, x):
    """The contrast: each token's top-k experts called on that token alone."""
    import torch

    weights, experts = block.route(x)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for row in range(x.shape[0]):
        for w, e in zip(weights[row].tolist(), experts[row].tolist(), strict=True):
            out[row] += w * block.experts[e].forward(x[row : row + 1])[0].float()
    return out.to(x.dtype)


ARMS = ("qwen3-moe", "qwen3-moe modules", "qwen3-moe per-token", "qwen3-dense")


def _set_arm(models: dict, arm: str, native: dict) -> object:
    """The model of `arm`, set up for it: the native decode step on or off (`native`: each
    model's own), the MoE blocks' forward per token or their own."""
    from worker_svc.layers.moe import MoE

    model = models["qwen3-dense" if arm == "qwen3-dense" else "qwen3-moe"]
    model.fused_decode = native.get(arm)
    for layer in model.model.layers.values():
        if isinstance(layer.mlp, MoE):
            if arm.endswith("per-token"):
                layer.mlp.forward = lambda x, lora=None, b=layer.mlp: per_token(b, x)
            else:
                layer.mlp.__dict__.pop("forward", None)
    return model


def _table(rows: list[dict]) -> None:
    step = {(r["arm"], r["batch"]): r["step_ms"] for r in rows}
    print("| arm | batch | step ms | / dense | grouped / per-token |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        dense = step[("qwen3-dense", r["batch"])]
        contrast = step.get(("qwen3-moe per-token", r["batch"])) if r["arm"] == "qwen3-moe" else None
        ratio = "" if contrast is None else f"{r['step_ms'] / contrast:.2f}"
        print(f"| {r['arm']} | {r['batch']} | {r['step_ms']:.1f} | {r['step_ms'] / dense:.2f} | {ratio} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", choices=["int8"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    from bench.batch_decode import pagoda_step_s
    from bench.machine import cpu_record
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.kernels.cpu_kernels import keep_freed_memory
    from worker_svc.weights.quantization import weight_bytes

    torch.set_num_threads(1)
    keep_freed_memory()
    from services.settings import cache_root

    root = cache_root() / "moe-bench"
    models = {
        name: load_stage(str(build(name, root)), dtype=args.dtype, quantization=args.quantization) for name in MODELS
    }
    native = {name: m.fused_decode for name, m in models.items()}  # (the arms switch them off)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        # the arms in turns, each round all of them, the fastest round kept: on a shared
        # machine a neighbour's load then falls on every arm alike
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.rounds):
            for arm in ARMS:
                times[arm].append(pagoda_step_s(_set_arm(models, arm, native), batch, args.context, args.steps))
        for arm in ARMS:
            model = _set_arm(models, arm, native)
            rows.append(
                {
                    "arm": arm,
                    "weight_bytes": weight_bytes(model),
                    "format": model.weight_format or "float",
                    "native": model.fused_decode is not None,
                    "batch": batch,
                    "step_ms": round(min(times[arm]) * 1000, 2),
                    "rounds_ms": [round(t * 1000, 2) for t in times[arm]],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nCPU: {cpu_record()['describe']}")
    _table(rows)
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_record(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
