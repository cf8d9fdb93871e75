"""`--plot`: PNGs from the results' JSON form (matplotlib, Agg backend; imported only here).

    throughput_vs_concurrency.png   output tokens/s of the base stack against concurrency,
                                    per model, with the transformers baseline's point
    latency_<model>.png             TTFT and inter-token latency distributions of each arm
    gantt_<model>.png               a few seconds of per-stage execution: one bar per
                                    micro-batch on each stage, gaps are bubbles
    gantt_<model>.trace.json        the same steps as Chrome trace events (opens in Perfetto)

and `emulated_busy`, bench/emulated_table.py's `--plot`: each pipeline size's stages busy over
time, sync beside async.
"""

from __future__ import annotations

import json
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_vs_concurrency(results: dict, path: Path) -> Path | None:
    models = [m for m in results["models"] if _sweep(m)]
    if not models:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        xs, ys = zip(*_sweep(m), strict=True)
        ax.plot(xs, ys, marker="o", label="Pagoda full stack (closed loop)")
        for r in m["runs"]:
            if r["arm"] == "in-process":
                ax.scatter(
                    [r["concurrency"]],
                    [r["client"]["output_tokens_per_s"]],
                    marker="s",
                    s=40,
                    color="tab:green",
                    label="in-process engine",
                )
            if r["arm"] == "transformers":
                ax.scatter(
                    [r["concurrency"]],
                    [r["client"]["output_tokens_per_s"]],
                    marker="x",
                    s=60,
                    color="tab:red",
                    label="transformers static batches",
                )
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrency / batch size")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{m['preset']}: throughput against concurrency (mixed)", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sweep(model: dict) -> list[tuple[int, float]]:
    return sorted(
        (r["concurrency"], r["client"]["output_tokens_per_s"])
        for r in model["runs"]
        if r["workload"] == "mixed" and r["arm"] == "pagoda" and r["mode"] == "closed"
    )


def latency_distributions(model: dict, path: Path) -> Path | None:
    runs = [
        r
        for r in model["runs"]
        if r["mode"] in ("closed", "static-batch") and not r["extra"].get("sweep") and r["extra"].get("quantiles")
    ]
    if not runs:
        return None
    plt = _plt()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        for r in runs:
            q = r["extra"]["quantiles"].get(key)
            if not q:
                continue
            ys = [i / (len(q) - 1) for i in range(len(q))]
            ax.plot(q, ys, label=f"{r['workload']}/{r['arm']}")
        ax.set_xscale("log")
        # plain numbers at 1, 2 and 5 of each decade: labelled minor ticks ("2x10^1") ran into
        # each other
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_title(f"{model['preset']}: {title}")
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gantt_window(events: list[dict], window_s: float) -> tuple[list[dict], int, int]:
    """The events overlapping the middle `window_s` of the span they cover, and the window."""
    if not events:
        return [], 0, 0
    t0 = min(e["start_ns"] for e in events)
    t1 = max(e["end_ns"] for e in events)
    mid = (t0 + t1) // 2
    half = int(window_s * 1e9 / 2)
    lo, hi = max(t0, mid - half), min(t1, mid + half)
    return [e for e in events if e["end_ns"] > lo and e["start_ns"] < hi], lo, hi


