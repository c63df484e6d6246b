"""The bilingual lexicon of the built-in corpus: number words and the vocabulary tables.

:mod:`streamnmt.data.synthetic` fills sentence templates; what it fills them with lives here: the
English and Chinese numerals (the conventions are listed in that module's docstring), and the
people, things, verbs, units, places and calendar names with their translations, as compact
``|``-separated tables parsed once at import. Nothing here draws random numbers, so a change to
the tables changes the corpus only through the words it offers.
"""

from __future__ import annotations

import calendar
from functools import lru_cache
from typing import NamedTuple

Pair = tuple[str, str]

# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "- - twenty thirty forty fifty sixty seventy eighty ninety".split()
_ORDINAL_LAST = {"one": "first", "two": "second", "three": "third", "five": "fifth",
                 "eight": "eighth", "nine": "ninth", "twelve": "twelfth"}
_ZH_DIGITS = "零一二三四五六七八九"
_ZH_PLACES = ((1000, "千"), (100, "百"), (10, "十"), (1, ""))


@lru_cache(maxsize=None)
def en_number(n: int) -> str:
    """English words for ``0 <= n < 1_000_000``: "two thousand twenty-one"."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"en_number covers 0..999999; got {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    head, rest, unit = (*divmod(n, 100), "hundred") if n < 1000 else (*divmod(n, 1000), "thousand")
    return f"{en_number(head)} {unit}" + (f" {en_number(rest)}" if rest else "")


def en_ordinal(n: int) -> str:
    """English ordinal words: 1 -> "first", 21 -> "twenty-first", 100 -> "one hundredth"."""
    words = en_number(n)
    cut = max(words.rfind(" "), words.rfind("-")) + 1
    last = words[cut:]
    if last in _ORDINAL_LAST:
        last = _ORDINAL_LAST[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return words[:cut] + last


def _zh_below_10000(n: int, leading: bool) -> str:
    # ``leading``: nothing is written before this group, so 1x is 十x rather than 一十x.
    out, zero_pending, started = [], False, False
    for value, unit in _ZH_PLACES:
        digit = n // value % 10
        if digit == 0:
            zero_pending = started
            continue
        if zero_pending:
            out.append("零")
            zero_pending = False
        out.append(unit if value == 10 and digit == 1 and leading and not started
                   else _ZH_DIGITS[digit] + unit)
        started = True
    return "".join(out)


@lru_cache(maxsize=None)
def zh_number(n: int) -> str:
    """Chinese numeral for ``0 <= n < 100_000_000`` with 二 throughout: 2021 -> 二千零二十一."""
    if not 0 <= n < 100_000_000:
        raise ValueError(f"zh_number covers 0..99999999; got {n}")
    if n == 0:
        return "零"
    high, low = divmod(n, 10_000)
    if high == 0:
        return _zh_below_10000(low, leading=True)
    out = _zh_below_10000(high, leading=True) + "万"
    if low:
        out += ("零" if low < 1000 else "") + _zh_below_10000(low, leading=False)
    return out


def zh_count(n: int) -> str:
    """The numeral for ``n`` things (before a measure word or unit): 2 is 两, all else zh_number."""
    return "两" if n == 2 else zh_number(n)


def _en_count(n: int, singular: str, plural: str) -> str:
    return f"{en_number(n)} {singular if n == 1 else plural}"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


# ---------------------------------------------------------------------------------------------
# Lexicon: compact "|"-separated tables parsed once at import
# ---------------------------------------------------------------------------------------------

def _rows(table: str) -> list[list[str]]:
    return [line.strip().split("|") for line in table.strip().splitlines()]


def _pairs(spec: str) -> tuple[Pair, ...]:
    """``"en:zh;en:zh"`` -> ((en, zh), ...)."""
    return tuple(tuple(item.split(":")) for item in spec.split(";") if item)  # type: ignore[misc]


class Person(NamedTuple):
    en: str          # subject form, lower case unless a name: "my brother", "I", "Tom"
    obj: str         # object form: "me", "my brother"
    poss: str        # possessive: "my", "my brother's"
    zh: str
    be: str          # am / is / are
    was: str         # was / were
    third: bool      # third person singular: "has", "gets up"

    def verb(self, base: str, third: str) -> str:
        return third if self.third else base


class Thing(NamedTuple):
    sg: str
    pl: str
    zh: str
    mw: str          # measure word: 个 本 辆 杯 张 只 ...
    tags: frozenset[str]

    def en_count(self, n: int) -> str:
        return _en_count(n, self.sg, self.pl)

    def zh_count(self, n: int) -> str:
        return zh_count(n) + self.mw + self.zh


class Unit(NamedTuple):
    sg: str
    pl: str
    zh: str
    lo: int          # range sampled for this unit
    hi: int

    def render(self, n: int) -> Pair:
        return _en_count(n, self.sg, self.pl), zh_count(n) + self.zh


class Verb(NamedTuple):
    en: str          # past tense: "bought"
    zh: str          # "买了"
    tag: str         # objects must carry this tag
    places: tuple[Pair, ...]


PEOPLE: dict[str, Person] = {r[0]: Person(*r[:6], r[6] == "1") for r in _rows("""
    I|me|my|我|am|was|0
    you|you|your|你|are|were|0
    he|him|his|他|is|was|1
    she|her|her|她|is|was|1
    we|us|our|我们|are|were|0
    they|them|their|他们|are|were|0
    Tom|Tom|Tom's|汤姆|is|was|1
    Mary|Mary|Mary's|玛丽|is|was|1
    John|John|John's|约翰|is|was|1
    Lucy|Lucy|Lucy's|露西|is|was|1
    David|David|David's|大卫|is|was|1
    Anna|Anna|Anna's|安娜|is|was|1
    Peter|Peter|Peter's|彼得|is|was|1
    Linda|Linda|Linda's|琳达|is|was|1
    Li Lei|Li Lei|Li Lei's|李雷|is|was|1
    Wang Fang|Wang Fang|Wang Fang's|王芳|is|was|1
    my brother|my brother|my brother's|我哥哥|is|was|1
    my sister|my sister|my sister's|我姐姐|is|was|1
    my father|my father|my father's|我爸爸|is|was|1
    my mother|my mother|my mother's|我妈妈|is|was|1
    my friend|my friend|my friend's|我朋友|is|was|1
    our teacher|our teacher|our teacher's|我们老师|is|was|1
    the old man|the old man|the old man's|那位老人|is|was|1
    the little girl|the little girl|the little girl's|那个小女孩|is|was|1
