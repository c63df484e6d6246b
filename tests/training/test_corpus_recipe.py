"""The corpus rule (CPU): the dropout, the label smoothing and the tokenizers' vocabulary chosen from the
training corpus where the flags leave them unset, said in one start line, and recorded in config.yaml."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from streamnmt.config import (DEFAULT_LABEL_SMOOTHING, RICH_LABEL_SMOOTHING, RICH_SMOOTHING_FORMS, SMALL_CORPUS_DROPOUT,
                              UNSPACED_SHARE, TrainJob, build_job, corpus_dropout, corpus_label_smoothing, preset_dropout)
from streamnmt.data.config import (CORPUS_VOCAB, LEAN_MIN_PAIRS, LEAN_VOCAB, RICH_FORMS, SMALL_CORPUS_PAIRS,
                                   SMALL_CORPUS_PIECES_PER_CHARACTER, SMALL_CORPUS_VOCAB, SOURCE_PER_TARGET,
                                   DataConfig, auto_vocab, source_vocab)
from streamnmt.data.prepare import prepare_data
from streamnmt.data.tokenizer import vocab_cap
from streamnmt.data.writing import unspaced_letter, unspaced_share, word_form_ratio
from streamnmt.training.recipe import resolve_corpus
from tests.data.conftest import HANZI, WORDS, write_corpus, write_split


@pytest.mark.parametrize("pairs, vocab", [(600, SMALL_CORPUS_VOCAB), (SMALL_CORPUS_PAIRS - 1, SMALL_CORPUS_VOCAB),
                                          (SMALL_CORPUS_PAIRS, CORPUS_VOCAB), (None, CORPUS_VOCAB)])
def test_the_vocabulary_halves_below_the_small_corpus_bound_and_not_for_the_builtin_corpus(pairs, vocab):
    assert auto_vocab(pairs) == vocab


@pytest.mark.parametrize("preset", ["base", "small", "big", "iwslt"])
def test_a_small_corpus_trains_with_at_least_the_small_corpus_dropout(preset):
    assert corpus_dropout(preset, 40000) == max(preset_dropout(preset), SMALL_CORPUS_DROPOUT)
    assert corpus_dropout(preset, 5_000_000) == preset_dropout(preset)
    assert corpus_dropout(preset, None) == preset_dropout(preset)  # the built-in corpus keeps the preset's
    assert corpus_dropout("base", 40000) > corpus_dropout("base", 5_000_000)


def test_data_config_leaves_the_vocabulary_to_the_rule_and_still_checks_a_given_one():
    assert DataConfig().src_vocab is None and DataConfig().tgt_vocab is None
    with pytest.raises(Exception, match="src_vocab"):
        DataConfig(src_vocab=8)


PIECES = ["<pad>", "<s>", "</s>", "<unk>", "▁the", "▁cat", "猫", "看見", "の", "，", "42"]


def _bundle(pairs: int | None, auto: dict[str, int], kept: int = 4, tokens: int = 30, target: tuple[int, ...] = (4, 5),
            why: dict[str, str] | None = None, forms: float | None = None):
    """prepare_data's bundle as resolve_corpus reads it; ``target``: the ids the training targets repeat
    (PIECES: 4-5 English, 6-8 Chinese or Japanese, 9-10 no letter); ``forms``: the target's word forms over
    the source's (None: too few words to count)."""
    train = type("Train", (), {"__len__": lambda self: kept, "num_tokens": lambda self: (tokens, tokens),
                               "tgt_tokens": np.array(target * 50, dtype=np.int32)})()
    tok = SimpleNamespace(vocab_size=777, piece=PIECES.__getitem__)
    return SimpleNamespace(train_pairs=pairs, auto_vocab=auto, auto_why=why or {}, train=train, src_tok=tok, tgt_tok=tok,
                           word_forms=lambda: forms)


def _job(**model) -> TrainJob:
    """A job as resolve_job leaves it: the preset resolved (its dropout filled where none is given)."""
    job = build_job({"model": "base", **model})
    return dataclasses.replace(job, model=job.model.resolve("base"))


