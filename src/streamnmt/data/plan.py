"""What an epoch's batching will look like, known before any loader starts.

The trainer decides some settings from it before it builds its loaders: ``--compile auto`` weighs
the planned steps against the number of batch shapes to compile.
"""

from __future__ import annotations

from streamnmt.data.config import DataConfig
from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.data.sampler import BucketSampler, bucket_lengths


def batch_plan(corpus: TokenizedCorpus, cfg: DataConfig, train: bool = True) -> tuple[int, list[tuple[int, int, int]]]:
    """(batches per epoch, the batch shapes (B, src length, tgt length)) of ``corpus`` under ``cfg``;
    ``train``: as the training loader batches it (packed with ``cfg.pack``), else as evaluation does."""
    sampler = _sampler(corpus, cfg, train)
    return len(sampler), sampler.shapes()  # packed: len plans epoch 0 of seed 0, a typical epoch


def batch_shapes(corpus: TokenizedCorpus, cfg: DataConfig, train: bool = True) -> list[tuple[int, int, int]]:
    """The batch shapes of :func:`batch_plan` alone: packed rows' one shape needs no epoch planned
    (on 1M pairs planning one takes seconds of a resumed run's set-up)."""
    return _sampler(corpus, cfg, train).shapes()


def _sampler(corpus: TokenizedCorpus, cfg: DataConfig, train: bool):
    if train and cfg.packs:
        from streamnmt.data.loader import make_sampler

        return make_sampler(corpus, cfg, train=True, seed=0)
    return BucketSampler(bucket_lengths(corpus.src_lengths, corpus.tgt_lengths, cfg.pad_multiple),
                         batch_size=cfg.sentences, max_tokens=cfg.max_tokens or 0, shuffle=False)
