"""When training stops and which weights are best: early stopping, time budgets, stop signals.

A real corpus is trained until the dev score stops improving or a time slot ends, not for a fixed
number of epochs. This module holds that logic so the Trainer only asks two questions after each
evaluation and step: did the metric improve (write ``best.pt``) and should we stop (and why, in
one line). :class:`EarlyStopping` follows ``--best-metric`` (dev BLEU, higher is better, or
validation loss) with ``--patience`` evaluations; :class:`TimeBudget` is ``--time-limit`` with an
injectable clock (tests). The flags themselves are declared, parsed and checked in
:mod:`streamnmt.config` (``RunConfig``). Both keep their state in the checkpoint, so a resumed run
stops where the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil


def is_better(metric: str, value: float | None, than: float | None) -> bool:
    """``value`` strictly better than ``than`` by ``metric`` (BLEU: higher, val_loss: lower); a
    missing or non-finite value is never better, anything finite beats a missing one."""
    if value is None or not math.isfinite(value):
        return False
    if than is None:
        return True
    return value > than if metric == "bleu" else value < than


class EarlyStopping:
    """Tracks ``metric`` over evaluations: improvements, the best value, and ``patience``."""

    def __init__(self, metric: str, patience: int = 0):
        if metric not in ("bleu", "val_loss"):
            raise ValueError(f"metric must be bleu or val_loss; got {metric!r}")
        self.metric, self.patience = metric, patience or 0  # None: a RunConfig not resolved yet
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0  # evaluations in a row without improvement
        self.evaluations = 0

    def update(self, value: float | None, step: int) -> bool:
        """Record one evaluation; True when it improved on every earlier one (write best.pt)."""
        self.evaluations += 1
        better = is_better(self.metric, value, self.best)
        if better:
            self.best, self.best_step, self.bad = value, step, 0
        else:
            self.bad += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def reason(self) -> str:
        name = "dev BLEU" if self.metric == "bleu" else "validation loss"
        best = "none" if self.best is None else f"{self.best:.4f} at step {self.best_step}"
        return (f"early stop: {name} has not improved for {self.bad} evaluation(s) (--patience "
                f"{self.patience}); best {best}")

    def where_best(self, steps: int) -> str | None:
        """The run's end line on its best evaluation: still improving at the end (a longer run may
        score higher), or how many evaluations and what share of the ``steps`` came after it (a run
        past its plateau; --patience ends one that many evaluations after its best). None before two
        evaluations."""
        if self.best is None or self.evaluations < 2 or steps <= 0:
            return None
        name = "dev BLEU" if self.metric == "bleu" else "val_loss"
        head = f"best: {name} {self.best:.4f} at step {self.best_step} of {steps}"
        if self.bad == 0:
            return f"{head}, the last of {self.evaluations} evaluations: still improving, a longer run may score higher"
        after = (steps - self.best_step) / steps
        return (f"{head}, then {self.bad} of {self.evaluations} evaluations without a better one (the last "
                f"{after:.0%} of the steps; best.pt holds the best, and --patience N ends a run N evaluations "
                f"after it)")

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step, "bad": self.bad,
                "evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and state.get("metric") == self.metric:
            self.best, self.best_step, self.bad = state["best"], state["best_step"], state["bad"]
            self.evaluations = state.get("evaluations", self.bad + (self.best is not None))  # older checkpoints


EXEC_GAP_S = 10.0  # an interpreter takes far less from its process's creation to importing streamnmt


def command_start() -> float:
    """``time.monotonic()`` at the command's start: the launcher's (``STREAMNMT_COMMAND_START``, a
    Unix time set by ``streamnmt train --nproc`` for its ranks), else this process's creation as the
    OS recorded it, so that interpreter start-up and imports count too; but where the process was
    made more than :data:`EXEC_GAP_S` before streamnmt was imported, it ran something else first and
    exec'd this command (``bash -c "pip install ... && streamnmt train"``), which starts at the import."""
    import streamnmt

    now_wall, now = time.time(), time.monotonic()
    started = os.environ.get("STREAMNMT_COMMAND_START")
    try:
        if started:
            wall = float(started)
        else:
            created = psutil.Process().create_time()
            wall = created if streamnmt.IMPORTED_AT - created < EXEC_GAP_S else streamnmt.IMPORTED_AT
    except (ValueError, psutil.Error):
        return now
    return now - min(max(now_wall - wall, 0.0), 86400.0)


class TimeBudget:
    """``--time-limit``: the run's wall-clock seconds, counted from ``t0`` (the command's start).

    A resumed run gets the budget afresh (one time slot per job). The loop asks :meth:`expired`
    with a reserve (what the last evaluation and checkpoint write will cost), so that the run
    ends, evaluated and saved, within the limit. ``clock`` is injectable (tests stop at a chosen
    step without sleeping; they set ``t0`` in the clock's units).
    """

    def __init__(self, limit_s: float | None, clock: Callable[[], float] = time.monotonic,
                 t0: float | None = None):
        self.limit_s, self.clock = limit_s, clock
        self.t0 = clock() if t0 is None else t0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def expired(self, reserve_s: float = 0.0) -> bool:
        return self.limit_s is not None and self.elapsed() + reserve_s >= self.limit_s

    def reason(self, step: int) -> str:
        return f"time limit ({self.limit_s:g} s) reached after step {step}"


@contextlib.contextmanager
def stop_signals(trainer: Any) -> Iterator[None]:
    """SIGTERM and a first SIGINT ask the loop to stop after the current step (a host-side flag,
    checked once per step; no device work); a second SIGINT aborts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum, frame):
        if trainer.signalled and signum == signal.SIGINT and not trainer.dist.active:
            raise KeyboardInterrupt  # (several ranks: Ctrl-C reaches a rank from the terminal and from torchrun)
        trainer.signalled = True
        trainer.stop_requested, trainer.stop_reason = True, ""
        # several ranks: the agreement every --sync-interval steps decides the step they stop after;
        # a second signal reaches them through torchrun, which kills them after its shutdown timeout
        again = "torchrun kills the ranks after its --shutdown-timeout" if trainer.dist.active else \
            "Ctrl-C again to abort"
        trainer.log(f"\n{signal.Signals(signum).name}: finishing the current step, then saving ({again})")

    old = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
