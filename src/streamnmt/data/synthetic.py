"""The built-in English->Chinese corpus: sentence pairs generated from a seed, nothing downloaded.

``streamnmt train`` with no ``--data`` needs a corpus that exists on every machine, costs nothing
to fetch, and is still a translation task: word translation from a small bilingual lexicon,
reordering (Chinese puts times, dates, places and durations before the verb, comparisons take
比) and numeral conversion (English number words to Chinese numerals and measure words). This
module fills 27 sentence templates about numbers, dates, clock times, quantities and prices
with ``random.Random(seed)``, so ``(size, seed)`` names one corpus exactly. The numerals and the
word tables live in :mod:`streamnmt.data.lexicon`; the phrase renderers and templates here.

Conventions, followed by every template and pinned down by the tests:

* English cardinals are words with hyphenated tens and no "and": "twenty-five",
  "one hundred five", "two thousand twenty-one" (0 to 999,999).
* Chinese cardinals use 零一二...九 十 百 千 万. A leading 一 before 十 is dropped (十, 十五,
  十二万) but kept inside a number (一百一十, 一万零一十); one 零 stands for any run of zeros
  between non-zero digits (一百零五, 一千零五, 一千零五十, 一万零五百); trailing zeros are silent
  (一千五百). Digits are always 二 (二十二, 二百, 二千), except that the number 2 *counting
  something* -- before a measure word or unit -- is 两 (两个苹果, 两公斤, 两美元, 两岁, 两点,
  两个小时). Ordinals, floors, bus routes, percentages, clock minutes, arithmetic and digit
  strings keep 二 (第二, 二楼, 二路, 百分之二, 八点零二分, 二加三).
* Dates are Arabic digits on both sides: "March 3, 2021" / "2021年3月3日"; years 1900-2099.
* Clock times: "seven o'clock" 七点, "half past seven" 七点半, "a quarter past seven" 七点一刻,
  "a quarter to eight" 差一刻八点, "ten past seven" 七点十分, "seven minutes past eight"
  八点零七分, "ten to eight" 差十分八点; "minutes" is said unless the minute is a multiple of 5.
* English sentences start with a capital and end in "."; Chinese ones end in "。" and contain
  no spaces and no ASCII letters (only the digits of dates and years).
"""

from __future__ import annotations

import calendar
import hashlib
import itertools
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from streamnmt.data import lexicon
from streamnmt.data.lexicon import (CITIES, MONTHS, PAST_VERBS, PEOPLE, THINGS, WEEKDAYS, _LOCATIONS,  # noqa: F401
                                    _ONES, _PERIODS, _THINGS_BY_TAG, _U, _ZH_DIGITS, Pair, Person, Thing,
                                    Verb, _cap, _en_count, _pairs, _rows, en_number, en_ordinal, zh_count,
                                    zh_number)
from streamnmt.fsutil import atomic_write

MANIFEST_NAME = "synthetic-manifest.json"
SPLITS = ("train", "dev", "test")

# ---------------------------------------------------------------------------------------------
# Phrase renderers shared by templates: each returns (English, Chinese)
# ---------------------------------------------------------------------------------------------

def render_clock(hour: int, minute: int, period: str | None = None) -> Pair:
    """A clock time, 1 <= hour <= 12: (7, 30) -> ("half past seven", "七点半")."""
    nxt = hour % 12 + 1
    if minute == 0:
        en, zh = f"{en_number(hour)} o'clock", f"{zh_count(hour)}点"
    elif minute in (15, 30):
        word, zh_part = ("a quarter", "一刻") if minute == 15 else ("half", "半")
        en, zh = f"{word} past {en_number(hour)}", f"{zh_count(hour)}点{zh_part}"
    elif minute == 45:
        en, zh = f"a quarter to {en_number(nxt)}", f"差一刻{zh_count(nxt)}点"
    else:
        gap = minute if minute < 30 else 60 - minute
        words = en_number(gap) if gap % 5 == 0 else _en_count(gap, "minute", "minutes")
        if minute < 30:
            zh_min = ("零" if minute < 10 else "") + zh_number(minute)
            en, zh = f"{words} past {en_number(hour)}", f"{zh_count(hour)}点{zh_min}分"
        else:
            en, zh = f"{words} to {en_number(nxt)}", f"差{zh_count(gap)}分{zh_count(nxt)}点"
    if period:
        en, zh = f"{en} in the {period}", _PERIODS[period][0] + zh
    return en, zh