def test_resolve_corpus_chooses_the_dropout_unless_given_and_says_so():
    lines: list[str] = []
    job = resolve_corpus(_job(), _bundle(40000, {"source": 16000, "target": 16000}), dropout_given=False, log=lines.append)
    assert job.model.dropout == SMALL_CORPUS_DROPOUT
    assert job.data.src_vocab == job.data.tgt_vocab == 777  # the tokenizers' own sizes, as every rank has them
    assert len(lines) == 1 and "40,000 training pairs" in lines[0] and "7.5 target tokens a pair" in lines[0]
    assert "--dropout 0.3 (auto)" in lines[0] and ("source tokenizer of 16000 pieces asked (auto), 777 trained; target tokenizer of "
                                                      "16000 pieces asked (auto), 777 trained;") in lines[0]
    assert job.model.label_smoothing == DEFAULT_LABEL_SMOOTHING  # an English-lettered target
    assert f"--label-smoothing {DEFAULT_LABEL_SMOOTHING:g} (auto: 0% of the target's letters Chinese or Japanese)" in lines[0]

    lines.clear()
    given = resolve_corpus(_job(dropout=0.1), _bundle(40000, {}), dropout_given=True, log=lines.append)
    assert given.model.dropout == 0.1 and "--dropout 0.1;" in lines[0] and "(auto)" not in lines[0]
    assert "tokenizers given or found (777 source and 777 target pieces)" in lines[0]

    lines.clear()
    large = resolve_corpus(_job(), _bundle(2_000_000, {"shared": 32000}), dropout_given=False, log=lines.append)
    assert large.model.dropout == preset_dropout("base") and "large-corpus recipe" in lines[0]
    assert "shared tokenizer of 32000 pieces asked" in lines[0]


@pytest.mark.parametrize("pairs, why", [(40000, "at most 1.5x the target's pieces"), (2_000_000, "")])
def test_the_start_line_gives_the_reason_the_tokenizers_training_recorded(pairs, why):
    """The source's reason comes from its training (DataBundle.auto_why), never from its size: a large
    corpus whose source size happens to be 1.5x the target's pieces (32000 beside 21333) gets none."""
    lines: list[str] = []
    bundle = _bundle(pairs, {"source": 32000}, why={"source": why} if why else None)
    bundle.tgt_tok = SimpleNamespace(vocab_size=21333, piece=PIECES.__getitem__)
    resolve_corpus(_job(), bundle, dropout_given=False, log=lines.append)
    assert ("source tokenizer of 32000 pieces asked (auto: at most 1.5x the target's pieces)" in lines[0]) == bool(why)
    assert "source tokenizer of 32000 pieces asked (auto" in lines[0]


def test_the_builtin_corpus_gets_no_corpus_line_and_keeps_the_presets_dropout():
    lines: list[str] = []
    job = resolve_corpus(_job(), _bundle(None, {}, target=(6, 7)), dropout_given=False, log=lines.append)
    assert job.model.dropout == preset_dropout("base") and lines == []
    assert job.model.label_smoothing == DEFAULT_LABEL_SMOOTHING  # Chinese, but the built-in corpus's recipe


@pytest.mark.parametrize("pairs, share, smoothing", [
    (40000, UNSPACED_SHARE, RICH_LABEL_SMOOTHING), (40000, 1.0, RICH_LABEL_SMOOTHING),
    (SMALL_CORPUS_PAIRS - 1, 0.9, RICH_LABEL_SMOOTHING),
    (40000, UNSPACED_SHARE - 0.01, DEFAULT_LABEL_SMOOTHING),  # a target-tagged corpus with some Japanese
    (40000, 0.0, DEFAULT_LABEL_SMOOTHING), (40000, None, DEFAULT_LABEL_SMOOTHING),  # no letter counted
    (SMALL_CORPUS_PAIRS, 1.0, DEFAULT_LABEL_SMOOTHING), (None, 1.0, DEFAULT_LABEL_SMOOTHING)])  # large, built-in
def test_label_smoothing_rises_only_for_a_small_corpus_of_chinese_or_japanese_targets(pairs, share, smoothing):
    assert corpus_label_smoothing(pairs, share) == smoothing


@pytest.mark.parametrize("pairs, forms, smoothing", [
    (40000, RICH_SMOOTHING_FORMS, RICH_LABEL_SMOOTHING), (10000, 2.0, RICH_LABEL_SMOOTHING),  # a target rich in forms
    (40000, RICH_SMOOTHING_FORMS - 0.01, DEFAULT_LABEL_SMOOTHING), (40000, 1.0, DEFAULT_LABEL_SMOOTHING),
    (40000, None, DEFAULT_LABEL_SMOOTHING),  # not counted
    (SMALL_CORPUS_PAIRS, 3.0, DEFAULT_LABEL_SMOOTHING), (None, 3.0, DEFAULT_LABEL_SMOOTHING)])  # large, built-in
