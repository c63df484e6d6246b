"""What a training run shows besides its CSV files: TensorBoard scalars and the run's sync summary.

The console stays short (one line per epoch; the host-sync table once at the end, or per epoch
with ``--verbose``), so the details go where they can be browsed: ``--tensorboard`` writes scalar
events (loss, learning rate, tokens/s, validation loss, BLEU, host-sync counts) into the run
directory through ``torch.utils.tensorboard``, which needs the ``tensorboard`` package; the flag
is refused up front when it is missing (see :func:`streamnmt.config.check_recipe`).
:func:`merge_sync_stats` adds up the per-epoch sync counters for the end-of-run table.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


class Scalars:
    """TensorBoard scalar writer; with ``enabled`` False every call does nothing."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.writer = SummaryWriter(log_dir=str(run_dir))

    def add(self, step: int, values: dict[str, Any]) -> None:
        """Write ``values`` ({tag: number}) at ``step``; empty strings and None are skipped."""
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None and value != "":
                self.writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def merge_sync_stats(entries: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per-site sums over several :meth:`SyncStats.snapshot` dicts (e.g. every epoch of a run)."""
    out: dict[str, dict[str, float]] = {}
    for stats in entries:
        for site, s in stats.items():
            m = out.setdefault(site, {"count": 0, "total_ms": 0.0, "mean_ms": 0.0, "max_ms": 0.0})
            m["count"] += s["count"]
            m["total_ms"] = round(m["total_ms"] + s["total_ms"], 4)
            m["max_ms"] = max(m["max_ms"], s["max_ms"])
            m["mean_ms"] = round(m["total_ms"] / m["count"], 4) if m["count"] else 0.0
    return dict(sorted(out.items()))


def running(strategy) -> str:
    """The strategy that actually runs: graph mode's fallback names itself."""
    fallback = getattr(strategy, "fallback", None)
    return f"{fallback.name} (in place of graph)" if fallback is not None else strategy.name


def overlong_note(stats: dict[str, int], data) -> str:
    """What --overlong did to the training pairs over --max-len, for the data start line."""
    if data.overlong == "drop":
        return f"{stats.get('dropped', 0)} training pairs over --max-len {data.max_len} dropped (--overlong drop)"
    return f"{stats.get('truncated', 0)} training pairs over --max-len {data.max_len} truncated (--overlong truncate)"


def warmup_note(warmup: int, end_step: int | None) -> str | None:
    """A warning line where the run's step count (``end_step``: --max-steps or its epochs' steps; None:
    a time limit or the plateau ends it) stops before the Noam warm-up does: the learning rate never
    reaches its peak, so the run trains at a fraction of its rate throughout (a small --max-tokens on
    a CPU: the warm-up follows the tokens per update, docs/PERFORMANCE.md, "CPU: the bare `streamnmt
    train`")."""
    if end_step is None or warmup <= end_step:
        return None
    return (f"warning: the warm-up (--warmup {warmup} steps) is longer than the run ({end_step} steps): the learning "
            f"rate never reaches its peak ({100 * end_step / warmup:.0f} % of it at the end); give a shorter "
            "--warmup or a longer run")


def progress(total: int, desc: str, quiet: bool = False):
    """The epoch's progress bar on stderr (off on ranks other than 0)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
                disable=True if quiet else None)


def epoch_line(row: dict[str, Any], epochs: int) -> str:
    """The console line of an epoch (its columns under the header the loop prints first); an
    epoch that was not evaluated shows '-' for its validation loss and BLEU."""
    val = f"{row['val_loss']:>10.4f}" if row["val_loss"] != "" else f"{'-':>10}"
    of = f"{row['epoch']:>3}/{epochs:<3}" if epochs < 1_000_000 else f"{row['epoch']:>7}"  # no total: --time-limit
    return (f"{of}{row['gpu_mem_gb']:>8.2f}G{row['steps']:>9}"
            f"{row['tokens_per_s']:>10.0f}{row['train_loss']:>12.4f}{row['train_nll']:>11.4f}"
            f"{row['train_ppl']:>9.2f}{val}{row['bleu'] if row['bleu'] != '' else '-':>7}{row['epoch_s']:>7.1f}s")


def time_line(times: dict[str, float], wall_s: float) -> str:
    """Where the run's wall clock went, e.g. ``wall 121 s: training 88 % (106 s), evaluation 6 %
    (7 s), ...``; ``times`` holds the measured seconds of each part."""
    parts = ", ".join(f"{name} {100 * s / max(wall_s, 1e-9):.0f} % ({s:.0f} s)" for name, s in times.items())
    return f"wall {wall_s:.0f} s: {parts}"
