"""How much of the machine something else used during a run (Linux `/proc`; None elsewhere).

The benchmark machines are shared: another process busy on one of two cores slows an arm, and
a torch op with two threads waits at its barrier for a thread that is not running. So each run
records the CPU time the whole machine spent busy and the part of it that this run's own
processes (the bench process, the services it started, all their threads) spent; the rest,
as a share of the cores over the run, is `foreign_cpu`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass


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
    fields = text[text.rindex(")") + 2:].split()
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