def test_label_smoothing_rises_for_a_small_corpus_whose_target_is_rich_in_word_forms(pairs, forms, smoothing):
    assert corpus_label_smoothing(pairs, 0.0, forms) == smoothing
    assert corpus_label_smoothing(pairs, None, forms) == smoothing  # no letter counted: the forms alone


@pytest.mark.parametrize("forms, smoothing", [(1.0, DEFAULT_LABEL_SMOOTHING), (RICH_SMOOTHING_FORMS, RICH_LABEL_SMOOTHING)])
def test_resolve_corpus_chooses_the_label_smoothing_from_the_word_forms_and_says_them(forms, smoothing):
    lines: list[str] = []
    counted: list[int] = []
    bundle = _bundle(40000, {}, forms=forms)
    bundle.word_forms = lambda: counted.append(1) or forms
    job = resolve_corpus(_job(), bundle, dropout_given=False, log=lines.append)
    assert job.model.label_smoothing == smoothing
    assert (f"--label-smoothing {smoothing:g} (auto: 0% of the target's letters Chinese or Japanese, the target "
            f"has {forms:.2f}x the source's word forms)") in lines[0]
    lines.clear()
    given = resolve_corpus(_job(label_smoothing=0.1), bundle, dropout_given=False, log=lines.append)
    assert given.model.label_smoothing == 0.1 and "word forms" not in lines[0]
    chinese_target = _bundle(40000, {}, target=(6, 7), forms=forms)
    chinese_target.word_forms = lambda: counted.append(1) or forms
    chinese = resolve_corpus(_job(), chinese_target, dropout_given=False, log=lines.append)
    assert chinese.model.label_smoothing == RICH_LABEL_SMOOTHING and "word forms" not in lines[-1]
    assert counted == [1]  # counted once: not where the flag is given, nor for a Chinese target


def test_the_recipe_and_the_tokenizers_training_count_the_same_word_forms(tmp_path):
    """The data: line (the tokenizers' training) and the label smoothing (DataBundle.word_forms, also where
    the tokenizers are found) count the same first pairs of the split: one number."""
    import json

    _inflecting_corpus(tmp_path / "c", ["", "en", "er", "es"], n=600, key="de")
    lines: list[str] = []
    # a sample of 100 of the 600 pairs trains the tokenizers; the words are counted in the split's order
    cfg = DataConfig(data=str(tmp_path / "c"), tgt_lang="de", max_len=40, tokenizer_sample=100)
    bundle = prepare_data(cfg, log=lines.append)
    rows = json.loads((tmp_path / "c" / "train.json").read_text())
    raw = word_form_ratio([r["en"] for r in rows], [r["de"] for r in rows])
    assert raw > RICH_SMOOTHING_FORMS and bundle.word_forms() == raw
    (line,) = [ln for ln in lines if "word forms" in ln]
    assert f"the target has {raw:.2f}x" in line
    found = prepare_data(cfg, log=lines.append)  # the tokenizers found, the splits from the cache
    assert found.auto_vocab == {} and found.word_forms() == raw


@pytest.mark.parametrize("key", ["zh", "src"])
def test_a_source_without_spaces_has_its_word_forms_counted_nowhere(tmp_path, key):
    """Each run of a Chinese source's letters would count as one word: neither the tokenizers' training
    nor the label smoothing counts them (a key naming no language: its text decides)."""
    rng = random.Random(0)
    clause = lambda: "".join(rng.choice(HANZI[:-2]) for _ in range(rng.randint(2, 4)))  # noqa: E731
    pairs = [("，".join(clause() for _ in range(3)), " ".join(rng.choice(WORDS) for _ in range(6))) for _ in range(640)]
    for split, (a, b) in (("train", (0, 600)), ("dev", (600, 620)), ("test", (620, 640))):
        write_split(tmp_path / "c", split, pairs[a:b], "json", src=key, tgt="de")
    lines: list[str] = []
    bundle = prepare_data(DataConfig(data=str(tmp_path / "c"), src_lang=key, tgt_lang="de", max_len=40), log=lines.append)
    assert word_form_ratio(*zip(*pairs[:600])) is not None  # the count itself would give a number
    assert bundle.word_forms() is None
    assert any("the source is written without spaces: the word forms are not counted" in ln for ln in lines)
    # the source's model found, only the target's trained: the source's key stands for the tokenizers
    # (no language read from its sample), yet its text still leaves the word forms uncounted
    (tmp_path / "c" / "tokenizer" / "tgt.model").unlink()
    lines.clear()
    prepare_data(DataConfig(data=str(tmp_path / "c"), src_lang=key, tgt_lang="de", max_len=40), log=lines.append)
    assert any("the source is written without spaces: the word forms are not counted" in ln for ln in lines)
    assert not any("x the source's word forms" in ln for ln in lines)


