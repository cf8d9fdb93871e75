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

The parts live beside this file: gpu_check_correctness.py (kernel_tests, hf_equivalence),
gpu_check_timing.py (attention_bench, throughput, profile) and what they share,
gpu_check_common.py. Run as `python scripts/gpu_check.py`, Python finds them in the
script's own folder; a module that imports this one puts scripts/ on sys.path first.
"""

from __future__ import annotations

import argparse
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

from gpu_check_common import REPO, CheckFailed, environment
from gpu_check_correctness import part_hf_equivalence, part_kernel_tests
from gpu_check_timing import part_attention_bench, part_profile, part_throughput

PARTS = ("kernel_tests", "hf_equivalence", "attention_bench", "throughput", "profile")
TIMEOUT_S = {"kernel_tests": 100, "hf_equivalence": 50, "attention_bench": 50, "throughput": 110, "profile": 60}
TOTAL_BUDGET_S = 350  # the whole run stays under six minutes


# --- the driver: one child process per part -----------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="run every part on the CPU under Triton's interpreter, at toy sizes"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON file for the figures (default: $OUT/gpu_check.json or ./gpu_check.json)",
    )
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
        result = (
            _run_child(name, args.cpu_smoke, timeout)
            if timeout > 0
            else {"ok": False, "error": "no time left in the five-minute budget"}
        )
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
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(result_path)] + (
            ["--cpu-smoke"] if smoke else []
        )
        started = time.monotonic()
        # Own session, so that a timeout takes down the whole process group.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {
                "ok": False,
                "error": f"timed out after {timeout} s",
                "seconds": round(time.monotonic() - started, 1),
            }
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


def run_part(name: str, smoke: bool, result_path: Path) -> int:
    started = time.perf_counter()
    result: dict[str, Any]
    try:
        result = {"ok": True, **PART_FUNCTIONS[name](smoke)}
    except CheckFailed as exc:
        result = {"ok": False, "error": str(exc), **exc.figures}
    except Exception as exc:  # a part's crash is its result, not the driver's
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    result["seconds"] = round(time.perf_counter() - started, 1)
    try:
        result["environment"] = environment()
    except Exception as exc:
        result["environment"] = {"error": repr(exc)}
    result_path.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


PART_FUNCTIONS = {
    "kernel_tests": part_kernel_tests,
    "hf_equivalence": part_hf_equivalence,
    "attention_bench": part_attention_bench,
    "throughput": part_throughput,
    "profile": part_profile,
}

if __name__ == "__main__":
    sys.exit(main())
