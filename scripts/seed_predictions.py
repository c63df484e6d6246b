"""The seed documents' predictions beside one ``streamnmt bench`` run's measurements.

Usage: python scripts/seed_predictions.py BENCH_DIR [--streams3 DIR] [--timeline deep] [--steps-shown 3]

BENCH_DIR is a ``streamnmt bench --profile`` output directory (bench.json, trace_<row>.json).
Prints two markdown tables (measurements per strategy; each prediction with the figure measured
and met / not met by the rule stated in its row) and, from the trace of the ``--timeline`` row,
draws ``timeline_<row>.png`` over the first ``--steps-shown`` profiled steps (the copies on their
streams over the compute). ``--streams3``: a second bench directory with the deep and full rows run
with ``--streams 3``; its rows are added as ``deep/3``, ``full/3``.

The predictions (shared/seeds 000 section 9.3, 001 sections 2.4.5 and 4.3, 003 section 3.3) are
estimates written before anything was measured; this script only reads what the bench measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

STAGE1, STAGE2 = ("event", "interval"), ("deep", "full", "deep/3", "full/3")


def load(path: Path, suffix: str = "") -> tuple[dict, dict[str, dict]]:
    record = json.loads((path / "bench.json").read_text())
    rows = {r["name"] + suffix: r for r in record["summary"]}
    return record, rows


def base_of(rows: dict[str, dict], name: str) -> dict:
    """The baseline a row is compared with: the one of its own bench run."""
    return rows.get("baseline/3", rows["baseline"]) if name.endswith("/3") else rows["baseline"]


def measurements(rows: dict[str, dict], steps: int) -> str:
    head = ("| strategy | ms/step [min-max] | vs baseline | syncs / 100 steps | host wait ms / batch | CPU % "
            "(process) | CPU % (+ workers) | GPU kernels % | NVML util % | peak MB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows.items():
        base = base_of(rows, name)
        change = "-" if r is base else f"{100 * (r['ms_per_step'] / base['ms_per_step'] - 1):+.1f} %"
        if r is not base and r.get("speedup_noise"):
            change += " (within noise)"
        lines.append(
            f"| {name} | {r['ms_per_step']:.2f} [{r['ms_min']:.2f}-{r['ms_max']:.2f}] | {change} | "
            f"{100 * r['sync_count'] / steps:.0f} | {r['sync_ms'] / steps:.3f} | {_f(r.get('cpu_pct'))} | "
            f"{_f(r.get('cpu_util_pct'))} | {_f(r.get('kernel_busy_pct'))} | {_f(r.get('nvml_util_pct'))} | "
            f"{_f(r.get('peak_mem_mb'), ',.0f')} |")
    return "\n".join(lines)


def _at_least(v: float | None, floor: float) -> bool | None:
    return None if v is None else v >= floor


def _f(v, fmt: str = ".0f") -> str:
    return "n/a" if v is None else format(v, fmt)


def predictions(rows: dict[str, dict], steps: int) -> str:
    out = ["| prediction (seed) | strategy | measured | met? (rule) |", "|---|---|---|---|"]

    def add(pred: str, names, measured, met, rule: str) -> None:
        for name in names:
            if name in rows:
                r, b = rows[name], base_of(rows, name)
                ok = met(r, b)
                verdict = "n/a" if ok is None else "met" if ok else "not met"
                out.append(f"| {pred} | {name} | {measured(r, b)} | {verdict} ({rule}) |")

    def cut(r, b):
        return 1 - r["sync_count"] / max(b["sync_count"], 1)

    def wait(r):
        return r["sync_ms"] / steps

    def faster(r, b):
        return 1 - r["ms_per_step"] / b["ms_per_step"]

    def ratio(r, b):
        return (r.get("peak_mem_mb") or 0) / (b.get("peak_mem_mb") or 1)

    add("host syncs -90 % (N -> N/10)", [*STAGE1, *STAGE2, "graph"],
        lambda r, b: f"{100 * r['sync_count'] / steps:.0f} / 100 steps ({-100 * cut(r, b):+.0f} %)",
        lambda r, b: None if not b["sync_count"] else cut(r, b) >= 0.9, "at least -90 %")
    add("CPU wait per batch 20-30 ms -> 2-3 ms", [*STAGE1, *STAGE2, "graph"],
        lambda r, b: f"{wait(r):.2f} ms (baseline {wait(b):.2f} ms)",
        lambda r, b: None if not b["sync_count"] else wait(r) <= 0.1 * wait(b), "at most 10 % of baseline's")
    add("CPU utilisation 60-70 % -> 80-85 % (stage 1)", STAGE1,
        lambda r, b: f"{_f(r.get('cpu_pct'))} % (baseline {_f(b.get('cpu_pct'))} %)",
        lambda r, b: _at_least(r.get("cpu_pct"), 80), ">= 80 % of one core")
    add("CPU utilisation -> 85-90 % (stage 2)", [*STAGE2, "graph"],
        lambda r, b: f"{_f(r.get('cpu_pct'))} % (baseline {_f(b.get('cpu_pct'))} %)",
        lambda r, b: _at_least(r.get("cpu_pct"), 85), ">= 85 % of one core")
    add("GPU utilisation 70-80 % -> 90-95 % (stage 2; 85-90 % with 3 streams)", [*STAGE2, "graph"],
        lambda r, b: f"kernels {_f(r.get('kernel_busy_pct'))} %, NVML {_f(r.get('nvml_util_pct'))} % "
                     f"(baseline {_f(b.get('kernel_busy_pct'))} %)",
        lambda r, b: _at_least(r.get("kernel_busy_pct"), 85 if r["name"].endswith("/3") else 90),
        "GPU kernels >= 90 % (3 streams: 85 %)")
    add("training time -3-5 % (stage 1)", STAGE1, lambda r, b: f"{-100 * faster(r, b):+.1f} %",
        lambda r, b: faster(r, b) >= 0.03 and not r.get("speedup_noise"), "at least -3 %, outside noise")
    add("training time -10-15 % (stage 2)", [*STAGE2, "graph"], lambda r, b: f"{-100 * faster(r, b):+.1f} %",
        lambda r, b: faster(r, b) >= 0.10 and not r.get("speedup_noise"), "at least -10 %, outside noise")
    add("memory x2-3 (4 streams, a cost)", STAGE2,
        lambda r, b: f"x{ratio(r, b):.2f} of baseline's peak",
        lambda r, b: None if not b.get("peak_mem_mb") or r.get("peak_mem_mb") is None else 2 <= ratio(r, b) <= 3,
        "between x2 and x3")
    return "\n".join(out)


def timeline(bench_dir: Path, row: str, steps_shown: int, ms_per_step: float) -> Path | None:
    from streamnmt.bench.profile import analyze_trace, load_trace
    from streamnmt.training.plots import plot_timeline

    trace = bench_dir / f"trace_{row}.json"
    if not trace.is_file():
        return None
    summary = analyze_trace(load_trace(trace))
    if summary is None or not summary.ops:
        return None
    limit = steps_shown * ms_per_step * 2  # the profiler slows the host about 2x
    ops = [o for o in summary.ops if o[1] <= limit]
    syncs = [s for s in summary.syncs if s[0] <= limit]
    return plot_timeline({f"{row}: first {steps_shown} profiled steps": {"ops": ops, "syncs": syncs}},
                         bench_dir / f"timeline_{row}.png")


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("bench_dir", type=Path)
    p.add_argument("--streams3", type=Path, default=None)
    p.add_argument("--timeline", default="deep")
    p.add_argument("--steps-shown", type=int, default=3)
    args = p.parse_args()
    record, rows = load(args.bench_dir)
    if args.streams3 is not None:
        rows.update({k: v for k, v in load(args.streams3, "/3")[1].items()
                     if k.split("/")[0] in ("baseline", "deep", "full")})
    steps = record["config"]["steps"]
    if "baseline" not in rows:
        print(f"{args.bench_dir}: no baseline row to compare with", file=sys.stderr)
        return 1
    git = record.get("git") or {}
    print(f"bench {args.bench_dir}: {record['date']}, commit {git.get('commit', '?')[:10]}"
          f"{' (dirty)' if git.get('dirty') else ''}, {record['device'].get('name')}, model {record['config']['model']}, "
          f"amp {record['config']['amp']}, batch {record['config']['batch_size']} x {record['config']['max_len']}, "
          f"{record['config']['repeats']} x {steps} steps; spread = [min-max] of the runs")
    if args.timeline in rows:
        png = timeline(args.bench_dir, args.timeline, args.steps_shown, rows[args.timeline]["ms_per_step"])
        print(f"timeline: {png}" if png else f"timeline: no GPU trace for {args.timeline}")
    print()
    print(measurements(rows, steps))
    print()
    print(predictions(rows, steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