def render_date(year: int, month: int | None = None, day: int | None = None) -> Pair:
    """A date with its English preposition: (2021, 3, 3) -> ("on March 3, 2021", "2021年3月3日")."""
    if month is None:
        return f"in {year}", f"{year}年"
    if day is None:
        return f"in {MONTHS[month - 1]} {year}", f"{year}年{month}月"
    return f"on {MONTHS[month - 1]} {day}, {year}", f"{year}年{month}月{day}日"


_CURRENCIES = {r[0]: r[1:] for r in _rows("""
    dollar|dollar|dollars|美元|cent|cents|美分
    euro|euro|euros|欧元|cent|cents|欧分
    yuan|yuan|yuan|元|||
""")}


def render_money(major: int, minor: int = 0, currency: str = "dollar") -> Pair:
    """(32, 50, "dollar") -> ("thirty-two dollars and fifty cents", "三十二美元五十美分")."""
    sg, pl, zh, minor_sg, minor_pl, minor_zh = _CURRENCIES[currency]
    en_parts, zh_parts = [], []
    if major or not minor:
        en_parts.append(_en_count(major, sg, pl))
        zh_parts.append(zh_count(major) + zh)
    if minor:
        en_parts.append(_en_count(minor, minor_sg, minor_pl))
        zh_parts.append(zh_count(minor) + minor_zh)
    return " and ".join(en_parts), "".join(zh_parts)


def _sentence(en: str, zh: str) -> Pair:
    return _cap(en) + ".", zh + "。"


# ---------------------------------------------------------------------------------------------
# Templates: render_* take fixed values (the tests call them); _s_* draw the values from an rng
# ---------------------------------------------------------------------------------------------

def render_purchase_on_date(p: Person, v: Verb, n: int, t: Thing, year: int, month: int,
                            day: int) -> Pair:
    date_en, date_zh = render_date(year, month, day)
    return _sentence(f"{p.en} {v.en} {t.en_count(n)} {date_en}", f"{p.zh}在{date_zh}{v.zh}{t.zh_count(n)}")


def render_purchase_on_weekday(p: Person, v: Verb, n: int, t: Thing, weekday: int,
                               place: Pair | None = None) -> Pair:
    day_en, day_zh = WEEKDAYS[weekday]
    where_en, where_zh = (place[0] + " ", place[1]) if place else ("", "")
    return _sentence(f"{p.en} {v.en} {t.en_count(n)} {where_en}on {day_en}",
                     f"{p.zh}{day_zh}{where_zh}{v.zh}{t.zh_count(n)}")


def render_price(t: Thing, money: Pair) -> Pair:
    return _sentence(f"the {t.sg} costs {money[0]}", f"这{t.mw}{t.zh}售价{money[1]}")


def render_paid(p: Person, money: Pair, n: int, t: Thing) -> Pair:
    return _sentence(f"{p.en} paid {money[0]} for {t.en_count(n)}",
                     f"{p.zh}花{money[1]}买了{t.zh_count(n)}")


_ROUTINES = _rows("""
    get up|gets up|起床
    go to bed|goes to bed|睡觉
    have breakfast|has breakfast|吃早饭
    have lunch|has lunch|吃午饭
    have dinner|has dinner|吃晚饭
    leave home|leaves home|离开家
    go to work|goes to work|去上班
    go to school|goes to school|去上学
    get home|gets home|到家
    take a shower|takes a shower|洗澡
    start work|starts work|开始工作
    go running|goes running|去跑步
""")


