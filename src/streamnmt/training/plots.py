"""Pictures of runs and benchmarks: training curves, strategy bars, kernel timelines.

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


def _read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _finite(x: list[float | None], y: list[float | None]) -> tuple[list[float], list[float]]:
    pts = [(a, b) for a, b in zip(x, y) if a is not None and b is not None and b == b and abs(b) != float("inf")]
    return [a for a, _ in pts], [b for _, b in pts]


def results_series(run_dir: str | Path) -> tuple[str, dict[str, tuple[list[float], list[float]]]]:
    """(x-axis name, curves of ``results.png`` as (x, y) lists), from the run's CSV files.

    ``train_loss``: per optimizer step (``steps.csv``); ``val_loss`` and ``bleu``: per evaluation
    on the same step axis (``evals.csv``); ``tokens_per_s`` and ``gpu_busy``: per epoch
    (``results.csv``). A run directory with only ``results.csv`` (older runs) gets its per-epoch
    losses and BLEU on the epoch axis instead (the x-axis name says which).
    """
    run_dir = Path(run_dir)
    results, steps, evals = (_read_rows(run_dir / f"{name}.csv") for name in ("results", "steps", "evals"))
    evals = [r for r in evals if not r.get("kind")]  # the end of the run's averaged row is no point of the curve
    if not (results or steps or evals):
        raise ValueError(f"{run_dir}: no results.csv, steps.csv or evals.csv rows to plot")
    epochs = [float(e) if e is not None else float(i + 1) for i, e in enumerate(_floats(results, "epoch"))]
    out: dict[str, tuple[list[float], list[float]]] = {}
    if steps or evals:
        out["train_loss"] = _finite(_floats(steps, "step"), _floats(steps, "loss"))
        out["val_loss"] = _finite(_floats(evals, "step"), _floats(evals, "val_loss"))
        out["bleu"] = _finite(_floats(evals, "step"), _floats(evals, "bleu"))
    else:  # per-epoch results only
        out["train_loss"] = _finite(epochs, _floats(results, "train_loss"))
        out["val_loss"] = _finite(epochs, _floats(results, "val_loss"))
        out["bleu"] = _finite(epochs, _floats(results, "bleu"))
    out["tokens_per_s"] = _finite(epochs, _floats(results, "tokens_per_s"))
    busy = results and "gpu_busy" in results[0]
    out["gpu_busy"] = _finite(epochs, _floats(results, "gpu_busy")) if busy else ([], [])
    return ("optimizer step" if steps or evals else "epoch"), out


def plot_results(run_dir: str | Path) -> Path:
    """Draw ``run_dir/results.png``: training loss per step with validation loss per evaluation,
    dev BLEU per evaluation (both on the step axis), and throughput per epoch (see
    :func:`results_series` for the files read)."""
    run_dir = Path(run_dir)
    x_label, series = results_series(run_dir)
    fig, axes = _figure(12, 3.6, 1, 3)
    ax = axes[0][0]
    x, y = series["train_loss"]
    if x:
        ax.plot(x, y, linewidth=0.8, alpha=0.8, label="train", marker="o" if len(x) < 30 else None)
    x, y = series["val_loss"]
    if x:
        ax.plot(x, y, marker="o", label="validation")
    ax.set(title="loss", xlabel=x_label)
    ax.legend()
    ax = axes[0][1]
    x, y = series["bleu"]
    if x:
        ax.plot(x, y, marker="o", color="tab:green", label="BLEU")
    else:
        ax.text(0.5, 0.5, "no BLEU recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="dev BLEU", xlabel=x_label)
    ax = axes[0][2]
    x, y = series["tokens_per_s"]
    ax.plot(x, y, marker="o", color="tab:purple", label="tokens/s")
    ax.set(title="throughput", xlabel="epoch", ylabel="target tokens/s")
    x, y = series["gpu_busy"]
    if x:
        twin = ax.twinx()
        twin.plot(x, y, marker="o", color="tab:orange", linestyle="--", label="GPU busy %")
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
                   "copy DtoD": "tab:olive", "memset": "tab:pink", "nccl all-reduce": "tab:cyan", "other": "tab:gray"}


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
