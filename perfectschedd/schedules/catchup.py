"""Misfire and grace (SPEC "Schedule policies"): what a worker does with an occurrence it
has just claimed, when that occurrence (or some after it) could not start on time.

Decided from the schedule's cron alone, without walking every missed occurrence (an
`@every` schedule's grid runs through the occurrence claimed, a grid point): a
schedule that missed 100,000 minutes is caught up by a few croniter steps back from now
(`latest`/`skip`) or forward from the grace deadline (`all` with a grace); the skipped
ones are counted up to COUNT_CAP and the newest of them recorded in the history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from perfectschedd.schedules import cron

# Skipped occurrences counted (log, metric) at most per catch-up, the history keeping the
# newest of them: the cap resume --skip-missed uses too (missed.py says why it is 1,000).
from perfectschedd.schedules.missed import COUNT_CAP
from perfectschedd.schedules.policy import due_shift
from perfectschedd.schedules.task import Task


@dataclass(frozen=True)
class CatchUp:
    skipped: list[int]        # occurrences not run, newest first (at most COUNT_CAP)
    run: int | None           # the occurrence to run now (None: run nothing now)
    next_time: int | None     # with run None: the occurrence the schedule moves on to


def plan(task: Task, now: float) -> CatchUp | None:
    """None: run the claimed occurrence as it is (the usual case)."""
    policy = task.policy
    grace = policy.effective_grace()
    if policy.misfire == "all" and grace is None:
        return None
    expr = task.cron
    if expr is None or cron.is_once(expr) or task.attempt != 1:
        return None  # extra runs and one-shots run; a retry is not a misfire
    shift = due_shift(task.key, task.delay, policy.jitter)  # due = occurrence + shift
    first = task.scheduled_time
    if policy.misfire == "all":
        assert grace is not None
        if now - (first + shift) <= grace:
            return None
        # Everything that can no longer start within the grace is skipped; the first
        # occurrence that still can is the next to run.
        target = cron.first_at_or_after(expr, task.timezone, math.ceil(now - grace - shift),
                                        anchor=first)
        skipped = cron.occurrences_back(expr, task.timezone, target, first, COUNT_CAP)
        if target + shift <= now:
            return CatchUp(skipped, target, None)
        return CatchUp(skipped, None, target)
    # latest / skip: the newest occurrence that is due now.
    newest = cron.latest_at_or_before(expr, task.timezone, math.floor(now - shift),
                                      anchor=first)
    newest = first if newest is None or newest < first else newest
    skipped = cron.occurrences_back(expr, task.timezone, newest, first, COUNT_CAP) \
        if newest > first else []
    late = now - (newest + shift)
    if policy.misfire == "skip" or (grace is not None and late > grace):
        if grace is None or late <= grace:
            if not skipped:
                return None
            return CatchUp(skipped, newest, None)
        return CatchUp([newest, *skipped][:COUNT_CAP], None,
                       cron.next_after(expr, task.timezone, newest))
    if not skipped:
        return None
    return CatchUp(skipped, newest, None)
