"""The templates of the built-in corpus: one sampler per sentence kind, drawing its values from an rng.

Kept apart from the renderings (:mod:`streamnmt.data.grammar`) because this is where the corpus's
distribution is decided: which people, things, numbers, dates and units each template is filled
with, and how often small and large numbers come. :data:`TEMPLATES` names every sampler; the
corpus writer (:mod:`streamnmt.data.synthetic`) picks one per pair with ``random.Random(seed)``,
so the same seed always draws the same sentences.
"""

from __future__ import annotations

import calendar
import random
from collections.abc import Callable

from streamnmt.data.grammar import (_ACTIVITIES, _BUS_PLACES, _COMPARATIVES, _CURRENCIES, _DAYS, _EVENTS, _GROUPS,
                                    _LIFE_EVENTS, _MOTIONS, _OPERATIONS, _OWNERS, _PREDICATES, _RELATIVES, _ROUTINES,
                                    _VEHICLES, _WEIGHABLES, _WHEN_PAST, render_age, render_arithmetic, render_birthday,
                                    render_born, render_bus, render_city_distance, render_clock, render_compare_have,
                                    render_compare_measure, render_date, render_date_event, render_duration,
                                    render_event_at, render_floor, render_money, render_owner_has, render_paid,
                                    render_percent, render_phone, render_price, render_purchase_on_date,
                                    render_purchase_on_weekday, render_rank, render_routine, render_speed,
                                    render_temperature, render_there_are, render_travel, render_weight)
from streamnmt.data.lexicon import _LOCATIONS, _PERIODS, _THINGS_BY_TAG, _U, CITIES, PAST_VERBS, PEOPLE, Pair, Person

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

