"""How much of the machine something else used during a run (Linux `/proc`; None elsewhere).

The benchmark machines are shared: another process busy on one of two cores slows an arm, and
a torch op with two threads waits at its barrier for a thread that is not running. So each run
records the CPU time the whole machine spent busy and the part of it that this run's own
processes (the bench process, the services it started, all their threads) spent; the rest,
as a share of the cores over the run, is `foreign_cpu`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model(default: str = "") -> str:
    """The CPU's model name (/proc/cpuinfo's first `model name`); `default` where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default


def cpu_record() -> dict[str, Any]:
    """The CPU a figure was measured on (issue 34: every figure names its machine): model,
    family/model numbers, the ISA level and flags that matter, and the caps that lowered
    them when a narrower CPU is emulated (worker_svc/kernels/cpu_features.py)."""
    from worker_svc.kernels.cpu_features import cpu_features

    f = cpu_features()
    return {
        "model_name": f.model_name,
        "family": f.family,
        "model": f.model,
        "level": f.level,
        "host_level": f.host_level,
        "caps": list(f.caps),
        "flags": list(f.isa_flags),
        "emulated": bool(f.caps),
        "describe": f.describe(),
    }


@dataclass(frozen=True)
class CpuSample:
    busy_ticks: int  # the whole machine, all cores
    own_ticks: int  # utime + stime of the given processes
    t_s: float


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle  # without guest time, which steal/user already count


def _process_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def cpu_sample(pids: Iterable[int]) -> CpuSample | None:
    import time

    try:
        return CpuSample(_machine_busy_ticks(), sum(_process_ticks(p) for p in set(pids)), time.monotonic())
    except (OSError, ValueError, IndexError):
        return None


def foreign_cpu(before: CpuSample | None, after: CpuSample | None, num_cores: int) -> float | None:
    """Cores' worth of CPU that other processes used between two samples, as a fraction of all
    cores (0 = nothing else ran, 0.5 = one of two cores was busy with something else)."""
    if before is None or after is None or after.t_s <= before.t_s or num_cores < 1:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    foreign_ticks = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    share = foreign_ticks / hz / ((after.t_s - before.t_s) * num_cores)
    return max(0.0, min(1.0, share))


BANDWIDTH_SCRIPT = r"""
import json, sys, time, torch
torch.set_num_threads(1)
mib = int(sys.argv[1])
x = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
x.sum()
times = []
for _ in range(7):
    t0 = time.perf_counter(); x.sum(); times.append(time.perf_counter() - t0)
nbytes = x.numel() * 4
print(json.dumps({"bytes": nbytes, "times_s": times, "best_gb_s": nbytes / min(times) / 1e9,
                  "median_gb_s": nbytes / sorted(times)[len(times) // 2] / 1e9}))
"""


def run_json(
    cmd: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
) -> dict[str, Any]:
    """Run a script that prints one JSON object as its last stdout line."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"exit {out.returncode}: {out.stderr[-1500:]}")
    lines = [line for line in out.stdout.splitlines() if line.strip().startswith("{")]
    if not lines:
        raise RuntimeError(f"no JSON on stdout: {out.stdout[-500:]} {out.stderr[-1000:]}")
    return json.loads(lines[-1])


def measure_bandwidth(mib: int = 512) -> dict[str, Any]:
    """One core's read bandwidth: a 1-thread torch sum over `mib` MiB of float32 (best of 7)."""
    return run_json([sys.executable, "-c", BANDWIDTH_SCRIPT, str(mib)], 300)
