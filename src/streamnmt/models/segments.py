"""The ranges of positions each position of a packed row may meet in attention, for the Triton segment
kernels (:mod:`streamnmt.models.segattn_triton`): built once per step on the device from the segment
ids, under the mask rules of :func:`streamnmt.models.attention.dense_masks` (the same pairs, never a
host sync)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SegmentRanges:
    """One attention's segment ids and, per position, the ranges of positions it may meet.

    ``q_seg`` (B, Tq), ``k_seg`` (B, Tk): int32 segment ids. ``lo``/``hi`` (B, Tq): the key positions
    a query may attend lie in [lo, hi). ``qlo``/``qhi`` (B, Tk): the queries that may attend a key
    lie in [qlo, qhi), and, for cross-attention, also in [elo, ehi) (the padding queries)."""

    q_seg: torch.Tensor
    k_seg: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    qlo: torch.Tensor
    qhi: torch.Tensor
    elo: torch.Tensor
    ehi: torch.Tensor
    causal: bool
    cross: bool


def segment_ranges(q_seg: torch.Tensor, k_seg: torch.Tensor, causal: bool, cross: bool) -> SegmentRanges:
    """The ranges of one attention (encoder: ``src, src``; decoder: ``tgt, tgt, causal``; cross:
    ``tgt, src, cross``) under the rules of :func:`streamnmt.models.attention.dense_masks`.

    Each bound is a masked min or max over one side of the rows' pairwise id comparison, as the dense
    masks compare: element-wise work that Inductor fuses into a few reductions. (A scatter by segment
    id with ``amin``/``amax`` was slower a call at the packed shape; docs/PERFORMANCE.md,
    "Triton segment kernels".) An id absent from the other side gives an empty range."""
    tq, tk = q_seg.size(1), k_seg.size(1)
    dev = q_seg.device
    qpos = torch.arange(tq, device=dev, dtype=torch.int32)
    kpos = torch.arange(tk, device=dev, dtype=torch.int32)
    same = q_seg[:, :, None] == k_seg[:, None, :]  # (B, Tq, Tk), the dense masks' comparison
    lo = torch.where(same, kpos, tk).amin(2)
    hi = torch.where(same, kpos, -1).amax(2) + 1
    qlo = torch.where(same, qpos[:, None], tq).amin(1)
    qhi = torch.where(same, qpos[:, None], -1).amax(1) + 1
    if causal:  # a query sees keys up to itself; a key is seen by queries from itself on
        hi = torch.minimum(hi, qpos + 1)
        qlo = torch.maximum(qlo, kpos)
    elo = torch.full_like(qlo, tq)  # empty: a key tile takes the smallest elo of its keys
    ehi = torch.zeros_like(qhi)
    if cross:  # padding queries see every source position
        pad_q = q_seg == 0
        lo, hi = lo.masked_fill(pad_q, 0), hi.masked_fill(pad_q, tk)
        real_k = k_seg != 0  # a padding key is seen by the padding queries through its own range
        pad_first = torch.where(pad_q, qpos, tq).amin(1, keepdim=True)
        pad_last = torch.where(pad_q, qpos, -1).amax(1, keepdim=True)
        elo = torch.where(real_k, pad_first, elo)
        ehi = torch.where(real_k, pad_last + 1, ehi)

    def i32(t: torch.Tensor) -> torch.Tensor:  # the kernels index (B, T) rows without strides
        return t.to(torch.int32).contiguous()

    return SegmentRanges(i32(q_seg), i32(k_seg), i32(lo), i32(hi), i32(qlo), i32(qhi), i32(elo), i32(ehi), causal,
                         cross)


def visited_fraction(r: SegmentRanges, query: int, key: int) -> torch.Tensor:
    """The share of the rows' position pairs (tiles of ``query`` x ``key`` positions) whose tiles the
    Triton kernels' forward visits, as a 0-dim tensor on the ranges' device."""
    b, tq = r.lo.shape
    tk = r.k_seg.size(1)
    n_q, n_k = -(-tq // query), -(-tk // key)
    pad = n_q * query - tq
    lo = torch.nn.functional.pad(r.lo.long(), (0, pad), value=tk).view(b, n_q, query).amin(-1)
    hi = torch.nn.functional.pad(r.hi.long(), (0, pad), value=0).view(b, n_q, query).amax(-1)
    tiles = torch.div(hi + key - 1, key, rounding_mode="floor") - torch.div(lo, key, rounding_mode="floor")
    return tiles.clamp(min=0).sum() / (b * n_q * n_k)
