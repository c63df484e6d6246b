"""The built-in corpus: numeral conventions, template renderings, determinism, splits, files."""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from pathlib import Path

import pytest

from streamnmt.data import grammar as G
from streamnmt.data import lexicon as L
from streamnmt.data import synthetic as S
from streamnmt.data import templates as T
from streamnmt.data.lexicon import PAST_VERBS, PEOPLE, THINGS

# Expected strings written by hand from the conventions in the docstring of streamnmt.data.grammar.
NUMBERS = [
    (0, "zero", "零"),
    (7, "seven", "七"),
    (10, "ten", "十"),
    (11, "eleven", "十一"),
    (15, "fifteen", "十五"),
    (20, "twenty", "二十"),
    (21, "twenty-one", "二十一"),
    (99, "ninety-nine", "九十九"),
    (100, "one hundred", "一百"),
    (101, "one hundred one", "一百零一"),
    (110, "one hundred ten", "一百一十"),
    (115, "one hundred fifteen", "一百一十五"),
    (222, "two hundred twenty-two", "二百二十二"),
    (1000, "one thousand", "一千"),
    (1005, "one thousand five", "一千零五"),
    (1010, "one thousand ten", "一千零一十"),
    (1050, "one thousand fifty", "一千零五十"),
    (1500, "one thousand five hundred", "一千五百"),
    (2021, "two thousand twenty-one", "二千零二十一"),
    (9999, "nine thousand nine hundred ninety-nine", "九千九百九十九"),
    (10000, "ten thousand", "一万"),
    (10010, "ten thousand ten", "一万零一十"),
    (20500, "twenty thousand five hundred", "二万零五百"),
    (120000, "one hundred twenty thousand", "十二万"),
    (345600, "three hundred forty-five thousand six hundred", "三十四万五千六百"),
]


@pytest.mark.parametrize("n,en,zh", NUMBERS)
def test_numbers_in_both_languages(n: int, en: str, zh: str) -> None:
    assert L.en_number(n) == en
    assert L.zh_number(n) == zh


def test_two_is_liang_only_when_counting() -> None:
    assert L.zh_count(2) == "两"
    assert L.zh_count(22) == "二十二"
    assert L.zh_count(200) == "二百"
    assert L.zh_number(2) == "二"


def test_numbers_out_of_range_raise() -> None:
    with pytest.raises(ValueError):
        L.en_number(1_000_000)
    with pytest.raises(ValueError):
        L.zh_number(-1)


@pytest.mark.parametrize("n,expected", [(1, "first"), (2, "second"), (3, "third"), (5, "fifth"),
                                        (8, "eighth"), (9, "ninth"), (11, "eleventh"), (12, "twelfth"),
                                        (20, "twentieth"), (21, "twenty-first"), (42, "forty-second"),
                                        (100, "one hundredth"), (103, "one hundred third")])
def test_ordinals(n: int, expected: str) -> None:
    assert L.en_ordinal(n) == expected


@pytest.mark.parametrize("hour,minute,period,en,zh", [
    (7, 0, None, "seven o'clock", "七点"),
    (2, 0, None, "two o'clock", "两点"),
    (7, 30, None, "half past seven", "七点半"),
    (7, 15, None, "a quarter past seven", "七点一刻"),
    (7, 45, None, "a quarter to eight", "差一刻八点"),
    (12, 45, None, "a quarter to one", "差一刻一点"),
    (7, 10, None, "ten past seven", "七点十分"),
    (8, 7, None, "seven minutes past eight", "八点零七分"),
    (8, 1, None, "one minute past eight", "八点零一分"),
    (8, 2, None, "two minutes past eight", "八点零二分"),
    (7, 50, None, "ten to eight", "差十分八点"),
    (7, 58, None, "two minutes to eight", "差两分八点"),
    (7, 30, "morning", "half past seven in the morning", "早上七点半"),
    (3, 20, "afternoon", "twenty past three in the afternoon", "下午三点二十分"),
])
def test_clock_times(hour: int, minute: int, period: str | None, en: str, zh: str) -> None:
    assert G.render_clock(hour, minute, period) == (en, zh)


