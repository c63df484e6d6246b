"""What an epoch's batching will look like, known before any loader starts.

The trainer decides some settings from it (``--compile auto`` weighs the planned steps against the
number of batch shapes to compile) and reports the padding share at start: with length buckets
and fixed shapes, part of every batch is padding, and ``--max-tokens`` batches trade that against
the number of shapes.
"""

from __future__ import annotations

from streamnmt.data.config import DataConfig
from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.data.sampler import BucketSampler, bucket_lengths


def batch_plan(corpus: TokenizedCorpus, cfg: DataConfig) -> tuple[int, list[tuple[int, int, int]]]:
    """(batches per epoch, the batch shapes (B, src length, tgt length)) of ``corpus`` under ``cfg``."""
    sampler = BucketSampler(bucket_lengths(corpus.src_lengths, corpus.tgt_lengths, cfg.pad_multiple),
                            batch_size=cfg.batch_size, max_tokens=cfg.max_tokens, shuffle=False)
    return len(sampler), sampler.shapes()


def padding_share(corpus: TokenizedCorpus, cfg: DataConfig) -> float:
    """Share of the target positions of one epoch's batches that are padding (filler rows included)."""
    sampler = BucketSampler(bucket_lengths(corpus.src_lengths, corpus.tgt_lengths, cfg.pad_multiple),
                            batch_size=cfg.batch_size, max_tokens=cfg.max_tokens, shuffle=False)
    sizes = sampler.bucket_sizes()
    padded = sum(b * L * -(-sizes[L] // b) for b, L, _ in sampler.shapes())
    real = int(corpus.tgt_lengths.sum()) + len(corpus)  # each target ends with EOS
    return 1.0 - real / padded if padded else 0.0
