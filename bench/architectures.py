"""Benchmark: does a new architecture cost more per parameter than Llama? (issue 33)

Builds (once, under `$PAGODA_CACHE_DIR/arch-bench` or ~/.cache/pagoda/arch-bench) a
Qwen3-shaped and a Gemma-3-shaped model with SmolLM2-135M's sizes (hidden 576, 30 layers,
9 heads over 3 KV heads of 64, MLP 1,536, vocabulary 49,152, tied embeddings; Qwen3 adds
its q/k norms, Gemma 3 its sandwich norms, GELU-tanh, scaled embeddings and five
512-token sliding-window layers to one global), random weights from `transformers` itself,
float32 safetensors; and a Llama of the same sizes the same way (SmolLM2's own shape). Then
runs bench/batch_decode.py on the three in one process: ms per decode step at each batch
(one thread, `--dtype` auto: bfloat16 weights on AVX-512 BF16 CPUs), so the ratio of each
architecture's step time to Llama's is the cost per parameter (their parameter counts
differ by the norms only, printed).

    .venv/bin/python -m bench.architectures [--batches 1,64] [--context 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ARCHS = {
    "llama": ("llama", "LlamaForCausalLM", {"rope_theta": 100000.0}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {"rope_theta": 100000.0}),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", {"sliding_window": 512, "query_pre_attn_scalar": 64}),
}


def build(arch: str, root: Path) -> Path:
    """The folder of the `arch`-shaped model, made once."""
    return build_random(root / f"{arch}-135m-shape", *ARCHS[arch], SHAPE)


def build_random(out: Path, model_type: str, name: str, extra: dict, shape: dict) -> Path:
    """A model of `model_type` (`architectures` [name]) with random weights from transformers
    itself, float32 safetensors in `out`, made once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors").is_file():
        return out
    config = AutoConfig.for_model(model_type, **shape, **extra)
    config.architectures = [name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    from services.settings import cache_root

    root = cache_root() / "arch-bench"
    folders = [build(arch, root) for arch in ARCHS]
    from bench import batch_decode

    argv2 = [a for f in folders for a in ("--model", str(f))]
    return batch_decode.main(
        [*argv2, "--batches", args.batches, "--context", str(args.context), "--steps", str(args.steps)]
    )


if __name__ == "__main__":
    raise SystemExit(main())
