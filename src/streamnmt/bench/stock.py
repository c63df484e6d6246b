"""The ``stock-ro`` peer: the same training written with stock PyTorch modules, compiled.

What a user writes without streamnmt's model, loss or engine: ``nn.Transformer`` (pre-norm,
``batch_first``; its dropout sites set to the bench's: the residual connections, the attention
weights and the feed-forward's hidden activations), ``nn.Embedding`` scaled by sqrt(d_model) plus a sinusoid
table, an ``nn.Linear`` output layer and ``F.cross_entropy`` with label smoothing over the whole
logits tensor, trained by the bench's own optimizer step (fused Adam, Noam schedule, clipping)
under ``torch.compile(mode="reduce-overhead")``. It trains on the bench's batches, packed ones
included: the segment masks of :func:`streamnmt.models.attention.dense_masks`, expanded to the
``(batch x heads, L, S)`` additive masks ``nn.MultiheadAttention`` takes, and positions that
restart for each pair. Same sizes as the bench's model (``ModelShape``), weights initialised as
``nn.Transformer`` does.

The module returns the summed smoothed loss twice: the plain NLL, which the engine logs beside
it, would be a second pass over the logits that this peer's user would not write.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from streamnmt.models import masks
from streamnmt.models.attention import dense_masks
from streamnmt.models.transformer import ModelShape, PositionalEncoding


class StockLossModel(nn.Module):
    """``(src, tgt_in, tgt_out, segments) -> (loss sum, loss sum)``: the interface of
    :class:`streamnmt.training.step.LossModel`, so the bench's step function drives it unchanged."""

    def __init__(self, shape: ModelShape, label_smoothing: float):
        super().__init__()
        self.shape, self.label_smoothing = shape, label_smoothing
        d = shape.d_model
        self.src_embed = nn.Embedding(shape.src_vocab, d, padding_idx=masks.PAD)
        self.tgt_embed = nn.Embedding(shape.tgt_vocab, d, padding_idx=masks.PAD)
        self.pos = PositionalEncoding(d, shape.max_positions)
        self.drop = nn.Dropout(shape.dropout)
        with warnings.catch_warnings():  # "enable_nested_tensor ... norm_first": inference only
            warnings.simplefilter("ignore", UserWarning)
            self.transformer = nn.Transformer(d, shape.n_heads, shape.n_layers, shape.n_layers, shape.d_ff,
                                              shape.dropout, batch_first=True, norm_first=True)
        # nn.Transformer takes one dropout for its three sites; set the attention weights' and the
        # feed-forward activations' to the bench's (the same recipe as the rows it is compared with)
        for layer in (*self.transformer.encoder.layers, *self.transformer.decoder.layers):
            for attn in (layer.self_attn, getattr(layer, "multihead_attn", None)):
                if attn is not None:
                    attn.dropout = shape.attention_p()
            layer.dropout = nn.Dropout(shape.activation_p())  # between the feed-forward's two linears
        self.generator = nn.Linear(d, shape.tgt_vocab)
        self.scale = math.sqrt(d)

    def _masks(self, src: torch.Tensor, tgt_in: torch.Tensor, segments: tuple[torch.Tensor, ...] | None
               ) -> tuple[torch.Tensor, ...]:
        """(enc, dec, cross) additive masks of shape (B*h, L, S) and the (B, S), (B, T) positions."""
        b, s, t = src.size(0), src.size(1), tgt_in.size(1)
        if segments is None:  # one sentence per row: padding keys masked, the decoder causal
            src_seg = (src != masks.PAD).long()
            tgt_seg = torch.ones_like(tgt_in)
            src_pos = torch.arange(s, device=src.device).expand(b, s)
            tgt_pos = torch.arange(t, device=src.device).expand(b, t)
        else:
            src_seg, tgt_seg, src_pos, tgt_pos = segments
        h = self.shape.n_heads
        enc, dec, cross = dense_masks(src_seg, tgt_seg, torch.float32)  # (B, 1, L, S), 0 / -inf
        heads = tuple(m.expand(-1, h, -1, -1).reshape(b * h, m.size(2), m.size(3)) for m in (enc, dec, cross))
        return (*heads, src_pos, tgt_pos)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor,
                segments: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        enc, dec, cross, src_pos, tgt_pos = self._masks(src, tgt_in, segments)
        x = self.drop(self.pos(self.src_embed(src) * self.scale, positions=src_pos))
        y = self.drop(self.pos(self.tgt_embed(tgt_in) * self.scale, positions=tgt_pos))
        out = self.transformer(x, y, src_mask=enc, tgt_mask=dec, memory_mask=cross)
        logits = self.generator(out)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=masks.PAD,
                               label_smoothing=self.label_smoothing, reduction="sum")
        return loss, loss.detach()
