"""Tokenizer: special ids, round trips, vocabulary cap, quiet training, bad model files."""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from streamnmt.data import Tokenizer, prepare_data, read_pairs, train_tokenizer
from streamnmt.errors import InputError
from streamnmt.models.masks import BOS, EOS, PAD, UNK

from .conftest import make_pairs, small_config, write_corpus


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Tokenizer, list]:
    directory = tmp_path_factory.mktemp("tok")
    pairs = make_pairs(300)
    src = train_tokenizer([s for s, _ in pairs], directory / "src.model", 120, "en", log=lambda _: None)
    tgt = train_tokenizer([t for _, t in pairs], directory / "tgt.model", 120, "ch", log=lambda _: None)
    return src, tgt, pairs


def test_special_ids(toks) -> None:
    src, tgt, pairs = toks
    for tok in (src, tgt):
        assert [tok.piece(i) for i in (PAD, UNK, BOS, EOS)] == ["<pad>", "<unk>", "<s>", "</s>"]
        ids = [i for s, t in pairs[:50] for i in tok.encode(s if tok is src else t)]
        assert ids and not {PAD, BOS, EOS} & set(ids)


def test_round_trip(toks) -> None:
    src, tgt, pairs = toks
    for s, t in pairs[:100]:
        assert src.decode(src.encode(s)) == s
        assert tgt.decode(tgt.encode(t)) == t  # full-width punctuation kept (no NFKC for Chinese)


def test_decode_stops_at_eos_and_skips_pad_and_bos(toks) -> None:
    src, _, pairs = toks
    ids = src.encode(pairs[0][0])
    other = src.encode(pairs[1][0])
    assert src.decode([BOS, *ids, EOS, *other]) == pairs[0][0]
    assert src.decode([BOS, *ids[:2], PAD, *ids[2:], PAD, PAD]) == pairs[0][0]
    assert src.decode(torch.tensor([BOS, *ids, EOS, PAD])) == pairs[0][0]


def test_unknown_character_maps_to_unk(toks) -> None:
    _, tgt, _ = toks
    assert UNK in tgt.encode("猫鑫狗")  # 鑫 never occurs in the training text


def test_encode_batch_matches_encode(toks) -> None:
    src, _, pairs = toks
    texts = [s for s, _ in pairs[:64]]
    assert src.encode_batch(texts) == [src.encode(s) for s in texts]


def test_path_hash_and_pickle(toks) -> None:
    src, _, _ = toks
    assert src.sha256 == hashlib.sha256(src.path.read_bytes()).hexdigest()
    copy = pickle.loads(pickle.dumps(src))
    assert copy.path == src.path and copy.vocab_size == src.vocab_size
    assert copy.encode("The cat runs.") == src.encode("The cat runs.")


def test_vocabulary_is_capped_for_a_small_corpus(tmp_path: Path) -> None:
    lines: list[str] = []
    pairs = make_pairs(200)
    tok = train_tokenizer([s for s, _ in pairs], tmp_path / "m.model", 32000, "en", log=lines.append)
    distinct = len({w for s, _ in pairs for w in s.split()} | {c for s, _ in pairs for c in s})
    assert tok.vocab_size <= distinct + 4 < 32000
    assert len([x for x in lines if "capped at" in x and "32000" in x]) == 1


@pytest.mark.parametrize("lang", ["zh_CN", "zh-TW", "ZH", "ja_JP"])
def test_a_region_or_script_suffix_keeps_the_settings_of_text_without_spaces(tmp_path: Path, lang) -> None:
    from streamnmt.data.tokenizer import is_cjk, vocab_cap

    assert is_cjk(lang) and not is_cjk("en_GB") and not is_cjk("de") and not is_cjk("mul")
    targets = [t for _, t in make_pairs(300)]
    tok = train_tokenizer(targets, tmp_path / "m.model", 32000, lang, log=lambda _: None)
    assert tok.vocab_size <= vocab_cap(targets, 32000, cjk=True)  # a few pieces per character
    assert all(tok.decode(tok.encode(t)) == t for t in targets[:100])  # full-width punctuation kept


