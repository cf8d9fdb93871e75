"""scripts/gpu_check.py's measuring parts: paged decode attention against a device copy,
a ~1B model's prefill and decode throughput (bfloat16 and fp8), and the step times fitted
to a device profile for the emulated device (see gpu_check.py's docstring).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_check_common import CheckFailed, GreedyBatch, check_no_grpc, device_for, environment, paged_batch, sync, timed

if TYPE_CHECKING:
    from wiring.tiny_model import TinyModelSpec

# --- part 3: paged decode attention benchmark ----------------------------------------------


def part_attention_bench(smoke: bool) -> dict[str, Any]:
    import torch

    from worker_svc.kernels.attention import TorchAttentionBackend
    from worker_svc.kernels.triton_attention import TritonAttentionBackend

    device = device_for(smoke)
    if smoke:
        shapes, heads, kv_heads, head_dim, dtype = ((4, 64), (4, 256)), 4, 2, 32, torch.float32
        copy_bytes, iters, ref_iters = 16 << 20, 2, 1
    else:
        shapes, heads, kv_heads, head_dim, dtype = ((64, 4096), (64, 32768)), 32, 8, 128, torch.bfloat16
        copy_bytes, iters, ref_iters = 2 << 30, 20, 2
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(functools.partial(dst.copy_, src), iters, device)
    copy_gbps = 2 * copy_bytes / copy_s / 1e9  # read + write
    del src, dst
    figures: dict[str, Any] = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": 16,
        "copy_GBps": round(copy_gbps, 1),
        "cases": [],
    }
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    failures = []
    for batch, ctx in shapes:
        q, k_pool, v_pool, _, _, metadata = paged_batch(
            device, ((1, ctx),) * batch, 16, heads, kv_heads, head_dim, dtype
        )
        scale = head_dim**-0.5

        def run_triton(q=q, k_pool=k_pool, v_pool=v_pool, metadata=metadata, scale=scale):
            return triton_backend.forward(q, k_pool, v_pool, metadata, scale, None)

        def run_torch(q=q, k_pool=k_pool, v_pool=v_pool, metadata=metadata, scale=scale):
            return torch_backend.forward(q, k_pool, v_pool, metadata, scale, None)

        out, ref = run_triton().float(), run_torch().float()
        rel_err = float((out - ref).norm() / ref.norm())
        triton_s = timed(run_triton, iters, device)
        torch_s = timed(run_torch, ref_iters, device)
        elem = k_pool.element_size()
        moved = 2 * batch * ctx * kv_heads * head_dim * elem + 2 * q.numel() * elem
        case = {
            "batch": batch,
            "context": ctx,
            "bytes_read_MiB": round(moved / 2**20, 1),
            "triton_ms": round(triton_s * 1e3, 3),
            "torch_ms": round(torch_s * 1e3, 3),
            "triton_GBps": round(moved / triton_s / 1e9, 1),
            "torch_GBps": round(moved / torch_s / 1e9, 1),
            "triton_fraction_of_copy": round(moved / triton_s / 1e9 / copy_gbps, 3),
            "speedup_vs_torch": round(torch_s / triton_s, 2),
            "rel_err_vs_torch": rel_err,
        }
        print(json.dumps(case), flush=True)
        figures["cases"].append(case)
        if not rel_err < 2e-2:
            failures.append(f"batch {batch} x {ctx}: relative error {rel_err:.3g} vs torch")
        del q, k_pool, v_pool, metadata, out, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    check_no_grpc()
    if failures:
        raise CheckFailed(failures[0], figures)
    return figures


# --- part 4: throughput of a ~1B model -----------------------------------------------------


@dataclass(frozen=True)
class ThroughputLoad:
    """The throughput part's batch: `batch` prompts of `prompt_len`, then `warmup` and `steps` decode steps."""

    batch: int
    prompt_len: int
    warmup: int
    steps: int
    block_size: int = 16

    @property
    def blocks_per_seq(self) -> int:
        return -(-(self.prompt_len + self.warmup + self.steps + 1) // self.block_size)


def throughput_case(smoke: bool) -> tuple[TinyModelSpec, ThroughputLoad]:
    """The model and load: a small stand-in for --smoke, else a ~1B model at batch 64."""
    from wiring.tiny_model import TinyModelSpec

    if smoke:
        spec = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, dtype="bfloat16")
        return spec, ThroughputLoad(batch=4, prompt_len=16, warmup=1, steps=4)
    # Llama 3.2 1B's shape, with the maker's largest vocabulary
    spec = TinyModelSpec(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        vocab_size=8192,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    return spec, ThroughputLoad(batch=64, prompt_len=128, warmup=4, steps=64)


def time_weight_format(model_dir: Path, quant: str | None, device, prompts: list[list[int]], load: ThroughputLoad):
    """One weight format (None: bfloat16, "fp8") loaded, prefilled and decoded greedily:
    its figures and the first token's logits of each prompt."""
    import torch

    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.runner import StageRunner
    from worker_svc.weights.quantization import weight_bytes

    started = time.perf_counter()
    model = load_stage(model_dir, dtype="bfloat16", device=device, quantization=quant)
    load_s = time.perf_counter() - started
    runner = StageRunner(
        model, num_blocks=load.batch * load.blocks_per_seq, block_size=load.block_size, backend="triton"
    )
    gb = GreedyBatch(runner, prompts, load.blocks_per_seq)
    sync(device)
    started = time.perf_counter()
    prefill_tokens = gb.step(chunk=load.prompt_len, keep_logits=True)  # samples the 1st token
    sync(device)
    prefill_s = time.perf_counter() - started
    first_logits = torch.stack([lg[0] for lg in gb.logits])
    for _ in range(load.warmup):
        gb.step(chunk=1)
    sync(device)
    started = time.perf_counter()
    for _ in range(load.steps):
        gb.step(chunk=1)  # the sampler's .tolist() waits for the step's result
    decode_s = time.perf_counter() - started
    row = {
        "weight_bytes": weight_bytes(model),
        "load_s": round(load_s, 2),
        "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1),
        "decode_tokens_per_s": round(load.batch * load.steps / decode_s, 1),
        "decode_step_ms": round(decode_s / load.steps * 1e3, 2),
    }
    if device.type == "cuda":
        row["peak_memory_GiB"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        torch.cuda.reset_peak_memory_stats(device)
    return row, first_logits


def part_throughput(smoke: bool) -> dict[str, Any]:
    import torch

    from wiring.tiny_model import make_tiny_model

    device = device_for(smoke)
    spec, load = throughput_case(smoke)
    figures: dict[str, Any] = {
        "device": str(device),
        "num_parameters": spec.num_parameters,
        "batch": load.batch,
        "prompt_len": load.prompt_len,
        "decode_steps": load.steps,
        "backend": "triton",
        "pipeline_parallel_size": 1,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-1b-") as tmp:
        started = time.perf_counter()
        model_dir = make_tiny_model(Path(tmp) / "model", spec)
        figures["make_model_s"] = round(time.perf_counter() - started, 1)
        g = torch.Generator().manual_seed(7)
        prompts = torch.randint(5, spec.vocab_size, (load.batch, load.prompt_len), generator=g).tolist()
        first_logits = {}
        for quant in (None, "fp8"):
            name = quant or "bfloat16"
            row, first_logits[name] = time_weight_format(model_dir, quant, device, prompts, load)
            print(name, json.dumps(row), flush=True)
            figures[name] = row
            if device.type == "cuda":  # the format's model and pool went with time_weight_format's frame
                torch.cuda.empty_cache()
    check_no_grpc()
    ref, got = first_logits["bfloat16"], first_logits["fp8"]
    figures["fp8_vs_bf16_first_token_agreement"] = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    figures["fp8_vs_bf16_max_abs_logit_diff"] = float((ref - got).abs().max())
    figures["fp8_weight_bytes_ratio"] = round(figures["fp8"]["weight_bytes"] / figures["bfloat16"]["weight_bytes"], 3)
    if figures["fp8_weight_bytes_ratio"] > 0.55 and not smoke:
        raise CheckFailed(f"fp8 weights are {figures['fp8_weight_bytes_ratio']} of bf16", figures)
    return figures


# --- part 5: a device profile from real step times --------------------------------------


def part_profile(smoke: bool) -> dict[str, Any]:

    from services.device_profile import load_profile, save_profile
    from wiring.tiny_model import TinyModelSpec, make_tiny_model
    from worker_svc.checkpoints.loader import load_stage

    device = device_for(smoke)
    if smoke:  # a stand-in device: checks the part and the file's format, not a GPU
        spec = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, dtype="float32")
        shapes, decode_steps = ((1, 16), (2, 32), (4, 8)), 2
    else:  # Llama 3.2 1B's shape, as the throughput part
        spec = TinyModelSpec(
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            vocab_size=8192,
            max_position_embeddings=4096,
            dtype="bfloat16",
        )
        shapes, decode_steps = ((1, 128), (1, 1024), (16, 256), (64, 128), (64, 512)), 8
    points: list[tuple[list[float], float, str]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-profile-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", spec)
        model = load_stage(model_dir, dtype=spec.dtype, device=device)
        _step_points(model, device, spec.vocab_size, *shapes[0], decode_steps)  # warm-up, not kept
        for batch, prompt_len in shapes:
            points += _step_points(model, device, spec.vocab_size, batch, prompt_len, decode_steps)
    name = _profile_name(device, smoke)
    profile = _fitted_profile(name, points, spec, device)
    path = Path(os.environ.get("OUT") or ".") / f"{name}.json"
    save_profile(profile, path)
    loaded = load_profile(str(path))  # the emulated device reads it back
    return {
        "profile_path": str(path),
        "name": loaded.name,
        "num_points": len(points),
        **{
            k: getattr(loaded, k) for k in ("fixed_s", "per_prefill_token_s", "per_decode_row_s", "per_context_token_s")
        },
    }


def _step_points(model, device, vocab_size: int, batch: int, prompt_len: int, decode_steps: int):
    """(features [1, prefill tokens, decode rows, context tokens], seconds, label) of one
    prefill step of `batch` prompts and of the decode steps after it."""
    import torch

    from worker_svc.execution.runner import StageRunner

    block_size = 16
    blocks_per_seq = -(-(prompt_len + decode_steps + 2) // block_size)
    runner = StageRunner(
        model,
        num_blocks=batch * blocks_per_seq,
        block_size=block_size,
        backend="triton" if device.type == "cuda" else "torch",
    )
    g = torch.Generator().manual_seed(batch * 7919 + prompt_len)
    gb = GreedyBatch(runner, torch.randint(5, vocab_size, (batch, prompt_len), generator=g).tolist(), blocks_per_seq)
    points = []
    for k in range(decode_steps + 1):
        sync(device)
        started = time.perf_counter()
        gb.step(chunk=prompt_len if k == 0 else 1)  # (its sampler waits for the result)
        seconds = time.perf_counter() - started
        if k == 0:
            points.append(
                ([1.0, batch * prompt_len, 0, batch * prompt_len], seconds, f"prefill {batch} x {prompt_len}")
            )
        elif k > 1:  # (the first decode step warms its shapes up)
            context = batch * (prompt_len + k)
            points.append(([1.0, 0, batch, context], seconds, f"decode {batch} x {prompt_len + k}"))
    return points


def _profile_name(device, smoke: bool) -> str:
    if smoke:
        return "cpu-stand-in-llama-tiny"
    import torch

    words = torch.cuda.get_device_name(device).lower().replace("nvidia", "").split()
    return "-".join(w for w in words if w.isalnum()) + "-llama-1b-bf16"


def _fitted_profile(name: str, points, spec, device):
    """Least squares of the step model on relative error, coefficients kept >= 0 (one layer
    count, so the constant is all fixed_s and per_step_s is 0)."""
    import numpy as np
    import torch

    from services.device_profile import DeviceProfile

    features = np.array([f for f, _, _ in points], dtype=float)
    seconds = np.array([s for _, s, _ in points], dtype=float)
    weighted = features / seconds[:, None]
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:  # drop a negative coefficient and fit the rest again
        solution, *_ = np.linalg.lstsq(weighted[:, active], np.ones(len(points)), rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    predicted = features @ coef
    notes = [
        f"{label}: measured {s * 1e3:.3f} ms, fit {p * 1e3:.3f} ms ({(p / s - 1) * 100:+.1f}%)"
        for (_, s, label), p in zip(points, predicted, strict=True)
    ]
    notes.insert(
        0,
        "Step times of Pagoda's own StageRunner (the whole model, PP=1, TP=1, greedy "
        "sampling included) at several batch sizes and prompt lengths; one layer count, "
        "so the constant is fixed_s and per_step_s is 0.",
    )
    source = (
        f"recorded by scripts/gpu_check.py (part profile) on {device} "
        f"({environment().get('gpu', 'no GPU')}, torch {torch.__version__}), {spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.dtype}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    return DeviceProfile(
        name=name,
        source=source,
        fixed_s=float(coef[0]),
        per_prefill_token_s=float(coef[1]),
        per_decode_row_s=float(coef[2]),
        per_context_token_s=float(coef[3]),
        allreduce_per_token_s=0.0,
        eos_probability=0.0,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        notes=tuple(notes),
    )
