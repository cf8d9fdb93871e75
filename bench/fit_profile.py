"""Fit a device profile (services/device_profile.py) from real forward passes on this machine.

    .venv/bin/python -m bench.fit_profile --model ~/.cache/pagoda-anchor/smol135 \
        --out services/profiles/cpu-local.json

Times a Hugging Face Llama checkpoint's decoder (transformers, float32, `--threads` torch
threads, 1 by default as a Pagoda stage runs) for prefills of one sequence and decode steps of
several batch sizes and context lengths, each with all of the model's layers and with the
first half of them, then fits the step model by non-negative least squares on relative error:

    t = fixed_s + layer_fraction * (per_step_s + prefill * a + decode * b + context * c)

(TP 1: no all-reduce). The decode steps read a KV cache of random values of the right shape,
so no long prefill is needed to set one up. The LM head and the argmax are timed on their own
(1 and 16 rows) and added: their per-row cost to per_decode_row_s, their constant to fixed_s.
The profile is written with its source (date, CPU, versions) and, in its notes, each point
measured beside the fit. A first placeholder: the bench refits `cpu-local` from real stage runs.
Not a test: the numbers are this machine's.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_model  # noqa: E402
from services.device_profile import DeviceProfile, save_profile  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "pagoda-anchor" / "smol135"
PREFILL_LENGTHS = (16, 64, 128)
DECODE_POINTS = ((1, 200), (4, 200), (16, 50), (16, 200), (16, 400))  # (rows, context each)
LAYER_FRACTIONS = (1.0, 0.5)
# the unknowns, in the order of a measurement's features
COEFFICIENTS = ("fixed_s", "per_step_s", "per_prefill_token_s", "per_decode_row_s",
                "per_context_token_s")


def _fastest_s(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls after a warm-up: on a shared machine another
    process only ever adds time, so the minimum is the estimate least disturbed by it."""
    fn()  # warm-up: allocator, kernels' first use
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _features(layer_fraction: float, prefill: int, decode: int, context: int) -> list[float]:
    lf = layer_fraction
    return [1.0, lf, lf * prefill, lf * decode, lf * context]


