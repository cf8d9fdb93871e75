"""`pagoda eval-quality`: how much each weight format costs in quality, beside llama.cpp.

    python -m bench.quality --formats float32,bfloat16,Q8_0,Q4_1 --tokens 20000 --llama-cpp \
        --out bench/results/quality.json

llama.cpp's `perplexity --kl-divergence` metrics, teacher-forced over a real English text:
per weight format, the perplexity of the text, the mean KL divergence of each next-token
distribution from the float32 reference's (KL(ref || format), natural log, averaged over
the scored positions) and the same-top-token rate (the format's argmax equals the
reference's). As llama.cpp does, the text's tokens are cut into windows of `n_ctx` (512)
tokens, each evaluated from an empty context, and only the second half of each window is
scored (the logits at positions n_ctx/2 .. n_ctx-2, predicting the next token), so every
scored token has at least n_ctx/2 tokens of context: n_ctx/2 - 1 scored tokens a window.

The text: "Botchan (Master Darling)" by Natsume Soseki, translated by Yasotaro Morri (1919),
Project Gutenberg eBook #8868 (public domain), which the package `sentencepiece` 0.2.3 ships
as `test/botchan.txt` in its source distribution (its wheels carry no text). Fetched once
from the package index with `pip download --no-deps --no-binary :all:` (never installed)
into ~/.cache/pagoda/quality, as wiring/model_source.py fetches the default model; the
Project Gutenberg header and licence are cut off, leaving the novel (about 65k tokens).
When the index cannot be reached, CPython's `pydoc_data/topics.py` text (the help topics
that ship with Python) stands in, and the output says so.

The model: SmolLM2-135M-Instruct, whose only checkpoint here is the default model's Q4_1
GGUF file. The reference "float32" is that file dequantized to float32, and so is every
other format's source: "bfloat16" is it loaded as bfloat16, "Q4_1" the file itself (its
weights packed, multiplied by the native kernels: worker_svc/weights/packed.py), "Q8_0" a GGUF
written from the float32 weights (wiring/gguf_export.py), then packed. A name that
`load_stage`'s `quantization` takes (worker_svc/weights/quantization.py: "fp8") is the float32
weights quantized at load. So Q4_1 differs from this reference by its arithmetic only (how
the kernels round activations), and Q8_0 adds a re-quantization of Q4_1's weights: the
numbers say how far each format is from the float32 model we have, not from SmolLM2's
original bfloat16 checkpoint.

llama.cpp (llama-cpp-python, in its own virtual environment) evaluates the same token ids
in the same windows from the Q4_1 file and the Q8_0 file, in a subprocess that writes its
logits to raw float32 files (no pickle), which are scored against the same float32 reference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.quality_formats import exported_gguf, gguf_file_type, weight_format
from bench.quality_logits import LLAMA_PYTHON, llama_logits, window_logits
from bench.quality_text import fetch_text, quality_cache

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: `pagoda --help` builds this module's parser
N_CTX = 512
LLAMA_WINDOWS_PER_CALL = 8  # bounds a llama.cpp call's logits file (8 x 255 x 49152 x 4 B = 400 MB)


# ---------------------------------------------------------------- the metrics


@dataclass(frozen=True)
class TokenScores:
    """Per scored position: the format's negative log-likelihood of the actual next token,
    KL(ref || format) of the next-token distributions, and whether their argmaxes agree."""

    nll: torch.Tensor  # [n] float64
    kl: torch.Tensor  # [n] float64
    same_top: torch.Tensor  # [n] bool


@dataclass(frozen=True)
class Reference:
    """The reference's next-token distributions of a window, computed once for every format."""

    logprobs: torch.Tensor  # [n, vocab] float64
    probs: torch.Tensor  # [n, vocab] float64
    top: torch.Tensor  # [n] int64

    @staticmethod
    def of(logits: torch.Tensor) -> Reference:
        import torch

        logprobs = torch.log_softmax(logits.double(), dim=-1)
        return Reference(logprobs, logprobs.exp(), logprobs.argmax(dim=-1))


