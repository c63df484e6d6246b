"""Packed batches as tensors: the buffer a loader worker fills for a planned micro-batch, and its views.

Kept apart from the sampler because it runs where the batches are built (the loader's workers)
and deals in tokens, not lengths: :func:`collate_packed` writes a :class:`~streamnmt.data.packing.PackedPlan`'s
pairs back to back into one NumPy buffer (tokens, segment ids and positions of each side, no loop
over pairs), :class:`PackedHostBatch` turns it into a :class:`~streamnmt.data.batch.Batch` of
views, and :func:`example_packed` makes a random one of a shape for graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.data.packing import PackedPlan
from streamnmt.models.masks import BOS, EOS


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