def render_routine(p: Person, routine: list[str], clock: Pair, weekday: int | None = None) -> Pair:
    """"Tom gets up at seven o'clock [every Monday]." / "汤姆[每个星期一]七点起床。"."""
    every_en, every_zh = ((f" every {WEEKDAYS[weekday][0]}", f"每个{WEEKDAYS[weekday][1]}")
                          if weekday is not None else ("", ""))
    return _sentence(f"{p.en} {p.verb(routine[0], routine[1])} at {clock[0]}{every_en}",
                     f"{p.zh}{every_zh}{clock[1]}{routine[2]}")


_EVENTS = _rows("""
    the train left|火车开了
    the meeting started|会议开始了
    the movie ended|电影结束了
    the shop opened|商店开门了
    the bank closed|银行关门了
    the rain stopped|雨停了
    the bus arrived|公共汽车到了
    the plane landed|飞机降落了
""")


def render_event_at(clock: Pair, event: list[str]) -> Pair:
    return _sentence(f"at {clock[0]}, {event[0]}", f"{clock[1]}，{event[1]}")


def render_age(p: Person, age: int, relative: Pair | None = None) -> Pair:
    years_en, years_zh = _U["age"].render(age)
    if relative is None:
        return _sentence(f"{p.en} {p.be} {years_en} old", f"{p.zh}{years_zh}")
    return _sentence(f"{p.poss} {relative[0]} is {years_en} old", f"{p.zh}的{relative[1]}{years_zh}")


_RELATIVES = _pairs("son:儿子;daughter:女儿;grandfather:爷爷;grandmother:奶奶;cat:猫;dog:狗;teacher:老师")
_COMPARATIVES = _rows("""
    older|大|age
    younger|小|age
    taller|高|cm
    shorter|矮|cm
    heavier|重|kg
    lighter|轻|kg
""")


def render_compare_measure(a: Person, b: Person, n: int, comparative: list[str]) -> Pair:
    """"Tom is three years older than Mary." / "汤姆比玛丽大三岁。"."""
    amount_en, amount_zh = _U[comparative[2]].render(n)
    return _sentence(f"{a.en} {a.be} {amount_en} {comparative[0]} than {b.obj}",
                     f"{a.zh}比{b.zh}{comparative[1]}{amount_zh}")


def render_compare_have(a: Person, b: Person, n: int, t: Thing, more: bool = True) -> Pair:
    """"Tom has three more cats than Mary." / "汤姆比玛丽多三只猫。"."""
    word, zh_word = ("more", "多") if more else ("fewer", "少")
    return _sentence(f"{a.en} {a.verb('have', 'has')} {en_number(n)} {word} {t.sg if n == 1 else t.pl} "
                     f"than {b.obj}", f"{a.zh}比{b.zh}{zh_word}{t.zh_count(n)}")


def render_city_distance(a: Pair, b: Pair, n: int, unit: str = "km") -> Pair:
    dist_en, dist_zh = _U[unit].render(n)
    return _sentence(f"it is {dist_en} from {a[0]} to {b[0]}", f"从{a[1]}到{b[1]}有{dist_zh}")


_MOTIONS = [(en, zh, units.split()) for en, zh, units in _rows("""
    walked|走了|km m
    ran|跑了|km m
    drove|开了|km mi
    swam|游了|m
    cycled|骑了|km mi
""")]
_WHEN_PAST = _pairs("yesterday:昨天;today:今天;last week:上个星期;this morning:今天早上;"
                    "last Sunday:上个星期日")


def render_travel(p: Person, motion: str, zh_motion: str, distance: Pair, when: Pair) -> Pair:
    """"Tom walked five kilometers yesterday." / "汤姆昨天走了五公里。"."""
    return _sentence(f"{p.en} {motion} {distance[0]} {when[0]}", f"{p.zh}{when[1]}{zh_motion}{distance[1]}")


