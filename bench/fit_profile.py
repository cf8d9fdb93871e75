"""Fit a device profile (services/device_profile.py) from Pagoda's own stage steps on this machine.

    .venv/bin/python -m bench.fit_profile --model ~/.cache/pagoda-anchor/smol135 \
        --out services/profiles/cpu-local.json

Times `worker_svc.execution.runner.StageRunner.execute` (paged KV cache, the worker's default attention
backend, `--dtype` `auto` by default as `pagoda serve` loads the stages: a float32 checkpoint
is served as bfloat16 weights on a CPU with AVX-512 BF16; `--threads` torch threads, 1 by
default as a Pagoda stage runs) on real plans: one sequence's prefill (16, 64, 128 tokens) and
decode steps of 1 to 64 rows at 50 to 400 tokens of context, for PP=1's one stage (all
layers, LM head and greedy sampling) and for each of PP=2's two stages (embedding and the
first half; the second half, LM head and sampling, fed random hidden states). The KV a decode
step reads is made by real, untimed prefills. Each point counts its fastest of `--repeats`
runs after a warm-up, in the fastest of `--passes` passes over all the points. Then fits the
step model by non-negative least squares on relative error:

    t = fixed_s + layer_fraction * (per_step_s + prefill * a + decode * b + context * c)
        + last * (last_stage_fixed_s + sampled_rows * last_stage_per_row_s)

(TP 1: no all-reduce; layer_fraction 1 for the whole stage, 0.5 for each half; `last` for the
stages that run the final norm, LM head and sampling: PP=1's and the second of PP=2's).
Context is what `worker_svc.execution.emulated.StepShape` counts: each row's length after the step,
summed. The profile is written with its source (date, CPU, versions) and, in its notes, each
point measured beside the fit. Not a test: the numbers are this machine's.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_model  # noqa: E402
from services.device_profile import DeviceProfile, save_profile  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "pagoda-anchor" / "smol135"
PREFILL_LENGTHS = (16, 64, 128)
DECODE_POINTS = ((1, 200), (4, 200), (16, 50), (16, 200), (16, 400), (64, 200))  # (rows, context)
STAGES = ((0, 1), (0, 2), (1, 2))  # (stage, of stages): PP=1's stage, PP=2's two
SETUP_TOKENS = 2048  # the untimed prefills that fill a decode point's KV: tokens per step
# the unknowns, in the order of a measurement's features
COEFFICIENTS = (
    "fixed_s",
    "per_step_s",
    "per_prefill_token_s",
    "per_decode_row_s",
    "per_context_token_s",
    "last_stage_fixed_s",
    "last_stage_per_row_s",
)


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


def _features(layer_fraction: float, prefill: int, decode: int, context: int, last: bool, sampled: int) -> list[float]:
    lf = layer_fraction
    return [1.0, lf, lf * prefill, lf * decode, lf * context, float(last), float(last) * sampled]


def _measure_stage(model, backend: str, repeats: int) -> list[tuple[list[float], float, str]]:
    """(features, seconds, label) of every point on one stage, a fresh runner per point."""
    import torch

    from services.defaults import BLOCK_SIZE
    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from worker_svc.execution.runner import StageRunner

    config, greedy = model.config, SamplingParams(temperature=0.0)
    fraction = model.num_local_layers / config.num_layers
    gen = torch.Generator().manual_seed(0)

    def hidden(n: int):  # what the previous stage hands on (none to the first)
        return None if model.is_first else torch.randn(n, config.hidden_size, generator=gen)

    def new_seq(seq_id: int, n: int, blocks: range) -> NewSeq:
        tokens = tuple(torch.randint(5, config.vocab_size, (n,), generator=gen).tolist())
        return NewSeq(seq_id, tokens, n, 0, n, tuple(blocks), greedy)

    points = []
    for n in PREFILL_LENGTHS:
        runner = StageRunner(model, -(-n // BLOCK_SIZE), BLOCK_SIZE, backend)
        seq, inputs, ids = new_seq(0, n, range(runner.num_blocks)), hidden(n), itertools.count(1)

        def prefill(runner=runner, seq=seq, inputs=inputs, ids=ids):  # a new id, the last dropped
            k = next(ids)
            runner.execute(StepPlan(k, (replace(seq, seq_id=k),), finished_seq_ids=(k - 1,)), inputs)

        points.append((_features(fraction, n, 0, n, model.is_last, 1), _fastest_s(prefill, repeats), f"prefill {n}"))
    for rows, context in DECODE_POINTS:
        per_seq = -(-(context + repeats + 1 + 8) // BLOCK_SIZE)
        runner = StageRunner(model, rows * per_seq, BLOCK_SIZE, backend)
        seqs = [new_seq(i, context, range(i * per_seq, (i + 1) * per_seq)) for i in range(rows)]
        chunk = max(1, SETUP_TOKENS // context)
        for k in range(0, rows, chunk):  # untimed: the KV the decode steps read
            runner.execute(StepPlan(k, new_seqs=tuple(seqs[k : k + chunk])), hidden(len(seqs[k : k + chunk]) * context))
        # a stage that does not sample is told each step's new token; the last samples its own
        new_tokens = () if model.is_last else (7,)
        decode = tuple(CachedSeq(i, 1, per_seq, (), new_tokens) for i in range(rows))
        inputs, ids = hidden(rows), itertools.count(rows)

        def step(runner=runner, decode=decode, inputs=inputs, ids=ids):
            runner.execute(StepPlan(next(ids), cached_seqs=decode), inputs)

        points.append(
            (
                _features(fraction, 0, rows, rows * (context + 1), model.is_last, rows),
                _fastest_s(step, repeats),
                f"decode {rows} x {context}",
            )
        )
    where = f"layers {model.start}-{model.end - 1} of {config.num_layers}"
    return [(f, s, f"{label} @ {where}") for f, s, label in points]


def measure(model_dir: Path, threads: int, repeats: int, dtype: str, passes: int = 2):
    """All the points (features, seconds, label), the model's config and what ran (weights'
    dtype and format, attention backend), the stages loaded and run as a CPU worker does.
    Every point is measured in each of `passes` passes over the stages and its fastest pass
    counts, so a burst of another process's work that spans one pass does not."""
    import torch

    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.checkpoints.stage_setup import resolve_dtype
    from worker_svc.execution.device import default_attention_backend
    from worker_svc.kernels.cpu_kernels import keep_freed_memory

    torch.set_num_threads(threads)
    keep_freed_memory()
    backend = default_attention_backend(torch.device("cpu"))
    models = [load_stage(model_dir, stage=k, num_stages=n, dtype=dtype) for k, n in STAGES]
    best: dict[str, tuple[list[float], float, str]] = {}  # by label
    for _ in range(passes):
        for point in (p for model in models for p in _measure_stage(model, backend, repeats)):
            best[point[2]] = min(best.get(point[2], point), point, key=lambda p: p[1])
    model = models[-1]
    weights = str(resolve_dtype(dtype, model.config)).removeprefix("torch.")
    ran = f"--dtype {dtype} ({model.weight_format or weights + ' weights'}), '{backend}' attention"
    return list(best.values()), model.config, ran


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


