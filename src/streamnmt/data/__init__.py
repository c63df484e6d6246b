"""Data pipeline: corpus readers, SentencePiece tokenizers, a tokenized cache, packed or bucketed batches.

The trainer needs four names::

    bundle = prepare_data(cfg)                    # tokenizers + tokenized train/dev/test
    loader = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=True)
    for batch in loader: ...                      # Batch: src, tgt_in, tgt_out int64 (+ segments if packed)
    refs = read_pairs(cfg, "test")                # raw text pairs, e.g. BLEU references

Each module below does one of those steps; this file only re-exports them.
"""

from streamnmt.data.batch import Batch, HostBatch, collate, collate_host
from streamnmt.data.config import DataConfig
from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.data.loader import BatchLoader, make_loader, make_sampler
from streamnmt.data.packbatch import collate_packed
from streamnmt.data.packing import PackSampler
from streamnmt.data.packshape import pack_shape
from streamnmt.data.plan import batch_plan, batch_shapes
from streamnmt.data.prepare import DataBundle, builtin_dir, prepare_data, read_pairs, resolve_data_dir
from streamnmt.data.sampler import BucketSampler, bucket_batch_size, bucket_lengths
from streamnmt.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "Batch", "BatchLoader", "BucketSampler", "DataBundle", "DataConfig", "HostBatch", "TokenizedCorpus",
    "Tokenizer", "bucket_batch_size", "bucket_lengths", "builtin_dir", "collate", "collate_host",
    "make_loader", "make_sampler", "batch_plan", "batch_shapes", "PackSampler", "collate_packed", "pack_shape", "prepare_data", "read_pairs", "resolve_data_dir", "train_tokenizer",
]
