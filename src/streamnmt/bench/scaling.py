"""Multi-GPU scaling: the benchmark's rows on N processes, and how per-GPU throughput holds up.

``streamnmt bench --nproc N`` starts torchrun (``dist.run_torchrun``: torchrun's own entry point,
as ``train --nproc`` does) with N ranks of ``streamnmt bench``; each rank runs every row on its
shard with a DDP-wrapped model (``bench.main``), and after each timed run the ranks' results are
merged here (:func:`merge_ranks`): the run's time is the slowest rank's (a global step is done only
when every rank is), its tokens are every rank's. Weak scaling: ``--batch-size`` is per rank, so
N ranks train on N times the pairs per step.

``--nproc 1,2,4`` runs each world size in turn (each through torchrun, so that every size runs in
fresh processes alike), each into ``OUT/nprocN/`` (a complete benchmark directory), then writes
``OUT/bench.json``, ``bench.csv`` and ``bench.png`` with one line per row and world size and prints
the scaling table last:

* **tok/s** = all ranks' real target tokens / the slowest rank's wall time (median over repeats);
* **tok/s per GPU** = tok/s / N;
* **scaling** = per-GPU tok/s at N / per-GPU tok/s at the smallest world size listed (1 if listed),
  as a percentage: 100 % is perfect weak scaling. When the medians of the per-GPU throughputs
  differ by less than the larger of their min-max ranges (``stats.within_noise``, as the rest of
  the benchmark judges), it is marked "within noise".
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from streamnmt.bench.config import BenchConfig
from streamnmt.bench.provenance import git_commit
from streamnmt.bench.stats import NOISE, spread, within_noise
from streamnmt.configbase import check, flag_name, to_dict
from streamnmt.fsutil import atomic_write

Log = Callable[[str], None]

RANK_KEYS = ("wall_s", "ms_per_step", "tokens", "tokens_per_s", "gpu_busy_pct", "cpu_pct", "sync_count", "sync_ms",
             "peak_mem_mb")


def merge_ranks(results: list[dict[str, Any]], peak_flops: float | None) -> dict[str, Any]:
    """One timed run as seen by all ranks (``results`` in rank order): the slowest rank's wall time,
    the sum of the ranks' tokens and FLOPs; GPU span, NVML, CPU and syncs are rank 0's (every rank's
    are under ``ranks``); peak memory is the largest rank's."""
    n = len(results)
    slow = max(range(n), key=lambda i: results[i]["wall_s"])
    wall, steps = results[slow]["wall_s"], results[0]["steps"]
    tokens = sum(r["tokens"] for r in results)
    padded = sum(r["padded_tokens_per_s"] * r["wall_s"] for r in results)
    tflop = sum(r["model_tflops"] * r["wall_s"] for r in results)  # TFLOP done by all ranks
    mems = [r["peak_mem_mb"] for r in results if r.get("peak_mem_mb") is not None]
    return {**results[0], "wall_s": wall, "ms_per_step": 1e3 * wall / steps, "tokens": tokens,
            "tokens_per_s": tokens / wall, "padded_tokens_per_s": padded / wall, "model_tflops": tflop / wall,
            "mfu_pct": 100 * tflop * 1e12 / wall / (n * peak_flops) if peak_flops else None,
            "peak_mem_mb": max(mems) if mems else None, "world": n, "slowest_rank": slow,
            "ranks": [{"rank": i, **{k: r.get(k) for k in RANK_KEYS}} for i, r in enumerate(results)]}


