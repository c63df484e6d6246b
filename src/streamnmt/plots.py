"""Pictures of runs and benchmarks: per-epoch results, strategy bars, kernel timelines.

Numbers in CSV files are exact but a curve or a bar chart shows at a glance whether training
converged and which strategy is faster by more than the noise. Each function reads plain data
(a CSV path, rows of dicts, lists of intervals), writes one PNG atomically and returns its path.
Drawing uses matplotlib's object API with the Agg renderer (no display, no pyplot global state),
so it works on a headless server and from threads.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from streamnmt.fsutil import atomic_path


def _figure(width: float, height: float, rows: int = 1, cols: int = 1, **kw: Any):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes


def _save(fig: Any, path: Path, dpi: int = 120) -> Path:
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path


def _floats(rows: list[dict[str, str]], key: str) -> list[float | None]:
    out: list[float | None] = []
    for r in rows:
        v = (r.get(key) or "").strip()
        try:
            out.append(float(v) if v else None)
        except ValueError:
            out.append(None)
    return out


def _line(ax: Any, x: list[float], y: list[float | None], label: str, **kw: Any) -> bool:
    pts = [(a, b) for a, b in zip(x, y) if b is not None]
    if not pts:
        return False
    ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=label, **kw)
    return True


def plot_results(run_dir: str | Path) -> Path:
    """Draw ``run_dir/results.png`` from ``run_dir/results.csv``: losses, BLEU, throughput per epoch.

    Columns used: ``epoch``, ``train_loss``, ``val_loss``, ``bleu`` (may be empty),
    ``tokens_per_s`` and, if present, ``gpu_busy`` (%, on a second axis).
    """
    run_dir = Path(run_dir)
    with open(run_dir / "results.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{run_dir / 'results.csv'}: no rows to plot")
    epochs = [float(e) if e is not None else float(i + 1)
              for i, e in enumerate(_floats(rows, "epoch"))]
    fig, axes = _figure(12, 3.6, 1, 3)
    ax = axes[0][0]
    _line(ax, epochs, _floats(rows, "train_loss"), "train")
    _line(ax, epochs, _floats(rows, "val_loss"), "validation")
    ax.set(title="loss", xlabel="epoch")
    ax.legend()
    ax = axes[0][1]
    if not _line(ax, epochs, _floats(rows, "bleu"), "BLEU", color="tab:green"):
        ax.text(0.5, 0.5, "no BLEU recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="BLEU", xlabel="epoch")
    ax = axes[0][2]
    _line(ax, epochs, _floats(rows, "tokens_per_s"), "tokens/s", color="tab:purple")
    ax.set(title="throughput", xlabel="epoch", ylabel="target tokens/s")
    busy = _floats(rows, "gpu_busy") if "gpu_busy" in rows[0] else []
    if any(v is not None for v in busy):
        twin = ax.twinx()
        _line(twin, epochs, busy, "GPU busy %", color="tab:orange", linestyle="--")
        twin.set(ylabel="GPU busy %", ylim=(0, 105))
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="lower right")
    for a in axes[0]:
        a.grid(alpha=0.3)
    return _save(fig, run_dir / "results.png")


def plot_bench(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Bars of median ms/step per row with min-max whiskers (rows: name, ms_per_step, ms_min, ms_max)."""
    names = [r["name"] for r in rows]
    med = [r["ms_per_step"] for r in rows]
    lo = [m - r["ms_min"] for m, r in zip(med, rows)]
    hi = [r["ms_max"] - m for m, r in zip(med, rows)]
    refs = {"plain", "resident", "resident-graph"}
    colors = ["tab:gray" if n in refs else "tab:blue" for n in names]
    fig, axes = _figure(max(6.0, 0.9 * len(rows) + 2), 4.2)
    ax = axes[0][0]
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color=colors)
    for i, (m, r) in enumerate(zip(med, rows)):
        ax.annotate(f"{m:.1f}", (i, r["ms_max"]), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.set(ylabel="ms per step (median, whiskers min-max)", title=title or "ms per training step")
    ax.tick_params(axis="x", labelrotation=30)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, Path(path))


CATEGORY_COLORS = {"forward": "tab:blue", "backward": "tab:red", "optimizer": "tab:green",
                   "graph replay": "tab:purple", "copy HtoD": "tab:orange", "copy DtoH": "tab:brown",
                   "copy DtoD": "tab:olive", "memset": "tab:pink", "other": "tab:gray"}


def plot_timeline(timelines: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Kernels per CUDA stream over time, one panel per row.

    ``timelines[name]`` holds ``ops``: (stream, start ms, duration ms, category) and ``syncs``:
    (start ms, duration ms) of host waits, both relative to the profiled window's start, and
    optionally ``labels``: {stream: lane name} (default "stream N").
    """
    from matplotlib.patches import Patch

    names = [n for n, t in timelines.items() if t.get("ops")]
    if not names:
        raise ValueError("no GPU kernels to draw (the timeline needs a CUDA run)")
    heights = [len({o[0] for o in timelines[n]["ops"]}) + 1 for n in names]
    fig, axes = _figure(14, 0.45 * sum(heights) + 0.9 * len(names) + 0.6, len(names), 1,
                        gridspec_kw={"height_ratios": heights})
    seen: set[str] = set()
    for ax, name in zip((a[0] for a in axes), names):
        ops, syncs = timelines[name]["ops"], timelines[name].get("syncs", [])
        streams = sorted({o[0] for o in ops})
        lanes = {s: i + 1 for i, s in enumerate(streams)}
        by_lane_cat: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for stream, start, dur, cat in ops:
            by_lane_cat.setdefault((lanes[stream], cat), []).append((start, max(dur, 1e-3)))
        for (lane, cat), spans in by_lane_cat.items():
            ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=CATEGORY_COLORS.get(cat, "black"), linewidth=0)
            seen.add(cat)
        if syncs:
            ax.broken_barh([(s, max(d, 1e-3)) for s, d in syncs], (-0.4, 0.8), facecolors="black", linewidth=0)
        labels = timelines[name].get("labels", {})
        ax.set_yticks([0] + [lanes[s] for s in streams],
                      ["host waits"] + [labels.get(s, f"stream {s}") for s in streams])
        ax.set_ylim(-0.7, len(streams) + 0.7)
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1][0].set_xlabel("ms from the start of the profiled steps")
    handles = [Patch(color=CATEGORY_COLORS.get(c, "black"), label=c) for c in CATEGORY_COLORS if c in seen]
    handles.append(Patch(color="black", label="host sync"))
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 10), fontsize=8)
    return _save(fig, Path(path))