""")}

THINGS: dict[str, Thing] = {r[0]: Thing(*r[:4], frozenset(r[4].split())) for r in _rows("""
    apple|apples|苹果|个|buy food have small
    orange|oranges|橙子|个|buy food have small
    banana|bananas|香蕉|根|buy food small
    egg|eggs|鸡蛋|个|buy food find small
    piece of cake|pieces of cake|蛋糕|块|buy food
    bowl of rice|bowls of rice|米饭|碗|food
    cup of coffee|cups of coffee|咖啡|杯|buy drink
    cup of tea|cups of tea|茶|杯|buy drink
    glass of milk|glasses of milk|牛奶|杯|drink
    bottle of water|bottles of water|水|瓶|buy drink small
    book|books|书|本|buy read borrow have find small class lib
    magazine|magazines|杂志|本|buy read borrow small lib
    newspaper|newspapers|报纸|份|buy read small
    letter|letters|信|封|write find small
    song|songs|歌|首|write
    picture|pictures|画|幅|buy draw have
    photo|photos|照片|张|photo have find small
    ticket|tickets|票|张|buy have find small
    map|maps|地图|张|buy draw small
    table|tables|桌子|张|buy class
    chair|chairs|椅子|把|buy class
    umbrella|umbrellas|伞|把|buy borrow find
    key|keys|钥匙|把|find have small
    pen|pens|笔|支|buy borrow find have small
    pencil|pencils|铅笔|支|buy borrow find have small class
    shirt|shirts|衬衫|件|buy wash have
    coat|coats|外套|件|buy wash have
    pair of shoes|pairs of shoes|鞋|双|buy wash have
    car|cars|车|辆|buy see have lot
    bicycle|bicycles|自行车|辆|buy borrow see have lot
    bus|buses|公共汽车|辆|see lot
    computer|computers|电脑|台|buy have class lib
    cat|cats|猫|只|see feed have yard
    dog|dogs|狗|只|see feed have yard farm
    bird|birds|鸟|只|see feed yard
    rabbit|rabbits|兔子|只|see feed have yard farm
    sheep|sheep|羊|只|see feed have farm
    horse|horses|马|匹|see feed have farm
    cow|cows|牛|头|see feed have farm
    fish|fish|鱼|条|buy see fish feed have river
    tree|trees|树|棵|see plant yard
    flower|flowers|花|朵|buy see yard
    house|houses|房子|栋|buy see have
    child|children|孩子|个|see have yard
    student|students|学生|名|see class lib
