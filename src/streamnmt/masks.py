"""Attention masks, shared by the model, the data batches and decoding.

Convention: a boolean mask is True where attention is allowed, shaped to broadcast against the
attention scores ``(B, heads, T_query, T_key)``. Special token ids follow the original system.
"""

from __future__ import annotations

import torch

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def src_mask(src: torch.Tensor) -> torch.Tensor:
    """(B, S) token ids -> (B, 1, 1, S) mask hiding padding keys."""
    return (src != PAD)[:, None, None, :]


def causal_mask(t: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, 1, T, T) lower-triangular mask: position i sees positions <= i."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril_()[None, None]


def tgt_mask(tgt: torch.Tensor) -> torch.Tensor:
    """(B, T) decoder input ids -> (B, 1, T, T) mask: causal and hiding padding keys."""
    return causal_mask(tgt.size(1), tgt.device) & (tgt != PAD)[:, None, None, :]
