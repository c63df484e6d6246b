"""Packed training batches: several sentence pairs back to back in each row, one shape per run.

A bucketed batch pads every sentence to its bucket length and has one shape per bucket; a packed
batch places whole pairs one after another: pair ``k`` of a row takes the next ``n_k + 1`` source
columns (tokens + EOS) of the encoder row and the next ``m_k + 1`` target columns of the decoder
row (``[BOS] + tokens`` in ``tgt_in``, ``tokens + [EOS]`` in ``tgt_out``). Each row carries
segment ids (1, 2, ... per pair; 0 for padding) and positions that restart at 0 for each pair, so
the model keeps attention inside a pair (:mod:`streamnmt.models.attention`) and every pair sees the
positions it would see alone.

Packing is four modules; this one holds the stateful part, the sampler (epoch, position, resume).
Shape: every batch is ``(rows, src width, tgt width)``, chosen once per corpus
(:func:`streamnmt.data.packshape.pack_shape`). Placement: each epoch's pairs go into rows
first-fit-decreasing, the next epoch planned ahead in a forked process
(:mod:`streamnmt.data.packrows`). Batches: a planned micro-batch becomes tensors in the loader's
workers (:func:`streamnmt.data.packbatch.collate_packed`).

Serving (:class:`PackSampler`): the rows are served in the global-step layout of
:mod:`streamnmt.data.sampler`: global batch ``g`` holds ``world * accum * rows`` rows, rank ``r``
serves micro-batches ``r*K .. r*K+K-1`` of it (every rank the same shape, disjoint pairs), and a
rows that do not fill a last global step are left out of the epoch (``drop_last``: those pairs
train in other epochs, which shuffle anew), so no step is mostly padding; a corpus smaller than one
global step is served as one step filled with empty rows. ``position`` counts the micro-batches
served, so a saved state resumes exactly; the plan is a pure function of ``(seed, epoch)``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from streamnmt.data.packrows import WINDOW, _planner, _planner_failed, epoch_rows
from streamnmt.errors import InputError

_ROWS_CACHE: dict[tuple, list[np.ndarray]] = {}  # see PackSampler._rows


class PackedPlan(NamedTuple):
    """One planned packed micro-batch: pair ``pairs[k]`` goes into row ``slots[k]`` (in this order
    within a row); ``group``: the pairs of its whole global step (the loss normaliser)."""

    shape: tuple[int, int, int]
    pairs: np.ndarray
    slots: np.ndarray
    group: np.ndarray


class PackSampler:
    """Yields :class:`PackedPlan` items of epoch ``self.epoch`` from ``self.position`` on; the
    interface of :class:`~streamnmt.data.sampler.BucketSampler` (shapes, state, resume)."""

    def __init__(self, src_lengths: np.ndarray, tgt_lengths: np.ndarray, shape: tuple[int, int, int], *,
                 shuffle: bool, seed: int = 0, accum: int = 1, world: int = 1, rank: int = 0,
                 window: int = WINDOW, background: bool = True) -> None:
        if not (accum >= 1 and world >= 1 and 0 <= rank < world):
            raise ValueError(f"PackSampler: accum {accum}, world {world}, rank {rank}")
        self.src_len = np.asarray(src_lengths, np.int64) + 1  # + EOS
        self.tgt_len = np.asarray(tgt_lengths, np.int64) + 1  # + BOS / EOS
        self.shape = shape
        rows, s_width, t_width = shape
        if len(self.src_len) and (self.src_len.max() > s_width or self.tgt_len.max() > t_width):
            raise InputError(f"a pair is longer than a packed row ({s_width} source, {t_width} target "
                             f"tokens): raise --max-len or use --overlong")
        self.accum, self.world, self.rank = accum, world, rank
        self.shuffle, self.seed, self.window = shuffle, seed, window
        self.epoch = 0
        self.position = 0
        self.background = background and shuffle
        if self.background:
            _planner()  # forked now, while the process is small and has not compiled or captured anything
        self._lengths_hash: tuple[int, int] | None = None
        self._plan: tuple[int, int, list[PackedPlan]] | None = None

    def shapes(self) -> list[tuple[int, int, int]]:
        return [self.shape]

    def _key(self, epoch: int) -> tuple:
        if self._lengths_hash is None:
            self._lengths_hash = (hash(self.src_len.tobytes()), hash(self.tgt_len.tobytes()))
        return (*self._lengths_hash, self.shape, self.shuffle, self.seed, epoch, self.window)

    def _rows(self, epoch: int) -> list[np.ndarray]:
        """The epoch's rows in serving order. Remembered for the last few (corpus, settings, epoch):
        the trainer plans epoch 0 several times before it starts (compile choice, shapes, loader).
        The next epoch's rows are planned in a background process meanwhile (:meth:`plan`)."""
        key = self._key(epoch)
        if key in _ROWS_CACHE:
            return _ROWS_CACHE[key]
        planner, rows = _planner() if self.background else None, None
        if planner is not None and planner.asked(key):
            try:
                rows = planner.result(key)
            except (EOFError, OSError):  # the planner died (killed, out of memory): plan here
                _planner_failed()
        if rows is None:
            rows = epoch_rows(self.src_len, self.tgt_len, self.shape, self.shuffle, self.seed, epoch, self.window,
                              workers=self._plan_workers())
        while len(_ROWS_CACHE) >= 4:
            _ROWS_CACHE.pop(next(iter(_ROWS_CACHE)))
        _ROWS_CACHE[key] = rows
        return rows

    def _plan_workers(self) -> int:
        """Processes for an epoch planned here: several for a corpus of many windows (a large corpus
        took seconds of a run's set-up in one process; docs/PERFORMANCE.md, "The packing planner"),
        this rank's share of the CPUs, at most 8; one
        where another Python thread runs (forking beside it could copy a lock it holds)."""
        windows = -(-len(self.src_len) // self.window)
        if windows < 4 or threading.active_count() > 1:
            return 1
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cpus = os.cpu_count() or 1
        return max(1, min(8, cpus // self.world, windows))

    def plan_ahead(self, epoch: int) -> None:
        """Start planning ``epoch`` in the planner process now: a resumed run's epoch, while the
        model is built (a loader's sampler of the same corpus, shape and seed then finds it)."""
        self._plan_ahead(epoch)

    def _plan_ahead(self, epoch: int) -> None:
        """Start planning ``epoch``'s rows in the planner process, unless known or under way."""
        key = self._key(epoch)
        planner = _planner() if self.background else None
        if planner is None or key in _ROWS_CACHE or planner.asked(key):
            return
        try:
            planner.submit(key, (self.src_len, self.tgt_len, self.shape, self.shuffle, self.seed, epoch, self.window))
        except (EOFError, OSError):
            _planner_failed()

    def plan(self, epoch: int) -> list[PackedPlan]:
        """All micro-batches of ``epoch`` in serving order (the last epoch's plan is kept)."""
        if self._plan is not None and self._plan[:2] == (epoch, self.seed):
            return self._plan[2]
        rows = self._rows(epoch)
        if self.shuffle:
            self._plan_ahead(epoch + 1)  # ready when this epoch ends: no pause of the training loop
        r, k, g = self.shape[0], self.accum, self.accum * self.world
        if self.shuffle and len(rows) > r * g and len(rows) % (r * g):
            # training: drop the partial last step (see module doc); evaluation keeps every pair
            rows = rows[:len(rows) - len(rows) % (r * g)]
        out: list[PackedPlan] = []
        empty = np.zeros(0, np.int64)
        for start in range(0, len(rows), r * g):
            step_rows = rows[start:start + r * g]
            group = np.concatenate(step_rows) if step_rows else empty
            for m in range(self.rank * k, (self.rank + 1) * k):
                mine = step_rows[m * r:(m + 1) * r]
                pairs = np.concatenate(mine) if mine else empty
                slots = np.repeat(np.arange(len(mine), dtype=np.int64), [len(x) for x in mine]) if mine else empty
                out.append(PackedPlan(self.shape, pairs, slots, group))
        self._plan = (epoch, self.seed, out)
        return out

    def __len__(self) -> int:
        """Micro-batches this rank serves in the current epoch (``accum`` per global step)."""
        return len(self.plan(self.epoch))

    def tokens(self) -> tuple[int, int, int]:
        """(real source, real target, padded target) tokens this rank serves in the current epoch."""
        src = tgt = 0
        for p in self.plan(self.epoch):
            src += int(self.src_len[p.pairs].sum())
            tgt += int(self.tgt_len[p.pairs].sum())
        return src, tgt, len(self) * self.shape[0] * self.shape[2]

    def bucket_sizes(self) -> dict[int, int]:
        return {self.shape[2]: len(self.src_len)}

    def empty_rank(self) -> int | None:
        """The first rank that would serve empty rows only in every epoch, or None."""
        n_rows = len(self._rows(0))
        for r in range(self.world):
            if n_rows <= r * self.accum * self.shape[0]:
                return r
        return None

    def __iter__(self) -> Iterator[PackedPlan]:
        plan, start = self.plan(self.epoch), self.position
        return iter(plan[start:])

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def _fingerprint(self) -> list[int]:
        return [len(self.src_len), int(self.src_len.sum()), int(self.tgt_len.sum())]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_batches": len(self),
                "accum": self.accum, "world": self.world, "packed": list(self.shape), "corpus": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved with the same data and packing; another global batch
        (world x accumulation) resumes at the global step that has served the same share."""
        state = dict(state)
        saved = [int(x) for x in state.get("packed") or []]
        if (len(saved) == 3 and saved[0] == self.shape[0] and saved[2] == self.shape[2] and saved[1] != self.shape[1]
                and (not len(self.src_len) or int(self.src_len.max()) <= saved[1])):
            # Saved under another source-width rule (an earlier version's pack_shape): the same rows
            # and target width, so resume with the saved source width and the same plan, exactly.
            self.shape, self._plan = (saved[0], saved[1], saved[2]), None
        if list(state.get("packed") or []) != list(self.shape):
            raise InputError(f"data order state: saved for batches of shape {state.get('packed') or 'bucketed'}, "
                             f"but this loader packs {list(self.shape)}; the corpus or the batching settings "
                             f"(--pack, --max-tokens, --max-len) changed since the checkpoint (a run saved with "
                             f"length buckets resumes with --no-pack)")
        if list(state.get("corpus") or self._fingerprint()) != self._fingerprint():
            raise InputError("data order state: saved for another training corpus (pairs or token counts "
                             "differ), so it cannot resume exactly")
        self.seed = int(state.get("seed", self.seed))
        epoch, position = int(state["epoch"]), int(state["position"])
        now = len(self.plan(epoch))
        old_k, old_n = int(state.get("accum", 1)), int(state.get("world", 1))
        if (old_k, old_n) != (self.accum, self.world):
            then = PackSampler(self.src_len - 1, self.tgt_len - 1, self.shape, shuffle=self.shuffle, seed=self.seed,
                               accum=old_k, world=old_n, window=self.window, background=False)
            done, old_steps, new_steps = position // old_k, len(then.plan(epoch)) // old_k, now // self.accum
            position = min(-(-done * new_steps // max(old_steps, 1)), new_steps) * self.accum
        if not 0 <= position <= now:
            raise InputError(f"data order state: saved at batch {position} of epoch {epoch}, but this loader has "
                             f"{now}; the batching settings changed since the checkpoint, so it cannot resume exactly")
        self.epoch, self.position = epoch, position