def test_resolve_corpus_chooses_the_label_smoothing_from_the_targets_script_unless_given():
    lines: list[str] = []
    job = resolve_corpus(_job(), _bundle(40000, {}, target=(6, 7, 8, 9)), dropout_given=False, log=lines.append)
    assert job.model.label_smoothing == RICH_LABEL_SMOOTHING
    assert "--label-smoothing 0.2 (auto: 100% of the target's letters Chinese or Japanese)" in lines[0]
    assert "--dropout, --label-smoothing, --src-vocab and --tgt-vocab override it" in lines[0]

    lines.clear()
    given = resolve_corpus(_job(label_smoothing=0.1), _bundle(40000, {}, target=(6, 7)), dropout_given=False,
                           log=lines.append)
    assert given.model.label_smoothing == 0.1 and "--label-smoothing 0.1;" in lines[0]
    lines.clear()
    large = resolve_corpus(_job(), _bundle(2_000_000, {}, target=(6, 7)), dropout_given=False, log=lines.append)
    assert large.model.label_smoothing == DEFAULT_LABEL_SMOOTHING and "--label-smoothing 0.1 (auto);" in lines[0]


def test_unspaced_share_weighs_letters_by_their_count_over_a_sample_spread_across_the_split():
    piece = PIECES.__getitem__
    # "▁the" 3 letters x 2, "猫" 1, "看見" 2: 3 of 9 letters; "，" and "42" are no letters
    assert unspaced_share(np.array([4, 4, 6, 7, 9, 10]), piece) == pytest.approx(3 / 9)
    assert unspaced_share(np.array([9, 10, 9]), piece) is None and unspaced_share(np.array([], int), piece) is None
    halves = np.array([4] * 5000 + [8] * 15000)  # one language's pairs listed after another's
    assert unspaced_share(halves, piece, sample=100) == pytest.approx(unspaced_share(halves, piece), abs=0.05)
    assert unspaced_share(halves, piece) == pytest.approx(15000 / (15000 + 3 * 5000))
    assert unspaced_letter("の") and unspaced_letter("猫") and not unspaced_letter("é") and not unspaced_letter("한")


def test_prepare_asks_the_rules_size_where_no_flag_gives_one(tmp_path):
    write_corpus(tmp_path / "c", n_train=300)
    lines: list[str] = []
    bundle = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24, tgt_vocab=120), log=lines.append)
    assert bundle.train_pairs == 300 and bundle.auto_vocab == {"source": SMALL_CORPUS_VOCAB}  # the target's size was given
    assert any(f"asked for {SMALL_CORPUS_VOCAB}" in line for line in lines)  # capped: the corpus is small
    assert bundle.tgt_tok.vocab_size <= 120
    lines.clear()
    again = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24), log=lines.append)
    # the target was trained for the flag's 120: the rule's size asks another; the source's size follows
    # the target's pieces where neither is given, so it is trained again beside it
    assert set(again.auto_vocab) == {"source", "target"} and again.auto_vocab["target"] == SMALL_CORPUS_VOCAB
    assert any("tgt.model was trained for 120 pieces asked, not the corpus rule's size: trained again" in line
               for line in lines)
    assert any("src.model was trained beside another target model" in line for line in lines)
    third = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24), log=lambda _: None)
    assert third.auto_vocab == {} and third.tgt_tok.sha256 == again.tgt_tok.sha256  # found on disk: nothing asked
    assert np.array_equal(third.train.tgt_offsets, again.train.tgt_offsets)