def make_profile(
    name: str, points, config, ran: str, threads: int, repeats: int, model_dir: Path, passes: int = 2
) -> DeviceProfile:
    import torch

    costs = fit(points)
    predicted = [sum(c * x for c, x in zip(costs.values(), f, strict=True)) for f, _, _ in points]
    notes = [
        f"Pagoda StageRunner.execute on real plans, {ran}, {threads} torch thread(s), "
        f"fastest of {repeats} after a warm-up and of {passes} passes: one sequence's "
        "prefill and decode steps (context = each row's length after the step, summed; a "
        "decode point's context grows by one per run), for PP=1's stage (all layers, LM "
        "head, greedy sampling) and PP=2's two (layer_fraction 0.5 each; only the second "
        "has the final norm, LM head and sampling: the last_stage_* costs)."
    ]
    notes += [
        f"{label}: measured {s * 1e3:.2f} ms, fit {p * 1e3:.2f} ms ({(p / s - 1) * 100:+.1f}%)"
        for (_, s, label), p in zip(points, predicted, strict=True)
    ]
    notes.append(
        "eos_probability 0: lengths come from the load's max_tokens (the validation loads run with ignore_eos)."
    )
    notes.append(
        "host_compute true: the device is this machine's CPU, so an emulated step keeps "
        "the stage's core busy for its time (small matrix products, "
        "worker_svc.execution.emulated.compute_for), as the real stage does, instead of sleeping: "
        "the services meet the same contention for the cores."
    )
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"fitted by bench/fit_profile.py on {when} from Pagoda StageRunner steps, "
        f"{cpu_model('unknown CPU')}, {threads} torch thread(s), {_shown(model_dir)} "
        f"({config.model_type}, {config.num_layers} layers, hidden {config.hidden_size}), "
        f"{ran}, torch {torch.__version__}"
    )
    return DeviceProfile(
        name=name,
        source=source,
        eos_probability=0.0,
        allreduce_per_token_s=0.0,
        host_compute=True,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        notes=tuple(notes),
        **costs,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="a Hugging Face Llama checkpoint folder (default: %(default)s)",
    )
    parser.add_argument("--name", default="cpu-local", help="the profile's name")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the stages' --dtype (default %(default)s, "
        "the worker's: bfloat16 weights for a float32 checkpoint on AVX-512 BF16)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per point (the fastest counts)")
    parser.add_argument(
        "--passes", type=int, default=2, help="passes over all the points (the fastest counts; default %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=None, help="the profile's JSON file (default: print the fit only)")
    args = parser.parse_args(argv)
    points, config, ran = measure(args.model.expanduser(), args.threads, args.repeats, args.dtype, args.passes)
    profile = make_profile(args.name, points, config, ran, args.threads, args.repeats, args.model, args.passes)
    for note in profile.notes:
        print(note)
    print({f: getattr(profile, f) for f in COEFFICIENTS})
    if args.out is not None:
        save_profile(profile, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
