"""Benchmark: a Qwen3-MoE Q4_K_M GGUF file, written with llama.cpp's own quantizer, served by
Pagoda beside llama.cpp on the same file (issue 36), one thread each.

The model is bench/moe.py's Qwen3-MoE shape (hidden 768, 8 layers, 32 experts of 256, top 4)
with SmolLM2-135M-Instruct's tokenizer (vocabulary 49,152; random weights from
`transformers`), made once under `--work`:

    1. the float32 folder (transformers), SmolLM2's tokenizer files copied in
    2. `pagoda export-gguf DIR F32.gguf --type F32` (llama.cpp's qwen3moe layout: experts
       stacked as ffn_*_exps, the router F32)
    3. llama.cpp's quantizer from llama-cpp-python's own virtualenv
       (shared/anchors/llama-cpp.md): LLAMA_FTYPE_MOSTLY_Q4_K_M
    4. bench.vs_llama_cpp on that file: llama.cpp and Pagoda (server and in-process), one
       stream, 64-token prompt, 128 greedy tokens, one thread each

    .venv/bin/python -m bench.moe_gguf [--work DIR] [--repeats 3] [--streams 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.moe import MODELS, SHAPE  # noqa: E402
from bench.vs_llama_cpp import DEFAULT_ANCHOR  # noqa: E402

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
p.nthread = 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def build_folder(work: Path, tokenizer_dir: Path) -> Path:
    """The float32 Qwen3-MoE folder with SmolLM2's tokenizer, made once."""
    from bench.architectures import build_random

    model_type, name, extra = MODELS["qwen3-moe"]
    shape = {**SHAPE, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}
    folder = build_random(work / "qwen3-moe-smol", model_type, name, extra, shape)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file() and not (folder / f).is_file():
            shutil.copy(tokenizer_dir / f, folder / f)
    return folder


def quantized_file(work: Path, tokenizer_dir: Path, llama_python: Path) -> Path:
    """The Q4_K_M file llama.cpp's quantizer writes from Pagoda's F32 export, made once."""
    out = work / "qwen3-moe-smol.Q4_K_M.gguf"
    if out.is_file():
        return out
    folder = build_folder(work, tokenizer_dir)
    f32 = work / "qwen3-moe-smol.F32.gguf"
    if not f32.is_file():
        subprocess.run(
            [str(ROOT / ".venv/bin/pagoda"), "export-gguf", str(folder), str(f32), "--type", "F32"], check=True
        )
    with open(work / "quantize.log", "w") as log:
        subprocess.run([str(llama_python), "-c", QUANTIZE, str(f32), str(out)], check=True, stderr=log)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=DEFAULT_ANCHOR / "moe")
    ap.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_ANCHOR / "smol135")
    ap.add_argument("--llama-python", type=Path, default=DEFAULT_ANCHOR / "llama" / "venv" / "bin" / "python")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "moe_vs_llama_cpp.json")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = quantized_file(args.work, args.tokenizer_dir, args.llama_python)
    print(json.dumps({"gguf": str(gguf), "bytes": gguf.stat().st_size}))
    from bench import vs_llama_cpp

    return vs_llama_cpp.main(
        [
            "--gguf",
            str(gguf),
            "--tokenizer-dir",
            str(args.tokenizer_dir),
            "--llama-python",
            str(args.llama_python),
            "--repeats",
            str(args.repeats),
            "--streams",
            str(args.streams),
            "--out",
            str(args.out),
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