def test_a_data_run_trains_and_records_the_rules_choice_and_a_flag_overrides_it(tmp_path, monkeypatch, capsys):
    import yaml

    from streamnmt.cli import main
    from streamnmt.data import tokenizer_child

    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    targets = [t for _, t in write_corpus(tmp_path / "c", n_train=120)["train"]]
    source = source_vocab(SMALL_CORPUS_VOCAB, vocab_cap(targets, SMALL_CORPUS_VOCAB, True, SMALL_CORPUS_PIECES_PER_CHARACTER))
    assert source < SMALL_CORPUS_VOCAB  # a Chinese target of a few dozen characters: the source is capped
    taken: list = []  # the first run's tokenizers are trained in the child process the command starts
    take = tokenizer_child.take
    monkeypatch.setattr(tokenizer_child, "take", lambda cfg, log: taken.append(take(cfg, log)) or taken[-1])
    flags = ["train", "--data", str(tmp_path / "c"), "--device", "cpu", "--model", "tiny", "--max-steps", "2",
             "--bleu-samples", "0", "--max-len", "24", "--project", str(tmp_path / "runs")]
    for name, extra, dropout in (("auto", [], SMALL_CORPUS_DROPOUT), ("given", ["--dropout", "0.05"], 0.05)):
        assert main([*flags, "--name", name, *extra]) == 0
        config = yaml.safe_load((tmp_path / "runs" / name / "config.yaml").read_text())
        assert config["model"]["dropout"] == dropout
        assert config["model"]["label_smoothing"] == RICH_LABEL_SMOOTHING  # the test corpus's target is Chinese
        assert isinstance(config["data"]["src_vocab"], int) and config["data"]["src_vocab"] <= SMALL_CORPUS_VOCAB
    out = capsys.readouterr().out
    assert out.count("recipe: a corpus of 120 training pairs") == 2 and "--dropout 0.05;" in out
    assert taken[0] is not None and taken[1:] == [None]  # the second run found them: no child
    assert out.count("data: trained source tokenizer and target tokenizer on 120 sampled pairs") == 1
    src, tgt = config["data"]["src_vocab"], config["data"]["tgt_vocab"]  # the sizes trained
    assert (f"source tokenizer of {source} pieces asked (auto: at most {SOURCE_PER_TARGET}x the target's "
            f"pieces){f', {src} trained' if src < source else ''}; target tokenizer of {SMALL_CORPUS_VOCAB} "
            f"pieces asked (auto: at most {SMALL_CORPUS_PIECES_PER_CHARACTER} per distinct character of a target "
            f"without spaces), {tgt} trained;") in out
    assert f"data: the source tokenizer asks {source} pieces, not {SMALL_CORPUS_VOCAB}" in out
    assert (f"vocabulary capped at {tgt} pieces (asked for {SMALL_CORPUS_VOCAB}): at most "
            f"{SMALL_CORPUS_PIECES_PER_CHARACTER} per distinct character of a target without spaces") in out


def test_the_source_never_asks_fewer_pieces_than_its_characters_need(tmp_path):
    """A target of few characters beside a source of many (here 56 distinct letters, every one needed at
    the source's full character coverage, and signs that NFKC folds into several new ones): 1.5x the
    target's pieces would be under what SentencePiece needs for the source's characters, and its
    training would fail; the source asks that many instead."""
    from streamnmt.data.tokenizer import min_pieces

    rng = random.Random(0)
    letters = [chr(c) for c in range(0x3b1, 0x3c9)] + [chr(c) for c in range(0x430, 0x450)]  # Greek, Cyrillic
    pairs = [(" ".join(["".join(rng.choices(letters, k=4)) for _ in range(5)] + [rng.choice("㍿㍾㍽㍼½")]),
              "".join(rng.choices("甲乙丙丁", k=6))) for _ in range(200)]
    for split, chunk in (("train", pairs[:160]), ("dev", pairs[160:180]), ("test", pairs[180:])):
        write_split(tmp_path / "c", split, chunk, "json")
    sources, targets = [p[0] for p in pairs[:160]], [p[1] for p in pairs[:160]]
    fewest = min_pieces(sources)
    assert round(SOURCE_PER_TARGET * vocab_cap(targets, SMALL_CORPUS_VOCAB, True, SMALL_CORPUS_PIECES_PER_CHARACTER)) < fewest
    lines: list[str] = []
    bundle = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=64), log=lines.append)
    assert bundle.auto_vocab["source"] == fewest >= bundle.src_tok.vocab_size
    assert bundle.auto_why["source"] == f"at most {SOURCE_PER_TARGET}x the target's pieces, raised to the {fewest} its characters need"
    assert any(f"raised to the {fewest} its characters need" in line for line in lines)


