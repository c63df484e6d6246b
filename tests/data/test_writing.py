"""streamnmt.data.writing: the language a text is written in, where its key does not say it."""

from __future__ import annotations

import pytest

import itertools

from streamnmt.data.writing import FORM_WINDOW, corpus_word_forms, word_form_ratio, written_language

CHINESE = ["我们是学生。", "文件无法打开", "请稍后再试"]
JAPANESE = ["ファイルを開けません", "後でもう一度お試しください", "設定を保存しました"]


@pytest.mark.parametrize("key, text, language", [
    ("tgt", CHINESE, "zh"), ("tgt", JAPANESE, "ja"), ("de", CHINESE, "zh"),  # the text, whatever the key
    ("tgt", ["파일을 열 수 없습니다"], "ko"),  # Hangul
    ("tgt", ["Datei kann nicht geöffnet werden"], None),  # spaced text: the key stands
    ("zh", JAPANESE, None), ("ko", CHINESE, None),  # a CJK key stands: it says the language
    ("tgt", [], None), ("tgt", ["42 !?"], None)])  # no letter
def test_the_text_names_the_language_only_where_the_key_names_none_of_chinese_japanese_korean(key, text, language):
    assert written_language(key, text) == language


def test_the_shares_decide_at_their_thresholds():
    english = "abcdefghij"  # 10 letters
    assert written_language("tgt", ["猫" * 10 + english]) == "zh"  # half the letters Chinese
    assert written_language("tgt", ["猫" * 9 + english]) is None  # under UNSPACED_SHARE
    assert written_language("tgt", ["한" * 10 + english]) == "ko" and written_language("tgt", ["한" * 9 + english]) is None
    assert written_language("tgt", ["猫" * 9 + "の"]) == "ja" and written_language("tgt", ["猫" * 10 + "の"]) == "zh"


def test_a_long_text_is_read_over_a_sample_spread_across_it():
    english, chinese = ["abcde fghij"], ["我们是学生文件无法打"]  # 10 letters a line each
    text = english * 1000 + chinese * 3000  # one language's lines after another's: 3 in 4 letters Chinese
    assert written_language("tgt", text, sample=100) == written_language("tgt", text) == "zh"
    assert written_language("tgt", english * 3000 + chinese * 1000, sample=100) is None  # 1 in 4


def test_the_word_forms_of_pairs_read_only_as_far_as_both_sides_first_words():
    pairs = [("the cat sees the dog", f"die katze{i % 3} sieht den hund") for i in range(2000)]
    read: list[int] = []
    endless = (read.append(1) or pairs[i % len(pairs)] for i in itertools.count())
    assert corpus_word_forms(endless, "en", window=3000) == (word_form_ratio(*zip(*pairs), window=3000), False)
    assert len(read) == 600  # 5 words a side: the 600th pair reaches 3,000 on both
    assert corpus_word_forms(pairs[:100], "en") == (None, False)  # under 1,000 words: not counted
    assert corpus_word_forms(pairs, "en")[0] == word_form_ratio(*zip(*pairs)) and 2000 * 5 < FORM_WINDOW  # the whole split


def test_a_source_key_naming_chinese_reads_none_of_the_split():
    read: list[int] = []
    endless = (read.append(1) or ("猫看见狗", "the cat sees the dog") for _ in itertools.count())
    assert corpus_word_forms(endless, "zh") == (None, True) and not read


@pytest.mark.parametrize("key, source, counted", [
    ("en", "the cat sees the dog", True), ("ko", "고양이가 개를 본다", True),  # Korean spaces its words
    ("src", "고양이가 개를 본다", True),  # no language key, Korean text: counted
    ("zh", "the cat sees the dog", False),  # the key names Chinese: not counted, whatever the text
    ("src", "猫看见狗，狗看见猫", False), ("src", "猫が犬を見る，犬が猫を見る", False)])  # no language key: the text
def test_the_corpus_count_leaves_out_a_source_without_spaces_and_says_so(key, source, counted):
    pairs = [(f"{source} {i % 7}", f"die katze{i % 3} sieht den hund") for i in range(1000)]
    forms, unspaced = corpus_word_forms(pairs, key)
    assert unspaced is not counted and (forms is not None) is counted
    if counted:
        assert forms == word_form_ratio(*zip(*pairs))