def _stage_bars(ax, events: list[dict], lo: int, hi: int, stages: list[int], label_ids: bool) -> None:
    """One bar per micro-batch's compute on each stage between `lo` and `hi` (ns), colour =
    micro-batch, the stage's busy share of the window beside it."""
    cmap = _plt().get_cmap("tab20")
    width_ms = (hi - lo) / 1e6
    for s in stages:
        mine = [e for e in events if e["stage"] == s]
        bars = [
            ((max(e["start_ns"], lo) - lo) / 1e6, (min(e["end_ns"], hi) - max(e["start_ns"], lo)) / 1e6) for e in mine
        ]
        ax.broken_barh(
            bars,
            (s - 0.4, 0.8),
            facecolors=[cmap(e["micro_batch_id"] % 20) for e in mine],
            edgecolor="black",
            linewidth=0.2,
        )
        busy = sum(w for _, w in bars) / width_ms if width_ms > 0 else 0
        ax.text(width_ms * 1.005, s, f"busy {busy:.0%}", va="center", fontsize=8)
        if label_ids:
            for e, (x, w) in zip(mine, bars, strict=True):
                if w > width_ms / 60:
                    ax.text(x + w / 2, s, str(e["micro_batch_id"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, width_ms * 1.1)


def gantt(model: dict, path: Path, window_s: float = 2.0, zoom_s: float = 0.25) -> Path | None:
    """Two panels: `window_s` of execution, and the middle `zoom_s` of it up close."""
    g = model.get("gantt")
    if not g or not g.get("events"):
        return None
    plt = _plt()
    stages = sorted({e["stage"] for e in g["events"]})
    fig, axes = plt.subplots(2, 1, figsize=(13, 2.4 + 1.8 * len(stages)))
    for ax, span in zip(axes, (window_s, zoom_s), strict=True):
        events, lo, hi = gantt_window(g["events"], span)
        _stage_bars(ax, events, lo, hi, stages, label_ids=span == zoom_s)
        ax.set_title(
            f"{(hi - lo) / 1e9:.2f} s" + (" (zoom: micro-batch ids on the bars)" if span == zoom_s else ""), fontsize=9
        )
    axes[1].set_xlabel("ms (one bar: one micro-batch's compute on a stage, colour = micro-batch; gaps: bubbles)")
    fig.suptitle(f"{model['preset']}: per-stage execution under mixed load ({g['settings']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def emulated_busy(results: dict, path: Path, window_s: float = 0.25, load: str = "mixed") -> Path | None:
    """bench/emulated_table.py's cells: for each pipeline size a row, sync on the left and async
    on the right, each stage's compute over the middle `window_s` of the loaded window of `load`
    (the bubbles are the gaps)."""
    cells = sorted(((int(pp), modes) for pp, modes in results["cells"].items()), key=lambda kv: kv[0])
    cells = [(pp, modes) for pp, modes in cells if any(modes.get(m, {}).get(load, {}).get("spans") for m in modes)]
    if not cells:
        return None
    plt = _plt()
    heights = [1.2 + 0.35 * pp for pp, _ in cells]
    fig, axes = plt.subplots(
        len(cells), 2, figsize=(15, sum(heights)), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for row, (pp, modes) in zip(axes, cells, strict=True):
        for ax, mode in zip(row, ("sync", "async"), strict=True):
            cell = modes.get(mode, {}).get(load)
            if not cell or not cell.get("spans"):
                ax.set_axis_off()
                continue
            spans = [
                {"stage": st, "micro_batch_id": mb, "start_ns": a, "end_ns": b} for st, mb, a, b, *_ in cell["spans"]
            ]
            events, lo, hi = gantt_window(spans, window_s)
            _stage_bars(ax, events, lo, hi, list(range(pp)), label_ids=False)
            ax.set_title(
                f"PP={pp} {mode}: {cell['output_tok_s']:.0f} tok/s, mean busy "
                f"{sum(cell['stage_busy']) / len(cell['stage_busy']):.0%} over the load",
                fontsize=9,
            )
    for ax in axes[-1]:
        ax.set_xlabel(
            f"ms ({window_s * 1000:.0f} ms from the middle of the {load} load; a bar: one micro-batch's "
            "compute on a stage; gaps: bubbles)",
            fontsize=8,
        )
    fig.suptitle(
        f"Stages busy over time, {results['meta']['device']} ({results['meta']['layers']} layers, "
        f"{results['meta']['concurrency']} clients)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def gantt_trace(model: dict, path: Path) -> Path | None:
    """The Gantt run's stage steps as Chrome trace-event JSON (pid 1, one tid per stage)."""
    g = model.get("gantt")
    if not g or not g.get("events"):
        return None
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"{model['preset']} stages"}}]
    for s in sorted({e["stage"] for e in g["events"]}):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": s, "args": {"name": f"stage {s}"}})
    for e in g["events"]:
        events.append(
            {
                "name": f"micro-batch {e['micro_batch_id']}",
                "cat": "stage",
                "ph": "X",
                "pid": 1,
                "tid": e["stage"],
                "ts": e["start_ns"] / 1000,
                "dur": (e["end_ns"] - e["start_ns"]) / 1000,
                "args": {"micro_batch_id": e["micro_batch_id"]},
            }
        )
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [throughput_vs_concurrency(results, out_dir / "throughput_vs_concurrency.png")]
    for m in results["models"]:
        paths.append(latency_distributions(m, out_dir / f"latency_{m['preset']}.png"))
        paths.append(gantt(m, out_dir / f"gantt_{m['preset']}.png"))
        paths.append(gantt_trace(m, out_dir / f"gantt_{m['preset']}.trace.json"))
    return [p for p in paths if p is not None]
