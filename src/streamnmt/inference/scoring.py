"""Text in, text out and scored: the part of inference that the trainer shares with the commands.

The trainer computes dev BLEU at each epoch end; ``streamnmt translate`` and ``eval`` translate
files and score splits. All three turn lines of text into encoder input the way the training
batches are built (tokens then EOS), decode them through :mod:`streamnmt.inference.search` (or, where asked,
:mod:`streamnmt.inference.graph_search`), detokenize through SentencePiece, and score with sacrebleu (BLEU
with its ``zh`` tokenizer for Chinese targets, MeCab or ``char`` for Japanese, ``char`` for Thai,
MeCab or ``13a`` for Korean, ``13a`` otherwise: ``scoreworker.bleu_tokenizer``; and chrF). This module holds
those pieces below both the trainer and the commands, so that imports run one way:
``train -> evaluation`` and ``translate -> evaluation``, never ``train <-> translate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from streamnmt.models import masks

from streamnmt.inference import scoreworker
from streamnmt.data import Tokenizer
from streamnmt.data.writing import written_language
from streamnmt.inference.decoding import SearchOptions
from streamnmt.inference.graph_search import translate_ids
from streamnmt.inference.search import nbest_search
from streamnmt.inference.search import translate_ids as translate_ids_eager
from streamnmt.models.transformer import Transformer

CHINESE = scoreworker.CHINESE  # target languages scored with sacrebleu's "zh" tokenizer
MAX_SCORE_WORKERS = 2  # scoring processes per Scorer (see score_workers)
# A Scorer waits this long for its workers' last answers, then scores here: scoring a batch takes
# milliseconds, so a worker this late is hung (its batches are scored in-process, it is killed).
WORKER_TIMEOUT_S = 30.0


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


def translate_texts_nbest(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer, texts: list[str],
                          opts: SearchOptions, n: int, *, device: torch.device | str, batch_size: int = 64,
                          max_input_len: int | None = None) -> tuple[list[list[tuple[str, float]]], list[int]]:
    """Each sentence's ``n`` best translations (text, score), best first, by the eager beam search
    (:func:`~streamnmt.inference.search.nbest_search`); and the indices of truncated inputs."""
    limit = min(max_input_len or model.shape.max_positions, model.shape.max_positions)
    sources, cut = encode_sources(src_tok, texts, limit)
    lists = translate_ids_eager(model, sources, opts, batch_size=batch_size, device=device,
                                search_fn=lambda src: nbest_search(model, src, opts, n))
    return [[(text, score) for text, (_, score) in zip(detokenize(tgt_tok, [ids for ids, _ in hyps]), hyps)]
            for hyps in lists], cut


def detokenize(tgt_tok: Tokenizer, outputs: list[list[int]]) -> list[str]:
    """Output ids -> text; a translation is one line whatever the tokenizer makes of it."""
    return [tgt_tok.decode(h).replace("\n", " ") for h in outputs]


def scored_language(tgt_lang: str, refs: list[str]) -> str:
    """The language BLEU tokenizes ``refs`` as: the key ``tgt_lang``'s (``scoreworker.bleu_tokenizer``),
    or where it names none of Chinese, Japanese and Korean but the references are one of them, that
    one (:func:`~streamnmt.data.writing.written_language`, as the tokenizers read their text): a
    Chinese corpus keyed ``tgt`` is not scored by 13a's words, a sentence each."""
    return written_language(tgt_lang, refs) or tgt_lang


def score(hyps: list[str], refs: list[str], tgt_lang: str) -> dict[str, Any]:
    """Corpus BLEU (sacrebleu, the target language's tokenizer: ``scoreworker.bleu_tokenizer`` of
    :func:`scored_language`) and chrF."""
    return _score_as(hyps, refs, scored_language(tgt_lang, refs))


def _score_as(hyps: list[str], refs: list[str], lang: str) -> dict[str, Any]:
    """:func:`score` with BLEU's tokenizer for ``lang`` as it is (a scorer's, read from all its references)."""
    bleu, chrf = scoreworker.metrics(lang)
    if not hyps:
        return {"bleu": 0.0, "chrf": 0.0, "signature": ""}
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "chrf": c.score, "signature": f"{bleu.get_signature()} / {chrf.get_signature()}"}