@pytest.mark.parametrize("major,minor,currency,en,zh", [
    (32, 50, "dollar", "thirty-two dollars and fifty cents", "三十二美元五十美分"),
    (1, 1, "dollar", "one dollar and one cent", "一美元一美分"),
    (2, 0, "euro", "two euros", "两欧元"),
    (0, 75, "dollar", "seventy-five cents", "七十五美分"),
    (105, 0, "yuan", "one hundred five yuan", "一百零五元"),
])
def test_money(major: int, minor: int, currency: str, en: str, zh: str) -> None:
    assert G.render_money(major, minor, currency) == (en, zh)


def test_example_sentence() -> None:
    pair = G.render_purchase_on_date(PEOPLE["I"], PAST_VERBS["bought"], 25, THINGS["apple"], 2021, 3, 3)
    assert pair == ("I bought twenty-five apples on March 3, 2021.", "我在2021年3月3日买了二十五个苹果。")


@pytest.mark.parametrize("pair,expected", [
    (lambda: G.render_purchase_on_date(PEOPLE["my brother"], PAST_VERBS["bought"], 1, THINGS["book"],
                                       1999, 12, 31),
     ("My brother bought one book on December 31, 1999.", "我哥哥在1999年12月31日买了一本书。")),
    (lambda: G.render_purchase_on_weekday(PEOPLE["Tom"], PAST_VERBS["bought"], 2, THINGS["car"], 0,
                                          ("at the market", "在市场")),
     ("Tom bought two cars at the market on Monday.", "汤姆星期一在市场买了两辆车。")),
    (lambda: G.render_price(THINGS["book"], G.render_money(32, 50)),
     ("The book costs thirty-two dollars and fifty cents.", "这本书售价三十二美元五十美分。")),
    (lambda: G.render_paid(PEOPLE["she"], G.render_money(2, 0, "yuan"), 3, THINGS["cup of tea"]),
     ("She paid two yuan for three cups of tea.", "她花两元买了三杯茶。")),
    (lambda: G.render_compare_have(PEOPLE["Tom"], PEOPLE["Mary"], 3, THINGS["cat"]),
     ("Tom has three more cats than Mary.", "汤姆比玛丽多三只猫。")),
    (lambda: G.render_compare_have(PEOPLE["I"], PEOPLE["he"], 1, THINGS["book"], more=False),
     ("I have one fewer book than him.", "我比他少一本书。")),
    (lambda: G.render_compare_measure(PEOPLE["we"], PEOPLE["they"], 2, ["older", "大", "age"]),
     ("We are two years older than them.", "我们比他们大两岁。")),
    (lambda: G.render_there_are(1, THINGS["apple"], ("on the table", "桌子上")),
     ("There is one apple on the table.", "桌子上有一个苹果。")),
    (lambda: G.render_there_are(12, THINGS["sheep"], ("on the farm", "农场里")),
     ("There are twelve sheep on the farm.", "农场里有十二只羊。")),
    (lambda: G.render_event_at(G.render_clock(7, 30), ["the train left", "火车开了"]),
     ("At half past seven, the train left.", "七点半，火车开了。")),
    (lambda: G.render_routine(PEOPLE["Tom"], ["get up", "gets up", "起床"], G.render_clock(6, 45), 4),
     ("Tom gets up at a quarter to seven every Friday.", "汤姆每个星期五差一刻七点起床。")),
    (lambda: G.render_routine(PEOPLE["I"], ["get up", "gets up", "起床"], G.render_clock(6, 0)),
     ("I get up at six o'clock.", "我六点起床。")),
    (lambda: G.render_age(PEOPLE["I"], 1),
     ("I am one year old.", "我一岁。")),
    (lambda: G.render_age(PEOPLE["Tom"], 85, ("grandmother", "奶奶")),
     ("Tom's grandmother is eighty-five years old.", "汤姆的奶奶八十五岁。")),
    (lambda: G.render_city_distance(("Beijing", "北京"), ("Shanghai", "上海"), 1213),
     ("It is one thousand two hundred thirteen kilometers from Beijing to Shanghai.",
      "从北京到上海有一千二百一十三公里。")),
    (lambda: G.render_travel(PEOPLE["Tom"], "walked", "走了", L._U["km"].render(5), ("yesterday", "昨天")),
     ("Tom walked five kilometers yesterday.", "汤姆昨天走了五公里。")),
    (lambda: G.render_weight("elephant", "大象", "头", L._U["t"].render(2)),
     ("The elephant weighs two tons.", "这头大象重两吨。")),
    (lambda: G.render_speed(("train", "火车"), 120),
     ("The train travels at one hundred twenty kilometers per hour.", "火车的速度是每小时一百二十公里。")),
    (lambda: G.render_phone(PEOPLE["my mother"], "13800138000"),
     ("My mother's phone number is one three eight zero zero one three eight zero zero zero.",
      "我妈妈的电话号码是一三八零零一三八零零零。")),
    (lambda: G.render_bus(PEOPLE["he"], 105, ("school", "学校")),
     ("He takes the number one hundred five bus to school.", "他坐一百零五路公交车去学校。")),
    (lambda: G.render_born(PEOPLE["they"], G.render_date(1995)),
     ("They were born in 1995.", "他们出生于1995年。")),
    (lambda: G.render_birthday(PEOPLE["you"], 2, 29),
     ("Your birthday is on February 29.", "你的生日是2月29日。")),
    (lambda: G.render_date_event(PEOPLE["Mary"], ("moved to Beijing", "搬到了北京"), G.render_date(2021, 3)),
     ("Mary moved to Beijing in March 2021.", "玛丽在2021年3月搬到了北京。")),
    (lambda: G.render_arithmetic(25, "plus", 17),
     ("Twenty-five plus seventeen equals forty-two.", "二十五加十七等于四十二。")),
    (lambda: G.render_arithmetic(84, "divided by", 2),
     ("Eighty-four divided by two equals forty-two.", "八十四除以二等于四十二。")),
    (lambda: G.render_duration(PEOPLE["Tom"], ("studied English", "学了"), "英语", L._U["year"].render(3)),
     ("Tom studied English for three years.", "汤姆学了三年英语。")),
    (lambda: G.render_duration(PEOPLE["I"], ("waited", "等了"), "", L._U["h"].render(2)),
     ("I waited for two hours.", "我等了两个小时。")),
    (lambda: G.render_percent(2, ("students", "学生"), ("passed the exam", "通过了考试")),
     ("Two percent of the students passed the exam.", "百分之二的学生通过了考试。")),
    (lambda: G.render_owner_has("the city", "这座城市", 345600,
                                L.Thing("person", "people", "人", "", frozenset())),
     ("The city has three hundred forty-five thousand six hundred people.", "这座城市有三十四万五千六百人。")),
    (lambda: G.render_temperature(-5, "yesterday", ("Harbin", "哈尔滨")),
     ("It was minus five degrees in Harbin yesterday.", "昨天哈尔滨零下五度。")),
    (lambda: G.render_temperature(1, "tomorrow"),
     ("It will be one degree tomorrow.", "明天一度。")),
    (lambda: G.render_rank(PEOPLE["Li Lei"], 2),
     ("Li Lei finished second in the race.", "李雷在比赛中获得了第二名。")),
    (lambda: G.render_floor(PEOPLE["she"], 21),
     ("She lives on the twenty-first floor.", "她住在二十一楼。")),
])
def test_template_renderings(pair, expected: tuple[str, str]) -> None:
    assert pair() == expected


