"""cron.py: five fields, aliases, time zones and the DST rules (SPEC "Cron").

The DST tests compare next_after with a brute-force oracle: walk every minute in UTC and
keep those whose local wall-clock time matches the fields.  A wall time in the spring
gap never appears in that walk (skipped); one in the autumn overlap appears twice (runs
twice) - exactly the SPEC rule.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from perfectschedd import InvalidInputError
from perfectschedd.schedules import cron

LA = "America/Los_Angeles"


def ts(text: str, tz: str = "UTC") -> int:
    """Unix time of an ISO time; a trailing offset wins over tz."""
    d = datetime.fromisoformat(text)
    if d.tzinfo is None:
        d = d.replace(tzinfo=ZoneInfo(tz))
    return int(d.timestamp())


def _field_matches(spec: str, value: int) -> bool:
    for part in spec.split(","):
        step = 1
        if "/" in part:
            part, step_s = part.split("/")
            step = int(step_s)
        if part == "*":
            lo, hi = 0, 59
        elif "-" in part:
            lo, hi = (int(x) for x in part.split("-"))
        else:
            lo = hi = int(part)
            if step != 1:
                hi = 59
        if lo <= value <= hi and (value - lo) % step == 0:
            return True
    return False


def oracle(expr: str, tz: str, start: int, end: int) -> list[int]:
    """Every occurrence in [start, end): minutes whose local wall time matches."""
    minute, hour, dom, month, dow = expr.split()
    assert dom == month == dow == "*", "the oracle handles minute/hour fields only"
    zone = ZoneInfo(tz)
    out = []
    for t in range(start - start % 60, end, 60):
        if t < start:
            continue
        local = datetime.fromtimestamp(t, UTC).astimezone(zone)
        if _field_matches(minute, local.minute) and _field_matches(hour, local.hour):
            out.append(t)
    return out


def walk(expr: str, tz: str, start: int, end: int) -> list[int]:
    out = []
    t = cron.first_at_or_after(expr, tz, start)
    while t < end:
        out.append(t)
        t = cron.next_after(expr, tz, t)
    return out


DST_DAYS = [
    pytest.param("2015-03-08T00:00:00-08:00", "2015-03-08T06:00:00-07:00", id="spring-forward"),
    pytest.param("2015-11-01T00:00:00-07:00", "2015-11-01T05:00:00-08:00", id="fall-back"),
]
EXPRS = ["* * * * *", "*/7 * * * *", "30 * * * *", "0 * * * *", "0,30 1,2,3 * * *",
         "15 2 * * *", "59 1 * * *", "0 0-3 * * *"]


@pytest.mark.parametrize(("begin", "end"), DST_DAYS)
@pytest.mark.parametrize("expr", EXPRS)
def test_dst_walk_matches_brute_force(expr: str, begin: str, end: str) -> None:
    start, stop = ts(begin), ts(end)
    assert walk(expr, LA, start, stop) == oracle(expr, LA, start, stop)


@pytest.mark.parametrize(("begin", "end"), DST_DAYS)
@pytest.mark.parametrize("expr", ["*/20 * * * *", "30 1 * * *", "0 2 * * *"])
def test_dst_next_after_from_every_second_of_a_window(expr: str, begin: str, end: str) -> None:
    """next_after(t) is the first oracle occurrence > t, wherever t falls (gap, overlap)."""
    start, stop = ts(begin), ts(end)
    occurrences = oracle(expr, LA, start, stop + 86400)
    for after in range(start, stop, 97):  # a prime step: lands on odd seconds too
        expected = next(o for o in occurrences if o > after)
        assert cron.next_after(expr, LA, after) == expected, after


@pytest.mark.parametrize(("begin", "end"), DST_DAYS)
def test_next_after_is_the_same_whatever_order_it_is_asked_in(begin: str, end: str) -> None:
    """next_after reuses its latest answer for a later time before it (a batch added a
    second after another): asked backwards, or jumping about, it still finds the oracle's
    first occurrence > t."""
    expr = "30 1 * * *"
    start, stop = ts(begin), ts(end)
    occurrences = oracle(expr, LA, start, stop + 86400)
    afters = list(range(start, stop, 89))
    for after in [*reversed(afters), *afters[::7], *afters[3::5]]:
        expected = next(o for o in occurrences if o > after)
        assert cron.next_after(expr, LA, after) == expected, after


def test_spring_forward_skips_the_missing_hour() -> None:
    # 2015-03-08 02:30 does not exist in Los Angeles: the daily 02:30 job skips that day.
    first = cron.first_at_or_after("30 2 * * *", LA, ts("2015-03-07T12:00:00", LA))
    assert first == ts("2015-03-08T02:30:00-08:00") or first == ts("2015-03-09T02:30:00-07:00")
    assert first == ts("2015-03-09T02:30:00-07:00")
    hourly = walk("0 * * * *", LA, ts("2015-03-08T00:00:00", LA), ts("2015-03-08T05:00:00", LA))
    local_hours = [datetime.fromtimestamp(t, ZoneInfo(LA)).hour for t in hourly]
    assert local_hours == [0, 1, 3, 4]
    assert hourly[2] - hourly[1] == 3600  # 01:00 PST -> 03:00 PDT is one real hour


def test_fall_back_runs_the_repeated_hour_twice() -> None:
    runs = walk("30 1 * * *", LA, ts("2015-11-01T00:00:00-07:00"), ts("2015-11-02T00:00:00", LA))
    assert runs == [ts("2015-11-01T01:30:00-07:00"), ts("2015-11-01T01:30:00-08:00")]
    assert runs[1] - runs[0] == 3600
    hourly = walk("0 * * * *", LA, ts("2015-11-01T00:00:00-07:00"),
                  ts("2015-11-01T04:00:00-08:00"))
    assert [datetime.fromtimestamp(t, ZoneInfo(LA)).hour for t in hourly] == [0, 1, 1, 2, 3]
    assert all(b - a == 3600 for a, b in zip(hourly, hourly[1:], strict=False))


def test_next_after_is_strict_and_first_at_or_after_is_inclusive() -> None:
    t = ts("2020-01-01T10:00:00")
    assert cron.first_at_or_after("0 * * * *", "UTC", t) == t
    assert cron.next_after("0 * * * *", "UTC", t) == t + 3600
    assert cron.next_after("0 * * * *", "UTC", t - 1) == t


def test_time_zone_is_applied() -> None:
    start = ts("2020-06-01T00:00:00")
    tokyo = cron.first_at_or_after("0 9 * * *", "Asia/Tokyo", start)
    assert tokyo == ts("2020-06-01T09:00:00+09:00")
    assert cron.first_at_or_after("0 9 * * *", "UTC", start) == ts("2020-06-01T09:00:00")
    # A 30-minute DST zone (Lord Howe) and a 45-minute offset (Chatham) still work.
    lh = walk("*/15 * * * *", "Australia/Lord_Howe", ts("2015-10-04T01:00:00+10:30"),
              ts("2015-10-04T03:00:00+11:00"))
    assert lh == oracle("*/15 * * * *", "Australia/Lord_Howe", ts("2015-10-04T01:00:00+10:30"),
                        ts("2015-10-04T03:00:00+11:00"))


@pytest.mark.parametrize(("alias", "fields"), sorted(cron.ALIASES.items()))
def test_aliases(alias: str, fields: str) -> None:
    assert cron.normalize(alias) == fields
    assert cron.normalize(alias.upper()) == fields
    start = ts("2021-05-05T05:05:05")
    assert cron.next_after(alias, "UTC", start) == cron.next_after(fields, "UTC", start)


def test_weekday_month_and_day_fields() -> None:
    # 2021-05-05 is a Wednesday.
    start = ts("2021-05-05T12:00:00")
    assert cron.first_at_or_after("0 0 * * 1", "UTC", start) == ts("2021-05-10T00:00:00")
    assert cron.first_at_or_after("0 0 1 1 *", "UTC", start) == ts("2022-01-01T00:00:00")
    assert cron.first_at_or_after("0 0 29 2 *", "UTC", start) == ts("2024-02-29T00:00:00")
    assert cron.first_at_or_after("  0   0 *  * 1 ", "UTC", start) == ts("2021-05-10T00:00:00")


@pytest.mark.parametrize("expr", [
    "", "   ", "* * * *", "* * * * * *", "61 * * * *", "* 24 * * *", "* * 32 * *",
    "* * * 13 *", "a b c d e", "@fortnightly", "*/0 * * * *", "5-1x * * * *",
])
def test_bad_cron_is_refused_naming_the_field(expr: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        cron.normalize(expr)
    assert info.value.field == "cron"
    assert str(info.value).startswith("cron: ")


def test_check_refuses_a_bad_line_each_time_and_keeps_the_good_ones() -> None:
    """check() remembers the lines it read (add_many checks one per row); a refusal is
    not remembered: asked again, it refuses again."""
    for _ in range(3):
        with pytest.raises(InvalidInputError, match="^cron: .*minute"):
            cron.check("61 * * * *")
        with pytest.raises(InvalidInputError, match="^cron: "):
            cron.check(["0", "0", "*", "*", "*"])  # type: ignore[arg-type]
        assert cron.check(" 0  5 * * 1 ") == "0  5 * * 1"


def test_cron_that_never_fires_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="^cron: "):
        cron.next_after("0 0 30 2 *", "UTC", ts("2021-01-01T00:00:00"))


@pytest.mark.parametrize("name", ["Mars/Olympus", "", "../etc/passwd", "UTC ", "Asia/Tokio"])
def test_unknown_zone_is_refused_naming_the_field(name: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        cron.zone(name)
    assert info.value.field == "timezone"
