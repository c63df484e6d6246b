"""Text in, text out and scored: the part of inference that the trainer shares with the commands.

The trainer computes dev BLEU at each epoch end; ``streamnmt translate`` and ``eval`` translate
files and score splits. All three turn lines of text into encoder input the way the training
batches are built (tokens then EOS), decode them through :mod:`streamnmt.decode` (or, where asked,
:mod:`streamnmt.decode_graph`), detokenize through SentencePiece, and score with sacrebleu (BLEU
with its ``zh`` tokenizer for Chinese targets, ``13a`` otherwise, and chrF). This module holds
those pieces below both the trainer and the commands, so that imports run one way:
``train -> evaluation`` and ``translate -> evaluation``, never ``train <-> translate``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import sacrebleu
import torch

from streamnmt import masks
from streamnmt.data import Tokenizer
from streamnmt.decode import SearchOptions
from streamnmt.decode_graph import translate_ids
from streamnmt.model import Transformer

CHINESE = {"ch", "zh"}  # target languages scored with sacrebleu's "zh" tokenizer


def encode_sources(tok: Tokenizer, texts: list[str], max_len: int) -> tuple[list[list[int]], list[int]]:
    """Encoder input as the training batches have it: tokens then EOS, at most ``max_len`` in all.

    Returns the id lists and the indices of the texts that were truncated.
    """
    sources, cut = [], []
    for i, ids in enumerate(tok.encode_batch(texts) if texts else []):
        if len(ids) > max_len - 1:
            ids = ids[:max_len - 1]
            cut.append(i)
        sources.append(ids + [masks.EOS])
    return sources, cut


def translate_texts(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer, texts: list[str],
                    opts: SearchOptions, *, device: torch.device | str, batch_size: int = 64,
                    max_input_len: int | None = None) -> tuple[list[str], list[int]]:
    """Translate sentences (none empty); returns the translations and the indices of truncated inputs."""
    limit = min(max_input_len or model.shape.max_positions, model.shape.max_positions)
    sources, cut = encode_sources(src_tok, texts, limit)
    hyps = translate_ids(model, sources, opts, batch_size=batch_size, device=device)
    # A translation is one line of output whatever the tokenizer makes of it.
    return [tgt_tok.decode(h).replace("\n", " ") for h in hyps], cut


def score(hyps: list[str], refs: list[str], tgt_lang: str) -> dict[str, Any]:
    """Corpus BLEU (sacrebleu, ``zh`` tokenizer for Chinese, else ``13a``) and chrF."""
    bleu = sacrebleu.BLEU(tokenize="zh" if tgt_lang.lower() in CHINESE else "13a")
    chrf = sacrebleu.CHRF()
    if not hyps:
        return {"bleu": 0.0, "chrf": 0.0, "signature": ""}
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "chrf": c.score, "signature": f"{bleu.get_signature()} / {chrf.get_signature()}"}


def bleu_on_pairs(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer, pairs: list[tuple[str, str]], *,
                  device: torch.device | str, beam_size: int = 3, batch_size: int = 64, tgt_lang: str = "ch",
                  limit: int | None = None, options: SearchOptions | None = None) -> dict[str, Any]:
    """Translate the sources of the first ``limit`` (None = all) ``pairs`` and score them.

    ``options`` gives the search settings other than ``beam_size`` (default: SearchOptions()).
    Returns ``bleu``, ``chrf``, ``n`` (sentences), ``seconds`` (wall time of the whole call) and the
    sacrebleu ``signature``. The model is put in eval mode and back in train mode if it was.
    """
    t0 = time.perf_counter()
    pairs = pairs[:limit] if limit else pairs
    was_training = model.training
    model.eval()
    try:
        hyps, _ = translate_texts(model, src_tok, tgt_tok, [s for s, _ in pairs],
                                  dataclasses.replace(options or SearchOptions(), beam_size=beam_size),
                                  device=device, batch_size=batch_size)
    finally:
        model.train(was_training)
    result = score(hyps, [t for _, t in pairs], tgt_lang)
    return {**result, "n": len(pairs), "seconds": time.perf_counter() - t0}
