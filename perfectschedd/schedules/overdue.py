"""How late schedules are (status, /metrics; docs/metrics.md "Overdue schedules").

An occurrence is overdue once it is due and has neither started nor succeeded: due and
not claimed (`next_run_time` passed), or failed and waiting for another attempt (its
lateness then counts from the occurrence's own due time, not from the retry's).  A run
that started on time is not overdue while it runs.

A schedule's period is approximated by the gap from its overdue occurrence to the cron's
next one after it (exact for `@every` and evenly spaced crons; the longer gap where they
are uneven, so the alert errs on the late side), and at least PERIOD_MIN.  One-off runs
(`run KEY`, `@once`) have none.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import cron, policy
from perfectschedd.store.schema import Row

# A poll, a claim and a start take seconds; a schedule of `@every 10s` is "a period
# overdue" only after this.
PERIOD_MIN = 60


@dataclass(frozen=True)
class Late:
    key: str
    due: int                 # when its overdue occurrence was due
    overdue_by: float        # seconds
    period: int | None       # None: a one-off run

    @property
    def beyond_period(self) -> bool:
        return self.period is not None and self.overdue_by > self.period


def due_of(row: Row) -> int:
    """When the schedule's current occurrence was due: a retried one's own due time (its
    time, delay and jitter), else when the row may run."""
    if row.attempt > 0:
        occurrence = policy.due_time(row.next_time, row.key, row.delay,
                                     policy.from_text(row.policy).jitter)
        return min(occurrence, row.next_run_time)
    return row.next_run_time


def period_of(row: Row) -> int | None:
    if row.cron is None or cron.is_once(row.cron):
        return None
    try:
        gap = cron.next_after(row.cron, row.timezone, row.next_time) - row.next_time
    except (InvalidInputError, OverflowError, ValueError):
        return None
    return max(PERIOD_MIN, gap)


def late(rows: Iterable[Row], now: float) -> list[Late]:
    """The overdue ones of `rows` (unpaused, not held), most overdue first; each key
    once."""
    out: dict[str, Late] = {}
    for row in rows:
        if row.key in out or row.paused or row.owner is not None:
            continue
        due = due_of(row)
        if due > now:
            continue
        out[row.key] = Late(row.key, due, round(now - due, 3), period_of(row))
    return sorted(out.values(), key=lambda x: (-x.overdue_by, x.key))