def score_tokens(ref: torch.Tensor | Reference, logits: torch.Tensor, targets: torch.Tensor) -> TokenScores:
    """Scores of `logits` [n, vocab] against the reference's (its logits [n, vocab] or their
    `Reference`) for the next tokens `targets` [n]; in float64, so identical inputs give a KL
    of exactly 0."""
    import torch

    ref = ref if isinstance(ref, Reference) else Reference.of(ref)
    lp = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref.probs * (ref.logprobs - lp)).sum(dim=-1)
    nll = -lp.gather(1, targets.long()[:, None])[:, 0]
    return TokenScores(nll, kl, ref.top == lp.argmax(dim=-1))


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def _se(x: torch.Tensor) -> float:
    """The standard error of the mean (0 for fewer than two values)."""
    n = x.numel()
    return float(x.double().std() / math.sqrt(n)) if n > 1 else 0.0


def summarize(scores: Sequence[TokenScores]) -> dict:
    """perplexity (with llama.cpp's error estimate: ppl * se(nll)), mean KL and the same-top
    rate, each with its standard error, over all the scored positions."""
    import torch

    nll = torch.cat([s.nll for s in scores])
    kl = torch.cat([s.kl for s in scores])
    same = torch.cat([s.same_top for s in scores]).double()
    ppl = perplexity(nll)
    return {
        "num_scored": nll.numel(),
        "perplexity": ppl,
        "perplexity_se": ppl * _se(nll),
        "mean_kl": float(kl.mean()),
        "mean_kl_se": _se(kl),
        "max_kl": float(kl.max()),
        "same_top": float(same.mean()),
        "same_top_se": _se(same),
    }


# ---------------------------------------------------------------- the windows


def make_windows(ids: Sequence[int], n_ctx: int, num_tokens: int) -> list[list[int]]:
    """ceil(num_tokens / n_ctx) consecutive windows of n_ctx tokens (fewer when the text runs out)."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    count = min(-(-num_tokens // n_ctx), len(ids) // n_ctx)
    return [list(ids[i * n_ctx : (i + 1) * n_ctx]) for i in range(count)]


def first_scored(n_ctx: int) -> int:
    """The first logits row scored in a window: row j predicts token j + 1, j in [n_ctx/2, n_ctx-1)."""
    return n_ctx // 2


# ---------------------------------------------------------------- the run


@dataclass
class Arm:
    """One row of the table: a Pagoda format (`model`) or llama.cpp on a GGUF file (`gguf`)."""

    name: str
    engine: str
    detail: str
    model: object = None
    gguf: Path | None = None
    scores: list[TokenScores] = field(default_factory=list)
    compute_s: float = 0.0
    load_s: float = 0.0


def _load_arms(
    formats: Sequence[str], source: Path, log: Callable[[str], None]
) -> tuple[list[Arm], dict[str, Path], Path, str | None]:
    """The Pagoda arms, the reference first; the GGUF files by block type ("source": the
    given one); the source's prepared folder and its block type."""
    from wiring.model_source import prepare_gguf
    from worker_svc.checkpoints.loader import load_stage

    prepared = prepare_gguf(source)
    source_type = gguf_file_type(source)
    specs = [weight_format(n, source_type) for n in ["float32", *[f for f in formats if f != "float32"]]]
    files = {"source": source}
    for spec in specs:
        if spec.checkpoint != "source" and spec.checkpoint not in files:
            files[spec.checkpoint] = exported_gguf(source, prepared, spec.checkpoint, log)
    arms = []
    for spec in specs:
        started = time.perf_counter()
        folder = prepared if spec.checkpoint == "source" else prepare_gguf(files[spec.checkpoint])
        model = load_stage(folder, dtype=spec.dtype, quantization=spec.quantization)
        where = files[spec.checkpoint].name
        detail = (
            f"{where}, packed ({model.weight_format})"
            if spec.dtype == "auto"
            else f"{where} dequantized to {spec.dtype}"
            + (f", {spec.quantization} at load" if spec.quantization else "")
        )
        arms.append(Arm(spec.name, "pagoda", detail, model=model, load_s=time.perf_counter() - started))
        log(f"eval-quality: loaded {spec.name}: {detail}")
    if source_type is not None:
        files.setdefault(source_type, source)
    return arms, files, prepared, source_type


