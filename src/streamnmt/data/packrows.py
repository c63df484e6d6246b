"""Where each pair of an epoch goes: first-fit-decreasing rows, planned ahead in a forked process.

Kept apart from the sampler because it is the pure, deterministic part of serving (a function of
the lengths, the shape and ``(seed, epoch)``) and the only code the planner process runs. The
epoch's pairs are shuffled (seed, epoch), cut into windows, and each window is packed
first-fit-decreasing (:func:`pack_rows`: a pair goes into the first open row where both its source
and its target fit); the rows are then shuffled (:func:`epoch_rows`). While an epoch trains, the
next one is planned in a forked process (:class:`_Planner`), so the loop does not pause at epoch
starts.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from streamnmt.data.workers import detach, fork_blocked

WINDOW = 8192  # pairs packed together (first-fit-decreasing inside a window)
_PLANNER: Any = None  # this process's _Planner (False: none to be had)


def pack_rows(src_len: np.ndarray, tgt_len: np.ndarray, order: np.ndarray, s_width: int, t_width: int,
              window: int = WINDOW, workers: int = 1) -> list[np.ndarray]:
    """Pack pairs ``order`` (lengths with EOS/BOS: ``n + 1``, ``m + 1``) into rows whose source and
    target both fit; first-fit-decreasing within windows of ``window`` pairs. Returns each row's
    pairs in placement order. Every pair must fit an empty row (the corpus's --overlong did that).
    ``workers`` > 1: the windows (independent of each other) are packed in that many forked
    processes, with the same result."""
    ratio = src_len.sum() / max(int(tgt_len.sum()), 1)  # both sides weighed by the corpus's ratio
    starts = range(0, len(order), window)
    if workers > 1 and len(starts) > 1 and "fork" in multiprocessing.get_all_start_methods():
        rows = _pack_in_processes(src_len, tgt_len, order, s_width, t_width, window, ratio, workers)
        if rows is not None:
            return rows
    rows = []
    for k in starts:
        rows.extend(_pack_window(src_len, tgt_len, order[k:k + window], s_width, t_width, ratio))
    return rows


_POOL_JOB: Any = None  # pack_rows's arguments, for the forked workers (inherited, never pickled)


def _pack_in_processes(src_len: np.ndarray, tgt_len: np.ndarray, order: np.ndarray, s_width: int, t_width: int,
                       window: int, ratio: float, workers: int) -> list[np.ndarray] | None:
    """The windows packed by ``workers`` forked processes, each a run of consecutive windows, in
    order; None where a process could not be forked or died (killed, out of memory): the caller then
    packs in this process. The workers run NumPy only, end with the trainer
    (:func:`streamnmt.data.workers.detach`) and keep SIGTERM's default, so that shutting the pool
    down never waits on a worker."""
    global _POOL_JOB
    starts = list(range(0, len(order), window))
    n = min(workers, len(starts))
    chunks = [starts[i * len(starts) // n:(i + 1) * len(starts) // n] for i in range(n)]
    _POOL_JOB = (src_len, tgt_len, order, s_width, t_width, window, ratio)
    try:
        with warnings.catch_warnings():  # the children run NumPy only: no CUDA, no other thread's locks
            warnings.simplefilter("ignore", DeprecationWarning)
            with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"),
                                     initializer=functools.partial(detach, ignore_sigterm=False)) as pool:
                parts = list(pool.map(_pack_windows_of_job, chunks))
    except (BrokenProcessPool, OSError):
        return None
    finally:
        _POOL_JOB = None
    return [row for flat, counts in parts for row in _unflatten(flat, counts)]


def _pack_windows_of_job(chunk: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A worker's windows, their rows flattened (:func:`_flatten`)."""
    src_len, tgt_len, order, s_width, t_width, window, ratio = _POOL_JOB
    return _flatten([row for k in chunk for row in _pack_window(src_len, tgt_len, order[k:k + window], s_width,
                                                                  t_width, ratio)])


def _flatten(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows as one array and their lengths: one buffer to send to another process, not one a row."""
    counts = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    return (np.concatenate(rows) if rows else np.zeros(0, np.int64)), counts


def _unflatten(flat: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(counts)[:-1]) if len(counts) else []


def _pack_window(src_len: np.ndarray, tgt_len: np.ndarray, part: np.ndarray, s_width: int, t_width: int,
                 ratio: float) -> list[np.ndarray]:
    """First-fit-decreasing of one window's pairs ``part``, largest first (size = target x ``ratio``
    + source; stable: deterministic)."""
    size = tgt_len[part] * ratio + src_len[part]
    part = part[np.argsort(-size, kind="stable")]
    free_s = np.empty(len(part), np.int64)
    free_t = np.empty(len(part), np.int64)
    members: list[list[int]] = []
    for p in part.tolist():
        s, t = int(src_len[p]), int(tgt_len[p])
        nb = len(members)
        hit = np.flatnonzero((free_s[:nb] >= s) & (free_t[:nb] >= t)) if nb else ()
        if len(hit):
            j = int(hit[0])
            members[j].append(p)
            free_s[j] -= s
            free_t[j] -= t
        else:
            members.append([p])
            free_s[nb], free_t[nb] = s_width - s, t_width - t
    return [np.asarray(m, np.int64) for m in members]


def epoch_rows(src_len: np.ndarray, tgt_len: np.ndarray, shape: tuple[int, int, int], shuffle: bool, seed: int,
               epoch: int, window: int, workers: int = 1) -> list[np.ndarray]:
    """An epoch's rows in serving order (lengths with EOS/BOS): its pairs shuffled by ``(seed,
    epoch)``, packed by :func:`pack_rows` (in ``workers`` processes), the rows shuffled. A pure
    function of its arguments, run here or in the planner process."""
    rng = np.random.default_rng([seed & (2**63 - 1), epoch]) if shuffle else None
    order = rng.permutation(len(src_len)) if rng is not None else np.arange(len(src_len))
    rows = pack_rows(src_len, tgt_len, order, shape[1], shape[2], window, workers)
    if rng is not None:
        rows = [rows[k] for k in rng.permutation(len(rows))]
    return rows


class _Planner:
    """A forked daemon process that plans epochs' rows on request (see
    :meth:`streamnmt.data.packing.PackSampler._plan_ahead`).

    Planning is a Python loop (first-fit-decreasing): about 0.1 s per 10,000 pairs, a pause of the
    training loop at every epoch start if it ran there (on the built-in corpus at a 16k-token
    batch an epoch is a few dozen steps; docs/PERFORMANCE.md), and in a thread it would take the interpreter
    lock from the loop that launches the steps. The process is forked once, when the first
    training sampler is made (before the model is compiled or captured), runs NumPy only, and is
    a daemon: a run that ends while it plans does not wait for it. Requests and answers go over
    one pipe, in order; every answer is read before the next request is sent."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        with warnings.catch_warnings():  # the child runs NumPy only: no CUDA, no locks of other threads
            warnings.simplefilter("ignore", DeprecationWarning)
            self._proc = ctx.Process(target=_planner_loop, args=(child, self._conn), daemon=True,
                                     name="streamnmt-pack-planner")
            with fork_blocked():  # a SIGTERM before the child's detach() must not meet the parent's handler
                self._proc.start()
        child.close()
        self._asked: list[tuple] = []  # keys sent, not yet answered
        self._answers: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def submit(self, key: tuple, args: tuple) -> None:
        self._collect()  # the pipe holds one request or answer at a time: never both ends writing
        self._conn.send((key, args))
        self._asked.append(key)

    def asked(self, key: tuple) -> bool:
        return key in self._asked or key in self._answers

    def result(self, key: tuple) -> list[np.ndarray]:
        """The rows of ``key`` (waits for the planner); raises EOFError/OSError if it died."""
        if key not in self._answers:
            self._collect(until=key)
        return _unflatten(*self._answers.pop(key))

    def _collect(self, until: tuple | None = None) -> None:
        while self._asked and (until is None or until not in self._answers):
            key, flat, counts = self._conn.recv()
            self._asked.remove(key)
            self._answers[key] = (flat, counts)
        while len(self._answers) > 2:  # answers nobody came for (another seed or sampler)
            self._answers.pop(next(iter(self._answers)))