""")}

PAST_VERBS: dict[str, Verb] = {r[0]: Verb(r[0], r[1], r[2], _pairs(r[3])) for r in _rows("""
    bought|买了|buy|at the market:在市场;at the supermarket:在超市;in the shop:在商店
    sold|卖了|buy|at the market:在市场;online:在网上
    found|找到了|find|in the park:在公园里;at home:在家里;in the car:在车里
    saw|看到了|see|in the park:在公园里;on the street:在街上;in the village:在村子里
    ate|吃了|food|at home:在家里;in the restaurant:在饭店
    drank|喝了|drink|in the cafe:在咖啡馆;at home:在家里
    read|读了|read|in the library:在图书馆;at home:在家里
    wrote|写了|write|at home:在家里;at school:在学校
    drew|画了|draw|at school:在学校;at home:在家里
    took|拍了|photo|in the park:在公园里;in Beijing:在北京
    planted|种了|plant|in the garden:在花园里;on the hill:在山上
    caught|钓到了|fish|in the river:在河里;in the lake:在湖里
    borrowed|借了|borrow|from the library:从图书馆;from a friend:从朋友那里
    washed|洗了|wash|at home:在家里
    fed|喂了|feed|in the park:在公园里;on the farm:在农场里
""")}

_THINGS_BY_TAG: dict[str, list[Thing]] = {}
for _thing in THINGS.values():
    for _tag in _thing.tags:
        _THINGS_BY_TAG.setdefault(_tag, []).append(_thing)

MONTHS = tuple(calendar.month_name[1:])
WEEKDAYS = tuple(zip(calendar.day_name,
                     ("星期一", "星期二", "星期三", "星期四", "星期五", "星期六", "星期日")))
CITIES = _pairs("Beijing:北京;Shanghai:上海;Guangzhou:广州;Shenzhen:深圳;Tianjin:天津;Nanjing:南京;"
                "Hangzhou:杭州;Chengdu:成都;Wuhan:武汉;Harbin:哈尔滨;London:伦敦;Paris:巴黎;"
                "Tokyo:东京;New York:纽约")
_PERIODS = {"morning": ("早上", range(5, 12)), "afternoon": ("下午", range(1, 6)),
            "evening": ("晚上", range(6, 12))}
_LOCATIONS = [(en, zh, tag) for en, zh, tag in _rows("""
    on the table|桌子上|small
    in the box|箱子里|small
    in the garden|花园里|yard
    in the park|公园里|yard
    in the parking lot|停车场里|lot
    on the street|街上|lot
    in the classroom|教室里|class
    on the farm|农场里|farm
    in the river|河里|river
    in the library|图书馆里|lib
""")]
_U = {r[0]: Unit(r[1], r[2], r[3], int(r[4]), int(r[5])) for r in _rows("""
    km|kilometer|kilometers|公里|1|5000
    m|meter|meters|米|1|9999
    mi|mile|miles|英里|1|3000
    kg|kilogram|kilograms|公斤|1|200
    g|gram|grams|克|1|999
    t|ton|tons|吨|1|50
    cm|centimeter|centimeters|厘米|1|60
    age|year|years|岁|1|60
    min|minute|minutes|分钟|1|59
    h|hour|hours|个小时|1|12
    day|day|days|天|1|30
    week|week|weeks|个星期|1|10
    month|month|months|个月|1|12
    year|year|years|年|1|50
""")}