# -- the launcher ---------------------------------------------------------------------------------
def config_argv(cfg: BenchConfig) -> list[str]:
    """``cfg`` as ``streamnmt bench`` flags (every field that has a value), for the ranks."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None or not f.metadata.get("cli", True):
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        else:
            argv += [flag_name(f.name), str(value)]
    return argv


def check_world_sizes(cfg: BenchConfig, sizes: list[int]) -> None:
    """Refuse a set-up torchrun could not run (exit 2, before anything is written)."""
    import torch

    check(int(os.environ.get("WORLD_SIZE", "1")) <= 1, "nproc", "this process already runs under torchrun; "
                                                                "drop --nproc")
    cuda = cfg.device.startswith("cuda") if cfg.device else torch.cuda.is_available()
    check(cfg.dist_backend != "nccl" or cuda, "dist_backend", "nccl needs CUDA devices but the bench runs on the "
                                                             "CPU; use --dist-backend gloo or auto")
    if cuda:
        have = torch.cuda.device_count()
        check(max(sizes) <= have, "nproc", f"{max(sizes)} processes but only {have} CUDA device(s); one GPU per "
                                           f"process: use --nproc {have} or fewer")


def run_world(cfg: BenchConfig, n: int, out: Path) -> int:
    """The benchmark on ``n`` processes through torchrun, written to ``out``; the exit code.

    Each rank runs with one intra-op thread unless OMP_NUM_THREADS says otherwise: torchrun's own
    default for several processes, applied to one process too, so that every world size runs alike."""
    from streamnmt import dist

    argv = config_argv(dataclasses.replace(cfg, nproc=None, out=str(out)))
    unset = "OMP_NUM_THREADS" not in os.environ
    if unset:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return dist.run_torchrun(n, ["-m", "streamnmt", "bench", *argv])
    finally:
        if unset:
            del os.environ["OMP_NUM_THREADS"]


def run_sizes(cfg: BenchConfig, sizes: list[int], log: Log = print) -> int:
    """``--nproc N`` or ``--nproc 1,2,4``: see the module docstring."""
    from streamnmt.training.runs import increment_path

    check_world_sizes(cfg, sizes)
    out = Path(cfg.out) if cfg.out else increment_path("runs/bench", "exp")
    if len(sizes) == 1:
        return run_world(cfg, sizes[0], out)
    records = {}
    for n in sizes:
        log(f"bench: --nproc {n} of {','.join(map(str, sizes))}: {out / f'nproc{n}'}")
        code = run_world(cfg, n, out / f"nproc{n}")
        if code != 0 or not (out / f"nproc{n}" / "bench.json").is_file():  # failed, or stopped by a signal
            log(f"bench: --nproc {n} did not finish; no scaling summary written")
            return code or 130
        records[n] = json.loads((out / f"nproc{n}" / "bench.json").read_text())
    rows = scaling_rows(records)
    write_scaling(cfg, records, rows, out)
    log(f"bench: wrote bench.json, bench.csv, bench.png to {out} (each world size in {out}/nprocN/)")
    log(format_scaling(rows) + "\n" + scaling_footnotes(records, rows))
    return 0


# -- the scaling summary ------------------------------------------------------------------------
def _per_gpu_runs(record: dict[str, Any], name: str) -> list[float]:
    world = record.get("world", 1)
    return [r["tokens_per_s"] / world for r in record["runners"][name]["runs"]]


def scaling_rows(records: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per benchmark row and world size (``records``: {N: that size's bench.json}), by row
    then N; efficiency against the smallest world size that ran the row."""
    sizes = sorted(records)
    order: list[str] = []
    for n in sizes:
        order += [name for name in records[n]["rows"] if name not in order]
    rows = []
    for name in order:
        have = [n for n in sizes if name in records[n]["rows"]]
        base = have[0]
        base_runs = _per_gpu_runs(records[base], name)
        base_per_gpu = spread(base_runs).median
        for n in have:
            summary = next(s for s in records[n]["summary"] if s["name"] == name)
            runs = _per_gpu_runs(records[n], name)
            per_gpu = summary["tokens_per_s"] / n
            rows.append({
                "name": name, "world": n, "repeats": summary["repeats"], "ms_per_step": summary["ms_per_step"],
                "ms_min": summary["ms_min"], "ms_max": summary["ms_max"], "tokens_per_s": summary["tokens_per_s"],
                "tokens_per_s_per_gpu": per_gpu, "scaling_base": base,
                "scaling_eff_pct": 100 * per_gpu / base_per_gpu if base_per_gpu else None,
                "scaling_noise": n != base and within_noise(runs, base_runs),
                "gpu_busy_pct": summary.get("gpu_busy_pct"), "mfu_pct": summary.get("mfu_pct"),
                "note": summary.get("note", "")})
    return rows


def _num(v: float | None, fmt: str, suffix: str = "") -> str:
    return "n/a" if v is None else format(v, fmt) + suffix


SCALING_COLUMNS = ["row", "GPUs", "ms/step [min-max]", "tok/s", "tok/s per GPU", "scaling", "MFU", "GPU span"]


