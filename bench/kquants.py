"""One-stream matmul times of GGUF K-quants against Q4_1 and Q8_0 on a SmolLM2-135M-shaped
layer (hidden 576, intermediate 1,536), one thread, for the native kernels
(worker_svc/kernels/quant_kernels.py). Prints figures; not a test.

SmolLM2's hidden size (576) is not a whole number of 256-value super-blocks, so in a
llama.cpp Q4_K_M file only ffn_down (K = 1,536) is Q4_K or Q6_K; q/k/v/o/gate/up fall back
to Q5_0 (Q8_0 where Q6_K was wanted). The figures are per product (ffn_down in every type;
gate/up in the 32-block types) and per layer (all seven products: the Q4_K_M mix, all Q4_1,
all Q8_0), at T = 1 (a decode step) and T = 64, act_bits 16 (the default) and 8; and a
whole stage's decode step (`--layers` SmolLM2-shaped layers written as Q4_K_M, Q4_1 and
Q8_0 files, loaded at dtype auto) with the native fused step and through the modules.

    .venv/bin/python -m bench.kquants [--repeats 100] [--isa avx512] [--layers 8]
"""

from __future__ import annotations

import argparse
import time

import torch

from worker_svc.kernels.block_formats import row_bytes
from worker_svc.kernels.quant_kernels import quant_kernels
from worker_svc.weights.kquants_ref import quantize