def test_enough_templates() -> None:
    assert len(T.TEMPLATES) >= 15


_ASCII_LETTER = re.compile(r"[A-Za-z]")


@pytest.mark.parametrize("name", sorted(T.TEMPLATES))
def test_every_template_is_well_formed(name: str) -> None:
    rng = random.Random(name)
    for _ in range(300):
        en, zh = T.TEMPLATES[name](rng)
        assert en and zh
        assert en[0].isupper() and en.endswith(".") and not en.endswith("..")
        assert "  " not in en and en == en.strip()
        assert zh.endswith("。") and zh.count("。") == 1
        assert not _ASCII_LETTER.search(zh), zh
        assert " " not in zh, zh


def test_generation_is_deterministic_per_seed() -> None:
    a = S.generate_pairs(500, seed=1)
    assert a == S.generate_pairs(500, seed=1)
    assert a != S.generate_pairs(500, seed=2)
    assert S.generate_pairs(800, seed=1)[:500] == a
    assert len({en for en, _ in a}) > 400  # varied, not one sentence repeated


def test_generated_corpus_is_pinned() -> None:
    # sha256 of the corpus as generated before the lexicon moved to its own module: a refactor of
    # the generator must not change one byte of the built-in corpus (runs and caches depend on it).
    splits = S.builtin_splits(16000, 0)
    digest = hashlib.sha256(json.dumps(splits, ensure_ascii=False).encode()).hexdigest()
    assert digest == "2baf98f83fa68dab66ab685ff858cb4e4f0b4a94c090693aae51d04837b1cba3"
    pairs = hashlib.sha256(json.dumps(S.generate_pairs(5000, 7), ensure_ascii=False).encode()).hexdigest()
    assert pairs == "49eb2c3e5aa12300cfe4e33fa770ad2a0cf97986fdfced7b073f90277a0dda84"