@pytest.mark.parametrize("given", [{}, {"tgt_vocab": 60}])
def test_a_chinese_source_of_many_characters_asks_at_least_its_characters(tmp_path, monkeypatch, given):
    """Chinese to English where the rule's size (SMALL_CORPUS_VOCAB, here made smaller than the source's
    80 characters, as a lean 4,000 would be beside a real Chinese source of several thousand) is under
    what the source's characters need: SentencePiece cannot train a source under them ("Vocabulary size
    is smaller than required_chars"), so the source asks what they need, whether or not --tgt-vocab is
    given. The word forms are not counted (a source without spaces counts each run of letters as one
    word), so the lean rule, which such a ratio would pick, stays out."""
    import streamnmt.data.config as data_config
    from streamnmt.data.tokenizer import min_pieces

    monkeypatch.setattr(data_config, "LEAN_MIN_PAIRS", 1000)
    monkeypatch.setattr(data_config, "SMALL_CORPUS_VOCAB", 40)
    rng = random.Random(0)
    hanzi = [chr(0x4E00 + i) for i in range(80)]
    pairs = [("".join(rng.choices(hanzi, k=8)) + "。", " ".join(rng.choices(WORDS, k=5))) for _ in range(1300)]
    for split, chunk in (("train", pairs[:1200]), ("dev", pairs[1200:1250]), ("test", pairs[1250:])):
        write_split(tmp_path / "c", split, chunk, "json", src="ch", tgt="en")
    fewest = min_pieces([p[0] for p in pairs[:1200]], True)
    lines: list[str] = []
    bundle = prepare_data(DataConfig(data=str(tmp_path / "c"), src_lang="ch", tgt_lang="en", max_len=24, **given),
                          log=lines.append)
    assert any("the source is written without spaces: the word forms are not counted; 40 pieces" in line
               for line in lines) and not any("word forms (distinct words" in line for line in lines)
    assert bundle.auto_vocab["source"] == fewest > 40 and bundle.src_tok.vocab_size > 40
    assert bundle.auto_why["source"].endswith(f"raised to the {fewest} its characters need")
    assert any(line.endswith(f"raised to the {fewest} its characters need (SentencePiece trains no fewer)")
               for line in lines)  # not "--src-vocab overrides it": a size under its characters fails


def test_a_shared_tokenizer_takes_the_rules_size_unless_either_side_gives_one(tmp_path):
    write_corpus(tmp_path / "c", n_train=200)
    lines: list[str] = []
    bundle = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24, shared_vocab=True), log=lines.append)
    assert bundle.auto_vocab == {"shared": SMALL_CORPUS_VOCAB} and bundle.src_tok is bundle.tgt_tok
    assert any(f"asked for {SMALL_CORPUS_VOCAB}" in line for line in lines)
    write_corpus(tmp_path / "d", n_train=200)
    given = prepare_data(DataConfig(data=str(tmp_path / "d"), max_len=24, shared_vocab=True, src_vocab=90),
                         log=lambda _: None)
    assert given.auto_vocab == {} and given.src_tok.vocab_size <= 90


@pytest.mark.parametrize("pairs, forms, vocab", [
    (40000, 1.0, LEAN_VOCAB), (LEAN_MIN_PAIRS, RICH_FORMS - 0.01, LEAN_VOCAB),
    (40000, RICH_FORMS, SMALL_CORPUS_VOCAB), (40000, 1.7, SMALL_CORPUS_VOCAB),  # a target rich in forms
    (LEAN_MIN_PAIRS - 1, 1.0, SMALL_CORPUS_VOCAB),  # too few pairs to halve (not measured there)
    (40000, None, SMALL_CORPUS_VOCAB),  # not counted (a shared tokenizer)
    (SMALL_CORPUS_PAIRS, 1.0, CORPUS_VOCAB), (None, 1.0, CORPUS_VOCAB)])  # large, built-in: 32k
def test_the_vocabulary_halves_again_for_a_target_with_few_more_word_forms_than_its_source(pairs, forms, vocab):
    assert auto_vocab(pairs, forms) == vocab


