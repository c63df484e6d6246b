"""Attention masks of packed rows: attention never crosses the pairs packed into one row.

A packed row (:mod:`streamnmt.data.packing`) holds several pairs; ``src_seg``/``tgt_seg`` number
them 1, 2, ... (0 on padding). Three masks follow from the segment ids alone:

* encoder self-attention: query and key in the same source segment;
* decoder self-attention: same target segment, and causal;
* cross-attention: target segment ``k`` sees source segment ``k`` only.

Padding positions (segment 0) see the other padding positions (themselves at least) and, across
attention, every source position: no query row is ever fully masked, which would make SDPA return
NaN and poison the gradients of the real rows (see :mod:`streamnmt.models.masks`).

Two implementations, chosen by ``--attention``:

* ``sdpa``: dense boolean masks ``(B, 1, Tq, Tk)`` built on the device from the segment ids (a few
  elementwise kernels, no host sync, capturable), fed to ``F.scaled_dot_product_attention``
  (the memory-efficient kernel on the GPU; attention dropout as for unpacked batches);
* ``flex``: ``torch.nn.attention.flex_attention`` with block masks (blocks of fully masked keys
  are skipped). Needs torch >= 2.5 and a compiled kernel; it has no attention-probability dropout,
  so training with it drops only the other dropouts. Falls back to ``sdpa`` where it is missing.

``auto`` is ``sdpa``: it keeps the training recipe's attention dropout; ``streamnmt bench
--attention`` measures both at the packed shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

ATTENTION_CHOICES = ("auto", "sdpa", "flex")


@dataclass
class SegmentMasks:
    """The three attention masks of a packed batch (dense bool tensors or flex BlockMasks) and the
    positions of each token within its pair."""

    enc: Any
    dec: Any
    cross: Any
    src_pos: torch.Tensor
    tgt_pos: torch.Tensor


def dense_masks(src_seg: torch.Tensor, tgt_seg: torch.Tensor, dtype: torch.dtype | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(enc (B,1,S,S), dec (B,1,T,T), cross (B,1,T,S)) boolean masks, True = may attend; with a
    floating ``dtype``, additive masks of that dtype instead (0 = may attend, -inf = may not)."""
    t = tgt_seg.size(1)
    enc = src_seg[:, :, None] == src_seg[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=tgt_seg.device).tril_()
    dec = (tgt_seg[:, :, None] == tgt_seg[:, None, :]) & causal
    cross = (tgt_seg[:, :, None] == src_seg[:, None, :]) | (tgt_seg == 0)[:, :, None]
    masks = enc[:, None], dec[:, None], cross[:, None]
    if dtype is None:
        return masks
    return tuple(torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
                 for m in masks)  # type: ignore[return-value]


def sdpa_mask_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype of the packed masks fed to SDPA: autocast's where it is on, so that the attention
    kernels read an additive mask of their own dtype (a boolean one is turned into that on every
    call: 0.02-0.08 ms more per call, forward and backward, at the packed base-model shape on an
    H200); None (boolean masks) otherwise."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def flex_importable() -> str | None:
    """None if this torch has FlexAttention, else why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def flex_available(device: torch.device) -> str | None:
    """None if FlexAttention can train on ``device``, else why not (it has no CPU backward)."""
    why = flex_importable()
    if why is None and device.type != "cuda":
        why = f"FlexAttention trains on CUDA only (no backward on {device.type})"
    return why


def resolve_attention(choice: str, device: torch.device, log=print) -> str:
    """``auto`` -> ``sdpa``; ``flex`` where FlexAttention is missing -> ``sdpa`` with one log line."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}; got {choice!r}")
    if choice == "flex":
        why = flex_available(device)
        if why is None:
            return "flex"
        log(f"model: --attention flex unavailable ({why}); using sdpa")
        return "sdpa"
    return "sdpa"


def flex_masks(src_seg: torch.Tensor, tgt_seg: torch.Tensor,
               block_size: int | None = None) -> tuple[Any, Any, Any]:
    """(enc, dec, cross) FlexAttention BlockMasks of the same rules as :func:`dense_masks`, in blocks
    of ``block_size`` positions (None: FlexAttention's default, 128)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = src_seg.shape
    t = tgt_seg.size(1)
    dev = src_seg.device

    def enc(bi, h, q, k):
        return src_seg[bi, q] == src_seg[bi, k]

    def dec(bi, h, q, k):
        return (tgt_seg[bi, q] == tgt_seg[bi, k]) & (k <= q)

    def cross(bi, h, q, k):
        return (tgt_seg[bi, q] == src_seg[bi, k]) | (tgt_seg[bi, q] == 0)

    sized = {} if block_size is None else {"BLOCK_SIZE": block_size}
    block = functools.partial(create_block_mask, B=b, H=None, device=dev, **sized)
    return block(enc, Q_LEN=s, KV_LEN=s), block(dec, Q_LEN=t, KV_LEN=t), block(cross, Q_LEN=t, KV_LEN=s)


def segment_masks(kind: str, src_seg: torch.Tensor, tgt_seg: torch.Tensor, src_pos: torch.Tensor,
                  tgt_pos: torch.Tensor) -> SegmentMasks:
    if kind == "flex":
        return SegmentMasks(*flex_masks(src_seg, tgt_seg), src_pos=src_pos, tgt_pos=tgt_pos)
    return SegmentMasks(*dense_masks(src_seg, tgt_seg, sdpa_mask_dtype(src_seg.device)), src_pos=src_pos,
                        tgt_pos=tgt_pos)


def is_block_mask(mask: Any) -> bool:
    return mask is not None and not isinstance(mask, torch.Tensor)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """FlexAttention of (B, h, T, dk) tensors under ``block_mask``: compiled on CUDA (the eager
    path materialises the scores), eager elsewhere and inside an outer ``torch.compile``."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_flex()(q, k, v, block_mask=block_mask)
    return flex_attention(q, k, v, block_mask=block_mask)
