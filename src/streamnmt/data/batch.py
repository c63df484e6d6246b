"""The unit the trainer consumes: one padded batch of sentence pairs, and the collate that makes it.

Shapes are fixed per bucket so that a graph-capture mode can keep one CUDA graph per shape: every
batch of bucket ``L`` is ``src (B, L)``, ``tgt_in (B, L)``, ``tgt_out (B, L)``, a short last batch
being filled with all-PAD rows. The token counts used to normalise the loss are counted here, on
the host, so that the training loop never has to ask the GPU for them.

:func:`collate_host` fills one preallocated NumPy array; at ~600 batches/s the loader has under
2 ms per batch, and a worker process sends NumPy bytes far faster than torch tensors
(see :class:`HostBatch`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.models.masks import BOS, EOS, PAD, src_mask, tgt_mask


@dataclass
class Batch:
    """A padded batch. ``src`` = tokens + EOS, ``tgt_in`` = BOS + tokens, ``tgt_out`` = tokens + EOS.

    Attributes:
        src, tgt_in, tgt_out: int64 tensors, (B, L); PAD (0) after each sentence and in filler rows.
        ntokens: non-PAD tokens in ``tgt_out`` (the loss normaliser), a host int.
        src_tokens: non-PAD tokens in ``src``, a host int.
        index: (B,) int64 NumPy array of each row's position in its corpus, -1 for filler rows.
            Stays on the host (``to`` does not move it), e.g. to match hypotheses to references.
        norm_tokens: target tokens of the whole global step this batch belongs to (all its
            accumulation micro-batches on all ranks), a host int; ``ntokens`` when it is alone.
        norm: () float32 tensor ``1 / norm_tokens``, travelling with the batch to the device: the
            step multiplies its summed loss by it (a static input of graph mode). None: the step
            normalises by the batch's own tokens.
        src_seg, tgt_seg, src_pos, tgt_pos: packed batches only (:mod:`streamnmt.data.packing`):
            int64 segment ids (1, 2, ... per pair in a row, 0 on padding) and positions restarting
            at 0 for each pair, shaped as ``src`` and ``tgt_in``. None: one sentence per row.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    ntokens: int
    src_tokens: int
    index: np.ndarray | None = None
    norm: torch.Tensor | None = None
    norm_tokens: int = 0
    src_seg: torch.Tensor | None = None
    src_pos: torch.Tensor | None = None
    tgt_seg: torch.Tensor | None = None
    tgt_pos: torch.Tensor | None = None

    SEGMENT_FIELDS = ("src_seg", "src_pos", "tgt_seg", "tgt_pos")

    @property
    def packed(self) -> bool:
        return self.src_seg is not None

    def segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(src_seg, tgt_seg, src_pos, tgt_pos) of a packed batch (the model's ``segments``), or None."""
        if self.src_seg is None:
            return None
        return self.src_seg, self.tgt_seg, self.src_pos, self.tgt_pos

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, src length, tgt length), as listed by ``BatchLoader.shapes()``."""
        return (self.src.size(0), self.src.size(1), self.tgt_in.size(1))

    @property
    def src_mask(self) -> torch.Tensor:
        """:func:`streamnmt.models.masks.src_mask` of ``src``, on the tensors' device."""
        return src_mask(self.src)

    @property
    def tgt_mask(self) -> torch.Tensor:
        """:func:`streamnmt.models.masks.tgt_mask` of ``tgt_in``, on the tensors' device."""
        return tgt_mask(self.tgt_in)

    def _tensor_fields(self) -> tuple[str, ...]:
        return ("src", "tgt_in", "tgt_out", "norm", *self.SEGMENT_FIELDS)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        # non_blocking overlaps the copy only from pinned memory (see pin_memory).
        return dataclasses.replace(self, **{
            k: t.to(device, non_blocking=non_blocking) for k in self._tensor_fields()
            if (t := getattr(self, k)) is not None})

    def pin_memory(self) -> Batch:
        """Page-locked copies of the tensors (called by DataLoader's pin-memory thread)."""
        return dataclasses.replace(self, **{k: t.pin_memory() for k in self._tensor_fields()
                                            if (t := getattr(self, k)) is not None})

    def is_pinned(self) -> bool:
        return all(t.is_pinned() for k in self._tensor_fields() if (t := getattr(self, k)) is not None)


