"""The Transformer encoder-decoder of the original system, in one readable file.

Vaswani et al. (2017) as the original trainer built it: N encoder and N decoder layers, multi-head
attention through ``F.scaled_dot_product_attention`` (fused kernels on the GPU), sinusoidal
positions, source and target embeddings scaled by sqrt(d_model), and a generator to the target
vocabulary (optionally tied: ``ModelShape.tie_embeddings``). Layers are pre-norm with a final
LayerNorm (the Annotated Transformer's layout), which trains stably without a long warm-up.
Self-attention projects queries, keys and values with one fused matrix; embeddings start from
N(0, d_model^-0.5) with the PAD row zero.

Packed batches (several pairs per row, :mod:`streamnmt.data.packing`) pass ``segments`` to
``forward``: attention stays inside each pair (:mod:`streamnmt.models.attention`) and positions restart
for each pair, so every pair computes what it would alone.

Besides ``forward`` for training, the decoder supports incremental decoding: the encoder output's
keys/values are projected once per layer and the self-attention keys/values of earlier positions
are cached (:class:`DecoderCache`), so each new target token costs one position. The decoder step
runs on any cache with DecoderCache's methods; graph decoding gives it a preallocated one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamnmt.models import masks
from streamnmt.models.attention import (
    SegmentMasks,
    SegmentRanges,
    flex,
    is_block_mask,
    segment_masks,
)


@dataclass(frozen=True)
class ModelShape:
    src_vocab: int
    tgt_vocab: int
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    d_ff: int = 2048
    dropout: float = 0.1
    max_positions: int = 1024
    tie_embeddings: str = "none"  # none | decoder (target embedding = generator) | all (and source)
    # Dropout of the attention probabilities and of the feed-forward's hidden activations; None =
    # ``dropout`` (the layout of checkpoints written before these two settings existed).
    attention_dropout: float | None = None
    activation_dropout: float | None = None

    def attention_p(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    def activation_p(self) -> float:
        return self.dropout if self.activation_dropout is None else self.activation_dropout


class MultiHeadAttention(nn.Module):
    """Multi-head attention. A self-attention module (``fused``) projects queries, keys and values
    with one (3D, D) matrix ``qkv`` (one GEMM); cross-attention keeps ``q`` and a fused ``kv``.
    ``mask``: a boolean tensor (True = may attend), a FlexAttention BlockMask (packed batches with
    ``--attention flex``), or None."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, fused: bool = False):
        super().__init__()
        self.h, self.dk, self.d = n_heads, d_model // n_heads, d_model
        self.fused = fused
        if fused:
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self._register_load_state_dict_pre_hook(self._fuse_old_weights)
        else:
            self.q = nn.Linear(d_model, d_model)
            self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    @staticmethod
    def _fuse_old_weights(state_dict: dict, prefix: str, *args) -> None:
        """Checkpoints written before the fused projection hold ``q`` and ``kv``: concatenate them."""
        for kind in ("weight", "bias"):
            q, kv = f"{prefix}q.{kind}", f"{prefix}kv.{kind}"
            if q in state_dict and kv in state_dict and f"{prefix}qkv.{kind}" not in state_dict:
                state_dict[f"{prefix}qkv.{kind}"] = torch.cat([state_dict.pop(q), state_dict.pop(kv)])

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.dk).transpose(1, 2)  # (B, h, T, dk)

    def _project_q(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.linear(x, self.qkv.weight[:self.d], self.qkv.bias[:self.d])
        return self.q(x)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = F.linear(x, self.qkv.weight[self.d:], self.qkv.bias[self.d:]) if self.fused else self.kv(x)
        k, v = kv.chunk(2, dim=-1)
        return self.split(k), self.split(v)  # 2 x (B, h, S, dk)

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        return self._attention(self.split(self._project_q(x)), k, v, mask, causal)  # (B, T, D)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, causal: bool) -> torch.Tensor:
        if isinstance(mask, SegmentRanges):  # the Triton segment kernels (packed batches); no attention dropout
            from streamnmt.models.segattn_triton import segment_attention

            y = segment_attention(q, k, v, mask)
        elif is_block_mask(mask):  # FlexAttention (packed batches); it has no attention dropout
            y = flex(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                dropout_p=self.dropout if self.training else 0.0)
        b, _, t, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, self.h * self.dk))  # (B, T, D)

    def forward(self, x: torch.Tensor, mem: torch.Tensor, mask: Any, causal: bool = False) -> torch.Tensor:
        if self.fused and mem is x:  # self-attention: one GEMM for queries, keys and values
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self._attention(self.split(q), self.split(k), self.split(v), mask, causal)
        k, v = self.project_kv(mem)
        return self.attend(x, k, v, mask, causal)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that keeps a half-precision input in its dtype under autocast.

    Autocast runs layer norm in fp32: a bf16 input is copied to fp32, normalised, written in fp32,
    and copied back to bf16 by the next matrix multiply, and the residual stream around it stays
    fp32. Here a bf16/fp16 input is normalised by the same kernel in its own dtype (statistics in
    fp32 inside the kernel) with the fp32 weights cast to it, as a model held in bf16 does; fp32
    inputs (the CPU, fp32 training) take the plain path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype or not torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """The residual stream in autocast's dtype where autocast is on (as a bf16 model holds it: every
    elementwise pass over it moves half the bytes), else as it is."""
    dev = x.device.type
    return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.w1, self.w2, self.drop = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(F.relu(self.w1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.ln1, self.ln2 = LayerNorm(s.d_model), LayerNorm(s.d_model)
        self.attn = MultiHeadAttention(s.d_model, s.n_heads, s.attention_p(), fused=True)
        self.ff = FeedForward(s.d_model, s.d_ff, s.activation_p())
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, mask))
        return x + self.drop(self.ff(self.ln2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = (LayerNorm(s.d_model) for _ in range(3))
        self.self_attn = MultiHeadAttention(s.d_model, s.n_heads, s.attention_p(), fused=True)
        self.cross_attn = MultiHeadAttention(s.d_model, s.n_heads, s.attention_p())
        self.ff = FeedForward(s.d_model, s.d_ff, s.activation_p())
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor, mem: torch.Tensor, src_mask: torch.Tensor,
                tgt_mask: torch.Tensor | None) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.self_attn(h, h, tgt_mask, causal=True))
        x = x + self.drop(self.cross_attn(self.ln2(x), mem, src_mask))
        return x + self.drop(self.ff(self.ln3(x)))

    def step(self, x: torch.Tensor, cache: DecoderCache, i: int, src_mask: torch.Tensor) -> torch.Tensor:
        """One new position x (B, 1, D) as layer ``i``; writes its keys/values into ``cache``."""
        h = self.ln1(x)
        k, v, mask = cache.append(i, *self.self_attn.project_kv(h))  # every position so far
        x = x + self.drop(self.self_attn.attend(h, k, v, mask))
        mk, mv = cache.memory(i)
        x = x + self.drop(self.cross_attn.attend(self.ln2(x), mk, mv, src_mask))
        return x + self.drop(self.ff(self.ln3(x)))


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        # Computed on the CPU whatever device the model is built on (a `with torch.device(...)`
        # block): the GPU's sin/cos differ in the last bits, and a model built for inference
        # must hold the table it was trained with.
        pos = torch.arange(max_positions, device="cpu").unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, device="cpu") * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_positions, d_model, device="cpu")
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: torch.Tensor, start: int | torch.Tensor = 0, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        if positions is not None:  # (B, T) positions of a packed batch (restarting for each pair)
            return x + F.embedding(positions, self.pe)
        if isinstance(start, torch.Tensor):  # a position held on the device (graph decoding): one row
            return x + self.pe.index_select(0, start.view(1))
        return x + self.pe[start:start + x.size(1)]


