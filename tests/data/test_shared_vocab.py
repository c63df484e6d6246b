"""--shared-vocab: one SentencePiece model for both sides, trained on both sides' text."""

from __future__ import annotations

import pytest

from streamnmt.data import prepare_data
from streamnmt.errors import ConfigError
from streamnmt.models.masks import UNK

from .conftest import HANZI, small_config


def test_one_model_for_both_sides(corpus_dir, logs):
    lines, log = logs
    bundle = prepare_data(small_config(corpus_dir, shared_vocab=True, src_vocab=300, tgt_vocab=300), log=log)
    assert bundle.src_tok is bundle.tgt_tok and bundle.src_tok.path == corpus_dir / "tokenizer" / "shared.model"
    tok = bundle.src_tok
    for text in ("The cat sees a big house.", HANZI[:8] + "。"):  # both languages, no unknown pieces
        ids = tok.encode(text)
        assert UNK not in ids and tok.decode(ids) == text
    assert not (corpus_dir / "tokenizer" / "src.model").exists()
    assert any("shared tokenizer" in line for line in lines)
    # the second time it is found, not retrained
    again = prepare_data(small_config(corpus_dir, shared_vocab=True, src_vocab=300, tgt_vocab=300), log=lambda _: None)
    assert again.src_tok.sha256 == tok.sha256


def test_given_shared_model_and_two_different_models(corpus_dir, tmp_path):
    first = prepare_data(small_config(corpus_dir, shared_vocab=True), log=lambda _: None)
    given = prepare_data(small_config(corpus_dir, shared_vocab=True, tokenizer_tgt=str(first.src_tok.path)),
                         log=lambda _: None)
    assert given.src_tok.path == given.tgt_tok.path == first.src_tok.path
    with pytest.raises(ConfigError, match="--shared-vocab"):
        small_config(corpus_dir, shared_vocab=True, tokenizer_src="a.model", tokenizer_tgt="b.model")
