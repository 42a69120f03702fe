"""What state a schedule is in, as `list`, `status` and /metrics say it (SPEC "Failures
and notifications"): one rule, read from the schedule's row and its latest history row.

- `paused`: paused (by a user, or by the daemon when it has no next occurrence).
- `running`: a worker holds it (`list` says `queued` of an extra run it holds until its
  schedule's running occurrence ends).
- `retrying`: its current occurrence failed and waits for another attempt (`attempt` on
  the row counts the attempts made; the latest run did not ask to run later).
- `failed`: its latest run failed and the occurrence was given up (max_attempts): the
  schedule moved on, and says so until a run succeeds.
- `ok`: anything else.
"""

from __future__ import annotations

from typing import Any

from perfectschedd.vocabulary.outcomes import Outcome, is_failure

OK, PAUSED, RUNNING, RETRYING, FAILED = "ok", "paused", "running", "retrying", "failed"
STATES = (OK, PAUSED, RUNNING, RETRYING, FAILED)
# What `list` says of an extra run (`run KEY`) a worker holds while it waits for its
# schedule's running occurrence to end (control/commands.py tells it from RUNNING; the
# counts of status and /metrics keep it under RUNNING).
QUEUED = "queued"


def state_of(paused: Any, owner: str | None, attempt: int, last_outcome: str | None) -> str:
    """The state of a schedule whose row says `paused`, `owner`, `attempt` and whose latest
    run (None: none recorded) ended `last_outcome`."""
    if paused:
        return PAUSED
    if owner is not None:
        return RUNNING
    if attempt > 0 and last_outcome != Outcome.LATER:
        return RETRYING
    if is_failure(last_outcome):
        return FAILED
    return OK


def shown(state: str, attempt: int) -> str:
    """The state as `list` prints it: `retrying N` says how many attempts failed."""
    return f"{RETRYING} {attempt}" if state == RETRYING else state


def first_line(text: Any, limit: int = 200) -> str | None:
    """The first non-empty line of a run's error text (None: none)."""
    if not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return None