@dataclass
class HostBatch:
    """A batch as one NumPy array, the form worker processes send back to the main process.

    A torch tensor crossing processes gets its own shared-memory segment and file descriptor; a
    NumPy array pickles as its bytes, far cheaper for a batch's few small arrays. The main
    process turns it into a :class:`Batch` with ``torch.from_numpy`` (no copy), or, in the
    DataLoader's pin-memory thread, into a pinned one with a single page-locked allocation.
    """

    tokens: np.ndarray  # (3, B, L) int64: src, tgt_in, tgt_out
    ntokens: int
    src_tokens: int
    index: np.ndarray
    norm_tokens: int = 0  # target tokens of the global step (0: this batch's own)

    def to_batch(self) -> Batch:
        return self._wrap(torch.from_numpy(self.tokens), self._norm())

    def pin_memory(self) -> Batch:
        return self._wrap(torch.from_numpy(self.tokens).pin_memory(), self._norm().pin_memory())

    def _norm(self) -> torch.Tensor:
        n = self.norm_tokens or self.ntokens
        return torch.tensor(1.0 / max(n, 1), dtype=torch.float32)  # ()

    def _wrap(self, t: torch.Tensor, norm: torch.Tensor) -> Batch:
        # t[k] are contiguous (B, L) views of one buffer (pinned or not).
        return Batch(t[0], t[1], t[2], ntokens=self.ntokens, src_tokens=self.src_tokens, index=self.index,
                     norm=norm, norm_tokens=self.norm_tokens or self.ntokens)


def collate(corpus: TokenizedCorpus, rows: np.ndarray, length: int, group: np.ndarray | None = None) -> Batch:
    """Build the batch of corpus pairs ``rows`` (-1 = filler row) padded to ``length``; ``group``:
    the rows of its whole global step (all micro-batches, all ranks), whose target tokens
    normalise the loss (default: ``rows``)."""
    return collate_host(corpus, rows, length, group).to_batch()


def collate_host(corpus: TokenizedCorpus, rows: np.ndarray, length: int,
                 group: np.ndarray | None = None) -> HostBatch:
    """:func:`collate` as a :class:`HostBatch`. Vectorised: one gather per side, no loop over rows."""
    b = len(rows)
    tokens = np.full((3, b, length), PAD, np.int64)
    src, tgt_in, tgt_out = tokens  # (B, L) views
    r = np.flatnonzero(rows >= 0)  # rows holding a pair
    i = rows[r]
    n = _fill(src, r, i, corpus.src_tokens, corpus.src_offsets)
    m = _fill(tgt_out, r, i, corpus.tgt_tokens, corpus.tgt_offsets)
    tgt_in[r, 0] = BOS
    tgt_in[:, 1:] = tgt_out[:, :-1]
    inside = m + 1 < length
    tgt_in[r[inside], m[inside] + 1] = PAD  # tgt_in stops before the EOS that tgt_out ends with
    ntokens = int(m.sum()) + len(r)
    norm_tokens = ntokens
    if group is not None and group is not rows:
        g = group[group >= 0]
        norm_tokens = int(corpus.tgt_lengths[g].sum()) + len(g)  # + EOS each, as ``ntokens``
    return HostBatch(tokens, ntokens=ntokens, src_tokens=int(n.sum()) + len(r), index=rows,
                     norm_tokens=norm_tokens)


def _fill(out: np.ndarray, r: np.ndarray, i: np.ndarray, tokens: np.ndarray,
          offsets: np.ndarray) -> np.ndarray:
    """Write pair ``i[k]``'s tokens then EOS into row ``r[k]`` of ``out``; return the lengths."""
    start, end = offsets[i], offsets[i + 1]
    n = end - start  # (R,) sentence lengths
    total = int(n.sum())
    row = np.repeat(r, n)
    first = np.repeat(np.cumsum(n) - n, n)  # flat position where each row's run starts
    pos = np.arange(total) - first  # column within the row
    out[row, pos] = tokens[np.repeat(start, n) + pos]
    out[r, n] = EOS
    return n
