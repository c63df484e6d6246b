"""The unit the trainer consumes: one padded batch of sentence pairs, and the collate that makes it.

Shapes are fixed per bucket so that a graph-capture mode can keep one CUDA graph per shape: every
batch of bucket ``L`` is ``src (B, L)``, ``tgt_in (B, L)``, ``tgt_out (B, L)``, a short last batch
being filled with all-PAD rows. The token counts used to normalise the loss are counted here, on
the host, so that the training loop never has to ask the GPU for them.

:func:`collate` fills preallocated NumPy arrays and wraps them with ``torch.from_numpy``: at ~600
batches/s the loader has under 2 ms per batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.masks import BOS, EOS, PAD, src_mask, tgt_mask


@dataclass
class Batch:
    """A padded batch. ``src`` = tokens + EOS, ``tgt_in`` = BOS + tokens, ``tgt_out`` = tokens + EOS.

    Attributes:
        src, tgt_in, tgt_out: int64 tensors, (B, L); PAD (0) after each sentence and in filler rows.
        ntokens: non-PAD tokens in ``tgt_out`` (the loss normaliser), a host int.
        src_tokens: non-PAD tokens in ``src``, a host int.
        index: (B,) int64 NumPy array of each row's position in its corpus, -1 for filler rows.
            Stays on the host (``to`` does not move it), e.g. to match hypotheses to references.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    ntokens: int
    src_tokens: int
    index: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, src length, tgt length), as listed by ``BatchLoader.shapes()``."""
        return (self.src.size(0), self.src.size(1), self.tgt_in.size(1))

    @property
    def src_mask(self) -> torch.Tensor:
        """:func:`streamnmt.masks.src_mask` of ``src``, on the tensors' device."""
        return src_mask(self.src)

    @property
    def tgt_mask(self) -> torch.Tensor:
        """:func:`streamnmt.masks.tgt_mask` of ``tgt_in``, on the tensors' device."""
        return tgt_mask(self.tgt_in)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        # non_blocking overlaps the copy only from pinned memory (see pin_memory).
        return dataclasses.replace(
            self, src=self.src.to(device, non_blocking=non_blocking),
            tgt_in=self.tgt_in.to(device, non_blocking=non_blocking),
            tgt_out=self.tgt_out.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Page-locked copies of the tensors (called by DataLoader's pin-memory thread)."""
        return dataclasses.replace(self, src=self.src.pin_memory(), tgt_in=self.tgt_in.pin_memory(),
                                   tgt_out=self.tgt_out.pin_memory())

    def is_pinned(self) -> bool:
        return all(t.is_pinned() for t in (self.src, self.tgt_in, self.tgt_out))


def collate(corpus: TokenizedCorpus, rows: np.ndarray, length: int) -> Batch:
    """Build the batch of corpus pairs ``rows`` (-1 = filler row) padded to ``length``.

    Vectorised: one gather per side instead of a Python loop over rows.
    """
    b = len(rows)
    src = np.full((b, length), PAD, np.int64)  # (B, L)
    tgt_in = np.full((b, length), PAD, np.int64)  # (B, L)
    tgt_out = np.full((b, length), PAD, np.int64)  # (B, L)
    r = np.flatnonzero(rows >= 0)  # rows holding a pair
    i = rows[r]
    n = _fill(src, r, i, corpus.src_tokens, corpus.src_offsets)
    m = _fill(tgt_out, r, i, corpus.tgt_tokens, corpus.tgt_offsets)
    tgt_in[r, 0] = BOS
    tgt_in[:, 1:] = tgt_out[:, :-1]
    inside = m + 1 < length
    tgt_in[r[inside], m[inside] + 1] = PAD  # tgt_in stops before the EOS that tgt_out ends with
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                 ntokens=int(m.sum()) + len(r), src_tokens=int(n.sum()) + len(r), index=rows)


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
