"""Attention masks, shared by the model, the data batches and decoding.

Convention: a boolean mask is True where attention is allowed, shaped to broadcast against the
attention scores ``(B, heads, T_query, T_key)``. Special token ids follow the original system.

No mask may hide every key of a query row: scaled-dot-product attention turns such a row into NaN,
and a NaN in a padded row poisons the gradients of the real ones (0 * NaN = NaN). Batches are
padded with whole PAD rows to keep shapes fixed, so :func:`src_mask` always leaves key 0 visible,
and the decoder mask is causal only (targets are right-padded, so a real query never sees a PAD
key anyway).
"""

from __future__ import annotations

import torch

from streamnmt.models.specials import BOS as BOS, EOS as EOS, PAD as PAD, UNK as UNK  # their usual import


def src_mask(src: torch.Tensor) -> torch.Tensor:
    """(B, S) token ids -> (B, 1, 1, S) mask hiding padding keys (key 0 always visible)."""
    keep = src != PAD
    keep[:, 0] = True  # an all-PAD row must still attend somewhere (see module doc)
    return keep[:, None, None, :]


def causal_mask(t: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, 1, T, T) lower-triangular mask: position i sees positions <= i."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril_()[None, None]


def tgt_mask(tgt: torch.Tensor) -> torch.Tensor:
    """(B, T) right-padded decoder input ids -> (1, 1, T, T) causal mask."""
    return causal_mask(tgt.size(1), tgt.device)
