"""A corpus with the lengths of a real one and the token ids of a real vocabulary.

The built-in corpus's tokenizers have ~1,500 pieces; a real EN->ZH system has ~32,000, and at
that size the output layer (generator and loss over the vocabulary) is a large share of a step.
The benchmark keeps the corpus's sentence lengths (what batching and packing see) and draws every
token id uniformly from ``[4, vocab)`` (ids 0-3 are PAD, UNK, BOS, EOS), seeded.
"""

from __future__ import annotations

import numpy as np

from streamnmt.data.corpus import TokenizedCorpus


def random_tokens(corpus: TokenizedCorpus, vocab: int, seed: int) -> TokenizedCorpus:
    """``corpus`` with each token replaced by a random id below ``vocab`` (same lengths, same order)."""
    rng = np.random.default_rng([seed & (2**63 - 1), vocab])
    arrays = {
        "src_tokens": rng.integers(4, vocab, len(corpus.src_tokens), dtype=np.int64),
        "tgt_tokens": rng.integers(4, vocab, len(corpus.tgt_tokens), dtype=np.int64),
        "src_offsets": np.asarray(corpus.src_offsets), "tgt_offsets": np.asarray(corpus.tgt_offsets),
        "index": np.asarray(corpus.index),
    }
    return TokenizedCorpus(arrays, name=f"{corpus.name}-vocab{vocab}")