def run(
    formats: Sequence[str],
    num_tokens: int,
    n_ctx: int = N_CTX,
    llama_cpp: bool = False,
    llama_types: Sequence[str] = ("Q4_1", "Q8_0"),
    model: Path | None = None,
    llama_python: Path = LLAMA_PYTHON,
    log: Callable[[str], None] = print,
) -> dict:
    """The whole benchmark; returns the JSON-ready results."""
    import torch

    from services.text.tokenizer import Tokenizer
    from wiring.model_source import default_model

    started = time.perf_counter()
    source = Path(model) if model is not None else default_model(log)
    text, text_source = fetch_text(log=log)
    arms, files, prepared, source_type = _load_arms(formats, source, log)
    ids = Tokenizer(prepared).encode(text, add_special_tokens=False)
    windows = make_windows(ids, n_ctx, num_tokens)
    if not windows:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of {n_ctx}")
    first = first_scored(n_ctx)
    notes: list[str] = []
    llama_arms = _llama_arms(llama_types, llama_python, files, source, prepared, notes, log) if llama_cpp else []
    log(
        f"eval-quality: {len(ids)} tokens of text; {len(windows)} windows of {n_ctx} tokens "
        f"({len(windows) * n_ctx} tokens), scoring {n_ctx - 1 - first} per window"
    )
    _evaluate(arms, llama_arms, windows, first, llama_python, log)
    return {
        "benchmark": "teacher-forced perplexity, KL divergence from float32, same-top rate",
        "method": (
            f"windows of n_ctx={n_ctx} tokens, each from an empty context; only the second half "
            f"scored (logits rows {first}..{n_ctx - 2} predicting the next token), so every scored "
            f"token has at least {first} tokens of context (as llama.cpp's perplexity); KL(ref || "
            "format) in nats, reference = float32"
        ),
        "model": {
            "name": source.stem,
            "file": str(source),
            "note": (
                f"the only checkpoint is this {source_type or 'GGUF'} file: float32 is it dequantized, so "
                f"{source_type or 'its own type'} differs from the reference by its arithmetic (activation "
                "rounding) only, and the other block types are re-quantized from it"
            ),
        },
        "text": {**text_source, "num_text_tokens": len(ids)},
        "n_ctx": n_ctx,
        "num_windows": len(windows),
        "num_tokens": len(windows) * n_ctx,
        "threads": torch.get_num_threads(),
        "formats": [_arm_result(a) for a in arms + llama_arms],
        "notes": notes,
        "wall_s": time.perf_counter() - started,
    }


def _llama_arms(
    qtypes: Sequence[str],
    python: Path,
    files: dict[str, Path],
    source: Path,
    prepared: Path,
    notes: list[str],
    log: Callable[[str], None],
) -> list[Arm]:
    """llama.cpp's arms, one per GGUF block type (the files written when missing); none, with
    a note saying why, without the llama-cpp-python environment."""
    if not python.is_file():
        notes.append(f"llama.cpp rows skipped: no llama-cpp-python environment at {python}")
        log(f"eval-quality: {notes[-1]}")
        return []
    arms = []
    for qtype in qtypes:
        if qtype not in files:
            files[qtype] = exported_gguf(source, prepared, qtype, log)
        arms.append(Arm(f"llama.cpp {qtype}", "llama.cpp", files[qtype].name, gguf=files[qtype]))
    return arms


def _evaluate(
    arms: list[Arm],
    llama_arms: list[Arm],
    windows: list[list[int]],
    first: int,
    python: Path,
    log: Callable[[str], None],
) -> None:
    """Every window through every arm, scored against the first arm (the reference); llama.cpp
    a group of windows per call, its logits in a temporary raw float32 file."""
    quality_cache().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=quality_cache()) as tmp:
        for group in range(0, len(windows), LLAMA_WINDOWS_PER_CALL):
            part = windows[group : group + LLAMA_WINDOWS_PER_CALL]
            llama_out = [
                _run_llama(arm, python, part, first, Path(tmp) / f"{arm.gguf.stem}-{group}.f32") for arm in llama_arms
            ]
            for k, window in enumerate(part):
                _score_window(arms, llama_arms, llama_out, k, window, first)
            log(
                f"eval-quality: {group + len(part)}/{len(windows)} windows; "
                + ", ".join(f"{a.name} {a.compute_s:.0f}s" for a in arms + llama_arms)
            )
            del llama_out
            for stale in Path(tmp).iterdir():
                stale.unlink()


