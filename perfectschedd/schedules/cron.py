"""(cron, tz, after) -> next occurrence; the DST rules live here and nowhere else.

croniter walks local wall-clock time (naive datetimes); this module maps each wall time
to real instants in the schedule's zone:
- a wall time that does not exist (spring forward gap) is skipped;
- a wall time that happens twice (fall back) yields two occurrences, one per offset.

`@every DURATION` (interval.py) is a grid of instants anchored at a grid point: the
functions that look for an occurrence from an arbitrary time take that `anchor` (any
stored next_time of the schedule); without one, the time given is taken as on the grid.
"""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import cronsyntax, interval
from perfectschedd.vocabulary.fields import LAST_INSTANT

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# croniter's non-standard random (R) and hashed (H) fields: each process would pick its
# own value, so hosts would disagree on when a schedule is due.
_RANDOM_FIELD = re.compile(r"(?:^|[,/-])[RrHh](?:$|[,/(-])")
# Longest wall-clock step back of any zone's DST change (Antarctica/Troll: 2 h), with margin.
_MAX_SHIFT = timedelta(hours=3)


@lru_cache(maxsize=1024)
def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError, OSError):
        # OSError: a name that is a directory of the zone database, or unreadable.
        raise InvalidInputError("timezone", f"unknown time zone {name!r}") from None


@lru_cache(maxsize=4096)
def normalize(expr: str) -> str:
    """Validate a cron expression as stored (five fields, an @alias, @once or @every) and
    return what evaluates it: the five fields as croniter reads them, ONCE, or the
    canonical @every text.  Rows stored by an older release (or another host's croniter)
    that the field checks refuse still evaluate as long as croniter reads them."""
    text = _words(expr)
    if text.lower() == ONCE:
        return ONCE
    if interval.is_interval(text):
        return interval.canonical(text)
    if text.startswith("@"):
        return _alias(text)
    fields = _five(expr, text)
    try:
        fields = cronsyntax.check(fields, new=False)
    except InvalidInputError:
        if _croniter_reads(text):
            return text
        raise
    readable = cronsyntax.for_croniter(fields)
    if not _croniter_reads(readable):
        raise InvalidInputError("cron", f"cannot parse {expr!r}")
    return readable


def check(expr: str) -> str:
    """A cron expression of a new schedule, as it is stored: field by field checks
    (cronsyntax), each refusal naming the field, the value and its range."""
    if not isinstance(expr, str):
        _words(expr)  # refuses it, naming the field
    return _check(expr)


# Pure function of the text, and add_many checks each row's: croniter parses a line in
# about 100 us, ten times what the rest of a row's checks cost.  (A refusal is not cached:
# it is raised anew.)
@lru_cache(maxsize=4096)
def _check(expr: str) -> str:
    text = _words(expr)
    if text.lower() == ONCE:
        return ONCE
    if interval.is_interval(text):
        return interval.canonical(text)
    if text.startswith("@"):
        _alias(text)
        return expr.strip()
    fields = _five(expr, text)
    stored = cronsyntax.check(fields)
    if not _croniter_reads(" ".join(stored)):
        raise InvalidInputError("cron", f"cannot parse {expr!r}")
    return expr.strip() if stored == fields else " ".join(stored)


def _words(expr: str) -> str:
    if not isinstance(expr, str) or not expr.strip():
        raise InvalidInputError("cron", "empty cron expression")
    return " ".join(expr.split())


def _alias(text: str) -> str:
    if text.lower() not in ALIASES:
        raise InvalidInputError(
            "cron", f"unknown alias {text!r} (known: {', '.join(sorted(ALIASES))}, @once, "
            "@every DURATION)")
    return ALIASES[text.lower()]


def _five(expr: str, text: str) -> list[str]:
    fields = text.split(" ")
    if len(fields) != 5:
        raise InvalidInputError("cron", f"{expr!r} must have five fields (min hour dom mon dow)")
    if any(_RANDOM_FIELD.search(field) for field in fields):
        raise InvalidInputError("cron", f"{expr!r}: random (R) and hashed (H) fields are not "
                                "supported (every host would pick its own time)")
    return fields


def _croniter_reads(text: str) -> bool:
    try:
        return bool(croniter.is_valid(text))
    except Exception:  # noqa: BLE001 - old croniter versions raise on some garbage
        return False