def _planner_loop(conn: Any, parent_end: Any) -> None:
    # The fork copied the trainer's end of the pipe: closed here, so that the trainer's death
    # (even by SIGKILL) ends this loop with EOFError instead of leaving it waiting forever.
    parent_end.close()
    # SIGTERM stays: multiprocessing ends this daemon process with it at the trainer's exit. A
    # SIGTERM to the whole process group mid-run ends it too; the trainer then plans in place.
    detach(ignore_sigterm=False)
    while True:
        try:
            key, args = conn.recv()
        except EOFError:  # the trainer closed its end or died
            return
        rows = epoch_rows(*args)
        conn.send((key, *_flatten(rows)))


def _planner() -> _Planner | None:
    """This process's planner (forked on first use), or None where fork is unavailable or it died."""
    global _PLANNER
    if _PLANNER is None:
        if "fork" not in multiprocessing.get_all_start_methods():
            _PLANNER = False
        else:
            try:
                _PLANNER = _Planner()
            except OSError:
                _PLANNER = False
    return _PLANNER or None


def _forget_planner_after_fork() -> None:
    # A process forked from one with a planner (a DataLoader worker, a launcher's child) would read the
    # parent's one pipe beside it and take its answers: it forks a planner of its own on first use.
    global _PLANNER
    _PLANNER = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_planner_after_fork)


def _planner_failed() -> None:
    global _PLANNER
    if _PLANNER:
        if _PLANNER._proc.is_alive():
            _PLANNER._proc.terminate()
        _PLANNER._conn.close()
    _PLANNER = False  # the rest of the run plans each epoch when it starts
