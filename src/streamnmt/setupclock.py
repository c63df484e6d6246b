"""What took the time inside each part of a run's set-up, for the set-up line.

The trainer times its set-up in parts (start-up, device, recipe, data, model, ...); a part's
seconds are often one thing's (the Triton kernels' build check in "recipe"). The code doing that
thing times it here (:func:`timed`, host clock, no device sync); the trainer closes each part
(:func:`close`), which files what was timed since under that part, and the set-up line names the
largest (:func:`detail`): ``recipe 7.9 s (Triton kernel build check 7.5 s)``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

# Cores the set-up's child processes leave to the command's own process (its imports, data and model):
# the tokenizers' child (streamnmt.data.tokenizer_child) runs on all but these, and the Triton kernels'
# build (streamnmt.models.prebuild) starts no more children than the cores less these.
LEFT_CORES = 4


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system says it, else all)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)

_OPEN: list[tuple[str, float]] = []  # timed since the last close
_BY_PART: dict[str, list[tuple[str, float]]] = {}
SHOWN_S = 0.1  # shorter things are not named


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    """Time ``what`` (a few words, e.g. "Triton kernel build check") as a piece of the current part."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - t0
        if seconds >= SHOWN_S:
            _OPEN.append((what, seconds))


def close(part: str) -> None:
    """The set-up part ``part`` ended: what was timed since the last close belongs to it."""
    _BY_PART[part] = _OPEN[:]
    _OPEN.clear()


def detail(part: str) -> str:
    """`` (WHAT N s)``: the largest thing timed in ``part``, or "" where none took ``SHOWN_S``."""
    pieces = [p for p in _BY_PART.get(part, []) if p[1] >= SHOWN_S]
    if not pieces:
        return ""
    what, seconds = max(pieces, key=lambda p: p[1])
    return f" ({what} {seconds:.1f} s)"