def _measure_decoder(model, num_layers: int, fraction: float,
                     repeats: int) -> list[tuple[list[float], float, str]]:
    """(features, seconds, label) of every point with the model cut to its first `num_layers`."""
    import torch
    from transformers import DynamicCache

    config, decoder = model.config, model.model
    kv_shape_tail = (config.num_key_value_heads, config.hidden_size // config.num_attention_heads)
    points = []
    for n in PREFILL_LENGTHS:
        ids = torch.randint(0, config.vocab_size, (1, n))
        seconds = _fastest_s(lambda ids=ids: decoder(input_ids=ids, use_cache=True), repeats)
        points.append((_features(fraction, n, 0, n), seconds, f"prefill {n}"))
    for rows, context in DECODE_POINTS:
        k = torch.randn(rows, kv_shape_tail[0], context, kv_shape_tail[1])
        ids = torch.randint(0, config.vocab_size, (rows, 1))
        positions = torch.full((rows, 1), context)

        def step(k=k, ids=ids, positions=positions):
            cache = DynamicCache(ddp_cache_data=[(k, k)] * num_layers)
            start = time.perf_counter()  # the cache's setup is not the step's
            decoder(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
            return time.perf_counter() - start

        step()
        seconds = min(step() for _ in range(repeats))
        points.append((_features(fraction, 0, rows, rows * (context + 1)), seconds,
                       f"decode {rows} x {context}"))
    return [(f, s, f"{label} @ {num_layers} layers") for f, s, label in points]


def _measure_head(model, repeats: int) -> tuple[float, float]:
    """(constant, per row) seconds of the final norm, LM head and argmax of decode rows."""
    import torch

    def head(rows: int) -> float:
        hidden = torch.randn(rows, 1, model.config.hidden_size)
        return _fastest_s(lambda: model.lm_head(model.model.norm(hidden)).argmax(-1), repeats)

    one, sixteen = head(1), head(16)
    per_row = max((sixteen - one) / 15, 0.0)
    return max(one - per_row, 0.0), per_row


def _with_layers(model, num_layers: int):
    """Keep only the model's first `num_layers` decoder layers (returns the full list)."""
    import torch

    full = model.model.layers
    model.model.layers = torch.nn.ModuleList(list(full)[:num_layers])
    model.config.num_hidden_layers = num_layers
    return full


def measure(model_dir: Path, threads: int, repeats: int):
    """All the points (features, seconds, label), the head's (constant, per row), the config."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = model.config.num_hidden_layers
    points = []
    with torch.inference_mode():
        for fraction in LAYER_FRACTIONS:
            num_layers = max(1, round(total * fraction))
            full = _with_layers(model, num_layers)
            try:
                points += _measure_decoder(model, num_layers, num_layers / total, repeats)
            finally:
                model.model.layers = full
                model.config.num_hidden_layers = total
        head = _measure_head(model, repeats)
    return points, head, model.config


def fit(points) -> dict[str, float]:
    """Non-negative least squares of the step model on relative error."""
    import numpy as np
    from scipy.optimize import nnls

    features = np.array([f for f, _, _ in points], dtype=float)
    seconds = np.array([s for _, s, _ in points], dtype=float)
    solution, _ = nnls(features / seconds[:, None], np.ones(len(points)))
    return dict(zip(COEFFICIENTS, (float(x) for x in solution), strict=True))


def _shown(path: Path) -> str:
    """A path as written in a profile: under the home folder as ~/..., so no user name."""
    try:
        return "~/" + path.expanduser().resolve().relative_to(Path.home().resolve()).as_posix()
    except ValueError:
        return str(path)


def make_profile(name: str, points, head: tuple[float, float], config, threads: int,
                 model_dir: Path) -> DeviceProfile:
    import torch
    import transformers

    costs = fit(points)
    predicted = [sum(c * x for c, x in zip(costs.values(), f, strict=True)) for f, _, _ in points]
    notes = [f"{label}: measured {s * 1e3:.2f} ms, fit {p * 1e3:.2f} ms ({(p / s - 1) * 100:+.1f}%)"
             for (_, s, label), p in zip(points, predicted, strict=True)]
    notes.insert(0, "Decoder forward (embedding, layers, final norm; no LM head) of one "
                    "sequence's prefill and of decode steps, with all layers and with half; "
                    "context = each sequence's length after the step, summed.")
    notes.append(f"LM head + argmax, timed apart: {head[0] * 1e3:.3f} ms + {head[1] * 1e3:.3f} ms "
                 "per decode row, added to fixed_s and per_decode_row_s (per_decode_row_s is "
                 "scaled by layer_fraction, so at PP > 1 each stage pays a share of the head that "
                 "only the last stage computes: the sum over stages is right).")
    notes.append("eos_probability 0: lengths come from the load's max_tokens (the validation "
                 "loads run with ignore_eos).")
    notes.append("A placeholder until the bench refits it from Pagoda's own stage runs: this times "
                 "transformers' forward, whose KV cache grows by concatenation, not Pagoda's "
                 "paged cache and kernels.")
    costs["fixed_s"] += head[0]
    costs["per_decode_row_s"] += head[1]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"fitted by bench/fit_profile.py on {when}, {cpu_model('unknown CPU')}, "
              f"{threads} torch thread(s), {_shown(model_dir)} ({config.model_type}, "
              f"{config.num_hidden_layers} layers, hidden {config.hidden_size}) float32, torch {torch.__version__}, transformers {transformers.__version__}")
    return DeviceProfile(name=name, source=source, eos_probability=0.0, allreduce_per_token_s=0.0,
                         hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                         notes=tuple(notes), **costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="a Hugging Face Llama checkpoint folder (default: %(default)s)")
    parser.add_argument("--name", default="cpu-local", help="the profile's name")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per point (the fastest counts)")
    parser.add_argument("--out", type=Path, default=None, help="the profile's JSON file "
                        "(default: print the fit only)")
    args = parser.parse_args(argv)
    points, head, config = measure(args.model.expanduser(), args.threads, args.repeats)
    profile = make_profile(args.name, points, head, config, args.threads, args.model)
    for note in profile.notes:
        print(note)
    print({f: getattr(profile, f) for f in COEFFICIENTS})
    if args.out is not None:
        save_profile(profile, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
