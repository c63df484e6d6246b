"""The search's decoder cache: keys and values of every hypothesis in preallocated, fixed-shape buffers.

Kept apart from the search (:mod:`streamnmt.inference.search`) because it is the model's side of
it: it implements the decoder's cache interface (``DecoderCache`` of
:mod:`streamnmt.models.transformer`: append, memory, advance, reorder) over buffers that never
move, which is what lets :mod:`streamnmt.inference.graph_search` capture a step in a CUDA graph,
while the eager search shrinks it as sentences finish (:meth:`StaticCache.select`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamnmt.models.transformer import Transformer


class StaticCache:
    """Decoder cache of ``n`` rows in preallocated buffers; the methods of DecoderCache.

    Self-attention keys/values live in buffers ``width`` slots long, laid out (W, N, h, dk) so
    that the first ``span`` slots are one contiguous block; a step writes slot ``pos`` (a device
    value: ``index_copy_``, no ``cat``) and reads the first ``span`` slots (a host value, fixed per
    captured graph) through the mask ``slot <= pos``; the eager search reads exactly pos + 1 slots
    (``exact``) and needs no mask. Beam reordering gathers the used slots into a second set of
    buffers and swaps the two (one read and one write of the cache, not two of each). The
    cross-attention keys/values of the encoder output are projected once per batch.
    """

    def __init__(self, model: Transformer, n: int, src_width: int, width: int, dtype: torch.dtype,
                 device: torch.device, exact: bool = False, reorders: bool = True):
        s = model.shape
        heads, dk = s.n_heads, s.d_model // s.n_heads
        kw = dict(dtype=dtype, device=device)
        layers = range(len(model.decoder))
        self.k = [torch.zeros(width, n, heads, dk, **kw) for _ in layers]  # (W, N, h, dk) per layer
        self.v = [torch.zeros(width, n, heads, dk, **kw) for _ in layers]
        # Reorder targets, kept for captured steps (fixed addresses); an eager step allocates its own.
        spares = 2 * len(layers) if reorders and not exact else 0
        self.spare = [torch.zeros(width, n, heads, dk, **kw) for _ in range(spares)]
        self.mk = [torch.zeros(n, heads, src_width, dk, **kw) for _ in layers]  # (N, h, S, dk)
        self.mv = [torch.zeros(n, heads, src_width, dk, **kw) for _ in layers]
        self.src_mask = torch.zeros(n, 1, 1, src_width, dtype=torch.bool, device=device)  # (N, 1, 1, S)
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # positions decoded so far
        self.keys = torch.arange(width, device=device)  # (W,) position of each key slot
        self.span = width  # key slots the next step reads (must exceed pos)
        self.exact = exact  # span is exactly pos + 1 (eager decoding): every slot read is visible

    def load(self, model: Transformer, mem: Tensor, src_mask: Tensor, index: Tensor) -> None:
        """Cross-attention K/V of ``mem`` (B, S, D) for rows ``index`` (n,): row r is sentence
        index[r]; rows past n attend to one zero key. Clears the self-attention K/V."""
        n, s = index.numel(), mem.size(1)
        for i, layer in enumerate(model.decoder):
            mk, mv = layer.cross_attn.project_kv(mem)  # 2 x (B, h, S, dk)
            for dst, src in ((self.mk[i], mk), (self.mv[i], mv)):
                dst.zero_()
                dst[:n, :, :s] = src.index_select(0, index)
        for buf in (*self.k, *self.v, *self.spare):
            buf.zero_()  # masked slots are multiplied by 0: they must hold no NaN
        self.src_mask.zero_()
        self.src_mask[:n, :, :, :s] = src_mask.index_select(0, index)
        self.src_mask[n:, :, :, 0] = True  # padding rows: one visible key (see masks.py)
        self.pos.zero_()

    # -- DecoderCache's interface ------------------------------------------------------------
    def append(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        ks, vs = self.k[i][:self.span], self.v[i][:self.span]  # (span, N, h, dk), contiguous
        ks.index_copy_(0, self.pos.view(1), k.permute(2, 0, 1, 3))  # (1, N, h, dk) into slot pos
        vs.index_copy_(0, self.pos.view(1), v.permute(2, 0, 1, 3))
        mask = None if self.exact else (self.keys[:self.span] <= self.pos)[None, None, None]  # (1, 1, 1, span)
        return ks.permute(1, 2, 0, 3), vs.permute(1, 2, 0, 3), mask  # (N, h, span, dk) views

    def memory(self, i: int) -> tuple[Tensor, Tensor]:
        return self.mk[i], self.mv[i]

    def advance(self) -> None:
        self.pos.add_(1)

    def reorder(self, index: Tensor) -> None:
        """Beam reordering of the self-attention K/V (the cross-attention K/V are the same for
        every hypothesis of a sentence, and hypotheses never move to another sentence): gathered
        into the spare buffers, which then become the cache (eagerly: into new buffers, whose
        slots past the span are never read before they are written)."""
        bufs = [*self.k, *self.v]
        spare = self.spare or [torch.empty_like(b) for b in bufs]
        for buf, dst in zip(bufs, spare):
            torch.index_select(buf[:self.span], 1, index, out=dst[:self.span])
        n = len(self.k)
        self.k, self.v = spare[:n], spare[n:]
        self.spare = bufs if self.spare else []

    def select(self, index: Tensor) -> None:
        """Keep rows ``index`` only (the eager search retiring finished sentences)."""
        self.k = [b.index_select(1, index) for b in self.k]
        self.v = [b.index_select(1, index) for b in self.v]
        self.spare = [b.index_select(1, index) for b in self.spare]
        self.mk = [b.index_select(0, index) for b in self.mk]
        self.mv = [b.index_select(0, index) for b in self.mv]
        self.src_mask = self.src_mask.index_select(0, index)