def score_workers() -> int:
    """Scoring processes a :class:`Scorer` starts: one core of the machine stays with decoding."""
    return max(1, min(MAX_SCORE_WORKERS, (os.cpu_count() or 1) - 1))


class _Worker:
    """One :mod:`streamnmt.inference.scoreworker` process, the thread that writes it its batches and
    the thread that reads its answers. :meth:`send` only queues: a worker that hangs with its pipe
    full never blocks the caller (the decoding loop); its batches are scored by the caller instead."""

    _STOP = object()

    def __init__(self, tgt_lang: str, results: dict[int, Any]):
        self.proc = subprocess.Popen([sys.executable, scoreworker.__file__, tgt_lang], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False  # a write failed: the worker died (its batches are scored by the caller)
        self.writer = threading.Thread(target=self._write, daemon=True, name="streamnmt-score-writer")
        self.reader = threading.Thread(target=self._read, args=(results,), daemon=True,
                                       name="streamnmt-score-reader")
        self.writer.start()
        self.reader.start()

    def _write(self) -> None:
        while True:  # blocked in get() or in a pipe write, the interpreter lock released
            frame = self.outbox.get()
            if frame is self._STOP:
                break
            try:
                scoreworker.write_frame(self.proc.stdin, frame)
            except (OSError, ValueError):
                self.broken = True
                break
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def _read(self, results: dict[int, Any]) -> None:
        while True:  # blocked in read() almost always, the interpreter lock released
            try:
                tag, b, c = scoreworker.read_frame(self.proc.stdout)
            except (EOFError, OSError, ValueError):
                return
            results[tag] = (b, c)

    @property
    def alive(self) -> bool:
        return not self.broken and self.proc.poll() is None

    def send(self, frame: Any) -> bool:
        """Queue ``frame`` for the worker; False where it is known dead."""
        if not self.alive:
            return False
        self.outbox.put(frame)
        return True

    def close(self, timeout: float) -> None:
        """The worker finishes what it was sent and exits; after ``timeout`` it is killed."""
        self.send(None)
        self.outbox.put(self._STOP)
        self.reader.join(timeout)
        if self.reader.is_alive() or self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1.0)
            self.kill()
        self.reader.join(1.0)
        with contextlib.suppress(OSError):
            self.proc.stdout.close()

    def kill(self) -> None:
        """End a hung worker now (its pipe closes, so the writer thread ends too)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.broken = True


class ScorePool:
    """Scoring workers kept for many :class:`Scorer` passes (a training run's evaluations), so that
    an evaluation does not wait for worker processes to start (an interpreter and sacrebleu each):
    on a short dev pass that start-up is a good part of the pass (docs/PERFORMANCE.md, "Evaluation
    and checkpoints in a run"). Started once, closed by its owner. A worker that dies or does not
    answer in time is dropped; what it was given is scored by the caller."""

    def __init__(self, tgt_lang: str, workers: int | None = None):
        self.tgt_lang = tgt_lang
        self.results: dict[int, Any] = {}  # pool tag -> (bleu stats, chrf stats), filled by the readers
        self.workers: list[_Worker] = []
        self._start(score_workers() if workers is None else workers)
        self._owner: dict[int, _Worker] = {}  # tag -> the worker it was sent to, until collected
        self._next = 0

    def _start(self, n: int) -> None:
        for _ in range(n):
            try:
                self.workers.append(_Worker(self.tgt_lang, self.results))
            except OSError:
                break

    def retarget(self, tgt_lang: str) -> None:
        """Workers that score ``tgt_lang``: the pool is started with the run's key before its references
        are read, and where they are another language than the key names (:func:`scored_language`) the
        first pass restarts as many workers for it (once: a run's references keep their language)."""
        if tgt_lang == self.tgt_lang:
            return
        n = len(self.workers)
        self.close()
        self.tgt_lang = tgt_lang
        self._start(n)

    def send(self, hyps: list[str], refs: list[str]) -> int | None:
        """Queue one batch; its tag, or None where no worker took it (it is scored by the caller)."""
        self.workers = [w for w in self.workers if w.alive]
        if not self.workers:
            return None
        tag, self._next = self._next, self._next + 1
        worker = self.workers[tag % len(self.workers)]
        if not worker.send((tag, hyps, refs)):
            return None
        self._owner[tag] = worker
        return tag

    def collect(self, tags: list[int | None], timeout: float | None = None) -> dict[int, Any]:
        """The statistics of ``tags`` (waiting for live workers up to ``timeout``, default
        :data:`WORKER_TIMEOUT_S`); a tag whose worker died or did not answer in time is left out, and
        a worker that did not is killed and dropped (a later pass would wait for it again)."""
        deadline = time.monotonic() + (WORKER_TIMEOUT_S if timeout is None else timeout)

        def waiting() -> list[int]:
            return [t for t in tags if t is not None and t not in self.results and t in self._owner
                    and self._owner[t].alive]

        while time.monotonic() < deadline and waiting():
            time.sleep(0.0005)  # the reader threads fill results; the lock is released while asleep
        for t in waiting():  # hung: it will not answer this pass, nor reliably the next
            self._owner[t].kill()
        for t in tags:
            self._owner.pop(t, None)  # type: ignore[arg-type]
        self.workers = [w for w in self.workers if w.alive]
        return {t: self.results.pop(t) for t in tags if t is not None and t in self.results}

    def close(self) -> None:
        for w in self.workers:
            w.close(WORKER_TIMEOUT_S)
        self.workers = []


class Scorer:
    """:func:`score`, computed batch by batch in worker processes while the device decodes.

    Scoring is pure Python (sacrebleu tokenizes and counts n-grams: about 1 s for 1,000 sentences
    of 30 words, as long as decoding them on a GPU), and in the decoding process it would compete
    with decoding for the interpreter lock. So each decoded batch is sent to one of
    :func:`score_workers` :mod:`streamnmt.inference.scoreworker` processes (round robin), which return its
    segment statistics; the corpus scores are computed from their sum at the end, the same numbers
    as :func:`score` over the whole corpus (sacrebleu's corpus score is a function of the summed
    segment statistics; tested). A batch whose worker could not be started or died is scored here
    at the end, as is everything where sacrebleu lacks the segment-statistics methods."""

    def __init__(self, refs: list[str], tgt_lang: str, workers: int | None = None, pool: ScorePool | None = None):
        tgt_lang = scored_language(tgt_lang, refs)
        if pool is not None:  # no batch of an earlier pass is left in it: a scorer's result collects them
            pool.retarget(tgt_lang)
        self.refs, self.tgt_lang, self.pool = refs, tgt_lang, pool
        self._pool_tags: list[int | None] = []  # with a pool: its tag of each batch
        self.bleu, self.chrf = scoreworker.metrics(tgt_lang)
        self.incremental = all(hasattr(m, a) for m in (self.bleu, self.chrf)
                               for a in ("_extract_corpus_statistics", "_aggregate_and_compute"))
        self.hyps: list[str | None] = [None] * len(refs)
        self._batches: list[tuple[list[str], list[str]]] = []
        self._stats: dict[int, Any] = {}  # batch tag -> (bleu stats, chrf stats), filled by the readers
        self._workers: list[_Worker] = []
        self._n_workers = score_workers() if workers is None else workers
        self._closed = False

    def _worker(self, tag: int) -> _Worker | None:
        if not self.incremental or self._n_workers < 1:
            return None
        if len(self._workers) < self._n_workers:  # started with the first batches: they overlap decoding
            try:
                self._workers.append(_Worker(self.tgt_lang, self._stats))
            except OSError:
                self._n_workers = len(self._workers)
                if not self._workers:
                    return None
        return self._workers[tag % len(self._workers)]

    def add(self, indices: list[int], hyps: list[str]) -> None:
        """Translations ``hyps`` of the sentences at ``indices`` (into ``refs``), any order."""
        for i, h in zip(indices, hyps):
            self.hyps[i] = h
        if not hyps:
            return
        tag, refs = len(self._batches), [self.refs[i] for i in indices]
        self._batches.append((list(hyps), refs))
        if self.pool is not None and self.incremental:
            self._pool_tags.append(self.pool.send(list(hyps), refs))
            return
        worker = self._worker(tag)
        if worker is not None:
            worker.send((tag, list(hyps), refs))

    def result(self, added_only: bool = False) -> dict[str, Any]:
        """BLEU, chrF and the sacrebleu signature; every sentence must have been added, or with
        ``added_only`` the scores are those of the sentences added (a decoding cut short)."""
        try:
            missing = [i for i, h in enumerate(self.hyps) if h is None]
            if missing and not added_only:
                raise ValueError(f"no translation added for sentence {missing[0]} (of {len(missing)} missing)")
            if not self.incremental or not self.refs:
                kept = [i for i, h in enumerate(self.hyps) if h is not None]
                return _score_as([self.hyps[i] for i in kept], [self.refs[i] for i in kept],  # type: ignore[misc]
                                 self.tgt_lang)
            self.close()  # the workers finish their batches and exit
            if self.pool is not None:
                got = self.pool.collect(self._pool_tags)
                self._stats = {i: got[tag] for i, tag in enumerate(self._pool_tags) if tag in got}
            bleu_stats, chrf_stats = [], []
            for tag, (hyps, refs) in enumerate(self._batches):
                b, c = self._stats.get(tag) or (self.bleu._extract_corpus_statistics(hyps, [refs]),
                                                self.chrf._extract_corpus_statistics(hyps, [refs]))
                bleu_stats += b
                chrf_stats += c
            b, c = self.bleu._aggregate_and_compute(bleu_stats), self.chrf._aggregate_and_compute(chrf_stats)
            for m in (self.bleu, self.chrf):  # the signature's "#" (references per sentence), which
                m.num_refs = 1                 # sacrebleu records when it reads references itself
            return {"bleu": b.score, "chrf": c.score,
                    "signature": f"{self.bleu.get_signature()} / {self.chrf.get_signature()}"}
        finally:
            self.close()

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers after the batches they have been given, waiting up to ``timeout``
        (default :data:`WORKER_TIMEOUT_S`) for their answers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.close(WORKER_TIMEOUT_S if timeout is None else timeout)


def bleu_on_pairs(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer, pairs: list[tuple[str, str]], *,
                  device: torch.device | str, beam_size: int = 3, batch_size: int = 64, tgt_lang: str = "ch",
                  limit: int | None = None, options: SearchOptions | None = None,
                  pool: ScorePool | None = None, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Translate the sources of the first ``limit`` (None = all) ``pairs`` and score them.

    ``options`` gives the search settings other than ``beam_size`` (default: SearchOptions()); ``pool``:
    scoring workers kept between calls (else each call starts its own); ``stop()``, asked between
    batches, ends the decoding early (a time limit): the scores are then those of the ``n``
    sentences decoded, the longest first.
    Returns ``bleu``, ``chrf``, ``n`` (sentences scored), ``seconds`` (wall time of the whole call),
    the sacrebleu ``signature``, ``cut`` (the indices of the sources truncated to the model's
    positions, as the training's dev batches truncate them) and ``hyps`` (the translations in the
    pairs' order; None where a stop left one undecoded). The model is put in eval mode and back in train mode if it was. Each
    decoded batch is detokenized and scored (:class:`Scorer`) while the next one decodes.
    """
    t0 = time.perf_counter()
    pairs = pairs[:limit] if limit else pairs
    scorer = Scorer([t for _, t in pairs], tgt_lang, pool=pool)

    def on_batch(indices: list[int], outputs: list[list[int]]) -> None:
        scorer.add(indices, detokenize(tgt_tok, outputs))

    was_training = model.training
    model.eval()
    try:
        sources, cut = encode_sources(src_tok, [s for s, _ in pairs], model.shape.max_positions)
        translate_ids(model, sources, dataclasses.replace(options or SearchOptions(), beam_size=beam_size),
                      batch_size=batch_size, device=device, on_batch=on_batch, stop=stop)
    except BaseException:
        scorer.close()
        raise
    finally:
        model.train(was_training)
    n = sum(h is not None for h in scorer.hyps)
    result = scorer.result(added_only=stop is not None)
    return {**result, "n": n, "seconds": time.perf_counter() - t0, "cut": cut, "hyps": list(scorer.hyps)}
