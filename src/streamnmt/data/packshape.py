"""The shape of every packed batch of a run: ``(rows, src width, tgt width)``, chosen once per corpus.

Kept apart from the sampler because it is a pure function of the corpus's lengths and the batching
settings (every rank computes the same), which the loader and the trainer ask for before any
sampler exists. The target width is ``--max-len`` (or ``--pack-width``) rounded up to
``--pad-multiple`` (the longest target after ``--overlong`` fits), the source width is the corpus's source/target token ratio times
the target width times 1 to 1.25 (at least its longest source), the factor chosen by packing a
sample at each so that the target side stays full and the encoder does little work on padding;
rows = ``--max-tokens`` / target width (without a token budget: enough rows for ``--batch-size``
sentences of the corpus's mean length). One shape per run: graph mode captures one graph and
``--compile`` compiles one.
"""

from __future__ import annotations

import numpy as np

from streamnmt.data.packrows import WINDOW, pack_rows
from streamnmt.errors import ConfigError

_SHAPE_CACHE: dict[tuple, int] = {}  # source widths chosen by pack_shape
# Source widths tried: target width x the corpus's source/target token ratio x each slack.
SRC_SLACKS = (1.0, 1.05, 1.1, 1.15, 1.2, 1.25)
# What a source position costs relative to a target position. Per layer both sides run the same
# matrices (a source position: self-attention 4 d^2, FFN 2 d d_ff and the decoder's cross-attention
# keys/values 2 d^2; a target position: 6 d^2 + 2 d d_ff), and a target position adds the output
# projection d x V: for the base model at a 32k vocabulary 22M vs 38M multiply-adds, 0.57.
SRC_COST = 0.57
MIN_TGT_FILL = 0.96  # a source width must leave at least this share of target positions real (the
# padding stays near 1 - MIN_TGT_FILL on the whole corpus, whose fill varies a little from the sample's)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_shape(src_lengths: np.ndarray, tgt_lengths: np.ndarray, *, max_len: int, max_tokens: int,
               batch_size: int, pad_multiple: int, width: int | None = None) -> tuple[int, int, int]:
    """(rows, src width, tgt width) of every packed batch of a corpus (see the module docstring).

    The source width is chosen by packing one window of the corpus at each candidate width
    (:data:`SRC_SLACKS`) and keeping the one with the most real target tokens per unit of work
    (``tgt fill x tgt width / (SRC_COST x src width + tgt width)``) among those that leave at
    least :data:`MIN_TGT_FILL` of the target positions real: a wider source row wastes encoder
    work on padding, a narrower one fills its source before its target. Against the fixed 1.25 x
    ratio this replaced (target width 128; docs/PERFORMANCE.md section 9): the built-in corpus
    (40,000 pairs) 280 source columns instead of 288, a long-tailed one (make_longtail.py, 40,000
    pairs) 248 instead of 304, its source fill 95 % instead of 79 % and its target fill 97.5 %
    instead of 99.9 %. A deterministic function of the lengths (every rank computes the same)."""
    t_width = round_up(width or max_len, pad_multiple)
    longest_tgt = int(tgt_lengths.max()) + 1 if len(tgt_lengths) else 1
    if width and t_width < longest_tgt:
        raise ConfigError(f"--pack-width (config key 'pack_width'): {width} positions cannot hold the longest "
                          f"training target ({longest_tgt} with its EOS); give at least {longest_tgt} or leave it "
                          f"to its default")
    src_total, tgt_total = int(src_lengths.sum()) + len(src_lengths), int(tgt_lengths.sum()) + len(tgt_lengths)
    ratio = src_total / max(tgt_total, 1)
    longest_src = int(src_lengths.max()) + 1 if len(src_lengths) else 1
    if max_tokens > 0:
        rows = max(1, max_tokens // t_width)
    else:
        mean_tgt = tgt_total / max(len(tgt_lengths), 1)
        rows = max(1, int(round(batch_size * mean_tgt / t_width)))
    widths = sorted({round_up(max(longest_src, int(np.ceil(t_width * ratio * k))), pad_multiple) for k in SRC_SLACKS})
    if len(widths) == 1 or len(src_lengths) == 0:
        return rows, widths[-1], t_width
    key = (hash(np.asarray(src_lengths).tobytes()), hash(np.asarray(tgt_lengths).tobytes()), t_width, tuple(widths))
    if key not in _SHAPE_CACHE:
        while len(_SHAPE_CACHE) >= 8:
            _SHAPE_CACHE.pop(next(iter(_SHAPE_CACHE)))
        _SHAPE_CACHE[key] = _source_width(np.asarray(src_lengths, np.int64) + 1, np.asarray(tgt_lengths, np.int64) + 1,
                                          widths, t_width)
    return rows, _SHAPE_CACHE[key], t_width


def _source_width(src_len: np.ndarray, tgt_len: np.ndarray, widths: list[int], t_width: int) -> int:
    """The source width of :func:`pack_shape`: pack one window at each of ``widths``; among those
    whose target fill reaches MIN_TGT_FILL, the most real target tokens per unit of work (ties: the
    narrower); if none does, the fullest target side."""
    order = np.random.default_rng(0).permutation(len(src_len))[:WINDOW]
    fill = {w: int(tgt_len[order].sum()) / (len(pack_rows(src_len, tgt_len, order, w, t_width)) * t_width)
            for w in widths}
    full = [w for w in widths if fill[w] >= MIN_TGT_FILL]
    if not full:
        return max(widths, key=lambda w: (fill[w], w))
    return max(full, key=lambda w: (fill[w] * t_width / (SRC_COST * w + t_width), -w))
