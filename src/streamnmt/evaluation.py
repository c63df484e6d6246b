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
import sys
import time
from typing import Any

import sacrebleu
import torch

from streamnmt import masks
from streamnmt.data import Tokenizer
from streamnmt.decode import SearchOptions
from streamnmt.decode_graph import translate_ids
from streamnmt.model import Transformer

CHINESE = {"ch", "zh"}
SWITCH_INTERVAL_S = 2e-4  # the GIL switch interval while a Scorer's worker runs  # target languages scored with sacrebleu's "zh" tokenizer


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
    return detokenize(tgt_tok, hyps), cut


def detokenize(tgt_tok: Tokenizer, outputs: list[list[int]]) -> list[str]:
    """Output ids -> text; a translation is one line whatever the tokenizer makes of it."""
    return [tgt_tok.decode(h).replace("\n", " ") for h in outputs]


def _metrics(tgt_lang: str) -> tuple[Any, Any]:
    return sacrebleu.BLEU(tokenize="zh" if tgt_lang.lower() in CHINESE else "13a"), sacrebleu.CHRF()


def score(hyps: list[str], refs: list[str], tgt_lang: str) -> dict[str, Any]:
    """Corpus BLEU (sacrebleu, ``zh`` tokenizer for Chinese, else ``13a``) and chrF."""
    bleu, chrf = _metrics(tgt_lang)
    if not hyps:
        return {"bleu": 0.0, "chrf": 0.0, "signature": ""}
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "chrf": c.score, "signature": f"{bleu.get_signature()} / {chrf.get_signature()}"}


class Scorer:
    """:func:`score`, computed batch by batch on a worker thread while the device decodes.

    Scoring is pure Python (sacrebleu tokenizes and counts n-grams: about 1 s for 1,000 sentences
    of 30 words on one slow core, as long as decoding them on a GPU), so it is done beside the
    decoding: each decoded batch's segment statistics are extracted on the worker as the next batch
    decodes, and the corpus scores are computed from their sum at the end, the same numbers as
    :func:`score` over the whole corpus (sacrebleu's corpus score is a function of the summed
    segment statistics; tested). The decoding thread waits for the GPU with the GIL released,
    which is when the worker runs. Where sacrebleu lacks the segment-statistics methods, the
    hypotheses are kept and scored at the end."""

    def __init__(self, refs: list[str], tgt_lang: str):
        from concurrent.futures import ThreadPoolExecutor

        self.refs, self.tgt_lang = refs, tgt_lang
        self.bleu, self.chrf = _metrics(tgt_lang)
        self.incremental = all(hasattr(m, a) for m in (self.bleu, self.chrf)
                               for a in ("_extract_corpus_statistics", "_aggregate_and_compute"))
        self.hyps: list[str | None] = [None] * len(refs)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="streamnmt-score")
        self._stats: list[Any] = []
        # While the worker runs, the decoding thread that wakes from a GPU wait must get the GIL
        # back within a fraction of a decoding step (about 1 ms), not Python's default 5 ms, or the
        # GPU would run out of queued steps; restored by close().
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    def add(self, indices: list[int], hyps: list[str]) -> None:
        """Translations ``hyps`` of the sentences at ``indices`` (into ``refs``), any order."""
        for i, h in zip(indices, hyps):
            self.hyps[i] = h
        if self.incremental and hyps:
            refs = [[self.refs[i] for i in indices]]
            self._stats.append(self._pool.submit(lambda: (self.bleu._extract_corpus_statistics(hyps, refs),
                                                          self.chrf._extract_corpus_statistics(hyps, refs))))

    def result(self) -> dict[str, Any]:
        """BLEU, chrF and the sacrebleu signature; every sentence must have been added."""
        try:
            missing = [i for i, h in enumerate(self.hyps) if h is None]
            if missing:
                raise ValueError(f"no translation added for sentence {missing[0]} (of {len(missing)} missing)")
            if not self.incremental or not self.refs:
                return score(self.hyps, self.refs, self.tgt_lang)  # type: ignore[arg-type]
            parts = [f.result() for f in self._stats]
            b = self.bleu._aggregate_and_compute([s for part, _ in parts for s in part])
            c = self.chrf._aggregate_and_compute([s for _, part in parts for s in part])
            return {"bleu": b.score, "chrf": c.score,
                    "signature": f"{self.bleu.get_signature()} / {self.chrf.get_signature()}"}
        finally:
            self.close()

    def close(self) -> None:
        """Stop the worker (after the batches it has been given)."""
        self._pool.shutdown(wait=True)
        sys.setswitchinterval(self._switch)


def bleu_on_pairs(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer, pairs: list[tuple[str, str]], *,
                  device: torch.device | str, beam_size: int = 3, batch_size: int = 64, tgt_lang: str = "ch",
                  limit: int | None = None, options: SearchOptions | None = None) -> dict[str, Any]:
    """Translate the sources of the first ``limit`` (None = all) ``pairs`` and score them.

    ``options`` gives the search settings other than ``beam_size`` (default: SearchOptions()).
    Returns ``bleu``, ``chrf``, ``n`` (sentences), ``seconds`` (wall time of the whole call) and the
    sacrebleu ``signature``. The model is put in eval mode and back in train mode if it was. Each
    decoded batch is detokenized and scored (:class:`Scorer`) while the next one decodes.
    """
    t0 = time.perf_counter()
    pairs = pairs[:limit] if limit else pairs
    scorer = Scorer([t for _, t in pairs], tgt_lang)

    def on_batch(indices: list[int], outputs: list[list[int]]) -> None:
        scorer.add(indices, detokenize(tgt_tok, outputs))

    was_training = model.training
    model.eval()
    try:
        sources, _ = encode_sources(src_tok, [s for s, _ in pairs], model.shape.max_positions)
        translate_ids(model, sources, dataclasses.replace(options or SearchOptions(), beam_size=beam_size),
                      batch_size=batch_size, device=device, on_batch=on_batch)
    except BaseException:
        scorer.close()
        raise
    finally:
        model.train(was_training)
    result = scorer.result()
    return {**result, "n": len(pairs), "seconds": time.perf_counter() - t0}