_WEIGHABLES = [(en, zh, mw, units.split()) for en, zh, mw, units in _rows("""
    box|箱子|个|kg
    bag|包|个|kg
    suitcase|行李箱|个|kg
    dog|狗|只|kg
    fish|鱼|条|kg g
    baby|婴儿|个|kg
    watermelon|西瓜|个|kg
    elephant|大象|头|t kg
    truck|卡车|辆|t
    apple|苹果|个|g
    egg|鸡蛋|个|g
    letter|信|封|g
""")]


def render_weight(thing: str, zh_thing: str, mw: str, weight: Pair) -> Pair:
    return _sentence(f"the {thing} weighs {weight[0]}", f"这{mw}{zh_thing}重{weight[1]}")


_VEHICLES = _pairs("train:火车;car:汽车;plane:飞机;bus:公共汽车;ship:船;bicycle:自行车")


def render_speed(vehicle: Pair, n: int, unit: str = "km") -> Pair:
    u = _U[unit]
    return _sentence(f"the {vehicle[0]} travels at {_en_count(n, u.sg, u.pl)} per hour",
                     f"{vehicle[1]}的速度是每小时{zh_count(n)}{u.zh}")


def render_there_are(n: int, t: Thing, location: Pair) -> Pair:
    """"There are three apples on the table." / "桌子上有三个苹果。"."""
    return _sentence(f"there {'is' if n == 1 else 'are'} {t.en_count(n)} {location[0]}",
                     f"{location[1]}有{t.zh_count(n)}")


def render_phone(p: Person, digits: str) -> Pair:
    spoken_en = " ".join(_ONES[int(d)] for d in digits)
    spoken_zh = "".join(_ZH_DIGITS[int(d)] for d in digits)
    return _sentence(f"{p.poss} phone number is {spoken_en}", f"{p.zh}的电话号码是{spoken_zh}")


_BUS_PLACES = _pairs("school:学校;work:上班;the hospital:医院;the station:车站;the airport:机场;"
                     "the library:图书馆;the park:公园;the museum:博物馆;the zoo:动物园;the market:市场")


def render_bus(p: Person, route: int, place: Pair) -> Pair:
    """"Tom takes the number fifteen bus to school." / "汤姆坐十五路公交车去学校。"."""
    return _sentence(f"{p.en} {p.verb('take', 'takes')} the number {en_number(route)} bus to {place[0]}",
                     f"{p.zh}坐{zh_number(route)}路公交车去{place[1]}")


def render_born(p: Person, date: Pair) -> Pair:
    return _sentence(f"{p.en} {p.was} born {date[0]}", f"{p.zh}出生于{date[1]}")


def render_birthday(p: Person, month: int, day: int) -> Pair:
    return _sentence(f"{p.poss} birthday is on {MONTHS[month - 1]} {day}", f"{p.zh}的生日是{month}月{day}日")


_LIFE_EVENTS = _rows("""
    moved to {city}|搬到了{city}
    arrived in {city}|到达了{city}
    left {city}|离开了{city}
    visited {city}|去了{city}
    got married|结婚了
    started a new job|开始了新工作
    graduated from college|大学毕业了
    learned to drive|学会了开车
""")


def render_date_event(p: Person, event: Pair, date: Pair) -> Pair:
    """"Tom moved to Beijing in March 2021." / "汤姆在2021年3月搬到了北京。"."""
    return _sentence(f"{p.en} {event[0]} {date[0]}", f"{p.zh}在{date[1]}{event[1]}")


