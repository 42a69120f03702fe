"""The holder side: claim due rows (a lease), renew, finish, give back, and take back
the leases of a worker that died.  Every write after the claim names the fence the
claim gave (schema.py), so a holder that lost its lease changes nothing.  The hot path
(finish and claim in one transaction) is each backend's (backends/)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.schema import Advance, Claimed
from perfectschedd.vocabulary.fields import PAUSED_REASON_MAX
from perfectschedd.vocabulary.history import history_row
from perfectschedd.vocabulary.outcomes import Outcome


class Leases(StoreBase):
    """The holder side of a row: claim, heartbeat, finish, retry, release."""

    @retried
    def claim(self, now: float, lease_seconds: int, owner: str, limit: int = 1) -> list[Claimed]:
        """Lease up to `limit` due rows, oldest first; one winner per row across all hosts."""
        return self.backend.finish_and_claim([], now, lease_seconds, owner, limit)[1]

    @retried
    def finish_and_claim(self, finished: Sequence[Advance], now: float, lease_seconds: int,
                         owner: str, limit: int) -> tuple[set[str], list[Claimed]]:
        """advance() and claim() in one transaction: the worker's hot path.

        Returns the preempted keys of `finished` and the newly claimed rows.
        """
        finished, pauses = _split_pauses(finished)
        paused_lost = self.pause_exhausted(pauses) if pauses else set()
        lost, claimed = self.backend.finish_and_claim(finished, now, lease_seconds, owner,
                                                      limit)
        return lost | paused_lost, claimed

    def restrict_types(self, exact: Sequence[str], patterns: Sequence[str],
                       routed: Callable[[str], bool]) -> None:
        """Claim, and look for, only occurrences of types this process routes: `exact`
        names or `patterns` (Python regular expressions searched in the type, as routes'
        /re/ are), `routed` being the exact predicate.  Set once, by a worker, before its
        first claim (see Backend.restrict_types)."""
        self.backend.restrict_types(exact, patterns, routed)

    @retried
    def warm_up(self) -> None:
        """Run the hot path once on nothing, so it is ready before the first burst."""
        self.backend.warm_up()

    @retried
    def earliest_due(self) -> int | None:
        """Smallest next_run_time of an unpaused routed row: one index probe."""
        return self.backend.earliest_due()

    @retried
    def heartbeat(self, held: Sequence[tuple[str, int]], lease_until: int) -> set[str]:
        """Extend leases; returns the keys whose lease was lost."""
        if not held:
            return set()
        t = self.t
        lost: set[str] = set()
        with self._tx() as conn:
            for key, fence in sorted(held):  # one lock order with the finishes (by key)
                res = conn.execute(t.update().where(t.c.key == key, t.c.fence == fence)
                                   .values(next_run_time=lease_until))
                if res.rowcount == 0:
                    lost.add(key)
        return lost

    @retried
    def advance(self, items: Sequence[Advance]) -> set[str]:
        """Finish occurrences (move to the next time, or delete one-offs).

        Returns the keys that were preempted (nothing written for them).
        """
        if not items:
            return set()
        items, pauses = _split_pauses(items)
        lost = self.pause_exhausted(pauses) if pauses else set()
        if not items:
            return lost
        return lost | self.backend.finish_and_claim(items, 0, 0, "", 0)[0]

    @retried
    def retarget(self, key: str, fence: int, next_time: int) -> bool:
        """The lease holder runs a later occurrence than it claimed (misfire `latest`):
        the row says which, so a worker that dies running it leaves that one to redo.
        Fenced; the lease is kept.  False when the lease was lost."""
        t = self.t
        with self._tx() as conn:
            return conn.execute(t.update().where(t.c.key == key, t.c.fence == fence)
                                .values(next_time=next_time)).rowcount == 1

    @retried
    def pause_exhausted(self, items: Sequence[Advance]) -> set[str]:
        """Pause schedules that have no next occurrence, with the reason, ending their
        leases (fenced like any holder-side write); returns the keys that were preempted."""
        t = self.t
        lost: set[str] = set()
        with self._tx() as conn:
            for a in items:
                done = conn.execute(
                    t.update().where(t.c.key == a.key, t.c.fence == a.fence)
                    .values(paused=1, paused_reason=(a.pause_reason or "")[:PAUSED_REASON_MAX],
                            owner=None, claimed_at=None, attempt=0, fence=t.c.fence + 1))
                if done.rowcount != 1:
                    lost.add(a.key)
        return lost

    @retried
    def wake(self, key: str, fence: int, now: int) -> bool:
        """Make an unheld row that waits (given back to wait for its group) due at
        `now`; fenced on the fence the caller read, so a row claimed or changed meanwhile
        is left alone.  Whether it was woken."""
        t = self.t
        with self._tx() as conn:
            return conn.execute(t.update().where(
                t.c.key == key, t.c.fence == fence, t.c.owner.is_(None),
                t.c.next_run_time > now).values(next_run_time=now)).rowcount == 1

    @retried
    def reschedule(self, key: str, fence: int, run_at: int, *, count_attempt: bool) -> bool:
        """Give the occurrence back to run again at `run_at` (retry, release, SCHED_LATER)."""
        t = self.t
        values: dict[str, Any] = {"next_run_time": run_at, "owner": None, "claimed_at": None,
                                  "fence": t.c.fence + 1}
        if not count_attempt:
            values["attempt"] = t.c.attempt - 1
        with self._tx() as conn:
            res = conn.execute(t.update().where(t.c.key == key, t.c.fence == fence)
                               .values(**values))
        return res.rowcount > 0

    @retried
    def release_owner(self, owner: str, now: int) -> int:
        """Hand back every lease of a dead/stopping process at once."""
        t = self.t
        with self._tx() as conn:
            return conn.execute(t.update().where(t.c.owner == owner).values(
                next_run_time=now, owner=None, claimed_at=None, fence=t.c.fence + 1,
                attempt=t.c.attempt - 1)).rowcount

    @retried
    def reclaim_owner(self, owner: str, now: float, error: str | None = None
                      ) -> list[dict[str, Any]]:
        """A worker died and its runs were killed: record each attempt it held as `lost`
        (`error`: what happened to it) and give the occurrences back to run now; the
        attempt counts.  One transaction.  The history rows written, each with the
        schedule's stored `policy` text and `creator` beside them (not columns: who is
        notified, in whose turn)."""
        t = self.t
        with self._tx() as conn:
            held = conn.execute(sa.select(t.c.key, t.c.type, t.c.next_time, t.c.attempt,
                                          t.c.claimed_at, t.c.fence, t.c.policy,
                                          t.c.creator)
                                .where(t.c.owner == owner)).all()
            if not held:
                return []
            # No duration: when the run ended inside the dead worker is unknown.
            rows = [history_row(key=r.key, type=r.type, scheduled_time=r.next_time,
                                attempt=r.attempt, started_at=r.claimed_at or now,
                                finished_at=now, outcome=Outcome.LOST, worker=owner,
                                error=error or f"worker {owner} died")
                    for r in held]
            conn.execute(self.h.insert(), rows)
            stmt = t.update().where(t.c.key == sa.bindparam("k"),
                                    t.c.fence == sa.bindparam("f")).values(
                next_run_time=int(now), owner=None, claimed_at=None, fence=t.c.fence + 1)
            conn.execute(stmt, [{"k": r.key, "f": r.fence} for r in held])
        return [{**row, "policy": r.policy, "creator": r.creator}
                for row, r in zip(rows, held, strict=True)]


def _split_pauses(items: Sequence[Advance]) -> tuple[Sequence[Advance], list[Advance]]:
    """(advances, pauses): the rare exhausted schedules apart from the hot path."""
    pauses = [a for a in items if a.pause_reason is not None]
    if not pauses:
        return items, pauses
    return [a for a in items if a.pause_reason is None], pauses
