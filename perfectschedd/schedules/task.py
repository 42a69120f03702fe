"""A leased occurrence of a schedule (Task): what a worker, or an application polling
the library, does with it: claim it, run it alone or beside its schedule's others, keep
its lease (heartbeat), and end it once (finish, retry, release, refuse, give back).

ScheduleCollection.poll_many makes them (collection.py); ending one writes to the store
through the holder's fence, so a task whose lease was lost ends in PreemptedError.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from perfectschedd.config import Config
from perfectschedd.errors import AlreadyFinishedError, PreemptedError
from perfectschedd.schedules import cron, policy
from perfectschedd.store.schema import Advance, Claimed, Row, lease_until
from perfectschedd.store.sql import Store
from perfectschedd.vocabulary.fields import KEY_MAX, RUN_NOW_MARK, schedule_key


def _run_at(now: float, wait: float) -> int:
    """The whole second at which an occurrence given back at `now` comes due again: the
    current one when it may run at once (rounding up would hold it for up to a second),
    else not before `wait` seconds have passed."""
    return math.ceil(now + wait) if wait else int(now)


def _retry_at(now: float, wait: float) -> int:
    """The whole second at which an attempt that ended at `now` is tried again: not before
    `wait` seconds, and never in the same second, even without a wait (retry_wait: 0,
    SCHED_LATER 0), so that a job failing at once with no limit on attempts runs at most
    once a second rather than as fast as a worker can claim it."""
    return max(math.ceil(now + wait), math.floor(now) + 1)


class Task:
    """One leased occurrence of a schedule.  Exactly one of finish/retry/release ends it."""

    __slots__ = ("_store", "_config", "key", "type", "cron", "delay", "timezone",
                 "scheduled_time", "attempt", "fence", "_data_text", "_data", "done",
                 "claimed_at", "due_time", "has_extra", "_advance", "policy", "gave_up",
                 "creator", "later_refused")

    def __init__(self, store: Store, config: Config, claimed: Claimed, claimed_at: float):
        """`store`, `config`: those of the collection that claimed it (poll_many)."""
        self._store = store
        self._config = config
        self.key = claimed.key
        self.type = claimed.type
        self.cron = claimed.cron
        self.delay = claimed.delay
        self.timezone = claimed.timezone
        self.scheduled_time = claimed.next_time
        self.attempt = claimed.attempt
        self.fence = claimed.fence
        self._data_text = claimed.data
        self._data: dict[str, Any] | None = None
        self.done = False
        self.claimed_at = claimed_at
        self.due_time = claimed.due_time
        self.has_extra = bool(claimed.has_extra)
        self._advance: Advance | None = None
        self.policy = policy.from_text(claimed.policy)
        self.gave_up = False  # its last failed attempt was its last (max_attempts)
        self.creator = claimed.creator  # whose notifications its runs are (dispatch.py)
        # Why a SCHED_LATER was refused and the occurrence given up (later_limit), or None.
        self.later_refused: str | None = None

    @property
    def schedule_key(self) -> str:
        """The key of the schedule this run belongs to: KEY for an extra run or an
        allow/replace occurrence (key KEY@run-...), else the key itself.  Exec jobs get
        it as PERFECTSCHED_SCHEDULE_KEY."""
        return schedule_key(self.key)

    @property
    def group(self) -> str | None:
        """The schedule whose runs must not overlap this one's, when that may happen: its
        own key if it has had extra runs, the schedule's key for an extra run (or an
        occurrence on a row of its own); None under `concurrency: allow`."""
        if self.policy.concurrency == "allow":
            return None
        if RUN_NOW_MARK in self.key:
            return schedule_key(self.key)
        return self.key if self.has_extra else None

    def group_turn(self, now: float | None = None) -> str:
        """Whether this run may start now in its group (store.group_turn: TURN_START,
        TURN_WAIT, TURN_LOST); under `replace`, the group's other running rows are stopped
        first.  Only for a task with a group."""
        group = self.group
        assert group is not None
        now_s = int(time.time() if now is None else now)
        return self._store.group_turn(
            self.key, group, now_s, fence=self.fence,
            replace=self.policy.concurrency == "replace")

    def split_off(self, owner: str, alive_time: int) -> bool:
        """An occurrence of an allow or replace schedule, just claimed, moves to a row of
        its own (KEY@run-TIME-HEX, a one-off holding this lease), and the schedule's row
        moves on to its next occurrence at once, so that the next one can come due while
        this one runs.  This task then stands for the new row.  False when the lease was
        lost (nothing to run); True when split, or when nothing is to split (an extra run,
        a one-shot, a schedule with no next occurrence, a key too long to mark)."""
        if not self.policy.overlaps or self.cron is None or cron.is_once(self.cron) \
                or RUN_NOW_MARK in self.key:
            return True
        run_key = f"{self.key}{RUN_NOW_MARK}{self.scheduled_time}-{os.urandom(4).hex()}"
        advance = self.next_advance()
        if advance.pause_reason is not None or len(run_key) > KEY_MAX:
            self._advance = None
            return True
        self._advance = None  # computed for the schedule's row; the run's is its own
        run = Row(key=run_key, type=self.type, cron=None, delay=self.delay,
                  timezone=self.timezone, data=self._data_text,
                  next_time=self.scheduled_time,
                  next_run_time=lease_until(self.claimed_at, alive_time), paused=False,
                  fence=1, attempt=self.attempt, owner=owner, claimed_at=self.claimed_at,
                  policy=self.policy.to_text())
        if not self._store.split_occurrence(advance, run, self.due_time):
            return False
        self.key, self.cron, self.fence, self.has_extra = run_key, None, 1, False
        return True

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            self._data = json.loads(self._data_text)
        return self._data

    def __repr__(self) -> str:
        return (f"Task(key={self.key!r}, type={self.type!r}, "
                f"scheduled_time={self.scheduled_time}, attempt={self.attempt})")

    def _end(self) -> None:
        if self.done:
            raise AlreadyFinishedError(f"task {self.key!r} was already finished")
        self.done = True

    def next_advance(self) -> Advance:
        """The holder-side write that finishing this occurrence means (computed once)."""
        if self._advance is None:
            self._advance = self._compute_advance()
        return self._advance

    @property
    def exhausted(self) -> str | None:
        """Why finishing did not move the schedule on (it has no next occurrence and is
        paused), once finished; else None."""
        return self._advance.pause_reason if self._advance is not None else None

    def _compute_advance(self) -> Advance:
        if self.cron is None or cron.is_once(self.cron):
            return Advance(self.key, self.fence, None, None)  # removed once it ran
        try:
            nxt = cron.next_after(self.cron, self.timezone, self.scheduled_time)
        except cron.NoNextOccurrence as exc:
            return Advance(self.key, self.fence, None, None,
                           pause_reason=f"paused by perfectschedd: {exc}")
        return self.advance_to(nxt)

    def advance_to(self, next_time: int) -> Advance:
        """The write that moves the schedule on to its occurrence at `next_time`."""
        return Advance(self.key, self.fence, next_time, self.due_of(next_time))

    def due_of(self, occurrence: int) -> int:
        """When an occurrence of this schedule is due (policy.due_time)."""
        return policy.due_time(occurrence, self.key, self.delay, self.policy.jitter)

    def finish(self) -> None:
        """Mark the occurrence done; the schedule moves to its next cron time."""
        self._end()
        if self._store.advance([self.next_advance()]):
            raise PreemptedError(f"task {self.key!r} lost its lease before finish")

    def retry(self, wait: float | None = None, now: float | None = None, *,
              later: bool = False) -> None:
        """Run the same occurrence again after `wait` seconds (default: the schedule's
        back-off: retry_wait, doubled per attempt up to retry_wait_max).  After the
        schedule's max_attempts the occurrence is given up instead: the schedule moves
        on to its next one (`gave_up` says so).  `later`: the job asked to run again
        (SCHED_LATER), which is not a failure: the attempt does not count, and the
        occurrence is given up instead only when the run asked for would start more than
        the config's later_limit after the occurrence was due (`later_refused` says so)."""
        now = time.time() if now is None else now
        if wait is None:
            wait = self.backoff()
        run_at = _retry_at(now, wait)
        if later:
            self.later_refused = self._past_later_limit(wait, run_at)
        if self.later_refused is not None or (not later and self.policy.gives_up(
                self.attempt, self._config.max_attempts)):
            self._end()
            self.gave_up = True
            if self._store.advance([self.next_advance()]):
                raise PreemptedError(f"task {self.key!r} lost its lease before giving up")
            return
        self._end()
        if not self._store.reschedule(self.key, self.fence, run_at,
                                                 count_attempt=not later):
            raise PreemptedError(f"task {self.key!r} lost its lease before retry")

    def _past_later_limit(self, wait: float, run_at: int) -> str | None:
        """Why running again at `run_at` (SCHED_LATER `wait`) is refused: later_limit;
        else None."""
        limit = self._config.later_limit
        due = self.due_of(self.scheduled_time)
        if limit <= 0 or run_at <= due + limit:
            return None
        return (f"SCHED_LATER {wait:g} refused: the occurrence of {self.scheduled_time} "
                f"would run {int(run_at - due)} s after it was due, more than later_limit "
                f"({limit} s); given up, the schedule moves on")

    def backoff(self) -> float:
        config = self._config
        return self.policy.backoff(self.attempt, config.retry_wait, config.retry_wait_max)

    def release(self, now: float | None = None) -> None:
        """The application gives the occurrence back, to run again on any worker.

        The first release of an occurrence (attempt 1) runs again at once, as in the
        original; a repeated one counts as an attempt and waits like a retry, so an
        application that always releases cannot spin (hundreds of runs a second).
        """
        self._end()
        now = time.time() if now is None else now
        at = _run_at(now, 0) if self.attempt <= 1 else _retry_at(now, self.policy.backoff(
            self.attempt - 1, self._config.retry_wait,
            self._config.retry_wait_max))
        if not self._store.reschedule(self.key, self.fence, at,
                                                 count_attempt=True):
            raise PreemptedError(f"task {self.key!r} lost its lease before release")

    def refuse(self, reason: str) -> None:
        """The daemon refuses to run this occurrence (fields.foreign_exec_row): its row is
        paused with `reason`, its lease ended, and nothing runs."""
        self._end()
        if self._store.pause_exhausted([Advance(self.key, self.fence, None, None,
                                                           pause_reason=reason)]):
            raise PreemptedError(f"task {self.key!r} lost its lease before it was refused")

    def give_back(self, now: float | None = None, wait: float = 0) -> None:
        """The daemon gives the occurrence back untried (it stops, or cannot run it): it
        runs again after `wait` seconds, on any worker, and this attempt does not count."""
        self._end()
        now = time.time() if now is None else now
        if not self._store.reschedule(self.key, self.fence, _run_at(now, wait),
                                                 count_attempt=False):
            raise PreemptedError(f"task {self.key!r} lost its lease before it was given back")

    def heartbeat(self, now: float | None = None) -> None:
        """Renew the lease for another alive_time seconds."""
        if self.done:
            raise AlreadyFinishedError(f"task {self.key!r} was already finished")
        now = time.time() if now is None else now
        lease = lease_until(now, self._config.alive_time)
        if self._store.heartbeat([(self.key, self.fence)], lease):
            raise PreemptedError(f"task {self.key!r} lost its lease")
