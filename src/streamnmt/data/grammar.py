"""The sentence grammar of the built-in corpus: how each kind of phrase and sentence reads in both languages.

The built-in corpus (:mod:`streamnmt.data.synthetic`) is a translation task because its pairs are
rendered by rules: word translation, reordering (Chinese puts times, dates, places and durations
before the verb, comparisons take 比) and numeral conversion. Those rules live here, apart from the
random draws (:mod:`streamnmt.data.templates`) and the corpus files: every ``render_*`` takes fixed
values and returns ``(English, Chinese)``, so the tests pin each rendering down by hand. The
numerals and the word tables they fill in live in :mod:`streamnmt.data.lexicon`.

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

from streamnmt.data.lexicon import (_ONES, _PERIODS, _U, _ZH_DIGITS, MONTHS, WEEKDAYS, Pair, Person, Thing, Verb,
                                    _cap, _en_count, _pairs, _rows, en_number, en_ordinal, zh_count, zh_number)

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
# Templates: render_* take fixed values (the tests call them); templates.py draws the values
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
