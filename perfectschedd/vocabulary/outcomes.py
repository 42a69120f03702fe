"""How a run ends: the one list of outcomes a history row, a counter label, a state and a
notification speak of, and the one rule of which of them are failures (SPEC "Failures
and notifications").  Every layer reads these names here; none spells them itself."""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    """How a run ended; also the ``outcome`` label of the task counters."""

    SUCCESS = "success"      # finished
    FAILED = "failed"        # retried after retry_wait (non-zero exit, exception)
    TIMEOUT = "timeout"      # killed or interrupted at the route's timeout, retried
    LATER = "later"          # retried after an explicit wait (SCHED_LATER N, retry(wait=N))
    PREEMPTED = "preempted"  # the lease was lost; nothing was written
    RELEASED = "released"    # the application released the task
    STOPPED = "stopped"      # ended because the daemon stops; task released
    # Written by the daemon, never returned by an executor:
    LOST = "lost"            # the worker (or host) holding the run died under it
    SKIPPED = "skipped"      # an occurrence not run (misfire policy, catch-up bound)
    REFUSED = "refused"      # a row the daemon will not run (a planted exec:K row)
    NO_ROUTE = "no_route"    # no route takes the schedule's type
    DB_ERROR = "db_error"    # the run's end could not be written (database error): it
    #                          runs again when its lease expires


# Outcomes that count as a failure (retries, the `failed` state, notifications).  A
# request to run later (SCHED_LATER N) is an attempt, not a failure.  Plain strings, as
# the database driver binds them (a driver may bind an Enum by its name).
FAILURES = frozenset(o.value for o in (Outcome.FAILED, Outcome.TIMEOUT, Outcome.LOST))


def is_failure(outcome: str | None) -> bool:
    """Whether a run that ended `outcome` (None: none recorded) failed."""
    return outcome in FAILURES