_OPERATIONS = {"plus": ("加", lambda a, b: a + b), "minus": ("减", lambda a, b: a - b),
               "times": ("乘以", lambda a, b: a * b), "divided by": ("除以", lambda a, b: a // b)}


def render_arithmetic(a: int, op: str, b: int) -> Pair:
    zh_op, fn = _OPERATIONS[op]
    c = fn(a, b)
    return _sentence(f"{en_number(a)} {op} {en_number(b)} equals {en_number(c)}",
                     f"{zh_number(a)}{zh_op}{zh_number(b)}等于{zh_number(c)}")


_ACTIVITIES = [(en, pre, obj, units.split()) for en, pre, obj, units in _rows("""
    waited|等了||min h
    slept|睡了||h
    studied English|学了|英语|week month year
    studied Chinese|学了|中文|week month year
    worked|工作了||h day year
    talked on the phone|打了|电话|min h
    watched TV|看了|电视|min h
    played basketball|打了|篮球|min h
    played the piano|弹了|钢琴|min h year
    lived in {city}|在{city}住了||month year
""")]


def render_duration(p: Person, activity: Pair, zh_object: str, duration: Pair) -> Pair:
    """"Tom studied English for three years." / "汤姆学了三年英语。"."""
    return _sentence(f"{p.en} {activity[0]} for {duration[0]}",
                     f"{p.zh}{activity[1]}{duration[1]}{zh_object}")


_GROUPS = _pairs("students:学生;people:人;workers:工人;teachers:老师;children:孩子")
_PREDICATES = _pairs("passed the exam:通过了考试;like music:喜欢音乐;have a car:有车;"
                     "drink coffee every day:每天喝咖啡;speak English:会说英语;agreed with the plan:同意这个计划")


def render_percent(n: int, group: Pair, predicate: Pair) -> Pair:
    return _sentence(f"{en_number(n)} percent of the {group[0]} {predicate[0]}",
                     f"百分之{zh_number(n)}的{group[1]}{predicate[1]}")


_OWNERS = [(en, zh, Thing(sg, pl, noun, mw, frozenset()), int(hi))
           for en, zh, sg, pl, noun, mw, hi in _rows("""
    the village|这个村子|person|people|人||9999
    the town|这个小镇|person|people|人||99999
    the city|这座城市|person|people|人||999999
    the school|这所学校|student|students|学生|名|9999
    the library|这个图书馆|book|books|书|本|999999
    the farm|这个农场|sheep|sheep|羊|只|9999
    the company|这家公司|employee|employees|员工|名|99999
    the zoo|这个动物园|animal|animals|动物|只|9999
""")]


def render_owner_has(owner: str, zh_owner: str, n: int, t: Thing) -> Pair:
    """"The city has three hundred forty-five thousand people." / "这座城市有三十四万五千人。"."""
    return _sentence(f"{owner} has {t.en_count(n)}", f"{zh_owner}有{t.zh_count(n)}")


_DAYS = {"today": ("is", "今天"), "yesterday": ("was", "昨天"), "tomorrow": ("will be", "明天")}


def render_temperature(degrees: int, day: str, city: Pair | None = None) -> Pair:
    """"It was minus five degrees in Harbin yesterday." / "昨天哈尔滨零下五度。"."""
    verb, zh_day = _DAYS[day]
    size = abs(degrees)
    en = ("minus " if degrees < 0 else "") + _en_count(size, "degree", "degrees")
    zh = ("零下" if degrees < 0 else "") + zh_count(size) + "度"
    where_en, where_zh = (f" in {city[0]}", city[1]) if city else ("", "")
    return _sentence(f"it {verb} {en}{where_en} {day}", f"{zh_day}{where_zh}{zh}")


def render_rank(p: Person, n: int) -> Pair:
    return _sentence(f"{p.en} finished {en_ordinal(n)} in the race", f"{p.zh}在比赛中获得了第{zh_number(n)}名")


def render_floor(p: Person, n: int) -> Pair:
    return _sentence(f"{p.en} {p.verb('live', 'lives')} on the {en_ordinal(n)} floor",
                     f"{p.zh}住在{zh_number(n)}楼")


# ---------------------------------------------------------------------------------------------
# Samplers: one per template
# ---------------------------------------------------------------------------------------------

_PEOPLE = list(PEOPLE.values())
_VERBS = list(PAST_VERBS.values())
_BUY = _THINGS_BY_TAG["buy"]
_HAVE = _THINGS_BY_TAG["have"]


def _num(rng: random.Random, lo: int, hi: int) -> int:
    """Uniform over digit counts, then uniform within: small and large numbers both appear."""
    digits = rng.randint(len(str(lo)), len(str(hi)))
    return rng.randint(max(lo, 10 ** (digits - 1) if digits > 1 else 0), min(hi, 10 ** digits - 1))


def _count(rng: random.Random) -> int:
    return rng.randint(1, 20) if rng.random() < 0.5 else _num(rng, 1, 9999)


def _date(rng: random.Random) -> tuple[int, int, int]:
    year, month = rng.randint(1900, 2099), rng.randint(1, 12)
    return year, month, rng.randint(1, calendar.monthrange(year, month)[1])


def _any_date(rng: random.Random) -> Pair:
    year, month, day = _date(rng)
    return render_date(year, *rng.choice([(), (month,), (month, day)]))


def _clock(rng: random.Random) -> Pair:
    minute = rng.choice([0, 0, 15, 30, 30, 45, rng.randrange(60)])
    period = rng.choice([None, None, "morning", "afternoon", "evening"]) if minute <= 30 else None
    hour = rng.choice(_PERIODS[period][1]) if period else rng.randint(1, 12)
    return render_clock(hour, minute, period)


def _unit_amount(rng: random.Random, key: str) -> Pair:
    u = _U[key]
    return u.render(_num(rng, u.lo, u.hi))


def _two_people(rng: random.Random) -> tuple[Person, Person]:
    a, b = rng.sample(_PEOPLE, 2)
    return a, b


def _s_purchase_date(rng: random.Random) -> Pair:
    v = rng.choice(_VERBS)
    return render_purchase_on_date(rng.choice(_PEOPLE), v, _count(rng),
                                   rng.choice(_THINGS_BY_TAG[v.tag]), *_date(rng))


def _s_purchase_weekday(rng: random.Random) -> Pair:
    v = rng.choice(_VERBS)
    place = rng.choice(v.places) if rng.random() < 0.6 else None
    return render_purchase_on_weekday(rng.choice(_PEOPLE), v, _count(rng),
                                      rng.choice(_THINGS_BY_TAG[v.tag]), rng.randrange(7), place)


def _money(rng: random.Random) -> Pair:
    currency = rng.choice(list(_CURRENCIES))
    minor = rng.randint(1, 99) if currency != "yuan" and rng.random() < 0.5 else 0
    return render_money(_num(rng, 0 if minor else 1, 999), minor, currency)


def _s_price(rng: random.Random) -> Pair:
    return render_price(rng.choice(_BUY), _money(rng))


def _s_paid(rng: random.Random) -> Pair:
    return render_paid(rng.choice(_PEOPLE), _money(rng), _num(rng, 1, 99), rng.choice(_BUY))


def _s_routine(rng: random.Random) -> Pair:
    return render_routine(rng.choice(_PEOPLE), rng.choice(_ROUTINES), _clock(rng))


def _s_routine_weekday(rng: random.Random) -> Pair:
    return render_routine(rng.choice(_PEOPLE), rng.choice(_ROUTINES), _clock(rng), rng.randrange(7))


def _s_event_at(rng: random.Random) -> Pair:
    return render_event_at(_clock(rng), rng.choice(_EVENTS))


def _s_age(rng: random.Random) -> Pair:
    relative = rng.choice(_RELATIVES) if rng.random() < 0.5 else None
    return render_age(rng.choice(_PEOPLE), rng.randint(1, 100), relative)


def _s_compare_measure(rng: random.Random) -> Pair:
    comparative = rng.choice(_COMPARATIVES)
    u = _U[comparative[2]]
    return render_compare_measure(*_two_people(rng), _num(rng, 1, min(u.hi, 50)), comparative)


def _s_compare_have(rng: random.Random) -> Pair:
    return render_compare_have(*_two_people(rng), _count(rng), rng.choice(_HAVE), rng.random() < 0.6)


def _s_city_distance(rng: random.Random) -> Pair:
    a, b = rng.sample(CITIES, 2)
    unit = rng.choice(["km", "mi"])
    return render_city_distance(a, b, _num(rng, 10, _U[unit].hi), unit)


def _s_travel(rng: random.Random) -> Pair:
    motion, zh_motion, units = rng.choice(_MOTIONS)
    return render_travel(rng.choice(_PEOPLE), motion, zh_motion, _unit_amount(rng, rng.choice(units)),
                         rng.choice(_WHEN_PAST))


def _s_weight(rng: random.Random) -> Pair:
    thing, zh_thing, mw, units = rng.choice(_WEIGHABLES)
    return render_weight(thing, zh_thing, mw, _unit_amount(rng, rng.choice(units)))


def _s_speed(rng: random.Random) -> Pair:
    return render_speed(rng.choice(_VEHICLES), _num(rng, 1, 999), rng.choice(["km", "mi"]))


def _s_there_are(rng: random.Random) -> Pair:
    en, zh, tag = rng.choice(_LOCATIONS)
    return render_there_are(_count(rng), rng.choice(_THINGS_BY_TAG[tag]), (en, zh))


def _s_phone(rng: random.Random) -> Pair:
    length = rng.choice([7, 8, 11])
    head = rng.choice("3456789") if length == 11 else str(rng.randint(2, 9))
    digits = ("1" if length == 11 else "") + head
    digits += "".join(rng.choice("0123456789") for _ in range(length - len(digits)))
    return render_phone(rng.choice(_PEOPLE), digits)


def _s_bus(rng: random.Random) -> Pair:
    return render_bus(rng.choice(_PEOPLE), _num(rng, 1, 999), rng.choice(_BUS_PLACES))


def _s_born(rng: random.Random) -> Pair:
    return render_born(rng.choice(_PEOPLE), _any_date(rng))


def _s_birthday(rng: random.Random) -> Pair:
    month = rng.randint(1, 12)
    return render_birthday(rng.choice(_PEOPLE), month, rng.randint(1, calendar.monthrange(2000, month)[1]))


def _fill_city(rng: random.Random, row: list[str]) -> list[str]:
    city = rng.choice(CITIES)
    return [row[0].format(city=city[0]), row[1].format(city=city[1]), *row[2:]]


def _s_date_event(rng: random.Random) -> Pair:
    en, zh = _fill_city(rng, rng.choice(_LIFE_EVENTS))
    return render_date_event(rng.choice(_PEOPLE), (en, zh), _any_date(rng))


def _s_arithmetic(rng: random.Random) -> Pair:
    op = rng.choice(list(_OPERATIONS))
    if op in ("plus", "minus"):
        a, b = _num(rng, 0, 9999), _num(rng, 0, 9999)
        a, b = (max(a, b), min(a, b)) if op == "minus" else (a, b)
    elif op == "times":
        a, b = _num(rng, 0, 99), _num(rng, 0, 99)
    else:
        b = _num(rng, 1, 99)
        a = b * _num(rng, 0, 99)
    return render_arithmetic(a, op, b)


def _s_duration(rng: random.Random) -> Pair:
    en, pre, obj, units = _fill_city(rng, list(rng.choice(_ACTIVITIES)))
    return render_duration(rng.choice(_PEOPLE), (en, pre), obj, _unit_amount(rng, rng.choice(units)))


def _s_percent(rng: random.Random) -> Pair:
    return render_percent(rng.randint(1, 99), rng.choice(_GROUPS), rng.choice(_PREDICATES))


def _s_owner_has(rng: random.Random) -> Pair:
    en, zh, t, hi = rng.choice(_OWNERS)
    return render_owner_has(en, zh, _num(rng, 10, hi), t)


def _s_temperature(rng: random.Random) -> Pair:
    city = rng.choice(CITIES) if rng.random() < 0.5 else None
    return render_temperature(rng.randint(-30, 40), rng.choice(list(_DAYS)), city)


def _s_rank(rng: random.Random) -> Pair:
    return render_rank(rng.choice(_PEOPLE), rng.randint(1, 100))


def _s_floor(rng: random.Random) -> Pair:
    return render_floor(rng.choice(_PEOPLE), rng.randint(1, 99))


TEMPLATES: dict[str, Callable[[random.Random], Pair]] = {
    name[3:]: fn for name, fn in sorted(globals().items()) if name.startswith("_s_") and callable(fn)}


# ---------------------------------------------------------------------------------------------
# Corpus, splits and files
# ---------------------------------------------------------------------------------------------

def _pair_stream(rng: random.Random) -> Iterator[Pair]:
    samplers = list(TEMPLATES.values())
    while True:
        yield rng.choice(samplers)(rng)


def generate_pairs(n: int, seed: int) -> list[Pair]:
    """``n`` (English, Chinese) pairs; the same ``(n, seed)`` always gives the same list, and a
    longer list for the same seed starts with the shorter one."""
    return list(itertools.islice(_pair_stream(random.Random(seed)), n))


def builtin_splits(n_train: int, seed: int = 0) -> dict[str, list[Pair]]:
    """Train/dev/test pairs; dev and test hold ``max(200, n_train // 20)`` pairs each.

    One stream is cut in order test, dev, train. Dev and test hold distinct English sentences,
    and train skips every sentence they hold, so no evaluation sentence is seen in training
    (train itself keeps repeats: they are part of the template distribution).
    """
    if n_train < 1:
        raise ValueError(f"builtin_splits: n_train must be positive; got {n_train}")
    n_eval = max(200, n_train // 20)
    stream = _pair_stream(random.Random(seed))
    held: set[str] = set()
    out: dict[str, list[Pair]] = {}
    for name in ("test", "dev"):
        out[name] = []
        while len(out[name]) < n_eval:
            pair = next(stream)
            if pair[0] not in held:
                held.add(pair[0])
                out[name].append(pair)
    out["train"] = list(itertools.islice((p for p in stream if p[0] not in held), n_train))
    return {name: out[name] for name in SPLITS}


def _to_json(pairs: list[Pair]) -> str:
    # One object per line: valid JSON that still reads and diffs like a line-based file.
    lines = ",\n".join(json.dumps({"en": en, "ch": zh}, ensure_ascii=False) for en, zh in pairs)
    return f"[\n{lines}\n]\n"


def _source_digest() -> str:
    # Any change to this file or the lexicon (words, templates, conventions) invalidates written corpora.
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(Path(lexicon.__file__).read_bytes())
    return h.hexdigest()[:16]


def _is_current(directory: Path, params: dict) -> bool:
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
        return (all(manifest.get(k) == v for k, v in params.items())
                and all((directory / f"{name}.json").stat().st_size == manifest["bytes"][name]
                        for name in SPLITS))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_builtin(directory: Path, n_train: int, seed: int = 0) -> None:
    """Write ``train.json``, ``dev.json`` and ``test.json`` (arrays of ``{"en", "ch"}``) to
    ``directory``, unless its manifest says this code already wrote them with these parameters
    and the files still have the sizes it recorded."""
    directory = Path(directory)
    params = {"generator": __name__, "source": _source_digest(), "n_train": n_train, "seed": seed}
    if _is_current(directory, params):
        return
    directory.mkdir(parents=True, exist_ok=True)
    # The manifest goes first and comes back last: an interrupted write is never taken as done.
    (directory / MANIFEST_NAME).unlink(missing_ok=True)
    sizes = {}
    for name, pairs in builtin_splits(n_train, seed).items():
        data = _to_json(pairs).encode("utf-8")
        atomic_write(directory / f"{name}.json", data)
        sizes[name] = len(data)
    atomic_write(directory / MANIFEST_NAME, json.dumps({**params, "bytes": sizes}, indent=2) + "\n")