class DecoderCache:
    """Per-layer cached keys/values of one batch of decoder states (rows can be re-selected).

    Self-attention keys/values grow by one position per step (``torch.cat``): the simplest cache,
    which the tests hold the search's preallocated one against. The search itself decodes on
    :class:`streamnmt.inference.search.StaticCache` (fixed width, the same methods), which
    :meth:`Transformer.decode_step` runs unchanged.
    """

    def __init__(self, layers: list[dict]):
        self.layers = layers
        self.pos = 0  # positions decoded so far

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Add layer ``i``'s keys/values of the new position (B, h, 1, dk); return all of them and
        the mask over them (None: every cached position is visible)."""
        layer = self.layers[i]
        if "k" in layer:
            k = torch.cat([layer["k"], k], dim=2)
            v = torch.cat([layer["v"], v], dim=2)
        layer["k"], layer["v"] = k, v
        return k, v, None  # 2 x (B, h, t, dk)

    def memory(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s cross-attention keys/values of the encoder output, 2 x (B, h, S, dk)."""
        return self.layers[i]["mk"], self.layers[i]["mv"]

    def advance(self) -> None:
        self.pos += 1

    def select(self, index: torch.Tensor) -> None:
        """Keep/reorder batch rows (beam reordering, retiring finished sentences)."""
        for layer in self.layers:
            for key in layer:
                layer[key] = layer[key].index_select(0, index)


