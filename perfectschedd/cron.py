"""(cron, tz, after) -> next occurrence; the DST rules live here and nowhere else.

croniter walks local wall-clock time (naive datetimes); this module maps each wall time
to real instants in the schedule's zone:
- a wall time that does not exist (spring forward gap) is skipped;
- a wall time that happens twice (fall back) yields two occurrences, one per offset.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from .errors import InvalidInputError

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# Longest wall-clock step back of any zone's DST change (Antarctica/Troll: 2 h), with margin.
_MAX_SHIFT = timedelta(hours=3)


@lru_cache(maxsize=1024)
def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidInputError("timezone", f"unknown time zone {name!r}") from None


@lru_cache(maxsize=4096)
def normalize(expr: str) -> str:
    """Validate a cron expression (five fields or an @alias) and return its five fields."""
    if not isinstance(expr, str) or not expr.strip():
        raise InvalidInputError("cron", "empty cron expression")
    text = " ".join(expr.split())
    if text.startswith("@"):
        if text.lower() not in ALIASES:
            raise InvalidInputError(
                "cron", f"unknown alias {text!r} (known: {', '.join(sorted(ALIASES))})")
        return ALIASES[text.lower()]
    if len(text.split(" ")) != 5:
        raise InvalidInputError("cron", f"{expr!r} must have five fields (min hour dom mon dow)")
    try:
        valid = croniter.is_valid(text)
    except Exception:  # noqa: BLE001 - old croniter versions raise on some garbage
        valid = False
    if not valid:
        raise InvalidInputError("cron", f"cannot parse {expr!r}")
    return text


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


# Pure function of its arguments; a burst of schedules sharing a cron line and an
# occurrence computes the next one once.
@lru_cache(maxsize=16384)
def next_after(expr: str, tz_name: str, after: int) -> int:
    """First occurrence strictly after Unix time `after`."""
    fields = normalize(expr)
    tz = zone(tz_name)
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


def first_at_or_after(expr: str, tz_name: str, start: int) -> int:
    return next_after(expr, tz_name, start - 1)
