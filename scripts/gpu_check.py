"""One-shot check and measurement of Pagoda's GPU path; `scripts/gpu_check.sh` runs it.

Made for a prepared GPU image with its own python3 (torch, triton, transformers; pytest
if present), no network and no project virtualenv: run from the repository root with
`PYTHONPATH=.`. It imports only worker_svc and wiring/tiny_model.py (never generated
gRPC code) and makes its models itself. Four parts, each in its own process with its own
timeout; the figures go to a JSON file after every part (`$OUT/gpu_check.json` when OUT
is set, else `./gpu_check.json`); the exit status is non-zero when any part failed.

  kernel_tests     pytest on the kernel tests (tests/unit/test_triton_attention.py) and
                   tests/gpu/, compiled for CUDA (TRITON_INTERPRET=0); without pytest, a
                   built-in comparison of the kernels with the torch reference
  hf_equivalence   tiny Llama and tiny gpt-oss (sinks, sliding layers, the fused-MoE kernels)
                   on CUDA in float32, greedy through StageRunner (triton and torch
                   backends) against transformers, under the project's tie rule
  attention_bench  paged decode attention, batch 64 x context 4,096 and 32,768, Triton vs
                   the torch reference, bandwidth against a device-to-device copy
  throughput       a ~1B-parameter random Llama (make_tiny_model), bfloat16 and fp8, PP=1,
                   prefill and decode steps through StageRunner (the runtime alone)
  profile          the same model's step times through StageRunner at several batch sizes
                   and prompt lengths, fitted to a device profile for the emulated device
                   (services/device_profile.py): `$OUT/<device>-llama-1b-bf16.json` (e.g.
                   h200-llama-1b-bf16.json), read back with load_profile; copy it into
                   services/profiles/ to check the A100 roofline against a measurement

`--cpu-smoke` runs all four on the CPU under Triton's interpreter, at toy sizes: it
checks the script, not the GPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PARTS = ("kernel_tests", "hf_equivalence", "attention_bench", "throughput", "profile")
TIMEOUT_S = {"kernel_tests": 100, "hf_equivalence": 50, "attention_bench": 50, "throughput": 110,
             "profile": 60}
TOTAL_BUDGET_S = 350  # the whole run stays under six minutes
TIE_TOLERANCE = 1e-4  # as tests/support/reference.py


# --- the driver: one child process per part -----------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run every part on the CPU under Triton's interpreter, at toy sizes")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the figures (default: $OUT/gpu_check.json or ./gpu_check.json)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        return run_part(args.part, args.cpu_smoke, args.result)

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    out = args.out or Path(os.environ.get("OUT") or ".") / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "started_unix": round(time.time(), 1),
        "python": platform.python_version(),
        "parts": {},
    }
    deadline = time.monotonic() + TOTAL_BUDGET_S
    for name in parts:
        timeout = min(TIMEOUT_S[name], int(deadline - time.monotonic()))
        print(f"== {name} (timeout {timeout} s)", flush=True)
        result = _run_child(name, args.cpu_smoke, timeout) if timeout > 0 else {
            "ok": False, "error": "no time left in the five-minute budget"}
        report.setdefault("environment", result.pop("environment", None))
        result.pop("environment", None)
        report["parts"][name] = result
        report["ok"] = all(r["ok"] for r in report["parts"].values())
        _write_json(out, report)
        status = "ok" if result["ok"] else f"FAILED: {result.get('error', '')}"
        print(f"== {name}: {status} ({result.get('seconds', '?')} s)", flush=True)
    print(f"figures written to {out}")
    print(json.dumps(report, indent=1))
    return 0 if report.get("ok") else 1


def _run_child(name: str, smoke: bool, timeout: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # Interpreter for the smoke run, compiled kernels for the real one: chosen before any
    # child imports triton.
    env["TRITON_INTERPRET"] = "1" if smoke else "0"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name,
               "--result", str(result_path)] + (["--cpu-smoke"] if smoke else [])
        started = time.monotonic()
        # Own session, so that a timeout takes down the whole process group.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"ok": False, "error": f"timed out after {timeout} s",
                    "seconds": round(time.monotonic() - started, 1)}
        if result_path.is_file():
            result = json.loads(result_path.read_text())
        else:
            result = {"ok": False, "error": f"exited with status {code} and no result"}
        if code != 0 and result.get("ok"):
            result.update(ok=False, error=f"exited with status {code}")
        return result


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


# --- child mode: one part in this process -------------------------------------------------


class CheckFailed(Exception):
    """A part ran but its figures miss a bound; carries what it measured."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