def _run_llama(arm: Arm, python: Path, windows: list[list[int]], first: int, out: Path) -> np.ndarray:
    logits, info = llama_logits(python, arm.gguf, windows, first, out)
    arm.compute_s += info["eval_s"]
    if "llama-cpp-python" not in arm.detail:
        arm.detail += f" (llama-cpp-python {info['version']}, 1 thread)"
    return logits


def _score_window(
    arms: list[Arm], llama_arms: list[Arm], llama_out: list[np.ndarray], k: int, window: list[int], first: int
) -> None:
    import torch

    targets = torch.tensor(window[first + 1 :], dtype=torch.long)
    ref = None
    for arm in arms:  # the reference (float32) is the first
        t0 = time.perf_counter()
        logits = window_logits(arm.model, window, first)
        arm.compute_s += time.perf_counter() - t0
        ref = Reference.of(logits) if ref is None else ref
        arm.scores.append(score_tokens(ref, logits, targets))
    for arm, logits in zip(llama_arms, llama_out, strict=True):
        arm.scores.append(score_tokens(ref, torch.from_numpy(np.array(logits[k])), targets))


def _arm_result(arm: Arm) -> dict:
    return {
        "format": arm.name,
        "engine": arm.engine,
        "weights": arm.detail,
        **summarize(arm.scores),
        "compute_s": arm.compute_s,
        "load_s": arm.load_s,
    }


def format_table(results: dict) -> str:
    """The results as a Markdown table, with what was measured over what."""
    t = results["text"]
    lines = [
        f"{results['model']['name']}: {results['num_windows']} windows x {results['n_ctx']} tokens "
        f"({results['num_tokens']} tokens; {results['formats'][0]['num_scored']} scored) of "
        f"{t['title']} ({t['origin']}; {t['file']} from {t['package']} {t['version']}"
        f"{', FALLBACK' if t.get('fallback') else ''})",
        f"second half of each window scored: every scored token has >= {results['n_ctx'] // 2} tokens of "
        f"context; KL(float32 || format), nats; {results['threads']} thread(s)",
        f"reference: {results['model']['note']}",
        "",
        "| format | engine | perplexity | mean KL | same top | compute s |",
        "|---|---|---|---|---|---|",
    ]
    for f in results["formats"]:
        lines.append(
            f"| {f['format']} | {f['engine']} | {f['perplexity']:.4f} ± {f['perplexity_se']:.4f} | "
            f"{_small(f['mean_kl'])} ± {_small(f['mean_kl_se'])} | {100 * f['same_top']:.2f} ± {100 * f['same_top_se']:.2f} % | "
            f"{f['compute_s']:.1f} |"
        )
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


def _small(x: float) -> str:
    """Six decimals, as llama.cpp prints KL; values below 1e-5 (but not 0) in scientific notation."""
    return f"{x:.2e}" if 0 < abs(x) < 1e-5 else f"{x:.6f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--formats",
        default="float32,bfloat16,Q8_0,Q4_1",
        help="weight formats, comma-separated: float32 (the reference, always run), bfloat16, "
        "float16, Q8_0, Q4_0, Q4_1, or a --quantization method (default float32,bfloat16,Q8_0,Q4_1)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=20000,
        help="tokens of text to evaluate, rounded up to whole windows (default 20000)",
    )
    p.add_argument("--n-ctx", type=int, default=N_CTX, help=f"window length in tokens (default {N_CTX})")
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also llama.cpp (llama-cpp-python) on the Q4_1 and Q8_0 files, scored against the same reference",
    )
    p.add_argument(
        "--llama-types",
        default="Q4_1,Q8_0",
        help="the GGUF types llama.cpp evaluates with --llama-cpp (default Q4_1,Q8_0)",
    )
    p.add_argument(
        "--llama-python",
        type=Path,
        default=LLAMA_PYTHON,
        help=f"the Python of a llama-cpp-python environment (default {LLAMA_PYTHON})",
    )
    p.add_argument(
        "--model",
        dest="model_file",
        type=Path,
        default=None,
        help="a GGUF file (default: the default model, SmolLM2-135M-Instruct Q4_1)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; llama.cpp runs on 1)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def run_cli(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.replace(",", " ").split() if f]
    try:
        llama_types = [t for t in args.llama_types.replace(",", " ").split() if t]
        results = run(
            formats,
            args.tokens,
            args.n_ctx,
            args.llama_cpp,
            llama_types,
            model=args.model_file,
            llama_python=args.llama_python,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