def period(expr: str) -> int | None:
    """The interval of an `@every` expression in seconds; None for any other."""
    fields = normalize(expr)
    return interval.seconds(fields) if interval.is_interval(fields) else None


def _instants(wall: datetime, tz: ZoneInfo) -> list[int]:
    """Unix seconds at which wall-clock time `wall` happens in `tz` (0, 1 or 2 of them)."""
    out: list[int] = []
    for fold in (0, 1):
        aware = wall.replace(tzinfo=tz, fold=fold)
        utc = aware.astimezone(UTC)
        if utc.astimezone(tz).replace(tzinfo=None) != wall:
            continue  # in a gap: this wall time does not exist
        ts = int(utc.timestamp())
        if ts not in out:
            out.append(ts)
    return out


_local = threading.local()


def _iterator(fields: str, start: datetime) -> croniter:
    """A croniter positioned at `start`; one per expression and thread, because building
    one costs twice as much as stepping it."""
    cache: dict[str, croniter] | None = getattr(_local, "iters", None)
    if cache is None:
        cache = _local.iters = {}
    it = cache.get(fields)
    if it is None:
        if len(cache) > 256:
            cache.clear()
        it = cache[fields] = croniter(fields, start)
    else:
        it.set_current(start)
    return it


class NoNextOccurrence(InvalidInputError):
    """The expression has no occurrence left before the calendar ends (year 9999)."""

    def __init__(self, expr: str, after: int) -> None:
        when = datetime.fromtimestamp(min(max(after, 0), LAST_INSTANT), UTC)
        super().__init__("cron", f"{expr!r} has no occurrence after {when:%Y-%m-%d %H:%M} UTC "
                         "(the calendar ends with year 9999)")


# Pure function of its arguments; a burst of schedules sharing a cron line and an
# occurrence computes the next one once.  (An exception is not cached: it is raised anew.)
@lru_cache(maxsize=16384)
def next_after(expr: str, tz_name: str, after: int, anchor: int | None = None) -> int:
    """First occurrence strictly after Unix time `after` (an interval's grid: through
    `anchor`, by default through `after` itself)."""
    fields = normalize(expr)
    tz = zone(tz_name)
    if interval.is_interval(fields):
        step = interval.seconds(fields)
        found = interval.first_at_or_after(step, after if anchor is None else anchor,
                                           after + 1)
        if found > LAST_INSTANT:
            raise NoNextOccurrence(expr, after)
        return found
    # The first occurrence after `a` is also the first after any later time before it:
    # a batch added a second after another (add_many's chunks) needs no croniter walk.
    known = _last_found.get((expr, tz_name))
    if known is not None and known[0] <= after < known[1]:
        return known[1]
    try:
        found = _next_after(expr, fields, tz, after)
    except (OverflowError, ValueError, OSError) as exc:
        if isinstance(exc, InvalidInputError):
            raise
        # Past year 9999 (datetime's end), or a time no platform call can hold.
        raise NoNextOccurrence(expr, after) from None
    if len(_last_found) >= 4096:
        _last_found.clear()
    _last_found[(expr, tz_name)] = (after, found)
    return found


# (expr, zone) -> (after, the first occurrence after it) of the latest walk.
_last_found: dict[tuple[str, str], tuple[int, int]] = {}


def _next_after(expr: str, fields: str, tz: ZoneInfo, after: int) -> int:
    if after >= LAST_INSTANT:
        raise NoNextOccurrence(expr, after)
    t = datetime.fromtimestamp(after, UTC)
    wall = t.astimezone(tz).replace(tzinfo=None)
    # Wall times before `wall` can still lie ahead only when the clock steps back soon.
    if (t + _MAX_SHIFT).astimezone(tz).utcoffset() != t.astimezone(tz).utcoffset():
        wall = wall - _MAX_SHIFT
    it = _iterator(fields, wall)
    best: int | None = None
    for _ in range(100_000):
        try:
            candidate = it.get_next(datetime)
        except CroniterBadDateError:  # no such date within croniter's search, e.g. 30 Feb
            break
        instants = _instants(candidate, tz)
        if best is not None and instants and instants[0] > best:
            return best
        for ts in instants:
            if ts > after and (best is None or ts < best):
                best = ts
        if best is not None and instants and instants[0] >= best:
            return best
    raise InvalidInputError("cron", f"{expr!r} has no occurrence")  # e.g. 30 Feb


