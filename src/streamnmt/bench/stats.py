"""Medians, spreads, the "within noise" rule, and the summary table of a benchmark.

Each row runs R times, interleaved with the other rows, so slow drifts (clocks, other load) hit
every row alike. A row is summarised by the median of its runs and their spread, the range
(min-max): with 3 to 5 runs an inter-quartile range would be no more informative. Two rows
differ only when their medians are further apart than the larger of their two ranges; a smaller
difference is printed as "within noise", and with a single run every difference counts.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NOISE = "within noise"


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float

    @property
    def range(self) -> float:
        return self.hi - self.lo


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("spread of no values")
    return Spread(statistics.median(values), min(values), max(values))


def within_noise(a: Sequence[float], b: Sequence[float]) -> bool:
    """True when the medians of ``a`` and ``b`` differ by less than the larger of their ranges."""
    sa, sb = spread(a), spread(b)
    return abs(sa.median - sb.median) < max(sa.range, sb.range)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def limit_of(name: str, names: Sequence[str]) -> str | None:
    """The reference row that is the limit of ``name``'s mode (graph rows: resident-graph)."""
    if name in ("graph", "resident-graph") and "resident-graph" in names:
        return "resident-graph"
    return "resident" if "resident" in names else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One summary row per entry of ``runs`` ({row name: per-repeat results}), in order."""
    names = list(runs)
    ms = {name: [r["ms_per_step"] for r in rs] for name, rs in runs.items()}
    rows = []
    for name, rs in runs.items():
        s = spread(ms[name])
        world = rs[0].get("world", 1)  # processes that ran it (runs merged across ranks: scaling.merge_ranks)
        tokens_per_s = _median(rs, "tokens_per_s")  # all ranks' tokens / the slowest rank's time
        row: dict[str, Any] = {
            "name": name, "repeats": len(rs), "ms_per_step": s.median, "ms_min": s.lo, "ms_max": s.hi,
            "world": world, "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": None if tokens_per_s is None else tokens_per_s / world, "padded_tokens_per_s": _median(rs, "padded_tokens_per_s"),
            "mfu_pct": _median(rs, "mfu_pct"), "real_share_pct": _median(rs, "real_share_pct"),
            "gpu_busy_pct": _median(rs, "gpu_busy_pct"), "nvml_util_pct": _median(rs, "nvml_util_pct"),
            "cpu_pct": _median(rs, "cpu_pct"), "workers_cpu_pct": _median(rs, "workers_cpu_pct"),
            "cpu_util_pct": _median(rs, "cpu_util_pct"),
            "sync_count": _median(rs, "sync_count"), "sync_ms": _median(rs, "sync_ms"),
            "peak_mem_mb": max((r["peak_mem_mb"] for r in rs if r.get("peak_mem_mb") is not None), default=None),
        }
        for key, ref in (("speedup", "baseline" if "baseline" in names else None),
                         ("pct_of_limit", limit_of(name, names))):
            if ref is None:
                row[key], row[key + "_ref"], row[key + "_noise"] = None, None, None
                continue
            ratio = spread(ms[ref]).median / s.median
            row[key] = ratio if key == "speedup" else 100 * ratio
            row[key + "_ref"] = ref
            row[key + "_noise"] = ref != name and within_noise(ms[name], ms[ref])
        rows.append(row)
    return rows


def _num(v: float | None, fmt: str, suffix: str = "") -> str:
    return "n/a" if v is None else format(v, fmt) + suffix


def _compare(row: dict[str, Any], key: str, fmt: str, suffix: str) -> str:
    if row[key] is None:
        return "n/a"
    if row[key + "_ref"] == row["name"]:
        return "-"
    return NOISE if row[key + "_noise"] else format(row[key], fmt) + suffix


COLUMNS = ["row", "ms/step [min-max]", "real tok/s", "padded tok/s", "real %", "vs baseline", "% of limit", "MFU",
           "GPU span", "GPU kernels", "NVML util", "CPU", "CPU+workers", "syncs", "sync ms", "peak MB"]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The console table (printed last by ``streamnmt bench``); on several processes with a per-GPU column."""
    several = any(r.get("world", 1) > 1 for r in rows)
    columns = COLUMNS[:3] + ["tok/s per GPU"] + COLUMNS[3:] if several else COLUMNS
    cells = [columns]
    for r in rows:
        per_gpu = [_num(r.get("tokens_per_s_per_gpu"), ",.0f")] if several else []
        cells.append([
            r["name"], f"{r['ms_per_step']:.2f} [{r['ms_min']:.2f}-{r['ms_max']:.2f}]",
            _num(r["tokens_per_s"], ",.0f"), *per_gpu, _num(r.get("padded_tokens_per_s"), ",.0f"),
            _num(r.get("real_share_pct"), ".1f", "%"),
            _compare(r, "speedup", ".2f", "x"),
            _compare(r, "pct_of_limit", ".0f", "%"), _num(r["mfu_pct"], ".1f", "%"),
            _num(r["gpu_busy_pct"], ".0f", "%"), _num(r.get("kernel_busy_pct"), ".0f", "%"),
            _num(r["nvml_util_pct"], ".0f", "%"),
            _num(r["cpu_pct"], ".0f", "%"), _num(r.get("cpu_util_pct"), ".0f", "%"), _num(r["sync_count"], ".0f"), _num(r["sync_ms"], ".1f"),
            _num(r["peak_mem_mb"], ",.0f")])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


CSV_FIELDS = ["name", "world", "repeats", "ms_per_step", "ms_min", "ms_max", "tokens_per_s", "tokens_per_s_per_gpu",
              "padded_tokens_per_s", "real_share_pct", "speedup", "speedup_noise",
              "pct_of_limit", "pct_of_limit_ref", "pct_of_limit_noise", "mfu_pct", "gpu_busy_pct",
              "kernel_busy_pct", "nvml_util_pct", "cpu_pct", "workers_cpu_pct", "cpu_util_pct", "sync_count", "sync_ms", "peak_mem_mb", "note"]
