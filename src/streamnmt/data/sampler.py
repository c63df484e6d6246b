"""Length buckets and the resumable, seeded order in which their batches are served.

The bucket rule (other code depends on it): a pair whose source has ``n`` tokens and target ``m``
feeds ``src_ids = tokens + [EOS]`` (n + 1) and ``tgt_in = [BOS] + tokens`` (m + 1), so its bucket is
``L = max(n + 1, m + 1)`` rounded up to a multiple of ``pad_multiple``. A bucket's batches all have
``B`` rows: ``batch_size``, or ``max(1, max_tokens // L)`` with a token budget. That bounds the set
of batch shapes to one per bucket, which is what CUDA graph capture needs.

The order of an epoch is a pure function of ``(seed, epoch)``: each bucket is shuffled and cut into
batches, then all batches are shuffled together. Evaluation order is fixed: buckets by length,
pairs in corpus order. ``position`` counts the batches already served this epoch, so a saved
``state_dict`` resumes exactly where training stopped.

Global steps (gradient accumulation ``accum`` K, data parallel ``world`` N ranks): the plan is cut
into *global* batches of ``N * K * B`` rows of one bucket, and global batch ``g`` is split in order
into N * K micro-batches of B rows: rank ``r`` serves micro-batches ``r*K .. r*K+K-1``. So every
rank sees the same shape at every step, the ranks' rows are disjoint, and 1 rank x batch 2B,
1 rank x 2 x B (accumulation) and 2 ranks x B all train on the same pairs in the same order. A
short last global batch of a bucket is filled with filler rows (-1), so every global step has all
its N * K micro-batches (some may hold filler rows only: they add nothing to the loss). Each item
carries the rows of its whole global batch, from which the loader counts the global step's target
tokens (the loss normaliser) without any communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from streamnmt.errors import InputError

# One planned batch: (bucket length L, corpus rows with -1 for filler rows, the rows of its
# whole global step on all ranks: the loss normaliser counts their target tokens).
PlannedBatch = tuple[int, np.ndarray, np.ndarray]


def bucket_lengths(src_lengths: np.ndarray, tgt_lengths: np.ndarray, pad_multiple: int) -> np.ndarray:
    """Bucket length of each pair from its token counts (bos/eos not included)."""
    longest = np.maximum(src_lengths, tgt_lengths).astype(np.int64) + 1
    return -(-longest // pad_multiple) * pad_multiple


def bucket_batch_size(length: int, batch_size: int, max_tokens: int) -> int:
    return max(1, max_tokens // length) if max_tokens > 0 else batch_size


class BucketSampler:
    """Yields :data:`PlannedBatch` items for the epoch ``self.epoch`` from ``self.position`` on."""

    def __init__(self, buckets: np.ndarray, *, batch_size: int, max_tokens: int = 0,
                 shuffle: bool, seed: int = 0, accum: int = 1, world: int = 1, rank: int = 0) -> None:
        if not (accum >= 1 and world >= 1 and 0 <= rank < world):
            raise ValueError(f"BucketSampler: accum {accum}, world {world}, rank {rank}")
        self.accum, self.world, self.rank = accum, world, rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        lengths = np.unique(buckets)
        self._members = {int(L): np.flatnonzero(buckets == L) for L in lengths}  # ascending rows
        self._size = {L: bucket_batch_size(L, batch_size, max_tokens) for L in self._members}
        g = accum * world  # micro-batches per global step
        self._num_batches = accum * sum(-(-len(m) // (self._size[L] * g)) for L, m in self._members.items())
        self._plan: tuple[int, list[PlannedBatch]] | None = None

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every batch shape this sampler produces: (B, src length, tgt length), by length."""
        return [(self._size[L], L, L) for L in sorted(self._members)]

    def bucket_sizes(self) -> dict[int, int]:
        """Pairs per bucket length."""
        return {L: len(m) for L, m in sorted(self._members.items())}

    def __len__(self) -> int:
        """Batches this rank serves per epoch (``accum`` per global step)."""
        return self._num_batches

    def empty_rank(self) -> int | None:
        """The first rank that would serve filler rows only in every epoch, or None."""
        biggest = max((len(m) / self._size[L] for L, m in self._members.items()), default=0)
        for r in range(self.world):
            if biggest <= r * self.accum:  # a bucket's rows fill rank r's micro-batches from r*K*B on
                return r
        return None

    def plan(self, epoch: int) -> list[PlannedBatch]:
        """All batches of ``epoch`` in serving order (the last epoch's plan is kept)."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        rng = np.random.default_rng([self.seed & (2**63 - 1), epoch]) if self.shuffle else None
        groups: list[tuple[int, np.ndarray]] = []  # global batches
        k_n = self.accum * self.world
        for L in sorted(self._members):
            rows = rng.permutation(self._members[L]) if rng is not None else self._members[L]
            b = self._size[L] * k_n
            for k in range(0, len(rows), b):
                part = rows[k:k + b]
                if len(part) < b:  # fill a short last batch with all-PAD rows: same shape
                    part = np.concatenate([part, np.full(b - len(part), -1, np.int64)])
                groups.append((L, part.astype(np.int64, copy=False)))
        if rng is not None:
            groups = [groups[k] for k in rng.permutation(len(groups))]
        batches: list[PlannedBatch] = []
        for L, part in groups:  # this rank's micro-batches of each global batch, in order
            b = self._size[L]
            for m in range(self.rank * self.accum, (self.rank + 1) * self.accum):
                batches.append((L, part[m * b:(m + 1) * b], part))
        self._plan = (epoch, batches)
        return batches

    def __iter__(self) -> Iterator[PlannedBatch]:
        # Read once: DataLoader calls iter() at the start of each pass over the loader.
        plan, start = self.plan(self.epoch), self.position
        return iter(plan[start:])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch, unless it is the epoch already in progress."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_batches": self._num_batches, "accum": self.accum, "world": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the data and batching must be those it was saved with.

        A state saved with another global batch (world size x accumulation) resumes at the global
        step that has served as many pairs (rounded up): training goes on, but not bit-exactly
        (:meth:`exact` tells)."""
        state = dict(state)
        old_k, old_n = int(state.get("accum", 1)), int(state.get("world", 1))
        if (old_k, old_n) != (self.accum, self.world) and int(state.get("num_batches", 0)):
            old_steps = int(state["num_batches"]) // old_k      # global steps per epoch then
            new_steps = self._num_batches // self.accum          # and now
            done = int(state["position"]) // old_k
            state["position"] = min(-(-done * new_steps // old_steps), new_steps) * self.accum
            state["num_batches"] = self._num_batches
        saved = int(state.get("num_batches", self._num_batches))
        position = int(state["position"])
        if saved != self._num_batches or not 0 <= position <= saved:
            raise InputError(f"data order state: saved for {saved} batches per epoch (at batch "
                             f"{position}), but this loader has {self._num_batches}; the corpus or the "
                             f"batching settings changed since the checkpoint, so it cannot resume exactly")
        self.epoch, self.position = int(state["epoch"]), position
        self.seed = int(state.get("seed", self.seed))
