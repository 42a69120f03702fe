"""CRON `@every DURATION`: a fixed-rate interval (SPEC "Schedule policies").

The occurrences form a grid anchored at the schedule's start: start, start + P,
start + 2P, ...  Every stored next_time is a grid point, so any of them serves as the
anchor: the next occurrence after one that ran is that one plus P, and catch-up finds the
grid points between the occurrence it claimed and now by arithmetic, never by walking.
Time zones play no part (an interval counts seconds, not wall-clock time).

DURATION is one or more groups NUMBER UNIT, units d (86400 s), h, m, s, each at most
once and largest first, with no spaces: `90s`, `5m`, `2h`, `1d`, `1h30m`, `1d12h`.
"""

from __future__ import annotations

import re

from perfectschedd.errors import InvalidInputError

EVERY = "@every"
MIN_SECONDS = 1
# A hundred years: a longer interval is a one-shot in practice (@once); every grid point
# then still fits the calendar (year 9999) and 64 bits.
MAX_SECONDS = 36500 * 86400
_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_USAGE = "give a duration such as 90s, 5m, 2h, 1d or 1h30m (units d, h, m, s, largest first)"


def is_interval(expr: str | None) -> bool:
    """Whether `expr` is an `@every` expression (well formed or not)."""
    if expr is None:
        return False
    words = expr.split()
    return bool(words) and words[0].lower() == EVERY


def seconds(expr: str) -> int:
    """The period of `@every DURATION`, in seconds; InvalidInputError (field cron) naming
    what is wrong, in one line."""
    words = expr.split()
    if len(words) != 2:
        raise InvalidInputError("cron", f"{expr.strip()!r}: @every takes one duration: "
                                f"{_USAGE}")
    text = words[1].lower()
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise InvalidInputError("cron", f"@every: cannot read duration {words[1]!r}: {_USAGE}")
    total = sum(int(n) * size for n, size in zip(match.groups(), _UNITS.values(), strict=True)
                if n is not None)
    if total < MIN_SECONDS:
        raise InvalidInputError("cron", f"@every: duration {words[1]!r} is shorter than 1s")
    if total > MAX_SECONDS:
        raise InvalidInputError("cron", f"@every: duration {words[1]!r} is longer than "
                                f"{MAX_SECONDS // 86400}d (100 years; for one run use @once)")
    return total


def canonical(expr: str) -> str:
    """How an `@every` expression is stored: the word lower case, one space, the duration
    as given (lower case)."""
    seconds(expr)
    return f"{EVERY} {expr.split()[1].lower()}"


def first_at_or_after(period: int, anchor: int, start: int) -> int:
    """The first grid point (anchor + k * period) at or after `start`."""
    return anchor - ((anchor - start) // period) * period


def latest_at_or_before(period: int, anchor: int, at: int) -> int:
    """The newest grid point at or before `at`."""
    return anchor + ((at - anchor) // period) * period
