"""Packed training batches: several sentence pairs back to back in each row, one shape per run.

A bucketed batch pads every sentence to its bucket length and has one shape per bucket; a packed
batch places whole pairs one after another: pair ``k`` of a row takes the next ``n_k + 1`` source
columns (tokens + EOS) of the encoder row and the next ``m_k + 1`` target columns of the decoder
row (``[BOS] + tokens`` in ``tgt_in``, ``tokens + [EOS]`` in ``tgt_out``). Each row carries
segment ids (1, 2, ... per pair; 0 for padding) and positions that restart at 0 for each pair, so
the model keeps attention inside a pair (:mod:`streamnmt.models.attention`) and every pair sees the
positions it would see alone.

Shape: every batch is ``(rows, src width, tgt width)`` (:func:`pack_shape`): the target width is
``--max-len`` rounded up to ``--pad-multiple`` (the longest target after ``--overlong`` fits), the
source width is the corpus's source/target token ratio times the target width times 1 to 1.25 (at
least its longest source), the factor chosen by packing a sample at each so that the target side
stays full and the encoder does little work on padding; rows = ``--max-tokens`` / target width
(without a token budget: enough rows for ``--batch-size`` sentences of the corpus's mean length).
One shape per run: graph mode captures one graph and ``--compile`` compiles one.

Placement (:func:`pack_rows`): the epoch's pairs are shuffled (seed, epoch), cut into windows, and
each window is packed first-fit-decreasing (a pair goes into the first open row where both its
source and its target fit). Rows are then shuffled and served in the global-step layout of
:mod:`streamnmt.data.sampler`: global batch ``g`` holds ``world * accum * rows`` rows, rank ``r``
serves micro-batches ``r*K .. r*K+K-1`` of it (every rank the same shape, disjoint pairs), and a
rows that do not fill a last global step are left out of the epoch (``drop_last``: those pairs
train in other epochs, which shuffle anew), so no step is mostly padding; a corpus smaller than one
global step is served as one step filled with empty rows. ``position`` counts the micro-batches
served, so a saved state resumes exactly; the plan is a pure function of ``(seed, epoch)``. While
an epoch trains, the next one is planned in a forked process (:class:`_Planner`), so the loop does
not pause at epoch starts.
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.data.workers import detach
from streamnmt.errors import InputError
from streamnmt.models.masks import BOS, EOS, PAD

WINDOW = 8192  # pairs packed together (first-fit-decreasing inside a window)
_ROWS_CACHE: dict[tuple, list[np.ndarray]] = {}  # see PackSampler._rows
_SHAPE_CACHE: dict[tuple, int] = {}  # source widths chosen by pack_shape
_PLANNER: Any = None  # this process's _Planner (False: none to be had)
# Source widths tried: target width x the corpus's source/target token ratio x each slack.
SRC_SLACKS = (1.0, 1.05, 1.1, 1.15, 1.2, 1.25)
# What a source position costs relative to a target position. Per layer both sides run the same
# matrices (a source position: self-attention 4 d^2, FFN 2 d d_ff and the decoder's cross-attention
# keys/values 2 d^2; a target position: 6 d^2 + 2 d d_ff), and a target position adds the output
# projection d x V: for the base model at a 32k vocabulary 22M vs 38M multiply-adds, 0.57.
SRC_COST = 0.57
MIN_TGT_FILL = 0.96  # a source width must leave at least this share of target positions real (the
# padding stays under 5 % on the whole corpus, whose fill varies a little from the sample's)


class PackedPlan(NamedTuple):
    """One planned packed micro-batch: pair ``pairs[k]`` goes into row ``slots[k]`` (in this order
    within a row); ``group``: the pairs of its whole global step (the loss normaliser)."""

    shape: tuple[int, int, int]
    pairs: np.ndarray
    slots: np.ndarray
    group: np.ndarray


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_shape(src_lengths: np.ndarray, tgt_lengths: np.ndarray, *, max_len: int, max_tokens: int,
               batch_size: int, pad_multiple: int) -> tuple[int, int, int]:
    """(rows, src width, tgt width) of every packed batch of a corpus (see the module docstring).

    The source width is chosen by packing one window of the corpus at each candidate width
    (:data:`SRC_SLACKS`) and keeping the one with the most real target tokens per unit of work
    (``tgt fill x tgt width / (SRC_COST x src width + tgt width)``) among those that leave at
    least :data:`MIN_TGT_FILL` of the target positions real: a wider source row wastes encoder
    work on padding, a narrower one fills its source before its target. Against the fixed 1.25 x
    ratio this replaced (target width 128; docs/PERFORMANCE.md section 9): the built-in corpus
    (40,000 pairs) 280 source columns instead of 288, a long-tailed one (make_longtail.py, 40,000
    pairs) 248 instead of 304, its source fill 95 % instead of 79 % and its target fill 97.5 %
    instead of 99.9 %. A deterministic function of the lengths (every rank computes the same)."""
    t_width = round_up(max_len, pad_multiple)
    src_total, tgt_total = int(src_lengths.sum()) + len(src_lengths), int(tgt_lengths.sum()) + len(tgt_lengths)
    ratio = src_total / max(tgt_total, 1)
    longest_src = int(src_lengths.max()) + 1 if len(src_lengths) else 1
    if max_tokens > 0:
        rows = max(1, max_tokens // t_width)
    else:
        mean_tgt = tgt_total / max(len(tgt_lengths), 1)
        rows = max(1, int(round(batch_size * mean_tgt / t_width)))
    widths = sorted({round_up(max(longest_src, int(np.ceil(t_width * ratio * k))), pad_multiple) for k in SRC_SLACKS})
    if len(widths) == 1 or len(src_lengths) == 0:
        return rows, widths[-1], t_width
    key = (hash(np.asarray(src_lengths).tobytes()), hash(np.asarray(tgt_lengths).tobytes()), t_width, tuple(widths))
    if key not in _SHAPE_CACHE:
        while len(_SHAPE_CACHE) >= 8:
            _SHAPE_CACHE.pop(next(iter(_SHAPE_CACHE)))
        _SHAPE_CACHE[key] = _source_width(np.asarray(src_lengths, np.int64) + 1, np.asarray(tgt_lengths, np.int64) + 1,
                                          widths, t_width)
    return rows, _SHAPE_CACHE[key], t_width


def _source_width(src_len: np.ndarray, tgt_len: np.ndarray, widths: list[int], t_width: int) -> int:
    """The source width of :func:`pack_shape`: pack one window at each of ``widths``; among those
    whose target fill reaches MIN_TGT_FILL, the most real target tokens per unit of work (ties: the
    narrower); if none does, the fullest target side."""
    order = np.random.default_rng(0).permutation(len(src_len))[:WINDOW]
    fill = {w: int(tgt_len[order].sum()) / (len(pack_rows(src_len, tgt_len, order, w, t_width)) * t_width)
            for w in widths}
    full = [w for w in widths if fill[w] >= MIN_TGT_FILL]
    if not full:
        return max(widths, key=lambda w: (fill[w], w))
    return max(full, key=lambda w: (fill[w] * t_width / (SRC_COST * w + t_width), -w))


def pack_rows(src_len: np.ndarray, tgt_len: np.ndarray, order: np.ndarray, s_width: int, t_width: int,
              window: int = WINDOW) -> list[np.ndarray]:
    """Pack pairs ``order`` (lengths with EOS/BOS: ``n + 1``, ``m + 1``) into rows whose source and
    target both fit; first-fit-decreasing within windows of ``window`` pairs. Returns each row's
    pairs in placement order. Every pair must fit an empty row (the corpus's --overlong did that)."""
    rows: list[np.ndarray] = []
    for k in range(0, len(order), window):
        part = order[k:k + window]
        # largest first, size = both sides weighed by the corpus's ratio (stable: deterministic)
        size = tgt_len[part] * (src_len.sum() / max(int(tgt_len.sum()), 1)) + src_len[part]
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
        rows.extend(np.asarray(m, np.int64) for m in members)
    return rows


def epoch_rows(src_len: np.ndarray, tgt_len: np.ndarray, shape: tuple[int, int, int], shuffle: bool, seed: int,
               epoch: int, window: int) -> list[np.ndarray]:
    """An epoch's rows in serving order (lengths with EOS/BOS): its pairs shuffled by ``(seed,
    epoch)``, packed by :func:`pack_rows`, the rows shuffled. A pure function of its arguments, run
    here or in the planner process."""
    rng = np.random.default_rng([seed & (2**63 - 1), epoch]) if shuffle else None
    order = rng.permutation(len(src_len)) if rng is not None else np.arange(len(src_len))
    rows = pack_rows(src_len, tgt_len, order, shape[1], shape[2], window)
    if rng is not None:
        rows = [rows[k] for k in rng.permutation(len(rows))]
    return rows


class _Planner:
    """A forked daemon process that plans epochs' rows on request (see :meth:`PackSampler._plan_ahead`).

    Planning is a Python loop (first-fit-decreasing): about 0.1 s per 10,000 pairs, a pause of the
    training loop at every epoch start if it ran there (on the built-in corpus at a 16k-token
    batch an epoch is 27 steps, 1.4 s on an H200), and in a thread it would take the interpreter
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
        flat, counts = self._answers.pop(key)
        return np.split(flat, np.cumsum(counts)[:-1]) if len(counts) else []

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
        counts = np.fromiter((len(r) for r in rows), np.int64, len(rows))
        conn.send((key, np.concatenate(rows) if rows else np.zeros(0, np.int64), counts))  # one buffer each


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


def _planner_failed() -> None:
    global _PLANNER
    if _PLANNER:
        if _PLANNER._proc.is_alive():
            _PLANNER._proc.terminate()
        _PLANNER._conn.close()
    _PLANNER = False  # the rest of the run plans each epoch when it starts


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
            rows = epoch_rows(self.src_len, self.tgt_len, self.shape, self.shuffle, self.seed, epoch, self.window)
        while len(_ROWS_CACHE) >= 4:
            _ROWS_CACHE.pop(next(iter(_ROWS_CACHE)))
        _ROWS_CACHE[key] = rows
        return rows

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
        if len(rows) > r * g and len(rows) % (r * g):
            rows = rows[:len(rows) - len(rows) % (r * g)]  # drop the partial last step (see module doc)
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


@dataclass
class PackedHostBatch:
    """A packed batch as one NumPy buffer (what a worker sends back; see ``HostBatch``):
    ``src`` (3, R, S): tokens, segment ids, positions; ``tgt`` (4, R, T): tgt_in, tgt_out, segment
    ids, positions."""

    buffer: np.ndarray  # flat int64: src part then tgt part
    shape: tuple[int, int, int]
    ntokens: int
    src_tokens: int
    index: np.ndarray
    norm_tokens: int

    def to_batch(self):
        return self._wrap(torch.from_numpy(self.buffer))

    def pin_memory(self):
        return self._wrap(torch.from_numpy(self.buffer).pin_memory())

    def _wrap(self, flat: torch.Tensor):
        from streamnmt.data.batch import Batch

        r, s, t = self.shape
        src = flat[:3 * r * s].view(3, r, s)
        tgt = flat[3 * r * s:].view(4, r, t)
        norm = torch.tensor(1.0 / max(self.norm_tokens, 1), dtype=torch.float32)
        if flat.is_pinned():
            norm = norm.pin_memory()
        return Batch(src[0], tgt[0], tgt[1], ntokens=self.ntokens, src_tokens=self.src_tokens, index=self.index,
                     norm=norm, norm_tokens=self.norm_tokens, src_seg=src[1], src_pos=src[2], tgt_seg=tgt[2],
                     tgt_pos=tgt[3])


def collate_packed(corpus: TokenizedCorpus, plan: PackedPlan) -> PackedHostBatch:
    """The batch of ``plan``: vectorised, one gather per side and no loop over pairs."""
    r, s_w, t_w = plan.shape
    buf = np.zeros(3 * r * s_w + 4 * r * t_w, np.int64)  # PAD = segment 0 = position 0
    src = buf[:3 * r * s_w].reshape(3, r, s_w)
    tgt = buf[3 * r * s_w:].reshape(4, r, t_w)
    pairs, slots = plan.pairs, plan.slots
    n_src = corpus.src_lengths[pairs]
    n_tgt = corpus.tgt_lengths[pairs]
    if len(pairs):
        first = np.searchsorted(slots, slots)  # index of the first pair of each pair's row
        seg = np.arange(len(pairs)) - first + 1
        _place(src[0], src[1], src[2], slots, first, seg, n_src + 1,
               corpus.src_tokens, corpus.src_offsets[pairs], shift=0)
        _place(tgt[1], tgt[2], tgt[3], slots, first, seg, n_tgt + 1,
               corpus.tgt_tokens, corpus.tgt_offsets[pairs], shift=0)
        _place(tgt[0], None, None, slots, first, seg, n_tgt + 1,
               corpus.tgt_tokens, corpus.tgt_offsets[pairs], shift=1)
    ntokens = int(n_tgt.sum()) + len(pairs)
    g = plan.group
    norm_tokens = int(corpus.tgt_lengths[g].sum()) + len(g)
    index = np.full(r, -1, np.int64)
    return PackedHostBatch(buf, plan.shape, ntokens=ntokens, src_tokens=int(n_src.sum()) + len(pairs),
                           index=index, norm_tokens=norm_tokens)


def _place(out: np.ndarray, seg_out: np.ndarray | None, pos_out: np.ndarray | None, slots: np.ndarray,
           first: np.ndarray, seg: np.ndarray, lens: np.ndarray, tokens: np.ndarray, starts: np.ndarray,
           shift: int) -> None:
    """Write each pair's ``lens`` columns into its row after the pairs before it: ``shift`` 0 gives
    tokens + EOS, 1 gives BOS + tokens. Segment ids and positions too, where asked."""
    excl = np.cumsum(lens) - lens  # flat start of each pair
    col0 = excl - excl[first]      # its first column within its row
    total = int(lens.sum())
    within = np.arange(total) - np.repeat(excl, lens)  # position inside the pair
    row = np.repeat(slots, lens)
    col = np.repeat(col0, lens) + within
    n = np.repeat(lens - 1, lens)  # sentence length without EOS/BOS
    src_idx = np.repeat(starts, lens) + within - shift
    if shift:
        special = within == 0
        value = np.where(special, BOS, tokens[np.clip(src_idx, 0, max(len(tokens) - 1, 0))] if len(tokens) else BOS)
    else:
        special = within == n
        value = np.where(special, EOS, tokens[np.clip(src_idx, 0, max(len(tokens) - 1, 0))] if len(tokens) else EOS)
    out[row, col] = value
    if seg_out is not None:
        seg_out[row, col] = np.repeat(seg, lens)
    if pos_out is not None:
        pos_out[row, col] = within


def example_packed(shape: tuple[int, int, int], src_vocab: int, tgt_vocab: int, seed: int):
    """A packed batch of random tokens of ``shape`` (a few segments per row) for graph capture."""
    from streamnmt.data.batch import Batch

    r, s, t = shape
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, src_vocab, (r, s), generator=g)
    tgt = torch.randint(4, tgt_vocab, (r, t + 1), generator=g)

    def segs(width: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols = torch.arange(width)
        part = max(width // 4, 1)
        return (cols // part + 1).expand(r, width).contiguous(), (cols % part).expand(r, width).contiguous()

    src_seg, src_pos = segs(s)
    tgt_seg, tgt_pos = segs(t)
    return Batch(src=src, tgt_in=tgt[:, :-1].contiguous(), tgt_out=tgt[:, 1:].contiguous(), ntokens=r * t,
                 src_tokens=r * s, norm=torch.tensor(1.0 / (r * t), dtype=torch.float32), norm_tokens=r * t,
                 src_seg=src_seg, src_pos=src_pos, tgt_seg=tgt_seg, tgt_pos=tgt_pos)
