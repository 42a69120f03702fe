"""`resume --skip-missed`: a paused schedule resumes without catching up.  The occurrences
it missed while paused are not run (recorded in history as `skipped`, as misfire skip
records them, at most COUNT_CAP of them); the first one due from now on runs on time.

Decided from the stored row alone, as catchup.py decides from a claimed one: a schedule
paused for a year is moved on by a few croniter steps, not by walking every occurrence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import cron, policy
from perfectschedd.store.schema import Row

# Skipped occurrences counted (log, metric, history) at most per schedule and catch-up:
# counting costs about 150 us each (a croniter step and the zone's offsets).
COUNT_CAP = 1_000
# The error line of the history rows of occurrences skipped this way.
SKIPPED_WHY = "not run: resumed with --skip-missed"


@dataclass(frozen=True)
class Skip:
    next_time: int      # the occurrence the schedule moves on to (due now or later)
    next_run_time: int
    skipped: list[int]  # occurrences not run, newest first (at most COUNT_CAP)


def skip(row: Row, now: float) -> Skip | None:
    """Where `row`, resumed at `now` without catching up, moves on to; None: it runs as it
    stands (nothing of it is due, it is an extra run or a one-shot, which were asked for
    and run, or a worker holds it: its finish moves it on)."""
    if row.cron is None or cron.is_once(row.cron) or row.owner is not None \
            or row.next_run_time > now:
        return None
    shift = policy.due_shift(row.key, row.delay, policy.from_text(row.policy).jitter)
    try:
        # An interval's grid runs through its stored occurrence: without the anchor,
        # first_at_or_after starts a new grid at `now`.
        target = cron.first_at_or_after(row.cron, row.timezone, math.ceil(now - shift),
                                        anchor=row.next_time)
    except InvalidInputError:  # no occurrence left: its next finish pauses it, as always
        return None
    if target <= row.next_time:
        return None
    skipped = cron.occurrences_back(row.cron, row.timezone, target, row.next_time,
                                    COUNT_CAP)
    return Skip(target, target + shift, skipped)