class Transformer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        s = self.shape = shape
        if s.d_model % s.n_heads:
            raise ValueError(f"n_heads ({s.n_heads}) must divide d_model ({s.d_model})")
        self.src_embed = nn.Embedding(s.src_vocab, s.d_model, padding_idx=masks.PAD)
        self.tgt_embed = nn.Embedding(s.tgt_vocab, s.d_model, padding_idx=masks.PAD)
        self.pos = PositionalEncoding(s.d_model, s.max_positions)
        self.drop = nn.Dropout(s.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(s) for _ in range(s.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(s) for _ in range(s.n_layers))
        self.enc_norm, self.dec_norm = LayerNorm(s.d_model), LayerNorm(s.d_model)
        self.generator = nn.Linear(s.d_model, s.tgt_vocab)
        self.scale = math.sqrt(s.d_model)
        self.tie_weights()
        self.attention = "sdpa"  # how packed batches attend: sdpa (dense masks) or flex (set_attention)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices (the fused qkv as a q block and a kv block), embeddings from
        N(0, d_model^-0.5) with the PAD row zero: scaled by sqrt(d_model) they have unit variance,
        on the scale of the positional signal whatever the vocabulary size (Xavier's bound shrinks
        with it)."""
        embeds = {id(self.src_embed.weight), id(self.tgt_embed.weight)}
        for p in self.parameters():  # a shared tensor is listed (and initialised) once
            if p.dim() > 1 and id(p) not in embeds:
                nn.init.xavier_uniform_(p)
        for m in self.modules():
            if isinstance(m, MultiHeadAttention) and m.fused:
                with torch.no_grad():  # as the separate q (D x D) and kv (2D x D) projections were
                    nn.init.xavier_uniform_(m.qkv.weight[:m.d])
                    nn.init.xavier_uniform_(m.qkv.weight[m.d:])
        for emb in (self.src_embed, self.tgt_embed):  # tied: the same tensor twice, same init
            nn.init.normal_(emb.weight, 0.0, self.shape.d_model ** -0.5)
            with torch.no_grad():
                emb.weight[masks.PAD].zero_()

    def set_attention(self, kind: str) -> None:
        """``sdpa``, ``flex`` or ``triton``: how packed batches' segment masks are applied (see
        streamnmt.models.attention)."""
        if kind not in ("sdpa", "flex", "triton"):
            raise ValueError(f"attention must be sdpa, flex or triton; got {kind!r}")
        self.attention = kind

    def tie_weights(self) -> None:
        """Make the tied embeddings one Parameter (Press & Wolf 2017): the generator's (V, D) weight
        is the target embedding; with ``all`` the source embedding is too (one shared vocabulary)."""
        tie = self.shape.tie_embeddings
        if tie not in ("none", "decoder", "all"):
            raise ValueError(f"tie_embeddings must be none, decoder or all; got {tie!r}")
        if tie == "all" and self.shape.src_vocab != self.shape.tgt_vocab:
            raise ValueError(f"tie_embeddings 'all' needs one vocabulary for both sides; got "
                             f"{self.shape.src_vocab} source and {self.shape.tgt_vocab} target pieces")
        if tie in ("decoder", "all"):
            self.generator.weight = self.tgt_embed.weight
        if tie == "all":
            self.src_embed.weight = self.tgt_embed.weight

    def encode(self, src: torch.Tensor, src_mask: Any, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) ids -> (B, S, D); ``positions`` (B, S): a packed batch's positions within each pair."""
        x = _compute_dtype(self.drop(self.pos(self.src_embed(src) * self.scale, positions=positions)))  # (B, S, D)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x)

    def decode(self, mem: torch.Tensor, src_mask: Any, tgt: torch.Tensor,
               tgt_mask: Any = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """All target positions at once; ``tgt_mask`` None means causal (fused kernel path)."""
        x = _compute_dtype(self.drop(self.pos(self.tgt_embed(tgt) * self.scale, positions=positions)))  # (B, T, D)
        for layer in self.decoder:
            x = layer(x, mem, src_mask, tgt_mask)
        return self.dec_norm(x)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor,
                tgt_mask: torch.Tensor | None = None,
                segments: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """(B, S) source ids, (B, T) decoder input ids -> (B, T, V) logits.

        ``segments``: ``(src_seg, tgt_seg, src_pos, tgt_pos)`` of a packed batch (``Batch.segments()``):
        attention stays inside each pair and positions restart per pair; ``src_mask`` and
        ``tgt_mask`` are then not used."""
        return self.generator(self.features(src, tgt, src_mask, tgt_mask, segments))

    def features(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor,
                 tgt_mask: torch.Tensor | None = None,
                 segments: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """:meth:`forward` without the generator: the (B, T, D) decoder output."""
        if segments is None:
            return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)
        m: SegmentMasks = segment_masks(self.attention, *segments)
        return self.decode(self.encode(src, m.enc, m.src_pos), m.cross, tgt, m.dec, m.tgt_pos)

    # -- incremental decoding -------------------------------------------------------------
    def init_cache(self, mem: torch.Tensor) -> DecoderCache:
        """Project the encoder output to cross-attention keys/values once per layer."""
        layers = []
        for layer in self.decoder:
            mk, mv = layer.cross_attn.project_kv(mem)
            layers.append({"mk": mk, "mv": mv})
        return DecoderCache(layers)

    def decode_step(self, y: torch.Tensor, src_mask: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """(B,) last target ids -> (B, V) log-probabilities of the next token; updates ``cache``."""
        x = self.drop(self.pos(self.tgt_embed(y[:, None]) * self.scale, start=cache.pos))  # (B, 1, D)
        for i, layer in enumerate(self.decoder):
            x = layer.step(x, cache, i, src_mask)
        cache.advance()
        return F.log_softmax(self.generator(self.dec_norm(x))[:, 0].float(), dim=-1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def make_model(src_vocab: int, tgt_vocab: int, d_model: int = 512, n_layers: int = 6, n_heads: int = 8,
               d_ff: int = 2048, dropout: float = 0.1, max_positions: int = 1024,
               tie_embeddings: str = "none", attention_dropout: float | None = None,
               activation_dropout: float | None = None) -> Transformer:
    """A Transformer of this shape (``attention_dropout``/``activation_dropout`` None = ``dropout``)."""
    return Transformer(ModelShape(src_vocab, tgt_vocab, d_model, n_layers, n_heads, d_ff, dropout, max_positions,
                                  tie_embeddings, attention_dropout, activation_dropout))
