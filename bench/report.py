"""Results as JSON and as Markdown tables. Rendering reads the JSON form only, so a saved
`results.json` can be rendered again (`pagoda bench --render results.json`)."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from bench.machine import cpu_model, cpu_record


def machine_info() -> dict:
    """The machine a run was made on: CPU, usable cores, memory, versions, load average."""
    cpu = cpu_model(platform.processor() or platform.machine())
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    info = {
        "cpu": cpu,
        "cpu_features": cpu_record(),
        "usable_cores": cores,
        "memory_gib": mem_gib,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=False, default=str) + "\n")


# --- Markdown ----------------------------------------------------------------------------------


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pcts(s: dict | None) -> str:
    if not s or not s.get("count"):
        return "-"
    return " / ".join(_f(s.get(k)) for k in ("p50_ms", "p90_ms", "p99_ms"))


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def comparison_rows(results: dict) -> list[str]:
    rows = [
        "| model | comparison | workload | metric | arm | baseline | ratio | tok/s ratio | checks |",
        "|---|---|---|---|---|---|---:|---:|---|",
    ]
    for m in results["models"]:
        for c in m["comparisons"]:
            metric = c["metric"].replace("_", " ")
            vals = f"{_f(c['value_arm'])} / {_f(c['value_baseline'])}"
            failed = [k["what"] for k in c["checks"] if not k["ok"]]
            checks = "all pass" if not failed else "FAILED: " + "; ".join(failed)
            rows.append(
                f"| {m['preset']} | ({c['key']}) {c['title']} | {c['workload']} | {metric} ({vals}) "
                f"| {c['arm']} | {c['baseline']} | **{_ratio(c['ratio'])}** "
                f"| {_ratio(c['throughput_ratio'])} | {checks} |"
            )
    return rows


def _stages(services: dict | None) -> tuple[str, str]:
    if not services or not services.get("stages"):
        return "-", "-"
    busy = " / ".join(f"{s['busy_fraction']:.0%}" for s in services["stages"])
    bubble = " / ".join(f"{s['bubble_fraction']:.0%}" for s in services["stages"])
    return busy, bubble


def run_rows(results: dict) -> list[str]:
    rows = [
        "| run | device | load | req | req/s | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
        "| stage busy | bubble | tok/µbatch | KV frag int / ext | prefix hit | preempt | other CPU |",
        "|---|---|---|---:|---:|---:|---|---|---|---|---:|---|---:|---:|---:|",
    ]
    for m in results["models"]:
        for r in m["runs"]:
            c, s = r["client"], r["services"]
            load = (
                f"closed, C={r['concurrency']}"
                if r["mode"] == "closed"
                else f"Poisson {r['rate']:.2f}/s"
                if r["mode"] == "open"
                else f"static batches of {r['concurrency']}"
            )
            busy, bubble = _stages(s)
            frag = f"{s['kv_internal_fragmentation']:.0%} / {s['kv_external_fragmentation']:.0%}" if s else "-"
            hit = f"{s['prefix_hit_rate']:.0%}" if s else "-"
            pre = str(s["num_preemptions"]) if s else "-"
            other = r["extra"].get("foreign_cpu")
            per_mb = _f(s.get("tokens_per_micro_batch")) if s else "-"
            # an emulated run says so in every row: its compute is a modelled wait, not a measurement
            device = r["extra"].get("device", "-")
            rows.append(
                f"| {r['name']} | {device} | {load} | {c['num_requests']} | {_f(c['requests_per_s'], '{:.2f}')} "
                f"| {_f(c['output_tokens_per_s'])} | {_pcts(c['ttft'])} | {_pcts(c['itl'])} "
                f"| {busy} | {bubble} | {per_mb} | {frag} | {hit} | {pre} | {_f(other, '{:.0%}')} |"
            )
    return rows


def check_lines(results: dict) -> list[str]:
    out = []
    for m in results["models"]:
        for c in m["comparisons"]:
            out.append(f"- **{m['preset']} ({c['key']}) {c['title']}**" + (f" — {c['note']}" if c.get("note") else ""))
            for k in c["checks"]:
                out.append(f"  - {'ok' if k['ok'] else 'FAILED'}: {k['what']}: {k['detail']}")
        for note in m.get("notes", ()):
            out.append(f"- {m['preset']}: {note}")
    return out


def render_markdown(results: dict, plot_paths: list[str] | None = None) -> str:
    meta = results["meta"]
    mach = meta["machine"]
    lines = [
        "# pagoda bench",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {mach['cpu']}, {mach['usable_cores']} usable core(s), {mach.get('memory_gib')} GiB; "
        f"Python {mach['python']}, torch {mach.get('torch', '-')}; load average "
        f"{meta.get('load_average_start')} at start, {meta.get('load_average_end')} at end.  ",
        f"Started {meta['started']}, took {meta['elapsed_s']:.0f} s. Load driver: {meta['driver_note']}.  ",
        f"Torch threads: {meta['total_threads']} in all for every arm (PP=1: 1 stage x "
        f"{meta['total_threads']}; PP=2: 2 stages x {meta['total_threads'] // 2 or 1}; the in-process "
        f"engine and transformers: {meta['total_threads']} in the bench process).",
        "",
    ]
    for note in meta.get("notes", ()):
        lines.append(f"- {note}")
    lines += ["", "## Comparisons (ratio = arm / baseline)", ""] + comparison_rows(results)
    lines += [
        "",
        "## Runs",
        "",
        "Stage busy and bubble per stage, over the window from the start of "
        "the run to its last request sent (work queued throughout); KV fragmentation under load "
        "then; prefix hit = hit tokens / looked-up tokens over the run; tok/µbatch = tokens computed per "
        "micro-batch; other CPU = the share of the "
        "machine's cores that processes other than this run's used during it (a shared machine).",
        "",
    ] + run_rows(results)
    lines += ["", "## What each comparison read back", ""] + check_lines(results)
    if plot_paths:
        lines += ["", "## Plots", ""] + [f"- `{p}`" for p in plot_paths]
    return "\n".join(lines) + "\n"
