"""The next fire times of a schedule or of an expression (perfectschedctl next), as the
workers will run them: each occurrence (the nominal time, PERFECTSCHED_SCHEDULED_TIME)
and when it runs (with the delay and the key's jitter), and the DST marks: a local time
that happens twice, and the local times a clock set forward skips (cron.py decides both).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import cron
from perfectschedd.schedules.policy import due_shift
from perfectschedd.vocabulary.fields import PREVIEW_COUNT, PREVIEW_MAX


@dataclass(frozen=True)
class Fire:
    scheduled_time: int        # the occurrence (nominal time)
    run_time: int              # when it runs: + delay + jitter (or the stored run time)
    repeated: int | None       # 1 or 2: the first or second time of a repeated local time
    skipped_before: list[datetime] = field(default_factory=list)  # gap times just before

    def as_dict(self, tz_name: str) -> dict[str, Any]:
        return {"scheduled_time": self.scheduled_time,
                "scheduled_local": local_iso(self.scheduled_time, tz_name),
                "run_time": self.run_time, "run_local": local_iso(self.run_time, tz_name),
                "repeated": self.repeated,
                "skipped_before": [w.isoformat() for w in self.skipped_before]}


def local_iso(ts: int, tz_name: str) -> str:
    """ISO 8601 local time with its UTC offset: 2026-03-29T03:30:00+02:00."""
    return datetime.fromtimestamp(ts, UTC).astimezone(cron.zone(tz_name)).isoformat()


def check_count(count: Any) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or \
            not 1 <= count <= PREVIEW_MAX:
        raise InvalidInputError("count", f"must be a whole number from 1 to {PREVIEW_MAX}")
    return count


def of_expression(expr: str, tz_name: str, start: int, count: int = PREVIEW_COUNT
                  ) -> list[Fire]:
    """The first `count` occurrences of `expr` at or after `start` (an @every grid starts
    at `start`, as a schedule added then would)."""
    cron.check(expr)  # as `add` would take it
    check_count(count)
    cron.zone(tz_name)
    if cron.is_once(expr):
        return [Fire(start, start, None)]
    first = cron.first_at_or_after(expr, tz_name, start)
    return _walk(expr, tz_name, first, first, count, lambda t: t, start - 1)


def of_schedule(info: Mapping[str, Any], count: int = PREVIEW_COUNT) -> list[Fire]:
    """The next `count` occurrences of a stored schedule (as `show` gives it): from its
    next_time on (the one after it when that one runs now), each run time with the delay
    and the key's jitter; the first as stored when it waits (--at, a retry's wait)."""
    check_count(count)
    expr, tz_name = info["cron"], info["timezone"]
    next_time, next_run = int(info["next_time"]), int(info["next_run_time"])
    shift = due_shift(str(info["key"]), int(info.get("delay") or 0),
                      int(info.get("jitter") or 0))
    if expr is None or cron.is_once(expr):
        return [Fire(next_time, next_run, None)] if info.get("owner") is None else []
    if info.get("owner") is not None:  # this occurrence runs now: the next ones follow
        first = cron.next_after(expr, tz_name, next_time, anchor=next_time)
        return _walk(expr, tz_name, first, next_time, count, lambda t: t + shift, next_time)
    fires = _walk(expr, tz_name, next_time, next_time, count, lambda t: t + shift,
                  next_time - 1)
    head = fires[0]
    return [Fire(head.scheduled_time, next_run, head.repeated, head.skipped_before),
            *fires[1:]]


def _walk(expr: str, tz_name: str, first: int, anchor: int, count: int,
          run_of: Any, before: int) -> list[Fire]:
    fires: list[Fire] = []
    previous, t = before, first
    marked = cron.period(expr) is None  # an interval counts seconds: no local-time marks
    while True:
        fires.append(Fire(t, run_of(t), cron.repeated(t, tz_name) if marked else None,
                          cron.skipped_between(expr, tz_name, previous, t)))
        if len(fires) == count:
            return fires
        previous = t
        try:
            t = cron.next_after(expr, tz_name, t, anchor=anchor)
        except cron.NoNextOccurrence:
            return fires


def of_expression_shown(expr: str, tz_name: str, start: int, count: int = PREVIEW_COUNT
                        ) -> dict[str, Any]:
    """`next --cron EXPR --json`, and GET /api/v1/next: the expression and its times."""
    fires = of_expression(expr, tz_name, start, count)
    return {"cron": expr, "timezone": tz_name, "times": [f.as_dict(tz_name) for f in fires]}


def of_schedule_shown(info: Mapping[str, Any], count: int = PREVIEW_COUNT) -> dict[str, Any]:
    """`next KEY --json`, and GET /api/v1/schedules/KEY/next: the schedule (as `show`
    gives it) and its times."""
    fires = of_schedule(info, count)
    tz_name = info["timezone"]
    return {"key": info["key"], "cron": info["cron"], "timezone": tz_name,
            "delay": info.get("delay") or 0, "jitter": info.get("jitter") or 0,
            "paused": bool(info.get("paused")), "running": info.get("owner") is not None,
            "times": [f.as_dict(tz_name) for f in fires]}
