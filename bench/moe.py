"""Benchmark: a mixture-of-experts decode step against a dense model with the same active
parameters, and against running each token's experts one by one (issue 36).

Builds (once, under `$PAGODA_CACHE_DIR/moe-bench` or ~/.cache/pagoda/moe-bench), with random
weights from `transformers` itself, float32 safetensors:

    qwen3-moe   Qwen3-MoE: hidden 768, 8 layers, 12 heads over 4 KV heads of 64, 32 experts
                of 256, top 4 (renormalised), vocabulary 32,000 tied: ~190M parameters
    qwen3-dense Qwen3 of the same shape with one MLP of 1,024 (= 4 x 256): the same active
                parameters per token

and times a decode step of each in one process (bench/batch_decode.py's `pagoda_step_s`:
`--dtype` auto, one thread, context 128) at each batch, and the MoE model once more with
its experts run token by token (each token's top-k experts called on that token alone: the
contrast to grouping a step's rows by expert).

    .venv/bin/python -m bench.moe [--batches 1,64] [--context 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = {"vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12,
         "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
         "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
MODELS = {
    "qwen3-moe": ("qwen3_moe", "Qwen3MoeForCausalLM", {"intermediate_size": 1024, "num_experts": 32,
                                                       "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                                                       "norm_topk_prob": True, "decoder_sparse_step": 1,
                                                       "mlp_only_layers": []}),
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
            out[row] += w * block.experts[e].forward(x[row:row + 1])[0].float()
    return out.to(x.dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    from bench.batch_decode import pagoda_step_s
    from bench.machine import cpu_record
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.kernels.cpu_kernels import keep_freed_memory
    from worker_svc.layers.moe import MoE
    from worker_svc.weights.quantization import weight_bytes

    torch.set_num_threads(1)
    keep_freed_memory()
    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda")) / "moe-bench"
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in MODELS:
        model = load_stage(str(build(name, root)))
        params = weight_bytes(model)
        arms = [(name, None)] + ([(f"{name} per-token", per_token)] if name == "qwen3-moe" else [])
        for arm, forward in arms:
            if forward is not None:
                for layer in model.model.layers.values():
                    if isinstance(layer.mlp, MoE):
                        layer.mlp.forward = lambda x, lora=None, b=layer.mlp, f=forward: f(b, x)
            for batch in batches:
                ms = pagoda_step_s(model, batch, args.context, args.steps) * 1000
                rows.append({"arm": arm, "weight_bytes": params, "format": model.weight_format or "float",
                             "batch": batch, "step_ms": round(ms, 2)})
                print(json.dumps(rows[-1]), flush=True)
    step = {(r["arm"], r["batch"]): r["step_ms"] for r in rows}
    print(f"\nCPU: {cpu_record()['describe']}")
    print("| arm | batch | step ms | / dense | grouped / per-token |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        dense = step[("qwen3-dense", r["batch"])]
        contrast = step.get(("qwen3-moe per-token", r["batch"])) if r["arm"] == "qwen3-moe" else None
        ratio = "" if contrast is None else f"{r['step_ms'] / contrast:.2f}"
        print(f"| {r['arm']} | {r['batch']} | {r['step_ms']:.1f} | {r['step_ms'] / dense:.2f} | {ratio} |")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_record(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
