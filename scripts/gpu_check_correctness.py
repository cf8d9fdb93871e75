"""scripts/gpu_check.py's correctness parts: the kernel tests compiled for the device, and
greedy decoding through StageRunner against transformers (see gpu_check.py's docstring).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpu_check_common import REPO, CheckFailed, GreedyBatch, check_no_grpc, device_for, paged_batch

TIE_TOLERANCE = 1e-4  # as tests/support/reference.py


# --- part 1: kernel tests ------------------------------------------------------------------


class _Outcomes:
    """A pytest plugin that counts outcomes and keeps the failed tests' ids."""

    def __init__(self) -> None:
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}
        self.failed: list[str] = []

    def pytest_collectreport(self, report) -> None:
        if report.skipped:  # a module skipped as a whole (no CUDA, interpreter mode)
            self.counts["skipped"] += 1
        elif report.failed:
            self.counts["failed"] += 1
            self.failed.append(f"{report.nodeid} (collection)")

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.counts["failed"] += 1
            self.failed.append(f"{report.nodeid} ({report.when})")
        elif report.skipped:
            self.counts["skipped"] += 1
        elif report.when == "call":
            self.counts["passed"] += 1


def part_kernel_tests(smoke: bool) -> dict[str, Any]:
    device = device_for(smoke)
    if importlib.util.find_spec("pytest") is None:
        figures = {"runner": "built-in (pytest is not installed)", **_builtin_kernel_check(device)}
        if figures["failures"]:
            raise CheckFailed(f"{len(figures['failures'])} kernel cases off the reference", figures)
        return figures
    import pytest

    outcomes = _Outcomes()
    files = ["tests/unit/test_triton_attention.py", "tests/gpu"]
    # --noconftest: the conftest would choose the interpreter and needs hypothesis; these
    # files need only pytest.
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", *files], plugins=[outcomes])
    check_no_grpc()
    figures = {
        "runner": "pytest",
        "files": files,
        "exit_code": int(code),
        **outcomes.counts,
        "failed_tests": outcomes.failed[:20],
    }
    if code != 0 or outcomes.counts["passed"] == 0:
        raise CheckFailed(f"pytest exit code {int(code)}", figures)
    return figures


def _builtin_kernel_check(device) -> dict[str, Any]:
    """Mixed decode/prefill batches through both backends, for images without pytest."""
    import torch

    from worker_svc.kernels.attention import TorchAttentionBackend
    from worker_svc.kernels.triton_attention import TritonAttentionBackend

    cases = []
    for block_size, heads, kv_heads, head_dim, dtype, window in (
        (16, 8, 8, 64, torch.float32, None),
        (32, 32, 8, 128, torch.bfloat16, None),
        (16, 16, 4, 128, torch.float16, 512),
        (1, 6, 2, 80, torch.float16, None),
    ):
        chunks = ((1, 1), (1, 17), (40, 1000), (300, 300), (1, 2049))
        q, k_pool, v_pool, k, v, metadata = paged_batch(device, chunks, block_size, heads, kv_heads, head_dim, dtype)
        ref_pools = (k_pool.clone(), v_pool.clone())
        TritonAttentionBackend().write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
        TorchAttentionBackend().write_kv(*ref_pools, k, v, metadata.slot_mapping)
        written = torch.equal(k_pool, ref_pools[0]) and torch.equal(v_pool, ref_pools[1])
        scale = head_dim**-0.5
        out = TritonAttentionBackend().forward(q, k_pool, v_pool, metadata, scale, window)
        ref = TorchAttentionBackend().forward(q.float(), k_pool.float(), v_pool.float(), metadata, scale, window)
        err = float((out.float() - ref).abs().max())
        bound = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        cases.append(
            {
                "case": f"bs{block_size}-h{heads}/{kv_heads}-d{head_dim}-{dtype}-w{window}",
                "max_abs_err": err,
                "write_kv_exact": written,
                "ok": written and err <= bound * max(1.0, float(ref.abs().max())),
            }
        )
    return {"cases": cases, "failures": [c["case"] for c in cases if not c["ok"]]}


# --- part 2: transformers equivalence ------------------------------------------------------


def part_hf_equivalence(smoke: bool) -> dict[str, Any]:
    """The tiny Llama, and a tiny gpt-oss (attention sinks, sliding layers, the fused-MoE
    kernels with the clamped SwiGLU and biases), each against transformers on the device."""
    from wiring.tiny_model import TinyModelSpec, make_tiny_model

    sys.path.insert(0, str(REPO / "tests"))
    from support.archs import make_arch_model

    device = device_for(smoke)
    lengths, new_tokens = ((1, 3, 17, 40), 8) if smoke else ((1, 3, 17, 45, 100, 177), 24)
    figures: dict[str, Any] = {
        "device": str(device),
        "dtype": "float32",
        "prompt_lengths": list(lengths),
        "new_tokens": new_tokens,
    }
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-tiny-") as tmp:
        tiny = make_tiny_model(Path(tmp) / "tiny", TinyModelSpec())
        models = {"tiny-llama": tiny, "tiny-gpt-oss": make_arch_model(Path(tmp) / "gpt-oss", "gpt_oss", tiny)}
        for name, model_dir in models.items():
            figures[name], failed = _greedy_against_transformers(model_dir, device, lengths, new_tokens)
            failures += [f"{name}: {f}" for f in failed]
    print(json.dumps(figures))
    if failures:
        figures["failures"] = failures[:10]
        raise CheckFailed(failures[0], figures)
    return figures


def _greedy_against_transformers(model_dir, device, lengths, new_tokens) -> tuple[dict[str, Any], list[str]]:
    """Greedy through StageRunner (triton and torch attention) against transformers' logits."""
    import torch

    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.runner import StageRunner

    g = torch.Generator().manual_seed(1234)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]
    runs = {}
    for backend in ("triton", "torch"):
        model = load_stage(model_dir, dtype="float32", device=device)
        runner = StageRunner(model, num_blocks=16 * len(prompts), block_size=16, backend=backend)
        batch = GreedyBatch(runner, prompts, blocks_per_seq=16)
        while min(len(o) for o in batch.outputs()) < new_tokens:
            batch.step(chunk=64, keep_logits=True)
        runs[backend] = batch
    check_no_grpc()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    figures: dict[str, Any] = {}
    failures: list[str] = []
    for backend, batch in runs.items():
        ties, max_logit_diff = 0, 0.0
        for i, (prompt, out) in enumerate(zip(prompts, batch.outputs(), strict=True)):
            out = out[:new_tokens]
            with torch.inference_mode():
                ids = torch.tensor([prompt + out[:-1]], device=device)
                ref = hf(ids).logits[0, len(prompt) - 1 :].float().cpu()  # [new_tokens, vocab]
            for j, token in enumerate(out):
                gap = float(ref[j].max() - ref[j, token])
                if int(ref[j].argmax()) != token:
                    if gap > TIE_TOLERANCE:
                        failures.append(
                            f"{backend}: prompt {i} step {j}: token {token}, "
                            f"transformers {int(ref[j].argmax())}, gap {gap:.3g}"
                        )
                        break
                    ties += 1
                max_logit_diff = max(max_logit_diff, float((batch.logits[i][j] - ref[j]).abs().max()))
        figures[backend] = {
            "tie_divergences": ties,
            "max_abs_logit_diff": max_logit_diff,
            "outputs_equal_triton": batch.outputs() == runs["triton"].outputs(),
        }
    return figures, failures