def run_part(name: str, smoke: bool, result_path: Path) -> int:
    started = time.perf_counter()
    result: dict[str, Any]
    try:
        result = {"ok": True, **PART_FUNCTIONS[name](smoke)}
    except CheckFailed as exc:
        result = {"ok": False, "error": str(exc), **exc.figures}
    except Exception as exc:  # a part's crash is its result, not the driver's
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=8)}
    result["seconds"] = round(time.perf_counter() - started, 1)
    try:
        result["environment"] = _environment()
    except Exception as exc:
        result["environment"] = {"error": repr(exc)}
    result_path.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


def _environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                           "grpc_imported": "grpc" in sys.modules}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpu_count=torch.cuda.device_count())
    return env


def _device(smoke: bool):
    import torch

    from worker_svc.execution.device import resolve_device

    torch.manual_seed(0)
    if smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        return resolve_device("cpu")
    return resolve_device("cuda")  # ValueError, naming the cause, where there is none


def _no_grpc() -> None:
    if "grpc" in sys.modules:
        raise RuntimeError("a worker_svc module imported grpc: the GPU image may not have it")


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
    device = _device(smoke)
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
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", *files],
                       plugins=[outcomes])
    _no_grpc()
    figures = {"runner": "pytest", "files": files, "exit_code": int(code), **outcomes.counts,
               "failed_tests": outcomes.failed[:20]}
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
        (16, 8, 8, 64, torch.float32, None), (32, 32, 8, 128, torch.bfloat16, None),
        (16, 16, 4, 128, torch.float16, 512), (1, 6, 2, 80, torch.float16, None),
    ):
        chunks = ((1, 1), (1, 17), (40, 1000), (300, 300), (1, 2049))
        q, k_pool, v_pool, k, v, metadata = paged_batch(
            device, chunks, block_size, heads, kv_heads, head_dim, dtype)
        ref_pools = (k_pool.clone(), v_pool.clone())
        TritonAttentionBackend().write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
        TorchAttentionBackend().write_kv(*ref_pools, k, v, metadata.slot_mapping)
        written = torch.equal(k_pool, ref_pools[0]) and torch.equal(v_pool, ref_pools[1])
        scale = head_dim**-0.5
        out = TritonAttentionBackend().forward(q, k_pool, v_pool, metadata, scale, window)
        ref = TorchAttentionBackend().forward(q.float(), k_pool.float(), v_pool.float(),
                                              metadata, scale, window)
        err = float((out.float() - ref).abs().max())
        bound = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        cases.append({"case": f"bs{block_size}-h{heads}/{kv_heads}-d{head_dim}-{dtype}-w{window}",
                      "max_abs_err": err, "write_kv_exact": written,
                      "ok": written and err <= bound * max(1.0, float(ref.abs().max()))})
    return {"cases": cases, "failures": [c["case"] for c in cases if not c["ok"]]}


