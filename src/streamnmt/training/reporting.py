"""What a training run shows besides its CSV files: TensorBoard scalars and the run's sync summary.

The console stays short (one line per epoch; the host-sync table once at the end, or per epoch
with ``--verbose``), so the details go where they can be browsed: ``--tensorboard`` writes scalar
events (loss, learning rate, tokens/s, validation loss, BLEU, host-sync counts) into the run
directory through ``torch.utils.tensorboard``, which needs the ``tensorboard`` package; the flag
is refused up front when it is missing (see :func:`streamnmt.training.stopping.check_recipe`).
:func:`merge_sync_stats` adds up the per-epoch sync counters for the end-of-run table.
"""

from __future__ import annotations

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