def format_scaling(rows: list[dict[str, Any]]) -> str:
    """The scaling table (printed last by ``streamnmt bench --nproc 1,2,...``)."""
    cells = [SCALING_COLUMNS]
    for r in rows:
        eff = r["scaling_eff_pct"]
        if r["world"] == r["scaling_base"] or eff is None:
            eff_cell = "-" if eff is not None else "n/a"
        else:
            eff_cell = f"{eff:.0f}%" + (f" ({NOISE})" if r["scaling_noise"] else "")
        cells.append([r["name"], str(r["world"]), f"{r['ms_per_step']:.2f} [{r['ms_min']:.2f}-{r['ms_max']:.2f}]",
                      f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.0f}", eff_cell,
                      _num(r["mfu_pct"], ".1f", "%"), _num(r["gpu_busy_pct"], ".0f", "%")])
    widths = [max(len(row[i]) for row in cells) for i in range(len(SCALING_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def per_rank_batch(cfg: dict[str, Any]) -> str:
    """What each rank's batch holds: the token budget where one was given, else the sentences."""
    if cfg.get("max_tokens"):
        return f"--max-tokens {cfg['max_tokens']}" + (" packed" if cfg.get("pack", True) else "")
    return f"--batch-size {cfg['batch_size']}"


def scaling_footnotes(records: dict[int, dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    sizes = sorted(records)
    cfg = records[sizes[0]]["config"]
    lines = [
        f"ms/step: median over {cfg['repeats']} runs of {cfg['steps']} steps of the slowest rank's time "
        f"[min-max]; {per_rank_batch(cfg)} per rank (weak scaling)",
        "tok/s: real target tokens of all ranks / the slowest rank's wall time; tok/s per GPU: tok/s / GPUs",
        f"scaling: tok/s per GPU / that of {sizes[0]} GPU(s) (100% = perfect); '{NOISE}': the per-GPU medians "
        "differ by less than the larger min-max range of the two",
        "MFU: model FLOPs of all ranks / wall / (GPUs x dense peak); GPU span: rank 0's (see each nprocN/ table)",
    ]
    for n in sizes:
        lines += [f"{n} GPU(s): {note}" for note in records[n].get("left_out", [])]
        dev = records[n]["device"]
        lines.append(f"{n} GPU(s): {dev['name']}, {records[n].get('dist_backend') or 'one process'}, "
                     f"{dev.get('torch_threads')} torch thread(s) per rank")
    return "\n".join(lines)


CSV_FIELDS = ["name", "world", "repeats", "ms_per_step", "ms_min", "ms_max", "tokens_per_s", "tokens_per_s_per_gpu",
              "scaling_base", "scaling_eff_pct", "scaling_noise", "mfu_pct", "gpu_busy_pct", "note"]


def write_scaling(cfg: BenchConfig, records: dict[int, dict[str, Any]], rows: list[dict[str, Any]], out: Path) -> None:
    """``bench.json`` (config, world sizes, where each size's record is, the scaling rows), ``bench.csv``,
    ``bench.png``, each written atomically."""
    from streamnmt.training.runs import write_json

    first = records[min(records)]
    write_json(out / "bench.json", {
        "config": to_dict(cfg), "world_sizes": sorted(records),
        "runs": {str(n): f"nproc{n}/bench.json" for n in sorted(records)}, "device": first["device"],
        "torch": first["torch"], "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_commit(), "summary": rows})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out / "bench.csv", buf.getvalue())
    c = first["config"]
    plot_scaling(rows, out / "bench.png", title=f"{first['device']['name']}: {c['model']}, {c['amp']}, batch "
                 f"{c['batch_size']} x {c['max_len']} per GPU")


def plot_scaling(rows: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Per-GPU tokens/s against GPUs (left) and scaling efficiency (right), one line per row."""
    from matplotlib.figure import Figure

    from streamnmt.fsutil import atomic_path

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        xs = [r["world"] for r in mine]
        left.plot(xs, [r["tokens_per_s_per_gpu"] for r in mine], marker="o", label=name)
        right.plot(xs, [r["scaling_eff_pct"] or 0.0 for r in mine], marker="o", label=name)
    sizes = sorted({r["world"] for r in rows})
    for ax, label in ((left, "real tokens/s per GPU (median)"), (right, "scaling efficiency, %")):
        ax.set(xlabel="GPUs (processes)", ylabel=label, xticks=sizes)
        ax.grid(alpha=0.3)
    right.axhline(100, color="gray", linestyle="--", linewidth=1)
    left.legend(fontsize=8)
    fig.suptitle(title or "multi-GPU scaling")
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    return path