def paged_batch(device, chunks, block_size, num_heads, num_kv_heads, head_dim, dtype,
                shuffle=True, seed=0):
    """A flattened batch over a paged pool: chunks are (num_new, context_len) per sequence.

    Returns q, k_pool, v_pool (random everywhere), the new tokens' k and v, and metadata.
    Each sequence's blocks are a random (or consecutive) set of the pool's blocks.
    """
    import torch

    from worker_svc.kernels.attention import AttentionMetadata

    g = torch.Generator(device=device).manual_seed(seed)
    needed = [-(-ctx // block_size) for _, ctx in chunks]
    num_blocks = sum(needed) + 1
    order = (torch.randperm(num_blocks, device=device, generator=g) if shuffle
             else torch.arange(num_blocks, device=device))
    max_blocks = max(needed)
    table = torch.zeros((len(chunks), max_blocks), dtype=torch.long, device=device)
    slots, starts, first = [], [0], 0
    for i, ((num_new, ctx), n) in enumerate(zip(chunks, needed, strict=True)):
        table[i, :n] = order[first:first + n]
        first += n
        pos = torch.arange(ctx - num_new, ctx, device=device)
        slots.append(table[i, pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + num_new)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.empty(size, device=device, dtype=dtype).normal_(generator=g)

    context_lens = tuple(ctx for _, ctx in chunks)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        block_tables=table,
        query_start_loc_list=tuple(starts),
        context_lens_list=context_lens,
    )
    num_tokens = starts[-1]
    return (rand(num_tokens, num_heads, head_dim), rand(*shape), rand(*shape),
            rand(num_tokens, num_kv_heads, head_dim), rand(num_tokens, num_kv_heads, head_dim),
            metadata)


# --- a greedy driver for one stage (PP=1) --------------------------------------------------


class GreedyBatch:
    """Drives one StageRunner (the whole model) over a batch: chunked prefill, then decode.

    Sequence i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq).
    """

    def __init__(self, runner, prompts: list[list[int]], blocks_per_seq: int) -> None:
        from services.sampling import SamplingParams

        self.runner = runner
        self.prompts = prompts
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                       for i in range(len(prompts))]
        self.logits: list[list[Any]] = [[] for _ in prompts]  # per sampled step, when kept
        self.greedy = SamplingParams(temperature=0.0)
        self._step = 0

    def outputs(self) -> list[list[int]]:
        return [t[len(p):] for t, p in zip(self.tokens, self.prompts, strict=True)]

    def step(self, chunk: int, keep_logits: bool = False) -> int:
        """One forward pass over every sequence; returns the number of tokens it computed."""
        from services.step import CachedSeq, NewSeq, StepPlan

        new, cached = [], []
        for i, t in enumerate(self.tokens):
            n = min(len(t) - self.computed[i], chunk)
            if self.computed[i] == 0:  # sent whole once; the stage keeps its tokens and table
                new.append(NewSeq(i, tuple(t), len(self.prompts[i]), 0, n, self.tables[i], self.greedy, 0, i))
            else:
                cached.append(CachedSeq(i, n, len(self.tables[i])))
            self.computed[i] += n
        plan = StepPlan(self._step, tuple(new), tuple(cached))
        result = self.runner.execute(plan, keep_logits=keep_logits)
        self._step += 1
        for row, (seq_id, token) in enumerate(
            zip(result.sampled_seq_ids, result.sampled.token_ids, strict=True)
        ):
            self.tokens[seq_id].append(token)
            if keep_logits:
                self.logits[seq_id].append(result.logits[row].float().cpu())
        return plan.num_tokens


# --- part 2: transformers equivalence ------------------------------------------------------


def part_hf_equivalence(smoke: bool) -> dict[str, Any]:
    """The tiny Llama, and a tiny gpt-oss (attention sinks, sliding layers, the fused-MoE
    kernels with the clamped SwiGLU and biases), each against transformers on the device."""
    from wiring.tiny_model import TinyModelSpec, make_tiny_model

    sys.path.insert(0, str(REPO / "tests"))
    from support.archs import make_arch_model

    device = _device(smoke)
    lengths, new_tokens = ((1, 3, 17, 40), 8) if smoke else ((1, 3, 17, 45, 100, 177), 24)
    figures: dict[str, Any] = {"device": str(device), "dtype": "float32", "prompt_lengths": list(lengths),
                               "new_tokens": new_tokens}
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
    _no_grpc()
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
                ref = hf(ids).logits[0, len(prompt) - 1:].float().cpu()  # [new_tokens, vocab]
            for j, token in enumerate(out):
                gap = float(ref[j].max() - ref[j, token])
                if int(ref[j].argmax()) != token:
                    if gap > TIE_TOLERANCE:
                        failures.append(f"{backend}: prompt {i} step {j}: token {token}, "
                                        f"transformers {int(ref[j].argmax())}, gap {gap:.3g}")
                        break
                    ties += 1
                max_logit_diff = max(max_logit_diff, float((batch.logits[i][j] - ref[j]).abs().max()))
        figures[backend] = {"tie_divergences": ties, "max_abs_logit_diff": max_logit_diff,
                            "outputs_equal_triton": batch.outputs() == runs["triton"].outputs()}
    return figures, failures


# --- part 3: paged decode attention benchmark ----------------------------------------------


def _timed(fn, iterations: int, device) -> float:
    """Mean seconds per call (after one warm-up call)."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iterations
    started = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - started) / iterations


def part_attention_bench(smoke: bool) -> dict[str, Any]:
    import torch

    from worker_svc.kernels.attention import TorchAttentionBackend
    from worker_svc.kernels.triton_attention import TritonAttentionBackend

    device = _device(smoke)
    if smoke:
        shapes, heads, kv_heads, head_dim, dtype = ((4, 64), (4, 256)), 4, 2, 32, torch.float32
        copy_bytes, iters, ref_iters = 16 << 20, 2, 1
    else:
        shapes, heads, kv_heads, head_dim, dtype = ((64, 4096), (64, 32768)), 32, 8, 128, torch.bfloat16
        copy_bytes, iters, ref_iters = 2 << 30, 20, 2
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(functools.partial(dst.copy_, src), iters, device)
    copy_gbps = 2 * copy_bytes / copy_s / 1e9  # read + write
    del src, dst
    figures: dict[str, Any] = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
                               "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
                               "block_size": 16, "copy_GBps": round(copy_gbps, 1), "cases": []}
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    failures = []
    for batch, ctx in shapes:
        q, k_pool, v_pool, _, _, metadata = paged_batch(
            device, ((1, ctx),) * batch, 16, heads, kv_heads, head_dim, dtype)
        scale = head_dim**-0.5

        def run_triton(q=q, k_pool=k_pool, v_pool=v_pool, metadata=metadata, scale=scale):
            return triton_backend.forward(q, k_pool, v_pool, metadata, scale, None)

        def run_torch(q=q, k_pool=k_pool, v_pool=v_pool, metadata=metadata, scale=scale):
            return torch_backend.forward(q, k_pool, v_pool, metadata, scale, None)

        out, ref = run_triton().float(), run_torch().float()
        rel_err = float((out - ref).norm() / ref.norm())
        triton_s = _timed(run_triton, iters, device)
        torch_s = _timed(run_torch, ref_iters, device)
        elem = k_pool.element_size()
        moved = 2 * batch * ctx * kv_heads * head_dim * elem + 2 * q.numel() * elem
        case = {"batch": batch, "context": ctx, "bytes_read_MiB": round(moved / 2**20, 1),
                "triton_ms": round(triton_s * 1e3, 3), "torch_ms": round(torch_s * 1e3, 3),
                "triton_GBps": round(moved / triton_s / 1e9, 1),
                "torch_GBps": round(moved / torch_s / 1e9, 1),
                "triton_fraction_of_copy": round(moved / triton_s / 1e9 / copy_gbps, 3),
                "speedup_vs_torch": round(torch_s / triton_s, 2), "rel_err_vs_torch": rel_err}
        print(json.dumps(case), flush=True)
        figures["cases"].append(case)
        if not rel_err < 2e-2:
            failures.append(f"batch {batch} x {ctx}: relative error {rel_err:.3g} vs torch")
        del q, k_pool, v_pool, metadata, out, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _no_grpc()
    if failures:
        raise CheckFailed(failures[0], figures)
    return figures


# --- part 4: throughput of a ~1B model -----------------------------------------------------


def part_throughput(smoke: bool) -> dict[str, Any]:
    import torch

    from wiring.tiny_model import TinyModelSpec, make_tiny_model
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.runner import StageRunner
    from worker_svc.weights.quantization import weight_bytes

    device = _device(smoke)
    if smoke:
        spec = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             dtype="bfloat16")
        batch, prompt_len, warmup, steps = 4, 16, 1, 4
    else:  # Llama 3.2 1B's shape, with the maker's largest vocabulary
        spec = TinyModelSpec(hidden_size=2048, intermediate_size=8192, num_layers=16,
                             num_heads=32, num_kv_heads=8, vocab_size=8192,
                             max_position_embeddings=4096, dtype="bfloat16")
        batch, prompt_len, warmup, steps = 64, 128, 4, 64
    block_size = 16
    blocks_per_seq = -(-(prompt_len + warmup + steps + 1) // block_size)
    figures: dict[str, Any] = {"device": str(device), "num_parameters": spec.num_parameters,
                               "batch": batch, "prompt_len": prompt_len, "decode_steps": steps,
                               "backend": "triton", "pipeline_parallel_size": 1}
    with tempfile.TemporaryDirectory(prefix="gpu-check-1b-") as tmp:
        started = time.perf_counter()
        model_dir = make_tiny_model(Path(tmp) / "model", spec)
        figures["make_model_s"] = round(time.perf_counter() - started, 1)
        g = torch.Generator().manual_seed(7)
        prompts = torch.randint(5, spec.vocab_size, (batch, prompt_len), generator=g).tolist()
        first_logits = {}
        for quant in (None, "fp8"):
            name = quant or "bfloat16"
            started = time.perf_counter()
            model = load_stage(model_dir, dtype="bfloat16", device=device, quantization=quant)
            load_s = time.perf_counter() - started
            runner = StageRunner(model, num_blocks=batch * blocks_per_seq, block_size=block_size,
                                 backend="triton")
            gb = GreedyBatch(runner, prompts, blocks_per_seq)
            _sync(device)
            started = time.perf_counter()
            prefill_tokens = gb.step(chunk=prompt_len, keep_logits=True)  # samples the 1st token
            _sync(device)
            prefill_s = time.perf_counter() - started
            first_logits[name] = torch.stack([lg[0] for lg in gb.logits])
            for _ in range(warmup):
                gb.step(chunk=1)
            _sync(device)
            started = time.perf_counter()
            for _ in range(steps):
                gb.step(chunk=1)  # the sampler's .tolist() waits for the step's result
            decode_s = time.perf_counter() - started
            row = {"weight_bytes": weight_bytes(model), "load_s": round(load_s, 2),
                   "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1),
                   "decode_tokens_per_s": round(batch * steps / decode_s, 1),
                   "decode_step_ms": round(decode_s / steps * 1e3, 2)}
            if device.type == "cuda":
                row["peak_memory_GiB"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                torch.cuda.reset_peak_memory_stats(device)
            print(name, json.dumps(row), flush=True)
            figures[name] = row
            del gb, runner, model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _no_grpc()
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

    device = _device(smoke)
    if smoke:  # a stand-in device: checks the part and the file's format, not a GPU
        spec = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, dtype="float32")
        shapes, decode_steps = ((1, 16), (2, 32), (4, 8)), 2
    else:  # Llama 3.2 1B's shape, as the throughput part
        spec = TinyModelSpec(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                             num_kv_heads=8, vocab_size=8192, max_position_embeddings=4096,
                             dtype="bfloat16")
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
    return {"profile_path": str(path), "name": loaded.name, "num_points": len(points),
            **{k: getattr(loaded, k) for k in ("fixed_s", "per_prefill_token_s", "per_decode_row_s",
                                                "per_context_token_s")}}


def _step_points(model, device, vocab_size: int, batch: int, prompt_len: int, decode_steps: int):
    """(features [1, prefill tokens, decode rows, context tokens], seconds, label) of one
    prefill step of `batch` prompts and of the decode steps after it."""
    import torch

    from worker_svc.execution.runner import StageRunner

    block_size = 16
    blocks_per_seq = -(-(prompt_len + decode_steps + 2) // block_size)
    runner = StageRunner(model, num_blocks=batch * blocks_per_seq, block_size=block_size,
                         backend="triton" if device.type == "cuda" else "torch")
    g = torch.Generator().manual_seed(batch * 7919 + prompt_len)
    gb = GreedyBatch(runner, torch.randint(5, vocab_size, (batch, prompt_len), generator=g).tolist(),
                     blocks_per_seq)
    points = []
    for k in range(decode_steps + 1):
        _sync(device)
        started = time.perf_counter()
        gb.step(chunk=prompt_len if k == 0 else 1)  # (its sampler waits for the result)
        seconds = time.perf_counter() - started
        if k == 0:
            points.append(([1.0, batch * prompt_len, 0, batch * prompt_len], seconds,
                           f"prefill {batch} x {prompt_len}"))
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
    notes = [f"{label}: measured {s * 1e3:.3f} ms, fit {p * 1e3:.3f} ms ({(p / s - 1) * 100:+.1f}%)"
             for (_, s, label), p in zip(points, predicted, strict=True)]
    notes.insert(0, "Step times of Pagoda's own StageRunner (the whole model, PP=1, TP=1, greedy "
                    "sampling included) at several batch sizes and prompt lengths; one layer count, "
                    "so the constant is fixed_s and per_step_s is 0.")
    source = (f"recorded by scripts/gpu_check.py (part profile) on {device} "
              f"({_environment().get('gpu', 'no GPU')}, torch {torch.__version__}), {spec.num_layers} layers, hidden "
              f"{spec.hidden_size}, {spec.dtype}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return DeviceProfile(name=name, source=source, fixed_s=float(coef[0]), per_prefill_token_s=float(coef[1]),
                         per_decode_row_s=float(coef[2]), per_context_token_s=float(coef[3]),
                         allreduce_per_token_s=0.0, eos_probability=0.0, hidden_size=spec.hidden_size,
                         num_layers=spec.num_layers, notes=tuple(notes))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


PART_FUNCTIONS = {
    "kernel_tests": part_kernel_tests,
    "hf_equivalence": part_hf_equivalence,
    "attention_bench": part_attention_bench,
    "throughput": part_throughput,
    "profile": part_profile,
}

if __name__ == "__main__":
    sys.exit(main())