def test_word_form_ratio_counts_distinct_words_over_the_same_number_of_words():
    src = ["the cat sees the dog", "a big red house"] * 300
    assert word_form_ratio(src, src) == 1.0
    inflected = [" ".join(w + ["", "en", "er", "es"][i // 2 % 4] for w in s.split()) for i, s in enumerate(src)]
    assert word_form_ratio(src, inflected) == pytest.approx(4.0)  # every word in four forms
    assert word_form_ratio(src, src + [f"w{i}" for i in range(5000)]) == 1.0  # only as many words as the source's
    assert word_form_ratio(src, [s + " and more words" for s in src]) == pytest.approx(11 / 8)
    rng = random.Random(0)
    cjk = ["".join(rng.choice(HANZI[:-2]) for _ in range(6)) + "，" + "".join(rng.choice(HANZI[:-2]) for _ in range(5))
           for _ in range(600)]
    assert word_form_ratio(src, cjk) > RICH_FORMS  # no spaces: each clause a "word", nearly all distinct
    assert word_form_ratio(src[:100], src[:100]) is None  # under 1,000 words: not counted
    assert word_form_ratio(src, [s.upper() for s in src]) == 1.0  # case is not a form


def _inflecting_corpus(directory, suffixes: list[str], n: int = 400, key: str = "ch") -> None:
    """English-like source; a target (under ``key``) that renders each word in one of ``suffixes``' forms."""
    rng = random.Random(0)
    for split, k in (("train", n), ("dev", 20), ("test", 20)):
        pairs = []
        for _ in range(k):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
            pairs.append((" ".join(words), " ".join(w[::-1] + rng.choice(suffixes) for w in words)))
        write_split(directory, split, pairs, "json", tgt=key)


@pytest.mark.parametrize("suffixes, vocab", [([""], LEAN_VOCAB), (["", "en", "er", "es"], SMALL_CORPUS_VOCAB)])
def test_prepare_asks_the_lean_vocabulary_for_a_target_with_few_word_forms(tmp_path, monkeypatch, suffixes, vocab):
    from streamnmt.data import config as data_config

    monkeypatch.setattr(data_config, "LEAN_MIN_PAIRS", 100)  # a corpus the test can afford
    _inflecting_corpus(tmp_path / "c", suffixes)
    lines: list[str] = []
    bundle = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24), log=lines.append)
    assert bundle.auto_vocab["target"] == vocab  # the source's: at most 1.5x the target's cap (a tiny corpus)
    targets = _targets(tmp_path / "c")  # under the key "ch": capped as Chinese text is
    assert bundle.auto_vocab["source"] == source_vocab(vocab, vocab_cap(targets, vocab, True, SMALL_CORPUS_PIECES_PER_CHARACTER))
    (line,) = [ln for ln in lines if "word forms" in ln]
    assert f"{vocab} pieces where no size is given" in line
    shared = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24, shared_vocab=True), log=lines.append)
    assert shared.auto_vocab == {"shared": SMALL_CORPUS_VOCAB}  # one tokenizer of both sides: not counted


def _targets(directory) -> list[str]:
    import json

    return [r["ch"] for r in json.loads((directory / "train.json").read_text())]


@pytest.mark.parametrize("asked, target, source", [
    (SMALL_CORPUS_VOCAB, 5100, round(SOURCE_PER_TARGET * 5100)),  # a Japanese target's cap: the source lowered
    (SMALL_CORPUS_VOCAB, 8084, round(SOURCE_PER_TARGET * 8084)),
    (SMALL_CORPUS_VOCAB, SMALL_CORPUS_VOCAB, SMALL_CORPUS_VOCAB),  # a spaced target as large: unchanged
    (LEAN_VOCAB, LEAN_VOCAB, LEAN_VOCAB), (SMALL_CORPUS_VOCAB, 11642, SMALL_CORPUS_VOCAB)])
def test_the_source_asks_at_most_a_multiple_of_the_targets_pieces(asked, target, source):
    assert source_vocab(asked, target) == source


@pytest.mark.parametrize("lang, given, cap", [
    ("ch", None, 1 * 7 + 4),  # the rule's size: SMALL_CORPUS_PIECES_PER_CHARACTER per distinct character
    ("zh_CN", None, 1 * 7 + 4), ("ch", 500, 4 * 7 + 4),  # --tgt-vocab given: the tokenizer's own cap
    ("ko", None, 4 * 7 + 4),  # Korean spaces its words: the tokenizer's own cap for its script, not the rule's
    ("de", None, 4 + 7 + 4)])  # spaced: 4 distinct words, 7 characters with the space, as before
