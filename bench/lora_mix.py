"""Multi-LoRA on the real model (issue 27): one load mixing 4 adapters and the base model
against the base model alone, through `pagoda serve --enable-lora`; and, in-process, one
step's batched LoRA products against a forward per adapter group (the contrast).

    python -m bench.lora_mix --model-dir ~/.cache/pagoda-anchor/smol135 [--out DIR]

Adapters: made here with `peft` for the checkpoint (random A and B, rank 8 and 16, on all
seven linear layers of every decoder layer), written as PEFT folders.
Served load: 32 clients in a closed loop, 96 requests of a 64-token prompt (token ids) and 64
output tokens (greedy, ignore_eos); "base": every request names the base model; "mixed": the
requests name the 4 adapters and the base in turn. Reported: output tokens per second, the
ratio mixed/base.
In-process: the stage (the same checkpoint, as served) runs a 32-sequence decode step with
32 sequences spread over the 4 adapters and the base, batched (one forward, gathered
products per adapter), and as one forward per adapter group (5 forwards of the groups'
rows), against the base model's step alone.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NAMES = ("a1", "a2", "a3", "a4")


def make_adapters(model_dir: Path, root: Path) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i, name in enumerate(NAMES):
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        r = 8 if i % 2 == 0 else 16
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for module in model.modules():
                if "default" in getattr(module, "lora_B", {}):
                    b = module.lora_B["default"].weight
                    b.copy_(torch.randn(b.shape, generator=g) * 0.01)
        model.save_pretrained(str(root / name), safe_serialization=True)
        out[name] = str(root / name)
    return out


def served(model_dir: Path, adapters: dict[str, str], logs: Path, num: int, streams: int) -> dict:
    import openai

    from wiring.launcher import ServiceProcess, free_port, pagoda_command

    port, grpc_port = free_port(), free_port()
    args = [
        str(model_dir),
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--log-dir",
        str(logs),
        "--served-model-name",
        "base",
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        *(f"{n}={p}" for n, p in adapters.items()),
    ]
    proc = ServiceProcess(
        "serve", pagoda_command("serve", *args), f"127.0.0.1:{grpc_port}", log_path=logs / "serve.log"
    )
    proc.start()
    proc.wait_healthy(600)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(num)]
    out = {}
    try:
        for load, models in (("base", ["base"]), ("mixed", ["base", *NAMES])):

            def one(i: int, models: list[str] = models) -> int:
                r = client.completions.create(
                    model=models[i % len(models)],
                    prompt=prompts[i],
                    max_tokens=64,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                return r.usage.completion_tokens

            one(0)  # warm-up
            started = time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                tokens = sum(pool.map(one, range(num)))
            out[load] = tokens / (time.perf_counter() - started)
    finally:
        proc.stop(30)
    return out


def in_process(model_dir: Path, adapters: dict[str, str], rows: int = 32, context: int = 128) -> dict:
    """ms per decode step of `rows` sequences: base alone, batched LoRA, a forward per group."""
    import torch

    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.kv_cache import PagedKVCache
    from worker_svc.kernels.attention import get_backend
    from worker_svc.kernels.attention_metadata import paged_layout
    from worker_svc.weights.lora import LoraBank, LoraStep, token_slots
    from worker_svc.weights.lora_adapter import load_adapter

    torch.set_num_threads(1)
    model = load_stage(str(model_dir), 0, 1, dtype="auto")
    cfg = model.config
    param = next(model.parameters())
    bank = LoraBank(cfg, 0, cfg.num_layers, 4, 16, param.dtype, param.device)
    for name, path in adapters.items():
        bank.add(name, load_adapter(path, cfg, 0, cfg.num_layers, max_rank=16))
    bs, per = 16, -(-(context + 1) // 16)
    kv = PagedKVCache(cfg.num_layers, rows * per, bs, cfg.num_kv_heads, cfg.head_dim, param.dtype)
    backend = get_backend("cpu")
    slots_of = [-1 if i % 5 == 4 else i % 5 for i in range(rows)]

    def step(which: list[int], lora: bool) -> None:
        spans = [(context, context + 1, list(range(i * per, (i + 1) * per))) for i in which]
        metadata, positions = paged_layout(spans, bs, "cpu")
        ids = torch.full((len(which),), 100, dtype=torch.long)
        step_lora = LoraStep(bank, token_slots([slots_of[i] for i in which], [1] * len(which))) if lora else None
        kw = {"lora": step_lora} if step_lora is not None else {}
        model(ids, positions, kv.pools, metadata, backend, torch.arange(len(which)), **kw)

    def timed(fn, reps: int = 10) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1000 * sorted(times)[reps // 2]

    everyone = list(range(rows))
    groups = [[i for i in everyone if slots_of[i] == s] for s in (-1, 0, 1, 2, 3)]
    return {
        "base_ms": timed(lambda: step(everyone, False)),
        "batched_ms": timed(lambda: step(everyone, True)),
        "per_adapter_ms": timed(lambda: [step(g, True) for g in groups]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True, help="a Hugging Face folder (safetensors)")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(args.model_dir, Path(tmp))
        step = in_process(args.model_dir, adapters)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        serve = served(args.model_dir, adapters, logs, args.num_requests, args.concurrency)
    result = {"served_tok_s": serve, "ratio": serve["mixed"] / serve["base"], "step": step}
    print(json.dumps(result, indent=2))
    print(
        f"\nserved at {args.concurrency} in flight: base {serve['base']:.1f} tok/s, 4 adapters + base mixed "
        f"{serve['mixed']:.1f} tok/s ({result['ratio']:.2f}x)"
    )
    print(
        f"one 32-sequence decode step: base {step['base_ms']:.1f} ms, batched LoRA {step['batched_ms']:.1f} ms, "
        f"a forward per adapter group {step['per_adapter_ms']:.1f} ms"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_mix.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