def first_at_or_after(expr: str, tz_name: str, start: int, anchor: int | None = None) -> int:
    """The first occurrence at or after `start`; a new interval schedule starts at
    `start` itself (no `anchor`)."""
    if is_once(expr):
        return start
    if anchor is None and interval.is_interval(normalize(expr)):
        return start
    return next_after(expr, tz_name, start - 1, anchor)


ONCE = "@once"


def is_once(expr: str | None) -> bool:
    """`@once`: a one-shot schedule (runs at its --at, then is removed)."""
    return expr is not None and expr.strip().lower() == ONCE


def occurrences_back(expr: str, tz_name: str, before: int, since: int,
                     limit: int, anchor: int | None = None) -> list[int]:
    """Occurrences in [since, before), newest first, at most `limit` of them: without
    iterating over everything between (a catch-up may span 100,000 occurrences).  An
    interval's grid runs through `anchor`, by default through `since`."""
    fields = normalize(expr)
    tz = zone(tz_name)
    if interval.is_interval(fields):
        step = interval.seconds(fields)
        grid = since if anchor is None else anchor
        newest = interval.latest_at_or_before(step, grid, before - 1)
        oldest = interval.first_at_or_after(step, grid, since)
        return list(range(newest, max(oldest - 1, newest - step * limit), -step))
    found: list[int] = []
    try:
        start = datetime.fromtimestamp(before, UTC).astimezone(tz).replace(tzinfo=None)
        # Walking back in wall time: past a clock step back, instants may come out of
        # order; a margin of the longest step keeps the newest ones.
        it = croniter(fields, start + _MAX_SHIFT)
        floor = since - int(_MAX_SHIFT.total_seconds())
        for _ in range(limit * 3 + 200):
            candidate = it.get_prev(datetime)
            instants = [t for t in _instants(candidate, tz) if since <= t < before]
            found.extend(t for t in instants if t not in found)
            if len(found) >= limit + 8 or (not instants and
                                           _wall_ts(candidate) < floor):
                break
    except (CroniterBadDateError, OverflowError, ValueError, OSError):
        pass
    found.sort(reverse=True)
    return found[:limit]


def latest_at_or_before(expr: str, tz_name: str, at: int, anchor: int | None = None
                        ) -> int | None:
    """The newest occurrence at or before Unix time `at` (None if there is none); an
    interval's grid runs through `anchor` (required for one)."""
    fields = normalize(expr)
    if interval.is_interval(fields):
        if anchor is None:
            raise ValueError("an interval's latest occurrence needs its grid's anchor")
        return interval.latest_at_or_before(interval.seconds(fields), anchor, at)
    newest = occurrences_back(expr, tz_name, at + 1, at - 400 * 86400 * 10, 1)
    return newest[0] if newest else None


def _wall_ts(wall: datetime) -> int:
    return int(wall.replace(tzinfo=UTC).timestamp())


# -- what a preview marks (perfectschedctl next) ------------------------------------------

# Wall times looked at between two occurrences for ones a DST gap skipped: a gap is at
# most a few hours, and the wall times of an expression in it at most one a minute.
_GAP_STEPS = 2000


def repeated(ts: int, tz_name: str) -> int | None:
    """1 or 2 when the wall time of instant `ts` happens twice in the zone (a clock set
    back): the first or the second time; None otherwise."""
    tz = zone(tz_name)
    wall = datetime.fromtimestamp(ts, UTC).astimezone(tz).replace(tzinfo=None)
    instants = _instants(wall, tz)
    return instants.index(ts) + 1 if len(instants) == 2 and ts in instants else None


def skipped_between(expr: str, tz_name: str, after: int, until: int) -> list[datetime]:
    """The wall times of `expr` after instant `after` and before instant `until` that do
    not exist in the zone (a clock set forward) and so are skipped; none for @once and
    @every (which count seconds)."""
    fields = normalize(expr)
    if fields == ONCE or interval.is_interval(fields):
        return []
    tz = zone(tz_name)
    start = datetime.fromtimestamp(after, UTC).astimezone(tz).replace(tzinfo=None)
    end = datetime.fromtimestamp(until, UTC).astimezone(tz).replace(tzinfo=None)
    if end <= start:
        return []
    out: list[datetime] = []
    it = croniter(fields, start)
    for _ in range(_GAP_STEPS):
        try:
            wall = it.get_next(datetime)
        except CroniterBadDateError:
            break
        if wall >= end:
            break
        if not _instants(wall, tz):
            out.append(wall)
    return out
