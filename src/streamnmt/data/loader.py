"""BatchLoader: a DataLoader over planned batches, with resumable order and pinned output.

Training batches are packed (:mod:`streamnmt.data.packing`, ``--pack``) or bucketed by length
(:mod:`streamnmt.data.sampler`); evaluation batches are packed in the training's shape where training packs, else bucketed.

The GPU strategies need the host to have the next batch ready before the current step ends, so
batches are built ahead in worker processes. Order must not depend on how many workers there are:
the main process's :class:`~streamnmt.data.sampler.BucketSampler` hands each worker a whole
planned batch ``(L, rows)`` and the DataLoader returns results in sampler order. The loader counts
the batches it has handed out, which is the position a checkpoint saves.

Usage::

    loader = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=True)
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)          # a no-op for the epoch a loaded state is in the middle of
        for batch in loader:             # Batch, shape in loader.shapes()
            ...
            ckpt["data"] = loader.state_dict()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from streamnmt.data.batch import Batch, HostBatch, collate_host
from streamnmt.data.config import DataConfig
from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.data.packbatch import PackedHostBatch, collate_packed
from streamnmt.data.packing import PackedPlan, PackSampler
from streamnmt.data.packshape import pack_shape
from streamnmt.data.sampler import BucketSampler, PlannedBatch, bucket_lengths
from streamnmt.data.workers import detach
from streamnmt.errors import InputError


class _PlannedBatches(Dataset):
    """Maps a planned batch ``(L, rows)`` to its :class:`HostBatch` (runs in the worker processes)."""

    def __init__(self, corpus: TokenizedCorpus) -> None:
        self.corpus = corpus

    def __getitem__(self, item: PlannedBatch | PackedPlan) -> HostBatch | PackedHostBatch:
        if isinstance(item, PackedPlan):
            return collate_packed(self.corpus, item)
        length, rows, group = item
        return collate_host(self.corpus, rows, length, group)


def _die_with_parent(worker_id: int) -> None:
    detach()  # see streamnmt.data.workers


def _as_is(batch: HostBatch) -> HostBatch:
    return batch


class BatchLoader:
    """Iterates :class:`Batch` objects of one corpus; see the module docstring."""

    def __init__(self, corpus: TokenizedCorpus, cfg: DataConfig, *, train: bool, seed: int,
                 pin_memory: bool, accum: int = 1, world: int = 1, rank: int = 0,
                 packed_shape: tuple[int, int, int] | None = None) -> None:
        self.corpus = corpus
        self.train = train
        self.sampler = make_sampler(corpus, cfg, train=train, seed=seed, accum=accum, world=world, rank=rank,
                                    packed_shape=packed_shape)
        # Pinning needs a CUDA driver; on a machine without one it is not attempted.
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())
        extra: dict[str, Any] = {}
        if cfg.workers > 0:
            extra = {"prefetch_factor": cfg.prefetch_factor, "persistent_workers": True}
        self.workers = cfg.workers
        # The DataLoader draws a seed for its workers each time an iterator starts; its own
        # generator keeps that draw out of the global RNG, whose state (dropout) a checkpoint
        # saves: otherwise a resumed run, which starts an iterator mid-epoch, would diverge.
        self._loader = DataLoader(_PlannedBatches(corpus), sampler=self.sampler, batch_size=None,
                                  collate_fn=_as_is, num_workers=cfg.workers,
                                  pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(seed),
                                  worker_init_fn=_die_with_parent, **extra)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.sampler)

    def close(self) -> None:
        """End the worker processes now (a run that failed): they ignore SIGTERM (see
        :mod:`streamnmt.data.workers`), so the interpreter's exit, which sends it to its daemon
        children and joins them, would wait for them forever while a traceback keeps the loader's
        iterator alive. The DataLoader's own shutdown asks them to exit and joins them."""
        it = getattr(self._loader, "_iterator", None)  # persistent workers: the DataLoader keeps it
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._loader._iterator = None

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch (all of it for an evaluation loader); then the epoch ends."""
        s = self.sampler
        if not self.train:
            s.position = 0
        for batch in self._loader:
            s.position += 1
            # The pin-memory thread has already made a (pinned) Batch; otherwise wrap here (no copy).
            yield batch if isinstance(batch, Batch) else batch.to_batch()
        s.epoch, s.position = s.epoch + 1, 0

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def position(self) -> int:
        """Batches of the current epoch already handed out."""
        return self.sampler.position

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def shapes(self) -> list[tuple[int, int, int]]:
        """The declared batch shapes (B, src length, tgt length); every batch has one of them."""
        return self.sampler.shapes()

    def num_tokens(self) -> dict[str, float]:
        """Real vs padded token counts of one epoch (filler rows included in the padded count)."""
        if isinstance(self.sampler, PackSampler):
            return self._packed_tokens()
        src, tgt = self.corpus.num_tokens()
        n = len(self.corpus)
        padded = sum(b * L * len_ for (b, L, _), len_ in zip(self.shapes(), self._batches_per_bucket()))
        return {"pairs": n, "src_tokens": src + n, "tgt_tokens": tgt + n, "padded_per_side": padded,
                "tgt_fill": (tgt + n) / padded if padded else 0.0}

    def _packed_tokens(self) -> dict[str, float]:
        """Real vs padded target positions of this rank's packed batches in the current epoch."""
        src, tgt, padded = self.sampler.tokens()
        return {"pairs": len(self.corpus), "src_tokens": src, "tgt_tokens": tgt, "padded_per_side": padded,
                "tgt_fill": tgt / padded if padded else 0.0}

    def _batches_per_bucket(self) -> list[int]:
        sizes = self.sampler.bucket_sizes()
        return [-(-sizes[L] // b) for b, L, _ in self.shapes()]

    def __repr__(self) -> str:
        return (f"BatchLoader({self.corpus.name!r}, batches={len(self)}, shapes={len(self.shapes())}, "
                f"train={self.train}, workers={self.workers}, pin_memory={self.pin_memory})")


def make_sampler(corpus: TokenizedCorpus, cfg: DataConfig, *, train: bool, seed: int, accum: int = 1,
                 world: int = 1, rank: int = 0,
                 packed_shape: tuple[int, int, int] | None = None) -> BucketSampler | PackSampler:
    """Packed rows for training with ``cfg.pack`` (:mod:`streamnmt.data.packing`), else length buckets.
    ``packed_shape``: an evaluation loader packed in that shape (the training's: one shape, one
    validation graph, and no batch shape the run has not already run), in a fixed order; where a
    pair does not fit it, length buckets."""
    if not train and packed_shape is not None:
        try:
            return PackSampler(corpus.src_lengths, corpus.tgt_lengths, packed_shape, shuffle=False, seed=seed,
                               background=False)
        except InputError:
            pass  # a pair longer than the packed row: buckets hold every pair
    if train and cfg.packs:
        shape = pack_shape(corpus.src_lengths, corpus.tgt_lengths, max_len=cfg.max_len, max_tokens=cfg.max_tokens,
                           width=cfg.pack_width,
                           batch_size=cfg.sentences, pad_multiple=cfg.pad_multiple)
        return PackSampler(corpus.src_lengths, corpus.tgt_lengths, shape, shuffle=True, seed=seed, accum=accum,
                           world=world, rank=rank)
    buckets = bucket_lengths(corpus.src_lengths, corpus.tgt_lengths, cfg.pad_multiple)
    return BucketSampler(buckets, batch_size=cfg.sentences, max_tokens=cfg.max_tokens or 0,
                         shuffle=train, seed=seed, accum=accum, world=world, rank=rank)


def make_loader(corpus: TokenizedCorpus, cfg: DataConfig, *, train: bool, seed: int,
                pin_memory: bool, accum: int = 1, world: int = 1, rank: int = 0,
                packed_shape: tuple[int, int, int] | None = None) -> BatchLoader:
    """A shuffled, resumable loader (``train=True``) or a fixed-order evaluation loader (packed in
    ``packed_shape`` where given, see :func:`make_sampler`).

    ``accum`` micro-batches per optimizer step on each of ``world`` ranks; this is rank ``rank``'s
    share (see :mod:`streamnmt.data.sampler`)."""
    return BatchLoader(corpus, cfg, train=train, seed=seed, pin_memory=pin_memory, accum=accum, world=world,
                       rank=rank, packed_shape=packed_shape)