def test_one_piece_per_character_leaves_room_for_every_character_and_the_word_boundary(tmp_path: Path) -> None:
    """The lowest cap (one piece per distinct character) still trains where every character is needed:
    a handful of characters, each frequent, none outside SentencePiece's character coverage."""
    from streamnmt.data.tokenizer import vocab_cap

    targets = ["甲乙丙丁。", "丁丙乙甲！", "乙甲丁丙。"] * 60
    cap = vocab_cap(targets, 32000, cjk=True, per_character=1)
    tok = train_tokenizer(targets, tmp_path / "m.model", 32000, "zh", cap=cap, log=lambda _: None)
    assert tok.vocab_size == cap and all(tok.decode(tok.encode(t)) == t for t in targets[:3])


@pytest.mark.parametrize("lang, unspaced", [("zh_CN", True), ("ja-JP", True), ("ch", True), ("ko_KR", False),
                                             ("kr", False), ("de", False)])
def test_korean_is_cjk_but_written_with_spaces(lang, unspaced) -> None:
    from streamnmt.data.tokenizer import is_cjk, is_unspaced

    assert is_unspaced(lang) == unspaced and is_cjk(lang) == (lang != "de")


def test_requested_vocabulary_is_an_upper_bound(tmp_path: Path) -> None:
    pairs = make_pairs(200)
    tok = train_tokenizer([t for _, t in pairs], tmp_path / "m.model", 60, "ch", log=lambda _: None)
    assert tok.vocab_size <= 60


def test_training_is_quiet(tmp_path: Path, capfd) -> None:
    write_corpus(tmp_path)
    prepare_data(small_config(tmp_path), log=lambda _: None)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert (tmp_path / "tokenizer" / "src.model").is_file() and (tmp_path / "tokenizer" / "tgt.model").is_file()


def test_model_with_other_special_ids_is_refused(tmp_path: Path) -> None:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([s for s, _ in make_pairs(200)]),
                                   model_writer=model, vocab_size=60, minloglevel=2)
    (tmp_path / "default.model").write_bytes(model.getvalue())  # unk=0 bos=1 eos=2, no pad
    with pytest.raises(InputError, match="pad=0 unk=1 bos=2 eos=3"):
        Tokenizer(tmp_path / "default.model")


def test_missing_or_garbage_model(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found") as info:
        Tokenizer(tmp_path / "none.model")
    assert str(tmp_path / "none.model") in str(info.value)
    (tmp_path / "junk.model").write_bytes(b"this is not a model")
    with pytest.raises(InputError, match="not a SentencePiece model"):
        Tokenizer(tmp_path / "junk.model")


def test_given_tokenizers_are_used_as_they_are(tmp_path: Path, toks) -> None:
    src, tgt, _ = toks
    write_corpus(tmp_path / "c")
    cfg = small_config(tmp_path / "c", tokenizer_src=str(src.path), tokenizer_tgt=str(tgt.path))
    bundle = prepare_data(cfg, log=lambda _: None)
    assert bundle.src_tok.path == src.path and bundle.tgt_tok.sha256 == tgt.sha256
    assert not (tmp_path / "c" / "tokenizer").exists()
    s, _ = bundle.dev[0]
    assert s.tolist() == src.encode(read_pairs(cfg, "dev")[0][0])[:cfg.max_len - 1]


def test_a_corpus_folder_with_an_older_versions_models_uses_them(tmp_path: Path, toks) -> None:
    """A corpus an older version trained in holds eng.model/chn.model: they are found and used, not
    retrained beside them; a fresh folder gets src.model/tgt.model."""
    src, tgt, _ = toks
    write_corpus(tmp_path / "c")
    (tmp_path / "c" / "tokenizer").mkdir()
    (tmp_path / "c" / "tokenizer" / "eng.model").write_bytes(src.path.read_bytes())
    (tmp_path / "c" / "tokenizer" / "chn.model").write_bytes(tgt.path.read_bytes())
    bundle = prepare_data(small_config(tmp_path / "c"), log=lambda _: None)
    assert bundle.src_tok.path.name == "eng.model" and bundle.src_tok.sha256 == src.sha256
    assert bundle.tgt_tok.path.name == "chn.model" and bundle.tgt_tok.sha256 == tgt.sha256
    assert sorted(p.name for p in (tmp_path / "c" / "tokenizer").iterdir()) == ["chn.model", "eng.model"]


def test_given_tokenizer_missing_is_an_input_error(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c")
    cfg = small_config(tmp_path / "c", tokenizer_src=str(tmp_path / "absent.model"))
    with pytest.raises(InputError, match="absent.model"):
        prepare_data(cfg, log=lambda _: None)
    assert not (tmp_path / "c" / "tokenizer").exists()  # the other side was not trained either