HIDDEN, INTER, KV = 576, 1536, 192
# (name, out, in) of one decoder layer; q/k/v and gate/up fused as the model runs them
LAYER = (
    ("qkv", HIDDEN + 2 * KV, HIDDEN),
    ("o", HIDDEN, HIDDEN),
    ("gate_up", 2 * INTER, HIDDEN),
    ("down", HIDDEN, INTER),
)
# the Q4_K_M mix of a SmolLM2 layer that gets more bits in ffn_down (attn_v's Q6_K -> Q8_0
# at K = 576 sits in the qkv product's third part; timed here as Q5_0 for the whole product)
MIXES = {
    "Q4_K_M": {"qkv": "Q5_0", "o": "Q5_0", "gate_up": "Q5_0", "down": "Q4_K"},
    "Q4_K_M (down Q6_K)": {"qkv": "Q5_0", "o": "Q5_0", "gate_up": "Q5_0", "down": "Q6_K"},
    "Q4_1": {"qkv": "Q4_1", "o": "Q4_1", "gate_up": "Q4_1", "down": "Q4_1"},
    "Q8_0": {"qkv": "Q8_0", "o": "Q8_0", "gate_up": "Q8_0", "down": "Q8_0"},
}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _blocks(qtype: str, n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        import gguf
        import numpy as np

        blocks = gguf.quants.quantize(w.numpy().astype(np.float32), getattr(gguf.GGMLQuantizationType, qtype))
        return torch.from_numpy(blocks)
    return quantize(w, qtype)


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--isa", default=None, help="avx512, avx2 or scalar (default: the best this CPU runs)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the whole-stage decode step (0: skip it)")
    args = parser.parse_args(argv)
    kernels = quant_kernels()
    if kernels is None:
        raise SystemExit("native kernels unavailable")
    torch.set_num_threads(1)
    isa = args.isa or kernels.isa
    print(f"CPU: {_cpu_name()}; path {isa} of {kernels.available}; one thread")
    cache: dict[tuple[str, int, int], torch.Tensor] = {}

    def weights(qtype: str, n: int, k: int) -> torch.Tensor:
        if (qtype, n, k) not in cache:
            cache[qtype, n, k] = _blocks(qtype, n, k)
        return cache[qtype, n, k]

    def product(qtype: str, n: int, k: int, T: int, bits: int) -> float:
        w, x = weights(qtype, n, k), torch.randn(T, k)
        out = torch.empty(T, n)
        return _time(lambda: kernels.matmul(x, w, qtype, out=out, isa=isa, act_bits=bits), args.repeats)

    print("\nper product (us; GB/s of weights at T=1)")
    for name, n, k, types in (
        ("down 576x1536", HIDDEN, INTER, ("Q4_K", "Q6_K", "Q5_0", "Q4_1", "Q8_0")),
        ("gate_up 3072x576", 2 * INTER, HIDDEN, ("Q5_0", "Q4_1", "Q8_0")),
    ):
        for qtype in types:
            cells = []
            for bits in (16, 8):
                for T in (1, 64):
                    s = product(qtype, n, k, T, bits)
                    rate = f" {n * row_bytes(qtype, k) / s / 1e9:5.1f} GB/s" if T == 1 else ""
                    cells.append(f"int{bits} T={T}: {s * 1e6:8.1f}{rate}")
            print(f"  {name:17s} {qtype:5s} " + "  ".join(cells))
    print("\nper layer, the four products (us)")
    for mix, types in MIXES.items():
        cells = []
        for bits in (16, 8):
            for T in (1, 64):
                total = sum(product(types[name], n, k, T, bits) for name, n, k in LAYER)
                cells.append(f"int{bits} T={T}: {total * 1e6:8.1f}")
        print(f"  {mix:19s} " + "  ".join(cells))
    if args.layers:
        decode_steps(args.layers, max(5, args.repeats // 10))


def _decode_step_ms(stage, batch: int, context: int, repeats: int) -> float:
    """ms of one decode step (one token for each of `batch` sequences after `context`)."""
    from worker_svc.execution.kv_cache import PagedKVCache
    from worker_svc.kernels.attention import AttentionMetadata, TorchAttentionBackend

    cfg, block = stage.config, 16
    per_seq = -(-(context + 1) // block)
    cache = PagedKVCache(
        stage.num_local_layers, batch * per_seq, block, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu"
    )
    table = torch.arange(batch * per_seq).view(batch, per_seq)

    def step(length: int, new: int) -> tuple:
        pos = torch.arange(length - new, length)
        slots = torch.cat([table[i, pos // block] * block + pos % block for i in range(batch)])
        starts = tuple(i * new for i in range(batch + 1))
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor(starts),
            context_lens=torch.full((batch,), length),
            block_tables=table,
            query_start_loc_list=starts,
            context_lens_list=(length,) * batch,
        )
        ids = torch.randint(5, cfg.vocab_size, (batch * new,))
        return ids, pos.repeat(batch), meta

    backend = TorchAttentionBackend()
    ids, pos, meta = step(context, context)
    stage(ids, pos, cache.pools, meta, backend, logits_indices=torch.arange(batch) * context + context - 1)
    ids, pos, meta = step(context + 1, 1)
    run = lambda: stage(ids, pos, cache.pools, meta, backend, logits_indices=torch.arange(batch))  # noqa: E731
    return _time(run, repeats) * 1e3


def decode_steps(num_layers: int, repeats: int) -> None:
    """A SmolLM2-135M-shaped model of `num_layers` layers (random weights) written as Q4_K_M,
    Q4_1 and Q8_0 GGUF files, served at dtype auto: a decode step with the native fused step
    and through the modules."""
    import tempfile
    from pathlib import Path

    from wiring.gguf_export import write_gguf
    from wiring.model_source import prepare_gguf
    from wiring.tiny_model import TinyModelSpec, make_tiny_model
    from worker_svc.checkpoints.loader import load_stage

    spec = TinyModelSpec(
        hidden_size=HIDDEN, intermediate_size=INTER, num_heads=9, num_kv_heads=3, num_layers=num_layers
    )
    print(
        f"\nwhole stage, {num_layers} SmolLM2-shaped layers, context 32: decode step ms (fused native step / modules)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", spec)
        for qtype in ("Q4_K_M", "Q4_1", "Q8_0"):
            stage = load_stage(prepare_gguf(write_gguf(model, Path(tmp) / f"{qtype}.gguf", qtype)))
            cells = []
            for batch in (1, 8):
                fused = _decode_step_ms(stage, batch, 32, repeats)
                keep, stage.fused_decode = stage.fused_decode, None
                modules = _decode_step_ms(stage, batch, 32, repeats)
                stage.fused_decode = keep
                cells.append(f"batch {batch}: {fused:6.2f} / {modules:6.2f}")
            print(
                f"  {qtype:7s} ({stage.weight_format}, fused {'on' if keep is not None else 'n/a'})  "
                + "  ".join(cells)
            )


if __name__ == "__main__":
    main()