def test_generation_leaves_global_random_state_alone() -> None:
    random.seed(123)
    expected = random.random()
    random.seed(123)
    S.generate_pairs(100, seed=0)
    assert random.random() == expected


def test_generation_speed() -> None:
    start = time.perf_counter()
    pairs = S.generate_pairs(40_000, seed=0)
    elapsed = time.perf_counter() - start
    assert len(pairs) == 40_000
    assert elapsed < 4.0, f"40k pairs took {elapsed:.2f}s (target under 2 s)"


@pytest.mark.parametrize("n_train,n_eval", [(1000, 200), (10_000, 500)])
def test_splits_sizes_and_no_overlap(n_train: int, n_eval: int) -> None:
    splits = S.builtin_splits(n_train, seed=3)
    assert set(splits) == {"train", "dev", "test"}
    assert len(splits["train"]) == n_train
    assert len(splits["dev"]) == len(splits["test"]) == n_eval
    train_en = {en for en, _ in splits["train"]}
    dev_en = {en for en, _ in splits["dev"]}
    test_en = {en for en, _ in splits["test"]}
    assert len(dev_en) == n_eval and len(test_en) == n_eval
    assert not train_en & dev_en and not train_en & test_en and not dev_en & test_en
    assert splits == S.builtin_splits(n_train, seed=3)
    assert splits["train"] != S.builtin_splits(n_train, seed=4)["train"]


def test_splits_reject_empty_train() -> None:
    with pytest.raises(ValueError):
        S.builtin_splits(0)


def test_write_builtin(tmp_path: Path) -> None:
    S.write_builtin(tmp_path, n_train=300, seed=5)
    expected = S.builtin_splits(300, seed=5)
    for name in ("train", "dev", "test"):
        path = tmp_path / f"{name}.json"
        text = path.read_text(encoding="utf-8")
        records = json.loads(text)
        assert [(r["en"], r["ch"]) for r in records] == expected[name]
        assert all(set(r) == {"en", "ch"} for r in records)
        assert "\\u" not in text  # Chinese written as itself, not escaped
        assert len(text.splitlines()) == len(records) + 2  # "[", one object per line, "]"

    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    S.write_builtin(tmp_path, n_train=300, seed=5)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == mtimes

    S.write_builtin(tmp_path, n_train=300, seed=6)  # other parameters: rewritten
    records = json.loads((tmp_path / "train.json").read_text(encoding="utf-8"))
    assert [(r["en"], r["ch"]) for r in records] == S.builtin_splits(300, seed=6)["train"]


def test_write_builtin_repairs_damaged_files(tmp_path: Path) -> None:
    S.write_builtin(tmp_path, n_train=300, seed=0)
    good = (tmp_path / "dev.json").read_text(encoding="utf-8")
    (tmp_path / "dev.json").write_text(good[: len(good) // 2], encoding="utf-8")
    S.write_builtin(tmp_path, n_train=300, seed=0)
    assert (tmp_path / "dev.json").read_text(encoding="utf-8") == good

    (tmp_path / "test.json").unlink()
    S.write_builtin(tmp_path, n_train=300, seed=0)
    assert json.loads((tmp_path / "test.json").read_text(encoding="utf-8"))