def test_a_target_without_spaces_keeps_fewer_pieces_per_character_unless_its_size_is_given(lang, given, cap):
    from streamnmt.data.tokenizer_training import target_cap

    assert SMALL_CORPUS_PIECES_PER_CHARACTER == 1  # the cases below count with it
    sample = ["甲乙 丙", "丁戊 己", "甲乙 丙"] if lang == "de" else ["甲乙丙", "丁戊己甲"]  # 6 distinct characters, and the word-boundary mark
    cfg = DataConfig(data="c", tgt_lang=lang, tgt_vocab=given)
    got, why = target_cap(cfg, sample, given or SMALL_CORPUS_VOCAB)
    assert got == cap and (f"at most {SMALL_CORPUS_PIECES_PER_CHARACTER} per distinct character" in why) == (
        lang not in ("de", "ko") and given is None)
    if lang == "ch" and given is None:  # characters enough for the size asked: no cap, no reason given
        assert target_cap(cfg, sample, cap) == (cap, "") and target_cap(cfg, sample, cap + 1) == (cap, why)


def test_a_chinese_target_keyed_by_no_language_trains_as_chinese(tmp_path):
    """A corpus keyed ``src``/``tgt`` (an OpenNMT user's names): the tokenizers read the text, so a Chinese
    target gets the same model as under the key ``ch``, and one line says why."""
    for key in ("ch", "tgt"):
        write_corpus(tmp_path / key, n_train=300, src="src", tgt=key)
    lines: list[str] = []
    by_text = prepare_data(DataConfig(data=str(tmp_path / "tgt"), src_lang="src", tgt_lang="tgt", max_len=24),
                           log=lines.append)
    by_key = prepare_data(DataConfig(data=str(tmp_path / "ch"), src_lang="src", tgt_lang="ch", max_len=24),
                          log=lambda _: None)
    assert by_text.tgt_tok.vocab_size == by_key.tgt_tok.vocab_size and by_text.auto_why == by_key.auto_why
    assert (by_text.data_dir / "tokenizer" / "tgt.model").read_bytes() == (
        by_key.data_dir / "tokenizer" / "tgt.model").read_bytes()
    assert any("the target key 'tgt' names none of Chinese, Japanese and Korean, but its text is Chinese" in line
               for line in lines)
    assert not any("the source key" in line for line in lines)  # English: the key stands


def test_prepare_caps_the_source_at_the_targets_pieces_unless_a_size_is_given(tmp_path):
    targets = [t for _, t in write_corpus(tmp_path / "c", n_train=300)["train"]]
    cap = vocab_cap(targets, SMALL_CORPUS_VOCAB, True, SMALL_CORPUS_PIECES_PER_CHARACTER)  # a few dozen characters
    lines: list[str] = []
    bundle = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24), log=lines.append)
    assert bundle.auto_vocab == {"source": round(SOURCE_PER_TARGET * cap), "target": SMALL_CORPUS_VOCAB}
    assert any(f"at most {SOURCE_PER_TARGET}x the target's {cap}" in line for line in lines)
    # the target found on disk, the source trained again: capped by the model found
    (tmp_path / "c" / "tokenizer" / "src.model").unlink()
    again = prepare_data(DataConfig(data=str(tmp_path / "c"), max_len=24), log=lambda _: None)
    assert again.auto_vocab == {"source": round(SOURCE_PER_TARGET * bundle.tgt_tok.vocab_size)}
    assert bundle.auto_why == {"source": f"at most {SOURCE_PER_TARGET}x the target's pieces",
                               "target": f"at most {SMALL_CORPUS_PIECES_PER_CHARACTER} per distinct character of a "
                                         "target without spaces"}
    assert again.auto_why == {"source": f"at most {SOURCE_PER_TARGET}x the target's pieces"}
    for given in ({"src_vocab": 500}, {"tgt_vocab": 120}):  # either size given: the rule's sizes, uncapped
        write_corpus(tmp_path / str(given), n_train=300)
        bundle = prepare_data(DataConfig(data=str(tmp_path / str(given)), max_len=24, **given), log=lambda _: None)
        assert SMALL_CORPUS_VOCAB in bundle.auto_vocab.values() and len(bundle.auto_vocab) == 1
