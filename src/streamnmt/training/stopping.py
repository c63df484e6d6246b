"""When training stops and which weights are best: early stopping, time budgets, recipe checks.

A real corpus is trained until the dev score stops improving or a time slot ends, not for a fixed
number of epochs. This module holds that logic so the Trainer only asks two questions after each
evaluation and step: did the metric improve (write ``best.pt``) and should we stop (and why, in
one line). :class:`EarlyStopping` follows ``--best-metric`` (dev BLEU, higher is better, or
validation loss) with ``--patience`` evaluations; :class:`TimeBudget` is ``--time-limit`` with an
injectable clock (tests); :func:`check_recipe` validates the run flags that belong together.
Both keep their state in the checkpoint, so a resumed run stops where the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from streamnmt.configbase import check, check_choice
from streamnmt.errors import ConfigError

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str | None, key: str = "time_limit") -> float | None:
    """``"2h"``, ``"90m"``, ``"20s"``, ``"1h30m"``, or plain seconds (``"45"``) -> seconds; None -> None."""
    if text is None:
        return None
    t = str(text).strip().lower()
    try:
        seconds = float(t)
    except ValueError:
        m = _DURATION.match(t)
        if not t or not m or not any(m.groups()):
            raise ConfigError(f"--{key.replace('_', '-')} (config key '{key}'): must be a duration such as "
                              f"2h, 90m, 20s or 1h30m; got {text!r}") from None
        seconds = sum(float(v) * _UNITS[u] for v, u in zip(m.groups(), "hms") if v)
    check(math.isfinite(seconds) and seconds > 0, key, f"must be a positive duration; got {text!r}")
    return seconds


def best_metric(run: Any) -> str:
    """The resolved ``--best-metric``: ``auto`` is BLEU when BLEU is computed, else val_loss."""
    if run.best_metric != "auto":
        return run.best_metric
    return "bleu" if run.bleu_samples > 0 else "val_loss"


def check_recipe(run: Any) -> None:
    """Validate the RunConfig fields of the training recipe (called from its ``__post_init__``)."""
    every = str(run.eval_every).strip().lower()
    check(every == "auto" or (every.isdigit() and int(every) >= 0), "eval_every",
          f"must be auto, 0 (epoch ends only) or a positive number of steps; got {run.eval_every!r}")
    run.eval_every = "auto" if every == "auto" else str(int(every))
    check_choice(run.best_metric, "best_metric", ("auto", "bleu", "val_loss"))
    check(run.best_metric != "bleu" or run.bleu_samples > 0, "best_metric",
          "bleu needs BLEU to be computed: set --bleu-samples above 0 or use --best-metric val_loss")
    check(run.patience >= 0, "patience", f"must be 0 (never stop early) or positive; got {run.patience}")
    parse_duration(run.time_limit)
    check(run.keep_last >= 0, "keep_last", f"must be 0 (none) or positive; got {run.keep_last}")
    check(run.keep_last == 0 or run.save_every > 0, "keep_last",
          "keeps step checkpoints, which --save-every S writes: add --save-every (e.g. --save-every 1000)")
    check(0.0 <= run.ema < 1.0, "ema", f"must be in [0, 1) (e.g. 0.9999; 0 = off); got {run.ema}")
    check(run.ema_every >= 1, "ema_every", f"must be at least 1; got {run.ema_every}")
    check(not run.eval_ema or run.ema > 0, "eval_ema", "evaluates the averaged weights: add --ema 0.9999")
    check(not run.tensorboard or importlib.util.find_spec("tensorboard") is not None, "tensorboard",
          "needs the tensorboard package: pip install tensorboard (or drop --tensorboard)")


class EarlyStopping:
    """Tracks ``metric`` over evaluations: improvements, the best value, and ``patience``."""

    def __init__(self, metric: str, patience: int = 0):
        if metric not in ("bleu", "val_loss"):
            raise ValueError(f"metric must be bleu or val_loss; got {metric!r}")
        self.metric, self.patience = metric, patience
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0  # evaluations in a row without improvement

    def update(self, value: float | None, step: int) -> bool:
        """Record one evaluation; True when it improved on every earlier one (write best.pt)."""
        if value is None or not math.isfinite(value):
            better = False
        elif self.best is None:
            better = True
        else:
            better = value > self.best if self.metric == "bleu" else value < self.best
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

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and state.get("metric") == self.metric:
            self.best, self.best_step, self.bad = state["best"], state["best_step"], state["bad"]


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
        trainer.log(f"\n{signal.Signals(signum).name}: finishing the current step, then saving "
                    "(Ctrl-C again to abort)")

    old = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
