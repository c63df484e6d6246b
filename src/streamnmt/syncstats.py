"""The one counted place where the host waits for the GPU.

Every host-blocking call in streamnmt (stream/event ``synchronize``, reading a device value on the
host) goes through :func:`host_sync`, which times it and counts it per call site. The seed design's
whole argument is about how often and how long the host waits; this module makes that a measured
number instead of an estimate: count, total, mean and max milliseconds per site, per epoch.

Call sites are short dotted names (``"baseline.compute"``, ``"losses.flush"``) and every call
carries a comment at the call site saying why the wait is needed there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class SiteStats:
    count: int = 0
    total_ms: float = 0.0
    max_ms: float = 0.0

    def add(self, ms: float) -> None:
        self.count += 1
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def as_dict(self) -> dict[str, float]:
        mean = self.total_ms / self.count if self.count else 0.0
        return {"count": self.count, "total_ms": round(self.total_ms, 4),
                "mean_ms": round(mean, 4), "max_ms": round(self.max_ms, 4)}


class SyncStats:
    """Per-site counters of host-blocking waits since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.sites: dict[str, SiteStats] = {}
        self._local = threading.local()  # a thread's own counters (:meth:`own`)

    def record(self, site: str, ms: float) -> None:
        own = getattr(self._local, "sites", None)
        (self.sites if own is None else own).setdefault(site, SiteStats()).add(ms)

    @contextlib.contextmanager
    def own(self) -> Iterator[dict[str, SiteStats]]:
        """This thread's waits into a dict of their own for the body of the ``with`` (a BLEU pass
        beside training: its waits are not the training loop's)."""
        self._local.sites = sites = {}
        try:
            yield sites
        finally:
            self._local.sites = None

    def reset(self) -> dict[str, dict[str, float]]:
        """Return the counters as a dict and start afresh (called at each epoch end)."""
        out = self.snapshot()
        self.sites = {}
        return out

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {site: s.as_dict() for site, s in sorted(self.sites.items())}

    @property
    def count(self) -> int:
        return sum(s.count for s in self.sites.values())

    @property
    def total_ms(self) -> float:
        return sum(s.total_ms for s in self.sites.values())


STATS = SyncStats()  # process-wide: one place counts every host wait


def host_sync(site: str, what: Any | Callable[[], T]) -> T | None:
    """Block the host on ``what`` and count the wait under ``site``.

    ``what`` is a CUDA stream or event (its ``synchronize()`` is called) or a zero-argument
    callable that blocks and returns a value (e.g. ``lambda: t.item()``), whose result is returned.
    """
    # Counted waits are allowed even under torch.cuda.set_sync_debug_mode("error"), which then
    # catches only the syncs that bypass this function.
    debug = torch.cuda.is_initialized() and torch.cuda.get_sync_debug_mode()
    if debug:
        torch.cuda.set_sync_debug_mode(0)
    t0 = time.perf_counter()
    try:
        result = what() if callable(what) and not hasattr(what, "synchronize") else what.synchronize()
    finally:
        STATS.record(site, (time.perf_counter() - t0) * 1e3)
        if debug:
            torch.cuda.set_sync_debug_mode(debug)
    return result


def format_table(stats: dict[str, dict[str, float]]) -> str:
    """A short text table of a snapshot, for the epoch-end console report."""
    if not stats:
        return "host syncs: none"
    lines = [f"{'host sync site':<24}{'count':>8}{'total ms':>11}{'mean ms':>10}{'max ms':>10}"]
    for site, s in stats.items():
        lines.append(f"{site:<24}{s['count']:>8}{s['total_ms']:>11.2f}{s['mean_ms']:>10.3f}{s['max_ms']:>10.3f}")
    return "\n".join(lines)
